//! The forward phase's second upstream kind: a connection that another
//! part of the proxy opened and holds, carrying each request as a stream
//! of its own (HTTP/2, or HTTP/3 reshaped by the carrier). The tunnel
//! server's runtimes are this kind: a runtime's tunnel, or the peer
//! replica that holds one.
//!
//! The first kind, [`UpstreamPool`](super::UpstreamPool), dials its
//! endpoints and picks, retries and ejects them. A carried upstream has
//! one connection, chosen before the phase runs (the tunnel server picks
//! it by host name), so what the two kinds share is the rest of the
//! phase: the request made ours (hop-by-hop fields out, the forwarded
//! fields set, an upgrade sent as an extended CONNECT, RFC 8441), sent,
//! and the answer with its hop-by-hop fields out and an accepted upgrade
//! spliced through ([`upgrade::splice`](super::upgrade::splice)),
//! answered the way the client asked for it: 101 over HTTP/1.1, 200 to
//! an extended CONNECT.

use std::future::Future;

use http::header::{self, HeaderName};
use hyper::body::Incoming;
use hyper::upgrade::OnUpgrade;
use tokio_util::task::TaskTracker;

use super::*;

/// A connection that carries requests: what a carried upstream sends on.
pub trait Carrier: Sync {
    /// Sends `req`, shaped for HTTP/2 (an absolute target; an upgrade as
    /// an extended CONNECT). The answer's head, or what failed; either
    /// way the request is spent.
    fn carry(
        &self,
        req: Request<Body>,
    ) -> impl Future<Output = Result<Response<Incoming>, String>> + Send;
}

/// What a carried request says of itself and its client.
pub struct Carriage<'a> {
    /// The host it is for: its `:authority`, and `X-Forwarded-Host`.
    pub host: &'a str,
    /// The scheme its client used: its `:scheme`, and `X-Forwarded-Proto`.
    pub scheme: &'static str,
    /// Whether the client's own `X-Forwarded-Proto`, `X-Forwarded-Host`
    /// and client-certificate fields are kept (a trusted balancer set
    /// them, or the replica that passed the request on).
    pub trust: bool,
    /// Fields only the carrier's two ends speak: a client's are removed.
    pub own_fields: &'a [&'static str],
    /// The field that names the client to the far end, and its value.
    pub client: Option<(HeaderName, HeaderValue)>,
}

/// The protocol a request upgrades to, and how its client asked.
struct Upgrade {
    protocol: HeaderValue,
    /// An extended CONNECT (answered 200), not an HTTP/1.1 `Upgrade`
    /// (answered 101).
    as_connect: bool,
    /// The client's side of the upgraded connection.
    client: OnUpgrade,
}

/// A request made ready to carry ([`Carried::new`]), then sent
/// ([`Carried::send`]).
pub struct Carried {
    req: Request<Body>,
    upgrade: Option<Upgrade>,
    /// Watched for the client breaking its body's framing, which the
    /// carrier reports as its own failure.
    progress: Option<Arc<BodyProgress>>,
}

