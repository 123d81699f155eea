//! Who a client certificate names: its subject and its subject
//! alternative names, read from the DER once per mutual-TLS connection,
//! for plugins (`host.client-certificate`) and the upstream
//! (`X-Forwarded-Client-Cert`'s `Subject`, `URI` and `DNS`).

use crate::der;

/// The names in a certificate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CertIdentity {
    /// The subject distinguished name in RFC 4514's string form
    /// (`CN=ci,O=Example`: most specific first, as OpenSSL prints it
    /// with `-nameopt RFC2253` and Envoy puts it in `Subject`).
    pub subject: String,
    /// `dNSName` alternative names.
    pub dns_names: Vec<String>,
    /// `uniformResourceIdentifier` alternative names (SPIFFE IDs).
    pub uris: Vec<String>,
    /// `rfc822Name` alternative names.
    pub emails: Vec<String>,
    /// `iPAddress` alternative names, in text form.
    pub ip_addresses: Vec<String>,
}

/// The names in the DER certificate `cert`; `None` when it is not a
/// certificate this reads.
pub fn read(cert: &[u8]) -> Option<CertIdentity> {
    let tbs = der::tbs_fields(cert)?;
    let (_, rest) = der::element(tbs, 0x02)?; // serialNumber
    let (_, rest) = der::element(rest, 0x30)?; // signature
    let (_, rest) = der::element(rest, 0x30)?; // issuer
    let (_, rest) = der::element(rest, 0x30)?; // validity
    let (subject, rest) = der::element(rest, 0x30)?;
    let (_, rest) = der::element(rest, 0x30)?; // subjectPublicKeyInfo
    let mut identity = CertIdentity {
        subject: distinguished_name(subject)?,
        ..CertIdentity::default()
    };
    // [1] issuerUniqueID, [2] subjectUniqueID, [3] extensions.
    let extensions = der::elements(rest)
        .find(|(tag, _, _)| *tag == 0xa3)
        .and_then(|(_, body, _)| der::element(body, 0x30))
        .map_or(&[][..], |(list, _)| list);
    for (_, extension, _) in der::elements(extensions) {
        let Some((oid, rest)) = der::element(extension, 0x06) else {
            continue;
        };
        // subjectAltName: 2.5.29.17.
        if oid != [0x55, 0x1d, 0x11] {
            continue;
        }
        // critical BOOLEAN DEFAULT FALSE, then extnValue OCTET STRING.
        let rest = der::element(rest, 0x01).map_or(rest, |(_, after)| after);
        let (value, _) = der::element(rest, 0x04)?;
        let (names, _) = der::element(value, 0x30)?;
        alternative_names(names, &mut identity);
    }
    Some(identity)
}

fn alternative_names(names: &[u8], identity: &mut CertIdentity) {
    for (tag, body, _) in der::elements(names) {
        let text = || String::from_utf8_lossy(body).into_owned();
        match tag {
            0x81 => identity.emails.push(text()),
            0x82 => identity.dns_names.push(text()),
            0x86 => identity.uris.push(text()),
            0x87 => {
                let ip = match body.len() {
                    4 => <[u8; 4]>::try_from(body).map(std::net::IpAddr::from).ok(),
                    16 => <[u8; 16]>::try_from(body).map(std::net::IpAddr::from).ok(),
                    _ => None,
                };
                identity.ip_addresses.extend(ip.map(|ip| ip.to_string()));
            }
            _ => {}
        }
    }
}

/// RFC 4514's string form of a `Name` (a SEQUENCE of RDN SETs): the
/// last RDN first, attributes of one RDN joined with `+`.
fn distinguished_name(name: &[u8]) -> Option<String> {
    let mut rdns = Vec::new();
    for (tag, rdn, _) in der::elements(name) {
        if tag != 0x31 {
            return None;
        }
        let mut attributes = Vec::new();
        for (_, pair, _) in der::elements(rdn) {
            let (oid, rest) = der::element(pair, 0x06)?;
            let (value_tag, value, whole) = der::elements(rest).next()?;
            let name = short_name(oid).map_or_else(|| der::oid_string(oid), |n| Some(n.into()))?;
            let value = match text_value(value_tag, value) {
                Some(text) => escape(&text),
                // RFC 4514 2.4: a value with no string form is `#` and
                // its DER in hex.
                None => format!("#{}", hex::encode(whole)),
            };
            attributes.push(format!("{name}={value}"));
        }
        rdns.push(attributes.join("+"));
    }
    rdns.reverse();
    Some(rdns.join(","))
}

