//! Sending requests to upstreams, of two kinds. An upstream of the
//! policies ([`UpstreamPool`]): pooled keep-alive connections per
//! upstream, endpoint balancing, timeouts, retries of requests that never
//! left, and endpoints that could not be reached kept out of the
//! rotation. A carried upstream ([`carried`]): a connection another part
//! of the proxy holds, such as a runtime's tunnel.
//!
//! Also the one body type the request path carries ([`Body`]: a client's
//! streamed body, an upstream's, or one made here), since forwarding both
//! sends and makes it, with what a body needs on its way: its progress
//! ([`BodyProgress`]), a copy for a mirror ([`tee`]), and the watch on a
//! client that may leave while its upstream thinks ([`client_watch`]).
//! Below the request pipeline (portcullis-http), which routes and runs
//! plugins around it.

mod affinity;
mod body;
mod body_progress;
// Public: the carried upstream kind, which the tunnel server's carriers
// implement and the phase driver sends through (http, tunnel).
pub mod carried;
// Public: the watch on a client while its upstream thinks, which the
// pipeline arms around its other waits and the listeners set up (http).
pub mod client_watch;
// The OpenTelemetry collector posted to as an upstream (obs's trait).
mod collector;
mod dial;
mod ejection;
mod endpoints;
mod error;
mod forwarded;
// Public: the own HTTP/1.1 exchange, named by the pipeline for its
// framing, and checked against hyper by tests and a fuzz target (http,
// tests, fuzz).
pub mod h1;
mod headers;
// Public: active health checks, which the pipeline starts (http).
pub mod health;
mod held;
mod pool;
mod retry;
mod send;
mod tee;
mod tls;
// Public: an accepted upgrade spliced between client and upstream
// (http).
pub mod upgrade;
mod worn;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri, Version};

pub use affinity::preference;
pub use body::{Body, BodyError, BodyProgress, ResponseBody, TooLarge, Tracked};
pub use carried::{Carriage, Carried, Carrier};
pub use ejection::Ejections;
use endpoints::*;
pub use endpoints::{SharedEndpoints, shared_endpoints};
pub use error::{ForwardError, error_chain};
pub use forwarded::{Forwarded, forwarded, set_forwarded};
pub use h1::H1Body;
pub use headers::{
    CLIENT_CERT, Seen, client_ip_header, client_of, is_websocket_upgrade, join_cookie_crumbs,
    last_forwarded_for, remove_hop_by_hop, single_content_length,
};
pub use held::{Admitted, Held, InFlight};
pub use tls::client_config as client_tls_config;

use pool::{Conn, ConnPool, Dest};
pub use retry::RetryCounts;

use crate::client_watch::{ClientSocket, Cut};
use portcullis_config::{Balance, Endpoint, HashOn, Target, Upstream};

/// An upstream's live state: its connections and balancing counters.
pub struct UpstreamPool {
    /// The upstream's settings.
    pub spec: Arc<Upstream>,
    conns: ConnPool,
    in_flight: held::InFlightCounts,
    ejections: Arc<Ejections>,
    requests: Arc<AtomicUsize>,
    /// The cap on `requests` when they are counted: `max_requests`, or
    /// none (`usize::MAX`) when only the retry budget needs the count.
    request_cap: Option<usize>,
    retries: Arc<RetryCounts>,
    /// Each endpoint's seed for `balance: hash` (empty otherwise).
    seeds: Box<[u64]>,
    /// Endpoints' weights, when not all equal (empty otherwise).
    weights: Box<[u32]>,
    /// With weights, the round-robin order: endpoint indices, each as
    /// often as its weight, spread out (nginx's smooth weighted round
    /// robin, worked out once).
    schedule: Box<[u16]>,
    next: AtomicUsize,
    /// Its counters in `/metrics` (responses, failures, time to the
    /// answer's head), found once here rather than by name per request.
    pub stats: &'static portcullis_obs::metrics::RouteStats,
}

