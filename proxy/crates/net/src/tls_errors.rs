//! What a TLS certificate error means and what to do about it, for the
//! errors a person meets first: rustls reports them by their webpki names
//! (`CaUsedAsEndEntity`, `UnknownIssuer`), which say little to someone
//! who made a certificate with `openssl req -x509`.

/// `error` (a TLS error's text) with what it means and the fix appended,
/// when it is one of the well-known certificate errors.
pub fn explain(error: impl std::fmt::Display) -> String {
    let text = error.to_string();
    match hint(&text) {
        Some(hint) => format!("{text} ({hint})"),
        None => text,
    }
}

fn hint(text: &str) -> Option<&'static str> {
    const HINTS: &[(&str, &str)] = &[
        (
            "CaUsedAsEndEntity",
            "the server presents a CA certificate as its own, as `openssl req -x509` makes by default; give the server a certificate signed by a CA, and the client that CA: `portcullis dev-certs DIR` makes both for loopback",
        ),
        (
            "UnknownIssuer",
            "the server's certificate is not signed by a CA this side trusts; give the CA that signed it (--ca FILE, or an upstream's tls.ca_file); `portcullis dev-certs` writes it as ca.crt",
        ),
        (
            "NotValidForName",
            "the certificate does not name the host dialled; dial a name it covers, or make one that covers this name",
        ),
        ("Expired", "the certificate has expired; renew it"),
        (
            "NotValidYet",
            "the certificate is not valid yet; check the clocks of both machines",
        ),
        (
            "SelfSigned",
            "the certificate is self-signed; sign it with a CA and trust that CA",
        ),
    ];
    HINTS
        .iter()
        .find(|(name, _)| text.contains(name))
        .map(|(_, hint)| *hint)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn well_known_errors_get_their_fix() {
        let e = "invalid peer certificate: Other(OtherError(CaUsedAsEndEntity))";
        let explained = explain(e);
        assert!(explained.starts_with(e));
        assert!(explained.contains("portcullis dev-certs"), "{explained}");
        assert!(explain("invalid peer certificate: UnknownIssuer").contains("--ca FILE"));
        assert_eq!(explain("connection reset"), "connection reset");
    }
}