/// RFC 4514's names for the attribute types it lists, plus the two
/// OpenSSL also prints by name in RFC 2253 mode.
fn short_name(oid: &[u8]) -> Option<&'static str> {
    Some(match oid {
        [0x55, 0x04, 0x03] => "CN",
        [0x55, 0x04, 0x05] => "serialNumber",
        [0x55, 0x04, 0x06] => "C",
        [0x55, 0x04, 0x07] => "L",
        [0x55, 0x04, 0x08] => "ST",
        [0x55, 0x04, 0x09] => "STREET",
        [0x55, 0x04, 0x0a] => "O",
        [0x55, 0x04, 0x0b] => "OU",
        [0x09, 0x92, 0x26, 0x89, 0x93, 0xf2, 0x2c, 0x64, 0x01, 0x01] => "UID",
        [0x09, 0x92, 0x26, 0x89, 0x93, 0xf2, 0x2c, 0x64, 0x01, 0x19] => "DC",
        [0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x09, 0x01] => "emailAddress",
        _ => return None,
    })
}

/// A directory string's text: UTF8String, PrintableString, IA5String,
/// TeletexString (read as Latin-1, as in practice), BMPString.
fn text_value(tag: u8, value: &[u8]) -> Option<String> {
    match tag {
        0x0c | 0x13 | 0x16 => String::from_utf8(value.to_vec()).ok(),
        0x14 => Some(value.iter().map(|b| char::from(*b)).collect()),
        0x1e if value.len().is_multiple_of(2) => char::decode_utf16(
            value
                .chunks(2)
                .map(|pair| u16::from_be_bytes([pair[0], pair[1]])),
        )
        .collect::<Result<String, _>>()
        .ok(),
        _ => None,
    }
}

/// RFC 4514 2.4's escaping of an attribute value.
fn escape(value: &str) -> String {
    let mut out = String::with_capacity(value.len());
    let last = value.chars().count().saturating_sub(1);
    for (i, c) in value.chars().enumerate() {
        let special = matches!(c, '"' | '+' | ',' | ';' | '<' | '>' | '\\')
            || (i == 0 && matches!(c, '#' | ' '))
            || (i == last && c == ' ');
        if special {
            out.push('\\');
            out.push(c);
        } else if c == '\0' {
            out.push_str("\\00");
        } else {
            out.push(c);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{CertificateParams, DistinguishedName, DnType, KeyPair, SanType};

    fn cert(dn: DistinguishedName, sans: Vec<SanType>) -> Vec<u8> {
        let key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::default();
        params.distinguished_name = dn;
        params.subject_alt_names = sans;
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn subject_most_specific_first_and_every_kind_of_alternative_name() {
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CountryName, "DE");
        dn.push(DnType::OrganizationName, "Example GmbH");
        dn.push(DnType::CommonName, "ci-runner");
        let der = cert(
            dn,
            vec![
                SanType::DnsName("ci.example".try_into().unwrap()),
                SanType::URI("spiffe://cluster.local/ns/ci/sa/runner".try_into().unwrap()),
                SanType::DnsName("*.ci.example".try_into().unwrap()),
                SanType::Rfc822Name("ops@example.com".try_into().unwrap()),
                SanType::IpAddress("10.0.0.7".parse().unwrap()),
                SanType::IpAddress("2001:db8::1".parse().unwrap()),
            ],
        );
        let id = read(&der).unwrap();
        assert_eq!(id.subject, "CN=ci-runner,O=Example GmbH,C=DE");
        assert_eq!(id.dns_names, ["ci.example", "*.ci.example"]);
        assert_eq!(id.uris, ["spiffe://cluster.local/ns/ci/sa/runner"]);
        assert_eq!(id.emails, ["ops@example.com"]);
        assert_eq!(id.ip_addresses, ["10.0.0.7", "2001:db8::1"]);
    }

    #[test]
    fn values_are_escaped_and_unlisted_types_use_their_oid() {
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "Smith, J+co \"x\"");
        dn.push(DnType::CustomDnType(vec![1, 3, 6, 1, 4, 1, 99]), "team");
        dn.push(DnType::OrganizationalUnitName, "#1 ");
        let id = read(&cert(dn, vec![])).unwrap();
        assert_eq!(
            id.subject,
            "OU=\\#1\\ ,1.3.6.1.4.1.99=team,CN=Smith\\, J\\+co \\\"x\\\""
        );
        assert!(id.dns_names.is_empty() && id.uris.is_empty());
    }

    #[test]
    fn non_ascii_subjects_survive() {
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "Jürgen");
        assert_eq!(read(&cert(dn, vec![])).unwrap().subject, "CN=Jürgen");
    }

    #[test]
    fn anything_else_is_none() {
        assert_eq!(read(b""), None);
        assert_eq!(read(b"\x30\x03\x02\x01\x00"), None);
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "x");
        let mut cut = cert(dn, vec![]);
        cut.truncate(80);
        assert_eq!(read(&cut), None);
    }

    #[test]
    fn text_forms() {
        assert_eq!(text_value(0x1e, &[0, b'h', 0, b'i']).as_deref(), Some("hi"));
        assert_eq!(text_value(0x14, &[0xe9]).as_deref(), Some("é"));
        assert_eq!(text_value(0x04, b"raw"), None);
        assert_eq!(escape(" a "), "\\ a\\ ");
    }
}