/// What to send: the parts of the client request the proxy keeps.
pub struct Outgoing {
    /// Method.
    pub method: Method,
    /// Path and query after rewriting.
    pub path: PathAndQuery,
    /// Headers, already edited.
    pub headers: HeaderMap,
    /// The forwarding fields still to add (none of them in `headers`):
    /// the own HTTP/1.1 exchange writes them after `headers`, every other
    /// way adds them to `headers` first.
    pub forwarded: Forwarded,
    /// Body.
    pub body: Body,
    /// With `balance: hash`, the hash of the request's key (see
    /// [`UpstreamPool::affinity`]).
    pub affinity: Option<u64>,
    /// Whether `headers` hold the `Host` it goes with (a plugin's callout
    /// names its own, as Envoy sends a call's `:authority`), instead of
    /// the endpoint's or the client's: one `Host` goes either way.
    pub own_host: bool,
    /// Whether it is a WebSocket upgrade its route lets through (its
    /// `Connection: upgrade` and `Upgrade` kept): it then goes by hyper,
    /// which hands over the upgraded connection. Known where the request
    /// was shaped, so the send need not look the headers up again.
    pub upgrade: bool,
}

fn idempotent(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE | Method::TRACE
    )
}

/// Request bodies of a known length up to this size are read before the
/// request goes out (as nginx buffers bodies in memory up to its
/// `client_body_buffer_size`): the request is then exchanged in-task in
/// one write, and can be sent again if a pooled connection turns out dead.
/// Longer bodies, and bodies of unknown length, stream through hyper.
pub const MAX_BUFFERED_BODY: u64 = 64 * 1024;

/// Reads all of a small body (see [`MAX_BUFFERED_BODY`]) within `timeout`.
pub async fn read_small_body(body: Body, timeout: Duration) -> Result<bytes::Bytes, ForwardError> {
    let limited = http_body_util::Limited::new(body, MAX_BUFFERED_BODY as usize);
    match tokio::time::timeout(timeout, http_body_util::BodyExt::collect(limited)).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(e)) => Err(ForwardError::RequestBody(e.to_string())),
        Err(_) => Err(ForwardError::RequestBodyTimeout(timeout)),
    }
}

/// How many times a pooled connection that turned out closed is replaced
/// before giving up (the request was never sent, so any method may go again).
const STALE_RETRIES: usize = 3;

impl UpstreamPool {
    /// Builds one worker's pool for an upstream; `shared` (in-flight
    /// counts and ejections per endpoint) is shared by all workers' pools
    /// of the upstream, so least-requests sees the whole process and one
    /// worker's failed connect spares the others. Opens no connection; with
    /// `previous` (this worker's pool of the same upstream before its
    /// endpoints changed), takes over the connections of the endpoints
    /// both list.
    pub fn new(
        spec: Arc<Upstream>,
        shared: SharedEndpoints,
        previous: Option<&UpstreamPool>,
    ) -> UpstreamPool {
        let mut conns = ConnPool::new(&spec, shared.in_flight.len());
        if let Some(old) = previous {
            for (i, j) in kept_endpoints(&spec, &old.spec) {
                conns.take_slot(i, &old.conns, j);
            }
        }
        UpstreamPool {
            conns,
            in_flight: shared.in_flight,
            ejections: shared.ejections,
            requests: shared.requests,
            request_cap: spec
                .max_requests
                .or((!spec.retry_on.is_empty() || spec.retry_on_reset).then_some(usize::MAX)),
            retries: shared.retries,
            seeds: match &spec.target {
                Target::Endpoints(eps) if spec.balance == Balance::Hash => {
                    eps.iter().map(affinity::endpoint_seed).collect()
                }
                _ => Box::default(),
            },
            weights: match &spec.target {
                Target::Endpoints(eps) if eps.iter().any(|e| e.weight != eps[0].weight) => {
                    eps.iter().map(|e| e.weight).collect()
                }
                _ => Box::default(),
            },
            schedule: match &spec.target {
                Target::Endpoints(eps) if eps.iter().any(|e| e.weight != eps[0].weight) => {
                    let weights: Vec<u32> = eps.iter().map(|e| e.weight).collect();
                    smooth_schedule(&weights).into()
                }
                _ => Box::default(),
            },
            next: AtomicUsize::new(0),
            stats: portcullis_obs::metrics::upstream(&spec.name),
            spec,
        }
    }

