//! `portcullis tunnel-server`: the public side. Accepts tunnel clients on
//! the tunnel endpoint (WebSocket, over TLS when given a certificate),
//! authenticates them, and forwards each public request for
//! `<runtime-id>.<domain>` through that runtime's tunnel.

use std::borrow::Cow;
use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use futures_util::FutureExt;
use http::header::{self, HeaderName, HeaderValue};
use http::uri::PathAndQuery;
use http::{Request, Response, StatusCode, Uri, Version};
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::tokens::{Refusal, Tokens, valid_runtime_id};
use super::{Hello, Refused};
use portcullis_config::{RequestIds, Tracing};
use portcullis_http::body::{Body, ResponseBody};
use portcullis_http::forward::{Held, UpstreamPool};
use portcullis_http::phases::{Entry, Phases, RequestCtx};
use portcullis_http::request_head;
use portcullis_net::balance::{Accepting, Balance, Handoff};
use portcullis_net::tls_listen::{NotOpened, Opened, open};
use portcullis_obs::metrics::RouteStats;

/// How the tunnel server runs.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Public listener.
    pub public: SocketAddr,
    /// Certificate chain and key (PEM) for HTTPS on the public listener
    /// (a wildcard certificate for `*.domain`); plain HTTP without.
    pub public_tls: Option<(PathBuf, PathBuf)>,
    /// Keep the `X-Forwarded-Proto` and `-Host` a public request brings
    /// (set by a balancer in front that terminates TLS) instead of
    /// setting them from the connection.
    pub trust_forwarded_headers: bool,
    /// Public connections start with a PROXY protocol header giving the
    /// client's address (behind a TCP balancer).
    pub proxy_protocol: bool,
    /// HTTP/3 on the public port's UDP twin (needs `public_tls`),
    /// advertised by `Alt-Svc` on HTTPS responses.
    pub http3: bool,
    /// The port `Alt-Svc` names for HTTP/3 (a balancer in front may
    /// publish it under another number); the public port by default.
    pub http3_advertised_port: Option<u16>,
    /// Tunnel connections start with a PROXY protocol header (behind a TCP
    /// balancer that would otherwise hide the clients' addresses, which the
    /// failed-token rate limit is kept by).
    pub tunnel_proxy_protocol: bool,
    /// Tunnel endpoint listener.
    pub tunnel: SocketAddr,
    /// Runtimes are reached as `<runtime-id>.<domain>`.
    pub domain: String,
    /// The tokens file (runtime id → token hash).
    pub tokens: PathBuf,
    /// Certificate chain and key (PEM) for `wss://`; plain `ws://` without.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Take QUIC tunnels too, on the tunnel port's UDP twin (needs `tls`).
    pub tunnel_quic: bool,
    /// How this server sends on its QUIC connections (tunnels, HTTP/3).
    pub quic_congestion: super::quic::Congestion,
    /// Admin listener; `None` turns it off.
    pub admin: Option<SocketAddr>,
    /// Worker threads, each with its own event loop.
    pub workers: usize,
    /// Public connections served at once (all workers together); more
    /// wait in the kernel's accept queue.
    pub max_connections: usize,
    /// Other replicas to forward to, and where they forward to this one
    /// (`--peers`, `--peer-listen`).
    pub peers: Option<super::peers::PeerOptions>,
    /// Public requests per client beyond which they are answered 429
    /// (`--public-rate-limit`, `COUNT/s|m|h`), and how many more at once.
    pub public_rate_limit: Option<(String, u32)>,
    /// Spans of public requests for an OpenTelemetry collector.
    pub tracing: Option<TraceOptions>,
    /// Requests a public connection carries before it is closed (0: no
    /// limit), and how long it is kept from its accept (zero: no limit):
    /// nginx's `keepalive_requests` and `keepalive_time`.
    pub public_connection_limits: (u32, Duration),
}

/// Where the tunnel server's spans go and which requests make one (the
/// routing core's `tracing`, from flags).
#[derive(Debug, Clone)]
pub struct TraceOptions {
    /// The collector's OTLP/HTTP base URL (`http://otel-collector:4318`).
    pub endpoint: String,
    /// Share of new traces recorded, 0 to 100.
    pub sample_percent: f64,
    /// The spans' `service.name`.
    pub service_name: String,
    /// Join the `traceparent` a public request brings; off, every public
    /// request starts a trace (a public client should not pick trace ids
    /// or force sampling). A peer's request is always joined.
    pub trust_incoming: bool,
    /// The longest a span waits in its batch.
    pub flush_every: Duration,
}

/// The collector's settings and pool, from `options`.
fn tracing_from(options: &TraceOptions) -> anyhow::Result<(Arc<Tracing>, Arc<UpstreamPool>)> {
    if !(0.0..=100.0).contains(&options.sample_percent) {
        anyhow::bail!(
            "--trace-sample-percent {}: a share from 0 to 100",
            options.sample_percent
        );
    }
    let spec = portcullis_config::upstream_at("otel-collector", &options.endpoint)
        .map_err(|e| anyhow::anyhow!("--otlp-endpoint: {e}"))?;
    let spec = Arc::new(spec);
    let shared = portcullis_http::forward::shared_endpoints(&spec, None);
    let pool = Arc::new(UpstreamPool::new(spec, shared, None));
    let tracing = Tracing {
        upstream: 0,
        path: PathAndQuery::from_static("/v1/traces"),
        threshold: Tracing::threshold_of(options.sample_percent),
        service_name: options.service_name.as_str().into(),
        flush_every: options.flush_every,
        trust_incoming: options.trust_incoming,
    };
    Ok((Arc::new(tracing), pool))
}

/// One tunnel connection from a client.
pub struct Tunnel {
    id: u64,
    instance: String,
    slot: u32,
    /// The worker thread driving its connection.
    worker: usize,
    /// The token hash it authenticated with.
    token: [u8; 32],
    remote: SocketAddr,
    since: SystemTime,
    sender: Sender,
    /// Last measured round trip, microseconds (0 until measured).
    rtt_us: AtomicU64,
    /// Public requests in flight on this tunnel.
    active: AtomicUsize,
    /// Its runtime's request metrics.
    stats: &'static RouteStats,
    closed: CancellationToken,
}

/// How requests reach a tunnel's client.
#[derive(Clone)]
enum Sender {
    /// An HTTP/2 connection over a WebSocket.
    H2(SendRequest<Body>),
    /// A QUIC connection, a stream per request.
    Quic(super::quic::ServerTunnel),
}

impl Sender {
    fn is_closed(&self) -> bool {
        match self {
            Sender::H2(s) => s.is_closed(),
            Sender::Quic(q) => q.is_closed(),
        }
    }

    /// Sends a request shaped for HTTP/2 (absolute target, an extended
    /// CONNECT for an upgrade); the QUIC transport reshapes it.
    async fn send(&self, req: Request<Body>) -> Result<Response<Incoming>, String> {
        match self {
            Sender::H2(s) => s
                .clone()
                .send_request(req)
                .await
                .map_err(|e| portcullis_http::forward::error_chain(&e)),
            Sender::Quic(q) => q.send(req).await,
        }
    }

    /// The client's address: the one it connected from (or its PROXY
    /// header gave), or where a QUIC connection has moved since.
    fn remote(&self, connected_from: SocketAddr) -> SocketAddr {
        match self {
            Sender::H2(_) => connected_from,
            Sender::Quic(q) => q.remote(),
        }
    }

    fn transport(&self) -> &'static str {
        match self {
            Sender::H2(_) => "websocket",
            Sender::Quic(_) => "quic",
        }
    }
}

/// The runtimes connected now.
#[derive(Default)]
pub struct Registry {
    runtimes: Mutex<HashMap<String, Runtime>>,
    next_id: AtomicU64,
    /// Changes whenever a tunnel comes or goes, so peers polling for the
    /// runtimes get the list only when it may have changed.
    generation: AtomicU64,
}

#[derive(Default)]
struct Runtime {
    instance: String,
    tunnels: Vec<Arc<Tunnel>>,
    next: usize,
}

/// Tunnels to close after adding one.
#[derive(Default)]
struct Added {
    /// Another client instance's, to tell it was replaced.
    replaced: Vec<Arc<Tunnel>>,
    /// Earlier tunnels of the same slot, given up on by the client.
    stale: Vec<Arc<Tunnel>>,
}

