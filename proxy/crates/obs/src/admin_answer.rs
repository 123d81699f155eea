//! What the admin listeners answer with: JSON and Prometheus answers,
//! 405s, times and metric families; used by the handlers and by the
//! access check in front of them.

use std::fmt::Write as _;
use std::time::SystemTime;

use bytes::Bytes;
use http::{Response, StatusCode, header};
use http_body_util::Full;

/// An admin answer.
pub type Answer = Response<Full<Bytes>>;

/// 405 for `path`, which takes `allow`. RFC 9110 15.5.6: a 405 says which
/// methods the resource takes, in `Allow`.
pub fn method_not_allowed(path: &str, allow: &'static str) -> Answer {
    let mut resp = json(
        StatusCode::METHOD_NOT_ALLOWED,
        serde_json::json!({"error": format!("{path} takes {allow}")}),
    );
    resp.headers_mut()
        .insert(header::ALLOW, header::HeaderValue::from_static(allow));
    resp
}

/// A Prometheus text answer.
pub fn prometheus(text: String) -> Answer {
    let mut resp = Response::new(Full::new(Bytes::from(text)));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    resp
}

/// Writes one metric family in Prometheus text format.
pub fn metric(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(String, f64)]) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (labels, value) in samples {
        let _ = writeln!(out, "{name}{labels} {value}");
    }
}

/// A JSON answer.
pub fn json(status: StatusCode, value: serde_json::Value) -> Answer {
    let mut resp = Response::new(Full::new(Bytes::from(value.to_string())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    resp
}

/// A time as RFC 3339 with milliseconds.
pub fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}
