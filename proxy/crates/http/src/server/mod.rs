//! Listeners: accept connections, serve HTTP/1.1 and cleartext HTTP/2 on
//! the same port, cap connections, and drain on shutdown.
//!
//! Thread per core, as nginx's workers: each worker thread runs its own
//! single-threaded tokio runtime with its own `SO_REUSEPORT` socket per
//! listener and its own upstream connection pools, so a request never
//! crosses threads. Measured against one multi-threaded runtime, this
//! cut the proxy's CPU per request by about a third (see bench/).
//!
//! Here: binding and running the server; `control.rs` applies a new
//! config to it, `worker.rs` runs a worker and its accept loops.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use futures_util::FutureExt;
use hyper::Request;
use hyper::body::Incoming;
use hyper_util::rt::TokioTimer;
use tokio::net::TcpListener;
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::pipeline::{ConnInfo, Pipeline, Shared};
use portcullis_config::{Config, Listener};
use portcullis_forward::client_watch::ClientSocket;
use portcullis_net::balance::{Accepting, Balance, Counted, Handoff};
use portcullis_net::drain::Connections;
use portcullis_net::h1_or_h2;

use portcullis_net::tls_listen::Opened;

mod control;
mod dns_refresh;
mod http3;
mod worker;

pub use control::ListenerChanges;
pub use worker::timer_anchor;
use worker::*;

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The config has no listener.
    #[error("the policies define no listener; add one under `listeners:`")]
    NoListeners,
    /// A listener's address could not be bound.
    // `error`, not `source`: as a source, `{:#}` would print the OS error
    // a second time after the message that already says it.
    #[error("listener `{name}` ({defined_at}): cannot bind {addr}: {error}")]
    Bind {
        /// Listener name.
        name: String,
        /// Where it was defined.
        defined_at: portcullis_config::Pos,
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        error: std::io::Error,
    },
    /// A plugin could not be compiled, linked or configured.
    #[error("plugins:\n{0}")]
    Plugins(portcullis_config::ConfigErrors),
    /// A worker thread could not be started.
    #[error("cannot start worker thread: {0}")]
    Worker(std::io::Error),
    /// A plugin's instances for the workers could not start.
    #[error("plugins: {0}")]
    PluginStart(String),
}

/// How a server stops.
#[derive(Debug, Clone, Copy)]
pub struct Drain {
    /// Time between the shutdown signal and closing the listeners, while
    /// `/readyz` already answers 503.
    pub delay: Duration,
    /// Time requests in flight get to finish after the listeners close.
    pub grace: Duration,
}

impl Default for Drain {
    fn default() -> Self {
        Drain {
            delay: Duration::ZERO,
            grace: Duration::from_secs(30),
        }
    }
}

/// A listener's settings as its accept loops read them at each accept, so
/// a reload can change them without re-binding.
pub struct ListenerSettings {
    spec: Arc<Listener>,
    /// The connection cap, shared by the workers' sockets. A reload that
    /// changes the cap starts a new count; connections open at that time
    /// stay counted against the old one until they close.
    limit: Arc<Semaphore>,
    builder: Arc<h1_or_h2::Builder>,
    /// The handshake of an HTTPS listener, with the session cache and
    /// ticket key it keeps across reloads that leave its TLS rules alone.
    tls: Option<portcullis_net::tls_live::LiveTls>,
    /// `Alt-Svc` for its HTTP/1.1 and HTTP/2 answers, when it serves
    /// HTTP/3 too.
    alt_svc: Option<http::HeaderValue>,
}

