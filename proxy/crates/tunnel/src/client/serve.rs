//! A tunnel's serving side: the HTTP/2 server (WebSocket) or QUIC streams the tunnel server's requests arrive on, each handled by the routing core's pipeline.

use super::*;
use portcullis_http::answers::ResetStream;

/// Serves HTTP/2 from the server over one tunnel until it ends; on drain,
/// stops taking new streams and lets those in flight finish.
///
/// Returns why the tunnel ended, for the reconnect log line: a reset, a
/// ping left unanswered (a dead peer) and a server that closed it cleanly
/// (restart, rotated token) call for different fixes.
pub(super) async fn serve(
    io: TokioIo<BoxIo>,
    slot: usize,
    dialer: &Arc<Dialer>,
    ctx: &WorkerContext,
) -> String {
    let service = service(slot, dialer, ctx, false);
    let conn = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        .initial_stream_window_size(crate::STREAM_WINDOW)
        .initial_connection_window_size(crate::CONNECTION_WINDOW)
        .max_concurrent_streams(crate::MAX_TUNNELED_STREAMS)
        .max_pending_accept_reset_streams(crate::MAX_TUNNELED_STREAMS as usize)
        .max_header_list_size(crate::MAX_TUNNELED_HEAD)
        // WebSocket upgrades arrive as extended CONNECT (RFC 8441).
        .enable_connect_protocol()
        .keep_alive_interval(crate::KEEPALIVE_INTERVAL)
        .keep_alive_timeout(crate::KEEPALIVE_TIMEOUT)
        .serve_connection(io, service);
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        r = conn.as_mut() => {
            return match r {
                Ok(()) => "the server closed the tunnel".into(),
                Err(e) => portcullis_forward::error_chain(&e),
            };
        }
        _ = ctx.stop.cancelled() => {}
        _ = dialer.give_up.cancelled() => {}
    }
    // Draining: GOAWAY, then the streams in flight run to their end.
    conn.as_mut().graceful_shutdown();
    let _ = conn.await;
    "draining".into()
}

/// Serves the requests of a QUIC tunnel, each on its own stream, until it
/// ends; on drain, tells the server (which then sends no new requests
/// here), lets those in flight finish and closes.
pub(super) async fn serve_quic(
    mut tunnel: crate::quic::ClientTunnel,
    slot: usize,
    dialer: &Arc<Dialer>,
    ctx: &WorkerContext,
) -> String {
    let service = service(slot, dialer, ctx, true);
    let streams = tokio_util::task::TaskTracker::new();
    let serve_next = |io| {
        let service = service.clone();
        streams.spawn(async move {
            if let Err(e) = crate::quic::serve_stream(io, service).await {
                tracing::debug!(slot, error = %e, "tunnel stream ended with an error");
            }
        });
    };
    loop {
        tokio::select! {
            io = tunnel.accept() => match io {
                Ok(io) => serve_next(io),
                Err(why) => return why,
            },
            _ = ctx.stop.cancelled() => break,
            _ = dialer.give_up.cancelled() => break,
        }
    }
    tunnel.drain();
    streams.close();
    // Requests the server sent before it heard are still served.
    loop {
        tokio::select! {
            io = tunnel.accept() => match io {
                Ok(io) => serve_next(io),
                Err(_) => break,
            },
            _ = streams.wait() => break,
        }
    }
    tunnel.close("draining").await;
    "draining".into()
}

/// The service a tunnel's requests are served with. The server pings as
/// soon as it has registered the tunnel: from then on public requests can
/// arrive, so that is when it counts as connected. `http1` when it serves
/// HTTP/1.1 (a QUIC stream), which declares trailers before sending them.
pub(super) fn service(
    slot: usize,
    dialer: &Arc<Dialer>,
    ctx: &WorkerContext,
    http1: bool,
) -> impl hyper::service::Service<
    Request<Incoming>,
    Response = Response<ResponseBody>,
    Error = ResetStream,
    Future = impl Future<Output = Result<Response<ResponseBody>, ResetStream>> + Send + 'static,
