//! Tokens verified recently, by their exact text.
//!
//! A client sends the same token with every request for the token's
//! lifetime, and checking it again costs a signature verification and two
//! JSON parses (HS256: ~3.4 us of the 3.8 us a call took; RS256 and ES256
//! far more). A token byte-identical to one that passed carries the same
//! signature over the same claims, checked against the same config (an
//! instance's config never changes), so only what depends on the time —
//! `exp` and `nbf` — is checked again on a hit. Refused tokens are never
//! kept: anyone can make those, so they could only flood the cache.
//! Envoy's `jwt_authn` caches the same way (`jwt_cache_config`).
//!
//! A hit must cost little next to the call itself, and the guest runs as
//! Cranelift code without SIMD: std's SipHash over a ~150-byte token and
//! memcmp's byte loop took ~0.25 us of a 0.8 us call. The digest reads only
//! the signature's end, and the compare goes a word at a time (~0.05 us). A
//! weak digest is safe in this table: only verified tokens are inserted, so
//! no client chooses the keys, and every hit compares the whole text, so a
//! token that shares a digest with a verified one is a miss (and two that
//! share one displace each other).

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use portcullis_sdk::HeaderEdits;

use crate::Refusal;

/// What a verified token decided, minus the time checks.
#[derive(Clone)]
pub struct Verified {
    /// `exp`, if the token has one.
    pub exp: Option<u64>,
    /// `nbf`, if the token has one.
    pub nbf: Option<u64>,
    /// The header edits its claims make.
    pub edits: HeaderEdits,
}

impl Verified {
    /// The time checks of [`crate::verify`], at `now` (seconds).
    pub fn check_time(&self, now: u64, leeway: u64) -> Result<(), Refusal> {
        if self.exp.is_some_and(|exp| now > exp.saturating_add(leeway)) {
            return Err(Refusal::Expired);
        }
        if self.nbf.is_some_and(|nbf| now.saturating_add(leeway) < nbf) {
            return Err(Refusal::NotYetValid);
        }
        Ok(())
    }
}

/// At most `capacity` verified tokens.
pub struct TokenCache {
    capacity: usize,
    /// By [`digest`] of the token; the token's text is kept beside.
    entries: HashMap<u64, (Box<[u8]>, Verified), BuildHasherDefault<Digested>>,
}

impl TokenCache {
    /// An empty cache; a capacity of 0 keeps nothing.
    pub fn new(capacity: usize) -> TokenCache {
        TokenCache {
            capacity,
            entries: HashMap::default(),
        }
    }

    /// The decision for `token` at `now` if it was verified before: its
    /// edits, or the time check it now fails (and it is dropped).
    pub fn get(
        &mut self,
        token: &[u8],
        now: u64,
        leeway: u64,
    ) -> Option<Result<HeaderEdits, Refusal>> {
        let key = digest(token);
        let (text, hit) = self.entries.get(&key)?;
        if !same(text, token) {
            return None;
        }
        match hit.check_time(now, leeway) {
            Ok(()) => Some(Ok(copy(&hit.edits))),
            Err(Refusal::Expired) => {
                // Never valid again.
                self.entries.remove(&key);
                Some(Err(Refusal::Expired))
            }
            Err(why) => Some(Err(why)),
        }
    }

    /// Keeps `token`, which just passed every check at `now`. When full,
    /// expired tokens go first, then an arbitrary one.
    pub fn insert(&mut self, token: &[u8], verified: Verified, now: u64, leeway: u64) {
        if self.capacity == 0 {
            return;
        }
        if self.entries.len() >= self.capacity {
            self.entries
                .retain(|_, (_, v)| v.check_time(now, leeway) != Err(Refusal::Expired));
        }
        if self.entries.len() >= self.capacity
            && let Some(&victim) = self.entries.keys().next()
        {
            self.entries.remove(&victim);
        }
        self.entries.insert(digest(token), (token.into(), verified));
    }