impl ListenerSettings {
    /// `addr`: where it is bound (a port of 0 is known only then).
    fn new(
        spec: &Listener,
        previous: Option<&ListenerSettings>,
        addr: SocketAddr,
    ) -> ListenerSettings {
        let limit = match previous {
            Some(p) if p.spec.max_connections == spec.max_connections => p.limit.clone(),
            _ => Arc::new(Semaphore::new(spec.max_connections)),
        };
        let tls = spec.tls.as_ref().map(|t| {
            let kept = previous.and_then(|p| p.tls.as_ref());
            portcullis_net::tls_live::LiveTls::carry(&t.template, t.keyed, t.source(), kept)
        });
        let alt_svc = spec.http3.map(|h3| {
            let port = h3.advertised_port.unwrap_or(addr.port());
            // A day, as Caddy and Cloudflare advertise it.
            http::HeaderValue::try_from(format!("h3=\":{port}\"; ma=86400"))
                .expect("a port number makes a valid header value")
        });
        ListenerSettings {
            builder: Arc::new(http_builder(spec)),
            spec: Arc::new(spec.clone()),
            limit,
            tls,
            alt_svc,
        }
    }
}

/// A listener being served, as the control side tracks it.
struct ActiveListener {
    name: String,
    /// The address as configured (port 0 stays 0): with the name, what
    /// identifies the listener across reloads.
    bind: SocketAddr,
    /// The address as bound.
    addr: SocketAddr,
    settings: Arc<ArcSwap<ListenerSettings>>,
    /// Stops this listener's accept loops (a child of the server's stop).
    stop: CancellationToken,
    /// Each accept loop holds a sender until its socket is closed.
    closed: mpsc::Receiver<()>,
    /// Its QUIC endpoint, when it serves HTTP/3.
    http3: Option<http3::Endpoint>,
}

impl ActiveListener {
    /// Whether `spec` is this listener: the same name and address, and
    /// HTTP/3 as it was (its UDP socket is opened with the listener).
    fn is(&self, spec: &Listener) -> bool {
        self.name == spec.name
            && self.bind == spec.bind
            && self.http3.is_some() == spec.http3.is_some()
    }
}

/// What the control side tells a worker.
enum WorkerCommand {
    /// Start accepting on this socket (the worker's own of a listener).
    Listen {
        socket: std::net::TcpListener,
        settings: Arc<ArcSwap<ListenerSettings>>,
        stop: CancellationToken,
        /// Dropped once the socket is closed.
        open: mpsc::Sender<()>,
        /// The listener's connections per worker.
        balance: Arc<Balance>,
        /// Connections other workers accepted for this one to serve.
        inbox: mpsc::UnboundedReceiver<Handoff>,
    },
    /// Run a task on the worker's runtime (tunnel connections), tracked
    /// like a connection so shutdown drains it.
    Spawn(Box<dyn FnOnce(WorkerContext) -> LocalTask + Send>),
}

/// A task for a worker's runtime (a current-thread runtime: it stays on
/// that worker's thread).
pub type LocalTask = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

/// What a task spawned on a worker gets.
#[derive(Clone)]
pub struct WorkerContext {
    /// The worker's index (picks its upstream pools).
    pub worker: usize,
    /// The configuration swapped by reloads.
    pub pipeline: Arc<ArcSwap<Pipeline>>,
    /// Cancelled when the server starts draining: stop taking new work,
    /// finish what is in flight.
    pub stop: CancellationToken,
}

/// The serving side as reloads and the admin endpoint see it: swaps in new
/// configurations and reports the listeners.
pub struct Control {
    workers: usize,
    pipeline: Arc<ArcSwap<Pipeline>>,
    shared: Arc<Shared>,
    /// Listeners by configuration. Held through a whole `apply` (which
    /// never waits on anything), so reloads cannot interleave.
    listeners: std::sync::Mutex<Vec<ActiveListener>>,
    to_workers: Vec<mpsc::UnboundedSender<WorkerCommand>>,
    stop_accepting: CancellationToken,
    /// Which of the policies' listeners are opened.
    opens: Listeners,
    /// The addresses of `dns: each_address` upstreams' hosts.
    addresses: crate::discovery::AddressBook,
}

