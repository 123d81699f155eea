//! Header handling between client and upstream: hop-by-hop removal,
//! `X-Forwarded-*`, and HTTP Upgrade detection.

use std::net::IpAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1),
/// plus the legacy ones proxies are expected to drop.
static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
];

/// A header name the forwarding pass looks for.
enum Listed {
    /// A hop-by-hop header: its position in [`HOP_BY_HOP`].
    HopByHop(usize),
    /// `X-Forwarded-Client-Cert`.
    ClientCert,
    /// `X-Forwarded-For`, `-Proto` or `-Host` (0, 1, 2).
    Forwarded(u8),
    /// `Cookie`.
    Cookie,
}

/// What the forwarding pass saw among a message's fields, for free as it
/// went: setting the `X-Forwarded-*` headers then needs no lookup to know
/// which came with the request (three lookups were ~500 instructions a
/// forwarded request).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Seen {
    /// An `X-Forwarded-Client-Cert`: a client may claim one.
    pub client_cert: bool,
    pub forwarded_for: bool,
    pub forwarded_proto: bool,
    pub forwarded_host: bool,
    /// A `Cookie` field, perhaps one of several to join
    /// ([`join_cookie_crumbs`]).
    pub cookie: bool,
}

impl Seen {
    fn note(&mut self, listed: &Listed, present: bool) {
        match listed {
            Listed::ClientCert => self.client_cert |= present,
            Listed::Forwarded(0) => self.forwarded_for = present,
            Listed::Forwarded(1) => self.forwarded_proto = present,
            Listed::Forwarded(_) => self.forwarded_host = present,
            Listed::Cookie => self.cookie = present,
            Listed::HopByHop(_) => {}
        }
    }
}

/// What `name` is to the forwarding pass. A match on the name's text (its
/// length first) rather than `HeaderName` comparisons: this runs for every
/// header of every request and response, and the comparisons were 5% of a
/// forwarded request's instructions.
fn listed(name: &str) -> Option<Listed> {
    Some(Listed::HopByHop(match name {
        "connection" => 0,
        "te" => 1,
        "trailer" => 2,
        "transfer-encoding" => 3,
        "upgrade" => 4,
        "proxy-authorization" => 5,
        "keep-alive" => 6,
        "proxy-connection" => 7,
        "x-forwarded-client-cert" => return Some(Listed::ClientCert),
        "x-forwarded-for" => return Some(Listed::Forwarded(0)),
        "x-forwarded-proto" => return Some(Listed::Forwarded(1)),
        "x-forwarded-host" => return Some(Listed::Forwarded(2)),
        "cookie" => return Some(Listed::Cookie),
        _ => return None,
    }))
}

/// Whether `name` is one of the hop-by-hop headers
/// [`remove_hop_by_hop`] removes by name (not those `Connection` lists).
pub(crate) fn is_hop_by_hop(name: &HeaderName) -> bool {
    matches!(listed(name.as_str()), Some(Listed::HopByHop(_)))
}