/// When a client instance started: the number its instance id begins with
/// (`<unix-ms>-<random>`); 0 when absent.
fn started(instance: &str) -> u128 {
    instance
        .split('-')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

impl Registry {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Runtime>> {
        self.runtimes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A tunnel of runtime `id`, taking turns among its connections, and
    /// among those driven by `worker` when there are any: a request then
    /// stays on one thread from the public socket to the tunnel and back.
    fn pick(&self, id: &str, worker: usize) -> Option<Arc<Tunnel>> {
        let mut runtimes = self.lock();
        let runtime = runtimes.get_mut(id)?;
        let n = runtime.tunnels.len();
        let mut other = None;
        for _ in 0..n {
            runtime.next = (runtime.next + 1) % n;
            let t = &runtime.tunnels[runtime.next];
            if t.sender.is_closed() {
                continue;
            }
            if t.worker == worker {
                return Some(t.clone());
            }
            other.get_or_insert_with(|| t.clone());
        }
        other
    }

    /// Adds a tunnel and says which tunnels to close. One client process
    /// (instance) serves a runtime at a time, and the most recently
    /// started one wins: its tunnels replace an older instance's, and a
    /// tunnel from an older instance is itself turned away (`replaced`:
    /// those clients are told, and stop). Deciding by start time rather
    /// than by arrival keeps two clients whose connections interleave (a
    /// rolling update) from taking the runtime from each other in turn.
    /// A tunnel dialled again for a slot the instance already has replaces
    /// that one (`stale`): the client has given up on it, though the
    /// server may not have noticed yet.
    fn add(&self, runtime: &str, tunnel: Arc<Tunnel>) -> Added {
        let mut runtimes = self.lock();
        self.generation.fetch_add(1, Ordering::Relaxed);
        let entry = runtimes.entry(runtime.to_owned()).or_default();
        let mut added = Added::default();
        if entry.instance == tunnel.instance || entry.tunnels.is_empty() {
            entry.instance = tunnel.instance.clone();
            if let Some(i) = entry.tunnels.iter().position(|t| t.slot == tunnel.slot) {
                added.stale.push(entry.tunnels.swap_remove(i));
            }
            entry.tunnels.push(tunnel);
        } else if started(&tunnel.instance) > started(&entry.instance) {
            entry.instance = tunnel.instance.clone();
            added.replaced = std::mem::replace(&mut entry.tunnels, vec![tunnel]);
        } else {
            added.replaced.push(tunnel);
        }
        added
    }

    fn remove(&self, runtime: &str, id: u64) {
        let mut runtimes = self.lock();
        self.generation.fetch_add(1, Ordering::Relaxed);
        if let Some(entry) = runtimes.get_mut(runtime) {
            entry.tunnels.retain(|t| t.id != id);
            if entry.tunnels.is_empty() {
                runtimes.remove(runtime);
            }
        }
    }

    /// The registry's generation, and how to list its runtimes (for a
    /// peer's poll).
    fn presence(&self) -> (u64, impl FnOnce() -> Vec<String> + '_) {
        let generation = self.generation.load(Ordering::Relaxed);
        (generation, move || {
            let mut ids: Vec<String> = self.lock().keys().cloned().collect();
            ids.sort();
            ids
        })
    }

    /// Connected runtimes for the admin endpoint, by id.
    pub fn snapshot(&self) -> Vec<RuntimeStatus> {
        let runtimes = self.lock();
        let mut out: Vec<_> = runtimes
            .iter()
            .map(|(id, r)| RuntimeStatus {
                id: id.clone(),
                tunnels: r
                    .tunnels
                    .iter()
                    .map(|t| TunnelStatus {
                        transport: t.sender.transport(),
                        worker: t.worker,
                        remote: t.sender.remote(t.remote),
                        since: t.since,
                        rtt: Duration::from_micros(t.rtt_us.load(Ordering::Relaxed)),
                        active: t.active.load(Ordering::Relaxed),
                    })
                    .collect(),
            })
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }
}

/// A connected runtime.
#[derive(Debug, Clone)]
pub struct RuntimeStatus {
    /// Runtime id.
    pub id: String,
    /// Its tunnel connections.
    pub tunnels: Vec<TunnelStatus>,
}

/// One tunnel connection.
#[derive(Debug, Clone)]
pub struct TunnelStatus {
    /// `websocket` or `quic`.
    pub transport: &'static str,
    /// The worker thread that drives it.
    pub worker: usize,
    /// The client's address.
    pub remote: SocketAddr,
    /// Connected since.
    pub since: SystemTime,
    /// Last measured round trip (zero until measured).
    pub rtt: Duration,
    /// Requests in flight.
    pub active: usize,
}

/// A bound tunnel server, ready to run.
pub struct TunnelServer {
    /// One public socket per worker (SO_REUSEPORT).
    public: Vec<std::net::TcpListener>,
    public_addr: SocketAddr,
    tunnel: TcpListener,
    workers: usize,
    tls: Option<tokio_rustls::TlsAcceptor>,
    public_tls: Option<tokio_rustls::TlsAcceptor>,
    /// The UDP socket and QUIC settings for HTTP/3 (`--http3`).
    h3: Option<(std::net::UdpSocket, quinn::ServerConfig)>,
    /// The UDP socket and QUIC settings for QUIC tunnels (`--tunnel-quic`).
    tunnel_quic: Option<(std::net::UdpSocket, quinn::ServerConfig)>,
    /// Where peers forward requests to this server (`--peer-listen`):
    /// one socket per worker (SO_REUSEPORT), empty when off.
    peer_listeners: Vec<std::net::TcpListener>,
    shared: Arc<Shared>,
}

struct Shared {
    registry: Registry,
    /// The public listener's connection cap.
    public_slots: Arc<tokio::sync::Semaphore>,
    tokens: Tokens,
    /// `.domain`, lower case.
    suffix: String,
    public_tls: bool,
    trust_forwarded_headers: bool,
    proxy_protocol: bool,
    tunnel_proxy_protocol: bool,
    /// QUIC tunnels are taken.
    tunnel_quic: bool,
    /// How QUIC connections (tunnels, HTTP/3) send.
    quic_congestion: super::quic::Congestion,
    /// `Alt-Svc` for HTTPS responses when HTTP/3 is served.
    alt_svc: Option<HeaderValue>,
    /// The other replicas (`--peers`).
    peers: Option<Arc<super::peers::Peers>>,
    /// The public side's limit per client.
    rate_limit: Option<portcullis_http::rate_limit::RateLimit>,
    /// Spans for a collector: its settings and pool.
    tracing: Option<(Arc<Tracing>, Arc<UpstreamPool>)>,
    /// [`ServerOptions::public_connection_limits`].
    public_connection_limits: (u32, Duration),
}

/// A TLS acceptor serving the pair in `cert` and `key` (read again when
/// they change), offering `alpn`.
fn load_tls(cert: &Path, key: &Path, alpn: &[&[u8]]) -> anyhow::Result<tokio_rustls::TlsAcceptor> {
    portcullis_net::tls_listen::acceptor(cert, key, None, alpn).map_err(anyhow::Error::msg)
}

/// The answer to plain HTTP on the public HTTPS port.
const PLAIN_ON_HTTPS: &str = concat!(
    r#"{"error":"plain HTTP request sent to the HTTPS port: use https://","#,
    r#""status":400,"runtime":null}"#
);

/// When `on`, the UDP socket on `addr` (the TCP listener's twin) and the
/// QUIC settings `config` makes from the certificate pair in `tls` and
/// the congestion control, for `what`; without a pair, `needs` says
/// which flags are missing.
fn quic_socket(
    (on, tls, congestion): (bool, &Option<(PathBuf, PathBuf)>, super::quic::Congestion),
    addr: SocketAddr,
    what: &str,
    needs: &str,
    config: fn(&Path, &Path, super::quic::Congestion) -> anyhow::Result<quinn::ServerConfig>,
) -> anyhow::Result<Option<(std::net::UdpSocket, quinn::ServerConfig)>> {
    use anyhow::Context;
    match (on, tls) {
        (false, _) => Ok(None),
        (true, None) => anyhow::bail!("{needs}"),
        (true, Some((cert, key))) => {
            let socket = std::net::UdpSocket::bind(addr)
                .with_context(|| format!("cannot bind UDP {addr} for {what}"))?;
            Ok(Some((socket, config(cert, key, congestion)?)))
        }
    }
}

impl TunnelServer {
    /// Reads the tokens file and certificate and binds both listeners.
    pub async fn bind(options: &ServerOptions) -> anyhow::Result<TunnelServer> {
        use anyhow::Context;
        let tokens = Tokens::load(options.tokens.clone()).map_err(anyhow::Error::msg)?;
        // The tunnel endpoint speaks WebSocket, an HTTP/1.1 upgrade; the
        // public side both versions.
        let tls = match &options.tls {
            Some((cert, key)) => Some(load_tls(cert, key, &[b"http/1.1"])?),
            None => None,
        };
        let public_tls = match &options.public_tls {
            Some((cert, key)) => Some(load_tls(cert, key, &[b"h2", b"http/1.1"])?),
            None => None,
        };
        let domain = options.domain.trim_matches('.').to_ascii_lowercase();
        anyhow::ensure!(!domain.is_empty(), "--domain is empty");
        let workers = options.workers.max(1);
        let public_err = || format!("cannot bind the public listener on {}", options.public);
        let (public_addr, public) =
            portcullis_net::sockets::worker_sockets(options.public, workers)
                .with_context(public_err)?;
        let tunnel = TcpListener::bind(options.tunnel)
            .await
            .with_context(|| format!("cannot bind the tunnel listener on {}", options.tunnel))?;
        let h3 = quic_socket(
            (options.http3, &options.public_tls, options.quic_congestion),
            public_addr,
            "HTTP/3",
            "--http3 needs --public-cert and --public-key",
            super::public_h3::server_config,
        )?;
        let tunnel_addr = tunnel.local_addr()?;
        let tunnel_quic = quic_socket(
            (options.tunnel_quic, &options.tls, options.quic_congestion),
            tunnel_addr,
            "QUIC tunnels",
            "--tunnel-quic needs --cert and --key",
            super::quic::tunnel_server_config,
        )?;
        let rate_limit = match &options.public_rate_limit {
            Some((rate, burst)) => {
                let (count, period) = portcullis_config::parse_rate(rate)
                    .map_err(|e| anyhow::anyhow!("--public-rate-limit: {e}"))?;
                Some(portcullis_http::rate_limit::RateLimit::new(
                    count,
                    period,
                    *burst,
                    portcullis_http::rate_limit::LimitKey::Client,
                    rate.clone(),
                ))
            }
            None => None,
        };
        let peers = match &options.peers {
            Some(peers) => Some(Arc::new(super::peers::Peers::new(
                peers,
                super::client::instance_id(),
                workers,
            )?)),
            None => None,
        };
        // A socket per worker, as for the public side: with peers'
        // clients dialling a single balanced address, most requests may
        // reach a runtime through a peer, and one worker would carry them
        // all.
        let mut peer_listeners = Vec::new();
        if let Some(addr) = options.peers.as_ref().and_then(|p| p.listen) {
            let peer_err = || format!("cannot bind the peer listener on {addr}");
            (_, peer_listeners) =
                portcullis_net::sockets::worker_sockets(addr, workers).with_context(peer_err)?;
        }
        let alt_svc = h3.as_ref().map(|_| {
            let port = options.http3_advertised_port.unwrap_or(public_addr.port());
            // A day, as Caddy and Cloudflare advertise it.
            HeaderValue::try_from(format!("h3=\":{port}\"; ma=86400"))
                .expect("a port number makes a valid header value")
        });
        Ok(TunnelServer {
            public,
            public_addr,
            tunnel,
            workers,
            tls,
            public_tls: public_tls.clone(),
            h3,
            tunnel_quic,
            peer_listeners,
            shared: Arc::new(Shared {
                registry: Registry::default(),
                public_slots: Arc::new(tokio::sync::Semaphore::new(options.max_connections.max(1))),
                tokens,
                suffix: format!(".{domain}"),
                public_tls: public_tls.is_some(),
                trust_forwarded_headers: options.trust_forwarded_headers,
                proxy_protocol: options.proxy_protocol,
                tunnel_proxy_protocol: options.tunnel_proxy_protocol,
                tunnel_quic: options.tunnel_quic,
                quic_congestion: options.quic_congestion,
                alt_svc,
                peers,
                rate_limit,
                tracing: options.tracing.as_ref().map(tracing_from).transpose()?,
                public_connection_limits: options.public_connection_limits,
            }),
        })
    }

    /// The public listener's address.
    pub fn public_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.public_addr)
    }

    /// The tunnel endpoint's address.
    pub fn tunnel_addr(&self) -> std::io::Result<SocketAddr> {
        self.tunnel.local_addr()
    }

    /// The peer listener's address (`--peer-listen`).
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        self.peer_listeners.first()?.local_addr().ok()
    }

    /// Serves the admin endpoint on `addr`: `/status` lists the connected
    /// runtimes, `/metrics` has them as gauges.
    pub async fn serve_admin(&self, addr: SocketAddr) -> std::io::Result<SocketAddr> {
        let shared = self.shared.clone();
        portcullis_obs::admin_http::serve_with(
            addr,
            Arc::new(move |req| {
                let shared = shared.clone();
                Box::pin(async move { admin(req, &shared) })
            }),
        )
        .await
    }

    /// Serves until `shutdown` completes. Thread per core, like the
    /// routing core: each worker accepts public connections on its own
    /// socket and drives the tunnel connections handed to it; a public
    /// request goes through a tunnel of its own worker when the runtime
    /// has one there, so it crosses no thread.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
        let tunnel_addr = self.tunnel.local_addr()?;
        tracing::info!(addr = %self.public_addr, workers = self.workers, tls = self.public_tls.is_some(), "public listening");
        if let Some(listener) = self.peer_listeners.first() {
            let tls = self.shared.peers.as_ref().is_some_and(|p| p.tls.is_some());
            tracing::info!(addr = %listener.local_addr()?, tls, "peer listening");
        }
        tracing::info!(addr = %tunnel_addr, tls = self.tls.is_some(), "tunnel listening");
        if self.h3.is_some() {
            tracing::info!(addr = %self.public_addr, "public HTTP/3 listening");
        }
        // Public HTTP/3 connections, handed from the endpoint to each
        // worker in turn.
        let (to_h3_workers, mut h3_inboxes): (Vec<_>, Vec<_>) = match &self.h3 {
            Some(_) => (0..self.workers)
                .map(|_| {
                    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                    (tx, Some(rx))
                })
                .unzip(),
            None => (Vec::new(), Vec::new()),
        };
        let (runtime, first_runtime) = tokio::sync::oneshot::channel();
        let release_first = CancellationToken::new();
        let mut first = Some(FirstWorker {
            h3: self
                .h3
                .map(|(socket, config)| (socket, config, to_h3_workers)),
            runtime,
            release: release_first.clone(),
        });
        let stops = Stops::default();
        let stop = stops.public.clone();
        let mut to_workers = Vec::with_capacity(self.workers);
        let mut done = Vec::with_capacity(self.workers);
        let mut public_done = Vec::with_capacity(self.workers);
        let (balance, inboxes) = Balance::new(self.workers);
        let mut peer_listeners = self.peer_listeners.into_iter();
        for ((index, public), inbox) in self.public.into_iter().enumerate().zip(inboxes) {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<Arrival>();
            to_workers.push(tx);
            let (shared, tls, stops) = (self.shared.clone(), self.tls.clone(), stops.clone());
            let h3_inbox = h3_inboxes.get_mut(index).and_then(Option::take);
            let public = PublicSide {
                listener: public,
                tls: self.public_tls.clone(),
                balance: balance.clone(),
                inbox,
                h3: h3_inbox,
                peer: peer_listeners.next(),
            };
            let first = first.take();
            let (finished, finished_rx) = tokio::sync::oneshot::channel::<()>();
            let (drained, drained_rx) = tokio::sync::oneshot::channel::<()>();
            std::thread::Builder::new()
                .name(format!("portcullis-tunnel-{index}"))
                .spawn(move || {
                    worker(index, public, first, rx, tls, shared, (stops, drained));
                    let _ = finished.send(());
                })?;
            done.push(finished_rx);
            public_done.push(drained_rx);
        }
        if let Some(peers) = &self.shared.peers {
            tokio::spawn(peers.clone().poll(stop.clone()));
        }
        let quic = match self.tunnel_quic {
            Some((socket, config)) => {
                // The endpoint's socket and driver go on the first worker,
                // not on this control thread: the driver receives every
                // packet of every QUIC tunnel, and hands each to its
                // connection's task; from here, each batch of packets woke
                // this thread and then a worker, and now the first
                // worker's tunnels get theirs with no thread crossed.
                let runtime = first_runtime
                    .await
                    .unwrap_or_else(|_| tokio::runtime::Handle::current());
                let _on_first = runtime.enter();
                Some(quinn::Endpoint::new(
                    quinn::EndpointConfig::default(),
                    Some(config),
                    socket,
                    Arc::new(quinn::TokioRuntime),
                )?)
            }
            None => None,
        };
        if quic.is_some() {
            tracing::info!(addr = %tunnel_addr, "tunnel QUIC listening");
        }
        let accepting = accept_tunnels(self.tunnel, quic.clone(), to_workers, stop.clone());
        tokio::select! {
            _ = shutdown => {}
            _ = accepting => {}
        }
        tracing::info!("shutting down");
        // The public side first: its requests in flight finish through
        // the tunnels (any worker's), which close only after.
        stops.public.cancel();
        let _ = tokio::time::timeout(
            Duration::from_secs(10),
            futures_util::future::join_all(public_done),
        )
        .await;
        stops.tunnels.cancel();
        if let Some(quic) = &quic {
            quic.close(0u32.into(), b"shutting down");
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), async {
            // The first worker drives the QUIC endpoint's socket, which
            // the other workers' tunnels send their closes through.
            let mut done = done.into_iter();
            let first = done.next();
            futures_util::future::join_all(done).await;
            release_first.cancel();
            if let Some(first) = first {
                let _ = first.await;
            }
        })
        .await;
        Ok(())
    }
}

