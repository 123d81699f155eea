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

mod capacity;
mod operations;
mod public_side;
mod refusals;
mod resilience;
mod routing;

use capacity::*;
use public_side::*;
use resilience::*;
use routing::*;

mod agree;
mod local_tls;
mod peers;
mod quic;
mod registry;

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
