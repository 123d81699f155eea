//! Running the tunnel: request ids and traces, connection limits, takeovers, signals, token rotation, many tunnels, certificate renewal.

use super::*;

/// The tunnel server gives each public request its id at the edge; the
/// client's routing core keeps it, so both access lines, the upstream and
/// the answer name the same request.
#[tokio::test]
pub(super) async fn a_public_request_keeps_one_id_from_the_edge_to_the_upstream() {
    let echo = upstream::echo("traced").await;
    let mut server = TunnelServer::start().await;
    let url = echo.url();
    let mut client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    let answer = server.get("rt-a", "/traced").await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let id = answer.header("x-request-id").expect("an id").to_owned();
    assert_eq!(id.len(), 32, "{id}");
    assert_eq!(answer.json()["headers"]["x-request-id"], id.as_str());
    let logged = format!("\"request_id\":\"{id}\"");
    let line = server.process.wait_for_log(&logged).await;
    assert!(line.contains("/traced"), "{line}");
    let line = client.wait_for_log(&logged).await;
    assert!(line.contains("/traced"), "{line}");
}

#[tokio::test]
pub(super) async fn a_public_requests_trace_starts_at_the_edge_and_goes_on_in_the_routing_core() {
    let (collector, mut spans) = crate::tracing_otlp::collector().await;
    let echo = upstream::echo("traced").await;
    let any = "127.0.0.1:0".parse().unwrap();
    let otlp = collector.url();
    let edge = ["--otlp-endpoint", &otlp, "--trace-flush-ms", "50"];
    let mut server = TunnelServer::start_in_with(tokens_dir(), any, any, &edge).await;
    let yaml = format!(
        r#"
upstreams:
  - {{ name: api, endpoints: ["{}"] }}
  - {{ name: otel, endpoints: ["{otlp}"] }}
routes:
  - {{ name: api, match: {{ path_prefix: /api }}, upstream: api }}
tracing: {{ upstream: otel, flush_every: 50ms, service_name: core }}
"#,
        echo.url()
    );
    let _client = server.policy_client(&yaml, &[]).await;

    // A public client's own traceparent, sampled: not trusted at the edge
    // (--trace-trust-incoming is off), which starts the trace itself.
    let caller = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let req = server
        .request("rt-a", "GET", "/api/things")
        .header("traceparent", caller)
        .body(body(Bytes::new()))
        .unwrap();
    let answer = client::send(&client::http1(), req).await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let upstream_saw = answer.json()["headers"]["traceparent"]
        .as_str()
        .unwrap()
        .to_owned();

    let mut by_service = std::collections::HashMap::new();
    for _ in 0..2 {
        let (seen, span) = crate::tracing_otlp::next_span(&mut spans).await;
        by_service.insert(seen["service"].as_str().unwrap().to_owned(), span);
    }
    let (edge, core) = (&by_service["portcullis-tunnel-server"], &by_service["core"]);
    let trace = edge["traceId"].as_str().unwrap();
    assert_ne!(
        trace, "4bf92f3577b34da6a3ce929d0e0e4736",
        "a public client picked the trace"
    );
    assert!(
        edge.get("parentSpanId").is_none(),
        "the edge's span is the root: {edge}"
    );
    // The routing core's span is the edge's child, in the same trace, and
    // the upstream's parent is the routing core's span.
    assert_eq!(core["traceId"], trace);
    assert_eq!(core["parentSpanId"], edge["spanId"]);
    let core_span = core["spanId"].as_str().unwrap();
    assert_eq!(upstream_saw, format!("00-{trace}-{core_span}-01"));
    assert_eq!(edge["name"], "GET");
    assert_eq!(core["name"], "GET api");
    let edge_attrs = edge["attributes"].to_string();
    assert!(
        edge_attrs.contains(&format!("rt-a.{DOMAIN}")),
        "{edge_attrs}"
    );
    // The edge counts its spans, and logs the trace.
    server
        .process
        .metrics_showing(&[r#"portcullis_trace_spans_total{outcome="exported"} 1"#.into()])
        .await;
    let line = server
        .process
        .wait_for_log("\"path\":\"/api/things\"")
        .await;
    assert!(
        line.contains(&format!("\"trace_id\":\"{trace}\"")),
        "{line}"
    );
}

#[tokio::test]
pub(super) async fn a_public_connection_closes_after_its_max_requests() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let echo = upstream::echo("api").await;
    let any = "127.0.0.1:0".parse().unwrap();
    let limit = ["--public-max-requests-per-connection", "2"];
    let server = TunnelServer::start_in_with(tokens_dir(), any, any, &limit).await;
    let url = echo.url();
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    let mut conn = tokio::net::TcpStream::connect(server.public).await.unwrap();
    let request = format!("GET /x HTTP/1.1\r\nhost: rt-a.{DOMAIN}\r\n\r\n");
    for last in [false, true] {
        conn.write_all(request.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        // The echo's JSON body ends the answer.
        while !answer.ends_with(b"}") {
            let n = conn.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&answer));
            answer.extend_from_slice(&buf[..n]);
        }
        let text = String::from_utf8_lossy(&answer).to_ascii_lowercase();
        assert!(text.starts_with("http/1.1 200"), "{text}");
        assert_eq!(text.contains("connection: close"), last, "{text}");
    }
    let mut buf = [0u8; 16];
    let end = tokio::time::timeout(std::time::Duration::from_secs(5), conn.read(&mut buf)).await;
    assert!(matches!(end, Ok(Ok(0) | Err(_))), "{end:?}");
}