/// One listener as the admin endpoint shows it.
#[derive(Debug, Clone)]
pub struct ListenerStatus {
    /// Name.
    pub name: String,
    /// Bound address.
    pub addr: SocketAddr,
    /// Connections open now.
    pub connections: usize,
    /// The cap.
    pub max_connections: usize,
    /// Whether it serves HTTP/3 too.
    pub http3: bool,
    /// For HTTPS: which client certificates it asks for, and each
    /// certificate file with its expiry.
    pub tls: Option<(portcullis_config::ClientAuthMode, Vec<CertExpiry>)>,
}

pub use portcullis_net::cert_files::CertExpiry;

/// Which of the policies' listeners a server opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listeners {
    /// All of them, and there must be one (`serve`).
    Required,
    /// All of them, if any (`tunnel-client --open-listeners`).
    Optional,
    /// None: requests arrive through the tunnel alone (`tunnel-client`),
    /// so nothing that can reach the pod gets past the tunnel server.
    Closed,
}

impl Listeners {
    /// The listeners of `config` to open.
    fn opened(self, config: &Config) -> Result<&[Listener], ServeError> {
        match self {
            Listeners::Required if config.listeners.is_empty() => Err(ServeError::NoListeners),
            Listeners::Required | Listeners::Optional => Ok(&config.listeners),
            Listeners::Closed => Ok(&[]),
        }
    }
}

/// A server with its listeners bound, ready to run.
pub struct Server {
    control: Arc<Control>,
    from_control: Vec<mpsc::UnboundedReceiver<WorkerCommand>>,
}

/// The number of worker threads when not configured: the CPUs this process
/// may use (cgroup quotas included).
pub fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// A listener's sockets: its address as bound, a TCP socket per worker,
/// and with `http3` the UDP socket on the same port.
type Bound = (
    SocketAddr,
    Vec<std::net::TcpListener>,
    Option<std::net::UdpSocket>,
);

/// Binds one socket per worker on the listener's address; the first
/// settles the port (port 0 picks one) and the others join it. With
/// `http3`, the UDP socket of the port TCP got.
fn bind_sockets(l: &Listener, workers: usize) -> Result<Bound, ServeError> {
    let bind_err = |addr, error| ServeError::Bind {
        name: l.name.clone(),
        defined_at: l.defined_at.clone(),
        addr,
        error,
    };
    let (addr, sockets) = portcullis_net::sockets::worker_sockets(l.bind, workers)
        .map_err(|e| bind_err(l.bind, e))?;
    let udp = match l.http3 {
        // Not shared (no SO_REUSEPORT): two QUIC endpoints on one port
        // would each get some of a connection's packets.
        Some(_) => Some(std::net::UdpSocket::bind(addr).map_err(|e| bind_err(addr, e))?),
        None => None,
    };
    Ok((addr, sockets, udp))
}

impl Server {
    /// Binds every listener of `config` for `workers` worker threads. Once
    /// this returns, `/readyz` is 200.
    pub async fn bind(config: Config, workers: usize) -> Result<Server, ServeError> {
        Self::bind_with(config, workers, Listeners::Required).await
    }

    /// [`Server::bind`], opening the policies' listeners as `listeners`
    /// says (the tunnel client's requests arrive through the tunnel).
    pub async fn bind_with(
        config: Config,
        workers: usize,
        listeners: Listeners,
    ) -> Result<Server, ServeError> {
        let specs = listeners.opened(&config)?;
        let workers = workers.max(1);
        let mut bound = Vec::with_capacity(specs.len());
        for l in specs {
            bound.push(bind_sockets(l, workers)?);
        }
        let chains = portcullis_plugin::prepare(&config)
            .await
            .map_err(ServeError::Plugins)?;
        // Every worker's VMs and instances started before any request:
        // none waits for a start.
        chains
            .warm(workers)
            .await
            .map_err(ServeError::PluginStart)?;
        let shared = Arc::new(Shared::default());
        // Hosts of `each_address` upstreams are looked up before serving,
        // so the first requests already spread over their addresses.
        let addresses = crate::discovery::AddressBook::default();
        let hosts = crate::discovery::hosts(&config).into_keys().collect();
        addresses.look_up(hosts, &config).await;
        let config = Arc::new(addresses.expand(config));
        let pipeline = Arc::new(ArcSwap::from_pointee(Pipeline::new(
            config.clone(),
            chains,
            shared.clone(),
            workers,
            None,
        )));
        let (to_workers, from_control) = (0..workers).map(|_| mpsc::unbounded_channel()).unzip();
        let control = Arc::new(Control {
            workers,
            pipeline,
            shared: shared.clone(),
            listeners: std::sync::Mutex::new(Vec::new()),
            to_workers,
            stop_accepting: CancellationToken::new(),
            opens: listeners,
            addresses,
        });
        {
            let mut active = control.active();
            for (spec, bound) in listeners.opened(&config)?.iter().zip(bound) {
                active.push(control.start_listener(spec, bound));
            }
        }
        shared.set_ready();
        Ok(Server {
            control,
            from_control,
        })
    }

