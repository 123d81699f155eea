//! `portcullis tunnel-client`: the cluster side. Keeps N outbound tunnel
//! connections to the server (to each, when given several replicas) and
//! serves the requests that come through
//! them with the in-process routing core (its policies and plugins, hot
//! reloaded) — no second network hop — or with one upstream URL.
//!
//! Each tunnel connection lives on one of the routing core's worker
//! threads and uses that worker's upstream pools, like a listener's
//! connection would.

use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio_util::sync::CancellationToken;

use super::{BoxIo, Hello};
use portcullis_config::Listener;
use portcullis_forward::{Body, ResponseBody};
use portcullis_http::conn_info::ConnInfo;
use portcullis_http::server::WorkerContext;

mod serve;

pub(crate) use serve::*;

/// Where the tunnel's requests go.
#[derive(Debug, Clone)]
pub enum Target {
    /// The routing core on these policies (the built-in set when `None`).
    Policies(Option<PathBuf>),
    /// Everything to this one upstream URL.
    Upstream(String),
}

/// Where the token comes from.
#[derive(Clone)]
pub enum Token {
    /// Given directly (environment variable).
    Value(String),
    /// Read from this file at every connection attempt, so a rotated
    /// Secret is picked up without a restart.
    File(PathBuf),
}

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Token::Value(_) => f.write_str("Token::Value(..)"),
            Token::File(p) => write!(f, "Token::File({})", p.display()),
        }
    }
}

impl Token {
    /// The token, trimmed; an error for an empty or placeholder one.
    pub fn read(&self) -> Result<String, String> {
        let token = match self {
            Token::Value(v) => v.clone(),
            Token::File(p) => {
                portcullis_net::files::read_bounded_text(p, portcullis_net::files::SMALL_LIMIT)
                    .map_err(|e| format!("reading the token file {}: {e}", p.display()))?
            }
        };
        let token = token.trim().to_owned();
        if token.is_empty() {
            return Err("the token is empty".into());
        }
        if crate::tokens::is_placeholder(&token) {
            let source = match self {
                Token::Value(_) => "PORTCULLIS_TOKEN".to_owned(),
                Token::File(p) => format!("the token file {}", p.display()),
            };
            return Err(format!(
                "{source} holds `{token}`, a placeholder from an example, not this runtime's token: make a random one with `head -c 32 /dev/urandom | base64`, and give the tunnel server its hash (`portcullis hash-token`)"
            ));
        }
        Ok(token)
    }
}

/// How tunnels reach the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// HTTP/2 over a WebSocket over TCP (and TLS for `wss://`).
    WebSocket,
    /// QUIC to the same host and port over UDP, a stream per request.
    Quic,
    /// QUIC, falling back to WebSocket when a QUIC handshake fails (UDP
    /// blocked on the way, a server without QUIC), and trying QUIC again
    /// at a dial after [`ClientOptions::quic_retry_after`].
    Auto,
}

/// A tunnel counts as up while the server pinged through it within this:
/// two ping intervals and some slack.
const PING_WINDOW: Duration =
    Duration::from_millis(2 * super::KEEPALIVE_INTERVAL.as_millis() as u64 + 5_000);

/// How long `--transport auto` gives a QUIC handshake before it falls
/// back: half the handshake time, so the WebSocket dial has the rest.
const QUIC_FALLBACK_AFTER: Duration = Duration::from_secs(5);

/// How the tunnel client runs.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// `wss://host[:port]` (or `ws://` for local testing): one, or
    /// several servers (replicas) that each get `connections` tunnels.
    pub servers: Vec<http::Uri>,
    /// This runtime's id.
    pub runtime_id: String,
    /// Its token.
    pub token: Token,
    /// Where requests go.
    pub target: Target,
    /// Tunnel connections kept open to each server.
    pub connections: usize,
    /// WebSocket or QUIC.
    pub transport: Transport,
    /// After `auto` fell back to WebSocket, how long before a dial tries
    /// QUIC again: a UDP path that was blocked for a while (a firewall
    /// change, a server that came up without QUIC during a rollout)
    /// does not pin WebSocket until the client restarts, and one that
    /// stays blocked costs one slow dial per period.
    pub quic_retry_after: Duration,
    /// How QUIC tunnels send (requests' answers: downloads).
    pub quic_congestion: super::quic::Congestion,
    /// Extra CA certificate (PEM) to trust for the server.
    pub ca: Option<PathBuf>,
}

/// Reconnection delays: jittered exponential backoff from 0.5 s to 30 s,
/// reset once a connection has stayed up for [`STABLE`].
// Not backon: its retry loop wraps one fallible future, where this loop
// also resets on a tunnel that lived and stops on drain; the delay is 10 lines.
struct Backoff {
    next: Duration,
}