    /// How many tokens it holds.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }
}

/// Edits to hand out for a hit: a copy, except that no edits (the usual
/// case: no `claims_to_headers`) are made anew rather than cloned, which
/// costs three calls into `Vec::clone` in the guest.
fn copy(edits: &HeaderEdits) -> HeaderEdits {
    if edits.remove.is_empty() && edits.set.is_empty() && edits.add.is_empty() {
        portcullis_sdk::no_edits()
    } else {
        edits.clone()
    }
}

/// How many bytes at the end of a token [`digest`] reads.
const DIGESTED: usize = 24;

/// A 64-bit digest of `token`: its length and its last 24 bytes, which in
/// a token that was verified are base64 of its signature, as good as
/// random. The rest of the text need not be read: two verified tokens
/// that differ anywhere differ in their signatures, and a hit still
/// compares the whole text. (Multiply-rotate, as FxHash, with a final mix
/// so the table's low and high bits both vary.)
fn digest(token: &[u8]) -> u64 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let tail = &token[token.len().saturating_sub(DIGESTED)..];
    let mut h = token.len() as u64;
    let mut words = tail.chunks_exact(8);
    for w in &mut words {
        h = (h ^ word(w)).wrapping_mul(K).rotate_left(29);
    }
    h = (h ^ padded(words.remainder())).wrapping_mul(K);
    h ^ (h >> 32)
}

/// `a == b`, four words at a time (the guest's `memcmp` goes byte by byte,
/// and every turn of a loop in the guest also checks the deadline).
fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let differ = |p: &[u8], q: &[u8], at: usize| word(&p[at..at + 8]) ^ word(&q[at..at + 8]);
    let (x, y) = (a.chunks_exact(32), b.chunks_exact(32));
    let (rx, ry) = (x.remainder(), y.remainder());
    let blocks = x.zip(y).all(|(p, q)| {
        (differ(p, q, 0) | differ(p, q, 8) | differ(p, q, 16) | differ(p, q, 24)) == 0
    });
    // What is left: whole words, then the last word, overlapping them (or
    // the whole text, when shorter than a word).
    let (wx, wy) = (rx.chunks_exact(8), ry.chunks_exact(8));
    let last = |t: &[u8]| match t.len() {
        8.. => word(&t[t.len() - 8..]),
        _ => padded(t),
    };
    blocks && last(a) == last(b) && wx.zip(wy).all(|(p, q)| word(p) == word(q))
}

fn word(eight: &[u8]) -> u64 {
    u64::from_le_bytes(eight.try_into().expect("chunks of eight"))
}

/// Up to seven bytes as a word, zero-padded; byte by byte, since a copy
/// of a length known only at run time is a call out of the guest.
fn padded(short: &[u8]) -> u64 {
    short.iter().rev().fold(0, |w, &b| (w << 8) | u64::from(b))
}

/// The table's hasher: its keys are digests already.
#[derive(Default)]
pub struct Digested(u64);

