//! Sending requests to upstreams: pooled keep-alive connections per upstream,
//! endpoint balancing, timeouts, retries of requests that never left, and
//! endpoints that could not be reached kept out of the rotation.

mod affinity;
mod ejection;
pub mod h1;
mod headers;
pub mod health;
mod pool;
mod retry;
mod tls;
pub mod upgrade;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, Uri, Version};

pub use affinity::preference;
pub use ejection::Ejections;
pub use h1::H1Body;
pub use headers::{
    CLIENT_CERT, client_ip_header, client_of, is_websocket_upgrade, join_cookie_crumbs,
    last_forwarded_for, remove_hop_by_hop, set_forwarded, single_content_length,
};
pub use tls::client_config as client_tls_config;

use pool::{Conn, ConnPool, Dest, Lease};
pub use retry::RetryCounts;

use crate::body::{Body, BodyProgress};
use crate::client_watch::{self, ClientSocket, Cut};
use portcullis_config::{Balance, Endpoint, HashOn, Target, Upstream};

/// Why a request could not be forwarded; each maps to one status code.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ForwardError {
    /// TCP or TLS connection to the upstream failed (refused, DNS, handshake).
    #[error("upstream unreachable: {0}")]
    Unreachable(String),
    /// Connecting took longer than the connect timeout.
    #[error("upstream connect timeout")]
    ConnectTimeout,
    /// The response head did not arrive within the request timeout.
    #[error("upstream timeout after {0:?}")]
    Timeout(Duration),
    /// The connection failed after the request was sent.
    #[error("upstream failed: {0}")]
    Failed(String),
    /// A path parameter cannot be used to build the upstream URL.
    #[error("{0}")]
    BadTarget(String),
    /// The client's request body could not be read (it went away, or sent
    /// something broken).
    #[error("reading the request body: {0}")]
    RequestBody(String),
    /// The client took longer than the request timeout to send its body.
    #[error("request body not received within {0:?}")]
    RequestBodyTimeout(Duration),
    /// The client went away while the upstream was working.
    #[error("client closed the connection")]
    ClientGone,
    /// The client's streamed body went over the route's
    /// `max_request_body`; the upstream got the start of it and a cut.
    #[error("request body larger than the route's max_request_body")]
    BodyTooLarge,
    /// The upstream already has its `max_requests` in flight.
    #[error("upstream has its max_requests ({0}) in flight")]
    Overloaded(usize),
}

impl ForwardError {
    /// The status the client gets.
    pub fn status(&self) -> StatusCode {
        match self {
            ForwardError::Unreachable(_) | ForwardError::Failed(_) => StatusCode::BAD_GATEWAY,
            ForwardError::ConnectTimeout | ForwardError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ForwardError::BadTarget(_) | ForwardError::RequestBody(_) => StatusCode::BAD_REQUEST,
            ForwardError::RequestBodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ForwardError::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ForwardError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            // nginx's "client closed request": never sent, but logged and
            // counted.
            ForwardError::ClientGone => {
                StatusCode::from_u16(portcullis_obs::metrics::CLIENT_CLOSED_REQUEST)
                    .unwrap_or(StatusCode::BAD_REQUEST)
            }
        }
    }

    /// The short text put in the JSON error body.
    pub fn public_message(&self) -> &'static str {
        match self {
            ForwardError::Unreachable(_) => "upstream unreachable",
            ForwardError::ConnectTimeout => "upstream connect timeout",
            ForwardError::Timeout(_) => "upstream timeout",
            ForwardError::Failed(_) => "upstream connection failed",
            ForwardError::BadTarget(_) => "invalid path parameter",
            ForwardError::RequestBody(_) => "request body could not be read",
            ForwardError::RequestBodyTimeout(_) => "request body timeout",
            ForwardError::ClientGone => "client closed request",
            ForwardError::BodyTooLarge => "request body too large",
            ForwardError::Overloaded(_) => "upstream overloaded",
        }
    }
}

/// Counts a request against an endpoint until dropped.
#[derive(Debug)]
pub struct InFlight(Arc<[AtomicUsize]>, usize);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0[self.1].fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counts a request against its upstream's `max_requests` until dropped.
#[derive(Debug)]
pub struct Admitted(Arc<AtomicUsize>);

