//! Tunnels with TLS on loopback, as docs/tunnels.md's quickstart runs
//! them: `portcullis dev-certs` makes the CA and the certificate, and the
//! TLS errors people meet first say what to do.

use super::*;

/// Runs `portcullis dev-certs DIR` with its default names.
fn dev_certs(dir: &std::path::Path) {
    let out = std::process::Command::new(crate::support::binary())
        .arg("dev-certs")
        .arg(dir)
        .output()
        .expect("run portcullis");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Never overwritten: a second run refuses.
    let again = std::process::Command::new(crate::support::binary())
        .arg("dev-certs")
        .arg(dir)
        .output()
        .expect("run portcullis");
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("exists"));
}

/// The quickstart: `dev-certs`, a server for `*.tunnels.localhost` with
/// HTTPS on both sides, a client trusting `ca.crt`, and a public HTTPS
/// request verified against the same CA.
#[tokio::test]
pub(super) async fn dev_certs_make_a_tunnel_pair_work_on_loopback() {
    let dir = tokens_dir();
    let certs = dir.path().join("certs");
    dev_certs(&certs);
    let file = |name: &str| certs.join(name).display().to_string();
    let args: Vec<String> = [
        "tunnel-server",
        "--public",
        "127.0.0.1:0",
        "--public-cert",
        &file("tls.crt"),
        "--public-key",
        &file("tls.key"),
        "--tunnel-listen",
        "127.0.0.1:0",
        "--cert",
        &file("tls.crt"),
        "--key",
        &file("tls.key"),
        "--domain",
        "tunnels.localhost",
        "--tokens",
        &dir.path().join("tokens.yaml").display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let server = ProxyProcess::launch(&args, &[], "tunnel listening").await;
    let echo = upstream::echo("local").await;
    let tunnel = server.addrs["tunnel listening"];
    let client_args: Vec<String> = [
        "tunnel-client",
        "--server",
        &format!("wss://localhost:{}", tunnel.port()),
        "--ca",
        &file("ca.crt"),
        "--runtime-id",
        "rt-a",
        "--upstream",
        &echo.url(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let _client = ProxyProcess::launch(
        &client_args,
        &[("PORTCULLIS_TOKEN", TOKENS[0].1.to_owned())],
        "tunnel connected",
    )
    .await;
    let ca = std::fs::read_to_string(certs.join("ca.crt")).unwrap();
    let public = server.addrs["public listening"];
    let (_, answer) = crate::support::tls::https_get(
        public,
        "rt-a.tunnels.localhost",
        &ca,
        &[b"h2", b"http/1.1"],
        "/hello",
    )
    .await
    .expect("an HTTPS exchange verified against dev-certs' CA");
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    assert_eq!(answer.json()["upstream"], "local");
}

/// What `openssl req -x509` makes, a CA certificate served as the
/// server's own and trusted as the CA, is refused by the client with
/// what to do instead, not only webpki's name for it.
#[tokio::test]
pub(super) async fn a_self_signed_ca_as_the_servers_certificate_is_explained() {
    let dir = tokens_dir();
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let cert = params.self_signed(&key).unwrap();
    std::fs::write(dir.path().join("cert.pem"), cert.pem()).unwrap();
    std::fs::write(dir.path().join("key.pem"), key.serialize_pem()).unwrap();
    std::fs::write(dir.path().join("ca.pem"), cert.pem()).unwrap();
    let any = "127.0.0.1:0".parse().unwrap();
    let server = TunnelServer::start_in_with(dir, any, any, &[]).await;
    let mut args: Vec<String> = [
        "tunnel-client",
        "--server",
        &server.url,
        "--runtime-id",
        "rt-a",
        "--upstream",
        "http://127.0.0.1:9",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(["--ca".to_owned(), server.ca.clone().expect("a CA file")]);
    let client = ProxyProcess::launch(
        &args,
        &[("PORTCULLIS_TOKEN", TOKENS[0].1.to_owned())],
        "tunnel connection failed",
    )
    .await;
    let line = client.find_log("tunnel connection failed").await;
    assert!(line.contains("CaUsedAsEndEntity"), "{line}");
    assert!(line.contains("portcullis dev-certs"), "{line}");
}
