//! A client's verified certificate (mutual TLS), read once per
//! connection: its hash and names for plugins, and the
//! `X-Forwarded-Client-Cert` value the upstream gets.

use http::HeaderValue;
use rustls_pki_types::CertificateDer;

use crate::cert_identity::{self, CertIdentity};

/// A client certificate the listener's `client_ca` vouched for.
#[derive(Debug)]
pub struct ClientCertificate {
    /// The certificate, DER.
    pub der: CertificateDer<'static>,
    /// SHA-256 of the DER, lower-case hex.
    pub sha256: String,
    /// Its subject and alternative names.
    pub identity: CertIdentity,
    /// As an `X-Forwarded-Client-Cert` value.
    pub header: HeaderValue,
}

impl ClientCertificate {
    /// Reads the verified leaf certificate `leaf`.
    pub fn of(leaf: &CertificateDer<'_>) -> ClientCertificate {
        use sha2::Digest;
        let sha256 = hex::encode(sha2::Sha256::digest(leaf.as_ref()));
        // webpki parsed it to verify it; a certificate this reader cannot
        // follow still passes, with no names.
        let identity = cert_identity::read(leaf.as_ref()).unwrap_or_default();
        let header = forwarded_header(leaf, &sha256, &identity);
        ClientCertificate {
            der: leaf.clone().into_owned(),
            sha256,
            identity,
            header,
        }
    }
}

/// The `X-Forwarded-Client-Cert` value in Envoy's format: `Hash`
/// (SHA-256 of the DER), `Cert` (the PEM, URL-encoded, as nginx's
/// `$ssl_client_escaped_cert`), then `Subject`, `URI` and `DNS` (each
/// name its own pair) as Envoy's `set_current_client_cert_details`
/// adds them, so an upstream can authorise on a name without parsing
/// the certificate.
fn forwarded_header(leaf: &CertificateDer<'_>, sha256: &str, id: &CertIdentity) -> HeaderValue {
    use base64::Engine;
    let body = base64::engine::general_purpose::STANDARD.encode(leaf.as_ref());
    let mut pem = String::from("-----BEGIN CERTIFICATE-----\n");
    for line in body.as_bytes().chunks(64) {
        pem.push_str(std::str::from_utf8(line).unwrap_or_default());
        pem.push('\n');
    }
    pem.push_str("-----END CERTIFICATE-----\n");
    let base = format!("Hash={sha256};Cert=\"{}\"", url_encode(&pem));
    let mut full = format!("{base};Subject={}", quoted(&id.subject));
    for uri in &id.uris {
        full.push_str(";URI=");
        full.push_str(&value(uri));
    }
    for dns in &id.dns_names {
        full.push_str(";DNS=");
        full.push_str(&value(dns));
    }
    // A name with bytes a header cannot carry (control characters) leaves
    // the names out; hash and PEM are ASCII and always fit.
    HeaderValue::from_str(&full)
        .or_else(|_| HeaderValue::from_str(&base))
        .unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// A value as the header's grammar allows it: quoted (with `"` and `\`
/// escaped) when it holds `,`, `;`, `=` or `"`.
fn value(text: &str) -> String {
    if text.contains([',', ';', '=', '"', '\\']) {
        quoted(text)
    } else {
        text.to_owned()
    }
}

fn quoted(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        if matches!(c, '"' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// Percent-encodes all but RFC 3986's unreserved characters.
pub fn url_encode(s: &str) -> String {
    use percent_encoding::{NON_ALPHANUMERIC, utf8_percent_encode};
    const ESCAPED: &percent_encoding::AsciiSet = &NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'.')
        .remove(b'_')
        .remove(b'~');
    utf8_percent_encode(s, ESCAPED).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair, SanType};

    #[test]
    fn the_header_names_the_client_as_envoy_does() {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "Example");
        dn.push(DnType::CommonName, "ci");
        params.distinguished_name = dn;
        params.subject_alt_names = vec![
            SanType::URI("spiffe://cluster.local/ns/ci/sa/runner".try_into().unwrap()),
            SanType::DnsName("ci.example".try_into().unwrap()),
            SanType::DnsName("b.example".try_into().unwrap()),
        ];
        let der = params.self_signed(&key).unwrap().der().clone();
        let cert = ClientCertificate::of(&der);
        let header = cert.header.to_str().unwrap();
        assert!(
            header.starts_with(&format!("Hash={};Cert=\"-----BEGIN", cert.sha256)),
            "{header}"
        );
        assert!(
            header.ends_with(
                "-----END%20CERTIFICATE-----%0A\";Subject=\"CN=ci,O=Example\";\
                 URI=spiffe://cluster.local/ns/ci/sa/runner;DNS=ci.example;DNS=b.example"
            ),
            "{header}"
        );
        assert_eq!(cert.sha256.len(), 64);
        assert_eq!(cert.der, der);
    }

    #[test]
    fn values_with_separators_are_quoted() {
        assert_eq!(value("a.example"), "a.example");
        assert_eq!(value("urn:x;y=z"), "\"urn:x;y=z\"");
        assert_eq!(quoted("CN=a\\,b \"q\""), "\"CN=a\\\\,b \\\"q\\\"\"");
    }
}
