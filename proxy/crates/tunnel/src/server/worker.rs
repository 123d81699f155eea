//! One worker thread of the tunnel server: its public socket and the
//! tunnels handed to it, and what it is given at start and told at stop.

use super::*;

/// A worker's public side: its socket and TLS, the balance over the
/// workers' sockets with its inbox of connections handed over, the
/// HTTP/3 connections handed to it, and its peer listener socket.
pub(super) struct PublicSide {
    pub(super) listener: std::net::TcpListener,
    pub(super) tls: Option<tokio_rustls::TlsAcceptor>,
    pub(super) balance: Arc<Balance>,
    pub(super) inbox: UnboundedReceiver<Handoff>,
    pub(super) h3: Option<UnboundedReceiver<portcullis_http::http3::Handed>>,
    pub(super) peer: Option<std::net::TcpListener>,
}

/// What only the first worker gets.
pub(super) struct FirstWorker {
    /// The public HTTP/3 endpoint (`--http3`), with where to hand each
    /// connection it accepts: every worker, in turn.
    pub(super) h3: Option<(
        std::net::UdpSocket,
        quinn::ServerConfig,
        Vec<tokio::sync::mpsc::UnboundedSender<portcullis_http::http3::Handed>>,
    )>,
    /// Where the worker sends its runtime, which the tunnel QUIC endpoint
    /// is registered with.
    pub(super) runtime: tokio::sync::oneshot::Sender<tokio::runtime::Handle>,
    /// Cancelled once the other workers are done: until then, this
    /// worker keeps driving the endpoint's socket.
    pub(super) release: CancellationToken,
}

/// What stops a tunnel server, in order.
#[derive(Clone, Default)]
pub(super) struct Stops {
    /// The public side: no new connections, those open finish.
    pub(super) public: CancellationToken,
    /// The tunnels, once the public side is done with them.
    pub(super) tunnels: CancellationToken,
}

/// One worker thread: its public socket (with the balance over the
/// workers' sockets and its inbox, and the HTTP/3 connections handed to
/// it), and the tunnels handed to it. Says `drained` once its public side
/// is done after a stop.
pub(super) fn worker(
    index: usize,
    PublicSide {
        listener: public,
        tls: public_tls,
        balance,
        inbox,
        h3: h3_inbox,
        peer,
    }: PublicSide,
    first: Option<FirstWorker>,
    mut tunnels: UnboundedReceiver<Arrival>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shared: Arc<Shared>,
    (stops, drained): (Stops, tokio::sync::oneshot::Sender<()>),
) {
    let stop = stops.public;
    portcullis_net::shard::claim(index);
    let runtime = match portcullis_net::worker_idle::runtime().build() {
        Ok(rt) => rt,
        Err(e) => {
            tracing::error!(worker = index, error = %e, "cannot start worker runtime");
            return;
        }
    };
    let (h3, release) = match first {
        Some(first) => {
            let _ = first.runtime.send(runtime.handle().clone());
            (first.h3, Some(first.release))
        }
        None => (None, None),
    };
    runtime.block_on(async move {
        tokio::spawn(portcullis_http::server::timer_anchor(
            shared.heartbeats.clone(),
            index,
        ));
        let tracker = TaskTracker::new();
        let tunnel_tasks = TaskTracker::new();
        let serving = Public::new(index, shared.clone());
        if let Some((socket, config, workers)) = h3 {
            tracker.spawn(public_h3::accept(
                socket,
                config,
                serving.slots(),
                workers,
                stop.clone(),
            ));
        }
        if let Some(h3_inbox) = h3_inbox {
            tracker.spawn(public_h3::serve(h3_inbox, serving.clone(), stop.clone()));
        }
        // Requests peers forward: served here as this worker's public
        // ones are, through its tunnels when it drives any of the
        // runtime's; drained with the public side.
        if let Some(listener) = peer {
            match TcpListener::from_std(listener) {
                Ok(listener) => {
                    let tls = shared.peers.as_ref().and_then(|p| p.tls.as_ref());
                    let tls = tls.map(|t| t.acceptor.clone());
                    let shared = shared.clone();
                    let answer = move |req, from| answer_peer(req, from, shared.clone(), index);
                    tracker.spawn(crate::peers::listen(
                        listener,
                        tls,
                        answer,
                        tracker.clone(),
                        stop.clone(),
                    ));
                }
                Err(e) => {
                    tracing::error!(worker = index, error = %e, "cannot register the peer listener")
                }
            }
        }
        match TcpListener::from_std(public) {
            Ok(public) => {
                tracker.spawn(accept_public(
                    (public, public_tls, balance, inbox),
                    serving,
                    tracker.clone(),
                    stop.clone(),
                ));
            }
            Err(e) => {
                tracing::error!(worker = index, error = %e, "cannot register the public listener")
            }
        }
        loop {
            let arrival = tokio::select! {
                t = tunnels.recv() => match t { Some(t) => t, None => break },
                _ = stop.cancelled() => break,
            };
            let (stream, peer) = match arrival {
                Arrival::Tcp(stream, peer) => (stream, peer),
                Arrival::Quic(incoming) => {
                    // Accepted here, so the connection is driven by this
                    // worker's thread.
                    tunnel_tasks.spawn(serve_quic_tunnel(
                        *incoming,
                        index,
                        shared.clone(),
                        stops.tunnels.clone(),
                    ));
                    continue;
                }
            };
            match TcpStream::from_std(stream) {
                Ok(stream) => {
                    tunnel_tasks.spawn(serve_tunnel(
                        stream,
                        peer,
                        index,
                        tls.clone(),
                        shared.clone(),
                        stops.tunnels.clone(),
                    ));
                }
                Err(e) => {
                    tracing::warn!(peer = %peer, error = %e, "cannot register a tunnel connection")
                }
            }
        }
        tracker.close();
        tracker.wait().await;
        if shared.tracing.is_some() {
            // The spans of this worker's last public requests.
            portcullis_obs::otlp::flush_and_wait().await;
        }
        let _ = drained.send(());
        tunnel_tasks.close();
        tunnel_tasks.wait().await;
        if let Some(release) = release {
            release.cancelled().await;
        }
    });
}
