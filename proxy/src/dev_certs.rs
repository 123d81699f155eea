//! `portcullis dev-certs DIR`: a private CA and a certificate it signed,
//! for trying HTTPS and tunnels on loopback. A self-signed certificate
//! (`openssl req -x509`) is a CA certificate, which TLS clients refuse as
//! a server's (`CaUsedAsEndEntity`); a CA and a leaf are what a real
//! deployment has, in two files fewer than a tutorial's worth of openssl.

use std::path::Path;
use std::process::ExitCode;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};

/// The names the leaf covers by default: the host, the runtimes of a
/// tunnel server run with `--domain tunnels.localhost` (curl and browsers
/// resolve every `*.localhost` name to loopback), and the loopback
/// addresses.
pub const DEFAULT_NAMES: [&str; 4] = ["localhost", "*.tunnels.localhost", "127.0.0.1", "::1"];

/// How long both certificates are valid: short, as they are for trying.
const VALID_FOR: std::time::Duration = std::time::Duration::from_secs(90 * 86_400);

/// The files written, in `DIR`.
const FILES: [&str; 3] = ["ca.crt", "tls.crt", "tls.key"];

/// Writes `ca.crt`, `tls.crt` and `tls.key` into `dir` (made if missing),
/// the leaf covering `names`; refuses to overwrite any of them.
pub fn dev_certs(dir: &Path, names: &[String]) -> ExitCode {
    match write(dir, names) {
        Ok(()) => {
            let d = dir.display();
            println!(
                "{d}/ca.crt   the CA: give it to clients (tunnel-client --ca, curl --cacert, an upstream's tls.ca_file)\n\
                 {d}/tls.crt  a certificate for {} signed by it, valid 90 days\n\
                 {d}/tls.key  its key (readable by you alone)\n\
                 For loopback only: the CA's key is not kept, so nothing else can be signed with it.",
                names.join(", ")
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("portcullis dev-certs: {e}");
            ExitCode::FAILURE
        }
    }
}

fn write(dir: &Path, names: &[String]) -> Result<(), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    if let Some(existing) = FILES.iter().map(|f| dir.join(f)).find(|p| p.exists()) {
        return Err(format!(
            "{} exists; remove it (or pick another directory) to make new ones",
            existing.display()
        ));
    }
    let err = |e: rcgen::Error| format!("making the certificates: {e}");
    let now = time::OffsetDateTime::now_utc();
    let ca_key = KeyPair::generate().map_err(err)?;
    let mut ca = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.distinguished_name
        .push(DnType::CommonName, "Portcullis dev CA (loopback only)");
    ca.not_before = now;
    ca.not_after = now + VALID_FOR;
    let ca = CertifiedIssuer::self_signed(ca, ca_key).map_err(err)?;
    let mut leaf = CertificateParams::new(names.to_vec())
        .map_err(|e| format!("a name in {names:?} is not a DNS name or an IP address: {e}"))?;
    leaf.distinguished_name.push(
        DnType::CommonName,
        names.first().map_or("localhost", String::as_str),
    );
    leaf.not_before = now;
    leaf.not_after = now + VALID_FOR;
    let leaf_key = KeyPair::generate().map_err(err)?;
    let cert = leaf.signed_by(&leaf_key, &*ca).map_err(err)?;
    let put = |name: &str, text: String, mode: u32| {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let path = dir.join(name);
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(&path)
            .and_then(|mut f| f.write_all(text.as_bytes()))
            .map_err(|e| format!("{}: {e}", path.display()))
    };
    put("ca.crt", ca.pem(), 0o644)?;
    put("tls.crt", cert.pem(), 0o644)?;
    put("tls.key", leaf_key.serialize_pem(), 0o600)
}
