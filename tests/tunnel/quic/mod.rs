//! Tunnels over QUIC (`tunnel-client --transport quic`, `tunnel-server
//! --tunnel-quic`): the same public traffic as over the WebSocket
//! transport, each request on a QUIC stream of its own.

mod auto;
mod roaming;

use hyper_util::rt::{TokioExecutor, TokioIo};

use super::*;

/// The client arguments for a QUIC tunnel to `upstream` with `extra`.
fn quic_upstream<'a>(upstream: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["--transport", "quic", "--upstream", upstream];
    args.extend_from_slice(extra);
    args
}

/// An `rt-a` client with `connections` QUIC tunnels to `server`, in front
/// of `upstream`; returned once its first tunnel is connected.
async fn quic_client(server: &TunnelServer, upstream: &str, connections: usize) -> ProxyProcess {
    let connections = connections.to_string();
    server
        .client(
            "rt-a",
            TOKENS[0].1,
            &quic_upstream(upstream, &["--connections", &connections]),
        )
        .await
}

/// Runs the binary with `args` (and a token), which must refuse to
/// start; what it printed.
fn refused_at_start(args: &[impl AsRef<std::ffi::OsStr>]) -> String {
    let refused = std::process::Command::new(crate::support::binary())
        .args(args)
        .env("PORTCULLIS_TOKEN", TOKENS[0].1)
        .output()
        .unwrap();
    assert!(!refused.status.success());
    String::from_utf8_lossy(&refused.stderr).into_owned()
}

