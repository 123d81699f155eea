//! The proxy's own error answers to gRPC clients, in gRPC's terms: a
//! "trailers-only" response (HTTP 200, `grpc-status` and `grpc-message`
//! in the head, no body), as Envoy sends for its local replies. A gRPC
//! client given an HTTP 502 with a JSON body reports "unexpected HTTP
//! status code 502; received unexpected content-type application/json";
//! given this, it reports UNAVAILABLE with "upstream unreachable", the
//! same words the access log and a JSON client get.
//!
//! Only answers the proxy makes itself change (marked [`LocalError`]),
//! and a proxy-wasm filter's, as Envoy converts a filter's local reply
//! ([`portcullis_plugin::GrpcReply`]); an upstream's or a component's own
//! answers pass as they are. The access log and metrics keep the HTTP
//! status the proxy chose.

use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Response, StatusCode};

use portcullis_forward::Body;

/// Marks a response the proxy made for an error, with its message, and
/// the gRPC status it gets (none: the HTTP status's mapping).
#[derive(Debug, Clone)]
pub struct LocalError(pub Box<str>, pub Option<u16>);

/// Whether a request is gRPC (or gRPC-Web): a POST whose content type is
/// `application/grpc…`. The method is looked at first, so requests that
/// cannot be gRPC never look the header up.
pub fn is_grpc(method: &Method, headers: &HeaderMap) -> bool {
    *method == Method::POST
        && headers
            .get(header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"))
}

/// `resp` for a gRPC client: unchanged unless the proxy made it for an
/// error, then trailers-only with the status gRPC gives that HTTP status
/// (Envoy's and gRPC's own mapping).
pub fn answer(resp: Response<Body>, content_type: Option<HeaderValue>) -> Response<Body> {
    let Some(LocalError(message, code)) = resp.extensions().get::<LocalError>().cloned() else {
        return resp;
    };
    let code = code.unwrap_or_else(|| grpc_code(resp.status()));
    let (mut parts, _) = resp.into_parts();
    parts.status = StatusCode::OK;
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        content_type.unwrap_or(HeaderValue::from_static("application/grpc")),
    );
    parts.headers.insert("grpc-status", HeaderValue::from(code));
    if let Ok(message) = HeaderValue::from_str(&percent_encode(&message)) {
        parts.headers.insert("grpc-message", message);
    }
    Response::from_parts(parts, Body::empty())
}

/// gRPC's status for an HTTP status (gRPC's "HTTP to gRPC status code
/// mapping", as Envoy applies it).
fn grpc_code(status: StatusCode) -> u16 {
    match status.as_u16() {
        400 => 13,                   // INTERNAL
        401 => 16,                   // UNAUTHENTICATED
        403 => 7,                    // PERMISSION_DENIED
        404 => 12,                   // UNIMPLEMENTED
        429 | 502 | 503 | 504 => 14, // UNAVAILABLE
        _ => 2,                      // UNKNOWN
    }
}

/// `grpc-message` is percent-encoded: bytes outside printable ASCII, and
/// `%` itself.
fn percent_encode(message: &str) -> String {
    // Controls and `%`; bytes past ASCII are always escaped.
    const ESCAPED: &percent_encoding::AsciiSet = &percent_encoding::CONTROLS.add(b'%');
    percent_encoding::utf8_percent_encode(message, ESCAPED).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_map_as_grpc_says() {
        assert_eq!(grpc_code(StatusCode::NOT_FOUND), 12);
        assert_eq!(grpc_code(StatusCode::BAD_GATEWAY), 14);
        assert_eq!(grpc_code(StatusCode::TOO_MANY_REQUESTS), 14);
        assert_eq!(grpc_code(StatusCode::PAYLOAD_TOO_LARGE), 2);
        assert_eq!(percent_encode("100% über"), "100%25 %C3%BCber");
    }

    #[test]
    fn only_local_errors_change() {
        let upstream = Response::new(Body::empty());
        let kept = answer(upstream, None);
        assert_eq!(kept.status(), StatusCode::OK);
        assert!(kept.headers().get("grpc-status").is_none());
        let mut local = Response::new(Body::full("{}"));
        *local.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
        local
            .headers_mut()
            .insert("retry-after", HeaderValue::from(1));
        local
            .extensions_mut()
            .insert(LocalError("upstream overloaded".into(), None));
        let grpc = answer(
            local,
            Some(HeaderValue::from_static("application/grpc+proto")),
        );
        assert_eq!(grpc.status(), StatusCode::OK);
        assert_eq!(grpc.headers()["grpc-status"], "14");
        assert_eq!(grpc.headers()["grpc-message"], "upstream overloaded");
        assert_eq!(grpc.headers()["content-type"], "application/grpc+proto");
        assert_eq!(grpc.headers()["retry-after"], "1");
        assert!(http_body::Body::is_end_stream(grpc.body()));
    }
}
