//! A worker thread: its runtime, its listeners' accept loops, and each accepted connection (PROXY header, TLS) handed to the shared connection server.

use super::*;
use portcullis_net::coarse_deadline;
use portcullis_net::worker_beat::Heartbeats;

/// One worker thread's share of the server.
pub(super) struct Worker {
    pub(super) index: usize,
    pub(super) pipeline: Arc<ArcSwap<Pipeline>>,
    pub(super) shared: Arc<Shared>,
    pub(super) stop_accepting: CancellationToken,
    pub(super) abort: CancellationToken,
}

impl Worker {
    pub(super) fn run(self, mut commands: mpsc::UnboundedReceiver<WorkerCommand>) {
        // The slot its plugins' VMs and instances were made for.
        portcullis_net::shard::claim(self.index);
        let runtime = match portcullis_net::worker_idle::runtime().build() {
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
            tokio::spawn(timer_anchor(self.shared.heartbeats.clone(), self.index));
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
///
/// Each tick is also the worker's heartbeat (`worker_beat`): a worker
/// whose thread something blocks stops beating, and readiness says so;
/// and it wakes the worker's long waits that have ended
/// (`coarse_deadline`: requests' upstream timeouts). For a worker's
/// one-thread runtime: the waits are the thread's.
pub async fn timer_anchor(beats: Arc<Heartbeats>, worker: usize) {
    // At once: the interval's first tick waits for the timer driver, and
    // a worker blocked before that must count as started. A wait begun
    // before this keeps tokio's timer.
    beats.beat(worker);
    coarse_deadline::keep_here();
    let mut tick = tokio::time::interval(ANCHOR_PERIOD);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        beats.beat(worker);
        coarse_deadline::tick();
    }
}

pub(super) const ANCHOR_PERIOD: Duration = portcullis_net::worker_beat::BEAT_EVERY;

/// The HTTP server settings of a listener.
pub(super) fn http_builder(listener: &Listener) -> h1_or_h2::Builder {
    let mut builder = h1_or_h2::Builder::new();
    builder
        .http1
        // One flattened write per response beats writev for small messages
        // (see the upstream side in portcullis-forward's pool.rs).
        .writev(false)
        // Without this, hyper reads the socket right after handing over
        // each request, to notice a client that leaves mid-request, and
        // reallocates its read buffer to do so; `client_watch` notices it
        // instead, only for requests still open after a while.
        .half_close(true)
        .timer(TokioTimer::new())
        // No head clock of hyper's: it would arm and drop a timer for
        // every request (~700 instructions). A head's deadline is
        // `head_deadline::within`'s, and an idle connection is parked
        // (`Within::parking`) and closed by `h1_or_h2` at the keep-alive
        // timeout (`parked_for` below), with one timer per connection.
        .header_read_timeout(None)
        // hyper's own limit is a backstop above ours: requests between the
        // two get the proxy's JSON 431 instead of hyper's bare one.
        .max_header_size(listener.max_request_header_size * 2)
        // Sized for bodies: each read of an upload takes up to this much
        // (the head bound is the line above).
        .max_buf_size(READ_BUFFER.max(listener.max_request_header_size * 2));
    // Parked after PARK_AFTER at least: the rest of the timeout, or up to
    // PARK_AFTER more.
    builder.parked_for = Some(
        listener
            .keepalive_timeout
            .saturating_sub(portcullis_net::head_deadline::PARK_AFTER),
    );
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
pub(super) const MAX_STREAMS: u32 = 1024;

/// The most an HTTP/1 connection reads from its client at once. At
/// 64 KiB (when it also bounded heads), uploads took 29% more CPU, and
/// chunked ones 47% more, than at this size (bench/HISTORY.md, "Large
/// bodies"): hyper's read buffer cannot be reused while the body's
/// chunks are queued to the upstream, and smaller reads mean more of them.
pub(super) const READ_BUFFER: usize = 256 * 1024;

/// Accepts on one worker's socket of a listener until `stop`, then lets
/// the connections it accepted finish their requests.
pub(super) async fn accept_loop(
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
        if !current.spec.proxy_protocol && current.tls.is_none() {
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
            let how = crate::connection::Opening {
                listener: &current.spec.name,
                proxy_protocol: current.spec.proxy_protocol,
                tls: current.tls.as_ref().map(|t| (&t.acceptor, PLAIN_ON_HTTPS)),
            };
            let limit = current.spec.header_read_timeout;
            let opened = crate::connection::open_accepted(stream, client, how, limit, &stop);
            let Some((opened, client)) = opened.await else {
                return;
            };
            let served = (&pipeline, &tracker_, &connections);
            match opened {
                Opened::Tcp(stream) => {
                    let socket = ClientSocket::of(&stream);
                    let conn = (stream, socket, None);
                    serve_connection(conn, client, &current, worker, served, (permit, counted));
                }
                Opened::Tls(stream) => {
                    let socket = ClientSocket::of(stream.get_ref().0);
                    let facts = portcullis_net::tls_listen::ClientFacts::of(&stream);
                    let conn = (*stream, socket, Some(facts));
                    serve_connection(conn, client, &current, worker, served, (permit, counted));
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
pub(super) const PLAIN_ON_HTTPS: &str = concat!(
    r#"{"error":"plain HTTP request sent to the HTTPS port: use https://","#,
    r#""status":400,"route":null}"#
);

/// Serves HTTP on an accepted connection from `client` (the peer, or the
/// address its PROXY header gave) in a task of its own: the stream, its
/// socket, and for TLS what its handshake told.
pub(super) fn serve_connection<S>(
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
        client_ip: portcullis_forward::client_ip_header(client.ip()),
        listener: settings.spec.clone(),
        tls: tls.is_some(),
        tls_version: tls.as_ref().and_then(|t| t.version),
        sni: tls.as_ref().and_then(|t| t.sni.clone()),
        client_cert: tls.and_then(|t| t.client_cert),
        worker,
        socket: Some(socket),
        alt_svc: settings.alt_svc.clone(),
    });
    let pipeline = pipeline.clone();
    let service_conn = conn.clone();
    let service = move |requests: crate::connection::Requests| {
        crate::connection::InPlace(move |req: Request<Incoming>| {
            let finish = requests.start(req.version());
            // Each request takes the pipeline current at its arrival; a
            // reload swaps it under keep-alive connections without
            // touching requests already in flight.
            let pipeline = crate::pipeline::current(&pipeline);
            let conn = service_conn.clone();
            // Not boxed, unlike on the tunnel server's public side: hyper
            // keeps a box the size of this future (~5 KiB) for the
            // connection's life, but boxing it per request cost 2.5% more
            // instructions per request (the future is copied into its
            // box), and behind an ingress the connections are few and busy.
            async move {
                // Made inside the future, not carried into it: a field
                // with a destructor in the future's first state kept it
                // from being built in hyper's box in place (a 5 KiB copy,
                // ~630 instructions a request).
                let _waiting = portcullis_net::worker_idle::Busy::new();
                finish.answer(pipeline.handle(req, &conn).await)
            }
        })
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
    let served = crate::connection::serve(stream, accepted, service);
    tracker.spawn(served.map(move |()| drop(held)));
}

/// A connection's listener name, held through its `ConnInfo`.
pub(super) struct ListenerName(Arc<ConnInfo>);

impl AsRef<str> for ListenerName {
    fn as_ref(&self) -> &str {
        &self.0.listener.name
    }
}
