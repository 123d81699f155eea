//! A request's path and host, as a client sends them: dot-segment
//! removal (which decides the route) and the host (which decides the
//! virtual host and the runtime behind a tunnel).
#![no_main]

use libfuzzer_sys::fuzz_target;
use portcullis::request_head::{normalize_path, request_host};

fuzz_target!(|bytes: &[u8]| {
    // Path, then a NUL, then the host.
    let (path, host) = match bytes.iter().position(|&b| b == 0) {
        Some(i) => (&bytes[..i], &bytes[i + 1..]),
        None => (bytes, &b""[..]),
    };
    if let Ok(path) = std::str::from_utf8(path)
        && path.starts_with('/')
        && let Some(normal) = normalize_path(path)
    {
        assert!(normal.starts_with('/'), "{path:?} -> {normal:?}");
        // Normalizing twice changes nothing: no dot segment survives to
        // be resolved by the upstream into another route's path.
        assert_eq!(
            normalize_path(&normal).as_deref(),
            Some(&*normal),
            "{path:?} -> {normal:?}"
        );
    }
    let root = http::Uri::from_static("/");
    if let Ok(value) = http::HeaderValue::from_bytes(host) {
        let mut headers = http::HeaderMap::new();
        headers.insert(http::header::HOST, value);
        if let Ok(Some(h)) = request_host(http::Version::HTTP_11, &root, &headers) {
            assert!(!h.bytes().any(|b| b.is_ascii_uppercase()), "{h:?}");
        }
    }
    if let Ok(uri) = http::Uri::try_from(host) {
        let headers = http::HeaderMap::new();
        if let Ok(Some(h)) = request_host(http::Version::HTTP_2, &uri, &headers) {
            assert!(!h.bytes().any(|b| b.is_ascii_uppercase()), "{h:?}");
        }
    }
});
