//! The peer listener: requests other replicas forward, over TLS when set.

use super::*;

/// The answer to plain HTTP on a peer port that speaks TLS.
pub(super) const PLAIN_ON_PEER_TLS: &str = concat!(
    r#"{"error":"plain HTTP request sent to a peer port that speaks TLS (with peer certificates)","#,
    r#""status":400}"#
);

/// Serves the peer listener until `stop`: HTTP/2, over TLS with `tls`
/// (or HTTP/1.1, see below), with
/// extended CONNECT for forwarded WebSockets. Every connection is tracked
/// by `tracker`, and on a stop finishes its streams after a GOAWAY.
pub(crate) async fn listen<F, Fut>(
    listener: TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    answer: F,
    tracker: TaskTracker,
    stop: CancellationToken,
) where
    F: Fn(Request<Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: std::future::Future<Output = Response<portcullis_forward::ResponseBody>> + Send + 'static,
{
    // Peers speak HTTP/2; HTTP/1.1 is served too, only so that someone
    // trying the port by hand (curl) gets the 401 that says what it is,
    // not a closed connection.
    let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(crate::HANDSHAKE_TIMEOUT);
    builder
        .http2()
        .timer(TokioTimer::new())
        .enable_connect_protocol()
        .initial_stream_window_size(crate::STREAM_WINDOW)
        .initial_connection_window_size(crate::CONNECTION_WINDOW)
        .max_concurrent_streams(PEER_STREAMS)
        // See `MAX_TUNNELED_STREAMS`: a peer resets a stream for every
        // public request it forwarded whose client left.
        .max_pending_accept_reset_streams(PEER_STREAMS as usize)
        .max_header_list_size(crate::MAX_TUNNELED_HEAD)
        .keep_alive_interval(crate::KEEPALIVE_INTERVAL)
        .keep_alive_timeout(crate::KEEPALIVE_TIMEOUT);
    let builder = Arc::new(builder);
    loop {
        let (stream, from) = tokio::select! {
            _ = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(pair) => pair,
                Err(e) => {
                    tracing::warn!(error = %e, "peer listener accept failed");
                    // Out of descriptors, say: a pause instead of a spin.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = stream.set_nodelay(true);
        let answer = answer.clone();
        let service = hyper::service::service_fn(move |req| {
            let answer = answer.clone();
            async move { Ok::<_, std::convert::Infallible>(answer(req, from).await) }
        });
        let (builder, stop, tls) = (builder.clone(), stop.clone(), tls.clone());
        // The handshake runs in the connection's own task, so a slow or
        // silent client holds up nobody else.
        tracker.spawn(async move {
            let Some(tls) = tls else {
                return serve(&builder, stream, service, stop, from).await;
            };
            let handshake = portcullis_net::tls_listen::handshake(&tls, stream, PLAIN_ON_PEER_TLS);
            match tokio::time::timeout(crate::HANDSHAKE_TIMEOUT, handshake).await {
                Ok(Ok(stream)) => serve(&builder, stream, service, stop, from).await,
                // Not a peer (no certificate from the peer CA, or plain
                // HTTP): a configuration mistake worth seeing, or a probe.
                Ok(Err(refused)) => {
                    tracing::warn!(peer = %from, "peer connection refused: {refused}")
                }
                Err(_) => {
                    tracing::warn!(peer = %from, "peer connection refused: TLS handshake timed out")
                }
            }
        });
    }
}

/// One peer connection, served until it ends or `stop` (then its
/// streams finish after a GOAWAY).
pub(super) async fn serve<S, Svc>(
    builder: &hyper_util::server::conn::auto::Builder<TokioExecutor>,
    stream: S,
    service: Svc,
    stop: CancellationToken,
    from: SocketAddr,
) where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    Svc: hyper::service::Service<
            Request<Incoming>,
            Response = Response<portcullis_forward::ResponseBody>,
            Error = std::convert::Infallible,
        > + Send
        + 'static,
    Svc::Future: Send + 'static,
{
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    let mut connection = std::pin::pin!(connection);
    let ended = tokio::select! {
        ended = connection.as_mut() => ended,
        _ = stop.cancelled() => {
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(e) = ended {
        tracing::debug!(peer = %from, error = %e, "peer connection ended");
    }
}

/// The answer to a request on the peer listener without the group token.
pub(crate) fn refused() -> Response<Body> {
    portcullis_http::answers::json_response(
        StatusCode::UNAUTHORIZED,
        &serde_json::json!({
            "error": "not a peer of this tunnel server (wrong or missing peer token)",
            "status": 401,
        }),
    )
}

/// The answer to an address locked out for wrong peer tokens, for `left`
/// more.
pub(crate) fn locked_out(left: Duration) -> Response<Body> {
    let mut resp = portcullis_http::answers::json_response(
        StatusCode::TOO_MANY_REQUESTS,
        &serde_json::json!({
            "error": "too many wrong peer tokens from this address; try again later",
            "status": 429,
        }),
    );
    let secs = left.as_secs().max(1);
    resp.headers_mut()
        .insert(http::header::RETRY_AFTER, HeaderValue::from(secs));
    resp
}
