//! aioquic (PyPI), a second HTTP/3 client with a QUIC and HTTP/3 stack
//! of its own, beside quinn/h3's in `tls`: run as `tests/support/h3_client.py`
//! in the virtualenv tests/run.sh makes.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// The virtualenv's Python: `$PORTCULLIS_AIOQUIC_PYTHON`, or the one in
/// the target directory.
fn python() -> PathBuf {
    super::installed(
        "PORTCULLIS_AIOQUIC_PYTHON",
        "aioquic-venv/bin/python",
        "tests/venv.sh <target>/aioquic-venv python aioquic==1.7.2",
    )
}

/// One HTTP/3 request to `addr` for `name` (SNI and `:authority`),
/// trusting the CA in `ca`, with a body of `body` bytes: status, headers
/// and body as JSON.
pub async fn request(
    addr: SocketAddr,
    name: &str,
    ca: &Path,
    (method, path, body): (&str, &str, usize),
) -> serde_json::Value {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/support/h3_client.py");
    let run = tokio::process::Command::new(python())
        .arg(script)
        .args([&addr.ip().to_string(), &addr.port().to_string(), name])
        .arg(ca)
        .args([method, path, &body.to_string()])
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(std::time::Duration::from_secs(30), run)
        .await
        .expect("aioquic answered within 30 s")
        .expect("aioquic ran");
    assert!(
        out.status.success(),
        "aioquic failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("aioquic's answer as JSON")
}