/// A worker's public side: its socket and TLS, the balance over the
/// workers' sockets with its inbox of connections handed over, the
/// HTTP/3 connections handed to it, and its peer listener socket.
struct PublicSide {
    listener: std::net::TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    balance: Arc<Balance>,
    inbox: UnboundedReceiver<Handoff>,
    h3: Option<UnboundedReceiver<super::public_h3::Handed>>,
    peer: Option<std::net::TcpListener>,
}

/// What only the first worker gets.
struct FirstWorker {
    /// The public HTTP/3 endpoint (`--http3`), with where to hand each
    /// connection it accepts: every worker, in turn.
    h3: Option<(
        std::net::UdpSocket,
        quinn::ServerConfig,
        Vec<tokio::sync::mpsc::UnboundedSender<super::public_h3::Handed>>,
    )>,
    /// Where the worker sends its runtime, which the tunnel QUIC endpoint
    /// is registered with.
    runtime: tokio::sync::oneshot::Sender<tokio::runtime::Handle>,
    /// Cancelled once the other workers are done: until then, this
    /// worker keeps driving the endpoint's socket.
    release: CancellationToken,
}

/// What stops a tunnel server, in order.
#[derive(Clone, Default)]
struct Stops {
    /// The public side: no new connections, those open finish.
    public: CancellationToken,
    /// The tunnels, once the public side is done with them.
    tunnels: CancellationToken,
}