#[tokio::test]
pub(super) async fn a_second_client_takes_over_its_runtime_and_the_first_stops() {
    let first_up = upstream::serve(|_req| async { Response::new(full("first")) }).await;
    let second_up = upstream::serve(|_req| async { Response::new(full("second")) }).await;
    let server = TunnelServer::start().await;
    let url = first_up.url();
    let mut first = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    assert_eq!(server.get("rt-a", "/").await.body, "first");

    let url = second_up.url();
    let _second = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    let line = first.wait_for_log("another client took over").await;
    assert!(line.contains("rt-a"), "{line}");
    let status = first.wait_exit(Duration::from_secs(20)).await;
    assert!(
        !status.success(),
        "the replaced client must exit with an error"
    );
    server.wait_connections("rt-a", 2).await;
    for _ in 0..10 {
        assert_eq!(server.get("rt-a", "/").await.body, "second");
    }
}

#[tokio::test]
pub(super) async fn sigterm_drains_the_client_then_it_exits() {
    let (up, mut arrived, release) = upstream::holding().await;
    let server = TunnelServer::start().await;
    let url = up.url();
    let mut client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    let in_flight = server.slow_in_flight("rt-a", &mut arrived).await;
    client.signal("TERM");
    client.wait_for_log("closed listeners").await;
    release.notify_one();
    let answer = in_flight.await.unwrap();
    assert_eq!(answer.status, 200);
    assert_eq!(answer.body, "done /slow");
    let status = client.wait_exit(Duration::from_secs(20)).await;
    assert!(status.success(), "exit status {status:?}");
}

/// An operator used to nginx sends the server SIGHUP to "reload": it has
/// nothing to reload, and must not die of it with every tunnel.
#[tokio::test]
pub(super) async fn sighup_to_the_server_is_logged_and_its_tunnels_stay() {
    let echo = upstream::echo("kept").await;
    let mut server = TunnelServer::start().await;
    let url = echo.url();
    let client = server
        .client(
            "rt-a",
            TOKENS[0].1,
            &["--upstream", &url, "--connections", "1"],
        )
        .await;
    assert_eq!(server.get("rt-a", "/").await.status, 200);
    server.process.signal("HUP");
    server
        .process
        .wait_for_log("SIGHUP received; nothing to reload")
        .await;
    // Still the same process and the same tunnel.
    assert_eq!(server.get("rt-a", "/").await.status, 200);
    server.wait_connections("rt-a", 1).await;
    assert_eq!(client.count_logs("tunnel connected"), 1);
}

