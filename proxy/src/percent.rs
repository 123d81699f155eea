//! Percent-encoding, for the few places a header carries text that must
//! be escaped: URLs put in headers, gRPC's `grpc-message`.

/// `s` with every byte that `keep` refuses written as `%XX`.
pub fn encode(s: &str, keep: impl Fn(u8) -> bool) -> String {
    let mut out = String::with_capacity(s.len() * 3 / 2);
    for b in s.bytes() {
        if keep(b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// RFC 3986's unreserved characters, which a URL component keeps.
pub fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}
