//! The public side: public connections accepted and served as the routing core serves its own, and each request run through the core's phase driver (`portcullis_http::phases`), with the runtime's tunnel as its forward.

use super::*;

/// Time a public connection has to send a request head: its first from
/// the accept, a later one from its first byte (`head_deadline`). Idle
/// connections between requests have the keep-alive timeout.
pub(super) const PUBLIC_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

pub(super) async fn accept_public(
    (listener, tls, balance, mut inbox): (
        TcpListener,
        Option<tokio_rustls::TlsAcceptor>,
        Arc<Balance>,
        UnboundedReceiver<Handoff>,
    ),
    public: Public,
    tracker: TaskTracker,
    stop: CancellationToken,
) {
    let worker = public.worker;
    // Spread over the workers as the routing core's listeners are: the
    // kernel's hash alone can leave one worker most of a client's pool.
    let mut accepting = Accepting {
        socket: &listener,
        name: "public",
        balance: &balance,
        worker,
        inbox: &mut inbox,
    };
    while let Some((stream, peer, permit, counted)) = accepting
        .next(|| public.shared.public_slots.clone(), &stop)
        .await
    {
        let _ = stream.set_nodelay(true);
        if tls.is_none() && !public.shared.proxy_protocol {
            let served = public.serve(stream, peer, None);
            tracker.spawn(served.map(move |()| drop((permit, counted))));
            continue;
        }
        // The PROXY header and the handshake are read in the connection's
        // task, not the accept loop, under the same deadline as a first
        // request head (a client that opens a connection and says nothing
        // holds a slot no longer).
        let (public, tls, stop) = (public.clone(), tls.clone(), stop.clone());
        tracker.spawn(async move {
            let how = portcullis_http::connection::Opening {
                listener: "public",
                proxy_protocol: public.shared.proxy_protocol,
                tls: tls.as_ref().map(|t| (t, PLAIN_ON_HTTPS)),
            };
            let limit = PUBLIC_HEADER_READ_TIMEOUT;
            let opened =
                portcullis_http::connection::open_accepted(stream, peer, how, limit, &stop);
            match opened.await {
                Some((Opened::Tcp(stream), client)) => public.serve(stream, client, None).await,
                Some((Opened::Tls(stream), client)) => {
                    let version = stream.get_ref().1.protocol_version();
                    public.serve(*stream, client, version).await
                }
                None => {}
            }
            drop((permit, counted));
        });
    }
    // Connections handed to this worker and not yet taken close with the
    // inbox.
    drop(inbox);
    public.connections.shutdown().await;
}

/// What serving a public connection needs, one per worker.
#[derive(Clone)]
pub(crate) struct Public {
    pub(super) builder: Arc<portcullis_net::h1_or_h2::Builder>,
    pub(super) connections: portcullis_net::drain::Connections,
    pub(super) worker: usize,
    pub(super) shared: Arc<Shared>,
}

impl Public {
    pub(super) fn new(worker: usize, shared: Arc<Shared>) -> Public {
        let mut builder = portcullis_net::h1_or_h2::Builder::new();
        builder
            .http1
            .timer(TokioTimer::new())
            // As the routing core's listeners: no head clock of hyper's (a
            // timer armed and dropped per request); heads have
            // `head_deadline`'s, and idle connections are parked and closed
            // at the keep-alive timeout (`parked_for` below).
            .header_read_timeout(None)
            // The same bound as HTTP/2's (hyper's default was its ~400 KiB
            // read buffer).
            .max_header_size(crate::MAX_PUBLIC_HEAD as usize);
        // A parked idle connection has the rest of the keep-alive timeout.
        builder.parked_for = Some(
            portcullis_config::DEFAULT_KEEPALIVE_TIMEOUT
                .saturating_sub(portcullis_net::head_deadline::PARK_AFTER),
        );
        builder
            .http2
            .timer(TokioTimer::new())
            .max_header_list_size(crate::MAX_PUBLIC_HEAD)
            .initial_stream_window_size(crate::STREAM_WINDOW)
            .initial_connection_window_size(crate::CONNECTION_WINDOW);
        Public {
            builder: Arc::new(builder),
            connections: portcullis_net::drain::Connections::new(),
            worker,
            shared,
        }
    }

    /// The public connection cap's slots.
    pub(crate) fn slots(&self) -> Arc<tokio::sync::Semaphore> {
        self.shared.public_slots.clone()
    }