/// Removes hop-by-hop headers, including any the `Connection` header names.
/// With `keep_upgrade`, `Connection: upgrade` and `Upgrade` survive, for a
/// WebSocket handshake that must reach the other side. Returns which of
/// the `X-Forwarded-*` headers (and `Cookie`) are among what is left,
/// which the same pass sees for free ([`set_forwarded`] then needs no
/// lookup).
pub fn remove_hop_by_hop(headers: &mut HeaderMap, keep_upgrade: bool) -> Seen {
    // One pass over the few names present finds which listed ones to
    // remove: a hash lookup per listed name cost more, and almost every
    // upstream response carries `Connection: keep-alive` and nothing else
    // from the list.
    let mut present = [false; HOP_BY_HOP.len()];
    let mut any = false;
    let mut seen = Seen::default();
    for name in headers.keys() {
        match listed(name.as_str()) {
            Some(Listed::HopByHop(i)) => {
                present[i] = true;
                any = true;
            }
            Some(other) => seen.note(&other, true),
            None => {}
        }
    }
    if !any {
        return seen;
    }
    // Names the `Connection` header lists besides the listed ones (those go
    // below) and `close`, so the usual values cost no parsed name.
    let mut named: Vec<HeaderName> = Vec::new();
    for value in headers.get_all(header::CONNECTION) {
        let v = value.as_bytes();
        // The usual values, which name no other header: no split, no trim.
        if v.eq_ignore_ascii_case(b"keep-alive") || v.eq_ignore_ascii_case(b"close") {
            continue;
        }
        if let Ok(v) = value.to_str() {
            for token in v.split(',').map(str::trim) {
                if token.eq_ignore_ascii_case("close")
                    || HOP_BY_HOP
                        .iter()
                        .any(|h| h.as_str().eq_ignore_ascii_case(token))
                {
                    continue;
                }
                if let Ok(name) = HeaderName::from_bytes(token.as_bytes()) {
                    named.push(name);
                }
            }
        }
    }
    for name in named {
        // A client may name a forwarded header in `Connection`: then it
        // is gone, and the proxy's own goes in its place.
        if let Some(l) = listed(name.as_str()) {
            seen.note(&l, false);
        }
        headers.remove(name);
    }
    for (name, _) in HOP_BY_HOP.iter().zip(present).filter(|(_, p)| *p) {
        if keep_upgrade && (name == header::CONNECTION || name == header::UPGRADE) {
            continue;
        }
        headers.remove(name);
    }
    if keep_upgrade {
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
    seen
}

/// True for an HTTP/1.1 WebSocket upgrade (`Connection: upgrade` and
/// `Upgrade: websocket`), the one upgrade a route can allow. Any other
/// (`h2c`, which RFC 9113 deprecates, or a protocol nobody configured) is
/// not passed on: the request goes as a plain one without its hop-by-hop
/// upgrade headers, as Envoy does with h2c, rather than letting the client
/// switch an upstream connection to a protocol the route never allowed.
pub fn is_websocket_upgrade(headers: &HeaderMap) -> bool {
    let has_token = |name: header::HeaderName, token: &str| {
        headers.get_all(name).iter().any(|v| {
            v.to_str()
                .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
        })
    };
    has_token(header::UPGRADE, "websocket") && has_token(header::CONNECTION, "upgrade")
}

/// Joins a request's cookie fields into one `Cookie` header. HTTP/2
/// clients may send each cookie as a field of its own (browsers do), and
/// RFC 9113 8.2.3 has them joined with "; " before the request goes on
/// over HTTP/1.1, where many servers read only one Cookie line. An
/// HTTP/1.1 client should send one (RFC 6265 5.4); one that sends more
/// gets the same join, so the upstream sees one form however the request
/// came (directly, over HTTP/2, through a tunnel), as Envoy does. Joined
/// with ", " as other repeated fields are, cookies would run together.
pub fn join_cookie_crumbs(headers: &mut HeaderMap) {
    let mut crumbs = headers.get_all(header::COOKIE).iter();
    if crumbs.next().is_none() || crumbs.next().is_none() {
        return;
    }
    let mut joined = Vec::new();
    for crumb in headers.get_all(header::COOKIE) {
        if !joined.is_empty() {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(crumb.as_bytes());
    }
    if let Ok(value) = HeaderValue::from_bytes(&joined) {
        headers.insert(header::COOKIE, value);
    }
}

/// Leaves at most one plain `Content-Length` in a response, before the
/// hop-by-hop pass. Beside a `Transfer-Encoding` it goes (RFC 9112 6.3:
/// the coding frames the body; hyper's client leaves the field, and the
/// client would wait for bytes that never come). An upstream's `42, 42`
/// or two equal fields, which both readers (ours and hyper's) take as 42
/// (RFC 9110 8.6), go on as `42`: passed as they came, an HTTP/2 client
/// (a tunnel's stream among them) refuses the answer. The readers have
/// refused unequal values already, so the first is the one.
pub fn single_content_length(headers: &mut HeaderMap) {
    if headers.contains_key(header::TRANSFER_ENCODING) {
        headers.remove(header::CONTENT_LENGTH);
        return;
    }
    let mut values = headers.get_all(header::CONTENT_LENGTH).iter();
    let Some(first) = values.next() else {
        return;
    };
    if values.next().is_none() && first.as_bytes().iter().all(u8::is_ascii_digit) {
        return;
    }
    let n = first
        .to_str()
        .ok()
        .and_then(|v| v.split(',').next())
        .and_then(|v| v.trim().parse::<u64>().ok());
    match n {
        Some(n) => {
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
        }
        None => {
            headers.remove(header::CONTENT_LENGTH);
        }
    }
}

pub use portcullis_net::client_addr::{client_of, last_forwarded_for};

/// The `X-Forwarded-For` entry for a client address.
pub fn client_ip_header(client: IpAddr) -> HeaderValue {
    HeaderValue::try_from(client.to_canonical().to_string())
        .unwrap_or(HeaderValue::from_static("unknown"))
}

pub use portcullis_net::forwarded_fields::CLIENT_CERT;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_content_length_goes_on_as_one_plain_value() {
        for (given, want) in [
            (&["42, 42"][..], "42"),
            (&["42", "42"][..], "42"),
            (&[" 7 "][..], "7"),
            (&["42"][..], "42"),
        ] {
            let mut h = HeaderMap::new();
            for v in given {
                h.append(header::CONTENT_LENGTH, v.parse().unwrap());
            }
            single_content_length(&mut h);
            let all: Vec<_> = h.get_all(header::CONTENT_LENGTH).iter().collect();
            assert_eq!(all, [want], "{given:?}");
        }
        let mut none = HeaderMap::new();
        single_content_length(&mut none);
        assert!(none.is_empty());
        let mut coded = HeaderMap::new();
        coded.insert(header::CONTENT_LENGTH, "100".parse().unwrap());
        coded.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
        single_content_length(&mut coded);
        assert!(!coded.contains_key(header::CONTENT_LENGTH));
    }

    fn hop_by_hop_index(name: &HeaderName) -> Option<usize> {
        match listed(name.as_str()) {
            Some(Listed::HopByHop(i)) => Some(i),
            _ => None,
        }
    }

    #[test]
    fn the_index_matches_the_list() {
        for (i, name) in HOP_BY_HOP.iter().enumerate() {
            assert_eq!(hop_by_hop_index(name), Some(i), "{name}");
        }
        for other in [header::HOST, header::CONTENT_LENGTH, header::COOKIE] {
            assert_eq!(hop_by_hop_index(&other), None, "{other}");
        }
    }

    #[test]
    fn cookie_crumbs_become_one_header() {
        let mut h = headers(&[("cookie", "a=1"), ("accept", "*/*"), ("cookie", "b=2")]);
        join_cookie_crumbs(&mut h);
        let all: Vec<_> = h.get_all(header::COOKIE).iter().collect();
        assert_eq!(all, ["a=1; b=2"]);
        let mut one = headers(&[("cookie", "a=1; b=2")]);
        join_cookie_crumbs(&mut one);
        assert_eq!(one.get(header::COOKIE).unwrap(), "a=1; b=2");
    }

    #[test]
    fn hop_by_hop_and_connection_named_headers_go() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-secret"),
        );
        h.insert("x-secret", HeaderValue::from_static("1"));
        h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
        h.insert(header::TE, HeaderValue::from_static("trailers"));
        h.insert("x-kept", HeaderValue::from_static("1"));
        remove_hop_by_hop(&mut h, false);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("x-kept"));
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|&(n, v)| (HeaderName::from_static(n), HeaderValue::from_static(v)))
            .collect()
    }

    /// The names left after removal, sorted.
    fn left_after(mut h: HeaderMap, keep_upgrade: bool) -> Vec<String> {
        remove_hop_by_hop(&mut h, keep_upgrade);
        let mut left: Vec<String> = h.iter().map(|(k, v)| format!("{k}: {v:?}")).collect();
        left.sort_unstable();
        left
    }

    #[test]
    fn keep_alive_response_loses_only_its_connection_headers() {
        let h = headers(&[
            ("connection", "Keep-Alive"),
            ("keep-alive", "timeout=5"),
            ("content-length", "3"),
            ("server", "nginx"),
        ]);
        assert_eq!(
            left_after(h, false),
            [r#"content-length: "3""#, r#"server: "nginx""#]
        );
    }

    #[test]
    fn connection_may_name_listed_headers_in_any_case() {
        let h = headers(&[
            ("connection", "close, TE, X-Hop"),
            ("te", "trailers"),
            ("x-hop", "1"),
            ("trailer", "x-sum"),
            ("accept", "*/*"),
        ]);
        assert_eq!(left_after(h, false), [r#"accept: "*/*""#]);
    }

    #[test]
    fn upgrade_kept_while_other_hop_headers_go() {
        let h = headers(&[
            ("connection", "keep-alive, Upgrade"),
            ("upgrade", "websocket"),
            ("keep-alive", "timeout=5"),
            ("proxy-connection", "keep-alive"),
        ]);
        assert_eq!(
            left_after(h, true),
            [r#"connection: "upgrade""#, r#"upgrade: "websocket""#]
        );
    }

    #[test]
    fn only_a_websocket_upgrade_is_one() {
        let is = |pairs: &[(&'static str, &'static str)]| is_websocket_upgrade(&headers(pairs));
        assert!(is(&[
            ("connection", "keep-alive, Upgrade"),
            ("upgrade", "WebSocket")
        ]));
        assert!(!is(&[
            ("connection", "Upgrade, HTTP2-Settings"),
            ("upgrade", "h2c")
        ]));
        assert!(!is(&[("connection", "upgrade"), ("upgrade", "tls/1.2")]));
        assert!(!is(&[("upgrade", "websocket")]));
        assert!(!is(&[
            ("connection", "keep-alive"),
            ("upgrade", "websocket")
        ]));
    }

    #[test]
    fn upgrade_survives_when_kept() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
        h.insert(header::UPGRADE, HeaderValue::from_static("websocket"));
        remove_hop_by_hop(&mut h, true);
        assert_eq!(h.get(header::UPGRADE).unwrap(), "websocket");
        assert_eq!(h.get(header::CONNECTION).unwrap(), "upgrade");
    }
}
