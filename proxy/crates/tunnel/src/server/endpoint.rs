//! The tunnel endpoint: tunnel clients connecting (WebSocket or QUIC), their hello and token checked, each tunnel run until it ends, and its round trip measured.

use super::*;

/// A tunnel connection handed to a worker.
pub(super) enum Arrival {
    /// A TCP connection (WebSocket).
    Tcp(std::net::TcpStream, SocketAddr),
    /// A QUIC connection, not yet accepted (boxed: it is large, and rare
    /// next to the channel's other messages).
    Quic(Box<quinn::Incoming>),
}

/// Accepts tunnel connections (TCP, and QUIC when on) and hands them to
/// the workers in turn, so each worker drives its share of the tunnels.
pub(super) async fn accept_tunnels(
    listener: TcpListener,
    quic: Option<quinn::Endpoint>,
    workers: Vec<tokio::sync::mpsc::UnboundedSender<Arrival>>,
    stop: CancellationToken,
) {
    let mut next = 0;
    loop {
        let arrival = tokio::select! {
            (stream, peer) = portcullis_net::sockets::accept(&listener, "tunnel") => {
                let _ = stream.set_nodelay(true);
                let Ok(stream) = stream.into_std() else {
                    continue;
                };
                Arrival::Tcp(stream, peer)
            }
            Some(incoming) = async { quic.as_ref()?.accept().await } => Arrival::Quic(Box::new(incoming)),
            _ = stop.cancelled() => return,
        };
        next = (next + 1) % workers.len();
        if workers[next].send(arrival).is_err() {
            return;
        }
    }
}

/// Decides on a client's [`Hello`] from `peer`: a valid runtime id and
/// its token, within the failed-attempt rate limit; the token's hash when
/// accepted.
pub(super) fn check_hello(
    shared: &Shared,
    peer: SocketAddr,
) -> impl FnOnce(&Hello) -> Result<[u8; 32], Refused> + Unpin + '_ {
    move |hello: &Hello| {
        let refused = |status, message, reason| Refused {
            status,
            message,
            reason,
        };
        if !valid_runtime_id(&hello.runtime) {
            return Err(refused(
                StatusCode::BAD_REQUEST,
                "invalid runtime id",
                format!("invalid runtime id {:?}", hello.runtime),
            ));
        }
        shared
            .tokens
            .verify(peer.ip(), &hello.runtime, &hello.token)
            .map_err(|r| match r {
                Refusal::BadCredentials => refused(
                    StatusCode::UNAUTHORIZED,
                    "bad credentials",
                    format!("bad credentials for runtime `{}`", hello.runtime),
                ),
                Refusal::RateLimited => refused(
                    StatusCode::TOO_MANY_REQUESTS,
                    "too many failed attempts",
                    format!("too many failed attempts (runtime `{}`)", hello.runtime),
                ),
            })
    }
}

