//! Listeners, readiness, the status page, connection caps, the spread over workers and per-client rate limits.

use super::*;

/// The tunnel client serves the tunnel only: on the default policies
/// (whose listener, on 0.0.0.0:8080, trusts X-Forwarded-*) it opens no
/// TCP listener but its admin, so nothing that reaches the pod gets past
/// the tunnel server; the policies' routes still answer through the
/// tunnel. (`--open-listeners` opens them: see the readiness test.)
#[tokio::test]
pub(super) async fn the_tunnel_client_opens_no_listener_of_its_policies() {
    let server = TunnelServer::start().await;
    let client = server.client("rt-a", TOKENS[0].1, &[]).await;
    let admin = client.admin.expect("admin listener").port();
    assert_eq!(client.listening_tcp_ports(), [admin]);
    let status = client.status().await;
    let listeners = &status["config"]["listeners"];
    assert_eq!(listeners.as_array().map(Vec::len), Some(0), "{listeners}");
    // The default policies' /healthz, answered through the tunnel.
    let healthz = server.get("rt-a", "/healthz").await;
    assert_eq!(healthz.status, 200, "{:?}", healthz.body);
}

/// The tunnel server's status page shows the connected runtimes with
/// their tunnels' transport, RTT and requests in flight.
#[tokio::test]
pub(super) async fn the_tunnel_servers_status_page_shows_its_runtimes() {
    let echo = upstream::echo("rt").await;
    let server = TunnelServer::start().await;
    let url = echo.url();
    let _client = server
        .client(
            "rt-a",
            TOKENS[0].1,
            &["--upstream", &url, "--connections", "1"],
        )
        .await;
    // The RTT is measured by the server's pings: wait until one is in.
    let status = server
        .process
        .wait_status("a measured RTT", |s| {
            s["runtimes"][0]["tunnels"][0]["rtt_ms"]
                .as_f64()
                .is_some_and(|rtt| rtt > 0.0)
        })
        .await;
    let dom = crate::support::browser::rendered(&server.process.admin_url("/")).await;
    let text = crate::status_page::visible_text(&dom);
    assert!(
        text.contains(&format!("tunnel server for *.{DOMAIN}")),
        "{text}"
    );
    assert!(text.contains("1 runtimes connected"), "{text}");
    let remote = status["runtimes"][0]["tunnels"][0]["remote"]
        .as_str()
        .expect("remote");
    assert!(
        text.contains(&format!("rt-a 1 websocket {remote}")),
        "{text}"
    );
    assert!(text.contains(" ms "), "no RTT: {text}");
}

