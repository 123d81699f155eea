//! Forwarding between tunnel-server replicas (`--peers`).
//!
//! A runtime's tunnels live on the servers its client dialled. A public
//! balancer in front of several replicas sends a request to any of them,
//! and one that holds no tunnel for the runtime (its client is still
//! backing off after the replica restarted, cannot reach it, or does not
//! know it yet) would answer 503. With peers, that replica passes the
//! request on to a peer that holds one, as Cloudflare's edge does between
//! its data centres.
//!
//! Each server polls its peers every second for the runtimes they hold
//! (`GET /runtimes` on the peer listener, answered in full only when its
//! registry changed), so a miss is forwarded with no round trip spent
//! asking. A forwarded request is one HTTP/2 stream on a connection its
//! worker keeps to that peer (cleartext inside a cluster, or mutual TLS
//! with `--peer-cert`, `--peer-key` and `--peer-ca` where peers talk over
//! networks that are not trusted; a WebSocket crosses as an extended
//! CONNECT, as it does through a tunnel), carrying the shared peer token
//! and the client's address. The receiving peer serves it only
//! through its own tunnels, never forwarding again, so no request loops.
//! Peer names are resolved on every poll: a headless Service's name gives
//! one peer per pod, replicas added or gone are seen within a second, and
//! a server that finds itself among them (its own instance id answers)
//! leaves itself out.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use http::header::{HeaderName, HeaderValue};
use http::{Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::client::conn::http2::SendRequest;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use serde::{Deserialize, Serialize};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use portcullis_http::body::Body;

mod link;
mod listener;

pub(crate) use link::*;
pub(crate) use listener::*;

/// The header a peer request carries the shared peer token in.
pub const PEER_TOKEN: &str = "x-portcullis-peer-token";
/// How often each peer is asked for its runtimes.
const POLL: Duration = Duration::from_secs(1);
/// Requests a peer link carries at once: hyper's default, stated because
/// the bound on streams reset before they were taken follows it.
const PEER_STREAMS: u32 = 200;
/// How long a poll (name resolution, connect, answer) may take.
const POLL_TIMEOUT: Duration = Duration::from_secs(2);
/// The largest runtimes list taken from a peer (about 100,000 ids).
const MAX_LIST: usize = 8 << 20;
/// The shortest peer token taken: a guessable one would let anyone who
/// reaches the peer port claim any client address.
pub const MIN_TOKEN_LEN: usize = 16;

/// Where a tunnel server meets its peers.
#[derive(Debug, Clone)]
pub struct PeerOptions {
    /// Where to take requests forwarded by peers (and their polls).
    pub listen: Option<SocketAddr>,
    /// The peers, as `host:port` of their peer listeners; a name may
    /// resolve to several addresses (a headless Service), each a peer.
    pub peers: Vec<String>,
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

/// What a peer answers a poll with.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct Presence {
    /// The answering server's instance id.
    pub instance: String,
    /// Its registry's generation: changes whenever a runtime comes or goes.
    pub generation: u64,
    /// Its runtimes; absent when the poll's `generation` is still current.
    pub runtimes: Option<Vec<String>>,
}

/// This server's peers and what they hold.
pub(super) struct Peers {
    /// This server's own instance id, to know itself among its peers.
    pub instance: String,
    token: HeaderValue,
    token_digest: [u8; 32],
    entries: Vec<String>,
    /// The worker threads, each with connections of its own to the peers.
    workers: usize,
    /// Mutual TLS between peers, when configured.
    pub tls: Option<PeerTls>,
    table: Mutex<Table>,
    next: AtomicUsize,
}

#[derive(Default)]
struct Table {
    /// The addresses each `--peers` entry resolved to last.
    resolved: HashMap<String, Vec<SocketAddr>>,
    /// Entries whose last resolution failed (warned about once).
    unresolved: HashSet<String>,
    peers: HashMap<SocketAddr, Peer>,
}

struct Peer {
    /// A connection per worker, and the poller's last: a forwarded
    /// request stays on its worker's thread, as one through a tunnel does
    /// (crossing to one shared connection's thread took a third more CPU
    /// per request).
    links: Vec<Arc<Link>>,
    /// Its last answer; `None` before the first and after a failed poll.
    seen: Option<Seen>,
    /// Why the last poll failed.
    error: Option<String>,
}

struct Seen {
    instance: String,
    generation: u64,
    runtimes: HashSet<String>,
    since: SystemTime,
}

impl Seen {
    fn itself(&self, peers: &Peers) -> bool {
        self.instance == peers.instance
    }
}

/// A peer as the admin endpoint shows it.
#[derive(Debug, Serialize)]
pub struct PeerStatus {
    pub address: String,
    pub up: bool,
    pub instance: Option<String>,
    /// This server itself, found among its peers (not forwarded to).
    #[serde(rename = "self")]
    pub itself: bool,
    pub runtimes: usize,
    pub since: Option<String>,
    pub error: Option<String>,
    /// Public requests this server has passed to it: many mean clients
    /// that do not dial this server (or cannot reach it).
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
            tls,
            token: header,
            token_digest: digest(token.as_bytes()),
            entries: options.peers.clone(),
            workers: workers.max(1),
            table: Mutex::default(),
            next: AtomicUsize::new(0),
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
        let mut holders: Vec<Arc<Link>> = table
            .peers
            .values()
            .filter(|p| {
                p.seen
                    .as_ref()
                    .is_some_and(|s| !s.itself(self) && s.runtimes.contains(runtime))
            })
            .map(|p| p.links[worker % self.workers].clone())
            .collect();
        if !holders.is_empty() {
            let turn = self.next.fetch_add(1, Ordering::Relaxed) % holders.len();
            holders.rotate_left(turn);
        }
        holders
    }

    /// Takes a peer that could not be reached out of the forwarding until
    /// its next poll answers: a peer that died takes no more requests in
    /// the second before the poll would notice.
    pub fn lost(&self, addr: SocketAddr, error: &str) {
        let mut table = self.lock();
        if let Some(peer) = table.peers.get_mut(&addr)
            && peer.seen.take().is_some()
        {
            tracing::warn!(peer = %addr, error, "peer unreachable; its runtimes are not forwarded to it");
            peer.error = Some(error.to_owned());
        }
    }

    /// Stamps a request for a peer with the group's token.
    pub fn stamp(&self, headers: &mut http::HeaderMap) {
        headers.insert(HeaderName::from_static(PEER_TOKEN), self.token.clone());
    }

    /// The peers for the admin endpoint, by address.
    pub fn snapshot(&self) -> Vec<PeerStatus> {
        let table = self.lock();
        let mut out: Vec<_> = table
            .peers
            .iter()
            .map(|(addr, p)| PeerStatus {
                address: addr.to_string(),
                up: p.seen.is_some(),
                instance: p.seen.as_ref().map(|s| s.instance.clone()),
                itself: p.seen.as_ref().is_some_and(|s| s.itself(self)),
                runtimes: p.seen.as_ref().map_or(0, |s| s.runtimes.len()),
                since: p
                    .seen
                    .as_ref()
                    .map(|s| portcullis_obs::admin_http::rfc3339(s.since)),
                error: p.error.clone(),
                forwarded: p.links.iter().map(|l| l.sent.load(Ordering::Relaxed)).sum(),
                active_requests: p
                    .links
                    .iter()
                    .map(|l| l.active.load(Ordering::Relaxed))
                    .sum(),
            })
            .collect();
        out.sort_by(|a, b| a.address.cmp(&b.address));
        out
    }

    /// Polls the peers every [`POLL`] until `stop`.
    pub async fn poll(self: Arc<Self>, stop: CancellationToken) {
        if self.entries.is_empty() {
            return;
        }
        let mut tick = tokio::time::interval(POLL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = self.poll_once() => {}
            }
        }
    }

    /// Resolves the peer names, then asks every peer for its runtimes.
    async fn poll_once(&self) {
        for entry in &self.entries {
            let resolved =
                tokio::time::timeout(POLL_TIMEOUT, tokio::net::lookup_host(entry.as_str())).await;
            let addrs = match resolved {
                Ok(Ok(addrs)) => {
                    let mut addrs: Vec<SocketAddr> = addrs.collect();
                    addrs.sort();
                    addrs.dedup();
                    addrs
                }
                // Keep what it resolved to before: a DNS hiccup should not
                // take working peers away.
                Ok(Err(e)) => {
                    self.unresolved(entry, &e.to_string());
                    continue;
                }
                Err(_) => {
                    self.unresolved(entry, "timed out");
                    continue;
                }
            };
            let mut table = self.lock();
            if table.unresolved.remove(entry) {
                tracing::info!(peer = %entry, "peer name resolves again");
            }
            table.resolved.insert(entry.clone(), addrs);
        }
        let asks: Vec<_> = {
            let mut table = self.lock();
            // Each address with the name it was listed by: the name its
            // certificate must carry when peers speak TLS.
            let mut wanted: HashMap<SocketAddr, &str> = HashMap::new();
            for (entry, addrs) in &table.resolved {
                for addr in addrs {
                    wanted.entry(*addr).or_insert(entry.as_str());
                }
            }
            let wanted: HashMap<SocketAddr, String> = wanted
                .into_iter()
                .map(|(addr, entry)| (addr, entry.to_owned()))
                .collect();
            table.peers.retain(|addr, p| {
                let keep = wanted.contains_key(addr);
                if !keep && p.seen.as_ref().is_some_and(|s| !s.itself(self)) {
                    tracing::info!(peer = %addr, "peer no longer listed");
                }
                keep
            });
            for (addr, entry) in wanted {
                let tls = self
                    .tls
                    .as_ref()
                    .map(|t| (t.connector.clone(), server_name(&entry)));
                table.peers.entry(addr).or_insert_with(|| Peer {
                    links: (0..=self.workers)
                        .map(|_| Arc::new(Link::new(addr, tls.clone())))
                        .collect(),
                    seen: None,
                    error: None,
                });
            }
            table
                .peers
                .iter()
                .map(|(addr, p)| {
                    let known = p.seen.as_ref().map(|s| (s.instance.clone(), s.generation));
                    (*addr, p.links[self.workers].clone(), known)
                })
                .collect()
        };
        let answers = futures_util::future::join_all(asks.into_iter().map(
            |(addr, link, known)| async move {
                let asked = tokio::time::timeout(POLL_TIMEOUT, self.ask(&link, known.as_ref()));
                let answer = asked
                    .await
                    .unwrap_or_else(|_| Err("no answer within 2s".to_owned()));
                (addr, answer)
            },
        ))
        .await;
        let mut table = self.lock();
        for (addr, answer) in answers {
            let Some(peer) = table.peers.get_mut(&addr) else {
                continue;
            };
            match answer {
                Ok(presence) => {
                    let changed = match (&mut peer.seen, presence.runtimes) {
                        (Some(seen), None)
                            if seen.instance == presence.instance
                                && seen.generation == presence.generation =>
                        {
                            false
                        }
                        (seen, Some(runtimes)) => {
                            let first = seen
                                .as_ref()
                                .is_none_or(|s| s.instance != presence.instance);
                            let since = match seen {
                                Some(s) if !first => s.since,
                                _ => SystemTime::now(),
                            };
                            *seen = Some(Seen {
                                instance: presence.instance,
                                generation: presence.generation,
                                runtimes: runtimes.into_iter().collect(),
                                since,
                            });
                            first
                        }
                        // An unchanged answer about a state not seen: ask
                        // in full next time.
                        (seen, None) => {
                            *seen = None;
                            false
                        }
                    };
                    if changed && let Some(seen) = &peer.seen {
                        if seen.itself(self) {
                            tracing::debug!(peer = %addr, "this server is among its peers");
                        } else {
                            tracing::info!(peer = %addr, instance = %seen.instance, runtimes = seen.runtimes.len(), "peer up");
                        }
                    }
                    peer.error = None;
                }
                Err(e) => {
                    if peer.seen.take().is_some() || peer.error.is_none() {
                        tracing::warn!(peer = %addr, error = %e, "peer unreachable; its runtimes are not forwarded to it");
                    }
                    peer.error = Some(e);
                }
            }
        }
    }

    /// Notes that `entry` did not resolve, with a warning the first time.
    fn unresolved(&self, entry: &str, error: &str) {
        if self.lock().unresolved.insert(entry.to_owned()) {
            tracing::warn!(peer = %entry, error, "cannot resolve a peer name; its last addresses are kept");
        }
    }

    /// One poll of one peer.
    async fn ask(&self, link: &Link, known: Option<&(String, u64)>) -> Result<Presence, String> {
        let target = match known {
            Some((instance, generation)) => {
                format!("/runtimes?instance={instance}&generation={generation}")
            }
            None => "/runtimes".to_owned(),
        };
        let mut req = Request::get(format!("http://{}{target}", link.addr))
            .body(Body::empty())
            .map_err(|e| e.to_string())?;
        self.stamp(req.headers_mut());
        let resp = link.send(req).await?;
        let status = resp.status();
        let body = http_body_util::Limited::new(resp.into_body(), MAX_LIST)
            .collect()
            .await
            .map_err(|e| format!("reading its answer: {e}"))?
            .to_bytes();
        if status != StatusCode::OK {
            return Err(format!(
                "answered {status}: {}",
                String::from_utf8_lossy(&body[..body.len().min(200)])
            ));
        }
        serde_json::from_slice(&body).map_err(|e| format!("not a peer's answer: {e}"))
    }
}

/// The answer to a peer's poll: this server's runtimes, or only its
/// generation when the poller's (`instance`, `generation`) is current.
pub(super) fn presence(
    query: Option<&str>,
    instance: &str,
    (generation, runtimes): (u64, impl FnOnce() -> Vec<String>),
) -> Response<Body> {
    let mut theirs = (None, None);
    for pair in query.unwrap_or("").split('&') {
        match pair.split_once('=') {
            Some(("instance", v)) => theirs.0 = Some(v),
            Some(("generation", v)) => theirs.1 = v.parse::<u64>().ok(),
            _ => {}
        }
    }
    let current = theirs == (Some(instance), Some(generation));
    let presence = Presence {
        instance: instance.to_owned(),
        generation,
        runtimes: (!current).then(runtimes),
    };
    let mut resp = Response::new(Body::full(
        serde_json::to_vec(&presence).unwrap_or_default(),
    ));
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

#[cfg(test)]
mod tests;