/// One worker thread: its public socket (with the balance over the
/// workers' sockets and its inbox, and the HTTP/3 connections handed to
/// it), and the tunnels handed to it. Says `drained` once its public side
/// is done after a stop.
fn worker(
    index: usize,
    PublicSide {
        listener: public,
        tls: public_tls,
        balance,
        inbox,
        h3: h3_inbox,
        peer,
    }: PublicSide,
    first: Option<FirstWorker>,
    mut tunnels: UnboundedReceiver<Arrival>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shared: Arc<Shared>,
    (stops, drained): (Stops, tokio::sync::oneshot::Sender<()>),
) {
    let stop = stops.public;
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(worker = index, error = %e, "cannot start worker runtime");
            return;
        }
    };
    let (h3, release) = match first {
        Some(first) => {
            let _ = first.runtime.send(runtime.handle().clone());
            (first.h3, Some(first.release))
        }
        None => (None, None),
    };
    runtime.block_on(async move {
        tokio::spawn(portcullis_http::server::timer_anchor());
        let tracker = TaskTracker::new();
        let tunnel_tasks = TaskTracker::new();
        let serving = Public::new(index, shared.clone());
        if let Some((socket, config, workers)) = h3 {
            tracker.spawn(super::public_h3::accept(
                socket,
                config,
                serving.slots(),
                workers,
                stop.clone(),
            ));
        }
        if let Some(h3_inbox) = h3_inbox {
            tracker.spawn(super::public_h3::serve(
                h3_inbox,
                serving.clone(),
                tracker.clone(),
                stop.clone(),
            ));
        }
        // Requests peers forward: served here as this worker's public
        // ones are, through its tunnels when it drives any of the
        // runtime's; drained with the public side.
        if let Some(listener) = peer {
            match TcpListener::from_std(listener) {
                Ok(listener) => {
                    let tls = shared.peers.as_ref().and_then(|p| p.tls.as_ref());
                    let tls = tls.map(|t| t.acceptor.clone());
                    let shared = shared.clone();
                    let answer = move |req, from| answer_peer(req, from, shared.clone(), index);
                    tracker.spawn(super::peers::listen(
                        listener,
                        tls,
                        answer,
                        tracker.clone(),
                        stop.clone(),
                    ));
                }
                Err(e) => {
                    tracing::error!(worker = index, error = %e, "cannot register the peer listener")
                }
            }
        }
        match TcpListener::from_std(public) {
            Ok(public) => {
                tracker.spawn(accept_public(
                    (public, public_tls, balance, inbox),
                    serving,
                    tracker.clone(),
                    stop.clone(),
                ));
            }
            Err(e) => {
                tracing::error!(worker = index, error = %e, "cannot register the public listener")
            }
        }
        loop {
            let arrival = tokio::select! {
                t = tunnels.recv() => match t { Some(t) => t, None => break },
                _ = stop.cancelled() => break,
            };
            let (stream, peer) = match arrival {
                Arrival::Tcp(stream, peer) => (stream, peer),
                Arrival::Quic(incoming) => {
                    // Accepted here, so the connection is driven by this
                    // worker's thread.
                    tunnel_tasks.spawn(serve_quic_tunnel(
                        *incoming,
                        index,
                        shared.clone(),
                        stops.tunnels.clone(),
                    ));
                    continue;
                }
            };
            match TcpStream::from_std(stream) {
                Ok(stream) => {
                    tunnel_tasks.spawn(serve_tunnel(
                        stream,
                        peer,
                        index,
                        tls.clone(),
                        shared.clone(),
                        stops.tunnels.clone(),
                    ));
                }
                Err(e) => {
                    tracing::warn!(peer = %peer, error = %e, "cannot register a tunnel connection")
                }
            }
        }
        tracker.close();
        tracker.wait().await;
        if shared.tracing.is_some() {
            // The spans of this worker's last public requests.
            portcullis_obs::otlp::flush_and_wait().await;
        }
        let _ = drained.send(());
        tunnel_tasks.close();
        tunnel_tasks.wait().await;
        if let Some(release) = release {
            release.cancelled().await;
        }
    });
}

/// A tunnel connection handed to a worker.
enum Arrival {
    /// A TCP connection (WebSocket).
    Tcp(std::net::TcpStream, SocketAddr),
    /// A QUIC connection, not yet accepted (boxed: it is large, and rare
    /// next to the channel's other messages).
    Quic(Box<quinn::Incoming>),
}

/// Accepts tunnel connections (TCP, and QUIC when on) and hands them to
/// the workers in turn, so each worker drives its share of the tunnels.
async fn accept_tunnels(
    listener: TcpListener,
    quic: Option<quinn::Endpoint>,
    workers: Vec<tokio::sync::mpsc::UnboundedSender<Arrival>>,
    stop: CancellationToken,
) {
    let mut next = 0;
    loop {
        let arrival = tokio::select! {
            (stream, peer) = portcullis_net::sockets::accept(&listener, "tunnel") => {
                let _ = stream.set_nodelay(true);
                let Ok(stream) = stream.into_std() else {
                    continue;
                };
                Arrival::Tcp(stream, peer)
            }
            Some(incoming) = async { quic.as_ref()?.accept().await } => Arrival::Quic(Box::new(incoming)),
            _ = stop.cancelled() => return,
        };
        next = (next + 1) % workers.len();
        if workers[next].send(arrival).is_err() {
            return;
        }
    }
}

/// Decides on a client's [`Hello`] from `peer`: a valid runtime id and
/// its token, within the failed-attempt rate limit; the token's hash when
/// accepted.
fn check_hello(
    shared: &Shared,
    peer: SocketAddr,
) -> impl FnOnce(&Hello) -> Result<[u8; 32], Refused> + Unpin + '_ {
    move |hello: &Hello| {
        let refused = |status, message, reason| Refused {
            status,
            message,
            reason,
        };
        if !valid_runtime_id(&hello.runtime) {
            return Err(refused(
                StatusCode::BAD_REQUEST,
                "invalid runtime id",
                format!("invalid runtime id {:?}", hello.runtime),
            ));
        }
        shared
            .tokens
            .verify(peer.ip(), &hello.runtime, &hello.token)
            .map_err(|r| match r {
                Refusal::BadCredentials => refused(
                    StatusCode::UNAUTHORIZED,
                    "bad credentials",
                    format!("bad credentials for runtime `{}`", hello.runtime),
                ),
                Refusal::RateLimited => refused(
                    StatusCode::TOO_MANY_REQUESTS,
                    "too many failed attempts",
                    format!("too many failed attempts (runtime `{}`)", hello.runtime),
                ),
            })
    }
}

