//! Certificates and keys read from PEM files, with errors a person can
//! act on: rustls-pki-types reports a broken file as byte arrays
//! (`missing section end marker: [67, 69, 82, …]`).

use std::path::Path;

use rustls_pki_types::pem::{self, PemObject};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};

use crate::files::{SMALL_LIMIT, read_bounded};

/// Every certificate in the PEM file `path` (a chain, or a CA bundle);
/// an error names the file, what is wrong, and what a PEM file looks like.
pub fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let bytes = read(path, "certificate")?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| explain(path, "certificate", "CERTIFICATE", &e))?;
    if certs.is_empty() {
        return Err(format!(
            "certificate file {}: no `-----BEGIN CERTIFICATE-----` block in it{}",
            path.display(),
            key_instead(&bytes)
        ));
    }
    Ok(certs)
}

/// The private key in the PEM file `path` (PKCS#8, PKCS#1 or SEC1).
pub fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    let bytes = read(path, "private key")?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| match e {
        pem::Error::NoItemsFound => format!(
            "private key file {}: no `-----BEGIN PRIVATE KEY-----` (or RSA/EC PRIVATE KEY) block in it{}",
            path.display(),
            if bytes.windows(17).any(|w| w == b"BEGIN CERTIFICATE") {
                ": it holds a certificate; were the certificate and key files swapped?"
            } else {
                ""
            }
        ),
        e => explain(path, "private key", "PRIVATE KEY", &e),
    })
}

fn read(path: &Path, what: &str) -> Result<Vec<u8>, String> {
    read_bounded(path, SMALL_LIMIT).map_err(|e| format!("{what} file {}: {e}", path.display()))
}

fn key_instead(bytes: &[u8]) -> &'static str {
    if bytes.windows(11).any(|w| w == b"PRIVATE KEY") {
        ": it holds a private key; were the certificate and key files swapped?"
    } else {
        ""
    }
}

fn explain(path: &Path, what: &str, label: &str, e: &pem::Error) -> String {
    let problem = match e {
        pem::Error::MissingSectionEnd { end_marker } => format!(
            "a block has no `{}` line",
            String::from_utf8_lossy(end_marker).trim()
        ),
        pem::Error::IllegalSectionStart { line } => format!(
            "`{}` is not a valid block start",
            String::from_utf8_lossy(line)
                .trim()
                .chars()
                .take(80)
                .collect::<String>()
        ),
        pem::Error::Base64Decode(e) => format!("a block's body is not base64 ({e})"),
        pem::Error::Io(e) => e.to_string(),
        pem::Error::NoItemsFound => "nothing in it".into(),
        pem::Error::SectionTooLarge => "a block is too large".into(),
        // The error is non-exhaustive: its own words for what comes next.
        other => other.to_string(),
    };
    format!(
        "{what} file {}: not PEM: {problem}. A PEM file has `-----BEGIN {label}-----`, base64 lines, and `-----END {label}-----`, each on a line of its own",
        path.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_placeholder_or_swapped_file_gets_an_error_a_person_can_act_on() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("tls.crt");
        // What deploy/ once shipped as a placeholder: one line.
        std::fs::write(
            &file,
            "-----BEGIN CERTIFICATE----- (replace) -----END CERTIFICATE-----",
        )
        .unwrap();
        let err = certificates(&file).unwrap_err();
        assert!(err.contains("tls.crt: not PEM"), "{err}");
        assert!(err.contains("on a line of its own"), "{err}");
        assert!(!err.contains("[67,"), "{err}");

        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        std::fs::write(&file, cert.signing_key.serialize_pem()).unwrap();
        let err = certificates(&file).unwrap_err();
        assert!(err.contains("swapped"), "{err}");
        std::fs::write(&file, cert.cert.pem()).unwrap();
        assert_eq!(certificates(&file).unwrap().len(), 1);
        let err = private_key(&file).unwrap_err();
        assert!(err.contains("swapped"), "{err}");
    }
}
