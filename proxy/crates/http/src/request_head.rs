//! Checks on a request head before it is routed: its size, its host,
//! its body's framing, and its path's dot-segments.

use std::borrow::Cow;

use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Uri, Version, header};

/// The first `name` field of a request's head: among a few fields (most
/// requests bring three to ten), found by comparing names in order,
/// which for a standard name is one byte each; among more, by hash.
/// `HeaderMap::get` hashes the name first, ~100 instructions for the
/// request's `X-Request-Id`, present or not.
pub fn first<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Option<&'a HeaderValue> {
    if headers.len() > 12 {
        return headers.get(name);
    }
    headers.iter().find(|(k, _)| *k == name).map(|(_, v)| v)
}

/// What one pass over a request head's fields finds: its size, and the
/// fields routing reads before a guard or plugin may change the head.
/// Looked up one by one, each hashed its name (~100 instructions), and
/// most requests have none of them but `Host`.
#[derive(Debug, Clone, Copy)]
pub struct Scanned<'a> {
    /// The head's size as it was on the wire, near enough for a limit.
    pub size: usize,
    /// The first `Host`, and whether another followed.
    pub host: (Option<&'a HeaderValue>, bool),
    /// The first `Origin`.
    pub origin: Option<&'a HeaderValue>,
    /// An `Accept-Encoding` field.
    pub accept_encoding: bool,
}

/// One pass over `req`'s fields ([`Scanned`]).
pub fn scan(req: &http::request::Parts) -> Scanned<'_> {
    let line =
        req.method.as_str().len() + req.uri.path_and_query().map_or(1, |p| p.as_str().len()) + 12;
    let mut found = Scanned {
        size: line,
        host: (None, false),
        origin: None,
        accept_encoding: false,
    };
    for (k, v) in &req.headers {
        found.size += k.as_str().len() + v.len() + 4;
        // Standard names compare as one byte each.
        if *k == header::HOST {
            match found.host.0 {
                None => found.host.0 = Some(v),
                Some(_) => found.host.1 = true,
            }
        } else if *k == header::ORIGIN {
            found.origin = found.origin.or(Some(v));
        } else if *k == header::ACCEPT_ENCODING {
            found.accept_encoding = true;
        }
    }
    found
}

/// What RFC 9112 says a server must refuse in a request's framing.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// An HTTP/1.1 request without `Host`, with two, or with a value that
    /// is not text (§3.2: 400).
    Host(&'static str),
    /// A `Transfer-Encoding` other than `chunked` alone.
    Coding,
}

impl Refused {
    /// The answer's status.
    pub fn status(&self) -> StatusCode {
        match self {
            Refused::Host(_) => StatusCode::BAD_REQUEST,
            Refused::Coding => StatusCode::NOT_IMPLEMENTED,
        }
    }

    /// The answer's `error` text.
    pub fn message(&self) -> &'static str {
        match self {
            Refused::Host(why) => why,
            Refused::Coding => "unsupported transfer-encoding",
        }
    }
}

/// The request's host, lower case, without port: the URI's authority
/// (HTTP/2, or an absolute-form target), else the `Host` header.
///
/// An HTTP/1.x request must carry one `Host` (HTTP/1.0 may leave it out):
/// routing on the first of two, or on none, is how host-based routes and
/// an upstream's idea of the host come apart. The header is read once
/// either way, so the check costs no extra lookup.
pub fn request_host<'a>(
    version: Version,
    uri: &'a Uri,
    headers: &'a HeaderMap,
) -> Result<Option<Cow<'a, str>>, Refused> {
    let mut hosts = headers.get_all(header::HOST).iter();
    let first = hosts.next();
    host_of(version, uri, (first, hosts.next().is_some()))
}