#[tokio::test]
pub(super) async fn the_client_is_ready_only_while_a_tunnel_carries_pings() {
    let dir = policies(
        r#"
listeners: [{ name: local, bind: "127.0.0.1:0" }]
routes: [{ name: readyz, match: { path: /readyz }, health: ready }]
"#,
    );
    // No server yet: the client keeps dialling a closed port (held, so no
    // other test's connection takes it before the server binds it).
    let (tunnel_port, _held) = crate::support::reserved_port();
    let path = dir.path().display().to_string();
    let args: Vec<String> = [
        "tunnel-client",
        "--server",
        &format!("ws://127.0.0.1:{tunnel_port}"),
        "--runtime-id",
        "rt-a",
        "--policies",
        &path,
        "--open-listeners",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut client = ProxyProcess::launch(
        &args,
        &[("PORTCULLIS_TOKEN", TOKENS[0].1.into())],
        "listening",
    )
    .await;
    client.wait_for_log("tunnel connection failed").await;
    assert_eq!(client::get(&client.url("/readyz")).await.status, 503);
    assert_eq!(client::get(&client.admin_url("/readyz")).await.status, 503);

    // The server comes up where the client is dialling.
    let _server = TunnelServer::start_in(
        tokens_dir(),
        "127.0.0.1:0".parse().unwrap(),
        format!("127.0.0.1:{tunnel_port}").parse().unwrap(),
    )
    .await;
    client.wait_for_log("tunnel connected").await;
    assert_eq!(client::get(&client.url("/readyz")).await.status, 200);
    assert_eq!(client::get(&client.admin_url("/readyz")).await.status, 200);
}

#[tokio::test]
pub(super) async fn public_connections_beyond_the_cap_wait_for_a_free_slot() {
    let echo = upstream::echo("capped").await;
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let server =
        TunnelServer::start_in_with(tokens_dir(), any, any, &["--max-connections", "1"]).await;
    let url = echo.url();
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    // The first public connection holds the only slot (keep-alive, idle).
    let mut first = tokio::net::TcpStream::connect(server.public).await.unwrap();
    first
        .write_all(format!("GET / HTTP/1.1\r\nHost: rt-a.{DOMAIN}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = [0u8; 256];
    let n = first.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));

    let req = server
        .request("rt-a", "GET", "/second")
        .body(body(Bytes::new()))
        .unwrap();
    let mut second = tokio::spawn(async move { client::send(&client::http1(), req).await });
    let waited = tokio::time::timeout(Duration::from_millis(300), &mut second).await;
    assert!(
        waited.is_err(),
        "second connection was served while the first held the only slot"
    );
    drop(first);
    let answer = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .expect("served after the slot was freed")
        .unwrap();
    assert_eq!(answer.status, 200);
}

/// An `rt-a` client whose policies answer `/who...` themselves, with
/// `here`; the policy directory lives as long as the client.
pub(super) async fn answering_here(server: &TunnelServer) -> (tempfile::TempDir, ProxyProcess) {
    let dir = policies(
        r#"routes: [{ name: who, match: { path_prefix: /who }, respond: { status: 200, body: here } }]"#,
    );
    let path = dir.path().display().to_string();
    let client = server
        .client("rt-a", TOKENS[0].1, &["--policies", &path])
        .await;
    (dir, client)
}

#[tokio::test]
pub(super) async fn public_connections_are_spread_evenly_over_the_workers() {
    // As in the routing core: 16 connections spread by the kernel's hash
    // alone land 4/4/4/4 on four workers only 1.5% of the time.
    let any: SocketAddr = "127.0.0.1:0".parse().unwrap();
    let mut server = TunnelServer::start_in_with(tokens_dir(), any, any, &["--workers", "4"]).await;
    let _client = answering_here(&server).await;
    let host = format!("rt-a.{DOMAIN}");
    // Opened one after another and all kept open, as an ingress pool.
    let mut conns = Vec::new();
    for i in 0..16 {
        let mut conn = tokio::net::TcpStream::connect(server.public).await.unwrap();
        client::get_on(&mut conn, &host, &format!("/who?c={i:02}"), "here").await;
        server.process.wait_for_log(&format!("c={i:02}\"")).await;
        conns.push(conn);
    }
    // Connections handed to another worker keep serving.
    for (i, conn) in conns.iter_mut().enumerate() {
        client::get_on(conn, &host, &format!("/who?again={i:02}"), "here").await;
    }
    assert_eq!(
        server.process.access_per_worker("c=", 4),
        [4, 4, 4, 4],
        "public connections per worker"
    );
}

/// Public HTTP/3 connections are served by every worker in turn, not all
/// by the one that drives the QUIC endpoint.
#[tokio::test]
pub(super) async fn public_http3_connections_are_spread_over_the_workers() {
    let (mut server, pki) = TunnelServer::start_https(&["--http3", "--workers", "2"]).await;
    let _client = answering_here(&server).await;
    let host = format!("rt-a.{DOMAIN}");
    for i in 0..4 {
        let path = format!("/who?h3c={i}");
        let answer = h3_get(server.public, &host, &pki.ca_pem, &path).await;
        assert_eq!(answer.status, 200);
        assert_eq!(answer.body, "here");
        server.process.wait_for_log(&format!("h3c={i}\"")).await;
    }
    assert_eq!(
        server.process.access_per_worker("h3c=", 2),
        [2, 2],
        "HTTP/3 connections per worker"
    );
}

/// `--public-rate-limit` on the public side: per client, a burst, then
/// 429 naming the runtime with `Retry-After`; the tunnel and other
/// clients behind a trusted balancer are untouched. A rate that does not
/// parse stops the server at start, saying so.
#[tokio::test]
pub(super) async fn the_public_side_limits_each_client_rate() {
    let echo = upstream::echo("limited").await;
    let any = "127.0.0.1:0".parse().unwrap();
    let server = TunnelServer::start_in_with(
        tokens_dir(),
        any,
        any,
        &[
            "--public-rate-limit",
            "60/h",
            "--public-rate-burst",
            "1",
            "--trust-forwarded-headers",
        ],
    )
    .await;
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &echo.url()])
        .await;
    let from = |client: &str| {
        server
            .request("rt-a", "GET", "/x")
            .header("x-forwarded-for", client)
            .body(body(Bytes::new()))
            .unwrap()
    };
    for _ in 0..2 {
        let answer = client::send(&client::http1(), from("203.0.113.7")).await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
    }
    let limited = client::send(&client::http1(), from("203.0.113.7")).await;
    assert_eq!(limited.status, 429, "{:?}", limited.body);
    assert_eq!(limited.json()["runtime"], "rt-a");
    assert_eq!(limited.json()["error"], "rate limit exceeded");
    let retry: u64 = limited.headers["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((59..=60).contains(&retry), "Retry-After {retry}");
    // Another client behind the same balancer has its own allowance.
    let other = client::send(&client::http1(), from("198.51.100.1")).await;
    assert_eq!(other.status, 200, "{:?}", other.body);

    let dir = tokens_dir();
    let out = server_command(&dir)
        .args(["--public-rate-limit", "many"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--public-rate-limit: rate `many`"),
        "{stderr}"
    );
}

/// `portcullis tunnel-server` on free loopback ports with the tokens in
/// `dir`, no admin listener: for tests of what it refuses at start.
pub(super) fn server_command(dir: &tempfile::TempDir) -> std::process::Command {
    let mut command = std::process::Command::new(crate::support::binary());
    command.args([
        "tunnel-server",
        "--public",
        "127.0.0.1:0",
        "--tunnel-listen",
        "127.0.0.1:0",
        "--domain",
        DOMAIN,
        "--tokens",
        &dir.path().join("tokens.yaml").display().to_string(),
        "--admin",
        "off",
    ]);
    command
}

/// A public HEAD over HTTP/2 gets a bodiless answer, whether the runtime's
/// routing core answers it through the tunnel or the server answers it
/// itself (a runtime it does not know): a body there is a protocol error
/// that the client turns into a reset.
#[tokio::test]
pub(super) async fn a_public_http2_head_gets_a_bodiless_answer() {
    let (_echo, server, _client) = fronting_an_echo().await;
    let h2 = server.h2().await;
    for (runtime, status) in [("rt-b", 200), ("nobody", 502)] {
        let send = async |method: &str| {
            let req = Request::builder()
                .method(method)
                .uri(format!("http://{runtime}.{DOMAIN}/any"))
                .body(http_body_util::Empty::<Bytes>::new())
                .unwrap();
            let resp = h2.clone().send_request(req).await.expect("answered");
            let status = resp.status().as_u16();
            let body = resp.into_body().collect().await.expect("a whole body");
            (status, body.to_bytes())
        };
        let (get, got) = send("GET").await;
        let (head, headed) = send("HEAD").await;
        assert_eq!((get, head), (status, status), "{runtime}");
        assert!(!got.is_empty());
        assert!(headed.is_empty(), "{runtime}: {headed:?}");
    }
}
