//! An `auth_request`'s cache of allowing answers: for `ttl`, a request
//! carrying the same key (by default its Cookie and Authorization
//! headers: the session) is let through with the headers the service
//! gave the first time, without asking it again. A UI making dozens of
//! calls a page then costs the auth service one round trip per session
//! and `ttl`, not one per call. Envoy's `ext_authz` has no such cache;
//! with nginx it takes a `proxy_cache` on the auth location.
//!
//! Only allowing (2xx) answers are kept: a refusal is asked again each
//! time, so signing in takes effect at once. What the cache trades is
//! the other way: a session revoked at the service stays allowed here
//! for up to `ttl`. Requests without any key header are never answered
//! from it (anonymous requests are what per-path rules tell apart).

use std::collections::HashMap;
use std::hash::{BuildHasher, Hasher, RandomState};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use http::header::{HeaderName, HeaderValue};
use http::{HeaderMap, Uri};

/// Entries kept at most; when full, the expired go, and if none has,
/// all (a burst of new sessions costs one round trip each again).
const MAX_ENTRIES: usize = 10_000;

/// A key: two independent keyed hashes (128 bits), so that two sessions
/// never share an entry, without keeping cookies in memory.
type Key = (u64, u64);

/// Headers an allowing answer set, and until when they stand.
struct Entry {
    until: Instant,
    copied: Vec<(HeaderName, HeaderValue)>,
}

/// One route's cache (see the module documentation).
pub struct AuthCache {
    ttl: Duration,
    key: Vec<HeaderName>,
    per_uri: bool,
    hashers: (RandomState, RandomState),
    entries: Mutex<HashMap<Key, Entry>>,
}

impl std::fmt::Debug for AuthCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthCache")
            .field("ttl", &self.ttl)
            .field("key", &self.key)
            .field("per_uri", &self.per_uri)
            .finish_non_exhaustive()
    }
}

impl AuthCache {
    /// Keeps allowing answers for `ttl`, keyed by the `key` headers' values
    /// (and the request's path and query, `per_uri`).
    pub fn new(ttl: Duration, key: Vec<HeaderName>, per_uri: bool) -> AuthCache {
        AuthCache {
            ttl,
            key,
            per_uri,
            hashers: (RandomState::new(), RandomState::new()),
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// The key of a request with these (client) headers and URI; `None`
    /// when it has none of the key headers.
    pub fn key_of(&self, headers: &HeaderMap, uri: &Uri) -> Option<Key> {
        let mut hashers = (self.hashers.0.build_hasher(), self.hashers.1.build_hasher());
        let mut write = |bytes: &[u8], end: u8| {
            for h in [&mut hashers.0, &mut hashers.1] {
                h.write(bytes);
                h.write_u8(end);
            }
        };
        let mut any = false;
        for name in &self.key {
            for value in headers.get_all(name) {
                any = true;
                write(value.as_bytes(), 0xff);
            }
            // Where one header's values end: `a` + `b` is not `ab`.
            write(&[], 0xfe);
        }
        if self.per_uri {
            let uri = uri.path_and_query().map_or("/", |p| p.as_str());
            write(uri.as_bytes(), 0xfd);
        }
        any.then(|| (hashers.0.finish(), hashers.1.finish()))
    }

    /// The headers an allowing answer for `key` set, while it stands.
    pub fn get(&self, key: Key) -> Option<Vec<(HeaderName, HeaderValue)>> {
        let entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        let entry = entries.get(&key)?;
        (Instant::now() < entry.until).then(|| entry.copied.clone())
    }

    /// Keeps an allowing answer for `key`, with the headers it set.
    pub fn put(&self, key: Key, copied: Vec<(HeaderName, HeaderValue)>) {
        let now = Instant::now();
        let mut entries = self.entries.lock().unwrap_or_else(|p| p.into_inner());
        if entries.len() >= MAX_ENTRIES && !entries.contains_key(&key) {
            entries.retain(|_, e| e.until > now);
            if entries.len() >= MAX_ENTRIES {
                entries.clear();
            }
        }
        let until = now + self.ttl;
        entries.insert(key, Entry { until, copied });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    #[test]
    fn the_key_is_the_named_headers_and_nothing_else() {
        let cache = AuthCache::new(
            Duration::from_secs(30),
            vec![http::header::COOKIE, http::header::AUTHORIZATION],
            false,
        );
        let uri: Uri = "/a".parse().unwrap();
        let session = headers(&[("cookie", "s=1"), ("x-other", "1")]);
        let same = headers(&[("cookie", "s=1"), ("x-other", "2")]);
        let key = cache.key_of(&session, &uri).unwrap();
        assert_eq!(cache.key_of(&same, &"/b".parse().unwrap()), Some(key));
        assert_ne!(
            cache.key_of(&headers(&[("cookie", "s=2")]), &uri),
            Some(key)
        );
        // The same bytes under another header are another key.
        assert_ne!(
            cache.key_of(&headers(&[("authorization", "s=1")]), &uri),
            Some(key)
        );
        assert_eq!(cache.key_of(&headers(&[("x-other", "1")]), &uri), None);
        // Per URI, the path and query count too.
        let per_uri = AuthCache::new(Duration::from_secs(30), vec![http::header::COOKIE], true);
        assert_ne!(
            per_uri.key_of(&session, &uri),
            per_uri.key_of(&session, &"/a?b".parse().unwrap())
        );
    }

    #[test]
    fn answers_stand_for_their_ttl() {
        let cache = AuthCache::new(Duration::from_millis(50), vec![http::header::COOKIE], false);
        let user = (
            HeaderName::from_static("x-user"),
            HeaderValue::from_static("ann"),
        );
        cache.put((1, 2), vec![user.clone()]);
        assert_eq!(cache.get((1, 2)), Some(vec![user]));
        assert_eq!(cache.get((1, 3)), None);
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(cache.get((1, 2)), None);
    }
}