    /// The bound address of each listener, by name (useful with port 0).
    pub fn local_addrs(&self) -> Vec<(String, SocketAddr)> {
        self.control.local_addrs()
    }

    /// The bound address of the listener called `name`.
    pub fn local_addr(&self, name: &str) -> Option<SocketAddr> {
        self.local_addrs()
            .into_iter()
            .find(|(n, _)| n == name)
            .map(|(_, a)| a)
    }

    /// The serving state (readiness, drain).
    pub fn shared(&self) -> &Arc<Shared> {
        &self.control.shared
    }

    /// The handle reloads and the admin endpoint use.
    pub fn control(&self) -> &Arc<Control> {
        &self.control
    }

    /// Serves until `shutdown` completes, then drains: `/readyz` turns 503
    /// at once, listeners keep accepting for `drain.delay` (so load
    /// balancers see the 503 and stop sending), then close; requests in
    /// flight (and upgraded connections) get up to `drain.grace` to finish,
    /// and whatever is left is cut.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()>,
        drain: Drain,
    ) -> Result<(), ServeError> {
        let control = self.control;
        let abort = CancellationToken::new();
        for (name, addr) in control.local_addrs() {
            tracing::info!(listener = %name, addr = %addr, workers = control.workers, "listening");
        }
        tokio::spawn(dns_refresh::refresh(
            Arc::downgrade(&control),
            control.stop_accepting.clone(),
        ));
        let mut done = Vec::with_capacity(control.workers);
        for (index, commands) in self.from_control.into_iter().enumerate() {
            let (tx, rx) = oneshot::channel();
            let worker = Worker {
                index,
                pipeline: control.pipeline.clone(),
                shared: control.shared.clone(),
                stop_accepting: control.stop_accepting.clone(),
                abort: abort.clone(),
            };
            std::thread::Builder::new()
                .name(format!("portcullis-worker-{index}"))
                .spawn(move || {
                    worker.run(commands);
                    let _ = tx.send(());
                })
                .map_err(ServeError::Worker)?;
            done.push(rx);
        }

        shutdown.await;
        control.shared.set_draining();
        if !drain.delay.is_zero() {
            tracing::info!(
                delay_secs = drain.delay.as_secs_f64(),
                "shutting down: readyz is 503; still accepting during the delay"
            );
            tokio::time::sleep(drain.delay).await;
        }
        tracing::info!(
            grace_secs = drain.grace.as_secs_f64(),
            "shutting down: closed listeners, draining connections"
        );
        control.stop_accepting.cancel();
        // What was served until now is out before the wait.
        portcullis_obs::access_log::flush();
        let all_done = futures_util::future::join_all(done);
        match tokio::time::timeout(drain.grace, all_done).await {
            Ok(_) => tracing::info!("drained; all connections closed"),
            Err(_) => {
                tracing::warn!(
                    grace_secs = drain.grace.as_secs_f64(),
                    "grace period over; closing remaining connections"
                );
                abort.cancel();
            }
        }
        Ok(())
    }
}
