//! Forwarding between tunnel-server replicas that share a registry
//! (`--registry`).
//!
//! A runtime's tunnels live on the servers its client dialled. A public
//! balancer in front of several replicas sends a request to any of them,
//! and one that holds no tunnel for the runtime would answer 503. With a
//! registry, every server records in Redis which runtimes it holds and
//! learns at once, through pub/sub, what the others hold
//! ([`directory`]); it keeps that map in memory, so a request for a
//! runtime held elsewhere goes to its holder with no Redis round trip.
//!
//! A forwarded request is one HTTP/2 stream on a connection its worker
//! keeps to that peer's advertised address (cleartext inside a cluster,
//! or mutual TLS with `--peer-cert`, `--peer-key` and `--peer-ca` where
//! peers talk over networks that are not trusted; a WebSocket crosses as
//! an extended CONNECT, as it does through a tunnel), carrying the shared
//! peer token and the client's address. The receiving peer serves it only
//! through its own tunnels, never forwarding again, so no request loops.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use http::header::{HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use serde::Serialize;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use portcullis_forward::Body;

pub mod directory;
mod link;
mod listener;
mod refusals;

pub(crate) use link::*;
pub(crate) use listener::*;
pub(crate) use refusals::{Failure, LOCKED_OUT_DELAY, MAX_FAILURES, WINDOW};

/// The header a peer request carries the shared peer token in.
pub const PEER_TOKEN: &str = "x-portcullis-peer-token";
/// Requests a peer link carries at once: hyper's default, stated because
/// the bound on streams reset before they were taken follows it.
const PEER_STREAMS: u32 = 200;
/// How long dialling a peer (name resolution, connect, TLS) may take.
const DIAL_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a peer that could not be reached is left out of forwarding
/// before it is tried again (its lease ends sooner if it died).
const UNREACHABLE_FOR: Duration = Duration::from_secs(1);
/// How long holdings a live server has yet to publish again are carried
/// (see `Table::carried`): a lease, within which a server that lost its
/// registry entries notices and publishes them again.
const CARRY_FOR: Duration = Duration::from_secs(5);
/// How long a dial that checks a peer is alive may take.
const PROBE_TIMEOUT: Duration = Duration::from_millis(500);
/// The shortest peer token taken: a guessable one would let anyone who
/// reaches the peer port claim any client address.
pub const MIN_TOKEN_LEN: usize = 16;

/// Where a tunnel server meets its peers.
#[derive(Debug, Clone)]
pub struct PeerOptions {
    /// Where to take requests forwarded by peers (`--peer-listen`).
    pub listen: SocketAddr,
    /// Where peers reach this server's peer listener, as `host:port`
    /// (`--peer-advertise`): published in the registry.
    pub advertise: String,
    /// The Redis the registry lives in (`--registry`).
    pub registry: portcullis_net::redis_target::RedisTarget,
    /// The token every peer of the group shares.
    pub token: String,
    /// Mutual TLS between peers: this server's certificate and key (served
    /// on the peer port and presented when dialling a peer) and the CA
    /// every peer's certificate chains to.
    pub tls: Option<PeerTlsFiles>,
}

/// The files of [`PeerOptions::tls`].
#[derive(Debug, Clone)]
pub struct PeerTlsFiles {
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
    pub ca: std::path::PathBuf,
}

/// Both ends of mutual TLS between peers.
pub(super) struct PeerTls {
    /// The peer port's handshake: a certificate from the peer CA required.
    pub acceptor: tokio_rustls::TlsAcceptor,
    /// Dialling a peer: its certificate checked against the peer CA and
    /// the name it was listed by; this server's own presented.
    connector: tokio_rustls::TlsConnector,
}

impl PeerTls {
    fn load(files: &PeerTlsFiles) -> Result<PeerTls, String> {
        let roots =
            portcullis_net::pem::certificates(&files.ca).map_err(|e| format!("--peer-ca: {e}"))?;
        let auth = portcullis_net::tls_listen::ClientAuth {
            roots: roots.clone(),
            optional: false,
        };
        // HTTP/1.1 too, as on the cleartext port: someone trying the port
        // by hand is told what it is.
        let acceptor = portcullis_net::tls_listen::acceptor(
            &files.cert,
            &files.key,
            Some(auth),
            &[b"h2", b"http/1.1"],
        )?;
        let mut store = rustls::RootCertStore::empty();
        for root in roots {
            store
                .add(root)
                .map_err(|e| format!("peer CA {}: {e}", files.ca.display()))?;
        }
        let own =
            portcullis_net::cert_files::CertFiles::load(files.cert.clone(), files.key.clone())?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(store)
            .with_client_cert_resolver(Arc::new(own));
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(PeerTls {
            acceptor,
            connector: tokio_rustls::TlsConnector::from(Arc::new(config)),
        })
    }
}