const FIRST_DELAY: Duration = Duration::from_millis(500);
const MAX_DELAY: Duration = Duration::from_secs(30);
const STABLE: Duration = Duration::from_secs(30);

impl Backoff {
    fn new() -> Backoff {
        Backoff { next: FIRST_DELAY }
    }

    /// The next delay: between half and all of the current step, so
    /// clients cut off together do not come back together.
    fn next(&mut self) -> Duration {
        let step = self.next;
        self.next = (self.next * 2).min(MAX_DELAY);
        let random = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        step / 2 + step.mul_f64((random % 1000) as f64 / 2000.0)
    }

    fn reset(&mut self) {
        self.next = FIRST_DELAY;
    }
}

/// The policy source a `Target::Upstream` client serves: one upstream and
/// one route for every path.
pub fn upstream_policy(url: &str) -> portcullis_config::Source {
    portcullis_config::Source {
        name: "--upstream".into(),
        text: format!(
            "upstreams: [{{ name: upstream, endpoints: [\"{}\"] }}]\nroutes:\n  - {{ name: upstream, match: {{ path_prefix: / }}, upstream: upstream, websocket: true }}\n",
            url.replace('"', "%22")
        ),
    }
}

/// What every tunnel connection of this client shares.
pub struct Dialer {
    options: ClientOptions,
    instance: String,
    tls: Option<tokio_rustls::TlsConnector>,
    /// QUIC settings, for `--transport quic` and `auto`.
    quic: Option<quinn::ClientConfig>,
    /// Per server: when `--transport auto` last fell back to WebSocket
    /// (ms since `epoch`, 0 never).
    fell_back: Vec<AtomicU64>,
    /// The listener settings tunnel requests are served under.
    listener: Arc<Listener>,
    /// Set when the server says another client took over this runtime.
    replaced: AtomicBool,
    /// Per slot (`connections` per server, the first server's first).
    slots: Vec<SlotState>,
    epoch: Instant,
    /// Cancelled to stop the whole client (after a takeover).
    pub give_up: CancellationToken,
}

impl Dialer {
    /// Prepares TLS for `wss://` servers.
    pub fn new(options: ClientOptions) -> anyhow::Result<Dialer> {
        anyhow::ensure!(!options.servers.is_empty(), "give --server");
        for server in &options.servers {
            anyhow::ensure!(
                matches!(server.scheme_str(), Some("wss" | "ws")),
                "--server {server} must be a wss:// (or ws:// for testing) URL"
            );
            anyhow::ensure!(server.host().is_some(), "--server {server} has no host");
            if options.transport != Transport::WebSocket && server.scheme_str() != Some("wss") {
                anyhow::bail!(
                    "--transport {} needs a wss:// server: QUIC is always encrypted (--server {server})",
                    if options.transport == Transport::Quic {
                        "quic"
                    } else {
                        "auto"
                    },
                );
            }
        }
        let tls_config = if options
            .servers
            .iter()
            .any(|s| s.scheme_str() == Some("wss"))
        {
            let mut settings = portcullis_config::TlsSettings::default();
            if let Some(ca) = &options.ca {
                settings.ca_certs = portcullis_net::pem::certificates(ca)
                    .map_err(|e| anyhow::anyhow!("--ca: {e}"))?;
            }
            Some(portcullis_forward::client_tls_config(&settings))
        } else {
            None
        };
        let (tls, quic) = match (options.transport, tls_config) {
            (_, None) => (None, None),
            (Transport::WebSocket, Some(mut config)) => {
                config.alpn_protocols = vec![b"http/1.1".to_vec()];
                (
                    Some(tokio_rustls::TlsConnector::from(Arc::new(config))),
                    None,
                )
            }
            (Transport::Quic, Some(config)) => (
                None,
                Some(
                    super::quic::client_config(config, options.quic_congestion)
                        .map_err(anyhow::Error::msg)?,
                ),
            ),
            (Transport::Auto, Some(mut config)) => {
                let quic = super::quic::client_config(config.clone(), options.quic_congestion)
                    .map_err(anyhow::Error::msg)?;
                config.alpn_protocols = vec![b"http/1.1".to_vec()];
                (
                    Some(tokio_rustls::TlsConnector::from(Arc::new(config))),
                    Some(quic),
                )
            }
        };
        Ok(Dialer {
            instance: instance_id(),
            tls,
            quic,
            fell_back: options.servers.iter().map(|_| AtomicU64::new(0)).collect(),
            listener: Arc::new(Listener {
                name: "tunnel".into(),
                bind: SocketAddr::from(([0, 0, 0, 0], 0)),
                max_connections: usize::MAX,
                header_read_timeout: Duration::from_secs(30),
                keepalive_timeout: portcullis_config::DEFAULT_KEEPALIVE_TIMEOUT,
                // The tunnel is one long-lived connection for everything.
                max_requests_per_connection: 0,
                connection_lifetime: Duration::ZERO,
                // As a policy listener that sets none: the public side
                // takes twice that (MAX_PUBLIC_HEAD), so this limit, and
                // its JSON 431, decides as it would on a direct request.
                max_request_header_size: portcullis_config::DEFAULT_MAX_HEADER_SIZE,
                // The tunnel server sets X-Forwarded-Proto and -Host.
                trust_forwarded_headers: true,
                proxy_protocol: false,
                // The tunnel server gave each request its id.
                request_id: portcullis_obs::request_id::RequestIds::Keep,
                tls: None,
                redirect_https: None,
                http3: None,
                defined_at: portcullis_config::Pos {
                    file: "--server".into(),
                    line: 0,
                    column: 0,
                },
            }),
            slots: (0..options.servers.len() * options.connections.max(1))
                .map(|_| SlotState::default())
                .collect(),
            epoch: Instant::now(),
            options,
            replaced: AtomicBool::new(false),
            give_up: CancellationToken::new(),
        })
    }

