//! What the tunnel server refuses, and how: unknown runtimes, bad credentials, garbage; tunnels over TLS.

use super::*;

#[tokio::test]
pub(super) async fn unknown_and_disconnected_runtimes_get_prompt_json_errors() {
    let server = TunnelServer::start().await;
    let start = Instant::now();
    let unknown = server.get("rt-zzz", "/").await;
    assert_eq!(unknown.status, 502);
    assert_eq!(unknown.json()["error"], "unknown runtime");
    let absent = server.get("rt-a", "/").await;
    assert_eq!(absent.status, 503);
    assert_eq!(absent.json()["runtime"], "rt-a");
    let elsewhere = client::get(&format!("http://{}/", server.public)).await;
    assert_eq!(elsewhere.status, 404);
    // A gRPC client gets the error in gRPC's terms, as from the core.
    let grpc = server
        .request("rt-zzz", "POST", "/app.Service/Call")
        .header("content-type", "application/grpc")
        .body(body(Bytes::from_static(b"\0\0\0\0\0")))
        .unwrap();
    // Over HTTP/1.1, where the Host names the runtime (the h2 client
    // would send the address as :authority).
    let grpc = client::send(&client::http1(), grpc).await;
    assert_eq!(grpc.status, 200, "{:?}", grpc.body);
    assert_eq!(grpc.header("grpc-status"), Some("14"));
    assert_eq!(grpc.header("grpc-message"), Some("unknown runtime"));
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "errors must not hang"
    );
    // A runtime from the tokens file counts under its id; any other host
    // under runtime="" (a request never makes a new label value).
    let text = server
        .process
        .metrics_showing(&[
            r#"portcullis_tunnel_requests_total{runtime="rt-a",code="503"} 1"#.into(),
            r#"portcullis_tunnel_requests_total{runtime="",code="502"} 2"#.into(),
            r#"portcullis_tunnel_requests_total{runtime="",code="404"} 1"#.into(),
        ])
        .await;
    assert!(!text.contains("rt-zzz"), "{text}");
}