/// The transports the server lists for `runtime`'s tunnels.
async fn transports(server: &TunnelServer, runtime: &str) -> Vec<String> {
    let status = server.process.status().await;
    status["runtimes"]
        .as_array()
        .and_then(|r| r.iter().find(|r| r["id"] == runtime))
        .map(|r| {
            r["tunnels"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t["transport"].as_str().unwrap().to_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// A server, a one-tunnel QUIC client for `rt-a` in front of a
/// [`upstream::holding`], and a request held there: its answer comes from
/// the task, once the returned `Notify` releases it.
async fn slow_request_on_a_quic_tunnel() -> (
    TunnelServer,
    ProxyProcess,
    tokio::task::JoinHandle<Answer>,
    upstream::Upstream,
    Arc<Notify>,
) {
    let (up, mut arrived, release) = upstream::holding().await;
    let server = TunnelServer::start_quic().await;
    let url = up.url();
    let client = quic_client(&server, &url, 1).await;
    let in_flight = server.slow_in_flight("rt-a", &mut arrived).await;
    (server, client, in_flight, up, release)
}

#[tokio::test]
async fn public_requests_cross_a_quic_tunnel() {
    let echo = upstream::echo("api").await;
    let server = TunnelServer::start_quic().await;
    let routes = "  - { name: api, match: { path_prefix: /api }, upstream: api }";
    let _client = server
        .core_client(&echo.url(), routes, &["--transport", "quic"])
        .await;
    server.wait_connections("rt-a", 2).await;
    assert_eq!(transports(&server, "rt-a").await, ["quic", "quic"]);
    let status = server.process.status().await;
    assert_eq!(status["tunnel_endpoint"]["quic"], true);
    assert_eq!(status["quic_congestion"], "cubic");

    let e = server.streamed_post_with_forwarding_headers("rt-a").await;
    // The tunnel hop's TE is not passed on either.
    assert!(e["headers"].get("te").is_none(), "{e:#}");

    // A HEAD gets the head alone, and the routing core's own answers come
    // back as they are.
    let req = server
        .request("rt-a", "HEAD", "/api/head")
        .body(body(Bytes::new()))
        .unwrap();
    let head = client::send(&client::http1(), req).await;
    assert_eq!(head.status, 200);
    assert!(head.body.is_empty());
    let missing = server.get("rt-a", "/nowhere").await;
    assert_eq!(missing.status, 404);
    assert_eq!(missing.json()["error"], "no route");
}

#[tokio::test]
async fn quic_tunnels_run_with_bbr_on_both_ends_when_asked() {
    let echo = upstream::echo("api").await;
    let server = TunnelServer::start_with_tls(&["--tunnel-quic", "--quic-congestion", "bbr"]).await;
    assert_eq!(server.process.status().await["quic_congestion"], "bbr");
    let _client = server
        .client(
            "rt-a",
            TOKENS[0].1,
            &quic_upstream(&echo.url(), &["--quic-congestion", "bbr"]),
        )
        .await;
    server.wait_connections("rt-a", 2).await;
    assert_eq!(transports(&server, "rt-a").await, ["quic", "quic"]);
    // A megabyte up, sent by the server's BBR, and the echo of what came
    // back by the client's.
    server.streamed_post_with_forwarding_headers("rt-a").await;

    // Anything else is refused at the start, naming what is taken.
    let stderr = refused_at_start(&[
        "tunnel-client",
        "--server",
        &server.url,
        "--runtime-id",
        "rt-a",
        "--transport",
        "quic",
        "--quic-congestion",
        "reno",
    ]);
    assert!(
        stderr.contains("--quic-congestion") && stderr.contains("give cubic or bbr"),
        "{stderr}"
    );
}

#[tokio::test]
async fn two_hundred_requests_run_at_once_over_one_quic_connection() {
    const N: usize = 200;
    let gate = gate_upstream(N).await;
    let server = TunnelServer::start_quic().await;
    let url = gate.url();
    let _client = quic_client(&server, &url, 1).await;
    let c = client::http1();
    let requests = (0..N).map(|i| {
        let req = server
            .request("rt-a", "GET", &format!("/r{i}"))
            .body(body(Bytes::new()))
            .unwrap();
        let c = c.clone();
        tokio::spawn(async move { client::send(&c, req).await })
    });
    for r in futures_util::future::join_all(requests).await {
        let a = r.unwrap();
        assert_eq!(a.status, 200);
        assert_eq!(a.body, "through");
    }
}

#[tokio::test]
async fn server_sent_events_and_websockets_cross_a_quic_tunnel() {
    let (sse, release) = held_events().await;
    let ws = upstream::websocket_echo().await;
    let server = TunnelServer::start_quic().await;
    let (sse_url, ws_url) = (sse.url(), ws.url());
    let _events = server
        .client("rt-a", TOKENS[0].1, &quic_upstream(&sse_url, &[]))
        .await;
    let _sockets = server
        .client("rt-b", TOKENS[1].1, &quic_upstream(&ws_url, &[]))
        .await;

    server.events_arrive_one_by_one("rt-a", &release).await;
    server.websocket_echo("rt-b").await;
}

#[tokio::test]
async fn bad_quic_tunnels_are_refused_with_the_reason() {
    let echo = upstream::echo("ok").await;
    let mut server = TunnelServer::start_quic().await;
    let url = echo.url();
    let _good = server
        .client("rt-a", TOKENS[0].1, &quic_upstream(&url, &[]))
        .await;

    // A wrong token: the client is told why, the server logs it.
    let ca = server.ca.clone().unwrap();
    let bad_args: Vec<String> = [
        "tunnel-client",
        "--server",
        &server.url,
        "--ca",
        &ca,
        "--runtime-id",
        "rt-a",
        "--transport",
        "quic",
        "--upstream",
        &url,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let bad = ProxyProcess::launch(
        &bad_args,
        &[("PORTCULLIS_TOKEN", "not-the-token".into())],
        "tunnel connection failed",
    )
    .await;
    let line = bad.find_log("tunnel connection failed").await;
    assert!(
        line.contains("the server refused the tunnel: 401"),
        "{line}"
    );
    assert!(line.contains("bad credentials"), "{line}");
    let line = server
        .process
        .wait_for_log("bad credentials for runtime `rt-a`")
        .await;
    assert!(line.contains("QUIC tunnel connection refused"), "{line}");

    // A QUIC client of another protocol (an HTTP/3 browser) fails in the
    // TLS handshake, and garbage datagrams are dropped.
    let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
    socket
        .send_to(b"not a QUIC packet at all", server.tunnel)
        .await
        .unwrap();
    let pki_ca = std::fs::read_to_string(&ca).unwrap();
    let h3 = crate::support::tls::h3_request(
        server.tunnel,
        "localhost",
        &pki_ca,
        "GET",
        "/",
        Bytes::new(),
    )
    .await;
    let err = h3.expect_err("an HTTP/3 client got an answer");
    assert!(
        err.contains("peer doesn't support any known protocol"),
        "{err}"
    );

    // The good tunnel never noticed.
    assert_eq!(server.get("rt-a", "/still").await.status, 200);

    // QUIC needs TLS: a ws:// server is refused at the start.
    let mut plain = bad_args.clone();
    plain[2] = format!("ws://{}", server.tunnel);
    let stderr = refused_at_start(&plain);
    assert!(
        stderr.contains("--transport quic needs a wss:// server"),
        "{stderr}"
    );
}

#[tokio::test]
async fn a_draining_quic_client_finishes_in_flight_requests_and_gets_no_new_ones() {
    let (mut server, mut client, in_flight, _up, release) = slow_request_on_a_quic_tunnel().await;
    client.signal("TERM");
    // The server hears of the drain at once: new requests are not sent
    // into a tunnel whose client is leaving.
    server.process.wait_for_log("tunnel client draining").await;
    let meanwhile = server.get("rt-a", "/new").await;
    assert_eq!(meanwhile.status, 503, "{:?}", meanwhile.body);
    assert_eq!(meanwhile.json()["error"], "runtime is not connected");
    release.notify_one();
    let answer = in_flight.await.unwrap();
    assert_eq!(answer.status, 200);
    assert_eq!(answer.body, "done /slow");
    let status = client.wait_exit(Duration::from_secs(20)).await;
    assert!(status.success(), "exit status {status:?}");
    server.process.wait_for_log("tunnel closed").await;
}

#[tokio::test]
async fn a_restarted_server_gets_its_quic_clients_back() {
    client_comes_back_after_a_restart(true).await;
}

/// gRPC's status travels in trailers: from an HTTP/2 upstream, through
/// the tunnel, to an HTTP/2 public client, over both transports (QUIC's
/// HTTP/1.1 streams carry them as chunked trailers).
#[tokio::test]
async fn trailers_cross_both_transports() {
    let grpc = upstream::serve(|_req| async {
        let frames = [
            Ok::<_, std::io::Error>(Frame::data(Bytes::from("payload"))),
            Ok(Frame::trailers({
                let mut t = http::HeaderMap::new();
                t.insert("grpc-status", "0".parse().unwrap());
                t.insert("grpc-message", "fine".parse().unwrap());
                t
            })),
        ];
        Response::builder()
            .header("content-type", "application/grpc")
            .body(BodyExt::boxed(StreamBody::new(futures_util::stream::iter(frames))) as RespBody)
            .unwrap()
    })
    .await;
    let server = TunnelServer::start_quic().await;
    let yaml = format!(
        r#"
upstreams: [{{ name: grpc, endpoints: ["{}"], http2: true }}]
routes:
  - {{ name: grpc, match: {{ path_prefix: / }}, upstream: grpc }}
"#,
        grpc.url()
    );
    let (_ws, dir) = server.policy_client(&yaml, &[]).await;
    let path = dir.path().display().to_string();
    let _quic = server
        .client(
            "rt-b",
            TOKENS[1].1,
            &["--transport", "quic", "--policies", &path],
        )
        .await;
    for runtime in ["rt-a", "rt-b"] {
        // HTTP/2 names the runtime in :authority, so the connection is
        // made by hand to the public listener.
        let tcp = tokio::net::TcpStream::connect(server.public).await.unwrap();
        let (mut h2, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
                .await
                .unwrap();
        tokio::spawn(conn);
        let req = Request::post(format!("http://{runtime}.{DOMAIN}/svc/Method"))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(body(Bytes::from("request")))
            .unwrap();
        let resp = tokio::time::timeout(Duration::from_secs(20), h2.send_request(req))
            .await
            .expect("an answer within 20s")
            .unwrap();
        assert_eq!(resp.status(), 200, "{runtime}");
        // The declaration the QUIC hop adds stays on that hop.
        assert!(resp.headers().get("trailer").is_none(), "{runtime}");
        let all = resp.into_body().collect().await.unwrap();
        let trailers = all.trailers().cloned().unwrap_or_default();
        assert_eq!(all.to_bytes(), "payload", "{runtime}");
        assert_eq!(
            trailers.get("grpc-status").map(|v| v.to_str().unwrap()),
            Some("0"),
            "{runtime}: {trailers:?}"
        );
        assert_eq!(
            trailers.get("grpc-message").map(|v| v.to_str().unwrap()),
            Some("fine")
        );
    }
}

/// A client that goes silent (its process stopped, its host gone) leaves
/// no reset behind as TCP's would: the idle timeout ends the tunnel, and
/// the request in flight gets its 502 then rather than hanging. Once the
/// client runs again it finds its connection gone and dials anew.
#[tokio::test]
async fn a_silent_quic_client_fails_in_flight_requests_and_comes_back() {
    let (server, mut client, in_flight, _up, _release) = slow_request_on_a_quic_tunnel().await;

    client.signal("STOP");
    let answer = in_flight.await.unwrap();
    assert_eq!(answer.status, 502, "{:?}", answer.body);
    server.wait_connections("rt-a", 0).await;
    assert_eq!(server.get("rt-a", "/gone").await.status, 503);

    client.signal("CONT");
    client.wait_for_log("tunnel lost").await;
    server.serves_again(&mut client).await;
}

/// A server told to stop takes no new public connections but finishes the
/// requests in flight: the tunnels they run through (over either
/// transport) close only after them.
#[tokio::test]
async fn a_stopping_server_finishes_requests_in_flight_through_either_transport() {
    let (up, mut arrived, release) = upstream::holding().await;
    let mut server = TunnelServer::start_quic().await;
    let url = up.url();
    let _ws = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    let _quic = server
        .client("rt-b", TOKENS[1].1, &quic_upstream(&url, &[]))
        .await;
    let over_ws = server.slow_in_flight("rt-a", &mut arrived).await;
    let over_quic = server.slow_in_flight("rt-b", &mut arrived).await;
    server.process.signal("TERM");
    server.process.wait_for_log("shutting down").await;
    release.notify_waiters();
    for in_flight in [over_ws, over_quic] {
        let answer = in_flight.await.unwrap();
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        assert_eq!(answer.body, "done /slow");
    }
    let status = server.process.wait_exit(Duration::from_secs(20)).await;
    assert!(status.success(), "exit status {status:?}");
}

/// A stopping server closes each QUIC tunnel with a close its client
/// hears at once (not after the idle timeout), whichever worker drives
/// the tunnel: the endpoint's socket is registered on the first worker,
/// which keeps driving it until the other workers are done.
#[tokio::test]
async fn a_stopping_server_closes_the_quic_tunnels_of_every_worker() {
    let echo = upstream::echo("close").await;
    let mut server = TunnelServer::start_with_tls(&["--tunnel-quic", "--workers", "2"]).await;
    let url = echo.url();
    let mut client = quic_client(&server, &url, 2).await;
    server.wait_connections("rt-a", 2).await;
    let status = server.process.status().await;
    let mut workers: Vec<u64> = status["runtimes"][0]["tunnels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["worker"].as_u64().unwrap())
        .collect();
    workers.sort_unstable();
    assert_eq!(workers, [0, 1], "{status}");
    assert_eq!(server.get("rt-a", "/").await.status, 200);

    server.process.signal("TERM");
    for _ in 0..2 {
        let lost = client.wait_for_log("tunnel lost").await;
        assert!(lost.contains("the server closed the tunnel"), "{lost}");
    }
    let exit = server.process.wait_exit(Duration::from_secs(20)).await;
    assert!(exit.success(), "exit status {exit:?}");
}

/// A client stopping with nothing in flight closes at once after telling
/// the server it drains; the server sees a clean close, whichever of the
/// two it reads first, not a lost tunnel.
#[tokio::test]
async fn an_idle_quic_client_that_stops_closes_cleanly() {
    let echo = upstream::echo("idle").await;
    let mut server = TunnelServer::start_quic().await;
    let url = echo.url();
    let mut client = quic_client(&server, &url, 1).await;
    server.wait_connections("rt-a", 1).await;
    client.signal("TERM");
    assert!(client.wait_exit(Duration::from_secs(20)).await.success());
    let end = loop {
        let line = server.process.wait_for_log("\"message\":\"tunnel ").await;
        if line.contains("\"message\":\"tunnel closed")
            || line.contains("\"message\":\"tunnel lost")
        {
            break line;
        }
    };
    assert!(end.contains("\"message\":\"tunnel closed\""), "{end}");
}
