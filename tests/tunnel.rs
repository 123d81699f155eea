//! Tunnels end to end, all real processes on loopback: public client →
//! `portcullis tunnel-server` → WebSocket → `portcullis tunnel-client` →
//! routing core → real upstream.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper::{Request, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Notify, mpsc};

use crate::support::client::{self, Answer, body};
use crate::support::process::ProxyProcess;
use crate::support::upstream::{self, RespBody, full};

mod agree;
mod peers;
mod quic;

const DOMAIN: &str = "tunnel.test";

/// A running tunnel server with its tokens file.
struct TunnelServer {
    process: ProxyProcess,
    public: SocketAddr,
    tunnel: SocketAddr,
    dir: tempfile::TempDir,
    /// `wss://localhost:port` with `--ca` when TLS is on, else `ws://ip:port`.
    url: String,
    ca: Option<String>,
}

/// Tokens for the runtimes the tests use.
const TOKENS: [(&str, &str); 2] = [
    ("rt-a", "token-a-0123456789"),
    ("rt-b", "token-b-0123456789"),
];

fn hash(token: &str) -> String {
    use sha2::Digest;
    format!(
        "sha256:{}",
        hex::encode(sha2::Sha256::digest(token.as_bytes()))
    )
}

/// A directory with `tokens.yaml` for [`TOKENS`].
fn tokens_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let tokens: String = TOKENS
        .iter()
        .map(|(id, t)| format!("{id}: {}\n", hash(t)))
        .collect();
    std::fs::write(dir.path().join("tokens.yaml"), tokens).unwrap();
    dir
}

impl TunnelServer {
    async fn start() -> TunnelServer {
        Self::start_with(false).await
    }

    /// With `tls`, the tunnel endpoint is `wss://` with a certificate from
    /// a private CA the clients are given with `--ca`.
    async fn start_with(tls: bool) -> TunnelServer {
        if tls {
            return Self::start_with_tls(&[]).await;
        }
        let any = "127.0.0.1:0".parse().unwrap();
        Self::start_in(tokens_dir(), any, any).await
    }

    /// A server whose tunnel endpoint takes QUIC tunnels (and `wss://`),
    /// with a certificate from a private CA the clients are given.
    async fn start_quic() -> TunnelServer {
        let server = Self::start_with_tls(&["--tunnel-quic"]).await;
        assert!(server.url.starts_with("wss://"));
        server
    }

    /// [`TunnelServer::start_with`] TLS on, with `extra` arguments.
    async fn start_with_tls(extra: &[&str]) -> TunnelServer {
        let dir = tokens_dir();
        let pki = crate::support::tls::TestPki::new();
        std::fs::write(dir.path().join("cert.pem"), &pki.leaf_pem).unwrap();
        std::fs::write(dir.path().join("key.pem"), &pki.leaf_key_pem).unwrap();
        std::fs::write(dir.path().join("ca.pem"), &pki.ca_pem).unwrap();
        let any = "127.0.0.1:0".parse().unwrap();
        Self::start_in_with(dir, any, any, extra).await
    }

    async fn start_in(
        dir: tempfile::TempDir,
        public: SocketAddr,
        tunnel: SocketAddr,
    ) -> TunnelServer {
        Self::start_in_with(dir, public, tunnel, &[]).await
    }

    /// A server whose public side serves HTTPS with a `*.DOMAIN`
    /// certificate from a fresh CA (returned, for clients to trust), with
    /// `extra` arguments.
    async fn start_https(extra: &[&str]) -> (TunnelServer, crate::support::tls::TestPki) {
        let dir = tokens_dir();
        let pki = crate::support::tls::TestPki::for_names(&[&format!("*.{DOMAIN}")]);
        let (cert, key) = (dir.path().join("public.pem"), dir.path().join("key.pem"));
        std::fs::write(&cert, &pki.leaf_pem).unwrap();
        std::fs::write(&key, &pki.leaf_key_pem).unwrap();
        let (cert, key) = (cert.display().to_string(), key.display().to_string());
        let mut args = vec!["--public-cert", &cert, "--public-key", &key];
        args.extend_from_slice(extra);
        let any = "127.0.0.1:0".parse().unwrap();
        (Self::start_in_with(dir, any, any, &args).await, pki)
    }

    /// [`TunnelServer::start_in`] with `extra` arguments.
    async fn start_in_with(
        dir: tempfile::TempDir,
        public: SocketAddr,
        tunnel: SocketAddr,
        extra: &[&str],
    ) -> TunnelServer {
        let mut args: Vec<String> = [
            "tunnel-server",
            "--public",
            &public.to_string(),
            "--tunnel-listen",
            &tunnel.to_string(),
            "--domain",
            DOMAIN,
            "--tokens",
            &dir.path().join("tokens.yaml").display().to_string(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        args.extend(extra.iter().map(|a| a.to_string()));
        let tls = dir.path().join("cert.pem").exists();
        if tls {
            for (flag, file) in [("--cert", "cert.pem"), ("--key", "key.pem")] {
                args.push(flag.into());
                args.push(dir.path().join(file).display().to_string());
            }
        }
        let process = ProxyProcess::launch(&args, &[], "tunnel listening").await;
        let tunnel = process.addrs["tunnel listening"];
        TunnelServer {
            public: process.addrs["public listening"],
            url: if tls {
                format!("wss://localhost:{}", tunnel.port())
            } else {
                format!("ws://{tunnel}")
            },
            ca: tls.then(|| dir.path().join("ca.pem").display().to_string()),
            tunnel,
            process,
            dir,
        }
    }

    /// Starts a tunnel client for `runtime` with `token`, serving `target`
    /// (`--policies DIR` or `--upstream URL`), and waits until its first
    /// tunnel is connected.
    async fn client(&self, runtime: &str, token: &str, target: &[&str]) -> ProxyProcess {
        self.client_via(&self.url, runtime, token, target).await
    }

    /// A client for runtime `rt-a` whose routing core has the upstream
    /// `api` at `api_url` and these `routes` (YAML list entries), with
    /// `extra` arguments; the policy directory lives as long as it.
    async fn core_client(
        &self,
        api_url: &str,
        routes: &str,
        extra: &[&str],
    ) -> (ProxyProcess, tempfile::TempDir) {
        let yaml =
            format!("upstreams: [{{ name: api, endpoints: [\"{api_url}\"] }}]\nroutes:\n{routes}");
        self.policy_client(&yaml, extra).await
    }

    /// A client for runtime `rt-a` whose routing core serves the policy
    /// `yaml`, with `extra` arguments; the policy directory lives as long
    /// as it.
    async fn policy_client(&self, yaml: &str, extra: &[&str]) -> (ProxyProcess, tempfile::TempDir) {
        let dir = policies(yaml);
        let path = dir.path().display().to_string();
        let mut args = extra.to_vec();
        args.extend(["--policies", &path]);
        (self.client("rt-a", TOKENS[0].1, &args).await, dir)
    }

    /// [`TunnelServer::client`] dialing `url` (a relay in front of the
    /// tunnel endpoint, say).
    async fn client_via(
        &self,
        url: &str,
        runtime: &str,
        token: &str,
        target: &[&str],
    ) -> ProxyProcess {
        let mut args: Vec<String> = vec![
            "tunnel-client".into(),
            "--server".into(),
            url.into(),
            "--runtime-id".into(),
            runtime.into(),
        ];
        if let Some(ca) = &self.ca {
            args.push("--ca".into());
            args.push(ca.clone());
        }
        args.extend(target.iter().map(|s| s.to_string()));
        ProxyProcess::launch(
            &args,
            &[("PORTCULLIS_TOKEN", token.to_owned())],
            "tunnel connected",
        )
        .await
    }

    /// A one-connection `rt-a` client fronting `upstream`, dialling through
    /// `relay`.
    async fn relayed_client(&self, relay: &Relay, upstream: &str) -> ProxyProcess {
        self.client_via(
            &format!("ws://{}", relay.addr),
            "rt-a",
            TOKENS[0].1,
            &["--upstream", upstream, "--connections", "1"],
        )
        .await
    }

    /// A request to the public listener for `runtime`.
    fn request(&self, runtime: &str, method: &str, path: &str) -> http::request::Builder {
        Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.public))
            .header("host", format!("{runtime}.{DOMAIN}"))
    }