#[tokio::test]
pub(super) async fn bad_credentials_and_garbage_are_refused_and_logged_without_disturbing_others() {
    let echo = upstream::echo("ok").await;
    let mut server = TunnelServer::start().await;
    let url = echo.url();
    let _good = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;

    // A wrong token, and a valid token used for another runtime's id.
    for (runtime, token) in [("rt-a", "not-the-token"), ("rt-a", TOKENS[1].1)] {
        let args: Vec<String> = [
            "tunnel-client",
            "--server",
            &format!("ws://{}", server.tunnel),
            "--runtime-id",
            runtime,
            "--upstream",
            &url,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let bad = ProxyProcess::launch(
            &args,
            &[("PORTCULLIS_TOKEN", token.into())],
            "tunnel connection failed",
        )
        .await;
        let line = bad.find_log("tunnel connection failed").await;
        assert!(line.contains("401"), "{line}");
        let line = server
            .process
            .wait_for_log("bad credentials for runtime `rt-a`")
            .await;
        assert!(line.contains("tunnel connection refused"), "{line}");
    }

    // Bytes that are not a WebSocket handshake.
    let mut raw = tokio::net::TcpStream::connect(server.tunnel).await.unwrap();
    raw.write_all(b"\x16\x03\x01garbage that is not HTTP\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), raw.read_to_end(&mut buf))
        .await
        .expect("the server closes a garbage connection");
    let line = server.process.wait_for_log("not a tunnel handshake").await;
    assert!(line.contains("tunnel connection refused"), "{line}");

    // A plain HTTP request (a browser, curl) is told what the port is
    // for, rather than met with a closed connection; a load balancer's
    // health check gets 200.
    let plain = |path: &'static str| {
        let request = format!("GET {path} HTTP/1.1\r\nHost: tunnel\r\n\r\n");
        async move { client::raw(server.tunnel, request.as_bytes()).await }
    };
    let answer = plain("/").await;
    assert!(answer.starts_with("HTTP/1.1 426 "), "{answer}");
    let body: serde_json::Value =
        serde_json::from_str(answer.split_once("\r\n\r\n").unwrap().1).unwrap();
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("tunnel connections"),
        "{body}"
    );
    let line = server.process.wait_for_log("GET /)").await;
    assert!(line.contains("answered 426"), "{line}");
    let answer = plain("/healthz").await;
    assert!(answer.starts_with("HTTP/1.1 200 "), "{answer}");
    assert!(answer.ends_with("\r\n\r\nok\n"), "{answer}");

    // A head the public port cannot parse gets the proxy's JSON answer
    // and an access line.
    let answer = client::raw(
        server.public,
        b"GET / HTTP/1.1\r\nhost: rt-a.example\r\nno colon\r\n\r\n",
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
    assert!(
        answer.ends_with(r#"{"error":"malformed request head","status":400,"route":null}"#),
        "{answer}"
    );
    let line = server.process.wait_for_log("request head refused").await;
    assert!(
        line.contains(r#""error":"invalid HTTP header parsed""#),
        "{line}"
    );

    // The good tunnel never noticed.
    assert_eq!(server.get("rt-a", "/still").await.status, 200);
}

#[tokio::test]
pub(super) async fn a_client_that_breaks_the_websocket_framing_loses_its_tunnel_alone() {
    let echo = upstream::echo("ok").await;
    let mut server = TunnelServer::start().await;
    let url = echo.url();
    let _good = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    // rt-b's client, by hand: a valid handshake, then a text frame,
    // which no tunnel sends.
    let mut raw = tokio::net::TcpStream::connect(server.tunnel).await.unwrap();
    let handshake = format!(
        "GET /_portcullis/tunnel HTTP/1.1\r\nhost: tunnel\r\nconnection: Upgrade\r\n\
         upgrade: websocket\r\nsec-websocket-version: 13\r\n\
         sec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nauthorization: Bearer {}\r\n\
         x-portcullis-runtime: rt-b\r\nx-portcullis-instance: 1-raw\r\n\r\n",
        TOKENS[1].1
    );
    raw.write_all(handshake.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        raw.read_exact(&mut byte).await.unwrap();
        head.push(byte[0]);
    }
    let head = String::from_utf8(head).unwrap();
    assert!(head.starts_with("HTTP/1.1 101 "), "{head}");
    // RFC 6455's own example key and its answer.
    assert!(
        head.contains("sec-websocket-accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo="),
        "{head}"
    );
    let mask = [1u8, 2, 3, 4];
    raw.write_all(&[
        0x81,
        0x81,
        mask[0],
        mask[1],
        mask[2],
        mask[3],
        b'x' ^ mask[0],
    ])
    .await
    .unwrap();
    // Named in the warning, whichever of the connection and the ping
    // meets it first ("tunnel lost", "tunnel ping failed").
    let line = server
        .process
        .wait_for_log("a text frame on a tunnel")
        .await;
    assert!(line.contains("WARN") && line.contains("rt-b"), "{line}");
    // The other runtime's tunnel serves on.
    let ok = server.get("rt-a", "/").await;
    assert_eq!(ok.status, 200);
}

#[tokio::test]
pub(super) async fn tunnels_run_over_tls_with_a_private_ca() {
    let echo = upstream::echo("tls").await;
    let server = TunnelServer::start_with(true).await;
    assert!(server.url.starts_with("wss://"));
    let url = echo.url();
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    let a = server.get("rt-a", "/over-tls").await;
    assert_eq!(a.status, 200);
    assert_eq!(a.json()["upstream"], "tls");
}

/// deploy/ ships no credential that works: its tokens file names no
/// runtime, a tokens file with the hash of a published placeholder (what
/// deploy/ once shipped: `change-me`) stops the server's start, and the
/// client refuses the placeholder its Secret ships with.
#[test]
pub(super) fn no_credential_from_deploy_or_an_example_lets_anyone_in() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let shipped = std::fs::read_to_string(repo.join("deploy/tunnel-server/tokens.yaml")).unwrap();
    let runtimes = shipped
        .lines()
        .filter(|l| !l.trim_start().starts_with('#') && l.contains(':'))
        .count();
    assert_eq!(
        runtimes, 0,
        "deploy/tunnel-server/tokens.yaml names a runtime:\n{shipped}"
    );

    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens.yaml");
    std::fs::write(&tokens, format!("rt-a: {}\n", hash("change-me"))).unwrap();
    let out = server_command(&dir).output().expect("run portcullis");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("tokens.yaml"), "{stderr}");
    assert!(
        stderr.contains("runtime `rt-a`: this is the hash of `change-me`"),
        "{stderr}"
    );

    // The client's Secret as deploy/tunnel-client ships it.
    let kustomization =
        std::fs::read_to_string(repo.join("deploy/tunnel-client/kustomization.yaml")).unwrap();
    let placeholder = kustomization
        .split("literals: [token=")
        .nth(1)
        .and_then(|rest| rest.split(']').next())
        .expect("the Secret's literal");
    let token = dir.path().join("token");
    std::fs::write(&token, placeholder).unwrap();
    let out = std::process::Command::new(crate::support::binary())
        .args([
            "tunnel-client",
            "--server",
            "ws://127.0.0.1:9",
            "--runtime-id",
            "rt-a",
        ])
        .args([
            "--upstream",
            "http://127.0.0.1:9",
            "--admin",
            "off",
            "--token-file",
        ])
        .arg(&token)
        .output()
        .expect("run portcullis");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("holds `{placeholder}`, a placeholder")),
        "{stderr}"
    );
}