#[tokio::test]
pub(super) async fn rotating_a_token_closes_tunnels_using_the_old_one_and_the_client_follows() {
    let echo = upstream::echo("rotated").await;
    let server = TunnelServer::start().await;
    let token_dir = tempfile::tempdir().unwrap();
    let token_file = token_dir.path().join("token");
    std::fs::write(&token_file, format!("{}\n", TOKENS[0].1)).unwrap();
    let url = echo.url();
    let file = token_file.display().to_string();
    let mut client = server
        .client(
            "rt-a",
            "unused-env-token",
            &[
                "--upstream",
                &url,
                "--connections",
                "1",
                "--token-file",
                &file,
            ],
        )
        .await;
    assert_eq!(server.get("rt-a", "/").await.status, 200);

    // The Secret is rotated on both sides: the client's mounted token and
    // the server's tokens file (written aside and renamed, as a mount does).
    let new_token = "token-a-rotated-9876543210";
    std::fs::write(&token_file, new_token).unwrap();
    let tokens = server.dir.path().join("tokens.yaml");
    let text = std::fs::read_to_string(&tokens)
        .unwrap()
        .replace(&hash(TOKENS[0].1), &hash(new_token));
    std::fs::write(server.dir.path().join(".tokens.new"), text).unwrap();
    std::fs::rename(server.dir.path().join(".tokens.new"), &tokens).unwrap();

    // Within a ping interval the old tunnel is closed; the client dials
    // again with the token file's new content.
    let lost = client.wait_for_log("tunnel lost").await;
    assert_lost_with_reason(&lost);
    client.wait_for_log("tunnel connected").await;
    assert_eq!(server.get("rt-a", "/").await.status, 200);
    server
        .process
        .find_log("the runtime's token changed in the tokens file")
        .await;
}

#[tokio::test]
pub(super) async fn a_thousand_idle_tunnels_on_one_server() {
    let echo = upstream::echo("many").await;
    let server = TunnelServer::start().await;
    let before = server.process.rss_kib();
    let url = echo.url();
    let _client = server
        .client(
            "rt-a",
            TOKENS[0].1,
            &[
                "--upstream",
                &url,
                "--connections",
                "1000",
                "--workers",
                "1",
            ],
        )
        .await;
    server.wait_connections("rt-a", 1000).await;
    let after = server.process.rss_kib();
    eprintln!(
        "tunnel server RSS: {before} KiB idle, {after} KiB with 1000 tunnels: {:.1} KiB per tunnel",
        (after.saturating_sub(before)) as f64 / 1000.0
    );
    // Still serving, spread over the tunnels.
    for _ in 0..20 {
        assert_eq!(server.get("rt-a", "/").await.status, 200);
    }
}

#[tokio::test]
pub(super) async fn websocket_echo_through_the_tunnel() {
    let ws = upstream::websocket_echo().await;
    let server = TunnelServer::start().await;
    let url = ws.url();
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    server.websocket_echo("rt-a").await;
}

#[tokio::test]
pub(super) async fn a_client_dialling_again_replaces_its_half_open_tunnel_at_once() {
    let echo = upstream::echo("fresh").await;
    let mut server = TunnelServer::start().await;
    let relay = Relay::start(server.tunnel).await;
    let url = echo.url();
    let mut client = server.relayed_client(&relay, &url).await;
    server.wait_connections("rt-a", 1).await;
    // The server's side of the old tunnel stays open: by itself it would
    // notice only after the ping timeout (20 s).
    relay.cut_half_open();
    client.wait_for_log("tunnel lost").await;
    client.wait_for_log("tunnel connected").await;
    let line = server
        .process
        .wait_for_log("client dialled this slot again")
        .await;
    assert!(line.contains("rt-a"), "{line}");
    server.wait_connections("rt-a", 1).await;
    // Every request lands on the live tunnel, none on the dead one.
    for _ in 0..10 {
        let start = Instant::now();
        assert_eq!(server.get("rt-a", "/").await.status, 200);
        assert!(start.elapsed() < Duration::from_secs(5));
    }
}

