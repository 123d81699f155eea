//! A route's request rate limit (`rate_limit`), as nginx's `limit_req`
//! with `nodelay` and Envoy's local rate limit: a steady rate, a burst
//! on top, and requests beyond them answered 429 at once rather than
//! queued.
//!
//! Each key (the client, a header's value, or the whole route) is one
//! GCRA cell: the time its next request is due, a single number, moved
//! on by one emission interval per request taken. That is a token
//! bucket refilled continuously, with nothing to refill: a route-wide
//! limit is one atomic, a keyed one a small map, sharded so the workers
//! seldom meet on one lock.
//!
//! Not `governor`: the same GCRA, but its keyed store (a DashMap) grows by
//! every client until `retain_recent` is called from a timer, where this
//! table is bounded ([`MAX_KEYS`]) and forgets full keys as it fills.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

pub use portcullis_config::LimitKey;
use portcullis_config::RateLimitSpec;
use portcullis_net::request_key::ip_key;

/// Shards of a keyed limit's table.
const SHARDS: usize = 16;

/// A route's limit and the state of its keys.
pub struct RateLimit {
    /// Nanoseconds between requests at the steady rate.
    interval: u64,
    /// How far ahead of now a key's next due time may run: `burst`
    /// intervals.
    tolerance: u64,
    /// What is counted.
    pub key: LimitKey,
    /// The keys' due times, for a keyed limit, by hash.
    table: Option<Table>,
    /// The due time, for a route-wide limit.
    whole: AtomicU64,
    /// Time zero of the due times.
    epoch: Instant,
    /// The rate as written, for `/status`.
    pub described: String,
    /// For a limit shared across replicas (`shared: true`), the prefix of
    /// its cells' keys in the state store: the route and the limit, so a
    /// changed limit starts afresh as a local one does.
    pub shared: Option<Vec<u8>>,
}

/// A keyed limit's map: key hash to due time. The keys are already
/// SipHash outputs (keyed per process, so not chosen by a client), and
/// hashing them again cost ~180 instructions a request.
type Keys = HashMap<u64, u64, std::hash::BuildHasherDefault<Prehashed>>;

/// The hasher of [`Keys`]: the key is its own hash.
#[derive(Default)]
struct Prehashed(u64);

impl std::hash::Hasher for Prehashed {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are hashed here; fold anything else in anyway.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*b);
        }
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

struct Table {
    shards: Vec<Mutex<Keys>>,
    /// Keys a shard holds before it drops those whose due time has
    /// passed (they are as good as new).
    per_shard: usize,
    hasher: std::collections::hash_map::RandomState,
}

impl std::fmt::Debug for RateLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RateLimit")
            .field("rate", &self.described)
            .field("key", &self.key)
            .finish_non_exhaustive()
    }
}

/// The most keys a keyed limit tracks (about 3 MiB); past it, keys
/// whose allowance is full again are forgotten first.
pub const MAX_KEYS: usize = 100_000;

impl RateLimit {
    /// A fresh limit as route `route`'s policy states it.
    pub fn from_spec(route: &str, spec: &RateLimitSpec) -> Self {
        let key = spec.key.clone();
        let mut limit = RateLimit::new(
            spec.count,
            spec.period,
            spec.burst,
            key,
            spec.described.clone(),
        );
        if spec.shared {
            let prefix = format!(
                "portcullis:rate:{route}:{}/{}:{}:",
                spec.described, spec.burst, limit.interval
            );
            limit.shared = Some(prefix.into_bytes());
        }
        limit
    }