/// One WebSocket tunnel connection: handshake, authentication, then
/// HTTP/2 over the WebSocket until it ends.
pub(super) async fn serve_tunnel(
    mut stream: TcpStream,
    mut peer: SocketAddr,
    worker: usize,
    tls: Option<tokio_rustls::TlsAcceptor>,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    // The PROXY header and the handshake share one deadline.
    let deadline = tokio::time::Instant::now() + crate::HANDSHAKE_TIMEOUT;
    if shared.tunnel_proxy_protocol {
        let header = portcullis_net::proxy_protocol::read(&mut stream);
        match tokio::time::timeout_at(deadline, header).await {
            Ok(Ok(source)) => peer = source.unwrap_or(peer),
            Ok(Err(e)) => {
                portcullis_obs::metrics::count_connection_error("tunnel", "proxy_protocol");
                tracing::warn!(peer = %peer, error = %e, "tunnel connection refused");
                return;
            }
            Err(_) => {
                tracing::warn!(peer = %peer, "tunnel connection refused: no PROXY protocol header within 10s");
                return;
            }
        }
    }
    // Boxed, as the HTTP/2 handshake below: a future holds room for its
    // largest state for as long as it lives, and this task lives as long
    // as the tunnel, idle for most of it.
    let accepted = Box::pin(crate::websocket::accept(
        stream,
        tls,
        check_hello(&shared, peer),
    ));
    let (io, hello, token) = match tokio::time::timeout_at(deadline, accepted).await {
        Ok(Ok(done)) => done,
        Ok(Err(crate::websocket::NotATunnel::HealthCheck)) => {
            tracing::debug!(peer = %peer, "health check on the tunnel port");
            return;
        }
        Ok(Err(crate::websocket::NotATunnel::Refused(e))) => {
            tracing::warn!(peer = %peer, error = %e, "tunnel connection refused");
            return;
        }
        Err(_) => {
            tracing::warn!(peer = %peer, "tunnel connection refused: no handshake within 10s");
            return;
        }
    };
    let handshake = Box::pin(
        crate::h2_client()
            .keep_alive_while_idle(true)
            .handshake::<_, Body>(TokioIo::new(io)),
    )
    .await;
    let (sender, conn) = match handshake {
        Ok(pair) => pair,
        Err(e) => {
            tracing::warn!(peer = %peer, runtime = hello.runtime, error = %e, "tunnel HTTP/2 handshake failed");
            return;
        }
    };
    let ended = async move {
        match conn.await {
            Ok(()) => End::Closed,
            // With its causes: hyper names only its own layer.
            Err(e) => End::Lost(portcullis_forward::error_chain(&e)),
        }
    };
    run_tunnel(
        Sender::H2(sender),
        hello,
        token,
        peer,
        worker,
        &shared,
        stop,
        ended,
    )
    .await;
}

/// One QUIC tunnel connection: handshake and authentication on its
/// control stream, then a stream per request until it ends.
pub(super) async fn serve_quic_tunnel(
    incoming: quinn::Incoming,
    worker: usize,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    let peer = incoming.remote_address();
    let accepted = Box::pin(crate::quic::accept(incoming, check_hello(&shared, peer)));
    let (tunnel, control, hello, token) = match tokio::time::timeout(
        crate::HANDSHAKE_TIMEOUT,
        accepted,
    )
    .await
    {
        Ok(Ok(done)) => done,
        Ok(Err(e)) => {
            tracing::warn!(peer = %peer, error = %e, "QUIC tunnel connection refused");
            return;
        }
        Err(_) => {
            tracing::warn!(peer = %peer, "QUIC tunnel connection refused: no handshake within 10s");
            return;
        }
    };
    let sender = Sender::Quic(tunnel.clone());
    let ended = async move {
        tokio::select! {
            closed = tunnel.closed() => match closed {
                Ok(()) => End::Closed,
                Err(why) => End::Lost(why),
            },
            _ = control.draining() => End::Draining,
        }
    };
    run_tunnel(sender, hello, token, peer, worker, &shared, stop, ended).await;
}

/// How a tunnel's connection ended, or that its client is draining.
pub(super) enum End {
    /// Closed cleanly by the client.
    Closed,
    /// Broken: why.
    Lost(String),
    /// The client takes no new requests; those in flight go on until it
    /// closes the connection.
    Draining,
}