    async fn get(&self, runtime: &str, path: &str) -> Answer {
        let req = self
            .request(runtime, "GET", path)
            .body(body(Bytes::new()))
            .unwrap();
        client::send(&client::http1(), req).await
    }

    /// Posts 1 MiB to `/api/items` behind `runtime` (an echo upstream)
    /// with forwarding headers of the client's own, and checks what the
    /// upstream saw: the body whole, the client's `X-Forwarded-For` added
    /// to, its proto and host claims replaced as a direct ingress would,
    /// and nothing of the tunnel hop's. Returns the upstream's view.
    async fn streamed_post_with_forwarding_headers(&self, runtime: &str) -> serde_json::Value {
        let data = vec![7u8; 1 << 20];
        let req = self
            .request(runtime, "POST", "/api/items?x=1")
            .header("x-forwarded-for", "198.51.100.7")
            .header("x-forwarded-proto", "https")
            .header("x-forwarded-host", "spoofed.example")
            .header("x-forwarded-client-cert", "Hash=0000;Subject=\"CN=admin\"")
            .body(body(data.clone()))
            .unwrap();
        let a = client::send(&client::http1(), req).await;
        assert_eq!(a.status, 200, "{:?}", a.body);
        let e = a.json();
        assert_eq!(e["method"], "POST");
        assert_eq!(e["target"], "/api/items?x=1");
        assert_eq!(e["body_len"], 1 << 20);
        assert_eq!(e["body_fnv"], upstream::fnv(&data));
        assert_eq!(e["headers"]["x-forwarded-for"], "198.51.100.7, 127.0.0.1");
        assert_eq!(e["headers"]["x-forwarded-proto"], "http");
        assert_eq!(
            e["headers"]["x-forwarded-host"],
            format!("{runtime}.{DOMAIN}")
        );
        assert!(e["headers"].get("x-portcullis-client").is_none(), "{e:#}");
        // The public side takes no client certificates; a claimed one is
        // dropped before the tunnel.
        assert!(
            e["headers"].get("x-forwarded-client-cert").is_none(),
            "{e:#}"
        );
        e
    }

    /// Sends `GET /slow` for `runtime` and waits until it has reached the
    /// [`upstream::holding`] (told by `arrived`); the answer comes from the
    /// task returned.
    async fn slow_in_flight(
        &self,
        runtime: &str,
        arrived: &mut mpsc::UnboundedReceiver<()>,
    ) -> tokio::task::JoinHandle<Answer> {
        let req = self
            .request(runtime, "GET", "/slow")
            .body(body(Bytes::new()))
            .unwrap();
        let in_flight = tokio::spawn(async move { client::send(&client::http1(), req).await });
        tokio::time::timeout(Duration::from_secs(10), arrived.recv())
            .await
            .expect("request reached the upstream");
        in_flight
    }

    /// Checks that the events of a [`held_events`] upstream behind
    /// `runtime` arrive one by one: the first while the upstream still
    /// holds the second, which `release` lets go.
    async fn events_arrive_one_by_one(&self, runtime: &str, release: &Notify) {
        let req = self
            .request(runtime, "GET", "/events")
            .body(body(Bytes::new()))
            .unwrap();
        let resp = client::http1().request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        let mut events = resp.into_body();
        let first = tokio::time::timeout(Duration::from_secs(10), events.frame())
            .await
            .expect("first event before the upstream finished")
            .unwrap()
            .unwrap();
        assert_eq!(first.into_data().unwrap(), "data: one\n\n");
        release.notify_one();
        let rest = events.collect().await.unwrap().to_bytes();
        assert_eq!(rest, "data: two\n\n");
    }

    /// A WebSocket echo exchange with the echo server behind `runtime`.
    async fn websocket_echo(&self, runtime: &str) {
        let mut request =
            tokio_tungstenite::tungstenite::client::IntoClientRequest::into_client_request(
                format!("ws://{}/socket", self.public),
            )
            .unwrap();
        request
            .headers_mut()
            .insert("host", format!("{runtime}.{DOMAIN}").parse().unwrap());
        crate::support::client::websocket_echo(request).await;
    }

    /// Waits until `client` (`rt-a`, in front of a [`upstream::holding`])
    /// has a tunnel again, and checks a request goes through it.
    async fn serves_again(&self, client: &mut ProxyProcess) {
        client.wait_for_log("tunnel connected").await;
        let again = self.get("rt-a", "/fast").await;
        assert_eq!(again.status, 200);
        assert_eq!(again.body, "done /fast");
    }

    /// A public HTTP/2 connection to the server.
    async fn h2(&self) -> hyper::client::conn::http2::SendRequest<http_body_util::Empty<Bytes>> {
        let public = tokio::net::TcpStream::connect(self.public).await.unwrap();
        let (sender, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(public),
        )
        .await
        .unwrap();
        tokio::spawn(conn);
        sender
    }

