//! A public request's forward: through its runtime's tunnel here, or a peer replica holding one; WebSocket upgrades spliced through.

use super::*;
use portcullis_http::body::BodyProgress;

/// Where a request goes: one of this server's tunnels, or the peers that
/// hold one, in the order to try them.
pub(super) enum Target {
    Tunnel(Arc<Tunnel>),
    Peers(Vec<Arc<crate::peers::Link>>),
}

/// A known runtime with no tunnel here, nor a peer to reach one through.
pub(super) fn not_connected(runtime: &str) -> Response<Body> {
    error(
        StatusCode::SERVICE_UNAVAILABLE,
        "runtime is not connected",
        Some(runtime),
    )
}

/// The public request's host, lower case, without port (`None` for a
/// request whose host is missing or ambiguous: [`request_head::request_host`]).
pub(super) fn host_of<B>(req: &Request<B>) -> Option<String> {
    request_head::request_host(req.version(), req.uri(), req.headers())
        .ok()
        .flatten()
        .map(Cow::into_owned)
}

/// The proxy's JSON error, about a runtime: `{"error", "status", "runtime"}`.
pub(super) fn error(status: StatusCode, message: &str, runtime: Option<&str>) -> Response<Body> {
    portcullis_http::answers::json_error_about(status, message, ("runtime", runtime), None)
}

