//! Listeners: accept connections, serve HTTP/1.1 and cleartext HTTP/2 on
//! the same port, cap connections, and drain on shutdown.

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
use tokio::sync::Semaphore;
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

/// A server with its listeners bound, ready to run.
pub struct Server {
    listeners: Vec<(Arc<Listener>, TcpListener)>,
    pipeline: Arc<ArcSwap<Pipeline>>,
    shared: Arc<Shared>,
}

impl Server {
    /// Binds every listener of `config`. Once this returns, `/readyz` is 200.
    pub async fn bind(config: Config) -> Result<Server, ServeError> {
        if config.listeners.is_empty() {
            return Err(ServeError::NoListeners);
        }
        let config = Arc::new(config);
        let mut listeners = Vec::with_capacity(config.listeners.len());
        for l in &config.listeners {
            let socket = TcpListener::bind(l.bind)
                .await
                .map_err(|source| ServeError::Bind {
                    name: l.name.clone(),
                    defined_at: l.defined_at.clone(),
                    addr: l.bind,
                    source,
                })?;
            listeners.push((Arc::new(l.clone()), socket));
        }
        let shared = Arc::new(Shared::default());
        let pipeline = Arc::new(ArcSwap::from_pointee(Pipeline::new(config, shared.clone())));
        shared.set_ready();
        Ok(Server {
            listeners,
            pipeline,
            shared,
        })
    }

    /// The bound address of each listener, by name (useful with port 0).
    pub fn local_addrs(&self) -> Vec<(String, SocketAddr)> {
        self.listeners
            .iter()
            .filter_map(|(l, s)| s.local_addr().ok().map(|a| (l.name.clone(), a)))
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
    pub async fn run(self, shutdown: impl Future<Output = ()>, drain: Drain) {
        let grace = drain.grace;
        let stop_accepting = CancellationToken::new();
        let graceful = Arc::new(GracefulShutdown::new());
        let mut accept_loops = Vec::new();
        for (listener, socket) in self.listeners {
            if let Ok(addr) = socket.local_addr() {
                tracing::info!(listener = %listener.name, %addr, "listening");
            }
            accept_loops.push(tokio::spawn(accept_loop(
                listener,
                socket,
                self.pipeline.clone(),
                self.shared.clone(),
                graceful.clone(),
                stop_accepting.clone(),
            )));
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
            grace_secs = grace.as_secs_f64(),
            "shutting down: closed listeners, draining connections"
        );
        stop_accepting.cancel();
        for handle in accept_loops {
            let _ = handle.await;
        }
        // Every accept loop has returned, so this is the only owner left.
        let graceful = Arc::try_unwrap(graceful).unwrap_or_else(|_| GracefulShutdown::new());
        self.shared.tracker.close();
        let drained = async {
            graceful.shutdown().await;
            self.shared.tracker.wait().await;
        };
        match tokio::time::timeout(grace, drained).await {
            Ok(()) => tracing::info!("drained; all connections closed"),
            Err(_) => tracing::warn!(
                grace_secs = grace.as_secs_f64(),
                "grace period over; closing remaining connections"
            ),
        }
    }
}

async fn accept_loop(
    listener: Arc<Listener>,
    socket: TcpListener,
    pipeline: Arc<ArcSwap<Pipeline>>,
    shared: Arc<Shared>,
    graceful: Arc<GracefulShutdown>,
    stop: CancellationToken,
) {
    let limit = Arc::new(Semaphore::new(listener.max_connections));
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(listener.header_read_timeout)
        // hyper's own limit is a backstop above ours: requests between the
        // two get the proxy's JSON 431 instead of hyper's bare one.
        .max_buf_size((listener.max_request_header_size * 2).max(16 * 1024))
        .max_headers(256);
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
        let permit = tokio::select! {
            p = limit.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return },
            _ = stop.cancelled() => return,
        };
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
        let conn = Arc::new(ConnInfo {
            client,
            listener: listener.clone(),
            tls: false,
        });
        serve_connection(
            stream, conn, &builder, &pipeline, &shared, &graceful, permit,
        );
    }
}

fn serve_connection(
    stream: TcpStream,
    conn: Arc<ConnInfo>,
    builder: &Arc<auto::Builder<TokioExecutor>>,
    pipeline: &Arc<ArcSwap<Pipeline>>,
    shared: &Arc<Shared>,
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
    shared.tracker.spawn(async move {
        if let Err(e) = served.await {
            tracing::debug!(client = %conn.client, error = %e, "connection ended with an error");
        }
        drop(permit);
    });
}