#[tokio::test]
pub(super) async fn a_renewed_certificate_is_served_without_a_restart() {
    let echo = upstream::echo("renewed").await;
    let mut server = TunnelServer::start_with(true).await;
    let url = echo.url();
    let _first = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;

    // The certificate is renewed by another CA; the files are replaced as
    // a Secret update does (written aside, renamed into place).
    let renewed = crate::support::tls::TestPki::new();
    let dir = server.dir.path().to_path_buf();
    // A key that does not match the certificate is refused, and the
    // previous pair stays in use.
    std::fs::write(dir.join(".key.new"), TestKeyOnly::pem()).unwrap();
    std::fs::rename(dir.join(".key.new"), dir.join("key.pem")).unwrap();
    let _still = server
        .client("rt-b", TOKENS[1].1, &["--upstream", &url])
        .await;
    let line = server
        .process
        .wait_for_log("TLS certificate not reloaded")
        .await;
    assert!(line.contains("do not belong together"), "{line}");

    std::fs::write(dir.join(".cert.new"), &renewed.leaf_pem).unwrap();
    std::fs::write(dir.join(".key.new"), &renewed.leaf_key_pem).unwrap();
    std::fs::rename(dir.join(".key.new"), dir.join("key.pem")).unwrap();
    std::fs::rename(dir.join(".cert.new"), dir.join("cert.pem")).unwrap();
    std::fs::write(dir.join("ca.pem"), &renewed.ca_pem).unwrap();
    // Only the renewed certificate verifies with the new CA.
    let _renewed = server
        .client("rt-b", TOKENS[1].1, &["--upstream", &url])
        .await;
    server
        .process
        .wait_for_log("TLS certificate reloaded")
        .await;
    assert_eq!(server.get("rt-b", "/").await.status, 200);
}

/// A private key unrelated to any certificate in the test.
pub(super) struct TestKeyOnly;

impl TestKeyOnly {
    pub(super) fn pem() -> String {
        rcgen::KeyPair::generate().unwrap().serialize_pem()
    }
}

/// A tunnel client opens none of its policies' listeners (the tunnel
/// carries its traffic), and its reload line says so: `listeners: 0`, not
/// the number the policies name.
#[tokio::test]
pub(super) async fn a_tunnel_clients_reload_counts_the_listeners_it_opens() {
    let dir = crate::support::policy_dir(
        r#"
listeners: [{ name: http, bind: "127.0.0.1:0" }]
routes: [{ name: a, match: { path: /a }, respond: { status: 200, body: a } }]
"#,
        &[],
    );
    let server = TunnelServer::start().await;
    let path = dir.path().display().to_string();
    let mut client = server
        .client("rt-a", TOKENS[0].1, &["--policies", &path])
        .await;
    // A route more: a change to apply (an unchanged one is not applied).
    std::fs::write(
        dir.path().join("policy.yaml"),
        r#"
listeners: [{ name: http, bind: "127.0.0.1:0" }]
routes:
  - { name: a, match: { path: /a }, respond: { status: 200, body: a } }
  - { name: b, match: { path: /b }, respond: { status: 200, body: b } }
"#,
    )
    .expect("write policy");
    client.signal("HUP");
    let line = client.wait_for_log("reload: configuration applied").await;
    let fields: serde_json::Value = serde_json::from_str(&line).expect("a JSON log line");
    assert_eq!(fields["listeners"], 0, "{line}");
    assert_eq!(fields["routes"], 2, "{line}");
}
