//! Setting a request's `X-Forwarded-*` fields (and
//! `X-Forwarded-Client-Cert`) on its way upstream: in its map at once, or
//! (those it lacks) left to add later, written by the own HTTP/1.1
//! exchange after the map's fields ([`Forwarded`]).

use http::header::{HeaderMap, HeaderName, HeaderValue};
use portcullis_net::forwarded_fields::Fields;
pub use portcullis_net::forwarded_fields::Forwarded;

use crate::headers::{CLIENT_CERT, Seen};

const XFF: HeaderName = HeaderName::from_static("x-forwarded-for");
const XFP: HeaderName = HeaderName::from_static("x-forwarded-proto");
const XFH: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Sets `X-Forwarded-For` (appending the client), `X-Forwarded-Proto`,
/// `X-Forwarded-Host`, and `X-Forwarded-Client-Cert` (the client's
/// certificate on a mutual-TLS listener, else none). With `trust`, proto,
/// host and client certificate the client already set are kept: the proxy
/// then sits behind an ingress that knows the public side. Without it, a
/// client's own `X-Forwarded-Client-Cert` (the request has
/// one) is dropped, as Envoy does: an upstream that trusts the header
/// must not get one a client made up. `seen`: which of them the request
/// has ([`remove_hop_by_hop`]'s pass).
pub fn set_forwarded(
    headers: &mut HeaderMap,
    client: (&HeaderValue, Option<&HeaderValue>, Seen),
    proto: &'static str,
    host: Option<HeaderValue>,
    trust: bool,
) {
    place(headers, client, (proto, host, trust), false);
}

/// What [`set_forwarded`] does, with the fields the request does
/// not have yet returned to add later instead of inserted: the fields the
/// client sent are replaced (or removed, or kept when trusted) in
/// `headers` at once. Arguments as `set_forwarded`'s.
pub fn forwarded(
    headers: &mut HeaderMap,
    client: (&HeaderValue, Option<&HeaderValue>, Seen),
    proto: &'static str,
    host: Option<HeaderValue>,
    trust: bool,
) -> Forwarded {
    place(headers, client, (proto, host, trust), true)
}