    /// What a request is counted by (see [`LimitKey`]), from the
    /// connection's peer address, whether its forwarding headers are
    /// trusted, and its headers; `buf` holds an address key.
    pub fn key_of<'a>(
        &self,
        (peer, trust_forwarded): (IpAddr, bool),
        headers: &'a http::HeaderMap,
        buf: &'a mut [u8; 16],
    ) -> Option<&'a [u8]> {
        match &self.key {
            LimitKey::Route => None,
            LimitKey::Header(name) => Some(headers.get(name).map_or(&[][..], |v| v.as_bytes())),
            LimitKey::Client => {
                let client = portcullis_net::client_addr::client_of(peer, trust_forwarded, headers);
                Some(ip_key(client, buf))
            }
        }
    }

    /// The steady interval between requests and the burst's tolerance.
    pub fn steps(&self) -> (Duration, Duration) {
        (
            Duration::from_nanos(self.interval),
            Duration::from_nanos(self.tolerance),
        )
    }

    /// `count` requests per `period`, `burst` more at once, per `key`.
    pub fn new(count: u32, period: Duration, burst: u32, key: LimitKey, described: String) -> Self {
        let interval = (period.as_nanos() / u128::from(count.max(1))).max(1) as u64;
        let table = (key != LimitKey::Route).then(|| Table {
            shards: (0..SHARDS).map(|_| Mutex::new(Keys::default())).collect(),
            per_shard: MAX_KEYS / SHARDS,
            hasher: Default::default(),
        });
        RateLimit {
            interval,
            tolerance: interval.saturating_mul(u64::from(burst)),
            key,
            table,
            whole: AtomicU64::new(0),
            epoch: Instant::now(),
            described,
            shared: None,
        }
    }

    /// Takes one request for `key` (see [`LimitKey`]; ignored for a
    /// route-wide limit): `Ok` when it may pass, or how long until one
    /// would.
    pub fn take(&self, key: Option<&[u8]>) -> Result<(), Duration> {
        let now = self.epoch.elapsed().as_nanos() as u64;
        match &self.table {
            None => {
                let mut due = self.whole.load(Ordering::Relaxed);
                loop {
                    let next = self.next_due(due, now)?;
                    match self.whole.compare_exchange_weak(
                        due,
                        next,
                        Ordering::Relaxed,
                        Ordering::Relaxed,
                    ) {
                        Ok(_) => return Ok(()),
                        Err(actual) => due = actual,
                    }
                }
            }
            Some(table) => {
                let hash = table.hasher.hash_one(key.unwrap_or_default());
                // Middle bits: the map places a key by its low bits and
                // tags it with its top 7, which should vary within a shard.
                let shard = &table.shards[((hash >> 32) as usize) % SHARDS];
                let mut keys = shard.lock().unwrap_or_else(|p| p.into_inner());
                let due = keys.get(&hash).copied().unwrap_or(0);
                let next = self.next_due(due, now)?;
                if keys.len() >= table.per_shard && !keys.contains_key(&hash) {
                    forget(&mut keys, now, table.per_shard);
                }
                keys.insert(hash, next);
                Ok(())
            }
        }
    }

    /// The next due time after taking a request at `now` from a key due
    /// at `due`, or the wait when it may not take one.
    fn next_due(&self, due: u64, now: u64) -> Result<u64, Duration> {
        let due = due.max(now);
        if due - now > self.tolerance {
            return Err(Duration::from_nanos(due - now - self.tolerance));
        }
        Ok(due + self.interval)
    }
}

/// A route's limit as `/status` shows it: rate, burst and key as written.
pub fn describe(spec: &RateLimitSpec) -> serde_json::Value {
    let key = match &spec.key {
        LimitKey::Client => "client".to_owned(),
        LimitKey::Route => "route".to_owned(),
        LimitKey::Header(name) => format!("header:{name}"),
    };
    serde_json::json!({
        "rate": spec.described,
        "burst": spec.burst,
        "key": key,
        "shared": spec.shared,
    })
}

/// Makes room in a full shard. Keys whose due time has passed are back
/// to a whole allowance, the same as absent, and go first. If none has,
/// the eighth nearest to a whole allowance go, as nginx drops its least
/// recently used states: the memory stays bounded when addresses are
/// sprayed, at the price of those keys starting over.
fn forget(keys: &mut Keys, now: u64, room: usize) {
    keys.retain(|_, due| *due > now);
    let size = keys.len();
    if size < room {
        return;
    }
    let mut dues: Vec<u64> = keys.values().copied().collect();
    let (_, threshold, _) = dues.select_nth_unstable(size / 8);
    let threshold = *threshold;
    keys.retain(|_, due| *due > threshold);
}

