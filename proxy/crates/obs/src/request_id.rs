//! Request ids (`X-Request-Id`), one per request from the edge to the
//! upstream: the tunnel server gives each public request one, and the
//! routing core keeps the one a request brings (from the tunnel server,
//! or an ingress controller: ingress-nginx sets this header by default)
//! or, on a listener told to, makes one when it brings none. The id goes
//! to the upstream, into the access line and the forwarding warnings, and
//! a made one back to the client on the response, so one request can be
//! followed through every log it crossed, and a user reporting an error
//! can quote it.

use std::cell::Cell;
use std::hash::{BuildHasher, Hasher};

use http::HeaderMap;
use http::header::{HeaderName, HeaderValue};

/// The header the id travels in.
pub const HEADER: HeaderName = HeaderName::from_static("x-request-id");

/// The longest id kept from a request; a longer one is replaced.
const MAX_KEPT: usize = 128;

pub use portcullis_config::RequestIds;

/// The request's id: the one `headers` bring when it is usable (1 to 128
/// visible ASCII characters), else a new one, set in `headers`.
pub fn ensure(headers: &mut HeaderMap) -> HeaderValue {
    // One hash of the name, whether the id is there or not.
    match headers.entry(HEADER) {
        http::header::Entry::Occupied(mut found) => {
            if !usable(found.get()) {
                found.insert(generate());
            }
            found.get().clone()
        }
        http::header::Entry::Vacant(slot) => slot.insert(generate()).clone(),
    }
}

/// Sets `id` on a response that does not name one of its own (an
/// upstream's own id is left as it is).
pub fn answer_with(headers: &mut HeaderMap, id: HeaderValue) {
    if let http::header::Entry::Vacant(slot) = headers.entry(HEADER) {
        slot.insert(id);
    }
}

/// The id as text for a log line (`-` without one).
pub fn text(id: Option<&HeaderValue>) -> &str {
    id.and_then(|v| v.to_str().ok()).unwrap_or("-")
}

fn usable(id: &HeaderValue) -> bool {
    let bytes = id.as_bytes();
    (1..=MAX_KEPT).contains(&bytes.len()) && bytes.iter().all(|b| (0x21..=0x7e).contains(b))
}

/// 128 random bits as 32 lower-case hex digits (the shape of
/// ingress-nginx's `$request_id`). Not a secret, only unique: a
/// per-thread generator seeded from the process's random keys, with no
/// lock and no system call per id.
pub fn generate() -> HeaderValue {
    /// Ids made at once per thread: one allocation (and one free, once
    /// all of them are dropped) for this many ids instead of one each.
    const BATCH: usize = 128;
    thread_local! {
        static MADE: std::cell::RefCell<(bytes::Bytes, usize)> =
            const { std::cell::RefCell::new((bytes::Bytes::new(), 0)) };
    }
    MADE.with_borrow_mut(|(ids, next)| {
        if *next == ids.len() {
            let mut text = vec![0u8; BATCH * 32];
            for id in text.chunks_exact_mut(16) {
                hex_into(random_u64(), id);
            }
            *ids = bytes::Bytes::from(text);
            *next = 0;
        }
        let id = ids.slice(*next..*next + 32);
        *next += 32;
        // A slice of the batch, shared: no copy.
        HeaderValue::from_maybe_shared(id).expect("hex digits make a header value")
    })
}

/// 64 random bits from this thread's generator (ids, not secrets).
pub fn random_u64() -> u64 {
    thread_local! {
        static STATE: Cell<u64> = Cell::new(seed());
    }
    STATE.with(wyrand)
}

/// `n` as 16 lower-case hex digits into `out`, a byte (two digits) a
/// turn from a table: a quarter of the instructions of a nibble a turn.
pub fn hex_into(n: u64, out: &mut [u8]) {
    const PAIRS: [[u8; 2]; 256] = {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut pairs = [[0u8; 2]; 256];
        let mut i = 0;
        while i < 256 {
            pairs[i] = [DIGITS[i >> 4], DIGITS[i & 0xf]];
            i += 1;
        }
        pairs
    };
    for (pair, byte) in out.chunks_exact_mut(2).zip(n.to_be_bytes()) {
        pair.copy_from_slice(&PAIRS[usize::from(byte)]);
    }
}

fn seed() -> u64 {
    // RandomState's keys come from the OS once per process, and differ
    // per thread by a counter.
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    );
    hasher.finish()
}

/// wyrand: one multiply per 64 bits, passes BigCrush.
fn wyrand(state: &Cell<u64>) -> u64 {
    let s = state.get().wrapping_add(0xa076_1d64_78bd_642f);
    state.set(s);
    let t = u128::from(s) * u128::from(s ^ 0xe703_7ed1_a0b4_28db);
    ((t >> 64) as u64) ^ (t as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_usable_id_is_kept_and_others_replaced() {
        let mut headers = HeaderMap::new();
        headers.insert(HEADER, HeaderValue::from_static("abc-123"));
        assert_eq!(ensure(&mut headers), "abc-123");
        assert_eq!(headers[HEADER], "abc-123");
        for bad in [String::new(), "x".repeat(129), "has space".into()] {
            let mut headers = HeaderMap::new();
            headers.insert(HEADER, HeaderValue::from_str(&bad).unwrap());
            let id = ensure(&mut headers);
            assert_eq!(id.len(), 32, "{bad:?} replaced");
            assert_eq!(headers[HEADER], id);
        }
        let mut headers = HeaderMap::new();
        let id = ensure(&mut headers);
        assert_eq!(headers[HEADER], id);
    }

    #[test]
    fn new_ids_are_hex_and_differ() {
        let ids: std::collections::HashSet<_> = (0..1000).map(|_| generate()).collect();
        assert_eq!(ids.len(), 1000);
        for id in &ids {
            assert!(
                id.as_bytes()
                    .iter()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(b)),
                "{id:?}"
            );
        }
    }

    #[test]
    fn a_response_keeps_its_own_id() {
        let mut headers = HeaderMap::new();
        headers.insert(HEADER, HeaderValue::from_static("upstream-own"));
        answer_with(&mut headers, HeaderValue::from_static("ours"));
        assert_eq!(headers[HEADER], "upstream-own");
        let mut headers = HeaderMap::new();
        answer_with(&mut headers, HeaderValue::from_static("ours"));
        assert_eq!(headers[HEADER], "ours");
    }
}