/// [`set_forwarded`] (`defer` false) or [`forwarded`] (true).
fn place(
    headers: &mut HeaderMap,
    (client, client_cert, seen): (&HeaderValue, Option<&HeaderValue>, Seen),
    (proto, host, trust): (&'static str, Option<HeaderValue>, bool),
    defer: bool,
) -> Forwarded {
    let mut later = Fields::default();
    // `client` is the connection's address, rendered once per connection.
    if seen.forwarded_for {
        let prior = headers.get(&XFF).and_then(|v| v.to_str().ok());
        let xff = match prior {
            Some(prior) if !prior.is_empty() => {
                HeaderValue::try_from(format!("{prior}, {}", client.to_str().unwrap_or_default()))
                    .ok()
            }
            _ => Some(client.clone()),
        };
        if let Some(v) = xff {
            headers.insert(XFF, v);
        }
    } else if defer {
        later.for_ = Some(client.clone());
    } else {
        headers.insert(XFF, client.clone());
    }
    if !(trust && seen.forwarded_proto) {
        if seen.forwarded_proto || !defer {
            headers.insert(XFP, HeaderValue::from_static(proto));
        } else {
            later.proto = Some(proto);
        }
    }
    match host {
        _ if trust && seen.forwarded_host => {}
        Some(v) if seen.forwarded_host || !defer => {
            headers.insert(XFH, v);
        }
        Some(v) => later.host = Some(v),
        None if seen.forwarded_host => {
            headers.remove(XFH);
        }
        None => {}
    }
    match client_cert {
        Some(cert) if seen.client_cert || !defer => {
            headers.insert(CLIENT_CERT, cert.clone());
        }
        Some(cert) => later.cert = Some(cert.clone()),
        None if seen.client_cert && !trust => {
            headers.remove(CLIENT_CERT);
        }
        None => {}
    }
    Forwarded::new(later)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::headers::{client_ip_header, remove_hop_by_hop};
    use http::header;

    /// The forwarding pass over `h`, as the proxy makes it first.
    fn pass(h: &mut HeaderMap) -> Seen {
        remove_hop_by_hop(h, false)
    }

    fn ip(s: &str) -> HeaderValue {
        client_ip_header(s.parse().unwrap())
    }

    /// Later or at once, a request gets the same fields: those it lacks
    /// are left to add (added, they make the map [`set_forwarded`] makes,
    /// in its order), those the client sent are replaced where they are.
    #[test]
    fn fields_left_for_later_are_those_the_request_lacks() {
        let mut base = HeaderMap::new();
        base.insert("accept", HeaderValue::from_static("*/*"));
        let seen = remove_hop_by_hop(&mut base, false);
        let cert = HeaderValue::from_static("Hash=abc");
        let host = Some(HeaderValue::from_static("a.example"));
        let client = (&ip("10.0.0.1"), Some(&cert), seen);
        let mut h = base.clone();
        let mut later = forwarded(&mut h, client, "https", host.clone(), false);
        assert_eq!(h.len(), 1, "nothing was inserted: {h:?}");
        later.add_to(&mut h);
        let mut at_once = base;
        set_forwarded(&mut at_once, client, "https", host, false);
        let names = |m: &HeaderMap| m.keys().map(|k| k.to_string()).collect::<Vec<_>>();
        assert_eq!((names(&h), &h), (names(&at_once), &at_once));
        assert_eq!(h.len(), 5);

        // The client's own fields: replaced (or appended to) in place,
        // nothing left for later.
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", HeaderValue::from_static("203.0.113.9"));
        h.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        h.insert(
            "x-forwarded-host",
            HeaderValue::from_static("forged.example"),
        );
        h.insert(CLIENT_CERT, HeaderValue::from_static("Hash=forged"));
        let seen = remove_hop_by_hop(&mut h, false);
        let host = Some(HeaderValue::from_static("a.example"));
        let later = forwarded(
            &mut h,
            (&ip("10.0.0.1"), Some(&cert), seen),
            "http",
            host,
            false,
        );
        assert!(later.is_empty(), "{later:?}");
        assert_eq!(h.get("x-forwarded-for").unwrap(), "203.0.113.9, 10.0.0.1");
        assert_eq!(h.get("x-forwarded-proto").unwrap(), "http");
        assert_eq!(h.get("x-forwarded-host").unwrap(), "a.example");
        assert_eq!(h.get(CLIENT_CERT).unwrap(), "Hash=abc");
    }

    #[test]
    fn forwarded_headers_append_and_trust() {
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", HeaderValue::from_static("203.0.113.9"));
        h.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        h.insert(CLIENT_CERT, HeaderValue::from_static("Hash=ingress"));
        let seen = pass(&mut h);
        set_forwarded(
            &mut h,
            (&client_ip_header("10.0.0.1".parse().unwrap()), None, seen),
            "http",
            Some(HeaderValue::from_static("a.example")),
            true,
        );
        assert_eq!(h.get("x-forwarded-for").unwrap(), "203.0.113.9, 10.0.0.1");
        assert_eq!(h.get("x-forwarded-proto").unwrap(), "https");
        assert_eq!(h.get("x-forwarded-host").unwrap(), "a.example");
        assert_eq!(h.get(CLIENT_CERT).unwrap(), "Hash=ingress");
        let seen = pass(&mut h);
        set_forwarded(
            &mut h,
            (&client_ip_header("10.0.0.2".parse().unwrap()), None, seen),
            "http",
            Some(HeaderValue::from_static("b.example")),
            false,
        );
        assert_eq!(h.get("x-forwarded-proto").unwrap(), "http");
        assert_eq!(h.get("x-forwarded-host").unwrap(), "b.example");
        // Untrusted: a client's own certificate header is dropped, and
        // the connection's replaces it.
        assert_eq!(h.get(CLIENT_CERT), None);
        let mut seen = HeaderMap::new();
        seen.insert(CLIENT_CERT, HeaderValue::from_static("Hash=forged"));
        assert!(
            remove_hop_by_hop(&mut seen, false).client_cert,
            "the pass notes it"
        );
        assert_eq!(
            remove_hop_by_hop(&mut HeaderMap::new(), false),
            Seen::default()
        );
        h.insert(CLIENT_CERT, HeaderValue::from_static("Hash=forged"));
        let verified = HeaderValue::from_static("Hash=abc");
        let ip = client_ip_header("10.0.0.3".parse().unwrap());
        let seen = pass(&mut h);
        set_forwarded(&mut h, (&ip, Some(&verified), seen), "https", None, true);
        assert_eq!(h.get(CLIENT_CERT).unwrap(), "Hash=abc");
    }

    /// A forwarded header the client names in `Connection` is removed as
    /// hop-by-hop; a trusting listener then sets its own, as it would had
    /// the client sent none.
    #[test]
    fn a_forwarded_header_named_in_connection_is_the_proxys_own() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            HeaderValue::from_static("x-forwarded-proto, X-Forwarded-Host"),
        );
        h.insert("x-forwarded-proto", HeaderValue::from_static("https"));
        h.insert(
            "x-forwarded-host",
            HeaderValue::from_static("forged.example"),
        );
        h.insert("x-forwarded-for", HeaderValue::from_static("203.0.113.9"));
        let seen = pass(&mut h);
        assert!(
            seen.forwarded_for && !seen.forwarded_proto && !seen.forwarded_host,
            "{seen:?}"
        );
        let ip = client_ip_header("10.0.0.1".parse().unwrap());
        set_forwarded(
            &mut h,
            (&ip, None, seen),
            "http",
            Some(HeaderValue::from_static("a.example")),
            true,
        );
        assert_eq!(h.get("x-forwarded-proto").unwrap(), "http");
        assert_eq!(h.get("x-forwarded-host").unwrap(), "a.example");
        assert_eq!(h.get("x-forwarded-for").unwrap(), "203.0.113.9, 10.0.0.1");
    }
}