    /// Sends `n` requests for `runtime` (`/h2/0` ...) on `sender`, each on
    /// a task of its own: aborting one resets its stream.
    fn h2_requests(
        sender: &hyper::client::conn::http2::SendRequest<http_body_util::Empty<Bytes>>,
        runtime: &str,
        n: u64,
    ) -> tokio::task::JoinSet<hyper::Result<hyper::Response<hyper::body::Incoming>>> {
        let mut requests = tokio::task::JoinSet::new();
        for i in 0..n {
            let mut sender = sender.clone();
            let req = Request::get(format!("http://{runtime}.{DOMAIN}/h2/{i}"))
                .body(http_body_util::Empty::<Bytes>::new())
                .unwrap();
            requests.spawn(async move { sender.send_request(req).await });
        }
        requests
    }

    /// Waits until the server lists `runtime` with `connections` tunnels.
    /// Waits until `runtime`'s tunnels carry `n` requests between them.
    async fn wait_active(&self, runtime: &str, n: u64) {
        self.process
            .wait_status(&format!("{n} requests in {runtime}'s tunnels"), |s| {
                let active: u64 = s["runtimes"]
                    .as_array()
                    .and_then(|r| r.iter().find(|r| r["id"] == runtime))
                    .and_then(|r| r["tunnels"].as_array())
                    .map_or(0, |t| {
                        t.iter().filter_map(|t| t["active_requests"].as_u64()).sum()
                    });
                active == n
            })
            .await;
    }

    async fn wait_connections(&self, runtime: &str, connections: usize) {
        self.process
            .wait_status(&format!("{runtime} with {connections} tunnels"), |s| {
                let listed = s["runtimes"]
                    .as_array()
                    .and_then(|r| r.iter().find(|r| r["id"] == runtime))
                    .map_or(0, |r| r["connections"].as_u64().unwrap_or(0) as usize);
                listed == connections
            })
            .await;
    }
}

/// A policy directory for the tunnel client's routing core.
fn policies(yaml: &str) -> tempfile::TempDir {
    crate::support::policy_dir(yaml, &[])
}