> + Clone
+ 'static {
    let connected = Arc::new(AtomicBool::new(false));
    let dialer = dialer.clone();
    let pipeline = ctx.pipeline.clone();
    let worker = ctx.worker;
    service_fn(move |req: Request<Incoming>| {
        if req.headers().contains_key(crate::CONTROL) {
            dialer.pinged(slot);
            if !connected.swap(true, Ordering::Relaxed) {
                tracing::info!(slot, server = %dialer.server(slot).1, runtime = %dialer.options.runtime_id, transport = if http1 { "quic" } else { "websocket" }, "tunnel connected");
            }
        }
        let dialer = dialer.clone();
        let pipeline = portcullis_http::pipeline::current(&pipeline);
        async move {
            let mut resp = handle(req, &dialer, &pipeline, worker).await;
            if http1 {
                crate::quic::declare_trailers(&mut resp);
            }
            // A plugin's reset resets the tunnelled stream.
            portcullis_http::answers::or_reset(resp)
        }
    })
}

pub(super) async fn handle(
    mut req: Request<Incoming>,
    dialer: &Dialer,
    pipeline: &portcullis_http::pipeline::Pipeline,
    worker: usize,
) -> Response<ResponseBody> {
    if let Some(what) = req.headers().get(crate::CONTROL) {
        if what == crate::REPLACED {
            dialer.replaced.store(true, Ordering::Relaxed);
            dialer.give_up.cancel();
        }
        let mut resp = Response::new(ResponseBody::new(
            Body::empty(),
            None,
            None,
            Default::default(),
        ));
        *resp.status_mut() = StatusCode::NO_CONTENT;
        return resp;
    }
    // The public client, as the tunnel server saw it.
    // Only for this hop: the upstream sees the address in X-Forwarded-For.
    let client = req
        .headers_mut()
        .remove(crate::CLIENT_ADDR)
        .as_ref()
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
    let conn = ConnInfo {
        client,
        client_ip: portcullis_forward::client_ip_header(client.ip()),
        listener: dialer.listener.clone(),
        tls: false,
        tls_version: None,
        sni: None,
        client_cert: None,
        worker,
        socket: None,
        alt_svc: None,
    };
    let Some(protocol) = req.extensions_mut().remove::<hyper::ext::Protocol>() else {
        return pipeline.handle(req, &conn).await;
    };
    // An extended CONNECT is a public client's HTTP/1.1 upgrade: hand the
    // routing core that upgrade request. The stream's own OnUpgrade stays
    // in the extensions, so the core splices the upstream to this stream
    // once it answers 200 here for the upstream's 101.
    let (mut parts, body) = req.into_parts();
    parts.method = http::Method::GET;
    parts.version = http::Version::HTTP_11;
    // An HTTP/1.1 request names its host in `Host`; the stream named it
    // in `:authority`.
    if let Some(authority) = parts.uri.authority()
        && !parts.headers.contains_key(http::header::HOST)
        && let Ok(host) = http::HeaderValue::from_str(authority.as_str())
    {
        parts.headers.insert(http::header::HOST, host);
    }
    match http::HeaderValue::from_str(protocol.as_str()) {
        Ok(v) => parts.headers.insert(http::header::UPGRADE, v),
        Err(_) => parts.headers.insert(
            http::header::UPGRADE,
            http::HeaderValue::from_static("websocket"),
        ),
    };
    parts.headers.insert(
        http::header::CONNECTION,
        http::HeaderValue::from_static("upgrade"),
    );
    let mut resp = pipeline
        .handle(Request::from_parts(parts, body), &conn)
        .await;
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        *resp.status_mut() = StatusCode::OK;
        resp.headers_mut().remove(http::header::CONNECTION);
        resp.headers_mut().remove(http::header::UPGRADE);
    }
    resp
}

/// A process's instance id: its start time in Unix milliseconds first
/// (the tunnel server keeps the newest client), then 64 random bits.
pub(crate) fn instance_id() -> String {
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis());
    format!("{started}-{random:016x}")
}