impl Admitted {
    /// Counts one more request on `count`, unless `max` are in flight.
    fn take(count: &Arc<AtomicUsize>, max: usize) -> Option<Admitted> {
        // An optimistic add, taken back when over: one atomic operation
        // for a request that is let in.
        if count.fetch_add(1, Ordering::Relaxed) >= max {
            count.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(Admitted(count.clone()))
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a forwarded response holds on to until its body ends: the
/// endpoint's in-flight count, the upstream's under `max_requests`, and,
/// for HTTP/1.1, the connection.
#[derive(Default)]
pub struct Held {
    in_flight: Option<InFlight>,
    admitted: Option<Admitted>,
    lease: Option<Box<Lease>>,
    /// The upstream's read timeout in milliseconds (zero: none); not a
    /// `Duration`, which would make every response's `Held` 16 bytes
    /// larger.
    read_timeout_ms: u32,
    /// Which of the upstream's endpoints answered, plus one (0: none, or
    /// a URL template's), for the access line; it fits beside
    /// `read_timeout_ms` at no size.
    endpoint: u32,
}

impl Held {
    /// Cuts the response body when the upstream sends nothing for
    /// `limit` while it is waited on (zero: never).
    pub fn with_read_timeout(mut self, limit: Duration) -> Held {
        self.read_timeout_ms = limit.as_millis().try_into().unwrap_or(u32::MAX);
        self
    }

    /// See [`Held::with_read_timeout`].
    pub fn read_timeout(&self) -> Duration {
        Duration::from_millis(self.read_timeout_ms.into())
    }

    /// The index of the endpoint that answered, in the upstream's
    /// endpoints; `None` for a URL template's destination.
    pub fn endpoint(&self) -> Option<usize> {
        (self.endpoint as usize).checked_sub(1)
    }

    /// The response body was read to its end: the connection can serve
    /// the next request.
    pub fn finish(&mut self) {
        if let Some(lease) = self.lease.take() {
            lease.release();
        }
        self.in_flight = None;
        self.admitted = None;
    }
}

/// What the workers' pools of an upstream share about its endpoints.
#[derive(Clone)]
pub struct SharedEndpoints {
    /// Requests in flight per endpoint (least-requests reads them).
    in_flight: Arc<[AtomicUsize]>,
    /// Endpoints out of the rotation after a failed connect.
    ejections: Arc<Ejections>,
    /// Requests in flight to the whole upstream, counted only when it
    /// has `max_requests` or `retry_on` (the retry budget's base).
    requests: Arc<AtomicUsize>,
    /// `retry_on`'s retries.
    retries: Arc<RetryCounts>,
}

/// A fresh [`SharedEndpoints`] for `spec`, made once per upstream. With
/// `previous`, the same upstream before its endpoints changed, the
/// endpoints both list stay out of the rotation if they were.
pub fn shared_endpoints(spec: &Upstream, previous: Option<&UpstreamPool>) -> SharedEndpoints {
    let n = match &spec.target {
        Target::Endpoints(e) => e.len(),
        Target::Template(_) => 1,
    };
    let ejections = Ejections::new(n, spec.eject_for, spec.eject_after_5xx.unwrap_or(0));
    if let Some(old) = previous {
        for (i, j) in kept_endpoints(spec, &old.spec) {
            ejections.take_over(i, &old.ejections, j);
        }
    }
    SharedEndpoints {
        in_flight: (0..n).map(|_| AtomicUsize::new(0)).collect(),
        ejections: Arc::new(ejections),
        requests: Arc::new(AtomicUsize::new(0)),
        retries: Arc::default(),
    }
}

/// The endpoints `new` and `old` both list, as pairs of their indices.
fn kept_endpoints(new: &Upstream, old: &Upstream) -> Vec<(usize, usize)> {
    let (Target::Endpoints(new), Target::Endpoints(old)) = (&new.target, &old.target) else {
        return Vec::new();
    };
    new.iter()
        .enumerate()
        .filter_map(|(i, ep)| Some((i, old.iter().position(|o| o == ep)?)))
        .collect()
}

/// An upstream's live state: its connections and balancing counters.
pub struct UpstreamPool {
    /// The upstream's settings.
    pub spec: Arc<Upstream>,
    conns: ConnPool,
    in_flight: Arc<[AtomicUsize]>,
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
}

/// What to send: the parts of the client request the proxy keeps.
pub struct Outgoing {
    /// Method.
    pub method: Method,
    /// Path and query after rewriting.
    pub path: PathAndQuery,
    /// Headers, already edited.
    pub headers: HeaderMap,
    /// Body.
    pub body: Body,
    /// With `balance: hash`, the hash of the request's key (see
    /// [`UpstreamPool::affinity`]).
    pub affinity: Option<u64>,
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
                .send(out, &params, timeout, None)
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

    /// Sends `out` to the upstream and waits for the response head, within
    /// `timeout`. A request whose connection could not be made is retried
    /// on the next endpoint in, up to `retries` times: nothing was sent,
    /// so any method and body may go again (as nginx's and Envoy's connect
    /// failure retries do); the endpoint is ejected for `eject_for`. A
    /// request that a stale pooled connection gave back unsent is always
    /// sent again on a new connection.
    pub async fn send(
        &self,
        out: Outgoing,
        params: &matchit::Params<'_, '_>,
        timeout: Duration,
        client: Option<ClientSocket>,
    ) -> Result<(Response<Body>, Held), ForwardError> {
        // Before anything is read or dialled: a request over the cap
        // costs the upstream nothing.
        let mut admitted = match self.request_cap {
            None => None,
            Some(max) => {
                Some(Admitted::take(&self.requests, max).ok_or(ForwardError::Overloaded(max))?)
            }
        };
        let rendered;
        let (endpoints, template): (&[Endpoint], bool) = match &self.spec.target {
            Target::Endpoints(e) => (e, false),
            Target::Template(t) => {
                let url = t
                    .render(|name| params.get(name))
                    .map_err(ForwardError::BadTarget)?;
                let ep = Uri::try_from(url.as_str())
                    .ok()
                    .and_then(|u| Endpoint::from_uri(&u))
                    .ok_or_else(|| {
                        ForwardError::BadTarget(format!("`{url}` is not a valid upstream URL"))
                    })?;
                rendered = [ep];
                (&rendered, true)
            }
        };
        let version = if self.spec.http2 {
            Version::HTTP_2
        } else {
            Version::HTTP_11
        };
        let Outgoing {
            method,
            path,
            mut headers,
            mut body,
            affinity,
        } = out;
        let upgrade = headers::is_websocket_upgrade(&headers);
        let bodiless = http_body::Body::is_end_stream(&body);
        // A small body of known length is read now: the request is then
        // whole in hand (one write, and sendable again).
        let payload = match http_body::Body::size_hint(&body).exact() {
            Some(n) if !bodiless && !upgrade && n <= MAX_BUFFERED_BODY => {
                let taken = std::mem::replace(&mut body, Body::empty());
                Some(read_small_body(taken, timeout).await?)
            }
            _ => None,
        };
        // A body that streams on is noted as it goes: the timeout for the
        // answer runs from its last progress (a long upload is not the
        // upstream being slow), and a client that stops sending it is cut.
        let progress = body.track();
        let whole = bodiless || payload.is_some();
        // As nginx's proxy_next_upstream: a retry goes to another endpoint,
        // so a single-endpoint upstream never pays for keeping a copy. Only
        // a failed connect is retried, before any byte of the request left:
        // a streamed body is still untouched then.
        let retryable = self.spec.retries > 0 && endpoints.len() > 1;
        let mut attempts = if retryable {
            1 + self.spec.retries.min(endpoints.len() as u32 - 1)
        } else {
            1
        };
        // A request whose answer may be thrown away for another: whole in
        // hand and safe to send twice. It gets its `retries` even with one
        // endpoint (a Kubernetes Service picks another pod).
        let replay_on_status = (!self.spec.retry_on.is_empty() || self.spec.retry_on_reset)
            && whole
            && !upgrade
            && idempotent(&method);
        if replay_on_status {
            attempts = attempts.max(1 + self.spec.retries);
        }
        // Requests in hand are exchanged with HTTP/1.1 upstreams by this
        // task (`h1`); streamed bodies and upgrades go through hyper's
        // connection task, which reads the response while the body is
        // still going out.
        let in_task = version == Version::HTTP_11 && !upgrade && whole;
        // Each try of a request that may be sent again gets its own
        // deadline; others wait for the request timeout alone.
        let per_try = if replay_on_status {
            self.spec.per_try_timeout
        } else {
            None
        };
        // Pinned where it is made: the exchange is the request's largest
        // future, and passed by value it was copied twice per request.
        let attempt_all = std::pin::pin!(async {
            let mut last = None;
            let n = endpoints.len();
            let mut i = self.pick(n, affinity);
            // The budget's place for the retry under way, if one is.
            let retrying = retry::RetrySlot::new(&self.retries);
            // `eject_after_5xx`: how each try went counts for its endpoint.
            let count_answers = n > 1 && !template && self.ejections.counts_answers();
            let answerer = |i: usize| if template { 0 } else { i as u32 + 1 };
            let answered = |i: usize, ep: &Endpoint, failed: Option<bool>| {
                let Some(failed) = failed.filter(|_| count_answers) else {
                    return;
                };
                // A body the client broke, or one cut for its size, ends
                // the exchange however the upstream side reports it.
                if progress
                    .as_deref()
                    .is_some_and(|p| p.malformed() || p.too_large())
                {
                    return;
                }
                if self.ejections.answered(i, failed) {
                    tracing::warn!(upstream = %self.spec.name, endpoint = %ep, eject_after_5xx = self.spec.eject_after_5xx, eject_for = ?self.spec.eject_for, "endpoint out of the rotation after failed answers in a row");
                }
            };
            'attempts: for attempt in 0..attempts {
                // Retries walk on from the balancer's choice to the next
                // endpoint in (the one that failed is out by now).
                if attempt > 0 {
                    i = match affinity.filter(|_| self.seeds.len() == n) {
                        // The key's next choice, as its later requests
                        // will make once the failed endpoint is out.
                        Some(key) => {
                            let failed = i;
                            affinity::pick(key, &self.seeds, &self.weights, |j| {
                                j == failed || self.ejections.is_out(j)
                            })
                        }
                        None => self.ejections.first_in((i + 1) % n, n),
                    };
                }
                let ep = &endpoints[i];
                // Whether this attempt's answer may be dropped for another
                // (the status is looked at only then).
                let may_retry = replay_on_status && attempt + 1 < attempts;
                let retry_status = |status: StatusCode| {
                    may_retry
                        && self.spec.retry_on.contains(&status.as_u16())
                        && self.retry_fits(&retrying)
                };
                let mut timer = per_try.map(|d| Box::pin(tokio::time::sleep(d)));
                // A try past its deadline is dropped with its connection,
                // and counts as a 504: the next try, or the client's 504.
                let ran_out = || {
                    let e = ForwardError::Timeout(per_try.unwrap_or_default());
                    if may_retry && self.spec.retry_on.contains(&504) && self.retry_fits(&retrying)
                    {
                        tracing::debug!(upstream = %self.spec.name, endpoint = %ep, attempt, "try ran out of its per_try_timeout; retrying");
                        Ok(e)
                    } else {
                        Err(e)
                    }
                };
                let dest = if template {
                    Dest::Dynamic(ep)
                } else {
                    Dest::Fixed(i, ep)
                };
                let last_attempt = attempt + 1 == attempts;
                // Keep a copy of the head only while a retry is still possible.
                let mut hdrs = if last_attempt {
                    std::mem::take(&mut headers)
                } else {
                    headers.clone()
                };
                let host = (!self.spec.preserve_host && version == Version::HTTP_11)
                    .then_some(&ep.host_header);
                // Only least-requests reads the counts; other policies skip
                // the shared atomics on the hot path.
                let guard = (self.spec.balance == Balance::LeastRequests).then(|| {
                    let slot = if template { 0 } else { i };
                    self.in_flight[slot].fetch_add(1, Ordering::Relaxed);
                    InFlight(self.in_flight.clone(), slot)
                });
                let mut req = None;
                let mut fresh = false;
                for _ in 0..=STALE_RETRIES {
                    let (conn, reused) = match self.conns.checkout(&dest, fresh, in_task).await {
                        Ok(c) => c,
                        Err(e) => {
                            tracing::debug!(upstream = %self.spec.name, endpoint = %ep, attempt, error = %e, "connect failed");
                            if n > 1 && self.ejections.eject(i) {
                                tracing::warn!(upstream = %self.spec.name, endpoint = %ep, error = %e, eject_for = ?self.spec.eject_for, "endpoint out of the rotation after a failed connect");
                            }
                            // A request a stale connection gave back keeps
                            // its body for the next endpoint.
                            if let Some(r) = req.take() {
                                body = http::Request::into_body(r);
                            }
                            last = Some(e);
                            break;
                        }
                    };
                    if n > 1 && !reused {
                        self.ejections.readmit(i);
                    }
                    let mut conn = match conn {
                        Conn::InTask(mut conn, slot) => {
                            let prefix = ep.base_path.as_deref().unwrap_or("");
                            let outcome = conn
                                .exchange(
                                    &method,
                                    prefix,
                                    path.as_str(),
                                    host,
                                    &hdrs,
                                    payload.as_deref(),
                                    timer.as_mut(),
                                )
                                .await;
                            // A pooled connection closed under the request
                            // says nothing of the endpoint.
                            answered(
                                i,
                                ep,
                                match &outcome {
                                    Ok((resp, _)) => Some(resp.status().is_server_error()),
                                    Err(h1::ExchangeError::Closed(_)) if reused => None,
                                    Err(_) => Some(true),
                                },
                            );
                            match outcome {
                                Err(h1::ExchangeError::RanOut) => {
                                    last = Some(ran_out()?);
                                    continue 'attempts;
                                }
                                Ok((resp, _)) if retry_status(resp.status()) => {
                                    // Its body unread, the connection goes.
                                    tracing::debug!(upstream = %self.spec.name, endpoint = %ep, status = resp.status().as_u16(), attempt, "answer to retry");
                                    continue 'attempts;
                                }
                                Ok((resp, framing)) => {
                                    conn.recycle(std::mem::take(&mut hdrs));
                                    let home = h1::keeps_alive(&resp, framing).then_some(slot);
                                    let body = H1Body::new(conn, framing, home);
                                    let resp = resp.map(|()| Body::Upstream { inner: body });
                                    let held = Held {
                                        in_flight: guard,
                                        admitted: admitted.take(),
                                        lease: None,
                                        read_timeout_ms: 0,
                                        endpoint: answerer(i),
                                    };
                                    return Ok((resp, held));
                                }
                                // A pooled connection the upstream closed
                                // while idle: the request may not have been
                                // seen, so an idempotent one goes again on a
                                // new connection (as nginx and hyper do).
                                Err(h1::ExchangeError::Closed(_))
                                    if reused && idempotent(&method) =>
                                {
                                    fresh = true;
                                    continue;
                                }
                                // Sent, and the connection went before any
                                // answer: with `reset`, the next attempt.
                                Err(h1::ExchangeError::Closed(e))
                                    if may_retry
                                        && self.spec.retry_on_reset
                                        && self.retry_fits(&retrying) =>
                                {
                                    tracing::debug!(upstream = %self.spec.name, endpoint = %ep, error = %e, attempt, "connection failed before an answer; retrying");
                                    last = Some(ForwardError::Failed(e));
                                    continue 'attempts;
                                }
                                Err(
                                    h1::ExchangeError::Closed(e) | h1::ExchangeError::Failed(e),
                                ) => return Err(ForwardError::Failed(e)),
                            }
                        }
                        c => c,
                    };
                    let r = match req.take() {
                        Some(r) => r,
                        None => {
                            // Taken only now, once connected: a failed
                            // connect leaves it for the next endpoint.
                            let b = match &payload {
                                Some(p) => Body::full(p.clone()),
                                None => std::mem::replace(&mut body, Body::empty()),
                            };
                            let mut r = Request::new(b);
                            *r.method_mut() = method.clone();
                            *r.uri_mut() = Self::uri(ep, &path, version)?;
                            *r.version_mut() = version;
                            *r.headers_mut() = std::mem::take(&mut hdrs);
                            if let Some(host) = host {
                                r.headers_mut().insert(http::header::HOST, host.clone());
                            }
                            r
                        }
                    };
                    // Through hyper's client (HTTP/2, streamed bodies), the
                    // deadline races the exchange from outside.
                    let outcome = match timer.as_mut() {
                        None => Some(conn.send(r).await),
                        Some(timer) => retry::within(timer, conn.send(r)).await,
                    };
                    // Neither a request a stale connection gave back nor
                    // our own body's error says anything of the endpoint.
                    answered(
                        i,
                        ep,
                        match &outcome {
                            None => Some(true),
                            Some(Ok(resp)) => Some(resp.status().is_server_error()),
                            Some(Err(e)) if reused && e.message().is_some() => None,
                            Some(Err(e)) if e.error().is_user() => None,
                            Some(Err(_)) => Some(true),
                        },
                    );
                    match outcome {
                        None => {
                            last = Some(ran_out()?);
                            continue 'attempts;
                        }
                        Some(Ok(resp)) if retry_status(resp.status()) => {
                            tracing::debug!(upstream = %self.spec.name, endpoint = %ep, status = resp.status().as_u16(), attempt, "answer to retry");
                            continue 'attempts;
                        }
                        Some(Ok(resp)) => {
                            return Ok((
                                resp.map(Body::from),
                                Held {
                                    in_flight: guard,
                                    admitted: admitted.take(),
                                    lease: conn.into_lease(),
                                    read_timeout_ms: 0,
                                    endpoint: answerer(i),
                                },
                            ));
                        }
                        Some(Err(mut e)) => match e.take_message() {
                            Some(back) if reused => {
                                req = Some(back);
                                fresh = true;
                            }
                            // A stream or connection lost before an
                            // answer (an HTTP/2 upstream's REFUSED_STREAM
                            // or GOAWAY as it shuts down), not an answer
                            // that did not parse nor our own body's error.
                            _ if may_retry
                                && self.spec.retry_on_reset
                                && !e.error().is_parse()
                                && !e.error().is_user()
                                && self.retry_fits(&retrying) =>
                            {
                                let e = error_chain(e.error());
                                tracing::debug!(upstream = %self.spec.name, endpoint = %ep, error = %e, attempt, "no answer before the stream ended; retrying");
                                last = Some(ForwardError::Failed(e));
                                continue 'attempts;
                            }
                            _ => return Err(ForwardError::Failed(error_chain(e.error()))),
                        },
                    }
                }
                if last.is_none() {
                    return Err(ForwardError::Failed(
                        "pooled connections kept closing".into(),
                    ));
                }
            }
            Err(last.unwrap_or(ForwardError::Unreachable("no endpoint".into())))
        });
        let result =
            match client_watch::exchange(attempt_all, timeout, client, progress.as_deref()).await {
                Ok(r) => r,
                Err(Cut::TimedOut) => Err(ForwardError::Timeout(timeout)),
                Err(Cut::BodyStalled) => Err(ForwardError::RequestBodyTimeout(timeout)),
                Err(Cut::ClientGone) => Err(ForwardError::ClientGone),
            };
        // However the upstream side reported it (hyper's "user body
        // error", an HTTP/2 reset), a body cut for its size is the
        // client's 413.
        match result {
            Err(_) if progress.as_deref().is_some_and(BodyProgress::too_large) => {
                Err(ForwardError::BodyTooLarge)
            }
            // Likewise a body the client broke is the client's 400; the
            // upstream got a cut body (hyper aborts the request) and no
            // failure counts against it.
            Err(ForwardError::Failed(e))
                if progress.as_deref().is_some_and(BodyProgress::malformed) =>
            {
                Err(ForwardError::RequestBody(e))
            }
            r => r,
        }
    }
}

/// nginx's smooth weighted round robin, run once over a whole cycle:
/// each endpoint index as often as its weight, spread out (3, 1 gives
/// 0 0 1 0, not 0 0 0 1).
fn smooth_schedule(weights: &[u32]) -> Vec<u16> {
    let total: i64 = weights.iter().map(|&w| i64::from(w)).sum();
    let mut current = vec![0i64; weights.len()];
    (0..total)
        .map(|_| {
            for (c, &w) in current.iter_mut().zip(weights) {
                *c += i64::from(w);
            }
            let mut best = 0;
            for i in 1..current.len() {
                if current[i] > current[best] {
                    best = i;
                }
            }
            current[best] -= total;
            best as u16
        })
        .collect()
}

/// An error and its sources on one line: hyper's own message alone
/// ("connection error") does not say what happened.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
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
