//! A public request's route and forward: its host names the runtime, and the core's forward phase carries it (`portcullis_forward::carried`) through the runtime's tunnel here, or a peer replica holding one.

use super::*;
use portcullis_forward::{Carriage, Carried, Carrier, ForwardError};

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

/// The fields only the tunnel's ends speak: a public client's are
/// dropped.
const TUNNEL_FIELDS: &[&str] = &[crate::CONTROL, crate::CLIENT_ADDR, crate::peers::PEER_TOKEN];

/// Sends a request through its runtime's tunnel, or to a peer that holds
/// one when this server holds none and the request is public: the core's
/// forward phase with a carried upstream (`portcullis_forward::carried`).
/// `stats` is set to the runtime's metrics once the runtime is known,
/// `via` to the peer it went to.
pub(super) async fn forward<B>(
    req: Request<B>,
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
    let request_id = req
        .headers()
        .get(portcullis_obs::request_id::HEADER)
        .cloned();
    let client = HeaderValue::from_str(&peer.to_string()).ok();
    let carriage = Carriage {
        host: &host,
        scheme: if shared.public_tls { "https" } else { "http" },
        // A peer set them from its public side.
        trust: shared.trust_forwarded_headers || matches!(origin, Origin::Peer(_)),
        own_fields: TUNNEL_FIELDS,
        client: client.map(|v| (HeaderName::from_static(crate::CLIENT_ADDR), v)),
    };
    let mut carried = match Carried::new(req, &carriage) {
        Ok(carried) => carried,
        Err(e) => return failed(None, &e, runtime, request_id.as_ref()),
    };
    // Counted once, where the public reached, as the request is.
    if origin == Origin::Public {
        carried.request_mut().body_mut().count_into(stats);
    }
    let splice = (&shared.upgrades, runtime);
    let sent = match target {
        Target::Tunnel(tunnel) => carried.send(&*tunnel, splice).await,
        Target::Peers(holders) => {
            let Some(hop) = first_ready(holders, shared).await else {
                return not_connected(runtime);
            };
            *via = Some(hop.link.addr.clone());
            carried.send(&hop, splice).await
        }
    };
    sent.unwrap_or_else(|e| failed(via.as_deref(), &e, runtime, request_id.as_ref()))
}

/// A runtime's tunnel carries its public requests.
impl Carrier for Tunnel {
    async fn carry(&self, req: Request<Body>) -> Result<Response<Incoming>, String> {
        let _counted = crate::Active::count(&self.active);
        self.sender.send(req).await
    }
}

/// A peer replica holding the runtime's tunnel, over a connection of the
/// link that is ready for a request.
struct PeerHop<'a> {
    link: Arc<crate::peers::Link>,
    sender: SendRequest<Body>,
    peers: &'a crate::peers::Peers,
}

/// Carries a public request to the peer, with the token that shows it
/// comes from a replica.
impl Carrier for PeerHop<'_> {
    async fn carry(&self, mut req: Request<Body>) -> Result<Response<Incoming>, String> {
        self.peers.stamp(req.headers_mut());
        self.link.forward(self.sender.clone(), req).await
    }
}

/// The first of `holders` that takes a connection; one that does not (it
/// went away since the registry said otherwise) has been sent nothing,
/// so the next can be tried, whatever the body.
async fn first_ready(
    holders: Vec<Arc<crate::peers::Link>>,
    shared: &Shared,
) -> Option<PeerHop<'_>> {
    let peers = shared.peers.as_ref()?;
    for link in holders {
        match link.ready().await {
            Ok(sender) => {
                return Some(PeerHop {
                    link,
                    sender,
                    peers,
                });
            }
            Err(e) => peers.lost(&link.addr, &e),
        }
    }
    None
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

/// The answer when the request could not be carried: through the
/// tunnel, or the peer `via`, which is warned of; or the client's own
/// fault (a body that broke its framing, a target that makes no URI).
fn failed(
    via: Option<&str>,
    e: &ForwardError,
    runtime: &str,
    request_id: Option<&HeaderValue>,
) -> Response<Body> {
    let request_id = portcullis_obs::request_id::text(request_id);
    let message = match (e, via) {
        (ForwardError::BadTarget(_), _) => "bad request target",
        (ForwardError::Failed(why), None) => {
            tracing::warn!(runtime, request_id, error = %why, "request through the tunnel failed");
            "the tunnel to this runtime failed"
        }
        (ForwardError::Failed(why), Some(peer)) => {
            tracing::warn!(runtime, peer, request_id, error = %why, "request through a peer failed");
            "the peer server holding this runtime's tunnel failed"
        }
        (e, _) => e.public_message(),
    };
    error(e.status(), message, Some(runtime))
}
