//! The status page at the admin listener's `/`: one HTML page with no
//! external assets that reads `/status` and `/metrics` every 2 s and
//! shows them (listeners, routes, upstream endpoints and their state,
//! plugins, reloads; a tunnel server's runtimes). Served by both admin
//! listeners; the page tells them apart by what `/status` holds.

use bytes::Bytes;
use http::{Response, header};
use http_body_util::Full;

/// The page.
const PAGE: &str = include_str!("status_page.html");

/// The page as an admin answer. Its policy lets it run its own script
/// and talk to this listener only.
pub fn answer() -> crate::admin_answer::Answer {
    let mut resp = Response::new(Full::new(Bytes::from_static(PAGE.as_bytes())));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/html; charset=utf-8"),
    );
    h.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-store"),
    );
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        header::HeaderValue::from_static(
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'",
        ),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        header::HeaderValue::from_static("nosniff"),
    );
    resp
}