/// Sets `Retry-After` to `wait` in whole seconds, rounded up (at least 1).
pub fn retry_after(headers: &mut http::HeaderMap, wait: Duration) {
    let seconds = wait.as_secs() + u64::from(wait.subsec_nanos() > 0);
    headers.insert(
        http::header::RETRY_AFTER,
        http::HeaderValue::from(seconds.max(1)),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(count: u32, period_s: u64, burst: u32, key: LimitKey) -> RateLimit {
        RateLimit::new(
            count,
            Duration::from_secs(period_s),
            burst,
            key,
            String::new(),
        )
    }

    #[test]
    fn a_burst_then_the_steady_rate() {
        // 2 a second, 3 more at once: 4 pass at once (as nginx's
        // `burst=3 nodelay`), then one every 500 ms.
        let l = limit(2, 1, 3, LimitKey::Route);
        let (mut due, at) = (0, 1_000_000_000);
        for _ in 0..4 {
            due = l.next_due(due, at).unwrap();
        }
        let wait = l.next_due(due, at).unwrap_err();
        assert_eq!(wait, Duration::from_millis(500));
        // Half a second on, one more fits, and only one.
        let later = at + 500_000_000;
        due = l.next_due(due, later).unwrap();
        assert!(l.next_due(due, later).is_err());
        // A quiet key is back to its whole burst, no more.
        let quiet = later + 10_000_000_000;
        let mut fresh = due;
        for _ in 0..4 {
            fresh = l.next_due(fresh, quiet).unwrap();
        }
        assert!(l.next_due(fresh, quiet).is_err());
    }

    #[test]
    fn keys_are_counted_apart_and_the_route_together() {
        let keyed = limit(1, 3600, 1, LimitKey::Client);
        let mut buf = [0; 16];
        let a = ip_key("10.0.0.1".parse().unwrap(), &mut buf).to_vec();
        assert!(keyed.take(Some(&a)).is_ok());
        assert!(keyed.take(Some(&a)).is_ok());
        let wait = keyed.take(Some(&a)).unwrap_err();
        assert!(wait > Duration::from_secs(3590), "{wait:?}");
        // Another client has its own allowance; an IPv4-mapped address is
        // the same client as its IPv4 form.
        assert!(keyed.take(Some(b"\x0a\x00\x00\x02")).is_ok());
        let mapped: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        assert!(keyed.take(Some(ip_key(mapped, &mut buf))).is_err());

        let whole = limit(1, 3600, 1, LimitKey::Route);
        assert!(whole.take(Some(b"a")).is_ok());
        assert!(whole.take(Some(b"b")).is_ok());
        assert!(whole.take(Some(b"c")).is_err());
    }

    #[test]
    fn a_full_table_forgets_the_keys_nearest_a_whole_allowance() {
        let keyed = limit(1, 3600, 0, LimitKey::Client);
        // Every key limited for an hour: the table cannot just drop the
        // expired ones, and must not grow without bound either.
        let keys = MAX_KEYS as u32 * 2;
        for i in 0..keys {
            assert!(keyed.take(Some(&i.to_be_bytes())).is_ok());
        }
        let table = keyed.table.as_ref().unwrap();
        let held: usize = table.shards.iter().map(|s| s.lock().unwrap().len()).sum();
        assert!(held <= MAX_KEYS, "{held} keys held");
        // The first keys (due soonest) were forgotten; the latest are
        // still limited.
        assert!(keyed.take(Some(&0u32.to_be_bytes())).is_ok());
        assert!(keyed.take(Some(&(keys - 1).to_be_bytes())).is_err());
    }
}
