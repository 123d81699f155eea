//! The header fields that frame an HTTP/1.1 message or describe one
//! connection (RFC 9112 6, RFC 9110 7.6.1). The proxy alone sets them: a
//! `Content-Length` a policy or a plugin set beside a body of another
//! length would send the next response's bytes as this one's end (or
//! this one's as the next's start) on a connection an ingress controller
//! pools for many users. So policies cannot name them (`check` refuses)
//! and plugins' edits of them are ignored and counted.

/// The fields, lower case.
pub const FIELDS: [&str; 8] = [
    "content-length",
    "transfer-encoding",
    "connection",
    "upgrade",
    "te",
    "trailer",
    "keep-alive",
    "proxy-connection",
];

/// Whether `name` (any case) is one of [`FIELDS`].
pub fn is_framing(name: &str) -> bool {
    // By length first: this runs on every header a plugin edits.
    match name.len() {
        2 | 7 | 10 | 14 | 16 | 17 => FIELDS.iter().any(|f| f.eq_ignore_ascii_case(name)),
        _ => false,
    }
}

/// The fields, listed for a message.
pub fn listed() -> String {
    FIELDS.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_field_and_only_they_are_framing() {
        for f in FIELDS {
            assert!(is_framing(f), "{f}");
            assert!(is_framing(&f.to_ascii_uppercase()), "{f}");
        }
        for other in [
            "content-type",
            "host",
            "x-te",
            "connections",
            "",
            "upgrade-insecure-requests",
        ] {
            assert!(!is_framing(other), "{other}");
        }
    }
}