/// [`request_host`], given the request's first `Host` and whether another
/// followed ([`scan`] finds both).
pub fn host_of<'a>(
    version: Version,
    uri: &'a Uri,
    (first, more): (Option<&'a HeaderValue>, bool),
) -> Result<Option<Cow<'a, str>>, Refused> {
    let first = if version < Version::HTTP_2 {
        if more {
            return Err(Refused::Host("more than one host header"));
        }
        if first.is_none() && version == Version::HTTP_11 {
            return Err(Refused::Host("missing host header"));
        }
        first
    } else if uri.authority().is_none() {
        // HTTP/2 names the host in `:authority`; `Host` only stands in.
        first
    } else {
        None
    };
    let (raw, upper) = match (uri.authority(), first) {
        (Some(a), _) => {
            // RFC 9110 §4.2.4: userinfo in a request target is an error
            // (`@` is not a host byte).
            let (_, upper) = host_part(a.as_str().as_bytes())
                .ok_or(Refused::Host("invalid host in the request target"))?;
            (a.host(), upper)
        }
        (None, None) => return Ok(None),
        (None, Some(h)) => {
            let (host, upper) =
                host_part(h.as_bytes()).ok_or(Refused::Host("invalid host header"))?;
            // SAFETY: `host_part` takes ASCII bytes only. Checked again,
            // this was ~125 instructions a request.
            let host = unsafe { std::str::from_utf8_unchecked(host) };
            (host, upper)
        }
    };
    // A fully qualified name (`app.example.com.`) is the same host; nginx
    // and Envoy (`strip_trailing_host_dot`) match it without the dot too.
    let raw = raw.strip_suffix('.').unwrap_or(raw);
    Ok(Some(if upper {
        Cow::Owned(raw.to_ascii_lowercase())
    } else {
        Cow::Borrowed(raw)
    }))
}

/// The host of `h` without its port, and whether it has an upper-case
/// letter; `None` unless `h` is `host[:port]` (RFC 9112 §3.2: any other
/// `Host` is a 400): an IP literal in brackets, or a name of letters,
/// digits, `-`, `.` and `_`, then at most a port of up to five digits.
/// Stricter than RFC 3986's reg-name, which allows `,`, `;` or `!`: no
/// DNS name has those, and a `Host: a,b` reads as two hosts to whatever
/// parses it next. One pass over the bytes, each looked up once in
/// [`HOST_BYTES`]: the searches it replaced (`find`, `rfind`, `contains`,
/// each a memchr set up for a few bytes) were ~800 instructions a
/// request, and testing each byte's kinds one by one ~13 a byte.
/// What it returns is ASCII.
fn host_part(h: &[u8]) -> Option<(&[u8], bool)> {
    let (end, upper) = if h.first() == Some(&b'[') {
        let close = h.iter().position(|&c| c == b']')?;
        let literal = &h[1..close];
        if literal.is_empty()
            || !literal
                .iter()
                .all(|&c| c.is_ascii_hexdigit() || c == b':' || c == b'.')
        {
            return None;
        }
        (close + 1, literal.iter().any(u8::is_ascii_uppercase))
    } else {
        let mut end = 0;
        let mut kinds = 0;
        while end < h.len() {
            let kind = HOST_BYTES[h[end] as usize];
            if kind & NAME == 0 {
                break;
            }
            kinds |= kind;
            end += 1;
        }
        if end == 0 || (end < h.len() && h[end] != b':') {
            return None;
        }
        (end, kinds & UPPER != 0)
    };
    let port = &h[end..];
    let port_ok = match port.split_first() {
        None => true,
        Some((b':', digits)) => digits.len() <= 5 && digits.iter().all(u8::is_ascii_digit),
        Some(_) => false,
    };
    port_ok.then_some((&h[..end], upper))
}

/// A byte of a host name (a letter, a digit, `-`, `.` or `_`).
const NAME: u8 = 1;
/// An upper-case letter.
const UPPER: u8 = 2;

/// Each byte's kinds, for [`host_part`].
static HOST_BYTES: [u8; 256] = {
    let mut table = [0u8; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        if c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_') {
            table[b] = NAME;
        }
        if c.is_ascii_uppercase() {
            table[b] |= UPPER;
        }
        b += 1;
    }
    table
};

