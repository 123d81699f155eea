//! Introspection answers kept until they expire, by the SHA-256 of their
//! token: the token itself is never kept, so a dump of the plugin's memory
//! holds no usable credential. A client sends the same token with every
//! request, and an answer costs a round trip to the authorization server.

use std::collections::HashMap;

use portcullis_sdk::HeaderEdits;
use sha2::{Digest, Sha256};

use crate::answer::Refusal;

/// A token's digest.
pub type Key = [u8; 32];

/// The key of `token`.
pub fn key(token: &[u8]) -> Key {
    Sha256::digest(token).into()
}

/// At most `capacity` answers.
pub struct AnswerCache {
    capacity: usize,
    entries: HashMap<Key, (u64, Result<HeaderEdits, Refusal>)>,
}

impl AnswerCache {
    /// An empty cache; a capacity of 0 keeps nothing.
    pub fn new(capacity: usize) -> AnswerCache {
        AnswerCache {
            capacity,
            entries: HashMap::new(),
        }
    }

    /// What was decided for `key`, if it still holds at `now` (seconds).
    pub fn get(&mut self, key: &Key, now: u64) -> Option<Result<HeaderEdits, Refusal>> {
        match self.entries.get(key) {
            Some((until, outcome)) if now < *until => Some(outcome.clone()),
            Some(_) => {
                self.entries.remove(key);
                None
            }
            None => None,
        }
    }

    /// Keeps `outcome` for `key` until `until` (seconds); full, it drops
    /// the expired answers first, then any one.
    pub fn insert(
        &mut self,
        key: Key,
        until: u64,
        outcome: Result<HeaderEdits, Refusal>,
        now: u64,
    ) {
        if self.capacity == 0 || until <= now {
            return;
        }
        if self.entries.len() >= self.capacity && !self.entries.contains_key(&key) {
            self.entries.retain(|_, (u, _)| now < *u);
            if self.entries.len() >= self.capacity
                && let Some(any) = self.entries.keys().next().copied()
            {
                self.entries.remove(&any);
            }
        }
        self.entries.insert(key, (until, outcome));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_answer_holds_until_its_time_and_no_longer() {
        let mut c = AnswerCache::new(2);
        let k = key(b"token-a");
        c.insert(k, 100, Ok(portcullis_sdk::no_edits()), 50);
        assert!(c.get(&k, 99).is_some_and(|o| o.is_ok()));
        assert!(c.get(&k, 100).is_none(), "expired at its time");
        assert_eq!(c.entries.len(), 0, "and dropped");
        // Already expired, or no room at all: not kept.
        c.insert(k, 50, Ok(portcullis_sdk::no_edits()), 50);
        assert!(c.get(&k, 50).is_none());
        let mut none = AnswerCache::new(0);
        none.insert(k, 100, Ok(portcullis_sdk::no_edits()), 50);
        assert!(none.get(&k, 60).is_none());
    }

    #[test]
    fn a_full_cache_drops_expired_answers_first() {
        let mut c = AnswerCache::new(2);
        let (a, b, d) = (key(b"a"), key(b"b"), key(b"d"));
        c.insert(a, 60, Err(Refusal::Audience), 0);
        c.insert(b, 1000, Ok(portcullis_sdk::no_edits()), 0);
        c.insert(d, 1000, Ok(portcullis_sdk::no_edits()), 70);
        assert_eq!(c.entries.len(), 2);
        assert!(c.get(&b, 70).is_some(), "the live answer stays");
        assert!(c.get(&d, 70).is_some());
        // Full of live answers: one goes, the new one is kept.
        c.insert(a, 1000, Err(Refusal::Issuer), 70);
        assert_eq!(c.entries.len(), 2);
        assert!(matches!(c.get(&a, 70), Some(Err(Refusal::Issuer))));
    }

    #[test]
    fn tokens_are_kept_by_digest_only() {
        assert_ne!(key(b"token-a"), key(b"token-b"));
        assert_eq!(key(b"token-a"), key(b"token-a"));
    }
}
