use super::*;

#[test]
fn a_hello_head_gives_its_fields() {
    let head = b"GET /_portcullis/tunnel HTTP/1.1\r\nhost: t\r\nauthorization: Bearer tok\r\nx-portcullis-runtime: rt-a\r\nx-portcullis-instance: 1-ab\r\nx-portcullis-slot: 3\r\n\r\n";
    let hello = parse_hello(head).expect("a valid hello");
    assert_eq!(hello.runtime, "rt-a");
    assert_eq!(hello.instance, "1-ab");
    assert_eq!(hello.slot, 3);
    assert_eq!(hello.token, "tok");
}

#[test]
fn a_head_for_another_path_or_not_http_is_no_hello() {
    let other = parse_hello(b"GET /other HTTP/1.1\r\nhost: t\r\n\r\n");
    // Hello has no Debug (it holds the token), so no unwrap_err.
    assert!(other.err().expect("refused").contains("/other"));
    let garbage = parse_hello(b"\x16\x03\x01garbage\r\n\r\n");
    assert!(garbage.err().expect("refused").starts_with("not a hello"));
}

#[test]
fn congestion_controls_are_named_as_the_flag_takes_them() {
    for congestion in [Congestion::Cubic, Congestion::Bbr] {
        assert_eq!(Congestion::parse(congestion.name()), Ok(congestion));
    }
    let refused = Congestion::parse("reno").unwrap_err();
    assert!(
        refused.contains("`reno`") && refused.contains("cubic or bbr"),
        "{refused}"
    );
}

/// A tunnel client's and a tunnel server's connection, one QUIC
/// connection over loopback, both ends set up with `congestion`.
async fn connected(congestion: Congestion) -> [quinn::Connection; 2] {
    let key = rcgen::KeyPair::generate().unwrap();
    let params = rcgen::CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    let cert = params.self_signed(&key).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (cert_path, key_path) = (dir.path().join("cert.pem"), dir.path().join("key.pem"));
    std::fs::write(&cert_path, cert.pem()).unwrap();
    std::fs::write(&key_path, key.serialize_pem()).unwrap();
    let server_config = tunnel_server_config(&cert_path, &key_path, congestion).unwrap();
    let server = quinn::Endpoint::server(server_config, ([127, 0, 0, 1], 0).into()).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert.der().clone()).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let mut client = quinn::Endpoint::client(([127, 0, 0, 1], 0).into()).unwrap();
    client.set_default_client_config(client_config(tls, congestion).unwrap());
    let to = server.local_addr().unwrap();
    let (dialed, accepted) = tokio::join!(
        async { client.connect(to, "localhost").unwrap().await.unwrap() },
        async { server.accept().await.unwrap().await.unwrap() },
    );
    [dialed, accepted]
}

#[tokio::test]
async fn both_ends_send_with_the_congestion_control_asked_for() {
    use quinn::congestion::{Bbr, Cubic};
    for (congestion, bbr) in [(Congestion::Cubic, false), (Congestion::Bbr, true)] {
        for conn in connected(congestion).await {
            let controller = conn.congestion_state().into_any();
            assert_eq!(controller.is::<Bbr>(), bbr, "{congestion:?}");
            assert_eq!(controller.is::<Cubic>(), !bbr, "{congestion:?}");
        }
    }
}