/// The checks every request head passes before it is routed, on the
/// routing core's listeners and the tunnel server's public side alike:
/// its host ([`request_host`]) and its body's coding
/// ([`unsupported_coding`]).
pub fn admit_head<'a>(
    version: Version,
    uri: &'a Uri,
    headers: &'a HeaderMap,
    body: &impl http_body::Body,
) -> Result<Option<Cow<'a, str>>, Refused> {
    let host = request_host(version, uri, headers)?;
    admit_coding(headers, body)?;
    Ok(host)
}

/// [`admit_head`]'s check of the body's coding alone.
pub fn admit_coding(headers: &HeaderMap, body: &impl http_body::Body) -> Result<(), Refused> {
    match unsupported_coding(headers, body) {
        true => Err(Refused::Coding),
        false => Ok(()),
    }
}

/// Whether a request body's transfer coding is one the proxy cannot pass
/// on: hyper reads a body by its final `chunked` coding, and the body
/// would reach the upstream with the codings before it (`gzip, chunked`)
/// dropped. nginx answers these 501 as well. Only a body of unknown length
/// can carry a coding, so a request with none or a `Content-Length` pays
/// for no header lookup.
pub fn unsupported_coding(headers: &HeaderMap, body: &impl http_body::Body) -> bool {
    body.size_hint().exact().is_none()
        && headers
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .any(|v| !v.as_bytes().trim_ascii().eq_ignore_ascii_case(b"chunked"))
}

