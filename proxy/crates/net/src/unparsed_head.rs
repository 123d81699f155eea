//! The answer to a request head that hyper cannot parse.
//!
//! hyper answers such a head itself, before any service sees a request:
//! a 400 (or 431, 414) with an empty body, then it closes. A client then
//! learns nothing, and the proxy's other errors are JSON. So the client's
//! socket ([`crate::head_deadline::Watched`]) recognises that answer, the
//! only bytes hyper writes on its own, and sends the proxy's JSON answer
//! in its place; and the connection's end writes an access line naming
//! hyper's reason, since no request ever reached the access log.

use http::StatusCode;

/// The proxy's answer in place of hyper's automatic `head` (its status
/// line and headers, no body), or `None` when `head` is not one.
pub fn answer(head: &[u8]) -> Option<(u16, Vec<u8>)> {
    let rest = head.strip_prefix(b"HTTP/1.1 ")?;
    let status = StatusCode::from_bytes(rest.get(..3)?).ok()?;
    // hyper's answer has no body: anything else is not its answer.
    if !head.ends_with(b"\r\n\r\n") || !contains(head, b"\r\ncontent-length: 0\r\n") {
        return None;
    }
    let body = serde_json::json!({
        "error": message(status),
        "status": status.as_u16(),
        "route": null,
    })
    .to_string();
    let mut out = Vec::with_capacity(256);
    out.extend_from_slice(b"HTTP/1.1 ");
    out.extend_from_slice(status.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(status.canonical_reason().unwrap_or("").as_bytes());
    out.extend_from_slice(b"\r\ncontent-type: application/json\r\ncache-control: no-store\r\nconnection: close\r\ncontent-length: ");
    out.extend_from_slice(body.len().to_string().as_bytes());
    out.extend_from_slice(b"\r\n");
    if let Some(date) = header_line(head, b"date: ") {
        out.extend_from_slice(date);
    }
    out.extend_from_slice(b"\r\n");
    out.extend_from_slice(body.as_bytes());
    Some((status.as_u16(), out))
}

/// What the answer's `error` says for each status hyper gives.
fn message(status: StatusCode) -> &'static str {
    match status {
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => "request head too large",
        StatusCode::URI_TOO_LONG => "request target too long",
        _ => "malformed request head",
    }
}

/// The parse error behind a connection's end, if hyper refused a head.
pub fn refused<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a hyper::Error> {
    error
        .downcast_ref::<hyper::Error>()
        .filter(|e| e.is_parse() && !e.is_parse_version_h2())
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

/// The whole line (with its CRLF) of the header starting `name` in a head.
fn header_line<'a>(head: &'a [u8], name: &[u8]) -> Option<&'a [u8]> {
    let start = head
        .windows(name.len() + 2)
        .position(|w| w.starts_with(b"\r\n") && &w[2..] == name)?
        + 2;
    let len = head[start..].windows(2).position(|w| w == b"\r\n")? + 2;
    Some(&head[start..start + len])
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYPER_400: &[u8] = b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\ndate: Mon, 23 Nov 2026 21:15:38 GMT\r\n\r\n";

    fn split(answer: &[u8]) -> (String, serde_json::Value) {
        let text = String::from_utf8(answer.to_vec()).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        (head.to_owned(), serde_json::from_str(body).unwrap())
    }

    #[test]
    fn hypers_400_becomes_the_proxys_json_with_its_date() {
        let (status, answer) = answer(HYPER_400).unwrap();
        assert_eq!(status, 400);
        let (head, body) = split(&answer);
        assert!(head.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{head}");
        assert!(
            head.contains("\r\ncontent-type: application/json"),
            "{head}"
        );
        assert!(head.contains("\r\nconnection: close"), "{head}");
        assert!(
            head.ends_with("\r\ndate: Mon, 23 Nov 2026 21:15:38 GMT"),
            "{head}"
        );
        assert_eq!(body["error"], "malformed request head");
        assert_eq!(body["status"], 400);
        let length: usize = head
            .split("\r\ncontent-length: ")
            .nth(1)
            .and_then(|s| s.split("\r\n").next())
            .unwrap()
            .parse()
            .unwrap();
        assert_eq!(length, answer.len() - head.len() - 4);
    }

    #[test]
    fn a_431_says_the_head_is_too_large() {
        let head = b"HTTP/1.1 431 Request Header Fields Too Large\r\nconnection: close\r\ncontent-length: 0\r\ndate: Mon, 23 Nov 2026 21:15:38 GMT\r\n\r\n";
        let (status, answer) = answer(head).unwrap();
        assert_eq!(status, 431);
        assert_eq!(split(&answer).1["error"], "request head too large");
    }

    #[test]
    fn anything_with_a_body_or_not_a_status_line_is_left_alone() {
        assert!(answer(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 5\r\n\r\nhello").is_none());
        assert!(answer(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n").is_none());
        assert!(answer(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00").is_none());
        assert!(answer(b"HTTP/1.1 4").is_none());
    }
}