    /// How many tunnel slots there are: `connections` per server.
    pub fn slots(&self) -> usize {
        self.slots.len()
    }

    /// The server a slot dials, and its index among the servers.
    fn server(&self, slot: usize) -> (usize, &http::Uri) {
        let index = (slot / self.options.connections.max(1)).min(self.options.servers.len() - 1);
        (index, &self.options.servers[index])
    }

    /// Tunnels the server pinged through within two ping intervals.
    pub fn tunnels_up(&self) -> usize {
        self.slots
            .iter()
            .filter(|s| self.ping_age(s).is_some_and(|age| age < PING_WINDOW))
            .count()
    }

    /// How long ago the server last pinged through `slot`, if ever since
    /// its tunnel was made.
    fn ping_age(&self, slot: &SlotState) -> Option<Duration> {
        let last = slot.last_ping.load(Ordering::Relaxed);
        let now = self.epoch.elapsed().as_millis() as u64;
        (last != 0).then(|| Duration::from_millis(now.saturating_sub(last)))
    }

    /// Every slot's tunnel, for the admin endpoint.
    pub fn report(&self) -> Vec<portcullis_http::pipeline::TunnelSlot> {
        self.slots
            .iter()
            .enumerate()
            .map(|(slot, state)| {
                let since = state.since.load(Ordering::Relaxed);
                let age = self.ping_age(state);
                portcullis_http::pipeline::TunnelSlot {
                    server: self.server(slot).1.to_string(),
                    slot,
                    transport: match state.transport.load(Ordering::Relaxed) {
                        1 => Some("websocket"),
                        2 => Some("quic"),
                        _ => None,
                    },
                    up: age.is_some_and(|age| age < PING_WINDOW),
                    since: (since != 0)
                        .then(|| std::time::UNIX_EPOCH + Duration::from_millis(since)),
                    last_ping: age,
                }
            })
            .collect()
    }

    fn pinged(&self, slot: usize) {
        let now = (self.epoch.elapsed().as_millis() as u64).max(1);
        if let Some(s) = self.slots.get(slot) {
            s.last_ping.store(now, Ordering::Relaxed);
        }
    }

    /// `slot`'s tunnel was made, over `quic` or WebSocket.
    fn connected(&self, slot: usize, quic: bool) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_millis() as u64);
        if let Some(s) = self.slots.get(slot) {
            s.since.store(now, Ordering::Relaxed);
            s.transport
                .store(if quic { 2 } else { 1 }, Ordering::Relaxed);
        }
    }

    fn down(&self, slot: usize) {
        if let Some(s) = self.slots.get(slot) {
            s.last_ping.store(0, Ordering::Relaxed);
            s.since.store(0, Ordering::Relaxed);
            s.transport.store(0, Ordering::Relaxed);
        }
    }

    /// True once another client took over this runtime id.
    pub fn was_replaced(&self) -> bool {
        self.replaced.load(Ordering::Relaxed)
    }

    /// Dials and authenticates a tunnel.
    async fn dial(&self, slot: usize) -> Result<Dialed, String> {
        let hello = Hello {
            runtime: self.options.runtime_id.clone(),
            instance: self.instance.clone(),
            slot: slot as u32,
            token: self.options.token.read()?,
        };
        let (index, server) = self.server(slot);
        let now = self.epoch.elapsed();
        let fell_back = self.fell_back[index].load(Ordering::Relaxed);
        if let Some(config) = &self.quic
            && quic_due(fell_back, now, self.options.quic_retry_after)
        {
            let quic = super::quic::dial(server, config.clone(), &hello);
            if self.options.transport == Transport::Quic {
                return Ok(Dialed::Quic(quic.await?));
            }
            let why = match tokio::time::timeout(QUIC_FALLBACK_AFTER, quic).await {
                Ok(Ok(tunnel)) => return Ok(Dialed::Quic(tunnel)),
                // The server answered over QUIC: WebSocket would get the
                // same answer.
                Ok(Err(e)) if e.starts_with(super::quic::REFUSED) => return Err(e),
                Ok(Err(e)) => e,
                Err(_) => format!("no QUIC handshake within {QUIC_FALLBACK_AFTER:?}"),
            };
            tracing::warn!(slot, %server, reason = %why, retry_after = ?self.options.quic_retry_after, "QUIC failed; using WebSocket, and QUIC again at a dial after retry_after");
            let failed_at = (self.epoch.elapsed().as_millis() as u64).max(1);
            self.fell_back[index].store(failed_at, Ordering::Relaxed);
        }
        let tls = self
            .tls
            .as_ref()
            .filter(|_| server.scheme_str() == Some("wss"));
        let io = super::websocket::dial(server, tls, &hello).await?;
        Ok(Dialed::WebSocket(TokioIo::new(io)))
    }
}

