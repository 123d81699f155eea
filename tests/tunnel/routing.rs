//! Public requests through a tunnel to the routing core and its upstreams: routes, plugins, bodies, streams, concurrency.

use super::*;

#[tokio::test]
pub(super) async fn public_requests_reach_the_routing_core_through_the_tunnel() {
    let echo = upstream::echo("api").await;
    let server = TunnelServer::start().await;
    let routes = r#"
  - { name: api, match: { path_prefix: /api }, upstream: api }
  - { name: hello, match: { path: /hello }, respond: { status: 200, body: "hello from the cluster" } }
"#;
    let _client = server.core_client(&echo.url(), routes, &[]).await;

    let hello = server.get("rt-a", "/hello").await;
    assert_eq!(hello.status, 200);
    assert_eq!(hello.body, "hello from the cluster");
    // The server's admin endpoints only read.
    let req = Request::post(server.process.admin_url("/status"))
        .body(body(Bytes::new()))
        .unwrap();
    let a = client::send(&client::http1(), req).await;
    assert_eq!(a.status, 405);
    assert_eq!(a.header("allow"), Some("GET, HEAD"));

    server.streamed_post_with_forwarding_headers("rt-a").await;

    // The routing core's own answers come back as they are.
    assert_eq!(server.get("rt-a", "/nowhere").await.status, 404);
    // The server writes an access line per public request.
    let mut server = server;
    let line = server.process.wait_for_log("\"path\":\"/nowhere\"").await;
    assert!(line.contains("\"status\":404"), "{line}");
    assert!(!line.contains("\"tls\""), "cleartext: {line}");
    assert!(line.contains(&format!("rt-a.{DOMAIN}")), "{line}");
    server.wait_connections("rt-a", 2).await;
}

#[tokio::test]
pub(super) async fn the_webhook_route_verifies_signatures_through_the_tunnel() {
    let events = upstream::echo("events").await;
    let dir = crate::support::policy_dir(
        &format!(
            r#"
upstreams: [{{ name: events, endpoints: ["{}"] }}]
plugins: [{{ name: sig, path: webhook-signature.wasm }}]
routes:
  - name: webhooks
    match: {{ path: "/webhooks/{{*rest}}" }}
    upstream: events
    plugins: [{{ use: sig, config: {{ provider: gitlab, secret: hook-secret }} }}]
"#,
            events.url()
        ),
        &["webhook-signature"],
    );
    let server = TunnelServer::start().await;
    let path = dir.path().display().to_string();
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--policies", &path])
        .await;
    let send = |token: &str| {
        let req = server
            .request("rt-a", "POST", "/webhooks/push")
            .header("x-gitlab-token", token)
            .body(body("{}"))
            .unwrap();
        async move { client::send(&client::http1(), req).await }
    };
    assert_eq!(send("hook-secret").await.status, 200);
    let refused = send("guess").await;
    assert_eq!(refused.status, 401, "{:?}", refused.body);
}

/// The tunnel client keeps its routing core's compiled plugins in
/// `--plugin-cache` as `serve` does, and a restarted client loads them.
#[tokio::test]
pub(super) async fn a_restarted_tunnel_client_loads_its_plugins_from_the_cache() {
    let dir = crate::support::policy_dir(
        r#"
plugins: [{ name: gate, path: example-require-header.wasm }]
routes:
  - { name: api, match: { path: /api }, respond: { status: 200, body: "in" }, plugins: [{ use: gate, config: { header: x-key } }] }
"#,
        &["example-require-header"],
    );
    let cache = tempfile::tempdir().expect("tempdir");
    let server = TunnelServer::start().await;
    let path = dir.path().display().to_string();
    let cache_path = cache.path().display().to_string();
    let args = ["--policies", &path, "--plugin-cache", &cache_path];
    let first = server.client("rt-a", TOKENS[0].1, &args).await;
    first
        .find_log("plugin compiled and kept in the plugin cache")
        .await;
    assert_eq!(server.get("rt-a", "/api").await.status, 403);
    drop(first);
    // The public side knows the first client's tunnels are gone.
    server.wait_connections("rt-a", 0).await;

    let second = server.client("rt-a", TOKENS[0].1, &args).await;
    second.find_log("plugin loaded from the plugin cache").await;
    assert_eq!(second.count_logs("plugin compiled"), 0);
    assert_eq!(server.get("rt-a", "/api").await.status, 403);
}

