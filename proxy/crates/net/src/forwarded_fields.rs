//! The `X-Forwarded-*` fields (and `X-Forwarded-Client-Cert`) a request
//! still lacks on its way upstream, held apart from its header map: the
//! own HTTP/1.1 exchange writes them after the map's fields instead of
//! the map taking them first (three inserts of names that are hashed and
//! looked up, the map grown for them: ~700 instructions a request on the
//! default app-proxy route, bench/versus-nginx.sh). Whatever reads the
//! map as forwarded takes them into it first ([`Forwarded::add_to`]):
//! hyper's client, a mirror, a route's edits, a plugin's response hook
//! reading the request (on its first read, so a hook that never reads it
//! costs nothing).
//!
//! Here, under both the forwarding and the plugins, because both hold
//! them: the forwarding makes and writes them, a plugin's response call
//! completes the request map with them.

use http::header::{HeaderMap, HeaderName, HeaderValue};

/// Envoy's header for the client certificate of a mutual-TLS connection.
pub const CLIENT_CERT: HeaderName = HeaderName::from_static("x-forwarded-client-cert");
const XFF: HeaderName = HeaderName::from_static("x-forwarded-for");
const XFP: HeaderName = HeaderName::from_static("x-forwarded-proto");
const XFH: HeaderName = HeaderName::from_static("x-forwarded-host");

/// The forwarding fields still to add to a request: none of them is in
/// its map (a field the client sent is replaced there, not here).
///
/// One word: it goes with the request wherever that is moved, and the
/// fields inline made every move ~130 bytes longer (more than their
/// allocation costs).
#[derive(Debug, Default, Clone)]
pub struct Forwarded(Option<Box<Fields>>);

/// The fields, each `None` when not to add.
#[derive(Debug, Default, Clone)]
pub struct Fields {
    /// `X-Forwarded-For`: the client's address.
    pub for_: Option<HeaderValue>,
    /// `X-Forwarded-Proto`.
    pub proto: Option<&'static str>,
    /// `X-Forwarded-Host`.
    pub host: Option<HeaderValue>,
    /// `X-Forwarded-Client-Cert`.
    pub cert: Option<HeaderValue>,
}

impl Forwarded {
    /// `fields` to add later (nothing when all are `None`).
    pub fn new(fields: Fields) -> Forwarded {
        let empty = fields.for_.is_none()
            && fields.proto.is_none()
            && fields.host.is_none()
            && fields.cert.is_none();
        Forwarded((!empty).then(|| Box::new(fields)))
    }

    /// Whether there is nothing to add.
    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    /// Adds them to `headers` (after its fields), leaving none here.
    pub fn add_to(&mut self, headers: &mut HeaderMap) {
        let Some(fields) = self.0.take() else {
            return;
        };
        // Inserted, not appended: none is in the map, and inserts are
        // what the map takes elsewhere on this path (a second caller of
        // `append` here had it no longer inlined into the response head's
        // reader, ~350 instructions a request).
        let Fields {
            for_,
            proto,
            host,
            cert,
        } = *fields;
        if let Some(v) = for_ {
            headers.insert(XFF, v);
        }
        if let Some(proto) = proto {
            headers.insert(XFP, HeaderValue::from_static(proto));
        }
        if let Some(v) = host {
            headers.insert(XFH, v);
        }
        if let Some(v) = cert {
            headers.insert(CLIENT_CERT, v);
        }
    }

    /// Writes them as HTTP/1.1 field lines, in the order
    /// [`Self::add_to`] adds them.
    pub fn write(&self, out: &mut Vec<u8>) {
        let Some(fields) = &self.0 else {
            return;
        };
        // Each name with its `: ` in one piece: three copies a field.
        let mut line = |name: &[u8], value: &[u8]| {
            out.extend_from_slice(name);
            out.extend_from_slice(value);
            out.extend_from_slice(b"\r\n");
        };
        if let Some(v) = &fields.for_ {
            line(b"x-forwarded-for: ", v.as_bytes());
        }
        if let Some(proto) = fields.proto {
            line(b"x-forwarded-proto: ", proto.as_bytes());
        }
        if let Some(v) = &fields.host {
            line(b"x-forwarded-host: ", v.as_bytes());
        }
        if let Some(v) = &fields.cert {
            line(b"x-forwarded-client-cert: ", v.as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Written and added alike, in one order; added once.
    #[test]
    fn fields_are_written_and_added_in_one_order_once() {
        let mut later = Forwarded::new(Fields {
            for_: Some(HeaderValue::from_static("10.0.0.1")),
            proto: Some("https"),
            host: Some(HeaderValue::from_static("a.example")),
            cert: Some(HeaderValue::from_static("Hash=abc")),
        });
        let mut written = Vec::new();
        later.write(&mut written);
        assert_eq!(
            String::from_utf8(written).unwrap(),
            "x-forwarded-for: 10.0.0.1\r\nx-forwarded-proto: https\r\n\
             x-forwarded-host: a.example\r\nx-forwarded-client-cert: Hash=abc\r\n"
        );
        let mut h = HeaderMap::new();
        h.insert("accept", HeaderValue::from_static("*/*"));
        later.add_to(&mut h);
        assert!(later.is_empty());
        let names: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(
            names,
            [
                "accept",
                "x-forwarded-for",
                "x-forwarded-proto",
                "x-forwarded-host",
                "x-forwarded-client-cert"
            ]
        );
        h.remove("x-forwarded-for");
        later.add_to(&mut h);
        assert!(h.get("x-forwarded-for").is_none(), "added once");
        assert!(Forwarded::new(Fields::default()).is_empty());
    }
}
