//! Header maps emptied for the next upstream response head on the same
//! worker thread.
//!
//! A connection's response head normally reuses the map of the request
//! it answers (`H1Conn::recycle`), and hyper then keeps that map for the
//! client's next request head: one map goes round per request. A route
//! whose plugins read the request head again in their response hooks
//! keeps the request's map until the request ends, so the next response
//! head found no map to reuse and allocated one: with a header-only
//! proxy-wasm filter that cost ~390 instructions a request (allocation,
//! index set-up, free; bench/instructions.sh, `/pw`). Such a map comes
//! back here when its request ends ([`give`]) and the next head takes it
//! ([`take`]).

use std::cell::RefCell;

use http::HeaderMap;

use super::SPARE_HEADERS;

/// Maps kept per thread: enough for the requests a worker ends between
/// two response heads; more are dropped.
const KEPT: usize = 8;

thread_local! {
    static MAPS: RefCell<Vec<HeaderMap>> = const { RefCell::new(Vec::new()) };
}

/// Keeps `map`, emptied, for a response head on this thread; a map grown
/// for an unusual message (or never allocated) is let go.
pub fn give(mut map: HeaderMap) {
    let capacity = map.capacity();
    if capacity == 0 || capacity > SPARE_HEADERS {
        return;
    }
    map.clear();
    // `try_with`: a request ending while its thread exits keeps nothing.
    let _ = MAPS.try_with(|maps| {
        let mut maps = maps.borrow_mut();
        if maps.len() < KEPT {
            maps.push(map);
        }
    });
}

/// A map kept by [`give`] on this thread, or a new empty one.
pub(super) fn take() -> HeaderMap {
    MAPS.try_with(|maps| maps.borrow_mut().pop())
        .ok()
        .flatten()
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A map given comes back emptied with its allocation; one never
    /// allocated, or grown past what a connection keeps, does not.
    #[test]
    fn a_given_map_comes_back_empty_with_its_capacity() {
        while MAPS.with(|m| m.borrow_mut().pop()).is_some() {}
        let mut map = HeaderMap::new();
        map.insert("x-a", "1".parse().unwrap());
        let capacity = map.capacity();
        give(map);
        give(HeaderMap::new());
        let mut big = HeaderMap::with_capacity(SPARE_HEADERS * 2);
        big.insert("x-b", "2".parse().unwrap());
        give(big);
        let back = take();
        assert!(back.is_empty());
        assert_eq!(back.capacity(), capacity);
        assert_eq!(take().capacity(), 0, "only the one map was kept");
    }
}