#[tokio::test]
pub(super) async fn a_body_over_the_routes_limit_gets_413_through_the_tunnel() {
    let echo = upstream::echo("api").await;
    let server = TunnelServer::start().await;
    let routes =
        "  - { name: small, match: { path: /small }, upstream: api, max_request_body: 64KiB }";
    let _client = server.core_client(&echo.url(), routes, &[]).await;
    // The core refuses it; the public side, where the client is still
    // writing, closes with a linger so that the 413 arrives (without it
    // the client's writes fail on a reset).
    let host = format!("rt-a.{DOMAIN}");
    let text = client::post_all_then_read(server.public, &host, "/small", 8 << 20).await;
    assert!(text.starts_with("HTTP/1.1 413 "), "{text}");
    assert!(text.contains("\"request body too large\""), "{text}");
    assert!(
        text.to_ascii_lowercase().contains("connection: close"),
        "{text}"
    );
    // Under the limit it passes.
    let req = server
        .request("rt-a", "POST", "/small")
        .body(body(vec![b'a'; 1000]))
        .unwrap();
    let answer = client::send(&client::http1(), req).await;
    assert_eq!(answer.json()["body_len"], 1000);
}

/// A tunnel server, and runtime `rt-b`'s client in upstream mode in front
/// of an echo upstream named `single` (kept with them).
pub(super) async fn fronting_an_echo() -> (upstream::Upstream, TunnelServer, ProxyProcess) {
    let echo = upstream::echo("single").await;
    let server = TunnelServer::start().await;
    let url = echo.url();
    let client = server
        .client("rt-b", TOKENS[1].1, &["--upstream", &url])
        .await;
    (echo, server, client)
}

