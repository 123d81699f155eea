//! Listeners: accept connections, serve HTTP/1.1 and cleartext HTTP/2 on
//! the same port, cap connections, and drain on shutdown.
//!
//! Thread per core, as nginx's workers: each worker thread runs its own
//! single-threaded tokio runtime with its own `SO_REUSEPORT` socket per
//! listener and its own upstream connection pools, so a request never
//! crosses threads. Measured against one multi-threaded runtime, this
//! cut the proxy's CPU per request by about a third (see bench/).

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

use crate::client_watch::ClientSocket;
use crate::pipeline::{ConnInfo, Pipeline, Shared};
use portcullis_config::{Config, Listener};
use portcullis_net::balance::{Accepting, Balance, Counted, Handoff};
use portcullis_net::drain::Connections;
use portcullis_net::h1_or_h2;

use portcullis_net::tls_listen::{NotOpened, Opened};

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
}

impl ListenerSettings {
    fn new(spec: &Listener, previous: Option<&ListenerSettings>) -> ListenerSettings {
        let limit = match previous {
            Some(p) if p.spec.max_connections == spec.max_connections => p.limit.clone(),
            _ => Arc::new(Semaphore::new(spec.max_connections)),
        };
        ListenerSettings {
            builder: Arc::new(http_builder(spec)),
            spec: Arc::new(spec.clone()),
            limit,
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

/// Binds one socket per worker on the listener's address; the first
/// settles the port (port 0 picks one) and the others join it.
fn bind_sockets(
    l: &Listener,
    workers: usize,
) -> Result<(SocketAddr, Vec<std::net::TcpListener>), ServeError> {
    let bind_err = |error| ServeError::Bind {
        name: l.name.clone(),
        defined_at: l.defined_at.clone(),
        addr: l.bind,
        error,
    };
    portcullis_net::sockets::worker_sockets(l.bind, workers).map_err(bind_err)
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
            for (spec, (addr, sockets)) in listeners.opened(&config)?.iter().zip(bound) {
                active.push(control.start_listener(spec, addr, sockets));
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
        tokio::spawn(crate::discovery::refresh(
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

/// What a reload changed in the listeners.
#[derive(Debug, Default)]
pub struct ListenerChanges {
    /// Listeners bound by this reload, with their addresses.
    pub added: Vec<(String, SocketAddr)>,
    /// Listeners closed by this reload.
    pub removed: Vec<(String, SocketAddr)>,
    /// Complete when every socket of the removed listeners is closed.
    pub closing: Vec<mpsc::Receiver<()>>,
}

impl ListenerChanges {
    /// Waits until the removed listeners refuse connections (their open
    /// connections may still be finishing).
    pub async fn closed(&mut self) {
        for c in &mut self.closing {
            while c.recv().await.is_some() {}
        }
    }
}

impl Control {
    /// Swaps in a new configuration whose plugins are already prepared:
    /// binds listeners it adds (and fails whole, changing nothing, when one
    /// cannot be bound), swaps the pipeline (requests in flight keep the old
    /// one; the next request on any connection gets the new one), then
    /// starts the new listeners and closes the removed ones, whose open
    /// connections finish their requests. Listeners both versions have keep
    /// their sockets and connections.
    pub fn apply(
        &self,
        config: Config,
        chains: portcullis_plugin::Chains,
    ) -> Result<ListenerChanges, ServeError> {
        let mut active = self.active();
        let mut fresh = Vec::new();
        for spec in self.opens.opened(&config)? {
            if !active
                .iter()
                .any(|a| a.name == spec.name && a.bind == spec.bind)
            {
                // An error drops the sockets bound so far, which closes them.
                let (addr, sockets) = bind_sockets(spec, self.workers)?;
                fresh.push((spec.clone(), addr, sockets));
            }
        }
        let config = self.addresses.expand(config);
        let previous = self.pipeline.load_full();
        let config = Arc::new(config);
        self.pipeline.store(Arc::new(Pipeline::new(
            config.clone(),
            chains,
            self.shared.clone(),
            self.workers,
            Some(&previous),
        )));
        drop(previous);
        self.addresses.config_applied();

        let mut changes = ListenerChanges::default();
        let mut kept = Vec::with_capacity(config.listeners.len());
        for a in active.drain(..) {
            match config
                .listeners
                .iter()
                .find(|s| s.name == a.name && s.bind == a.bind)
            {
                Some(spec) => {
                    let settings = ListenerSettings::new(spec, Some(&a.settings.load()));
                    a.settings.store(Arc::new(settings));
                    kept.push(a);
                }
                None => {
                    tracing::info!(listener = %a.name, addr = %a.addr, "listener removed; closing it");
                    a.stop.cancel();
                    changes.removed.push((a.name, a.addr));
                    changes.closing.push(a.closed);
                }
            }
        }
        for (spec, addr, sockets) in fresh {
            tracing::info!(listener = %spec.name, addr = %addr, workers = self.workers, "listening");
            changes.added.push((spec.name.clone(), addr));
            kept.push(self.start_listener(&spec, addr, sockets));
        }
        *active = kept;
        Ok(changes)
    }

    /// Hands each worker its socket of a listener.
    fn start_listener(
        &self,
        spec: &Listener,
        addr: SocketAddr,
        sockets: Vec<std::net::TcpListener>,
    ) -> ActiveListener {
        let settings = Arc::new(ArcSwap::from_pointee(ListenerSettings::new(spec, None)));
        let stop = self.stop_accepting.child_token();
        let (open, closed) = mpsc::channel(1);
        let (balance, inboxes) = Balance::new(self.workers);
        for ((socket, worker), inbox) in sockets.into_iter().zip(&self.to_workers).zip(inboxes) {
            // A worker that is gone has stopped serving anyway.
            let _ = worker.send(WorkerCommand::Listen {
                socket,
                settings: settings.clone(),
                stop: stop.clone(),
                open: open.clone(),
                balance: balance.clone(),
                inbox,
            });
        }
        ActiveListener {
            name: spec.name.clone(),
            bind: spec.bind,
            addr,
            settings,
            stop,
            closed,
        }
    }

    /// The bound address of each listener, by name.
    pub fn local_addrs(&self) -> Vec<(String, SocketAddr)> {
        self.active()
            .iter()
            .map(|l| (l.name.clone(), l.addr))
            .collect()
    }

    /// Each listener with its open connections.
    pub fn listeners(&self) -> Vec<ListenerStatus> {
        self.active()
            .iter()
            .map(|l| {
                let s = l.settings.load();
                let max = s.spec.max_connections;
                ListenerStatus {
                    name: l.name.clone(),
                    addr: l.addr,
                    connections: max.saturating_sub(s.limit.available_permits()),
                    max_connections: max,
                    tls: s
                        .spec
                        .tls
                        .as_ref()
                        .map(|t| (t.client_auth, t.certificates.expiries())),
                }
            })
            .collect()
    }

    fn active(&self) -> std::sync::MutexGuard<'_, Vec<ActiveListener>> {
        // Nothing under this lock is expected to panic; if something did,
        // the listeners still serve and the list is the best record left.
        self.listeners.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `task` on worker `worker % workers`, in that worker's runtime.
    pub fn spawn_on_worker(
        &self,
        worker: usize,
        task: impl FnOnce(WorkerContext) -> LocalTask + Send + 'static,
    ) {
        let _ = self.to_workers[worker % self.workers].send(WorkerCommand::Spawn(Box::new(task)));
    }

    /// The number of worker threads.
    pub fn workers(&self) -> usize {
        self.workers
    }

    /// The configuration serving new requests now.
    pub fn pipeline(&self) -> Arc<Pipeline> {
        self.pipeline.load_full()
    }

    /// What `dns: each_address` upstreams' hosts resolved to.
    pub fn addresses(&self) -> &crate::discovery::AddressBook {
        &self.addresses
    }

    /// Looks up the `each_address` hosts of `config` (a reload's, before
    /// [`Control::apply`]) that were never resolved, so a new upstream
    /// starts out spread over its addresses.
    pub async fn look_up_new_hosts(&self, config: &Config) {
        let new: Vec<_> = crate::discovery::hosts(config)
            .into_keys()
            .filter(|hp| !self.addresses.knows(hp))
            .collect();
        if !new.is_empty() {
            self.addresses.look_up(new, config).await;
        }
    }

    /// Swaps in the serving configuration with its `each_address`
    /// upstreams listing the addresses known now, when that changes them.
    /// Only those upstreams change: the others keep their pools, and they
    /// keep the connections of the addresses that stayed.
    pub fn refresh_addresses(&self) {
        // Held as `apply` holds it: a reload and a refresh never interleave.
        let _active = self.active();
        let current = self.pipeline.load_full();
        let Some(config) = self.addresses.expanded(current.config()) else {
            return;
        };
        self.pipeline.store(Arc::new(Pipeline::new(
            Arc::new(config),
            current.chains().clone(),
            self.shared.clone(),
            self.workers,
            Some(&current),
        )));
    }

    /// The serving state (readiness, drain).
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}

/// One worker thread's share of the server.
struct Worker {
    index: usize,
    pipeline: Arc<ArcSwap<Pipeline>>,
    shared: Arc<Shared>,
    stop_accepting: CancellationToken,
    abort: CancellationToken,
}

impl Worker {
    fn run(self, mut commands: mpsc::UnboundedReceiver<WorkerCommand>) {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                tracing::error!(worker = self.index, error = %e, "cannot start worker runtime");
                return;
            }
        };
        runtime.block_on(async move {
            // Accept loops and connections; each accept loop drains its own
            // connections when it stops.
            let tracker = TaskTracker::new();
            tokio::spawn(timer_anchor());
            loop {
                let command = tokio::select! {
                    c = commands.recv() => c,
                    _ = self.stop_accepting.cancelled() => None,
                };
                let (socket, settings, stop, open, balance, inbox) = match command {
                    Some(WorkerCommand::Listen {
                        socket,
                        settings,
                        stop,
                        open,
                        balance,
                        inbox,
                    }) => (socket, settings, stop, open, balance, inbox),
                    Some(WorkerCommand::Spawn(make)) => {
                        let task = make(WorkerContext {
                            worker: self.index,
                            pipeline: self.pipeline.clone(),
                            stop: self.stop_accepting.clone(),
                        });
                        tracker.spawn(task);
                        continue;
                    }
                    None => break,
                };
                match TcpListener::from_std(socket) {
                    Ok(socket) => {
                        tracker.spawn(accept_loop(
                            settings,
                            (socket, balance, inbox),
                            self.index,
                            self.pipeline.clone(),
                            tracker.clone(),
                            stop,
                            open,
                        ));
                    }
                    Err(e) => {
                        let name = settings.load().spec.name.clone();
                        tracing::error!(listener = %name, error = %e, "cannot register listener");
                    }
                }
            }
            tracker.close();
            let drained = async {
                tracker.wait().await;
                // Spliced WebSocket connections are tracked process-wide.
                self.shared.tracker.close();
                self.shared.tracker.wait().await;
                // The last requests' spans, before the runtime goes.
                portcullis_obs::otlp::flush_and_wait().await;
            };
            tokio::select! {
                _ = drained => {}
                _ = self.abort.cancelled() => {}
            }
        });
    }
}

/// Keeps a timer due within the next [`ANCHOR_PERIOD`] on the worker's
/// runtime at all times.
///
/// tokio's time driver writes to the runtime's eventfd (a syscall, and an
/// extra trip through epoll) whenever a timer is registered that is due
/// earlier than every timer it saw when it last parked. Under load that
/// happened on about one request in five: a worker whose connections were
/// all waiting on their upstreams (60 s route timeouts) parked, and the
/// next keep-alive request armed its 10 s header-read timeout, earlier
/// than all of them. With this timer always due sooner, a timer of a
/// second or more never wakes the driver; the cost is one wake-up per
/// period on an idle worker.
pub async fn timer_anchor() {
    let mut tick = tokio::time::interval(ANCHOR_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
    }
}

const ANCHOR_PERIOD: Duration = Duration::from_millis(500);

/// The HTTP server settings of a listener.
fn http_builder(listener: &Listener) -> h1_or_h2::Builder {
    let mut builder = h1_or_h2::Builder::new();
    builder
        .http1
        // One flattened write per response beats writev for small messages
        // (see the upstream side in forward/pool.rs).
        .writev(false)
        // Without this, hyper reads the socket right after handing over
        // each request, to notice a client that leaves mid-request, and
        // reallocates its read buffer to do so; `client_watch` notices it
        // instead, only for requests still open after a while.
        .half_close(true)
        .timer(TokioTimer::new())
        // hyper's head clock also runs while a keep-alive connection waits
        // for its next request, so it takes the keep-alive timeout; the
        // heads' shorter deadline is `head_deadline`'s.
        .header_read_timeout(listener.keepalive_timeout)
        // hyper's own limit is a backstop above ours: requests between the
        // two get the proxy's JSON 431 instead of hyper's bare one.
        .max_header_size(listener.max_request_header_size * 2)
        // Sized for bodies: each read of an upload takes up to this much
        // (the head bound is the line above).
        .max_buf_size(READ_BUFFER.max(listener.max_request_header_size * 2));
    // hyper's default of 100 headers is parsed on the stack; setting any
    // other maximum costs a heap allocation per request.
    builder
        .http2
        .timer(TokioTimer::new())
        .max_header_list_size((listener.max_request_header_size * 2) as u32)
        .initial_stream_window_size(4 << 20)
        .initial_connection_window_size(8 << 20)
        .max_concurrent_streams(MAX_STREAMS)
        .max_pending_accept_reset_streams(MAX_STREAMS as usize)
        .keep_alive_interval(Some(Duration::from_secs(30)));
    builder
}

/// Requests one HTTP/2 client connection carries at once.
///
/// As many streams opened and reset before the listener took them are
/// borne on a connection. h2's default is 20, beyond which it takes the
/// client for a rapid-reset attacker (CVE-2023-44487) and ends the
/// connection with every request on it. But an ingress that speaks
/// HTTP/2 to its backends carries many users on one connection and
/// resets a stream for each user who leaves, and a burst of those (users
/// leaving together, a balancer's timeouts, a load test ending) reaches
/// the proxy in one read when it is busy (nginx 1.22 goes on answering
/// after a burst of 100 in one read). Such streams still reach the
/// pipeline (hyper calls the service, and drops its future at the first
/// wait), so a burst costs what as many requests cancelled in flight
/// cost, which the concurrency limit allows anyway; the queue of them
/// stays bounded, which is what h2's limit is for.
const MAX_STREAMS: u32 = 1024;

/// The most an HTTP/1 connection reads from its client at once. At
/// 64 KiB (when it also bounded heads), uploads took 29% more CPU, and
/// chunked ones 47% more, than at this size (bench/HISTORY.md, "Large
/// bodies"): hyper's read buffer cannot be reused while the body's
/// chunks are queued to the upstream, and smaller reads mean more of them.
const READ_BUFFER: usize = 256 * 1024;

/// Accepts on one worker's socket of a listener until `stop`, then lets
/// the connections it accepted finish their requests.
async fn accept_loop(
    settings: Arc<ArcSwap<ListenerSettings>>,
    (socket, balance, mut inbox): (TcpListener, Arc<Balance>, mpsc::UnboundedReceiver<Handoff>),
    worker: usize,
    pipeline: Arc<ArcSwap<Pipeline>>,
    tracker: TaskTracker,
    stop: CancellationToken,
    open: mpsc::Sender<()>,
) {
    let connections = Connections::new();
    // Fixed for the loop's life: a listener renamed by a reload is another
    // listener.
    let name = settings.load().spec.name.clone();
    let mut accepting = Accepting {
        socket: &socket,
        name: &name,
        balance: &balance,
        worker,
        inbox: &mut inbox,
    };
    while let Some((stream, client, permit, counted)) = accepting
        .next(|| settings.load().limit.clone(), &stop)
        .await
    {
        let current = settings.load_full();
        let _ = stream.set_nodelay(true);
        if !current.spec.proxy_protocol && current.spec.tls.is_none() {
            let socket = ClientSocket::of(&stream);
            serve_connection(
                (stream, socket, None),
                client,
                &current,
                worker,
                (&pipeline, &tracker, &connections),
                (permit, counted),
            );
            continue;
        }
        // The PROXY header and the handshake take place in the
        // connection's own task, under the header-read timeout, so a
        // balancer or a client slow to send them holds up no other
        // connection.
        let (pipeline, tracker_, connections, stop) = (
            pipeline.clone(),
            tracker.clone(),
            connections.clone(),
            stop.clone(),
        );
        tracker.spawn(async move {
            let limit = current.spec.header_read_timeout;
            let tls = current.spec.tls.as_ref().map(|t| (&t.acceptor, PLAIN_ON_HTTPS));
            let opened = portcullis_net::tls_listen::open(stream, client, current.spec.proxy_protocol, tls);
            let opened = tokio::time::timeout(limit, opened);
            let opened = tokio::select! {
                opened = opened => opened,
                _ = stop.cancelled() => return,
            };
            let name = &current.spec.name;
            let served = (&pipeline, &tracker_, &connections);
            match opened {
                Ok(Ok((Opened::Tcp(stream), client))) => {
                    let socket = ClientSocket::of(&stream);
                    let conn = (stream, socket, None);
                    serve_connection(conn, client, &current, worker, served, (permit, counted));
                }
                Ok(Ok((Opened::Tls(stream), client))) => {
                    let socket = ClientSocket::of(stream.get_ref().0);
                    let facts = portcullis_net::tls_listen::ClientFacts::of(&stream);
                    let conn = (*stream, socket, Some(facts));
                    serve_connection(conn, client, &current, worker, served, (permit, counted));
                }
                Ok(Err(NotOpened::ProxyHeader(e))) => {
                    portcullis_obs::metrics::count_connection_error(name, "proxy_protocol");
                    tracing::debug!(peer = %client, error = %e, "connection closed");
                }
                Ok(Err(NotOpened::Tls(refused))) => {
                    portcullis_obs::metrics::count_connection_error(name, refused.reason());
                    tracing::debug!(peer = %client, listener = %name, "connection closed: {refused}");
                }
                Err(_) => {
                    portcullis_obs::metrics::connection_timed_out(name);
                    tracing::debug!(peer = %client, "no PROXY protocol header or TLS handshake within the header-read timeout; closed");
                }
            }
        });
    }
    // Closing the socket now refuses new connections at once; the open
    // ones finish their current request and close. Connections handed to
    // this worker and not yet taken close with the inbox.
    drop(socket);
    drop(inbox);
    drop(open);
    connections.shutdown().await;
}

/// The answer to plain HTTP on an HTTPS listener.
const PLAIN_ON_HTTPS: &str = concat!(
    r#"{"error":"plain HTTP request sent to the HTTPS port: use https://","#,
    r#""route":null,"status":400}"#
);

/// Serves HTTP on an accepted connection from `client` (the peer, or the
/// address its PROXY header gave) in a task of its own: the stream, its
/// socket, and for TLS what its handshake told.
fn serve_connection<S>(
    (stream, socket, tls): (
        S,
        ClientSocket,
        Option<portcullis_net::tls_listen::ClientFacts>,
    ),
    client: SocketAddr,
    settings: &ListenerSettings,
    worker: usize,
    (pipeline, tracker, connections): (&Arc<ArcSwap<Pipeline>>, &TaskTracker, &Connections),
    // Held for the connection's life: its slot under the cap, its count
    // in the balance.
    held: (tokio::sync::OwnedSemaphorePermit, Counted),
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let retire = portcullis_net::drain::Retire::new(
        settings.spec.max_requests_per_connection,
        settings.spec.connection_lifetime,
    );
    let conn = Arc::new(ConnInfo {
        client,
        client_ip: crate::forward::client_ip_header(client.ip()),
        listener: settings.spec.clone(),
        tls: tls.is_some(),
        tls_version: tls.as_ref().and_then(|t| t.version),
        sni: tls.as_ref().and_then(|t| t.sni.clone()),
        client_cert: tls.and_then(|t| t.client_cert),
        worker,
        socket: Some(socket),
        retire: retire.clone(),
    });
    let pipeline = pipeline.clone();
    let service_conn = conn.clone();
    let respond = move |req: Request<Incoming>, finish: crate::connection::Finish| {
        // Each request takes the pipeline current at its arrival; a reload
        // swaps it under keep-alive connections without touching requests
        // already in flight.
        let pipeline = crate::pipeline::current(&pipeline);
        let conn = service_conn.clone();
        // Not boxed, unlike on the tunnel server's public side: hyper
        // keeps a box the size of this future (~5 KiB) for the
        // connection's life, but boxing it per request cost 2.5% more
        // instructions per request (the future is copied into its box),
        // and behind an ingress the connections are few and busy.
        async move { finish.answer(pipeline.handle(req, &conn).await) }
    };
    let accepted = crate::connection::Accepted {
        builder: &settings.builder,
        connections,
        listener: ListenerName(conn.clone()),
        client,
        worker,
        retire,
        header_read_timeout: conn.listener.header_read_timeout,
    };
    let served = crate::connection::serve(stream, accepted, respond);
    tracker.spawn(served.map(move |()| drop(held)));
}

/// A connection's listener name, held through its `ConnInfo`.
struct ListenerName(Arc<ConnInfo>);

impl AsRef<str> for ListenerName {
    fn as_ref(&self) -> &str {
        &self.0.listener.name
    }
}