    /// One public request, on any HTTP version: sent through its runtime's
    /// tunnel, with an access line (its `upstream` the runtime's host) and
    /// the runtime's metrics written when the response body ends, as the
    /// routing core does.
    /// `tls` is the connection's TLS version, for the access line.
    pub(crate) async fn respond<B>(
        &self,
        req: Request<B>,
        peer: SocketAddr,
        tls: Option<rustls::ProtocolVersion>,
    ) -> Response<ResponseBody>
    where
        B: http_body::Body + Into<Body> + Send,
    {
        let origin = Origin::Public;
        respond(req, (peer, tls), self.worker, &self.shared, origin).await
    }

    /// Serves HTTP on one public connection (TCP, or TLS over it, of
    /// version `tls`) until it closes, as the routing core serves its
    /// listeners' connections (`portcullis_http::connection`).
    pub(super) fn serve<S>(
        &self,
        stream: S,
        peer: SocketAddr,
        tls: Option<rustls::ProtocolVersion>,
    ) -> impl Future<Output = ()> + use<S>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    {
        let public = self.clone();
        let service = move |requests: portcullis_http::connection::Requests| {
            portcullis_http::connection::InPlace(move |req: Request<Incoming>| {
                let finish = requests.start(req.version());
                let public = public.clone();
                // Boxed, unlike on the routing core's listeners: hyper
                // keeps a box the size of this future (~8 KiB) for the
                // connection's life, and this side faces the internet's
                // idle clients; the copy into a box per request is little
                // beside a tunnel's crossing.
                Box::pin(async move {
                    // Made inside the future, as on the routing core's.
                    let _waiting = portcullis_net::worker_idle::Busy::new();
                    finish.answer(public.respond(req, peer, tls).await)
                })
            })
        };
        let (max_requests, lifetime) = self.shared.public_connection_limits;
        let accepted = portcullis_http::connection::Accepted {
            builder: &self.builder,
            connections: &self.connections,
            listener: "public",
            client: peer,
            worker: self.worker,
            retire: portcullis_net::drain::Retire::new(max_requests, lifetime),
            header_read_timeout: PUBLIC_HEADER_READ_TIMEOUT,
        };
        portcullis_http::connection::serve(stream, accepted, service)
    }
}

/// Where a request to forward came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Origin {
    /// A public client: served through this server's tunnels, or passed
    /// on to a peer holding one.
    Public,
    /// Another replica that holds no tunnel of the runtime: served
    /// through this server's tunnels only, and not counted in the
    /// runtime's metrics here (the public side that took it counts it).
    Peer(SocketAddr),
}

/// A public or peer request's connection, as the phases see it.
pub(super) struct PublicConn {
    /// The client: the connection's peer, or for a peer's request the
    /// client it names.
    pub(super) client: SocketAddr,
    /// The connection's TLS version (`None` for a peer's request).
    pub(super) tls: Option<rustls::ProtocolVersion>,
    pub(super) worker: usize,
    pub(super) origin: Origin,
}

/// A request on any HTTP version, from the public or from a peer: sent
/// through its runtime's tunnel (or a peer) by the routing core's phase
/// driver, so its access line (its `upstream` the runtime's host; its
/// `route` the peer, when one took part), id, span, metrics and error
/// shapes are the core's.
pub(super) async fn respond<B>(
    req: Request<B>,
    (client, tls): (SocketAddr, Option<rustls::ProtocolVersion>),
    worker: usize,
    shared: &Shared,
    origin: Origin,
) -> Response<ResponseBody>
where
    B: http_body::Body + Into<Body> + Send,
{
    let conn = PublicConn {
        client,
        tls,
        worker,
        origin,
    };
    portcullis_http::phases::drive(shared, req, &conn).await
}

impl Phases for Shared {
    type Conn = PublicConn;