    /// The endpoints out of the rotation now (authority, time left), for
    /// the admin endpoint.
    pub fn ejected(&self) -> Vec<(String, Duration)> {
        match &self.spec.target {
            Target::Endpoints(eps) if eps.len() > 1 => eps
                .iter()
                .enumerate()
                .filter_map(|(i, ep)| Some((ep.to_string(), self.ejections.remaining(i)?)))
                .collect(),
            _ => Vec::new(),
        }
    }

    /// Requests in flight against the upstream's `max_requests`, and that
    /// cap, for the admin endpoint; `None` without a cap (uncounted).
    pub fn requests_in_flight(&self) -> Option<(usize, usize)> {
        let max = self.spec.max_requests?;
        Some((self.requests.load(Ordering::Relaxed), max))
    }

    /// `retry_on`'s retries made and refused by the budget (all workers),
    /// for the metrics; `None` for upstreams without `retry_on`.
    pub fn retry_totals(&self) -> Option<(u64, u64)> {
        let retrying = !self.spec.retry_on.is_empty() || self.spec.retry_on_reset;
        retrying.then(|| self.retries.totals())
    }

    /// Whether one more `retry_on` retry fits the budget; the place taken
    /// is kept in `slot` for as long as the retry's try runs.
    fn retry_fits(&self, slot: &retry::RetrySlot<'_>) -> bool {
        let requests = self.requests.load(Ordering::Relaxed);
        let fits = slot.take(&self.spec.retry_budget, requests);
        if !fits {
            tracing::debug!(upstream = %self.spec.name, ?self.spec.retry_budget, requests, "retry budget spent; the answer at hand is passed on");
        }
        fits
    }

    /// The endpoints failing their health check now (authorities), for
    /// the admin endpoint; `None` without health checks.
    pub fn unhealthy(&self) -> Option<Vec<String>> {
        self.spec.health_check.as_ref()?;
        match &self.spec.target {
            Target::Endpoints(eps) => Some(
                eps.iter()
                    .enumerate()
                    .filter(|&(i, _)| self.ejections.is_down(i))
                    .map(|(_, ep)| ep.to_string())
                    .collect(),
            ),
            Target::Template(_) => None,
        }
    }

    /// For `balance: hash`, the hash of the key the upstream balances by,
    /// read from a request's headers as the client sent them (`peer`: the
    /// connection's client address; `trust`: whether its listener trusts
    /// `X-Forwarded-For`); `None` for other balancing, or a request
    /// without the key. Inlined: every forwarded request asks, and for
    /// other balancing the answer is one comparison (out of line, a call
    /// and its set-up cost ~35 instructions a request).
    #[inline]
    pub fn affinity(
        &self,
        peer: std::net::IpAddr,
        trust: bool,
        headers: &HeaderMap,
    ) -> Option<(u64, Option<HeaderValue>)> {
        if self.spec.balance != Balance::Hash {
            return None;
        }
        if let Some(key) = affinity::key_hash(&self.spec.hash_on, peer, trust, headers) {
            return Some((key, None));
        }
        // No cookie yet: one is made, and its value picks the endpoint
        // its later requests will keep to.
        match (&self.spec.hash_on, self.spec.hash_cookie_ttl) {
            (HashOn::Cookie(name), Some(ttl)) => Some(affinity::new_cookie(name, ttl)),
            _ => None,
        }
    }

