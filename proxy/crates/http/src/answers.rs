//! The answers the routing core makes itself: JSON errors (with CORS
//! for a route that sets it), 429 and 413 with the connection's close,
//! HTTPS redirects, and the bodiless-answer rule.

use std::time::Duration;

use http::header::{self, HeaderValue};
use http::{Response, StatusCode, Version};

use crate::conn_info::ConnInfo;
use crate::request_head;
use portcullis_config::{Cors, Route};
use portcullis_forward::Body;

/// Builds the JSON error answer the proxy gives on its own behalf.
pub fn error_response(
    status: StatusCode,
    message: &str,
    route: Option<&Route>,
    origin: Option<&HeaderValue>,
) -> Response<Body> {
    let mut resp = json_error(status, message, route, None);
    if let (Some(cors), Some(origin)) = (route.and_then(|r| r.error_cors.as_ref()), origin) {
        add_cors(resp.headers_mut(), cors, origin);
    }
    resp
}

/// Takes one request from `limit` for the key it counts by: in the
/// state store when the limit is shared and the store answers in time,
/// else here.
pub(crate) async fn take_rate(
    limit: &crate::rate_limit::RateLimit,
    conn: &ConnInfo,
    headers: &http::HeaderMap,
) -> Result<(), Duration> {
    let mut buf = [0u8; 16];
    let trust = conn.listener.trust_forwarded_headers;
    let key = limit.key_of((conn.client.ip(), trust), headers, &mut buf);
    if let (Some(prefix), Some(state)) = (&limit.shared, crate::shared_limit::state()) {
        let mut cell = Vec::with_capacity(prefix.len() + key.map_or(0, <[u8]>::len));
        cell.extend_from_slice(prefix);
        cell.extend_from_slice(key.unwrap_or_default());
        // Boxed: only shared limits pay for the store's future.
        if let Some(taken) = Box::pin(state.take(&cell, limit.steps())).await {
            return taken;
        }
    }
    limit.take(key)
}

/// The answer to a request over its route's rate limit: 429 with
/// `Retry-After` (whole seconds, rounded up) saying when one would pass.
pub(crate) fn rate_limited(
    route: &Route,
    wait: Duration,
    origin: Option<&HeaderValue>,
) -> Response<Body> {
    let mut resp = error_response(
        StatusCode::TOO_MANY_REQUESTS,
        "rate limit exceeded",
        Some(route),
        origin,
    );
    crate::rate_limit::retry_after(resp.headers_mut(), wait);
    resp
}

/// Marks an answer given while the client may still be sending its body
/// (413): its HTTP/1 connection closes after it, and first reads and
/// drops what the client still sends, for a while, as nginx's lingering
/// close does. Closed at once, the socket's unread bytes would make the
/// kernel reset the connection, and a client still writing would see
/// the reset instead of the answer.
#[derive(Clone, Copy, Debug)]
pub struct Linger;

/// Marks an answer that is none: its stream is reset instead (a
/// plugin's doing; see [`reset`]).
#[derive(Clone, Copy, Debug)]
pub struct ResetStream;

impl std::fmt::Display for ResetStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a plugin reset the stream")
    }
}

impl std::error::Error for ResetStream {}

/// No answer: the request's stream is reset where the answer would go out
/// (an HTTP/1.1 connection closes with nothing sent; an HTTP/2 or HTTP/3
/// stream is reset). Its status, 444, is nginx's for a connection closed
/// with no answer: what the access log and metrics show.
pub fn reset() -> Response<Body> {
    let mut resp = Response::new(Body::empty());
    *resp.status_mut() = StatusCode::from_u16(444).unwrap_or(StatusCode::BAD_REQUEST);
    resp.extensions_mut().insert(ResetStream);
    resp
}

/// `resp` as hyper takes it: an error for an answer that is a reset, so
/// hyper resets the stream (closes an HTTP/1.1 connection unanswered).
#[inline]
pub fn or_reset<B>(resp: Response<B>) -> Result<Response<B>, ResetStream> {
    match resp.extensions().get::<ResetStream>() {
        Some(reset) => Err(*reset),
        None => Ok(resp),
    }
}

/// The 413 answer to a body over the route's `max_request_body`.
pub(crate) fn too_large(
    route: &Route,
    version: Version,
    origin: Option<&HeaderValue>,
) -> Response<Body> {
    let resp = error_response(
        StatusCode::PAYLOAD_TOO_LARGE,
        "request body too large",
        Some(route),
        origin,
    );
    closing(resp, version)
}

/// `resp`, closing its HTTP/1 connection after it with a lingering close
/// (HTTP/2 and HTTP/3 reset the one stream instead).
pub(crate) fn closing(mut resp: Response<Body>, version: Version) -> Response<Body> {
    close_after(&mut resp, version);
    resp
}