/// One WebSocket tunnel connection: handshake, authentication, then
/// HTTP/2 over the WebSocket until it ends.
async fn serve_tunnel(
    mut stream: TcpStream,
    mut peer: SocketAddr,
    worker: usize,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    // The PROXY header and the handshake share one deadline.
    let deadline = tokio::time::Instant::now() + super::HANDSHAKE_TIMEOUT;
    if shared.tunnel_proxy_protocol {
        let header = portcullis_net::proxy_protocol::read(&mut stream);
        match tokio::time::timeout_at(deadline, header).await {
            Ok(Ok(source)) => peer = source.unwrap_or(peer),
            Ok(Err(e)) => {
                portcullis_obs::metrics::count_connection_error("tunnel", "proxy_protocol");
                tracing::warn!(peer = %peer, error = %e, "tunnel connection refused");
                return;
            }
            Err(_) => {
                tracing::warn!(peer = %peer, "tunnel connection refused: no PROXY protocol header within 10s");
                return;
            }
        }
    }
    let accepted = super::websocket::accept(stream, tls, check_hello(&shared, peer));
    let (io, hello, token) = match tokio::time::timeout_at(deadline, accepted).await {
        Ok(Ok(done)) => done,
        Ok(Err(super::websocket::NotATunnel::HealthCheck)) => {
            tracing::debug!(peer = %peer, "health check on the tunnel port");
            return;
        }
        Ok(Err(super::websocket::NotATunnel::Refused(e))) => {
            tracing::warn!(peer = %peer, error = %e, "tunnel connection refused");
            return;
        }
        Err(_) => {
            tracing::warn!(peer = %peer, "tunnel connection refused: no handshake within 10s");
            return;
        }
    };
    let handshake = super::h2_client()
        .keep_alive_while_idle(true)
        .handshake::<_, Body>(TokioIo::new(io))
        .await;
    let (sender, conn) = match handshake {
        Ok(pair) => pair,
        Err(e) => {
            tracing::warn!(peer = %peer, runtime = hello.runtime, error = %e, "tunnel HTTP/2 handshake failed");
            return;
        }
    };
    let ended = async move {
        match conn.await {
            Ok(()) => End::Closed,
            Err(e) => End::Lost(e.to_string()),
        }
    };
    run_tunnel(
        Sender::H2(sender),
        hello,
        token,
        peer,
        worker,
        &shared,
        stop,
        ended,
    )
    .await;
}

/// One QUIC tunnel connection: handshake and authentication on its
/// control stream, then a stream per request until it ends.
async fn serve_quic_tunnel(
    incoming: quinn::Incoming,
    worker: usize,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    let peer = incoming.remote_address();
    let accepted = super::quic::accept(incoming, check_hello(&shared, peer));
    let (tunnel, control, hello, token) = match tokio::time::timeout(
        super::HANDSHAKE_TIMEOUT,
        accepted,
    )
    .await
    {
        Ok(Ok(done)) => done,
        Ok(Err(e)) => {
            tracing::warn!(peer = %peer, error = %e, "QUIC tunnel connection refused");
            return;
        }
        Err(_) => {
            tracing::warn!(peer = %peer, "QUIC tunnel connection refused: no handshake within 10s");
            return;
        }
    };
    let sender = Sender::Quic(tunnel.clone());
    let ended = async move {
        tokio::select! {
            closed = tunnel.closed() => match closed {
                Ok(()) => End::Closed,
                Err(why) => End::Lost(why),
            },
            _ = control.draining() => End::Draining,
        }
    };
    run_tunnel(sender, hello, token, peer, worker, &shared, stop, ended).await;
}

/// How a tunnel's connection ended, or that its client is draining.
enum End {
    /// Closed cleanly by the client.
    Closed,
    /// Broken: why.
    Lost(String),
    /// The client takes no new requests; those in flight go on until it
    /// closes the connection.
    Draining,
}

/// A tunnel from its authentication to its end: registered for its
/// runtime (replacing what it replaces), pinged, and removed when `ended`
/// completes, its client stops answering pings, the server closes it or
/// the server stops.
#[allow(clippy::too_many_arguments)]
async fn run_tunnel(
    sender: Sender,
    hello: Hello,
    token: [u8; 32],
    peer: SocketAddr,
    worker: usize,
    shared: &Shared,
    stop: CancellationToken,
    ended: impl Future<Output = End>,
) {
    let (runtime, instance, slot) = (hello.runtime, hello.instance, hello.slot);
    let transport = sender.transport();
    let tunnel = Arc::new(Tunnel {
        id: shared.registry.next_id.fetch_add(1, Ordering::Relaxed),
        instance,
        slot,
        worker,
        token,
        remote: peer,
        since: SystemTime::now(),
        sender,
        rtt_us: AtomicU64::new(0),
        active: AtomicUsize::new(0),
        stats: portcullis_obs::metrics::runtime(&runtime),
        closed: CancellationToken::new(),
    });
    let Added { replaced, stale } = shared.registry.add(&runtime, tunnel.clone());
    if !replaced.iter().any(|t| t.id == tunnel.id) {
        tracing::info!(runtime, peer = %peer, slot, transport, worker, "tunnel connected");
    }
    for old in stale {
        tracing::info!(runtime, old = %old.remote, new = %peer, slot, "client dialled this slot again; closing its previous tunnel");
        old.closed.cancel();
    }
    for old in replaced {
        tracing::warn!(runtime, old = %old.remote, new = %peer, "another client took over this runtime; closing the older client's tunnel");
        tokio::spawn(async move {
            let _ = control(&old, super::REPLACED).await;
            old.closed.cancel();
        });
    }
    // Ends when the client stops answering or its token is no longer
    // valid; the select below then drops the connection.
    let pings = measure_rtt(tunnel.clone(), shared, &runtime);
    let mut draining = false;
    tokio::select! {
        end = ended => match end {
            End::Closed => tracing::info!(runtime, peer = %peer, "tunnel closed"),
            End::Lost(e) => tracing::warn!(runtime, peer = %peer, error = %e, "tunnel lost"),
            End::Draining => draining = true,
        },
        _ = pings => {}
        _ = tunnel.closed.cancelled() => tracing::info!(runtime, peer = %peer, "tunnel closed by the server"),
        _ = stop.cancelled() => {}
    }
    shared.registry.remove(&runtime, tunnel.id);
    if let Sender::Quic(quic) = &tunnel.sender {
        if draining {
            tracing::info!(runtime, peer = %peer, "tunnel client draining; sending it no new requests");
            tokio::select! {
                closed = quic.closed() => match closed {
                    Ok(()) => tracing::info!(runtime, peer = %peer, "tunnel closed"),
                    Err(e) => tracing::warn!(runtime, peer = %peer, error = %e, "tunnel lost"),
                },
                _ = tunnel.closed.cancelled() => {}
                _ = stop.cancelled() => {}
            }
        }
        // A QUIC connection lives while any handle does (requests in
        // flight hold some); the others are cut off like HTTP/2's.
        quic.close("closed by the server");
    }
}

/// Sends a control request to the client behind `tunnel`.
async fn control(tunnel: &Tunnel, what: &'static str) -> Result<(), String> {
    let req = Request::builder()
        .uri("http://tunnel/_portcullis/control")
        .header(super::CONTROL, what)
        .body(Body::empty())
        .map_err(|e| e.to_string())?;
    let resp = tokio::time::timeout(super::KEEPALIVE_TIMEOUT, tunnel.sender.send(req))
        .await
        .map_err(|_| "no answer".to_owned())??;
    if resp.status().is_success() {
        Ok(())
    } else {
        Err(format!("answered {}", resp.status()))
    }
}

/// Measures the round trip every keep-alive interval (shown on the admin
/// endpoint); returns when the client stops answering, or when the
/// runtime's token was rotated or removed from the tokens file.
async fn measure_rtt(tunnel: Arc<Tunnel>, shared: &Shared, runtime: &str) {
    loop {
        if shared.tokens.current(runtime) != Some(tunnel.token) {
            tracing::warn!(runtime, peer = %tunnel.remote, "the runtime's token changed in the tokens file; closing its tunnel");
            return;
        }
        let start = Instant::now();
        match control(&tunnel, "ping").await {
            Ok(()) => tunnel
                .rtt_us
                .store(start.elapsed().as_micros() as u64, Ordering::Relaxed),
            Err(e) => {
                tracing::warn!(runtime, peer = %tunnel.remote, error = %e, "tunnel ping failed; closing it");
                return;
            }
        }
        tokio::time::sleep(super::KEEPALIVE_INTERVAL).await;
    }
}

/// Time a public connection has to send a request head: its first from
/// the accept, a later one from its first byte (`head_deadline`). Idle
/// connections between requests have the keep-alive timeout.
const PUBLIC_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