/// What the client knows of one tunnel slot, for readiness and its
/// admin endpoint.
#[derive(Default)]
struct SlotState {
    /// When the server last pinged through it (ms since the dialer's
    /// `epoch`, 0 while down). A tunnel counts as up while pings arrive,
    /// not merely while its socket is open: a half-dead connection must
    /// not look ready.
    last_ping: AtomicU64,
    /// When its tunnel was made (ms since the Unix epoch, 0 while down).
    since: AtomicU64,
    /// Its transport: 0 while down, 1 WebSocket, 2 QUIC.
    transport: AtomicU8,
}

/// Whether a dial at `now` tries QUIC, for a server where `auto` last
/// fell back to WebSocket at `fell_back` ms (0: never).
fn quic_due(fell_back: u64, now: Duration, retry_after: Duration) -> bool {
    fell_back == 0 || now.saturating_sub(Duration::from_millis(fell_back)) >= retry_after
}

/// A dialled tunnel.
enum Dialed {
    /// A byte stream for HTTP/2.
    WebSocket(TokioIo<BoxIo>),
    /// A QUIC connection, a stream per request.
    Quic(super::quic::ClientTunnel),
}

/// One tunnel connection slot: dials, serves until the tunnel ends, and
/// dials again after a backoff, until the worker drains.
pub async fn run_slot(slot: usize, dialer: Arc<Dialer>, ctx: WorkerContext) {
    let mut backoff = Backoff::new();
    loop {
        if ctx.stop.is_cancelled() || dialer.give_up.is_cancelled() {
            return;
        }
        let started = Instant::now();
        let dialed = tokio::select! {
            r = tokio::time::timeout(super::HANDSHAKE_TIMEOUT, dialer.dial(slot)) => r.unwrap_or_else(|_| Err(match dialer.options.transport {
                Transport::WebSocket => "no handshake within 10s".into(),
                // UDP is often dropped where TCP passes, without a word.
                Transport::Quic => "no QUIC handshake within 10s: is UDP to the server's port open, and does the server run with --tunnel-quic?".into(),
                Transport::Auto => "no handshake within 10s".into(),
            })),
            _ = ctx.stop.cancelled() => return,
            _ = dialer.give_up.cancelled() => return,
        };
        match dialed {
            Ok(dialed) => {
                tracing::debug!(slot, "tunnel handshake done");
                dialer.connected(slot, matches!(dialed, Dialed::Quic(_)));
                let why = match dialed {
                    Dialed::WebSocket(io) => serve(io, slot, &dialer, &ctx).await,
                    Dialed::Quic(tunnel) => serve_quic(tunnel, slot, &dialer, &ctx).await,
                };
                dialer.down(slot);
                if dialer.was_replaced() {
                    tracing::error!(slot, runtime = %dialer.options.runtime_id, "another client took over this runtime id; stopping");
                    dialer.give_up.cancel();
                    return;
                }
                if ctx.stop.is_cancelled() {
                    return;
                }
                tracing::warn!(
                    slot,
                    server = %dialer.server(slot).1,
                    reason = %why,
                    up_for_s = started.elapsed().as_secs(),
                    "tunnel lost; reconnecting"
                );
            }
            Err(e) => {
                tracing::warn!(slot, server = %dialer.server(slot).1, error = %e, "tunnel connection failed")
            }
        }
        if started.elapsed() >= STABLE {
            backoff.reset();
        }
        let delay = backoff.next();
        tracing::debug!(
            slot,
            delay_ms = delay.as_millis() as u64,
            "reconnecting after backoff"
        );
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = ctx.stop.cancelled() => return,
            _ = dialer.give_up.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests;