/// Marks `resp` to close its HTTP/1 connection after it, lingering (see
/// [`Linger`]); the routing core's 413s, and the tunnel server's.
pub fn close_after<B>(resp: &mut Response<B>, version: Version) {
    if version < Version::HTTP_2 {
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        resp.extensions_mut().insert(Linger);
    }
}

/// The proxy's JSON error answer: `{"error", "status", "route", "plugin"?}`.
pub fn json_error(
    status: StatusCode,
    message: &str,
    route: Option<&Route>,
    plugin: Option<&str>,
) -> Response<Body> {
    let extra = plugin.map(|p| ("plugin", p));
    json_error_about(status, message, ("route", route.map(|r| &*r.name)), extra)
}

/// The JSON error answer of the proxy's every side: `{"error", "status",
/// FIELD: what it is about}` (`route` in the routing core, `runtime` on
/// the tunnel server's public side), and `extra` when set; over gRPC, in
/// gRPC's terms (see `grpc_local`).
pub fn json_error_about(
    status: StatusCode,
    message: &str,
    (field, about): (&str, Option<&str>),
    extra: Option<(&str, &str)>,
) -> Response<Body> {
    let mut body = serde_json::json!({
        "error": message,
        "status": status.as_u16(),
    });
    body[field] = about.into();
    if let Some((name, value)) = extra {
        body[name] = value.into();
    }
    let mut resp = json_response(status, &body);
    resp.extensions_mut()
        .insert(crate::grpc_local::LocalError(message.into(), None));
    resp
}

/// An answer that must have no body — to a HEAD request (`head`), or a
/// 204 or 304 — without one. hyper drops such a body itself over
/// HTTP/1.1, but over HTTP/2 (and h3 over HTTP/3) it sends what it is
/// given, and DATA there is a protocol error that the client's stack
/// turns into a reset: every HTTP/2 HEAD the proxy answered itself (a
/// health probe, a local answer, its JSON errors) failed so, as did a
/// local or plugin answer of 204 or 304 with a body. A HEAD answer keeps
/// the length the body had declared, as for GET. An upstream's answer,
/// bodiless already, is left as it is. In place: every answer passes
/// here, and one passed by value was copied in and out.
pub fn make_bodiless(resp: &mut Response<Body>, head: bool) {
    use http_body::Body as _;
    let status = resp.status();
    let never = status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED;
    if !(head || never) || resp.body().is_end_stream() {
        return;
    }
    if !never && let Some(len) = resp.body().size_hint().exact() {
        resp.headers_mut()
            .entry(header::CONTENT_LENGTH)
            .or_insert_with(|| HeaderValue::from(len));
    }
    *resp.body_mut() = Body::empty();
}

/// A small JSON answer the proxy makes itself (never cached).
pub fn json_response(status: StatusCode, body: &serde_json::Value) -> Response<Body> {
    let mut resp = Response::new(Body::full(body.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// The answer on a listener with `redirect_https`: 308 (the method and
/// body are kept, where 301 lets clients turn a POST into a GET) to the
/// same host, path and query over https on `port`.
pub(crate) fn https_redirect(host: Option<&str>, port: u16, uri: &http::Uri) -> Response<Body> {
    let Some(host) = host else {
        return error_response(
            StatusCode::BAD_REQUEST,
            "a redirect to https needs the request's host",
            None,
            None,
        );
    };
    let bracketed = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_owned()
    };
    let port = if port == 443 {
        String::new()
    } else {
        format!(":{port}")
    };
    let target = uri.path_and_query().map_or("/", |pq| pq.as_str());
    let location = format!("https://{bracketed}{port}{target}");
    let mut resp = json_response(
        StatusCode::PERMANENT_REDIRECT,
        &serde_json::json!({ "location": location, "status": 308 }),
    );
    if let Ok(value) = HeaderValue::from_str(&location) {
        resp.headers_mut().insert(header::LOCATION, value);
    }
    resp
}

/// The answer to a request whose framing RFC 9112 says to refuse.
pub(crate) fn refused_response(refused: &request_head::Refused) -> Response<Body> {
    error_response(refused.status(), refused.message(), None, None)
}

pub(crate) fn add_cors(headers: &mut http::HeaderMap, cors: &Cors, origin: &HeaderValue) {
    let listed = origin
        .to_str()
        .is_ok_and(|o| cors.origins.iter().any(|x| x == o));
    if !(cors.allow_any || listed) {
        return;
    }
    // `*` may not be combined with credentials, so echo the origin then.
    let value = if cors.allow_any && !cors.allow_credentials {
        HeaderValue::from_static("*")
    } else {
        origin.clone()
    };
    headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, value);
    if cors.allow_credentials {
        headers.insert(
            header::ACCESS_CONTROL_ALLOW_CREDENTIALS,
            HeaderValue::from_static("true"),
        );
    }
    headers.append(header::VARY, HeaderValue::from_static("Origin"));
}
