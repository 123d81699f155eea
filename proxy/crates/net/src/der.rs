//! Just enough of a DER reader to pick fields out of an X.509 certificate
//! (expiry, subject, alternative names): webpki verifies certificates but
//! exposes none of these, and an X.509 crate would bring a parser stack
//! (nom, asn1-rs, an OID registry) for a handful of fields.

/// The contents of the DER element at the start of `der`, which must
/// have `tag`, and what follows it.
pub fn element(der: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    if *der.first()? != tag {
        return None;
    }
    any_element(der)
}

/// The contents of the DER element at the start of `der`, whatever its
/// tag, and what follows it.
pub fn any_element(der: &[u8]) -> Option<(&[u8], &[u8])> {
    let first = *der.get(1)?;
    let (len, header) = if first < 0x80 {
        (usize::from(first), 2)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 {
            return None;
        }
        let len = der
            .get(2..2 + n)?
            .iter()
            .fold(0usize, |l, b| (l << 8) | usize::from(*b));
        (len, 2 + n)
    };
    let body = der.get(header..header.checked_add(len)?)?;
    Some((body, &der[header + len..]))
}

/// The elements of a SEQUENCE's or SET's contents, as (tag, contents,
/// whole element), stopping at the first that does not parse.
pub fn elements(mut der: &[u8]) -> impl Iterator<Item = (u8, &[u8], &[u8])> {
    std::iter::from_fn(move || {
        let tag = *der.first()?;
        let (body, rest) = any_element(der)?;
        let whole = &der[..der.len() - rest.len()];
        der = rest;
        Some((tag, body, whole))
    })
}

/// The fields of a certificate's `tbsCertificate` from `serialNumber` on
/// (the optional `[0] version` skipped).
pub fn tbs_fields(cert: &[u8]) -> Option<&[u8]> {
    // Certificate ::= SEQUENCE { tbsCertificate SEQUENCE { [0] version
    // OPTIONAL, serialNumber, signature, issuer, validity, subject,
    // subjectPublicKeyInfo, [1], [2], [3] extensions }, ... }
    let (certificate, _) = element(cert, 0x30)?;
    let (tbs, _) = element(certificate, 0x30)?;
    if tbs.first() == Some(&0xa0) {
        return Some(element(tbs, 0xa0)?.1);
    }
    Some(tbs)
}

/// An OBJECT IDENTIFIER's contents in dotted form (`2.5.4.3`).
pub fn oid_string(oid: &[u8]) -> Option<String> {
    let mut arcs = Vec::new();
    let mut value: u64 = 0;
    for (i, b) in oid.iter().enumerate() {
        value = value.checked_mul(128)? | u64::from(b & 0x7f);
        if b & 0x80 == 0 {
            if arcs.is_empty() {
                let first = (value / 40).min(2);
                arcs.push(first);
                arcs.push(value - first * 40);
            } else {
                arcs.push(value);
            }
            value = 0;
        } else if i + 1 == oid.len() {
            return None;
        }
    }
    if arcs.is_empty() {
        return None;
    }
    Some(
        arcs.iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join("."),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_lengths_and_truncation() {
        let mut long = vec![0x04, 0x81, 200];
        long.extend([7u8; 200]);
        long.push(0x05);
        let (body, rest) = element(&long, 0x04).unwrap();
        assert_eq!((body.len(), rest), (200, &[0x05][..]));
        assert_eq!(element(&long, 0x30), None);
        assert_eq!(any_element(&long[..100]), None);
        assert_eq!(any_element(&[0x04, 0x80]), None);
    }

    #[test]
    fn elements_in_order() {
        let seq = [0x02, 0x01, 0x05, 0x0c, 0x02, b'h', b'i'];
        let found: Vec<_> = elements(&seq).collect();
        assert_eq!(found.len(), 2);
        assert_eq!(found[0], (0x02, &[5u8][..], &seq[..3]));
        assert_eq!(found[1].1, b"hi");
    }

    #[test]
    fn oids_in_dotted_form() {
        assert_eq!(oid_string(&[0x55, 0x04, 0x03]).as_deref(), Some("2.5.4.3"));
        // 1.2.840.113549.1.9.1 (emailAddress): multi-byte arcs.
        let email = [0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x09, 0x01];
        assert_eq!(oid_string(&email).as_deref(), Some("1.2.840.113549.1.9.1"));
        assert_eq!(oid_string(&[0x86]), None);
        assert_eq!(oid_string(&[]), None);
    }
}