#[tokio::test]
async fn public_requests_reach_the_routing_core_through_the_tunnel() {
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
async fn the_webhook_route_verifies_signatures_through_the_tunnel() {
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
async fn a_restarted_tunnel_client_loads_its_plugins_from_the_cache() {
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
    first.find_log("plugin compiled and kept in the plugin cache");
    assert_eq!(server.get("rt-a", "/api").await.status, 403);
    drop(first);
    // The public side knows the first client's tunnels are gone.
    server.wait_connections("rt-a", 0).await;

    let second = server.client("rt-a", TOKENS[0].1, &args).await;
    second.find_log("plugin loaded from the plugin cache");
    assert_eq!(second.count_logs("plugin compiled"), 0);
    assert_eq!(server.get("rt-a", "/api").await.status, 403);
}

#[tokio::test]
async fn a_body_over_the_routes_limit_gets_413_through_the_tunnel() {
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
async fn fronting_an_echo() -> (upstream::Upstream, TunnelServer, ProxyProcess) {
    let echo = upstream::echo("single").await;
    let server = TunnelServer::start().await;
    let url = echo.url();
    let client = server
        .client("rt-b", TOKENS[1].1, &["--upstream", &url])
        .await;
    (echo, server, client)
}

#[tokio::test]
async fn upstream_mode_fronts_one_service() {
    let (_echo, server, _client) = fronting_an_echo().await;
    let a = server.get("rt-b", "/any/path?q=1").await;
    assert_eq!(a.status, 200);
    assert_eq!(a.json()["upstream"], "single");
    assert_eq!(a.json()["target"], "/any/path?q=1");
    // The server counts it by runtime, the client's routing core by route.
    server
        .process
        .metrics_showing(&[
            r#"portcullis_tunnel_requests_total{runtime="rt-b",code="200"} 1"#.into(),
            r#"portcullis_tunnel_request_duration_seconds_count{runtime="rt-b"} 1"#.into(),
        ])
        .await;
}

/// An event-stream upstream that sends one event, then a second once the
/// returned `Notify` is told.
async fn held_events() -> (upstream::Upstream, Arc<Notify>) {
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
async fn server_sent_events_stream_through_the_tunnel() {
    let (sse, release) = held_events().await;
    let server = TunnelServer::start().await;
    let url = sse.url();
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    server.events_arrive_one_by_one("rt-a", &release).await;
}

#[tokio::test]
async fn a_hundred_megabytes_up_and_down_with_bounded_memory_on_both_sides() {
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
async fn gate_upstream(n: usize) -> upstream::Upstream {
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
async fn two_hundred_requests_run_at_once_over_the_tunnel() {
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

#[tokio::test]
async fn unknown_and_disconnected_runtimes_get_prompt_json_errors() {
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
async fn bad_credentials_and_garbage_are_refused_and_logged_without_disturbing_others() {
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
        let line = bad.find_log("tunnel connection failed");
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
        answer.ends_with(r#"{"error":"malformed request head","route":null,"status":400}"#),
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
async fn tunnels_run_over_tls_with_a_private_ca() {
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

/// With `--public-cert`/`--public-key` the public side is HTTPS with a
/// wildcard certificate for the domain: HTTP/1.1 and HTTP/2 (ALPN), the
/// routing core told `X-Forwarded-Proto: https`; a client speaking plain
/// HTTP to it, or not trusting it, is refused, counted, and disturbs
/// nothing.
#[tokio::test]
async fn the_public_side_serves_https_with_a_wildcard_certificate() {
    let echo = upstream::echo("https").await;
    let (server, pki) = TunnelServer::start_https(&[]).await;
    let status = server.process.status().await;
    assert_eq!(status["public"]["tls"], true, "{status}");
    assert_eq!(status["domain"], DOMAIN);
    let url = echo.url();
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    let host = format!("rt-a.{DOMAIN}");
    let https = |alpn: &'static [&'static [u8]]| {
        crate::support::tls::https_get(server.public, &host, &pki.ca_pem, alpn, "/secure?q=1")
    };

    const H1: &[&[u8]] = &[b"http/1.1"];
    const H2: &[&[u8]] = &[b"h2", b"http/1.1"];
    for (alpn, version) in [(H1, http::Version::HTTP_11), (H2, http::Version::HTTP_2)] {
        let (got, a) = https(alpn).await.expect("HTTPS exchange");
        assert_eq!(got, version);
        assert_eq!(a.status, 200, "{:?}", a.body);
        let seen = a.json();
        assert_eq!(seen["upstream"], "https");
        assert_eq!(seen["path"], "/secure?q=1");
        assert_eq!(seen["headers"]["x-forwarded-proto"], "https", "{seen}");
        assert_eq!(seen["headers"]["x-forwarded-host"], host.as_str(), "{seen}");
    }

    // Plain HTTP on the HTTPS port is told to use https (as nginx does);
    // a client that does not trust the certificate fails its handshake.
    // Both are counted, and the next client is served.
    let plain = client::raw(
        server.public,
        format!("GET /app HTTP/1.1\r\nhost: {host}\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(plain.starts_with("HTTP/1.1 400 "), "{plain:?}");
    assert!(plain.contains("use https://"), "{plain:?}");
    let other = crate::support::tls::TestPki::new();
    let refused =
        crate::support::tls::https_get(server.public, &host, &other.ca_pem, H2, "/").await;
    assert!(refused.is_err_and(|e| e.starts_with("TLS")));
    server
        .process
        .metrics_showing(&[
            crate::support::process::connection_errors("public", "plain_http", 1),
            crate::support::process::connection_errors("public", "tls_handshake", 1),
        ])
        .await;
    assert_eq!(https(H2).await.expect("HTTPS").1.status, 200);
    // The access line gives the TLS version, as the routing core's does.
    let mut server = server;
    let line = server
        .process
        .wait_for_log("\"path\":\"/secure?q=1\"")
        .await;
    assert!(line.contains("\"tls\":\"TLSv1.3\""), "{line}");
}

/// Behind a TLS-terminating balancer (`--trust-forwarded-headers`), the
/// balancer's `X-Forwarded-Proto` and `-Host` reach the runtime; a request
/// without them gets the server's own.
#[tokio::test]
async fn a_balancer_in_front_is_trusted_for_the_scheme_when_told() {
    let echo = upstream::echo("behind").await;
    let any = "127.0.0.1:0".parse().unwrap();
    let server =
        TunnelServer::start_in_with(tokens_dir(), any, any, &["--trust-forwarded-headers"]).await;
    let url = echo.url();
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    let req = server
        .request("rt-a", "GET", "/")
        .header("x-forwarded-proto", "https")
        .header("x-forwarded-host", "app.example.com")
        .body(body(Bytes::new()))
        .unwrap();
    let seen = client::send(&client::http1(), req).await.json();
    assert_eq!(seen["headers"]["x-forwarded-proto"], "https", "{seen}");
    assert_eq!(seen["headers"]["x-forwarded-host"], "app.example.com");
    let seen = server.get("rt-a", "/").await.json();
    assert_eq!(seen["headers"]["x-forwarded-proto"], "http", "{seen}");
    assert_eq!(
        seen["headers"]["x-forwarded-host"],
        format!("rt-a.{DOMAIN}")
    );
}

/// Behind a TCP balancer that passes TLS through (an AWS NLB), the
/// server reads the PROXY header the balancer puts before the handshake
/// (`--proxy-protocol`), and the runtime sees the client's address in
/// `X-Forwarded-For`; the balancer's health checks (version 2 LOCAL) keep
/// the connection's. A connection without a header is closed and counted,
/// and the next is served.
#[tokio::test]
async fn a_tcp_balancer_in_front_gives_the_client_address() {
    let echo = upstream::echo("behind").await;
    let (server, pki) = TunnelServer::start_https(&["--proxy-protocol"]).await;
    assert_eq!(
        server.process.status().await["public"]["proxy_protocol"],
        true
    );
    let url = echo.url();
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    let host = format!("rt-a.{DOMAIN}");
    const H2: &[&[u8]] = &[b"h2", b"http/1.1"];
    let https = |before: &'static [u8]| {
        crate::support::tls::https_get_after(server.public, before, &host, &pki.ca_pem, H2, "/")
    };

    let (_, a) = https(b"PROXY TCP4 203.0.113.7 10.0.0.1 51234 443\r\n")
        .await
        .expect("HTTPS after a PROXY header");
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(a.json()["headers"]["x-forwarded-for"], "203.0.113.7");
    let health_check = b"\r\n\r\n\0\r\nQUIT\n\x20\x00\x00\x00";
    let (_, a) = https(health_check).await.expect("HTTPS after LOCAL");
    assert_eq!(a.json()["headers"]["x-forwarded-for"], "127.0.0.1");

    assert!(https(b"").await.is_err(), "served without a PROXY header");
    server
        .process
        .metrics_showing(&[crate::support::process::connection_errors(
            "public",
            "proxy_protocol",
            1,
        )])
        .await;
    let (_, a) = https(b"PROXY TCP6 2001:db8::9 2001:db8::1 4000 443\r\n")
        .await
        .expect("HTTPS after a PROXY header");
    assert_eq!(a.json()["headers"]["x-forwarded-for"], "2001:db8::9");
}

/// With `--http3` the public side also serves HTTP/3 on the public port's
/// UDP twin, with the same certificate, and HTTPS responses advertise it
/// (`Alt-Svc`). A request over HTTP/3 reaches the runtime as one over
/// TCP does: path and query kept, an upload streamed through intact, the
/// routing core told `https`. A request in flight at shutdown finishes.
#[tokio::test]
async fn the_public_side_serves_http3_and_advertises_it() {
    let echo = upstream::echo("h3").await;
    let (server, pki) = TunnelServer::start_https(&["--http3"]).await;
    assert_eq!(server.process.status().await["public"]["http3"], true);
    let url = echo.url();
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    let host = format!("rt-a.{DOMAIN}");

    const H2: &[&[u8]] = &[b"h2", b"http/1.1"];
    let (_, a) = crate::support::tls::https_get(server.public, &host, &pki.ca_pem, H2, "/over-tcp")
        .await
        .expect("HTTPS");
    let advertised = format!("h3=\":{}\"; ma=86400", server.public.port());
    assert_eq!(a.header("alt-svc"), Some(advertised.as_str()));

    let h3 = |method: &'static str, path: &'static str, body: Vec<u8>| {
        let (host, ca) = (host.clone(), pki.ca_pem.clone());
        let addr = server.public;
        async move {
            crate::support::tls::h3_request(addr, &host, &ca, method, path, body.into())
                .await
                .expect("HTTP/3 exchange")
        }
    };
    let a = h3("GET", "/over-quic?q=1", Vec::new()).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert!(
        a.header("alt-svc").is_none(),
        "HTTP/3 answers need no Alt-Svc"
    );
    let seen = a.json();
    assert_eq!(seen["upstream"], "h3");
    assert_eq!(seen["target"], "/over-quic?q=1");
    assert_eq!(seen["headers"]["x-forwarded-proto"], "https", "{seen}");
    assert_eq!(seen["headers"]["x-forwarded-host"], host.as_str());

    let data: Vec<u8> = (0..(3 << 20) / 4)
        .flat_map(|i: u32| i.to_le_bytes())
        .collect();
    let a = h3("POST", "/upload", data.clone()).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    let seen = a.json();
    assert_eq!(seen["method"], "POST");
    assert_eq!(seen["body_len"], data.len());
    assert_eq!(seen["body_fnv"], upstream::fnv(&data));
    let mut server = server;
    let line = server.process.wait_for_log("\"path\":\"/upload\"").await;
    assert!(line.contains("\"tls\":\"TLSv1.3\""), "{line}");

    // A request in flight when the server is told to stop still gets its
    // answer (the connection is sent a GOAWAY, not closed).
    let (up, mut arrived, release) = upstream::holding().await;
    let url = up.url();
    let _slow_client = server
        .client("rt-b", TOKENS[1].1, &["--upstream", &url])
        .await;
    let slow = {
        let (host, ca, addr) = (format!("rt-b.{DOMAIN}"), pki.ca_pem.clone(), server.public);
        tokio::spawn(async move {
            crate::support::tls::h3_request(addr, &host, &ca, "GET", "/slow", Bytes::new()).await
        })
    };
    tokio::time::timeout(Duration::from_secs(10), arrived.recv())
        .await
        .expect("the HTTP/3 request reached the upstream");
    server.process.signal("TERM");
    server.process.wait_for_log("shutting down").await;
    release.notify_one();
    let answer = slow
        .await
        .unwrap()
        .expect("HTTP/3 exchange across shutdown");
    assert_eq!(answer.status, 200);
    assert_eq!(answer.body, "done /slow");
    assert!(
        server
            .process
            .wait_exit(Duration::from_secs(20))
            .await
            .success()
    );
}

/// A GET over a new HTTP/3 connection to the public side at `addr`.
async fn h3_get(addr: SocketAddr, host: &str, ca_pem: &str, path: &str) -> Answer {
    crate::support::tls::h3_request(addr, host, ca_pem, "GET", path, Bytes::new())
        .await
        .expect("HTTP/3 exchange")
}

/// An upstream that answers the first request on each connection, keeps
/// it alive, and closes it as the next request arrives (as one whose
/// keep-alive timeout fires just then); it counts the connections.
async fn closing_reused_connections() -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                let mut answered = false;
                while let Ok(n) = conn.read(&mut chunk).await {
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        buf.drain(..end + 4);
                        if answered {
                            return;
                        }
                        answered = true;
                        let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if conn.write_all(answer).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, accepted)
}

/// A bodiless HTTP/3 request is whole in hand, as over HTTP/1.1 and
/// HTTP/2: a GET that meets a pooled upstream connection closing under
/// it goes again on a new connection, and every one succeeds.
#[tokio::test]
async fn http3_gets_are_retried_when_a_pooled_upstream_connection_closes() {
    let (up, accepted) = closing_reused_connections().await;
    let (server, pki) = TunnelServer::start_https(&["--http3"]).await;
    let url = format!("http://{up}");
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url, "--workers", "1"])
        .await;
    let host = format!("rt-a.{DOMAIN}");
    for i in 0..8 {
        let path = format!("/get-{i}");
        let a = h3_get(server.public, &host, &pki.ca_pem, &path).await;
        assert_eq!(
            (a.status.as_u16(), &a.body[..]),
            (200, &b"ok"[..]),
            "{path}"
        );
    }
    // The pooled connections were met closing, and replaced.
    assert!(accepted.load(std::sync::atomic::Ordering::SeqCst) >= 8);
}

/// Errors from the runtime's side come back over HTTP/3 as they are, and
/// a connection that sends no request is closed after 10 s, as a TCP one
/// that sends no head.
#[tokio::test]
async fn http3_answers_errors_as_the_other_versions_do() {
    let (server, pki) = TunnelServer::start_https(&["--http3"]).await;
    let idle = {
        let (addr, host, ca) = (server.public, format!("rt-a.{DOMAIN}"), pki.ca_pem.clone());
        tokio::spawn(async move { crate::support::tls::h3_idle(addr, &host, &ca).await })
    };
    let get = |runtime: &str| {
        let host = format!("{runtime}.{DOMAIN}");
        let (addr, ca) = (server.public, pki.ca_pem.clone());
        async move {
            crate::support::tls::h3_request(addr, &host, &ca, "GET", "/", Bytes::new())
                .await
                .expect("HTTP/3 exchange")
        }
    };
    let unknown = get("nobody").await;
    assert_eq!(unknown.status, 502);
    assert_eq!(unknown.json()["error"], "unknown runtime");
    let offline = get("rt-a").await;
    assert_eq!(offline.status, 503);
    assert_eq!(offline.json()["runtime"], "rt-a");
    let kept = idle.await.unwrap().expect("an idle HTTP/3 connection");
    // The first-request deadline, well before either side's idle timeout
    // (the client's 30 s, the server's 75 s) would close it.
    assert!(kept < Duration::from_secs(20), "kept {kept:?}");
    server
        .process
        .metrics_showing(&[crate::support::process::connection_errors(
            "public",
            "header_timeout",
            1,
        )])
        .await;
}

/// Behind a TCP balancer that hides the clients' addresses, the tunnel
/// endpoint reads them from PROXY headers (`--tunnel-proxy-protocol`): the
/// failed-token rate limit then counts per client, so a client retrying a
/// stale token locks out itself and not every runtime behind the same
/// balancer; `/status` shows the clients' own addresses.
#[tokio::test]
async fn the_tunnel_endpoint_behind_a_balancer_limits_each_client_on_its_own() {
    use tokio::io::AsyncWriteExt;
    let echo = upstream::echo("behind-nlb").await;
    let any = "127.0.0.1:0".parse().unwrap();
    let server =
        TunnelServer::start_in_with(tokens_dir(), any, any, &["--tunnel-proxy-protocol"]).await;
    assert_eq!(
        server.process.status().await["tunnel_endpoint"]["proxy_protocol"],
        true
    );
    let attempt = |source: &str, token: &str| {
        let raw = format!(
            "PROXY TCP4 {source} 10.0.0.1 40000 443\r\n\
             GET /_portcullis/tunnel HTTP/1.1\r\nhost: tunnel\r\nupgrade: websocket\r\n\
             connection: upgrade\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
             sec-websocket-version: 13\r\nauthorization: Bearer {token}\r\n\
             x-portcullis-runtime: rt-a\r\nx-portcullis-instance: stale\r\n\
             x-portcullis-slot: 0\r\n\r\n"
        );
        let addr = server.tunnel;
        async move { client::raw(addr, raw.as_bytes()).await }
    };
    // A client with a stale token, retrying from one address.
    for _ in 0..10 {
        let answer = attempt("198.51.100.66", "stale-token").await;
        assert!(answer.starts_with("HTTP/1.1 401 "), "{answer}");
    }
    let answer = attempt("198.51.100.66", TOKENS[0].1).await;
    assert!(answer.starts_with("HTTP/1.1 429 "), "{answer}");

    // Another client through the same balancer still gets in: a relay
    // standing in for the balancer puts its address in a PROXY header.
    let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay_url = format!("ws://{}", relay.local_addr().unwrap());
    let tunnel = server.tunnel;
    let relaying = tokio::spawn(async move {
        loop {
            let Ok((mut inbound, _)) = relay.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut out = tokio::net::TcpStream::connect(tunnel).await.unwrap();
                out.write_all(b"PROXY TCP4 203.0.113.7 10.0.0.1 40001 443\r\n")
                    .await
                    .unwrap();
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
            });
        }
    });
    let url = echo.url();
    let _client = server
        .client_via(
            &relay_url,
            "rt-a",
            TOKENS[0].1,
            &["--upstream", &url, "--connections", "1"],
        )
        .await;
    assert_eq!(server.get("rt-a", "/").await.status, 200);
    let status = server.process.status().await;
    let remote = &status["runtimes"][0]["tunnels"][0]["remote"];
    assert!(
        remote
            .as_str()
            .is_some_and(|r| r.starts_with("203.0.113.7:")),
        "{status}"
    );

    // Without a header, a connection is refused and counted.
    let bare =
        client::raw_until_closed(server.tunnel, b"GET /healthz HTTP/1.1\r\nhost: t\r\n\r\n").await;
    assert_eq!(bare, "");
    server
        .process
        .metrics_showing(&[crate::support::process::connection_errors(
            "tunnel",
            "proxy_protocol",
            1,
        )])
        .await;
    relaying.abort();
}

/// Request heads as large as the routing core takes (32 KiB by default;
/// large cookies are common) cross the tunnel whole, over each public
/// HTTP version, and so do large response heads.
#[tokio::test]
async fn large_heads_cross_the_tunnel_both_ways() {
    let big_set_cookie = format!("session={}", "s".repeat(24 * 1024));
    let echo = {
        let big = big_set_cookie.clone();
        upstream::serve(move |req: Request<hyper::body::Incoming>| {
            let big = big.clone();
            async move {
                let other = req
                    .headers()
                    .get("x-other")
                    .map_or(0, |v| v.len())
                    .to_string();
                Response::builder()
                    .header("set-cookie", big)
                    .body(full(other))
                    .unwrap()
            }
        })
        .await
    };
    let (server, pki) = TunnelServer::start_https(&[]).await;
    let url = echo.url();
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    let cookie = "c".repeat(12 * 1024);
    for version in [http::Version::HTTP_11, http::Version::HTTP_2] {
        let alpn: &[&[u8]] = if version == http::Version::HTTP_2 {
            &[b"h2"]
        } else {
            &[b"http/1.1"]
        };
        let answer = crate::support::tls::https_get_with(
            server.public,
            &format!("rt-a.{DOMAIN}"),
            &pki.ca_pem,
            alpn,
            "/",
            &[("cookie", &cookie), ("x-other", &cookie)],
        )
        .await
        .expect("HTTPS exchange");
        assert_eq!(answer.0, version);
        assert_eq!(answer.1.status, 200, "{version:?}: {:?}", answer.1.body);
        assert_eq!(answer.1.body, cookie.len().to_string());
        assert_eq!(answer.1.header("set-cookie"), Some(big_set_cookie.as_str()));
    }
}

/// An HTTP/1.1 head on the public side is held to the bound HTTP/2's
/// header list has (64 KiB), refused as soon as it passes it, even while
/// it is still arriving.
#[tokio::test]
async fn a_public_http1_head_past_the_bound_is_refused_at_once() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let server = TunnelServer::start().await;
    let mut conn = tokio::net::TcpStream::connect(server.public).await.unwrap();
    let mut head = format!("GET / HTTP/1.1\r\nhost: rt-a.{DOMAIN}\r\nx-big: ").into_bytes();
    head.resize(100 * 1024, b'x');
    conn.write_all(&head).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), conn.read_to_end(&mut answer))
        .await
        .expect("closed")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 431 "), "{answer:?}");
    assert!(
        answer.ends_with(r#""error":"request head too large","route":null,"status":431}"#),
        "{answer:?}"
    );
}

/// A TCP relay in front of the tunnel endpoint that the test can cut.
struct Relay {
    addr: SocketAddr,
    /// Cancelled by [`Relay::cut`] for the connections relayed so far.
    current: Arc<std::sync::Mutex<tokio_util::sync::CancellationToken>>,
    /// Set before a cut: keep the server's side open (half-open tunnel).
    half_open: Arc<std::sync::atomic::AtomicBool>,
    /// While true, what the server sends is held, and passed on in one
    /// write when it turns false ([`Relay::hold`]).
    held: Arc<tokio::sync::watch::Sender<bool>>,
    /// Connections taken and left silent since [`Relay::black_hole`]
    /// (`None` before).
    black_holed: Arc<std::sync::Mutex<Option<usize>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn start(to: SocketAddr) -> Relay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let current = Arc::new(std::sync::Mutex::new(
            tokio_util::sync::CancellationToken::new(),
        ));
        let tokens = current.clone();
        let half_open = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let half = half_open.clone();
        let held = Arc::new(tokio::sync::watch::Sender::new(false));
        let hold = held.clone();
        let black_holed = Arc::new(std::sync::Mutex::new(None));
        let silent = black_holed.clone();
        let task = tokio::spawn(async move {
            // Kept open, unread, until the relay goes.
            let mut unanswered = Vec::new();
            loop {
                let Ok((inbound, _)) = listener.accept().await else {
                    continue;
                };
                if let Some(taken) = silent.lock().unwrap().as_mut() {
                    *taken += 1;
                    unanswered.push(inbound);
                    continue;
                }
                let cut = tokens.lock().unwrap().clone();
                let (half, held) = (half.clone(), hold.subscribe());
                tokio::spawn(async move {
                    let Ok(outbound) = tokio::net::TcpStream::connect(to).await else {
                        return;
                    };
                    let (mut client_rd, mut client_wr) = inbound.into_split();
                    let (mut server_rd, mut server_wr) = outbound.into_split();
                    tokio::select! {
                        _ = async {
                            tokio::join!(
                                tokio::io::copy(&mut client_rd, &mut server_wr),
                                copy_unless_held(&mut server_rd, &mut client_wr, held),
                            )
                        } => {}
                        // Dropping both sockets: the tunnel is gone, mid-stream.
                        _ = cut.cancelled() => {
                            if half.load(std::sync::atomic::Ordering::SeqCst) {
                                // The client's side goes; the server's stays
                                // open and silent, as after a lost route.
                                drop((client_rd, client_wr));
                                std::future::pending::<()>().await;
                            }
                        }
                    }
                });
            }
        });
        Relay {
            addr,
            current,
            half_open,
            held,
            black_holed,
            task,
        }
    }

    /// From now on, takes new connections and leaves them silent (a
    /// process that hangs, a path that drops what follows the TCP
    /// handshake); those relayed so far go on.
    fn black_hole(&self) {
        *self.black_holed.lock().unwrap() = Some(0);
    }

    /// Connections taken since [`Relay::black_hole`].
    fn black_holed(&self) -> usize {
        self.black_holed.lock().unwrap().unwrap_or(0)
    }

    /// Cuts the client's side of every relayed connection and leaves the
    /// server's open and silent.
    fn cut_half_open(&self) {
        self.half_open
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.cut();
    }

    /// Holds what the server sends from now on, until [`Relay::release`].
    fn hold(&self) {
        self.held.send_replace(true);
    }

    /// Passes on what was held, in one write per connection (the client
    /// reads it all at once), and relays as before.
    fn release(&self) {
        self.held.send_replace(false);
    }

    /// Cuts every relayed connection; later ones are relayed normally.
    fn cut(&self) {
        let mut current = self.current.lock().unwrap();
        current.cancel();
        *current = tokio_util::sync::CancellationToken::new();
    }
}

/// Copies `from` to `to` until `from` ends, keeping what comes while
/// `held` says so and writing it all at once when it stops.
async fn copy_unless_held(
    from: &mut tokio::net::tcp::OwnedReadHalf,
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    mut held: tokio::sync::watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut kept = Vec::new();
    loop {
        tokio::select! {
            read = from.read(&mut buf) => {
                let n = match read {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if *held.borrow() {
                    kept.extend_from_slice(&buf[..n]);
                } else if to.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
            Ok(()) = held.changed() => {
                if !*held.borrow() && !kept.is_empty() {
                    if to.write_all(&kept).await.is_err() {
                        return;
                    }
                    kept.clear();
                }
            }
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The client's "tunnel lost" line says why (a reset, an unanswered
/// ping, a clean close: which one depends on timing here) and after how
/// long the tunnel had been up.
fn assert_lost_with_reason(line: &str) {
    let v: serde_json::Value = serde_json::from_str(line).expect("a JSON log line");
    assert!(
        v["reason"].as_str().is_some_and(|r| !r.is_empty()),
        "{line}"
    );
    assert!(v["up_for_s"].is_u64(), "{line}");
}

#[tokio::test]
async fn public_clients_that_leave_at_once_do_not_take_the_tunnel_down() {
    let (up, mut arrived, release) = upstream::holding().await;
    let server = TunnelServer::start().await;
    let relay = Relay::start(server.tunnel).await;
    let client = server.relayed_client(&relay, &up.url()).await;
    let in_flight = server.slow_in_flight("rt-a", &mut arrived).await;

    // A hundred public requests are cancelled at once (a page closed, a
    // balancer's timeout, a load test ending): the server opens a stream
    // for each and resets it. Across a WAN the
    // client reads a stream's opening and its reset together, before it
    // has taken the stream, which the relay makes certain by holding
    // what the server sends until all are reset. h2 takes more than 20
    // such streams for a rapid-reset attack and ends the connection,
    // unless told to expect them.
    relay.hold();
    const LEAVING: u64 = 100;
    let mut leaving = TunnelServer::h2_requests(&server.h2().await, "rt-a", LEAVING);
    server.wait_active("rt-a", LEAVING + 1).await;
    // Each request's future dropped: the client resets its stream.
    leaving.abort_all();
    server.wait_active("rt-a", 1).await;
    relay.release();
    // Once a request made after them has crossed, the client has read
    // every reset before it.
    assert_eq!(server.get("rt-a", "/after").await.status, 200);

    release.notify_one();
    let held = in_flight.await.unwrap();
    assert_eq!(held.status, 200, "{:?}", held.body);
    assert_eq!(client.count_logs("tunnel lost"), 0);
}

/// A public client that leaves over HTTP/3 ends its request in the
/// tunnel too: the server stops counting it (and resets its stream), and
/// counts it as nginx's 499.
#[tokio::test]
async fn an_http3_client_that_leaves_ends_its_request_in_the_tunnel() {
    let (up, mut arrived, _release) = upstream::holding().await;
    let (server, pki) = TunnelServer::start_https(&["--http3"]).await;
    let url = up.url();
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    let host = format!("rt-a.{DOMAIN}");
    let waiting = crate::support::tls::h3_send(server.public, &host, &pki.ca_pem, "/slow")
        .await
        .expect("HTTP/3 request sent");
    tokio::time::timeout(Duration::from_secs(10), arrived.recv())
        .await
        .expect("request reached the upstream");
    server.wait_active("rt-a", 1).await;
    waiting.leave();
    server.wait_active("rt-a", 0).await;
    server
        .process
        .metrics_showing(&[
            r#"portcullis_tunnel_requests_total{runtime="rt-a",code="499"} 1"#.into(),
        ])
        .await;
}

#[tokio::test]
async fn a_cut_tunnel_fails_in_flight_requests_promptly_and_the_client_reconnects() {
    let (up, mut arrived, _release) = upstream::holding().await;
    let server = TunnelServer::start().await;
    let relay = Relay::start(server.tunnel).await;
    let url = up.url();
    let mut client = server.relayed_client(&relay, &url).await;
    let in_flight = server.slow_in_flight("rt-a", &mut arrived).await;

    let cut_at = Instant::now();
    relay.cut();
    let answer = in_flight.await.unwrap();
    assert_eq!(answer.status, 502, "{:?}", answer.body);
    assert!(
        cut_at.elapsed() < Duration::from_secs(5),
        "in-flight request took {:?} to fail",
        cut_at.elapsed()
    );

    // The client notices, backs off (0.5 s at first) and dials again.
    let lost = client.wait_for_log("tunnel lost").await;
    assert_lost_with_reason(&lost);
    server.serves_again(&mut client).await;
}

#[tokio::test]
async fn a_restarted_server_gets_its_clients_back() {
    client_comes_back_after_a_restart(false).await;
}

/// A one-tunnel client (over QUIC with `quic`) of a server that stops
/// (killed; over QUIC stopped cleanly, which tells the client at once
/// where silence would take the idle timeout) and starts again on the
/// same ports: the client notices, dials again and serves.
async fn client_comes_back_after_a_restart(quic: bool) {
    let echo = upstream::echo("back").await;
    let (server_args, transport): (&[&str], &[&str]) = if quic {
        (&["--tunnel-quic"], &["--transport", "quic"])
    } else {
        (&[], &[])
    };
    let server = if quic {
        TunnelServer::start_quic().await
    } else {
        TunnelServer::start().await
    };
    let url = echo.url();
    let mut args = vec!["--upstream", &url, "--connections", "1"];
    args.extend_from_slice(transport);
    let mut client = server.client("rt-a", TOKENS[0].1, &args).await;
    assert_eq!(server.get("rt-a", "/").await.status, 200);
    let (public, tunnel) = (server.public, server.tunnel);
    let TunnelServer {
        mut process, dir, ..
    } = server;
    process.signal(if quic { "TERM" } else { "KILL" });
    process.wait_exit(Duration::from_secs(10)).await;
    client.wait_for_log("tunnel lost").await;

    let server = TunnelServer::start_in_with(dir, public, tunnel, server_args).await;
    client.wait_for_log("tunnel connected").await;
    let a = server.get("rt-a", "/back").await;
    assert_eq!(a.status, 200);
    assert_eq!(a.json()["upstream"], "back");
}

/// A client given several servers (replicas of one tunnel service,
/// `--server a,b`) keeps tunnels to each, so a public request reaching
/// any of them is served; when one goes away the others serve on, the
/// client stays ready, says which server it lost, and its admin endpoint
/// shows which tunnels are up.
#[tokio::test]
async fn a_client_keeps_tunnels_to_every_server_it_is_given() {
    let echo = upstream::echo("replicas").await;
    let mut a = TunnelServer::start().await;
    let b = TunnelServer::start().await;
    let url = echo.url();
    let mut client = a
        .client_via(
            &format!("{},{}", a.url, b.url),
            "rt-a",
            TOKENS[0].1,
            &["--upstream", &url, "--connections", "2"],
        )
        .await;
    a.wait_connections("rt-a", 2).await;
    b.wait_connections("rt-a", 2).await;
    for server in [&a, &b] {
        let answer = server.get("rt-a", "/through").await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        assert_eq!(answer.json()["upstream"], "replicas");
    }
    // http::Uri writes the empty path as `/`.
    let up = |server: &str, n: usize| {
        format!("portcullis_tunnel_client_tunnels_up{{server=\"{server}/\"}} {n}")
    };
    client
        .metrics_showing(&[up(&a.url, 2), up(&b.url, 2)])
        .await;
    let status = client.status().await;
    let tunnels = status["tunnels"].as_array().expect("tunnels in the status");
    let servers: Vec<_> = tunnels
        .iter()
        .map(|t| t["server"].as_str().unwrap())
        .collect();
    let (a_server, b_server) = (format!("{}/", a.url), format!("{}/", b.url));
    assert_eq!(
        servers,
        [&a_server, &a_server, &b_server, &b_server],
        "{status}"
    );
    for (slot, t) in tunnels.iter().enumerate() {
        assert_eq!(t["slot"], slot, "{status}");
        assert_eq!(t["up"], true, "{status}");
        assert_eq!(t["transport"], "websocket", "{status}");
        assert!(t["since"].is_string(), "{status}");
    }

    a.process.signal("KILL");
    a.process.wait_exit(Duration::from_secs(10)).await;
    let lost = client.wait_for_log("tunnel lost").await;
    assert!(lost.contains(&a.url), "{lost}");
    let answer = b.get("rt-a", "/still").await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    assert_eq!(client::get(&client.admin_url("/readyz")).await.status, 200);
    assert_eq!(b.process.status().await["runtimes"][0]["connections"], 2);
    client
        .metrics_showing(&[up(&a.url, 0), up(&b.url, 2)])
        .await;
    let status = client.status().await;
    let a_slot = &status["tunnels"][0];
    assert_eq!(a_slot["up"], false, "{status}");
    assert!(a_slot["transport"].is_null(), "{status}");
}

/// The tunnel server gives each public request its id at the edge; the
/// client's routing core keeps it, so both access lines, the upstream and
/// the answer name the same request.
#[tokio::test]
async fn a_public_request_keeps_one_id_from_the_edge_to_the_upstream() {
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
async fn a_public_requests_trace_starts_at_the_edge_and_goes_on_in_the_routing_core() {
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
async fn a_public_connection_closes_after_its_max_requests() {
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
async fn a_second_client_takes_over_its_runtime_and_the_first_stops() {
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
async fn sigterm_drains_the_client_then_it_exits() {
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
async fn sighup_to_the_server_is_logged_and_its_tunnels_stay() {
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
async fn rotating_a_token_closes_tunnels_using_the_old_one_and_the_client_follows() {
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
        .find_log("the runtime's token changed in the tokens file");
}

#[tokio::test]
async fn a_thousand_idle_tunnels_on_one_server() {
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
async fn websocket_echo_through_the_tunnel() {
    let ws = upstream::websocket_echo().await;
    let server = TunnelServer::start().await;
    let url = ws.url();
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    server.websocket_echo("rt-a").await;
}

#[tokio::test]
async fn a_client_dialling_again_replaces_its_half_open_tunnel_at_once() {
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
async fn a_renewed_certificate_is_served_without_a_restart() {
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
struct TestKeyOnly;

impl TestKeyOnly {
    fn pem() -> String {
        rcgen::KeyPair::generate().unwrap().serialize_pem()
    }
}

/// The tunnel client serves the tunnel only: on the default policies
/// (whose listener, on 0.0.0.0:8080, trusts X-Forwarded-*) it opens no
/// TCP listener but its admin, so nothing that reaches the pod gets past
/// the tunnel server; the policies' routes still answer through the
/// tunnel. (`--open-listeners` opens them: see the readiness test.)
#[tokio::test]
async fn the_tunnel_client_opens_no_listener_of_its_policies() {
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
async fn the_tunnel_servers_status_page_shows_its_runtimes() {
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
async fn the_client_is_ready_only_while_a_tunnel_carries_pings() {
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
async fn public_connections_beyond_the_cap_wait_for_a_free_slot() {
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
async fn answering_here(server: &TunnelServer) -> (tempfile::TempDir, ProxyProcess) {
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
async fn public_connections_are_spread_evenly_over_the_workers() {
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
async fn public_http3_connections_are_spread_over_the_workers() {
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
async fn the_public_side_limits_each_client_rate() {
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
fn server_command(dir: &tempfile::TempDir) -> std::process::Command {
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
async fn a_public_http2_head_gets_a_bodiless_answer() {
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