async fn accept_public(
    (listener, tls, balance, mut inbox): (
        TcpListener,
        Option<tokio_rustls::TlsAcceptor>,
        Arc<Balance>,
        UnboundedReceiver<Handoff>,
    ),
    public: Public,
    tracker: TaskTracker,
    stop: CancellationToken,
) {
    let worker = public.worker;
    // Spread over the workers as the routing core's listeners are: the
    // kernel's hash alone can leave one worker most of a client's pool.
    let mut accepting = Accepting {
        socket: &listener,
        name: "public",
        balance: &balance,
        worker,
        inbox: &mut inbox,
    };
    while let Some((stream, peer, permit, counted)) = accepting
        .next(|| public.shared.public_slots.clone(), &stop)
        .await
    {
        let _ = stream.set_nodelay(true);
        if tls.is_none() && !public.shared.proxy_protocol {
            let served = public.serve(stream, peer, None);
            tracker.spawn(served.map(move |()| drop((permit, counted))));
            continue;
        }
        // The PROXY header and the handshake are read in the connection's
        // task, not the accept loop, under the same deadline as a first
        // request head (a client that opens a connection and says nothing
        // holds a slot no longer).
        let (public, tls, stop) = (public.clone(), tls.clone(), stop.clone());
        tracker.spawn(async move {
            let deadline = tokio::time::Instant::now() + PUBLIC_HEADER_READ_TIMEOUT;
            let tls = tls.as_ref().map(|t| (t, PLAIN_ON_HTTPS));
            let opened = open(stream, peer, public.shared.proxy_protocol, tls);
            let opened = tokio::time::timeout_at(deadline, opened);
            let opened = tokio::select! {
                opened = opened => opened,
                _ = stop.cancelled() => return,
            };
            match opened {
                Ok(Ok((Opened::Tcp(stream), client))) => public.serve(stream, client, None).await,
                Ok(Ok((Opened::Tls(stream), client))) => {
                    let version = stream.get_ref().1.protocol_version();
                    public.serve(*stream, client, version).await
                }
                Ok(Err(NotOpened::ProxyHeader(e))) => {
                    tracing::debug!(peer = %peer, error = %e, "public connection closed");
                    portcullis_obs::metrics::count_connection_error("public", "proxy_protocol");
                }
                Ok(Err(NotOpened::Tls(refused))) => {
                    tracing::debug!(peer = %peer, "public connection closed: {refused}");
                    portcullis_obs::metrics::count_connection_error("public", refused.reason());
                }
                Err(_) => portcullis_obs::metrics::connection_timed_out("public"),
            }
            drop((permit, counted));
        });
    }
    // Connections handed to this worker and not yet taken close with the
    // inbox.
    drop(inbox);
    public.connections.shutdown().await;
}

/// What serving a public connection needs, one per worker.
#[derive(Clone)]
pub(super) struct Public {
    builder: Arc<portcullis_net::h1_or_h2::Builder>,
    connections: portcullis_net::drain::Connections,
    worker: usize,
    shared: Arc<Shared>,
}

impl Public {
    fn new(worker: usize, shared: Arc<Shared>) -> Public {
        let mut builder = portcullis_net::h1_or_h2::Builder::new();
        builder
            .http1
            .timer(TokioTimer::new())
            // As the routing core's listeners (see `head_deadline`): hyper's
            // head clock runs between requests too, so it takes the keep-alive
            // timeout, and heads have the short one.
            .header_read_timeout(portcullis_config::DEFAULT_KEEPALIVE_TIMEOUT)
            // The same bound as HTTP/2's (hyper's default was its ~400 KiB
            // read buffer).
            .max_header_size(super::MAX_PUBLIC_HEAD as usize);
        builder
            .http2
            .timer(TokioTimer::new())
            .max_header_list_size(super::MAX_PUBLIC_HEAD)
            .initial_stream_window_size(super::STREAM_WINDOW)
            .initial_connection_window_size(super::CONNECTION_WINDOW);
        Public {
            builder: Arc::new(builder),
            connections: portcullis_net::drain::Connections::new(),
            worker,
            shared,
        }
    }

    /// The public connection cap's slots.
    pub(super) fn slots(&self) -> Arc<tokio::sync::Semaphore> {
        self.shared.public_slots.clone()
    }

    /// One public request, on any HTTP version: sent through its runtime's
    /// tunnel, with an access line (its `upstream` the runtime's host) and
    /// the runtime's metrics written when the response body ends, as the
    /// routing core does.
    /// `tls` is the connection's TLS version, for the access line.
    pub(super) async fn respond<B>(
        &self,
        req: Request<B>,
        peer: SocketAddr,
        tls: Option<rustls::ProtocolVersion>,
    ) -> Response<ResponseBody>
    where
        B: http_body::Body + Into<Body> + Send,
    {
        let origin = Origin::Public;
        respond(req, (peer, tls), self.worker, &self.shared, origin).await
    }

    /// Serves HTTP on one public connection (TCP, or TLS over it, of
    /// version `tls`) until it closes, as the routing core serves its
    /// listeners' connections (`portcullis_http::connection`).
    fn serve<S>(
        &self,
        stream: S,
        peer: SocketAddr,
        tls: Option<rustls::ProtocolVersion>,
    ) -> impl Future<Output = ()> + use<S>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    {
        let public = self.clone();
        let respond = move |req: Request<Incoming>| {
            let public = public.clone();
            // Boxed, unlike on the routing core's listeners: hyper keeps
            // a box the size of this future (~8 KiB) for the connection's
            // life, and this side faces the internet's idle clients; the
            // copy into a box per request is little beside a tunnel's
            // crossing.
            Box::pin(async move { public.respond(req, peer, tls).await })
        };
        let (max_requests, lifetime) = self.shared.public_connection_limits;
        let accepted = portcullis_http::connection::Accepted {
            builder: &self.builder,
            connections: &self.connections,
            listener: "public",
            client: peer,
            worker: self.worker,
            retire: portcullis_net::drain::Retire::new(max_requests, lifetime),
            header_read_timeout: PUBLIC_HEADER_READ_TIMEOUT,
        };
        portcullis_http::connection::serve(stream, accepted, respond)
    }
}

/// Where a request to forward came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// A public client: served through this server's tunnels, or passed
    /// on to a peer holding one.
    Public,
    /// Another replica that holds no tunnel of the runtime: served
    /// through this server's tunnels only, and not counted in the
    /// runtime's metrics here (the public side that took it counts it).
    Peer(SocketAddr),
}

/// A public or peer request's connection, as the phases see it.
struct PublicConn {
    /// The client: the connection's peer, or for a peer's request the
    /// client it names.
    client: SocketAddr,
    /// The connection's TLS version (`None` for a peer's request).
    tls: Option<rustls::ProtocolVersion>,
    worker: usize,
    origin: Origin,
}

/// A request on any HTTP version, from the public or from a peer: sent
/// through its runtime's tunnel (or a peer) by the routing core's phase
/// driver, so its access line (its `upstream` the runtime's host; its
/// `route` the peer, when one took part), id, span, metrics and error
/// shapes are the core's.
async fn respond<B>(
    req: Request<B>,
    (client, tls): (SocketAddr, Option<rustls::ProtocolVersion>),
    worker: usize,
    shared: &Shared,
    origin: Origin,
) -> Response<ResponseBody>
where
    B: http_body::Body + Into<Body> + Send,
{
    let conn = PublicConn {
        client,
        tls,
        worker,
        origin,
    };
    portcullis_http::phases::drive(shared, req, &conn).await
}

impl Phases for Shared {
    type Conn = PublicConn;

    fn entry<'c>(&self, conn: &'c PublicConn, _version: Version) -> Entry<'c> {
        Entry {
            client: conn.client,
            worker: conn.worker,
            // Passed in as a version, not its name: a `&'static str`
            // argument trips rustc's `Send` check of the spawned
            // connection future.
            tls_version: conn.tls.map(portcullis_net::tls_listen::version_name),
            client_cert: None,
            // Every public request gets its id here, at the edge (a
            // peer's carries the one its public side gave it).
            request_ids: RequestIds::Make,
            // The public side counts the request, not a peer that serves
            // it for the public side of another replica.
            counted: (conn.origin == Origin::Public).then(portcullis_obs::metrics::no_runtime),
            watch: None,
        }
    }

    fn trace(
        &self,
        conn: &PublicConn,
    ) -> Option<(
        &Arc<Tracing>,
        &Arc<UpstreamPool>,
        portcullis_obs::otlp::Arrival,
    )> {
        // The public edge: where a trace starts (or joins its client's).
        let (tracing, pool) = self.tracing.as_ref()?;
        let public = conn.origin == Origin::Public;
        let from = portcullis_obs::otlp::Arrival {
            peer: conn.client.ip(),
            // A peer's request names its client already.
            trust_forwarded: public && self.trust_forwarded_headers,
            https: conn.tls.is_some(),
            trust_traceparent: tracing.trust_incoming || !public,
        };
        Some((tracing, pool, from))
    }

    async fn serve<B>(
        &self,
        req: Request<B>,
        conn: &PublicConn,
        ctx: &mut RequestCtx,
    ) -> (Response<Body>, Held)
    where
        B: http_body::Body + Into<Body> + Send,
    {
        if let Some(log) = ctx.log.as_mut() {
            log.upstream = host_of(&req).map(Into::into);
            if let Origin::Peer(from) = conn.origin {
                log.route = Some(format!("from peer {from}").into());
            }
        }
        let mut via = None;
        let stats = (ctx.stats(), &mut via);
        let resp = forward(req, conn.client, conn.worker, self, conn.origin, stats).await;
        if let (Some(log), Some(peer)) = (ctx.log.as_mut(), via) {
            log.route = Some(format!("peer {peer}").into());
        }
        (resp, Held::default())
    }

    fn finish(&self, resp: &mut Response<Body>, version: Version, conn: &PublicConn) {
        // The routing core refused a body the client may still be
        // sending: close after the answer, lingering, as the core does on
        // its own listeners (`portcullis_net::linger`).
        if resp.status() == StatusCode::PAYLOAD_TOO_LARGE && version < Version::HTTP_2 {
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            resp.extensions_mut()
                .insert(portcullis_http::pipeline::Linger);
        }
        if conn.origin == Origin::Public
            && version < Version::HTTP_3
            && let Some(alt_svc) = &self.alt_svc
        {
            resp.headers_mut().insert(header::ALT_SVC, alt_svc.clone());
        }
    }
}