/// This server's peers and what they hold, as the registry says.
pub(super) struct Peers {
    /// This server's own instance id, to know its own entries.
    pub instance: String,
    /// Where peers reach this server.
    pub advertise: String,
    /// The Redis the registry lives in.
    pub registry: portcullis_net::redis_target::RedisTarget,
    token: HeaderValue,
    token_digest: [u8; 32],
    /// The worker threads, each with connections of its own to the peers.
    workers: usize,
    /// Mutual TLS between peers, when configured.
    pub tls: Option<PeerTls>,
    table: Mutex<Table>,
    next: AtomicUsize,
    /// Wrong peer tokens by source address.
    pub refusals: refusals::Refusals,
}

#[derive(Default)]
struct Table {
    /// Runtime id → the other servers holding it (server instance → what
    /// it published).
    runtimes: HashMap<String, HashMap<String, directory::Holding>>,
    /// Holdings kept though the registry no longer shows them, by server
    /// and runtime, until when: their server is alive (its link is up, or
    /// it answers a dial) and has yet to publish them again, as after the
    /// registry lost its data or the server's lease lapsed. Published
    /// again, they are held as any; not by then, they go.
    carried: HashMap<(String, String), Instant>,
    /// The other servers holding at least one runtime, by instance.
    servers: HashMap<String, Peer>,
    /// The registry's state, for `/status` and `/metrics`.
    registry: RegistryState,
}

struct Peer {
    /// Its advertised peer address.
    addr: String,
    /// A connection per worker: a forwarded request stays on its worker's
    /// thread, as one through a tunnel does (crossing to one shared
    /// connection's thread took a third more CPU per request).
    links: Vec<Arc<Link>>,
    /// Left out of forwarding until then: a dial to it just failed.
    unreachable: Option<(Instant, String)>,
}

/// Whether this server is in touch with the registry.
#[derive(Debug, Clone, Default)]
pub(super) struct RegistryState {
    pub up: bool,
    /// Since when it has been up or down.
    pub since: Option<SystemTime>,
    /// Why it is down.
    pub error: Option<String>,
    /// Times the connection to Redis was lost.
    pub lost: u64,
}

/// A peer as the admin endpoint shows it.
#[derive(Debug, Serialize)]
pub struct PeerStatus {
    pub instance: String,
    pub address: String,
    /// Runtimes it holds, as the registry says.
    pub runtimes: usize,
    /// Of those, the ones carried: the registry lost them (or the peer's
    /// lease) while the peer lives, and it has yet to publish them again.
    pub carried: usize,
    /// Why the last dial failed, while it is left out of forwarding.
    pub error: Option<String>,
    /// Public requests this server has passed to it.
    pub forwarded: u64,
    /// Of those, the ones waiting for its answer now.
    pub active_requests: usize,
}

fn digest(token: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(token).into()
}

