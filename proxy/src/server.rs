//! Listeners: accept connections, serve HTTP/1.1 and cleartext HTTP/2 on
//! the same port, cap connections, and drain on shutdown.
//!
//! Thread per core, as nginx's workers: each worker thread runs its own
//! single-threaded tokio runtime with its own `SO_REUSEPORT` socket per
//! listener and its own upstream connection pools, so a request never
//! crosses threads. Measured against one multi-threaded runtime, this
//! cut the proxy's CPU per request by about a third (see bench/).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Semaphore, oneshot};
use tokio_util::sync::CancellationToken;

use crate::config::{Config, Listener};
use crate::pipeline::{ConnInfo, Pipeline, Shared};

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The config has no listener.
    #[error("the policies define no listener; add one under `listeners:`")]
    NoListeners,
    /// A listener's address could not be bound.
    #[error("listener `{name}` ({defined_at}): cannot bind {addr}: {source}")]
    Bind {
        /// Listener name.
        name: String,
        /// Where it was defined.
        defined_at: crate::config::Pos,
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
    /// A plugin could not be compiled, linked or configured.
    #[error("plugins:\n{0}")]
    Plugins(crate::config::ConfigErrors),
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

/// One listener's sockets: one per worker, all on the same address.
struct BoundListener {
    spec: Arc<Listener>,
    addr: SocketAddr,
    sockets: Vec<std::net::TcpListener>,
    /// Shared by the workers: the connection cap is per listener.
    limit: Arc<Semaphore>,
}

/// A server with its listeners bound, ready to run.
pub struct Server {
    listeners: Vec<BoundListener>,
    workers: usize,
    pipeline: Arc<ArcSwap<Pipeline>>,
    shared: Arc<Shared>,
}

/// The number of worker threads when not configured: the CPUs this process
/// may use (cgroup quotas included).
pub fn default_workers() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

fn reuseport_socket(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(4096)?;
    Ok(socket.into())
}

impl Server {
    /// Binds every listener of `config` for `workers` worker threads. Once
    /// this returns, `/readyz` is 200.
    pub async fn bind(config: Config, workers: usize) -> Result<Server, ServeError> {
        if config.listeners.is_empty() {
            return Err(ServeError::NoListeners);
        }
        let workers = workers.max(1);
        let config = Arc::new(config);
        let mut listeners = Vec::with_capacity(config.listeners.len());
        for l in &config.listeners {
            let bind_err = |source| ServeError::Bind {
                name: l.name.clone(),
                defined_at: l.defined_at.clone(),
                addr: l.bind,
                source,
            };
            // The first socket settles the port (port 0 picks one); the
            // other workers' sockets join it.
            let first = reuseport_socket(l.bind).map_err(bind_err)?;
            let addr = first.local_addr().map_err(bind_err)?;
            let mut sockets = vec![first];
            for _ in 1..workers {
                sockets.push(reuseport_socket(addr).map_err(bind_err)?);
            }
            listeners.push(BoundListener {
                spec: Arc::new(l.clone()),
                addr,
                sockets,
                limit: Arc::new(Semaphore::new(l.max_connections)),
            });
        }
        let chains = crate::plugin::prepare(&config)
            .await
            .map_err(ServeError::Plugins)?;
        let shared = Arc::new(Shared::default());
        let pipeline = Arc::new(ArcSwap::from_pointee(Pipeline::new(
            config,
            chains,
            shared.clone(),
            workers,
        )));
        shared.set_ready();
        Ok(Server {
            listeners,
            workers,
            pipeline,
            shared,
        })
    }

    /// The bound address of each listener, by name (useful with port 0).
    pub fn local_addrs(&self) -> Vec<(String, SocketAddr)> {
        self.listeners
            .iter()
            .map(|l| (l.spec.name.clone(), l.addr))
            .collect()
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
        &self.shared
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
        let stop_accepting = CancellationToken::new();
        let abort = CancellationToken::new();
        for l in &self.listeners {
            tracing::info!(listener = %l.spec.name, addr = %l.addr, workers = self.workers, "listening");
        }
        // Hand each worker its socket of every listener.
        let mut per_worker: Vec<Vec<WorkerSocket>> =
            (0..self.workers).map(|_| Vec::new()).collect();
        for l in self.listeners {
            for (w, socket) in l.sockets.into_iter().enumerate() {
                per_worker[w].push(WorkerSocket {
                    spec: l.spec.clone(),
                    socket,
                    limit: l.limit.clone(),
                });
            }
        }
        let mut done = Vec::with_capacity(self.workers);
        for (index, sockets) in per_worker.into_iter().enumerate() {
            let (tx, rx) = oneshot::channel();
            let worker = Worker {
                index,
                pipeline: self.pipeline.clone(),
                shared: self.shared.clone(),
                stop_accepting: stop_accepting.clone(),
                abort: abort.clone(),
            };
            std::thread::Builder::new()
                .name(format!("portcullis-worker-{index}"))
                .spawn(move || {
                    worker.run(sockets);
                    let _ = tx.send(());
                })
                .map_err(ServeError::Worker)?;
            done.push(rx);
        }

        shutdown.await;
        self.shared.set_draining();
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
        stop_accepting.cancel();
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

/// A worker's socket of one listener.
struct WorkerSocket {
    spec: Arc<Listener>,
    socket: std::net::TcpListener,
    limit: Arc<Semaphore>,
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
    fn run(self, sockets: Vec<WorkerSocket>) {
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
            let graceful = Arc::new(GracefulShutdown::new());
            let tracker = tokio_util::task::TaskTracker::new();
            let mut loops = Vec::new();
            for WorkerSocket { spec, socket, limit } in sockets {
                match TcpListener::from_std(socket) {
                    Ok(socket) => loops.push(tokio::spawn(accept_loop(
                        spec,
                        socket,
                        limit,
                        self.index,
                        self.pipeline.clone(),
                        graceful.clone(),
                        tracker.clone(),
                        self.stop_accepting.clone(),
                    ))),
                    Err(e) => tracing::error!(listener = %spec.name, error = %e, "cannot register listener"),
                }
            }
            self.stop_accepting.cancelled().await;
            for l in loops {
                let _ = l.await;
            }
            // Every accept loop has returned, so this is the only owner left.
            let graceful = Arc::try_unwrap(graceful).unwrap_or_else(|_| GracefulShutdown::new());
            tracker.close();
            let drained = async {
                graceful.shutdown().await;
                tracker.wait().await;
                // Spliced WebSocket connections are tracked process-wide.
                self.shared.tracker.close();
                self.shared.tracker.wait().await;
            };
            tokio::select! {
                _ = drained => {}
                _ = self.abort.cancelled() => {}
            }
        });
    }
}

#[allow(clippy::too_many_arguments)]
async fn accept_loop(
    listener: Arc<Listener>,
    socket: TcpListener,
    limit: Arc<Semaphore>,
    worker: usize,
    pipeline: Arc<ArcSwap<Pipeline>>,
    graceful: Arc<GracefulShutdown>,
    tracker: tokio_util::task::TaskTracker,
    stop: CancellationToken,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        // One flattened write per response beats writev for small messages
        // (see the upstream side in forward/pool.rs).
        .writev(false)
        .timer(TokioTimer::new())
        .header_read_timeout(listener.header_read_timeout)
        // hyper's own limit is a backstop above ours: requests between the
        // two get the proxy's JSON 431 instead of hyper's bare one.
        .max_buf_size((listener.max_request_header_size * 2).max(16 * 1024));
    // hyper's default of 100 headers is parsed on the stack; setting any
    // other maximum costs a heap allocation per request.
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size((listener.max_request_header_size * 2) as u32)
        .initial_stream_window_size(4 << 20)
        .initial_connection_window_size(8 << 20)
        .max_concurrent_streams(1024)
        .keep_alive_interval(Some(Duration::from_secs(30)));
    let builder = Arc::new(builder);
    loop {
        let (stream, client) = tokio::select! {
            r = socket.accept() => match r {
                Ok(pair) => pair,
                Err(e) => {
                    // Out of file descriptors and the like: back off briefly
                    // rather than spin; the listener stays up.
                    tracing::warn!(listener = %listener.name, error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            _ = stop.cancelled() => return,
        };
        // The cap is shared by the workers, so a slot is taken after
        // accepting: a worker that held one while waiting on its own
        // socket would starve the others. Each worker holds at most one
        // accepted connection waiting for a slot; the rest stay queued in
        // the kernel.
        let permit = tokio::select! {
            p = limit.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return },
            _ = stop.cancelled() => return,
        };
        let conn = Arc::new(ConnInfo {
            client,
            client_ip: crate::forward::client_ip_header(client.ip()),
            listener: listener.clone(),
            tls: false,
            worker,
        });
        serve_connection(
            stream, conn, &builder, &pipeline, &tracker, &graceful, permit,
        );
    }
}

fn serve_connection(
    stream: TcpStream,
    conn: Arc<ConnInfo>,
    builder: &Arc<auto::Builder<TokioExecutor>>,
    pipeline: &Arc<ArcSwap<Pipeline>>,
    tracker: &tokio_util::task::TaskTracker,
    graceful: &GracefulShutdown,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    let _ = stream.set_nodelay(true);
    let pipeline = pipeline.clone();
    let service_conn = conn.clone();
    let service = service_fn(move |req| {
        // Each request takes the pipeline current at its arrival; a reload
        // swaps it under keep-alive connections without touching requests
        // already in flight.
        let pipeline = pipeline.load_full();
        let conn = service_conn.clone();
        async move { Ok::<_, Infallible>(pipeline.handle(req, &conn).await) }
    });
    let builder = builder.clone();
    let io = TokioIo::new(stream);
    let served = graceful.watch(
        builder
            .serve_connection_with_upgrades(io, service)
            .into_owned(),
    );
    tracker.spawn(async move {
        if let Err(e) = served.await {
            tracing::debug!(client = %conn.client, error = %e, "connection ended with an error");
        }
        drop(permit);
    });
}