impl Carried {
    /// `req` as it crosses: HTTP/2 to `how.host`, an upgrade as an
    /// extended CONNECT with an empty body, its hop-by-hop fields and
    /// the carrier's own gone, the client and `X-Forwarded-*` set.
    pub fn new<B>(mut req: Request<B>, how: &Carriage<'_>) -> Result<Carried, ForwardError>
    where
        B: Into<Body>,
    {
        let upgrade = upgrade_asked(&req).map(|(protocol, as_connect)| Upgrade {
            protocol,
            as_connect,
            client: hyper::upgrade::on(&mut req),
        });
        let (mut parts, body) = req.into_parts();
        let seen = remove_hop_by_hop(&mut parts.headers, false);
        if let Some(upgrade) = &upgrade {
            parts.method = Method::CONNECT;
            let protocol = upgrade.protocol.to_str().unwrap_or("websocket");
            parts
                .extensions
                .insert(hyper::ext::Protocol::from(protocol));
        }
        for own in how.own_fields {
            parts.headers.remove(*own);
        }
        if let Some((name, value)) = &how.client {
            parts.headers.insert(name.clone(), value.clone());
        }
        set_forwarded_scheme_and_host(&mut parts.headers, how, seen);
        // Shared with the received target, not parsed again.
        let path = parts.uri.path_and_query().cloned();
        let path = path.unwrap_or_else(|| PathAndQuery::from_static("/"));
        parts.uri = Uri::builder()
            .scheme(how.scheme)
            .authority(how.host)
            .path_and_query(path)
            .build()
            .map_err(|e| ForwardError::BadTarget(e.to_string()))?;
        parts.version = Version::HTTP_2;
        parts.headers.remove(header::HOST);
        let mut body = match upgrade {
            Some(_) => Body::empty(),
            None => body.into(),
        };
        let progress = body.track();
        Ok(Carried {
            req: Request::from_parts(parts, body),
            upgrade,
            progress,
        })
    }

    /// The request as it will be sent, for the carrier's last touches
    /// (its body counted, a field of its own).
    pub fn request_mut(&mut self) -> &mut Request<Body> {
        &mut self.req
    }

    /// Sends the request on `carrier`: the answer as the client gets it,
    /// an accepted upgrade spliced on a task of `upgrades` (named `what`
    /// in the logs); or why not, in the terms of the routing core's
    /// upstreams (the client's broken body is its own 400, not the
    /// carrier's failure).
    pub async fn send<C: Carrier>(
        self,
        carrier: &C,
        (upgrades, what): (&TaskTracker, &str),
    ) -> Result<Response<Body>, ForwardError> {
        let Carried {
            req,
            upgrade,
            progress,
        } = self;
        let mut resp = match carrier.carry(req).await {
            Ok(resp) => resp,
            Err(_) if progress.as_deref().is_some_and(BodyProgress::malformed) => {
                return Err(ForwardError::RequestBody(
                    "the client's body broke its framing".into(),
                ));
            }
            Err(e) => return Err(ForwardError::Failed(e)),
        };
        let upgraded = match upgrade {
            Some(upgrade) if resp.status() == StatusCode::OK => {
                let far_side = hyper::upgrade::on(&mut resp);
                super::upgrade::splice(upgrades, upgrade.client, far_side, what.into());
                Some((upgrade.protocol, upgrade.as_connect))
            }
            _ => None,
        };
        let (mut parts, body) = resp.into_parts();
        let _ = remove_hop_by_hop(&mut parts.headers, false);
        match upgraded {
            // The client's stream is an extended CONNECT: 200 opens it.
            Some((_, true)) => Ok(Response::from_parts(parts, Body::empty())),
            Some((protocol, false)) => {
                parts.status = StatusCode::SWITCHING_PROTOCOLS;
                parts.headers.insert(header::UPGRADE, protocol);
                let upgrade = HeaderValue::from_static("upgrade");
                parts.headers.insert(header::CONNECTION, upgrade);
                Ok(Response::from_parts(parts, Body::empty()))
            }
            None => Ok(Response::from_parts(parts, Body::from(body))),
        }
    }
}

/// The protocol `req` upgrades to, and whether it asks by extended
/// CONNECT: an HTTP/1.1 WebSocket upgrade, or an HTTP/2 stream that is
/// one already (a replica passing a WebSocket on).
fn upgrade_asked<B>(req: &Request<B>) -> Option<(HeaderValue, bool)> {
    if req.method() == Method::CONNECT {
        let protocol = req.extensions().get::<hyper::ext::Protocol>()?;
        return Some((HeaderValue::from_str(protocol.as_str()).ok()?, true));
    }
    if !is_websocket_upgrade(req.headers()) {
        return None;
    }
    Some((req.headers().get(header::UPGRADE)?.clone(), false))
}

/// `X-Forwarded-Proto` and `X-Forwarded-Host` as the carriage says,
/// unless trusted ones came with the request; a client certificate the
/// client claims (`seen`, from [`remove_hop_by_hop`]) dropped unless trusted: a carried request's
/// listener takes none. `X-Forwarded-For` is left to the far end, which
/// has the client from `Carriage::client`.
fn set_forwarded_scheme_and_host(headers: &mut HeaderMap, how: &Carriage<'_>, seen: Seen) {
    const XFP: HeaderName = HeaderName::from_static("x-forwarded-proto");
    const XFH: HeaderName = HeaderName::from_static("x-forwarded-host");
    if !(how.trust && seen.forwarded_proto) {
        headers.insert(XFP, HeaderValue::from_static(how.scheme));
    }
    if !(how.trust && seen.forwarded_host)
        && let Ok(v) = HeaderValue::from_str(how.host)
    {
        headers.insert(XFH, v);
    }
    if seen.client_cert && !how.trust {
        headers.remove(CLIENT_CERT);
    }
}

#[cfg(test)]
mod tests;