    fn entry<'c>(&self, conn: &'c PublicConn, _version: Version) -> Entry<'c> {
        Entry {
            client: conn.client,
            worker: conn.worker,
            // Passed in as a version, not its name: a `&'static str`
            // argument trips rustc's `Send` check of the spawned
            // connection future.
            tls_version: conn.tls.map(portcullis_net::tls_listen::version_name),
            client_cert: None,
            // Every public request gets its id here, at the edge (a
            // peer's carries the one its public side gave it).
            request_ids: RequestIds::Make,
            // The public side counts the request, not a peer that serves
            // it for the public side of another replica.
            counted: (conn.origin == Origin::Public).then(portcullis_obs::metrics::no_runtime),
            watch: None,
        }
    }

    fn trace(
        &self,
        conn: &PublicConn,
    ) -> Option<(
        &Arc<Tracing>,
        &Arc<UpstreamPool>,
        portcullis_obs::otlp::Arrival,
    )> {
        // The public edge: where a trace starts (or joins its client's).
        let (tracing, pool) = self.tracing.as_ref()?;
        let public = conn.origin == Origin::Public;
        let from = portcullis_obs::otlp::Arrival {
            peer: conn.client.ip(),
            // A peer's request names its client already.
            trust_forwarded: public && self.trust_forwarded_headers,
            https: conn.tls.is_some(),
            trust_traceparent: tracing.trust_incoming || !public,
        };
        Some((tracing, pool, from))
    }

    async fn serve<B>(
        &self,
        req: Request<B>,
        conn: &PublicConn,
        ctx: &mut RequestCtx,
    ) -> (Response<Body>, Held)
    where
        B: http_body::Body + Into<Body> + Send,
    {
        if let Some(log) = ctx.log.as_mut() {
            log.upstream = host_of(&req).map(Into::into);
            if let Origin::Peer(from) = conn.origin {
                log.route = Some(format!("from peer {from}").into());
            }
        }
        let mut via = None;
        let stats = (ctx.stats(), &mut via);
        let resp = forward(req, conn.client, conn.worker, self, conn.origin, stats).await;
        if let (Some(log), Some(peer)) = (ctx.log.as_mut(), via) {
            log.route = Some(format!("peer {peer}").into());
        }
        (resp, Held::default())
    }

    fn finish(&self, resp: &mut Response<Body>, version: Version, conn: &PublicConn) {
        // The routing core refused a body the client may still be
        // sending: close after the answer, lingering, as the core does on
        // its own listeners (`portcullis_net::linger`).
        if resp.status() == StatusCode::PAYLOAD_TOO_LARGE {
            portcullis_http::answers::close_after(resp, version);
        }
        if conn.origin == Origin::Public
            && version < Version::HTTP_3
            && let Some(alt_svc) = &self.alt_svc
        {
            resp.headers_mut().insert(header::ALT_SVC, alt_svc.clone());
        }
    }
}

/// Answers on the peer listener: a request a peer forwards, carrying the
/// client's address.
pub(super) async fn answer_peer(
    req: Request<Incoming>,
    from: SocketAddr,
    shared: Arc<Shared>,
    worker: usize,
) -> Response<ResponseBody> {
    let plain =
        |resp: Response<Body>| resp.map(|b| ResponseBody::new(b, None, None, Held::default()));
    let Some(peers) = &shared.peers else {
        return plain(crate::peers::refused());
    };
    if !peers.authentic(req.headers()) {
        // An address that presented wrong tokens again and again is
        // answered slowly and logged no more (see `peers::refusals`). A
        // real peer is never kept out: its token is good wherever it
        // comes from.
        if let Some(left) = peers.refusals.locked_out(from.ip()) {
            tokio::time::sleep(crate::peers::LOCKED_OUT_DELAY).await;
            return plain(crate::peers::locked_out(left));
        }
        use crate::peers::Failure;
        let (method, path) = (req.method(), req.uri().path());
        match peers.refusals.failed(from.ip()) {
            Failure::First => {
                tracing::warn!(from = %from, %method, path, "peer request refused: wrong or missing peer token")
            }
            Failure::Again => {
                tracing::debug!(from = %from, %method, path, "peer request refused: wrong or missing peer token")
            }
            Failure::LockedOut => {
                tracing::warn!(from = %from, "peer requests refused: {} wrong or missing peer tokens; this address is refused for {:?}", crate::peers::MAX_FAILURES, crate::peers::WINDOW)
            }
        }
        return plain(crate::peers::refused());
    }
    let for_runtime = req
        .uri()
        .host()
        .is_some_and(|h| h.to_ascii_lowercase().ends_with(&shared.suffix));
    if !for_runtime {
        return plain(error(StatusCode::NOT_FOUND, "not a peer endpoint", None));
    }
    let client = req
        .headers()
        .get(crate::CLIENT_ADDR)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(from);
    respond(req, (client, None), worker, &shared, Origin::Peer(from)).await
}