/// Answers on the peer listener: a poll for this server's runtimes, or a
/// request a peer forwards, carrying the client's address.
async fn answer_peer(
    req: Request<Incoming>,
    from: SocketAddr,
    shared: Arc<Shared>,
    worker: usize,
) -> Response<ResponseBody> {
    let plain =
        |resp: Response<Body>| resp.map(|b| ResponseBody::new(b, None, None, Held::default()));
    let Some(peers) = &shared.peers else {
        return plain(super::peers::refused());
    };
    if !peers.authentic(req.headers()) {
        tracing::warn!(from = %from, method = %req.method(), path = req.uri().path(), "peer request refused: wrong or missing peer token");
        return plain(super::peers::refused());
    }
    let for_runtime = req
        .uri()
        .host()
        .is_some_and(|h| h.to_ascii_lowercase().ends_with(&shared.suffix));
    if !for_runtime {
        return plain(
            if req.uri().path() == "/runtimes" && req.method() == http::Method::GET {
                super::peers::presence(
                    req.uri().query(),
                    &peers.instance,
                    shared.registry.presence(),
                )
            } else {
                error(StatusCode::NOT_FOUND, "not a peer endpoint", None)
            },
        );
    }
    let client = req
        .headers()
        .get(super::CLIENT_ADDR)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(from);
    respond(req, (client, None), worker, &shared, Origin::Peer(from)).await
}

/// Where a request goes: one of this server's tunnels, or the peers that
/// hold one, in the order to try them.
enum Target {
    Tunnel(Arc<Tunnel>),
    Peers(Vec<Arc<super::peers::Link>>),
}

/// A known runtime with no tunnel here, nor a peer to reach one through.
fn not_connected(runtime: &str) -> Response<Body> {
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "runtime is not connected",
        Some(runtime),
    )
}

/// The public request's host, lower case, without port (`None` for a
/// request whose host is missing or ambiguous: [`request_head::request_host`]).
fn host_of<B>(req: &Request<B>) -> Option<String> {
    request_head::request_host(req.version(), req.uri(), req.headers())
        .ok()
        .flatten()
        .map(Cow::into_owned)
}

fn error(status: StatusCode, message: &str, runtime: Option<&str>) -> Response<Body> {
    let body = serde_json::json!({
        "error": message,
        "status": status.as_u16(),
        "runtime": runtime,
    });
    let mut resp = portcullis_http::pipeline::json_response(status, &body);
    // A gRPC client gets it in gRPC's terms, as the routing core's own
    // errors (`portcullis_http::grpc_local`).
    resp.extensions_mut()
        .insert(portcullis_http::grpc_local::LocalError(message.into()));
    resp
}