#[tokio::test]
pub(super) async fn upstream_mode_fronts_one_service() {
    let (_echo, server, _client) = fronting_an_echo().await;
    let a = server.get("rt-b", "/any/path?q=1").await;
    assert_eq!(a.status, 200);
    assert_eq!(a.json()["upstream"], "single");
    assert_eq!(a.json()["target"], "/any/path?q=1");
    let req = server
        .request("rt-b", "POST", "/upload")
        .body(body(vec![b'a'; 1000]))
        .unwrap();
    let b = client::send(&client::http1(), req).await;
    assert_eq!(b.json()["body_len"], 1000);
    // The server counts them by runtime, the client's routing core by
    // route: the bytes are the bodies the public client sent and got.
    let sent = a.body.len() + b.body.len();
    server
        .process
        .metrics_showing(&[
            r#"portcullis_tunnel_requests_total{runtime="rt-b",code="200"} 2"#.into(),
            r#"portcullis_tunnel_request_duration_seconds_count{runtime="rt-b"} 2"#.into(),
            r#"portcullis_tunnel_request_bytes_total{runtime="rt-b"} 1000"#.into(),
            format!(r#"portcullis_tunnel_response_bytes_total{{runtime="rt-b"}} {sent}"#),
        ])
        .await;
}

/// An event-stream upstream that sends one event, then a second once the
/// returned `Notify` is told.
pub(super) async fn held_events() -> (upstream::Upstream, Arc<Notify>) {
    let release = Arc::new(Notify::new());
    let held = release.clone();
    let sse = upstream::serve(move |_req| {
        let held = held.clone();
        async move {
            let (tx, mut rx) = mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(4);
            tokio::spawn(async move {
                let _ = tx.send(Ok(Frame::data(Bytes::from("data: one\n\n")))).await;
                held.notified().await;
                let _ = tx.send(Ok(Frame::data(Bytes::from("data: two\n\n")))).await;
            });
            let stream = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
            Response::builder()
                .header("content-type", "text/event-stream")
                .body(BodyExt::boxed(StreamBody::new(stream)) as RespBody)
                .unwrap()
        }
    })
    .await;
    (sse, release)
}

#[tokio::test]
pub(super) async fn server_sent_events_stream_through_the_tunnel() {
    let (sse, release) = held_events().await;
    let server = TunnelServer::start().await;
    let url = sse.url();
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    server.events_arrive_one_by_one("rt-a", &release).await;
}

#[tokio::test]
pub(super) async fn a_hundred_megabytes_up_and_down_with_bounded_memory_on_both_sides() {
    const SIZE: u64 = 100 << 20;
    let sink = upstream::echo("sink").await;
    let source = upstream::serve(|_req| async {
        Response::new(BodyExt::boxed(StreamBody::new(upstream::chunks(SIZE))) as RespBody)
    })
    .await;
    let dir = policies(&format!(
        r#"
upstreams: [{{ name: sink, endpoints: ["{}"] }}, {{ name: source, endpoints: ["{}"] }}]
routes:
  - {{ name: up, match: {{ path: /upload }}, upstream: sink }}
  - {{ name: down, match: {{ path: /download }}, upstream: source }}
"#,
        sink.url(),
        source.url()
    ));
    let server = TunnelServer::start().await;
    let path = dir.path().display().to_string();
    let client_process = server
        .client(
            "rt-a",
            TOKENS[0].1,
            &["--policies", &path, "--connections", "1", "--workers", "1"],
        )
        .await;
    // Warm up both sides before the baselines.
    assert_eq!(server.get("rt-a", "/upload").await.status, 200);
    let server_base = server.process.peak_rss_kib();
    let client_base = client_process.peak_rss_kib();

    let req = server
        .request("rt-a", "POST", "/upload")
        .body(BodyExt::boxed(StreamBody::new(upstream::chunks(SIZE))))
        .unwrap();
    let a = client::send(&client::http1(), req).await;
    assert_eq!(a.status, 200);
    assert_eq!(a.json()["body_len"], SIZE);
    // The public connection's read buffer grew for the upload: it closes
    // after the answer, and the buffer with it.
    assert_eq!(a.header("connection"), Some("close"));

    let req = server
        .request("rt-a", "GET", "/download")
        .body(body(Bytes::new()))
        .unwrap();
    let resp = client::http1().request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let mut received = 0u64;
    let mut down = resp.into_body();
    while let Some(frame) = tokio::time::timeout(Duration::from_secs(20), down.frame())
        .await
        .expect("progress")
    {
        received += frame.unwrap().data_ref().map_or(0, |d| d.len() as u64);
    }
    assert_eq!(received, SIZE);

    let server_growth = server.process.peak_rss_kib().saturating_sub(server_base);
    let client_growth = client_process.peak_rss_kib().saturating_sub(client_base);
    eprintln!(
        "peak RSS growth over 2 x 100 MiB: server {server_growth} KiB, client {client_growth} KiB"
    );
    // Windows are 4 MiB per stream and 16 MiB per connection: memory may
    // hold a window, never a body.
    for (side, growth) in [("server", server_growth), ("client", client_growth)] {
        assert!(
            growth < 48 * 1024,
            "{side} grew by {growth} KiB: bodies are being buffered"
        );
    }
}

/// An upstream that answers nobody (`through`) until `n` requests are
/// waiting: only true concurrency gets through.
pub(super) async fn gate_upstream(n: usize) -> upstream::Upstream {
    let arrived = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let all_in = Arc::new(Notify::new());
    upstream::serve(move |_req| {
        let (arrived, all_in) = (arrived.clone(), all_in.clone());
        async move {
            let notified = all_in.notified();
            if arrived.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1 == n {
                all_in.notify_waiters();
            } else {
                notified.await;
            }
            Response::new(full("through"))
        }
    })
    .await
}

#[tokio::test]
pub(super) async fn two_hundred_requests_run_at_once_over_the_tunnel() {
    const N: usize = 200;
    let gate = gate_upstream(N).await;
    let server = TunnelServer::start().await;
    let url = gate.url();
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    let c = client::http1();
    let mut requests = Vec::new();
    for i in 0..N {
        let req = server
            .request("rt-a", "GET", &format!("/r{i}"))
            .body(body(Bytes::new()))
            .unwrap();
        let c = c.clone();
        requests.push(tokio::spawn(async move { client::send(&c, req).await }));
    }
    for r in requests {
        let a = r.await.unwrap();
        assert_eq!(a.status, 200);
        assert_eq!(a.body, "through");
    }
}