impl Peers {
    pub fn new(options: &PeerOptions, instance: String, workers: usize) -> anyhow::Result<Peers> {
        let token = options.token.trim();
        anyhow::ensure!(
            token.len() >= MIN_TOKEN_LEN,
            "the peer token must be at least {MIN_TOKEN_LEN} characters"
        );
        let header = HeaderValue::from_str(token)
            .map_err(|_| anyhow::anyhow!("the peer token must be printable ASCII"))?;
        let tls = match &options.tls {
            Some(files) => Some(PeerTls::load(files).map_err(anyhow::Error::msg)?),
            None => None,
        };
        Ok(Peers {
            instance,
            advertise: options.advertise.clone(),
            registry: options.registry.clone(),
            tls,
            token: header,
            token_digest: digest(token.as_bytes()),
            workers: workers.max(1),
            table: Mutex::default(),
            next: AtomicUsize::new(0),
            refusals: refusals::Refusals::default(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Table> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a request to the peer listener carries the group's token.
    pub fn authentic(&self, headers: &http::HeaderMap) -> bool {
        let presented = headers
            .get(PEER_TOKEN)
            .map_or(&[][..], HeaderValue::as_bytes);
        // Compared as digests, in constant time: the token's length and
        // prefix stay hidden.
        super::tokens::constant_time_eq(&digest(presented), &self.token_digest)
    }

    /// `worker`'s connections to the peers holding a tunnel of
    /// `runtime`, in the order to try them: taking turns at the first.
    pub fn holders(&self, runtime: &str, worker: usize) -> Vec<Arc<Link>> {
        let table = self.lock();
        let Some(holders) = table.runtimes.get(runtime) else {
            return Vec::new();
        };
        let now = Instant::now();
        let mut links: Vec<Arc<Link>> = holders
            .keys()
            .filter_map(|server| table.servers.get(server))
            .filter(|p| {
                p.unreachable
                    .as_ref()
                    .is_none_or(|(until, _)| *until <= now)
            })
            .map(|p| p.links[worker % self.workers].clone())
            .collect();
        if links.len() > 1 {
            let turn = self.next.fetch_add(1, Ordering::Relaxed) % links.len();
            links.rotate_left(turn);
        }
        links
    }

    /// Whether another server holds `runtime` for a client instance that
    /// started after `client`: that one wins, wherever it connected.
    pub fn newer_elsewhere(&self, runtime: &str, client: &str) -> bool {
        let started = crate::instance_started(client);
        self.lock().runtimes.get(runtime).is_some_and(|holders| {
            holders
                .values()
                .any(|h| crate::instance_started(&h.client) > started)
        })
    }

    /// Takes a peer that could not be reached out of the forwarding for
    /// [`UNREACHABLE_FOR`]: a peer that died takes no more requests in the
    /// seconds before its lease ends.
    pub fn lost(&self, addr: &str, error: &str) {
        let mut table = self.lock();
        for peer in table.servers.values_mut().filter(|p| p.addr == addr) {
            if peer.unreachable.is_none() {
                tracing::warn!(peer = %addr, error, "peer unreachable; its runtimes are not forwarded to it for now");
            }
            peer.unreachable = Some((Instant::now() + UNREACHABLE_FOR, error.to_owned()));
        }
    }

    /// Stamps a request for a peer with the group's token.
    pub fn stamp(&self, headers: &mut http::HeaderMap) {
        headers.insert(HeaderName::from_static(PEER_TOKEN), self.token.clone());
    }

    /// Replaces the map with `holdings` (server instance, runtime, what it
    /// published), after a (re)load of the registry; what the servers in
    /// `alive` held before and the registry no longer shows is carried
    /// (see `Table::carried`).
    pub(super) fn replace(
        &self,
        holdings: Vec<(String, String, directory::Holding)>,
        alive: &std::collections::HashSet<String>,
    ) {
        let mut table = self.lock();
        let before = std::mem::take(&mut table.runtimes);
        for (server, runtime, holding) in holdings {
            self.insert(&mut table, server, runtime, holding);
        }
        let until = Instant::now() + CARRY_FOR;
        for (runtime, holders) in before {
            for (server, holding) in holders.into_iter().filter(|(s, _)| alive.contains(s)) {
                let held = table.runtimes.entry(runtime.clone()).or_default();
                if held.contains_key(&server) {
                    continue;
                }
                held.insert(server.clone(), holding);
                table
                    .carried
                    .entry((server, runtime.clone()))
                    .or_insert(until);
            }
        }
        let Table {
            runtimes, carried, ..
        } = &mut *table;
        carried.retain(|(server, runtime), _| {
            runtimes
                .get(runtime)
                .is_some_and(|h| h.contains_key(server))
        });
        let held: std::collections::HashSet<&String> =
            table.runtimes.values().flat_map(|h| h.keys()).collect();
        let gone: Vec<String> = table
            .servers
            .keys()
            .filter(|s| !held.contains(s))
            .cloned()
            .collect();
        for server in gone {
            table.servers.remove(&server);
        }
    }

    /// Records that `server` holds `runtime`.
    pub(super) fn held(&self, server: String, runtime: String, holding: directory::Holding) {
        let mut table = self.lock();
        self.insert(&mut table, server, runtime, holding);
    }

    fn insert(
        &self,
        table: &mut Table,
        server: String,
        runtime: String,
        holding: directory::Holding,
    ) {
        let replace = table
            .servers
            .get(&server)
            .is_none_or(|p| p.addr != holding.addr);
        if replace {
            let tls = self
                .tls
                .as_ref()
                .map(|t| (t.connector.clone(), server_name(&holding.addr)));
            table.servers.insert(
                server.clone(),
                Peer {
                    addr: holding.addr.clone(),
                    links: (0..self.workers)
                        .map(|_| Arc::new(Link::new(holding.addr.clone(), tls.clone())))
                        .collect(),
                    unreachable: None,
                },
            );
        } else if let Some(peer) = table.servers.get_mut(&server) {
            // It just published: reachable again as far as we know.
            peer.unreachable = None;
        }
        table.carried.remove(&(server.clone(), runtime.clone()));
        table
            .runtimes
            .entry(runtime)
            .or_default()
            .insert(server, holding);
    }

    /// Carries what `server` holds for [`CARRY_FOR`] more: its lease is
    /// gone, but it is alive. Whether any of it was not carried already
    /// (the lapse began).
    pub(super) fn carry(&self, server: &str) -> bool {
        let mut table = self.lock();
        let until = Instant::now() + CARRY_FOR;
        let held: Vec<String> = (table.runtimes.iter())
            .filter(|(_, h)| h.contains_key(server))
            .map(|(r, _)| r.clone())
            .collect();
        let mut began = false;
        for runtime in held {
            began |= (table.carried)
                .insert((server.to_owned(), runtime), until)
                .is_none();
        }
        began
    }

    /// The carried holdings whose time ran out, as (server, runtime): the
    /// registry says which stay ([`Peers::settle`]).
    pub(super) fn carried_due(&self) -> Vec<(String, String)> {
        let table = self.lock();
        let now = Instant::now();
        (table.carried.iter())
            .filter(|(_, until)| **until <= now)
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Settles a carried holding whose time ran out: held as any other if
    /// the registry has it again (`listed`: its server is back and never
    /// lost it, or published it again), dropped if not (its server let it
    /// go meanwhile).
    pub(super) fn settle(&self, server: &str, runtime: &str, listed: bool) {
        if !listed {
            self.released(server, runtime);
            return;
        }
        self.lock()
            .carried
            .remove(&(server.to_owned(), runtime.to_owned()));
    }

    /// One of `server`'s links, and whether any is connected now.
    pub(super) fn link_to(&self, server: &str) -> Option<(Arc<Link>, bool)> {
        let table = self.lock();
        let peer = table.servers.get(server)?;
        let open = peer.links.iter().any(|l| l.open().is_some());
        Some((peer.links.first()?.clone(), open))
    }

    /// Records that `server` no longer holds `runtime`.
    pub(super) fn released(&self, server: &str, runtime: &str) {
        let mut table = self.lock();
        table
            .carried
            .remove(&(server.to_owned(), runtime.to_owned()));
        if let Some(holders) = table.runtimes.get_mut(runtime) {
            holders.remove(server);
            if holders.is_empty() {
                table.runtimes.remove(runtime);
            }
        }
        let still = table.runtimes.values().any(|h| h.contains_key(server));
        if !still {
            table.servers.remove(server);
        }
    }

    /// Forgets `server` and all it held: its lease ended.
    pub(super) fn forget(&self, server: &str) {
        let mut table = self.lock();
        table.servers.remove(server);
        table.carried.retain(|(s, _), _| s != server);
        table.runtimes.retain(|_, holders| {
            holders.remove(server);
            !holders.is_empty()
        });
    }

    /// The other servers known to hold something, by instance.
    pub(super) fn servers(&self) -> Vec<String> {
        self.lock().servers.keys().cloned().collect()
    }

    /// Notes that the registry is reachable (`None`) or not (why).
    pub(super) fn registry_state(&self, error: Option<String>) {
        let mut table = self.lock();
        let state = &mut table.registry;
        let up = error.is_none();
        if state.up != up || state.since.is_none() {
            state.since = Some(SystemTime::now());
            if state.up && !up {
                state.lost += 1;
            }
        }
        state.up = up;
        state.error = error;
    }

    /// The registry's state for the admin endpoint.
    pub fn registry(&self) -> RegistryState {
        self.lock().registry.clone()
    }

    /// The peers for the admin endpoint, by instance.
    pub fn snapshot(&self) -> Vec<PeerStatus> {
        let table = self.lock();
        let now = Instant::now();
        let mut out: Vec<_> = table
            .servers
            .iter()
            .map(|(instance, p)| PeerStatus {
                instance: instance.clone(),
                address: p.addr.clone(),
                runtimes: table
                    .runtimes
                    .values()
                    .filter(|h| h.contains_key(instance))
                    .count(),
                carried: (table.carried.keys())
                    .filter(|(s, _)| s == instance)
                    .count(),
                error: p
                    .unreachable
                    .as_ref()
                    .filter(|(until, _)| *until > now)
                    .map(|(_, e)| e.clone()),
                forwarded: p.links.iter().map(|l| l.sent.load(Ordering::Relaxed)).sum(),
                active_requests: p
                    .links
                    .iter()
                    .map(|l| l.active.load(Ordering::Relaxed))
                    .sum(),
            })
            .collect();
        out.sort_by(|a, b| a.instance.cmp(&b.instance));
        out
    }
}

#[cfg(test)]
mod tests;

/// Whether `server` is alive, though its lease is gone: one of this
/// server's links to it is connected, or a dial to it succeeds now (the
/// connection then closed). A server that crashed refuses the dial; one
/// cut off answers none within [`PROBE_TIMEOUT`].
pub(super) async fn alive(peers: &Peers, server: &str) -> bool {
    let Some((link, open)) = peers.link_to(server) else {
        return false;
    };
    open || matches!(
        tokio::time::timeout(PROBE_TIMEOUT, link.dial()).await,
        Ok(Ok(_))
    )
}