/// Removes `.` and `..` segments (RFC 3986 §5.2.4) so `/a/../b` cannot reach
/// a route the plain path would not, and returns `None` for a path that
/// climbs above the root.
pub fn normalize_path(path: &str) -> Option<Cow<'_, str>> {
    // A dot-segment needs a `.` or a `%`; most paths have neither, and one
    // pass over the bytes is cheaper than splitting them into segments.
    if !path.bytes().any(|b| b == b'.' || b == b'%') {
        return Some(Cow::Borrowed(path));
    }
    let dotted = path.split('/').any(|s| {
        s == "."
            || s == ".."
            || s.eq_ignore_ascii_case("%2e")
            || s.eq_ignore_ascii_case("%2e%2e")
            || s.eq_ignore_ascii_case(".%2e")
            || s.eq_ignore_ascii_case("%2e.")
    });
    if !dotted {
        return Some(Cow::Borrowed(path));
    }
    let mut out: Vec<&str> = Vec::new();
    let segments: Vec<&str> = path.split('/').skip(1).collect();
    let last = segments.len().saturating_sub(1);
    for (i, seg) in segments.iter().enumerate() {
        let lower = seg.to_ascii_lowercase();
        match lower.as_str() {
            "." | "%2e" => {
                if i == last {
                    out.push("");
                }
            }
            ".." | "%2e%2e" | ".%2e" | "%2e." => {
                out.pop()?;
                if i == last {
                    out.push("");
                }
            }
            _ => out.push(seg),
        }
    }
    Some(Cow::Owned(format!("/{}", out.join("/"))))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(raw: &[(&str, &str)], version: Version, uri: &str) -> http::request::Parts {
        let mut b = http::Request::get(uri).version(version);
        for (k, v) in raw {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    /// Found by name among a few fields or by hash among many, a field
    /// is the one a lookup gives: the first of its name.
    #[test]
    fn the_first_field_of_a_name_is_found_among_few_and_many() {
        let id = HeaderName::from_static("x-request-id");
        for n in [0, 3, 10, 11, 40] {
            let mut h = HeaderMap::new();
            for i in 0..n {
                let name = HeaderName::from_bytes(format!("x-f{i}").as_bytes()).unwrap();
                h.append(name, HeaderValue::from(i));
            }
            h.append(&id, HeaderValue::from_static("a"));
            h.append(&id, HeaderValue::from_static("b"));
            h.append(header::HOST, HeaderValue::from_static("h"));
            assert_eq!(first(&h, &id).unwrap(), "a", "{n} fields before");
            assert_eq!(first(&h, &header::HOST), h.get(header::HOST));
            assert_eq!(first(&h, &header::ORIGIN), None);
        }
    }

    /// The one pass finds what lookups would: the first `Host` and
    /// whether another came, the first `Origin`, an `Accept-Encoding`,
    /// and the head's size.
    #[test]
    fn one_pass_finds_the_fields_routing_reads() {
        let p = parts(
            &[
                ("host", "a.test"),
                ("origin", "https://o.test"),
                ("origin", "https://p.test"),
                ("accept-encoding", "gzip"),
                ("x-a", "1"),
            ],
            Version::HTTP_11,
            "/p?q",
        );
        let s = scan(&p);
        assert_eq!(s.host.0, p.headers.get(header::HOST));
        assert!(!s.host.1);
        assert_eq!(s.origin, p.headers.get(header::ORIGIN));
        assert!(s.accept_encoding);
        let fields: usize = [("host", "a.test"), ("origin", "https://o.test")]
            .iter()
            .chain(&[
                ("origin", "https://p.test"),
                ("accept-encoding", "gzip"),
                ("x-a", "1"),
            ])
            .map(|(k, v)| k.len() + v.len() + 4)
            .sum();
        assert_eq!(s.size, "GET".len() + "/p?q".len() + 12 + fields);

        let two = parts(
            &[("host", "a.test"), ("host", "b.test")],
            Version::HTTP_11,
            "/",
        );
        let s = scan(&two);
        assert_eq!(s.host.0.map(|h| h.as_bytes()), Some(&b"a.test"[..]));
        assert!(s.host.1);
        assert_eq!(
            host_of(Version::HTTP_11, &two.uri, s.host),
            request_host(Version::HTTP_11, &two.uri, &two.headers)
        );
        let none = parts(&[("x-a", "1")], Version::HTTP_11, "/");
        let s = scan(&none);
        assert_eq!((s.host.0, s.origin, s.accept_encoding), (None, None, false));
    }

    #[test]
    fn dot_segments_are_resolved() {
        assert_eq!(normalize_path("/a/b").unwrap(), "/a/b");
        assert_eq!(normalize_path("/a/b.js").unwrap(), "/a/b.js");
        assert_eq!(normalize_path("/a/%2e/b").unwrap(), "/a/b");
        assert_eq!(normalize_path("/a/../b").unwrap(), "/b");
        assert_eq!(normalize_path("/a/./b/.").unwrap(), "/a/b/");
        assert_eq!(
            normalize_path("/webhooks/%2E%2E/app-proxy").unwrap(),
            "/app-proxy"
        );
        assert!(normalize_path("/../etc").is_none());
    }

    #[test]
    fn an_http11_request_needs_exactly_one_host() {
        let host = |h: &[(&str, &str)], v, uri| {
            let p = parts(h, v, uri);
            request_host(p.version, &p.uri, &p.headers).map(|h| h.map(String::from))
        };
        assert_eq!(
            host(&[("host", "A.example:8080")], Version::HTTP_11, "/"),
            Ok(Some("a.example".into()))
        );
        assert_eq!(
            host(&[("host", "App.Example.:8080")], Version::HTTP_11, "/"),
            Ok(Some("app.example".into()))
        );
        assert_eq!(
            host(
                &[("host", "a.example")],
                Version::HTTP_11,
                "http://a.example./"
            ),
            Ok(Some("a.example".into()))
        );
        assert_eq!(
            host(&[("host", "[::1]:8080")], Version::HTTP_11, "/"),
            Ok(Some("[::1]".into()))
        );
        assert_eq!(
            host(&[], Version::HTTP_11, "/"),
            Err(Refused::Host("missing host header"))
        );
        // Even with the host in an absolute-form target (RFC 9112 §3.2).
        assert_eq!(
            host(&[], Version::HTTP_11, "http://a.example/"),
            Err(Refused::Host("missing host header"))
        );
        assert_eq!(
            host(
                &[("host", "a.example"), ("host", "b.example")],
                Version::HTTP_11,
                "/"
            ),
            Err(Refused::Host("more than one host header"))
        );
        assert_eq!(
            host(
                &[("host", "a.example"), ("host", "a.example")],
                Version::HTTP_10,
                "/"
            ),
            Err(Refused::Host("more than one host header"))
        );
        // HTTP/1.0 may leave it out; the target's authority wins over Host.
        assert_eq!(host(&[], Version::HTTP_10, "/"), Ok(None));
        assert_eq!(
            host(
                &[("host", "b.example")],
                Version::HTTP_11,
                "http://a.example/"
            ),
            Ok(Some("a.example".into()))
        );
        // HTTP/2 names the host in :authority, or else in Host.
        assert_eq!(
            host(
                &[("host", "b.example")],
                Version::HTTP_2,
                "http://a.example/"
            ),
            Ok(Some("a.example".into()))
        );
        assert_eq!(
            host(&[("host", "b.example")], Version::HTTP_2, "/"),
            Ok(Some("b.example".into()))
        );
        assert_eq!(host(&[], Version::HTTP_2, "/"), Ok(None));
    }

    #[test]
    fn a_host_that_is_not_host_and_port_is_refused() {
        let host = |value: &str| {
            let p = parts(&[("host", value)], Version::HTTP_11, "/");
            request_host(p.version, &p.uri, &p.headers).map(|h| h.map(String::from))
        };
        for bad in [
            "a b@evil",
            "evil/path",
            "a,b",
            "a;b",
            "user@a.example",
            "a.example:80:80",
            "a.example:http",
            "[::1",
            "[zz]:80",
            "",
            ":80",
            "a.example:123456",
        ] {
            assert_eq!(
                host(bad),
                Err(Refused::Host("invalid host header")),
                "{bad:?}"
            );
        }
        for good in [
            "a.example",
            "A-b_c.example:8080",
            "10.0.0.1:80",
            "[::1]",
            "[::ffff:10.0.0.1]:1",
        ] {
            assert!(host(good).is_ok(), "{good:?}");
        }
        // The same rules for a request target's authority.
        let p = parts(
            &[("host", "a.example")],
            Version::HTTP_11,
            "http://u@a.example/",
        );
        assert_eq!(
            request_host(p.version, &p.uri, &p.headers),
            Err(Refused::Host("invalid host in the request target"))
        );
    }

    #[test]
    fn every_byte_in_a_host_name_is_taken_or_refused_by_its_kind() {
        // The rule, byte by byte: name bytes up to an optional `:port`.
        fn by_rule(h: &[u8]) -> Option<(&[u8], bool)> {
            let end = h.iter().position(|&c| c == b':').unwrap_or(h.len());
            let name = &h[..end];
            let ok = !name.is_empty()
                && name
                    .iter()
                    .all(|&c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'.' | b'_'));
            let port = &h[end..];
            let port_ok =
                port.is_empty() || (port.len() <= 6 && port[1..].iter().all(u8::is_ascii_digit));
            (ok && port_ok).then(|| (name, name.iter().any(u8::is_ascii_uppercase)))
        }
        for b in 0..=255u8 {
            for at in 0..4 {
                let mut h = b"ab.c:80".to_vec();
                h[at] = b;
                assert_eq!(host_part(&h), by_rule(&h), "{h:?}");
                h.truncate(4);
                assert_eq!(host_part(&h), by_rule(&h), "{h:?}");
            }
        }
    }

    #[test]
    fn a_host_that_is_not_text_is_refused() {
        let mut p = parts(&[], Version::HTTP_11, "/");
        p.headers.insert(
            header::HOST,
            http::HeaderValue::from_bytes(b"a\xffb").unwrap(),
        );
        assert_eq!(
            request_host(p.version, &p.uri, &p.headers).err(),
            Some(Refused::Host("invalid host header"))
        );
    }
}