/// Sends a request through its runtime's tunnel, or to a peer that holds
/// one when this server holds none and the request is public; `stats` is
/// set to the runtime's metrics once the runtime is known, `via` to the
/// peer it went to.
async fn forward<B>(
    mut req: Request<B>,
    peer: SocketAddr,
    worker: usize,
    shared: &Shared,
    origin: Origin,
    (stats, via): (&mut &'static RouteStats, &mut Option<SocketAddr>),
) -> Response<Body>
where
    B: http_body::Body + Into<Body>,
{
    let host = match request_head::request_host(req.version(), req.uri(), req.headers()) {
        Ok(Some(host)) => host.into_owned(),
        Ok(None) => return error(StatusCode::BAD_REQUEST, "request has no host", None),
        Err(refused) => return error(refused.status(), refused.message(), None),
    };
    if request_head::unsupported_coding(req.headers(), req.body()) {
        let refused = request_head::Refused::Coding;
        return error(refused.status(), refused.message(), None);
    }
    let Some(runtime) = host.strip_suffix(&shared.suffix) else {
        return error(
            StatusCode::NOT_FOUND,
            &format!("{host} is not a runtime under this tunnel's domain"),
            None,
        );
    };
    if !valid_runtime_id(runtime) {
        return error(StatusCode::NOT_FOUND, "not a runtime host", None);
    }
    let tunnel = shared.registry.pick(runtime, worker);
    let holders = match (&tunnel, origin, &shared.peers) {
        (None, Origin::Public, Some(peers)) => peers.holders(runtime, worker),
        _ => Vec::new(),
    };
    let target = match tunnel {
        Some(tunnel) => {
            *stats = tunnel.stats;
            Target::Tunnel(tunnel)
        }
        None if !holders.is_empty() => {
            *stats = portcullis_obs::metrics::runtime(runtime);
            Target::Peers(holders)
        }
        None if shared.tokens.knows(runtime) => {
            *stats = portcullis_obs::metrics::runtime(runtime);
            return not_connected(runtime);
        }
        None => {
            return error(StatusCode::BAD_GATEWAY, "unknown runtime", Some(runtime));
        }
    };
    // Counted once, where the public reached: a peer does not count a
    // request again. Only known, connected runtimes get this far, so the
    // 429 is in the runtime's metrics.
    if origin == Origin::Public
        && let Some(limit) = &shared.rate_limit
    {
        let client = portcullis_net::client_addr::client_of(
            peer.ip(),
            shared.trust_forwarded_headers,
            req.headers(),
        );
        let mut buf = [0u8; 16];
        if let Err(wait) = limit.take(Some(portcullis_http::rate_limit::ip_key(client, &mut buf))) {
            let mut resp = error(
                StatusCode::TOO_MANY_REQUESTS,
                "rate limit exceeded",
                Some(runtime),
            );
            portcullis_http::rate_limit::retry_after(resp.headers_mut(), wait);
            return resp;
        }
    }
    // An HTTP/1.1 upgrade (WebSocket) crosses the tunnel as an HTTP/2
    // extended CONNECT (RFC 8441) whose stream then carries the bytes; a
    // peer passes one on in that shape already.
    let upgrade = match origin {
        Origin::Public => portcullis_http::forward::is_websocket_upgrade(req.headers())
            .then(|| req.headers().get(header::UPGRADE).cloned())
            .flatten(),
        Origin::Peer(_) => (req.method() == http::Method::CONNECT)
            .then(|| req.extensions().get::<hyper::ext::Protocol>())
            .flatten()
            .and_then(|p| HeaderValue::from_str(p.as_str()).ok()),
    };
    let public_upgrade = upgrade.as_ref().map(|_| hyper::upgrade::on(&mut req));
    let (mut parts, body) = req.into_parts();
    let claimed = portcullis_http::forward::remove_hop_by_hop(&mut parts.headers, false);
    if let Some(protocol) = &upgrade {
        parts.method = http::Method::CONNECT;
        parts.extensions.insert(hyper::ext::Protocol::from(
            protocol.to_str().unwrap_or("websocket"),
        ));
    }
    // Only the tunnel server speaks these.
    parts
        .headers
        .remove(HeaderName::from_static(super::CONTROL));
    parts
        .headers
        .remove(HeaderName::from_static(super::CLIENT_ADDR));
    parts
        .headers
        .remove(HeaderName::from_static(super::peers::PEER_TOKEN));
    if let Ok(v) = HeaderValue::from_str(&peer.to_string()) {
        parts
            .headers
            .insert(HeaderName::from_static(super::CLIENT_ADDR), v);
    }
    let proto = if shared.public_tls { "https" } else { "http" };
    let xfp = HeaderName::from_static("x-forwarded-proto");
    let xfh = HeaderName::from_static("x-forwarded-host");
    // A peer set them from its public side.
    let trust = shared.trust_forwarded_headers || matches!(origin, Origin::Peer(_));
    if !(trust && parts.headers.contains_key(&xfp)) {
        parts.headers.insert(xfp, HeaderValue::from_static(proto));
    }
    if !(trust && parts.headers.contains_key(&xfh))
        && let Ok(v) = HeaderValue::from_str(&host)
    {
        parts.headers.insert(xfh, v);
    }
    // The public side takes no client certificates: one a client names
    // is made up.
    if claimed && !trust {
        parts.headers.remove(portcullis_http::forward::CLIENT_CERT);
    }
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    parts.uri = match Uri::builder()
        .scheme(proto)
        .authority(host.as_str())
        .path_and_query(path)
        .build()
    {
        Ok(uri) => uri,
        Err(_) => return error(StatusCode::BAD_REQUEST, "bad request target", Some(runtime)),
    };
    parts.version = Version::HTTP_2;
    parts.headers.remove(header::HOST);
    let body = if upgrade.is_some() {
        Body::empty()
    } else {
        body.into()
    };
    let request_id = parts
        .headers
        .get(portcullis_obs::request_id::HEADER)
        .cloned();
    let mut req = Request::from_parts(parts, body);
    let result = match &target {
        Target::Tunnel(tunnel) => {
            let _counted = super::Active::count(&tunnel.active);
            tunnel.sender.send(req).await
        }
        Target::Peers(holders) => {
            let Some(peers) = &shared.peers else {
                return not_connected(runtime);
            };
            peers.stamp(req.headers_mut());
            // The first holder that takes a connection gets the request;
            // one that does not (it died since the last poll) has been
            // sent nothing, so the next can be tried, whatever the body.
            let mut sent = None;
            for link in holders {
                match link.ready().await {
                    Ok(sender) => {
                        *via = Some(link.addr);
                        sent = Some(link.forward(sender, req).await);
                        break;
                    }
                    Err(e) => peers.lost(link.addr, &e),
                }
            }
            match sent {
                Some(result) => result,
                None => return not_connected(runtime),
            }
        }
    };
    match result {
        Ok(mut resp) => {
            let upgraded = match (public_upgrade, &upgrade) {
                (Some(public), Some(protocol)) if resp.status() == StatusCode::OK => {
                    let tunnel_side = hyper::upgrade::on(&mut resp);
                    splice(public, tunnel_side, runtime.to_owned());
                    Some(protocol.clone())
                }
                _ => None,
            };
            let (mut parts, body) = resp.into_parts();
            let _ = portcullis_http::forward::remove_hop_by_hop(&mut parts.headers, false);
            if upgraded.is_some() && matches!(origin, Origin::Peer(_)) {
                // The peer's stream is an extended CONNECT: 200 opens it.
                return Response::from_parts(parts, Body::empty());
            }
            if let Some(protocol) = upgraded {
                parts.status = StatusCode::SWITCHING_PROTOCOLS;
                parts.headers.insert(header::UPGRADE, protocol);
                parts
                    .headers
                    .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
                return Response::from_parts(parts, Body::empty());
            }
            Response::from_parts(parts, Body::from(body))
        }
        Err(e) => match target {
            Target::Tunnel(_) => {
                let request_id = portcullis_obs::request_id::text(request_id.as_ref());
                tracing::warn!(runtime, request_id, error = %e, "request through the tunnel failed");
                error(
                    StatusCode::BAD_GATEWAY,
                    "the tunnel to this runtime failed",
                    Some(runtime),
                )
            }
            Target::Peers(_) => {
                let request_id = portcullis_obs::request_id::text(request_id.as_ref());
                let peer = via.map(|p| p.to_string()).unwrap_or_default();
                tracing::warn!(runtime, peer, request_id, error = %e, "request through a peer failed");
                error(
                    StatusCode::BAD_GATEWAY,
                    "the peer server holding this runtime's tunnel failed",
                    Some(runtime),
                )
            }
        },
    }
}

/// Copies both ways between the public client's upgraded connection and
/// the tunnel stream, once both are ready.
fn splice(public: hyper::upgrade::OnUpgrade, tunnel: hyper::upgrade::OnUpgrade, runtime: String) {
    tokio::spawn(async move {
        let (public, tunnel) = match tokio::try_join!(public, tunnel) {
            Ok(pair) => pair,
            Err(e) => {
                tracing::warn!(runtime, error = %e, "upgrade through the tunnel failed");
                return;
            }
        };
        let (mut public, mut tunnel) = (TokioIo::new(public), TokioIo::new(tunnel));
        if let Err(e) = tokio::io::copy_bidirectional(&mut public, &mut tunnel).await {
            tracing::debug!(runtime, error = %e, "upgraded connection through the tunnel ended with an error");
        }
    });
}

fn admin(req: Request<Incoming>, shared: &Shared) -> portcullis_obs::admin_http::Answer {
    let path = req.uri().path();
    // Both endpoints only read; HEAD is GET without the body.
    if matches!(path, "/" | "/status" | "/metrics")
        && !matches!(*req.method(), http::Method::GET | http::Method::HEAD)
    {
        return portcullis_obs::admin_http::method_not_allowed(path, "GET, HEAD");
    }
    let runtimes = shared.registry.snapshot();
    match path {
        "/" => portcullis_obs::status_page::answer(),
        "/status" => portcullis_obs::admin_http::json(
            StatusCode::OK,
            serde_json::json!({
                "version": env!("CARGO_PKG_VERSION"),
                "domain": shared.suffix.trim_start_matches('.'),
                "public": {
                    "tls": shared.public_tls,
                    "trust_forwarded_headers": shared.trust_forwarded_headers,
                    "proxy_protocol": shared.proxy_protocol,
                    "http3": shared.alt_svc.is_some(),
                },
                "tunnel_endpoint": {
                    "proxy_protocol": shared.tunnel_proxy_protocol,
                    "quic": shared.tunnel_quic,
                },
                "quic_congestion": shared.quic_congestion.name(),
                "instance": shared.peers.as_ref().map(|p| p.instance.clone()),
                "peers": shared.peers.as_ref().map(|p| p.snapshot()),
                "runtimes": runtimes.iter().map(|r| serde_json::json!({
                    "id": r.id,
                    "connections": r.tunnels.len(),
                    "connected_since": r.tunnels.iter().map(|t| t.since).min().map(portcullis_obs::admin_http::rfc3339),
                    "tunnels": r.tunnels.iter().map(|t| serde_json::json!({
                        "transport": t.transport,
                        "worker": t.worker,
                        "remote": t.remote.to_string(),
                        "since": portcullis_obs::admin_http::rfc3339(t.since),
                        "rtt_ms": t.rtt.as_secs_f64() * 1e3,
                        "active_requests": t.active,
                    })).collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
            }),
        ),
        "/metrics" => {
            use portcullis_obs::admin_http::metric;
            use portcullis_obs::metrics::label;
            let mut out = String::new();
            metric(
                &mut out,
                "portcullis_tunnel_runtimes",
                "gauge",
                "Runtimes with at least one tunnel connected.",
                &[(String::new(), runtimes.len() as f64)],
            );
            let per = |f: &dyn Fn(&RuntimeStatus) -> f64| -> Vec<(String, f64)> {
                runtimes
                    .iter()
                    .map(|r| (format!("{{runtime=\"{}\"}}", label(&r.id)), f(r)))
                    .collect()
            };
            metric(
                &mut out,
                "portcullis_tunnel_connections",
                "gauge",
                "Tunnel connections per runtime.",
                &per(&|r| r.tunnels.len() as f64),
            );
            metric(
                &mut out,
                "portcullis_tunnel_rtt_seconds",
                "gauge",
                "Smallest round trip measured among a runtime's tunnels.",
                &per(&|r| {
                    r.tunnels
                        .iter()
                        .map(|t| t.rtt.as_secs_f64())
                        .fold(f64::INFINITY, f64::min)
                }),
            );
            metric(
                &mut out,
                "portcullis_tunnel_active_requests",
                "gauge",
                "Public requests in flight per runtime.",
                &per(&|r| r.tunnels.iter().map(|t| t.active as f64).sum()),
            );
            if let Some(peers) = &shared.peers {
                let peers = peers.snapshot();
                let count =
                    |up: bool| peers.iter().filter(|p| !p.itself && p.up == up).count() as f64;
                metric(
                    &mut out,
                    "portcullis_tunnel_peers",
                    "gauge",
                    "Peer servers, by whether their last poll answered.",
                    &[
                        ("{state=\"up\"}".to_owned(), count(true)),
                        ("{state=\"down\"}".to_owned(), count(false)),
                    ],
                );
                let per_peer = |value: &dyn Fn(&super::peers::PeerStatus) -> f64| {
                    peers
                        .iter()
                        .filter(|p| !p.itself)
                        .map(|p| (format!("{{peer=\"{}\"}}", label(&p.address)), value(p)))
                        .collect::<Vec<_>>()
                };
                metric(
                    &mut out,
                    "portcullis_tunnel_peer_forwarded_total",
                    "counter",
                    "Public requests passed to a peer holding the runtime's tunnel.",
                    &per_peer(&|p| p.forwarded as f64),
                );
                metric(
                    &mut out,
                    "portcullis_tunnel_peer_active_requests",
                    "gauge",
                    "Public requests passed to a peer and waiting for its answer.",
                    &per_peer(&|p| p.active_requests as f64),
                );
            }
            if shared.tracing.is_some() {
                metric(
                    &mut out,
                    "portcullis_trace_spans_total",
                    "counter",
                    "Spans for the collector (--otlp-endpoint): exported, failed (refused or not answered), dropped (too many exports in flight).",
                    &portcullis_obs::otlp::metric_samples(),
                );
            }
            portcullis_obs::metrics::render(&mut out);
            portcullis_obs::admin_http::prometheus(out)
        }
        _ => portcullis_obs::admin_http::json(
            StatusCode::NOT_FOUND,
            serde_json::json!({"error": "not found", "endpoints": ["GET /status", "GET /metrics"]}),
        ),
    }
}
