//! The runtimes and their tunnel connections: which tunnel a public request takes, and what `/status` shows of them.

use super::*;

/// One tunnel connection from a client.
pub struct Tunnel {
    pub(super) id: u64,
    pub(super) instance: String,
    pub(super) slot: u32,
    /// The worker thread driving its connection.
    pub(super) worker: usize,
    /// The token hash it authenticated with.
    pub(super) token: [u8; 32],
    pub(super) remote: SocketAddr,
    pub(super) since: SystemTime,
    pub(super) sender: Sender,
    /// Last measured round trip, microseconds (0 until measured).
    pub(super) rtt_us: AtomicU64,
    /// Public requests in flight on this tunnel.
    pub(super) active: AtomicUsize,
    /// Its runtime's request metrics.
    pub(super) stats: &'static RouteStats,
    pub(super) closed: CancellationToken,
}

/// How requests reach a tunnel's client.
#[derive(Clone)]
pub(super) enum Sender {
    /// An HTTP/2 connection over a WebSocket.
    H2(SendRequest<Body>),
    /// A QUIC connection, a stream per request.
    Quic(crate::quic::ServerTunnel),
}

impl Sender {
    pub(super) fn is_closed(&self) -> bool {
        match self {
            Sender::H2(s) => s.is_closed(),
            Sender::Quic(q) => q.is_closed(),
        }
    }

    /// Sends a request shaped for HTTP/2 (absolute target, an extended
    /// CONNECT for an upgrade); the QUIC transport reshapes it.
    pub(super) async fn send(&self, req: Request<Body>) -> Result<Response<Incoming>, String> {
        match self {
            Sender::H2(s) => s
                .clone()
                .send_request(req)
                .await
                .map_err(|e| portcullis_forward::error_chain(&e)),
            Sender::Quic(q) => q.send(req).await,
        }
    }

    /// The client's address: the one it connected from (or its PROXY
    /// header gave), or where a QUIC connection has moved since.
    pub(super) fn remote(&self, connected_from: SocketAddr) -> SocketAddr {
        match self {
            Sender::H2(_) => connected_from,
            Sender::Quic(q) => q.remote(),
        }
    }

    pub(super) fn transport(&self) -> &'static str {
        match self {
            Sender::H2(_) => "websocket",
            Sender::Quic(_) => "quic",
        }
    }
}

/// The runtimes connected now.
#[derive(Default)]
pub struct Registry {
    pub(super) runtimes: Mutex<HashMap<String, Runtime>>,
    pub(super) next_id: AtomicU64,
    /// Told whenever a tunnel comes or goes, so the registry in Redis
    /// (when shared) is brought up to date.
    pub(super) changed: tokio::sync::Notify,
}

#[derive(Default)]
pub(super) struct Runtime {
    pub(super) instance: String,
    pub(super) tunnels: Vec<Arc<Tunnel>>,
    pub(super) next: usize,
}

/// Tunnels to close after adding one.
#[derive(Default)]
pub(super) struct Added {
    /// Another client instance's, to tell it was replaced.
    pub(super) replaced: Vec<Arc<Tunnel>>,
    /// Earlier tunnels of the same slot, given up on by the client.
    pub(super) stale: Vec<Arc<Tunnel>>,
}

impl Registry {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Runtime>> {
        self.runtimes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A tunnel of runtime `id`, taking turns among its connections, and
    /// among those driven by `worker` when there are any: a request then
    /// stays on one thread from the public socket to the tunnel and back.
    pub(super) fn pick(&self, id: &str, worker: usize) -> Option<Arc<Tunnel>> {
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
    pub(super) fn add(&self, runtime: &str, tunnel: Arc<Tunnel>) -> Added {
        let mut runtimes = self.lock();
        self.changed.notify_one();
        let entry = runtimes.entry(runtime.to_owned()).or_default();
        let mut added = Added::default();
        if entry.instance == tunnel.instance || entry.tunnels.is_empty() {
            entry.instance = tunnel.instance.clone();
            if let Some(i) = entry.tunnels.iter().position(|t| t.slot == tunnel.slot) {
                added.stale.push(entry.tunnels.swap_remove(i));
            }
            entry.tunnels.push(tunnel);
        } else if crate::instance_started(&tunnel.instance)
            > crate::instance_started(&entry.instance)
        {
            entry.instance = tunnel.instance.clone();
            added.replaced = std::mem::replace(&mut entry.tunnels, vec![tunnel]);
        } else {
            added.replaced.push(tunnel);
        }
        added
    }

    pub(super) fn remove(&self, runtime: &str, id: u64) {
        let mut runtimes = self.lock();
        self.changed.notify_one();
        if let Some(entry) = runtimes.get_mut(runtime) {
            entry.tunnels.retain(|t| t.id != id);
            if entry.tunnels.is_empty() {
                runtimes.remove(runtime);
            }
        }
    }

    /// What this server holds, for the shared registry.
    pub(super) fn held(&self) -> Vec<crate::peers::directory::Held> {
        self.lock()
            .iter()
            .filter(|(_, r)| !r.tunnels.is_empty())
            .map(|(id, r)| crate::peers::directory::Held {
                runtime: id.clone(),
                client: r.instance.clone(),
                conns: r.tunnels.len(),
                since: r
                    .tunnels
                    .iter()
                    .map(|t| t.since)
                    .min()
                    .unwrap_or(SystemTime::UNIX_EPOCH),
            })
            .collect()
    }

    /// Takes out the tunnels of `runtime` whose client started before
    /// `newer`, which holds it elsewhere: they are to be closed.
    pub(super) fn superseded(&self, runtime: &str, newer: &str) -> Vec<Arc<Tunnel>> {
        let mut runtimes = self.lock();
        let Some(entry) = runtimes.get_mut(runtime) else {
            return Vec::new();
        };
        if crate::instance_started(&entry.instance) >= crate::instance_started(newer) {
            return Vec::new();
        }
        let gone = std::mem::take(&mut entry.tunnels);
        runtimes.remove(runtime);
        self.changed.notify_one();
        gone
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