/// Sends a request through its runtime's tunnel, or to a peer that holds
/// one when this server holds none and the request is public; `stats` is
/// set to the runtime's metrics once the runtime is known, `via` to the
/// peer it went to.
pub(super) async fn forward<B>(
    mut req: Request<B>,
    peer: SocketAddr,
    worker: usize,
    shared: &Shared,
    origin: Origin,
    (stats, via): (&mut &'static RouteStats, &mut Option<String>),
) -> Response<Body>
where
    B: http_body::Body + Into<Body>,
{
    let (host, target) = match admit(&req, peer, worker, shared, origin, stats) {
        Ok(admitted) => admitted,
        Err(refused) => return refused,
    };
    let runtime = &host[..host.len() - shared.suffix.len()];
    let upgrade = upgrade_of(&req, origin);
    let public_upgrade = upgrade.as_ref().map(|_| hyper::upgrade::on(&mut req));
    let Some(mut req) = through_tunnel(req, (peer, shared, origin), &host, upgrade.as_ref()) else {
        return error(StatusCode::BAD_REQUEST, "bad request target", Some(runtime));
    };
    let request_id = req
        .headers()
        .get(portcullis_obs::request_id::HEADER)
        .cloned();
    // Watched for the client breaking its body's framing, which the
    // tunnel's send reports as its own failure.
    let progress = req.body_mut().track();
    // Counted once, where the public reached, as the request is.
    if origin == Origin::Public {
        req.body_mut().count_into(stats);
    }
    let result = match &target {
        Target::Tunnel(tunnel) => {
            let _counted = crate::Active::count(&tunnel.active);
            tunnel.sender.send(req).await
        }
        Target::Peers(holders) => {
            let Some(peers) = &shared.peers else {
                return not_connected(runtime);
            };
            peers.stamp(req.headers_mut());
            // The first holder that takes a connection gets the request;
            // one that does not (it died since the last poll) has been
            // sent nothing, so the next can be tried, whatever the body.
            let mut sent = None;
            for link in holders {
                match link.ready().await {
                    Ok(sender) => {
                        *via = Some(link.addr.clone());
                        sent = Some(link.forward(sender, req).await);
                        break;
                    }
                    Err(e) => peers.lost(&link.addr, &e),
                }
            }
            match sent {
                Some(result) => result,
                None => return not_connected(runtime),
            }
        }
    };
    match result {
        Ok(resp) => answer(
            resp,
            (public_upgrade, upgrade),
            (origin, &shared.upgrades),
            runtime,
        ),
        // The client's 400, as the routing core answers it; the runtime
        // got a cut request.
        Err(_) if progress.as_deref().is_some_and(BodyProgress::malformed) => error(
            StatusCode::BAD_REQUEST,
            "request body could not be read",
            Some(runtime),
        ),
        Err(e) => failed(&target, &e, runtime, request_id.as_ref(), via.as_deref()),
    }
}

/// Where a request to `host` goes, once its host names a runtime that is
/// known, connected (here or on a peer) and within the rate limit: its
/// host and target, or the answer that refuses it.
#[allow(clippy::result_large_err)] // the refusal is answered at once, not carried
fn admit<B>(
    req: &Request<B>,
    peer: SocketAddr,
    worker: usize,
    shared: &Shared,
    origin: Origin,
    stats: &mut &'static RouteStats,
) -> Result<(String, Target), Response<Body>>
where
    B: http_body::Body,
{
    let host = match request_head::admit_head(req.version(), req.uri(), req.headers(), req.body()) {
        Ok(Some(host)) => host.into_owned(),
        Ok(None) => return Err(error(StatusCode::BAD_REQUEST, "request has no host", None)),
        Err(refused) => return Err(error(refused.status(), refused.message(), None)),
    };
    let Some(runtime) = host.strip_suffix(&shared.suffix) else {
        return Err(error(
            StatusCode::NOT_FOUND,
            &format!("{host} is not a runtime under this tunnel's domain"),
            None,
        ));
    };
    if !valid_runtime_id(runtime) {
        return Err(error(StatusCode::NOT_FOUND, "not a runtime host", None));
    }
    let tunnel = shared.registry.pick(runtime, worker);
    let holders = match (&tunnel, origin, &shared.peers) {
        (None, Origin::Public, Some(peers)) => peers.holders(runtime, worker),
        _ => Vec::new(),
    };
    let target = match tunnel {
        Some(tunnel) => {
            *stats = tunnel.stats;
            Target::Tunnel(tunnel)
        }
        None if !holders.is_empty() => {
            *stats = portcullis_obs::metrics::runtime(runtime);
            Target::Peers(holders)
        }
        None if shared.tokens.knows(runtime) => {
            *stats = portcullis_obs::metrics::runtime(runtime);
            return Err(not_connected(runtime));
        }
        None => {
            return Err(error(
                StatusCode::BAD_GATEWAY,
                "unknown runtime",
                Some(runtime),
            ));
        }
    };
    // Counted once, where the public reached: a peer does not count a
    // request again. Only known, connected runtimes get this far, so the
    // 429 is in the runtime's metrics.
    if origin == Origin::Public
        && let Some(limit) = &shared.rate_limit
    {
        let mut buf = [0u8; 16];
        let trust = shared.trust_forwarded_headers;
        if let Err(wait) = limit.take(limit.key_of((peer.ip(), trust), req.headers(), &mut buf)) {
            let mut resp = error(
                StatusCode::TOO_MANY_REQUESTS,
                "rate limit exceeded",
                Some(runtime),
            );
            portcullis_http::rate_limit::retry_after(resp.headers_mut(), wait);
            return Err(resp);
        }
    }
    Ok((host, target))
}

/// The protocol a request upgrades to, if it does. An HTTP/1.1 upgrade
/// (WebSocket) crosses the tunnel as an HTTP/2 extended CONNECT (RFC
/// 8441) whose stream then carries the bytes; a peer passes one on in
/// that shape already.
fn upgrade_of<B>(req: &Request<B>, origin: Origin) -> Option<HeaderValue> {
    match origin {
        Origin::Public => portcullis_http::forward::is_websocket_upgrade(req.headers())
            .then(|| req.headers().get(header::UPGRADE).cloned())
            .flatten(),
        Origin::Peer(_) => (req.method() == http::Method::CONNECT)
            .then(|| req.extensions().get::<hyper::ext::Protocol>())
            .flatten()
            .and_then(|p| HeaderValue::from_str(p.as_str()).ok()),
    }
}

/// The request as it crosses the tunnel: HTTP/2 to `host` (an upgrade as
/// an extended CONNECT), its hop-by-hop and tunnel-only headers gone, the
/// client's address and `X-Forwarded-*` set; `None` when its target
/// makes no URI.
fn through_tunnel<B>(
    req: Request<B>,
    (peer, shared, origin): (SocketAddr, &Shared, Origin),
    host: &str,
    upgrade: Option<&HeaderValue>,
) -> Option<Request<Body>>
where
    B: Into<Body>,
{
    let (mut parts, body) = req.into_parts();
    let claimed = portcullis_http::forward::remove_hop_by_hop(&mut parts.headers, false);
    if let Some(protocol) = upgrade {
        parts.method = http::Method::CONNECT;
        parts.extensions.insert(hyper::ext::Protocol::from(
            protocol.to_str().unwrap_or("websocket"),
        ));
    }
    // Only the tunnel server speaks these.
    for only_ours in [crate::CONTROL, crate::CLIENT_ADDR, crate::peers::PEER_TOKEN] {
        parts.headers.remove(HeaderName::from_static(only_ours));
    }
    if let Ok(v) = HeaderValue::from_str(&peer.to_string()) {
        parts
            .headers
            .insert(HeaderName::from_static(crate::CLIENT_ADDR), v);
    }
    let proto = if shared.public_tls { "https" } else { "http" };
    let xfp = HeaderName::from_static("x-forwarded-proto");
    let xfh = HeaderName::from_static("x-forwarded-host");
    // A peer set them from its public side.
    let trust = shared.trust_forwarded_headers || matches!(origin, Origin::Peer(_));
    if !(trust && parts.headers.contains_key(&xfp)) {
        parts.headers.insert(xfp, HeaderValue::from_static(proto));
    }
    if !(trust && parts.headers.contains_key(&xfh))
        && let Ok(v) = HeaderValue::from_str(host)
    {
        parts.headers.insert(xfh, v);
    }
    // The public side takes no client certificates: one a client names
    // is made up.
    if claimed && !trust {
        parts.headers.remove(portcullis_http::forward::CLIENT_CERT);
    }
    let path = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .to_owned();
    parts.uri = Uri::builder()
        .scheme(proto)
        .authority(host)
        .path_and_query(path)
        .build()
        .ok()?;
    parts.version = Version::HTTP_2;
    parts.headers.remove(header::HOST);
    let body = if upgrade.is_some() {
        Body::empty()
    } else {
        body.into()
    };
    Some(Request::from_parts(parts, body))
}

/// The runtime's answer as it goes back to the public client (or peer):
/// hop-by-hop headers gone, an accepted upgrade spliced through and
/// answered 101 (200 to a peer, whose stream is an extended CONNECT).
fn answer(
    mut resp: Response<Incoming>,
    (public_upgrade, upgrade): (Option<hyper::upgrade::OnUpgrade>, Option<HeaderValue>),
    (origin, upgrades): (Origin, &TaskTracker),
    runtime: &str,
) -> Response<Body> {
    let upgraded = match (public_upgrade, upgrade) {
        (Some(public), Some(protocol)) if resp.status() == StatusCode::OK => {
            let tunnel_side = hyper::upgrade::on(&mut resp);
            let what = runtime.into();
            portcullis_http::forward::upgrade::splice(upgrades, public, tunnel_side, what);
            Some(protocol)
        }
        _ => None,
    };
    let (mut parts, body) = resp.into_parts();
    let _ = portcullis_http::forward::remove_hop_by_hop(&mut parts.headers, false);
    if upgraded.is_some() && matches!(origin, Origin::Peer(_)) {
        // The peer's stream is an extended CONNECT: 200 opens it.
        return Response::from_parts(parts, Body::empty());
    }
    if let Some(protocol) = upgraded {
        parts.status = StatusCode::SWITCHING_PROTOCOLS;
        parts.headers.insert(header::UPGRADE, protocol);
        parts
            .headers
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        return Response::from_parts(parts, Body::empty());
    }
    Response::from_parts(parts, Body::from(body))
}

/// The answer when the tunnel (or the peer, `via`) failed the request,
/// and the warning that says so.
fn failed(
    target: &Target,
    e: &str,
    runtime: &str,
    request_id: Option<&HeaderValue>,
    via: Option<&str>,
) -> Response<Body> {
    let request_id = portcullis_obs::request_id::text(request_id);
    match target {
        Target::Tunnel(_) => {
            tracing::warn!(runtime, request_id, error = %e, "request through the tunnel failed");
            error(
                StatusCode::BAD_GATEWAY,
                "the tunnel to this runtime failed",
                Some(runtime),
            )
        }
        Target::Peers(_) => {
            let peer = via.unwrap_or_default();
            tracing::warn!(runtime, peer, request_id, error = %e, "request through a peer failed");
            error(
                StatusCode::BAD_GATEWAY,
                "the peer server holding this runtime's tunnel failed",
                Some(runtime),
            )
        }
    }
}
