//! `portcullis tunnel-server`: the public side. Accepts tunnel clients on
//! the tunnel endpoint (WebSocket, over TLS when given a certificate),
//! authenticates them, and forwards each public request for
//! `<runtime-id>.<domain>` through that runtime's tunnel.
//!
//! Here: binding and running the workers. `options.rs` holds the command
//! line's settings, `registry.rs` the runtimes and their tunnels,
//! `endpoint.rs` the tunnel endpoint, `public.rs` the public side (the
//! routing core's connection server and phase driver), `forward.rs` a
//! request's way through a tunnel or a peer, `admin.rs` the admin listener.

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
use http::{Request, Response, StatusCode, Version};
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
use portcullis_forward::{Body, ResponseBody};
use portcullis_forward::{Held, UpstreamPool};
use portcullis_http::phases::{Entry, Phases, RequestCtx};
use portcullis_http::request_head;
use portcullis_net::balance::{Accepting, Balance, Handoff};
use portcullis_net::tls_listen::Opened;
use portcullis_obs::metrics::RouteStats;

mod admin;
mod endpoint;
mod forward;
mod options;
mod public;
mod public_h3;
mod registry;
mod worker;

use admin::*;
use endpoint::*;
use forward::*;
use options::*;
pub use options::{ServerOptions, TraceOptions};
pub(crate) use public::Public;
use public::*;
use registry::*;
pub use registry::{Registry, RuntimeStatus, Tunnel, TunnelStatus};
use worker::*;

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
    /// The other replicas, found through the registry (`--registry`).
    peers: Option<Arc<super::peers::Peers>>,
    /// The public side's limit per client.
    rate_limit: Option<portcullis_http::rate_limit::RateLimit>,
    /// Spans for a collector: its settings and pool.
    tracing: Option<(Arc<Tracing>, Arc<UpstreamPool>)>,
    /// [`ServerOptions::public_connection_limits`].
    public_connection_limits: (u32, Duration),
    /// Set at SIGTERM: `/readyz` answers 503 from then on.
    draining: std::sync::atomic::AtomicBool,
    /// [`ServerOptions::shutdown_delay`].
    shutdown_delay: Duration,
    /// Public WebSockets spliced through tunnels.
    upgrades: TaskTracker,
    /// The workers' signs of life: a stalled worker is not ready.
    heartbeats: Arc<portcullis_net::worker_beat::Heartbeats>,
}

/// This server's holdings as the shared registry sees them: what the
/// registry of tunnels holds, and closing tunnels a newer client holds
/// elsewhere.
impl crate::peers::directory::Local for Shared {
    fn changed(&self) -> &tokio::sync::Notify {
        &self.registry.changed
    }

    fn held(&self) -> Vec<crate::peers::directory::Held> {
        self.registry.held()
    }

    fn superseded(&self, runtime: &str, newer: &str) {
        let old = self.registry.superseded(runtime, newer);
        close_replaced(old, runtime, "a newer client on another server");
    }
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
            public_h3::server_config,
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
        // A socket per worker, as for the public side: with clients
        // dialling a single balanced address, most requests may reach a
        // runtime through a peer, and one worker would carry them all.
        let mut peer_listeners = Vec::new();
        let mut peers = None;
        if let Some(options) = &options.peers {
            let addr = options.listen;
            let peer_err = || format!("cannot bind the peer listener on {addr}");
            let bound;
            (bound, peer_listeners) =
                portcullis_net::sockets::worker_sockets(addr, workers).with_context(peer_err)?;
            let mut options = options.clone();
            // Advertised with port 0 (`--peer-listen HOST:0`): the port
            // it was given.
            if let Some(host) = options.advertise.strip_suffix(":0") {
                options.advertise = format!("{host}:{}", bound.port());
            }
            peers = Some(Arc::new(super::peers::Peers::new(
                &options,
                super::client::instance_id(),
                workers,
            )?));
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
                draining: std::sync::atomic::AtomicBool::new(false),
                shutdown_delay: options.shutdown_delay,
                upgrades: TaskTracker::new(),
                heartbeats: Default::default(),
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
    pub async fn serve_admin(
        &self,
        addr: SocketAddr,
        access: portcullis_obs::admin_access::AdminAccess,
    ) -> std::io::Result<SocketAddr> {
        let shared = self.shared.clone();
        portcullis_obs::admin_http::serve_with(
            addr,
            access,
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
            tokio::spawn(crate::peers::directory::run(
                peers.clone(),
                self.shared.clone(),
                stop.clone(),
            ));
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
        tokio::pin!(accepting);
        let accept_ended = tokio::select! {
            _ = shutdown => false,
            _ = &mut accepting => true,
        };
        // Not ready from now on; still serving for the delay, so the
        // balancers see /readyz fail and stop sending before we stop.
        self.shared
            .draining
            .store(true, std::sync::atomic::Ordering::Relaxed);
        if !accept_ended && !self.shared.shutdown_delay.is_zero() {
            tracing::info!(delay = ?self.shared.shutdown_delay, "draining: /readyz answers 503; serving until the delay ends");
            tokio::select! {
                _ = tokio::time::sleep(self.shared.shutdown_delay) => {}
                _ = &mut accepting => {}
            }
        }
        tracing::info!("shutting down");
        portcullis_obs::access_log::flush();
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