impl Hasher for Digested {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys reach here (write_u64); kept total anyway.
        self.0 = digest(bytes);
    }

    fn write_u64(&mut self, digest: u64) {
        self.0 = digest;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verified(exp: Option<u64>, nbf: Option<u64>, sub: &str) -> Verified {
        Verified {
            exp,
            nbf,
            edits: HeaderEdits {
                remove: vec!["x-user".into()],
                set: vec![portcullis_sdk::header("x-user", sub)],
                add: Vec::new(),
            },
        }
    }

    #[test]
    fn a_hit_gives_the_edits_until_the_token_expires() {
        let mut cache = TokenCache::new(8);
        assert!(cache.get(b"t1", 1000, 30).is_none());
        cache.insert(b"t1", verified(Some(2000), None, "alice"), 1000, 30);
        let edits = cache.get(b"t1", 1500, 30).unwrap().unwrap();
        assert_eq!(edits.set[0].value, b"alice");
        // Within the leeway, still good; past it, refused and dropped.
        assert!(cache.get(b"t1", 2030, 30).unwrap().is_ok());
        assert_eq!(
            cache.get(b"t1", 2031, 30).unwrap().unwrap_err(),
            Refusal::Expired
        );
        assert!(cache.get(b"t1", 1500, 30).is_none());
        // Another token (one character off) is a miss, not a hit.
        cache.insert(b"t2", verified(None, None, "bob"), 1000, 30);
        assert!(cache.get(b"t2x", 1000, 30).is_none());
        assert!(cache.get(b"t", 1000, 30).is_none());
    }

    #[test]
    fn a_long_token_one_byte_off_anywhere_is_a_miss() {
        // The word-wise compare and digest, on a token of a realistic
        // length that is not a multiple of eight.
        let token: Vec<u8> = (0..155u8).map(|i| b'A' + i % 58).collect();
        let mut cache = TokenCache::new(8);
        cache.insert(&token, verified(None, None, "alice"), 0, 0);
        assert!(cache.get(&token, 0, 0).unwrap().is_ok());
        for at in 0..token.len() {
            let mut off = token.clone();
            off[at] ^= 1;
            assert!(
                cache.get(&off, 0, 0).is_none(),
                "byte {at} changed, still a hit"
            );
        }
        assert!(cache.get(&token[..154], 0, 0).is_none());
        assert!(
            cache
                .get(&[token.as_slice(), b"A"].concat(), 0, 0)
                .is_none()
        );
        assert!(same(&token, &token.clone()));
        assert!(!same(b"abcdefgh1", b"abcdefgh2"));
    }

    #[test]
    fn the_compare_sees_every_byte_at_every_length() {
        // Lengths around the block (32) and word (8) boundaries, where the
        // blocks, the whole words and the overlapping last word meet.
        for len in 0..100usize {
            let text: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
            assert!(same(&text, &text.clone()), "length {len}");
            for at in 0..len {
                let mut off = text.clone();
                off[at] ^= 0x20;
                assert!(!same(&text, &off), "length {len}, byte {at}");
            }
            let mut cache = TokenCache::new(4);
            cache.insert(&text, verified(None, None, "x"), 0, 0);
            assert!(cache.get(&text, 0, 0).unwrap().is_ok(), "length {len}");
        }
    }

    #[test]
    fn not_yet_valid_stays_cached_until_it_is() {
        let mut cache = TokenCache::new(8);
        cache.insert(b"t", verified(None, Some(1000), "a"), 1000, 0);
        assert_eq!(
            cache.get(b"t", 900, 0).unwrap().unwrap_err(),
            Refusal::NotYetValid
        );
        assert!(cache.get(b"t", 1000, 0).unwrap().is_ok());
    }

    #[test]
    fn it_stays_within_its_capacity_dropping_expired_tokens_first() {
        let mut cache = TokenCache::new(3);
        cache.insert(b"old", verified(Some(100), None, "o"), 50, 0);
        cache.insert(b"a", verified(Some(9000), None, "a"), 50, 0);
        cache.insert(b"b", verified(Some(9000), None, "b"), 50, 0);
        // Full: the expired one makes room, the live ones stay.
        cache.insert(b"c", verified(Some(9000), None, "c"), 500, 0);
        assert_eq!(cache.len(), 3);
        for t in ["a", "b", "c"] {
            assert!(
                cache.get(t.as_bytes(), 500, 0).unwrap().is_ok(),
                "{t} was dropped"
            );
        }
        // Full of live tokens: one goes, the new one is kept.
        cache.insert(b"d", verified(Some(9000), None, "d"), 500, 0);
        assert_eq!(cache.len(), 3);
        assert!(cache.get(b"d", 500, 0).unwrap().is_ok());

        let mut off = TokenCache::new(0);
        off.insert(b"a", verified(None, None, "a"), 0, 0);
        assert!(off.get(b"a", 0, 0).is_none());
    }
}