/// A tunnel from its authentication to its end: registered for its
/// runtime (replacing what it replaces), pinged, and removed when `ended`
/// completes, its client stops answering pings, the server closes it or
/// the server stops.
#[allow(clippy::too_many_arguments)]
pub(super) async fn run_tunnel(
    sender: Sender,
    hello: Hello,
    token: [u8; 32],
    peer: SocketAddr,
    worker: usize,
    shared: &Shared,
    stop: CancellationToken,
    ended: impl Future<Output = End>,
) {
    let (runtime, instance, slot) = (hello.runtime, hello.instance, hello.slot);
    let transport = sender.transport();
    let tunnel = Arc::new(Tunnel {
        id: shared.registry.next_id.fetch_add(1, Ordering::Relaxed),
        instance,
        slot,
        worker,
        token,
        remote: peer,
        since: SystemTime::now(),
        sender,
        rtt_us: AtomicU64::new(0),
        active: AtomicUsize::new(0),
        stats: portcullis_obs::metrics::runtime(&runtime),
        closed: CancellationToken::new(),
    });
    // A newer client of the runtime holds it on another server: this
    // one is turned away as it would be here.
    let newer_elsewhere = shared
        .peers
        .as_ref()
        .is_some_and(|p| p.newer_elsewhere(&runtime, &tunnel.instance));
    let Added { replaced, stale } = if newer_elsewhere {
        Added {
            replaced: vec![tunnel.clone()],
            stale: Vec::new(),
        }
    } else {
        shared.registry.add(&runtime, tunnel.clone())
    };
    if !replaced.iter().any(|t| t.id == tunnel.id) {
        tracing::info!(runtime, peer = %peer, slot, transport, worker, "tunnel connected");
    }
    for old in stale {
        tracing::info!(runtime, old = %old.remote, new = %peer, slot, "client dialled this slot again; closing its previous tunnel");
        old.closed.cancel();
    }
    close_replaced(replaced, &runtime, &peer.to_string());
    // Ends when the client stops answering or its token is no longer
    // valid; the select below then drops the connection.
    let pings = measure_rtt(tunnel.clone(), shared, &runtime);
    let mut draining = false;
    tokio::select! {
        end = ended => match end {
            End::Closed => tracing::info!(runtime, peer = %peer, "tunnel closed"),
            End::Lost(e) => tracing::warn!(runtime, peer = %peer, error = %e, "tunnel lost"),
            End::Draining => draining = true,
        },
        _ = pings => {}
        _ = tunnel.closed.cancelled() => tracing::info!(runtime, peer = %peer, "tunnel closed by the server"),
        _ = stop.cancelled() => {}
    }
    shared.registry.remove(&runtime, tunnel.id);
    if let Sender::Quic(quic) = &tunnel.sender {
        if draining {
            tracing::info!(runtime, peer = %peer, "tunnel client draining; sending it no new requests");
            tokio::select! {
                closed = quic.closed() => match closed {
                    Ok(()) => tracing::info!(runtime, peer = %peer, "tunnel closed"),
                    Err(e) => tracing::warn!(runtime, peer = %peer, error = %e, "tunnel lost"),
                },
                _ = tunnel.closed.cancelled() => {}
                _ = stop.cancelled() => {}
            }
        }
        // A QUIC connection lives while any handle does (requests in
        // flight hold some); the others are cut off like HTTP/2's.
        quic.close("closed by the server");
    }
}

/// Tells the clients behind `old` that another client (`by`) took over
/// `runtime`, and closes their tunnels.
pub(super) fn close_replaced(old: Vec<Arc<Tunnel>>, runtime: &str, by: &str) {
    for old in old {
        tracing::warn!(runtime, old = %old.remote, new = by, "another client took over this runtime; closing the older client's tunnel");
        tokio::spawn(async move {
            let _ = control(&old, crate::REPLACED).await;
            old.closed.cancel();
        });
    }
}

/// Sends a control request to the client behind `tunnel`.
pub(super) async fn control(tunnel: &Tunnel, what: &'static str) -> Result<(), String> {
    let req = Request::builder()
        .uri("http://tunnel/_portcullis/control")
        .header(crate::CONTROL, what)
        .body(Body::empty())
        .map_err(|e| e.to_string())?;
    let resp = tokio::time::timeout(crate::KEEPALIVE_TIMEOUT, tunnel.sender.send(req))
        .await
        .map_err(|_| "no answer".to_owned())??;
    if resp.status().is_success() {
        Ok(())
    } else {
        Err(format!("answered {}", resp.status()))
    }
}

/// Measures the round trip every keep-alive interval (shown on the admin
/// endpoint); returns when the client stops answering, or when the
/// runtime's token was rotated or removed from the tokens file.
pub(super) async fn measure_rtt(tunnel: Arc<Tunnel>, shared: &Shared, runtime: &str) {
    loop {
        if shared.tokens.current(runtime) != Some(tunnel.token) {
            tracing::warn!(runtime, peer = %tunnel.remote, "the runtime's token changed in the tokens file; closing its tunnel");
            return;
        }
        let start = Instant::now();
        match control(&tunnel, "ping").await {
            Ok(()) => tunnel
                .rtt_us
                .store(start.elapsed().as_micros() as u64, Ordering::Relaxed),
            Err(e) => {
                tracing::warn!(runtime, peer = %tunnel.remote, error = %e, "tunnel ping failed; closing it");
                return;
            }
        }
        tokio::time::sleep(crate::KEEPALIVE_INTERVAL).await;
    }
}
