//! A TLS certificate and key read from files and read again when they
//! change (a renewed cert-manager Secret, say), without a restart: each
//! handshake checks the files' modification time and length, which costs
//! two `stat` calls. A pair that fails to load keeps the previous one in
//! use and is logged once per change.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use rustls::server::{ClientHello, ResolvesServerCert};
use rustls::sign::CertifiedKey;

/// A certificate file and when the certificate in it expires (seconds
/// since the epoch; `None` when it cannot be read).
pub type CertExpiry = (std::path::PathBuf, Option<i64>);

/// What the files looked like when last read.
type Stamp = [(Option<SystemTime>, u64); 2];

/// Serves the certificate in `cert` with the key in `key`.
#[derive(Debug)]
pub struct CertFiles {
    cert: PathBuf,
    key: PathBuf,
    current: Mutex<(Stamp, Arc<CertifiedKey>)>,
}

fn stamp(path: &Path) -> (Option<SystemTime>, u64) {
    std::fs::metadata(path).map_or((None, 0), |m| (m.modified().ok(), m.len()))
}

fn load(cert: &Path, key: &Path) -> Result<CertifiedKey, String> {
    let certs = crate::pem::certificates(cert)?;
    let key_der = crate::pem::private_key(key)?;
    // aws-lc-rs signs: an RSA-2048 signature costs 256 us against ring's
    // 564 (the rest of TLS stays on ring); it is a full handshake's
    // largest cost, where nginx (OpenSSL, 241 us) led.
    let signing = rustls::crypto::aws_lc_rs::sign::any_supported_type(&key_der)
        .map_err(|e| format!("private key {}: {e}", key.display()))?;
    let certified = CertifiedKey::new(certs, signing);
    certified.keys_match().map_err(|e| {
        format!(
            "{} and {} do not belong together: {e}",
            cert.display(),
            key.display()
        )
    })?;
    Ok(certified)
}

impl CertFiles {
    /// Reads the pair; an error names the file and the problem.
    pub fn load(cert: PathBuf, key: PathBuf) -> Result<CertFiles, String> {
        let seen = [stamp(&cert), stamp(&key)];
        let certified = load(&cert, &key)?;
        Ok(CertFiles {
            current: Mutex::new((seen, Arc::new(certified))),
            cert,
            key,
        })
    }
}

impl ResolvesServerCert for CertFiles {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

/// The same pair as a client certificate (a tunnel server dialling its
/// peers), renewed the same way.
impl rustls::client::ResolvesClientCert for CertFiles {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[rustls::SignatureScheme],
    ) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

impl CertFiles {
    /// The certificate file.
    pub fn cert_path(&self) -> &Path {
        &self.cert
    }

    /// The pair, read again first when the files changed.
    pub fn current(&self) -> Arc<CertifiedKey> {
        let now = [stamp(&self.cert), stamp(&self.key)];
        let mut current = self.current.lock().unwrap_or_else(|p| p.into_inner());
        if current.0 != now {
            // Recorded either way: a broken pair is reported once, and
            // tried again when the files change again.
            current.0 = now;
            match load(&self.cert, &self.key) {
                Ok(certified) => {
                    tracing::info!(cert = %self.cert.display(), "TLS certificate reloaded");
                    current.1 = Arc::new(certified);
                }
                Err(e) => tracing::error!(
                    "TLS certificate not reloaded, the previous one stays in use: {e}"
                ),
            }
        }
        current.1.clone()
    }

    /// Whether the certificate is valid for the DNS name `name` (wildcards
    /// as clients match them).
    pub fn covers(certified: &CertifiedKey, name: &str) -> bool {
        let Ok(name) = rustls_pki_types::ServerName::try_from(name) else {
            return false;
        };
        certified.cert.first().is_some_and(|leaf| {
            webpki::EndEntityCert::try_from(leaf)
                .and_then(|cert| cert.verify_is_valid_for_subject_name(&name))
                .is_ok()
        })
    }
}

/// Several certificates on one port, chosen by the name the client asks
/// for (SNI): the first that covers it, else the first listed, as nginx
/// falls back to its default server's.
#[derive(Debug)]
pub struct ByServerName(pub Vec<CertFiles>);

impl ByServerName {
    /// Each certificate file with its current certificate's expiry
    /// (seconds since the epoch; `None` if it cannot be read).
    pub fn expiries(&self) -> Vec<CertExpiry> {
        self.0
            .iter()
            .map(|files| {
                let current = files.current();
                let expiry = current
                    .cert
                    .first()
                    .and_then(|leaf| crate::cert_expiry::not_after(leaf));
                (files.cert_path().to_path_buf(), expiry)
            })
            .collect()
    }
}

impl ResolvesServerCert for ByServerName {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        let first = self.0.first()?.current();
        let Some(name) = hello.server_name() else {
            return Some(first);
        };
        if CertFiles::covers(&first, name) {
            return Some(first);
        }
        let covering = self.0[1..]
            .iter()
            .map(CertFiles::current)
            .find(|c| CertFiles::covers(c, name));
        Some(covering.unwrap_or(first))
    }
}