    /// Picks the endpoint for a request, passing over ejected ones.
    fn pick(&self, n: usize, key: Option<u64>) -> usize {
        if n == 1 {
            return 0;
        }
        if let Some(key) = key.filter(|_| self.seeds.len() == n) {
            let out = |i| self.ejections.is_out(i);
            return affinity::pick(key, &self.seeds, &self.weights, out);
        }
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        let start = turn % n;
        match self.spec.balance {
            // Requests without the key go round robin.
            Balance::RoundRobin | Balance::Hash if !self.schedule.is_empty() => {
                let len = self.schedule.len();
                (0..len)
                    .map(|k| usize::from(self.schedule[(turn + k) % len]))
                    .find(|&i| !self.ejections.is_out(i))
                    .unwrap_or(usize::from(self.schedule[turn % len]))
            }
            Balance::RoundRobin | Balance::Hash => self.ejections.first_in(start, n),
            Balance::LeastRequests => {
                // Requests in flight per unit of weight (nginx's
                // least_conn with weights), in fixed point.
                let load = |i: usize| {
                    let n = self.in_flight[i].load(Ordering::Relaxed) as u64;
                    match self.weights.get(i) {
                        Some(&w) => (n << 16) / u64::from(w),
                        None => n,
                    }
                };
                let least = |ejected_too: bool| {
                    (0..n)
                        .map(|i| (start + i) % n)
                        .filter(|&i| ejected_too || !self.ejections.is_out(i))
                        .min_by_key(|&i| load(i))
                };
                least(false).or_else(|| least(true)).unwrap_or(start)
            }
        }
    }

    /// The request target: origin-form (`/path?query`) for HTTP/1.1, as
    /// RFC 9112 §3.2.1 asks of a client talking to an origin server (some
    /// servers do not take the absolute form); scheme and authority too for
    /// HTTP/2, which sends them as pseudo-headers.
    fn uri(ep: &Endpoint, path: &PathAndQuery, version: Version) -> Result<Uri, ForwardError> {
        let mut parts = http::uri::Parts::default();
        if version != Version::HTTP_11 {
            parts.scheme = Some(ep.scheme.clone());
            parts.authority = Some(ep.authority.clone());
        }
        parts.path_and_query = Some(match ep.base_path.as_deref() {
            None => path.clone(),
            Some(base) => {
                let joined = format!("{base}{}", path.as_str());
                PathAndQuery::try_from(joined)
                    .map_err(|e| ForwardError::BadTarget(e.to_string()))?
            }
        });
        Uri::from_parts(parts).map_err(|e| ForwardError::BadTarget(e.to_string()))
    }

    /// Sends a request of the proxy's own (a mirrored copy, a batch of
    /// spans) and reads its answer to the end, so that the connection
    /// serves again, all within the upstream's request timeout and a
    /// second: the answer's status, or what went wrong.
    pub async fn side_request(&self, out: Outgoing) -> Result<StatusCode, String> {
        let timeout = self.spec.timeouts.request;
        let params = matchit::Params::new();
        let exchange = async {
            let (resp, held) = self
                .send(out, &params, timeout, None, None)
                .await
                .map_err(|e| e.to_string())?;
            let status = resp.status();
            let _ = http_body_util::BodyExt::collect(resp.into_body()).await;
            drop(held);
            Ok(status)
        };
        tokio::time::timeout(timeout + Duration::from_secs(1), exchange)
            .await
            .unwrap_or_else(|_| Err("timed out".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::smooth_schedule;

    #[test]
    fn a_weighted_schedule_spreads_each_endpoint_over_the_cycle() {
        assert_eq!(smooth_schedule(&[3, 1]), [0, 0, 1, 0]);
        assert_eq!(smooth_schedule(&[5, 1, 1]), [0, 0, 1, 0, 2, 0, 0]);
        let long = smooth_schedule(&[2, 7, 1]);
        assert_eq!(long.len(), 10);
        for (i, w) in [2, 7, 1].into_iter().enumerate() {
            assert_eq!(long.iter().filter(|&&e| usize::from(e) == i).count(), w);
        }
    }
}
