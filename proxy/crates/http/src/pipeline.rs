//! The request path shared by every listener: route → (answer | forward).
//!
//! A [`Pipeline`] is built from one [`Config`] and never changes; a reload
//! builds a new one and swaps it in, while requests in flight keep theirs.

use std::borrow::Cow;
use std::cell::RefCell;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use arc_swap::ArcSwap;
use http::header::{self, HeaderValue};
use http::uri::PathAndQuery;
use http::{Method, Request, Response, StatusCode, Version};
use hyper::body::Incoming;
use tokio_util::task::TaskTracker;

use crate::body::{Body, ResponseBody};
use crate::client_watch::ClientSocket;
use crate::forward::{self, ForwardError, Outgoing, UpstreamPool};
use crate::route_state::{self, RouteState};
use crate::{chain, request_head};
use portcullis_config::{Action, Config, Cors, Listener, PathRewrite, Probe, Route, Upstream};
use portcullis_obs::metrics;
use portcullis_obs::telemetry::AccessLog;
use portcullis_plugin as plugin;

/// An extra condition for readiness (the tunnel client's: a tunnel that
/// answers pings).
pub type ReadyGate = Box<dyn Fn() -> bool + Send + Sync>;

/// One tunnel slot of a tunnel client, for its admin endpoint.
#[derive(Debug, Clone)]
pub struct TunnelSlot {
    /// The server it dials.
    pub server: String,
    /// Its number (the server's `slot`).
    pub slot: usize,
    /// `websocket` or `quic` while it has a tunnel.
    pub transport: Option<&'static str>,
    /// True while the server pings through it.
    pub up: bool,
    /// When its tunnel was made, while it has one.
    pub since: Option<std::time::SystemTime>,
    /// How long ago the server last pinged through it.
    pub last_ping: Option<std::time::Duration>,
}

/// The tunnel client's tunnels, for its admin endpoint.
pub type TunnelReport = Box<dyn Fn() -> Vec<TunnelSlot> + Send + Sync>;

/// Process-wide serving state that outlives any one pipeline.
#[derive(Default)]
pub struct Shared {
    phase: AtomicU8,
    gate: std::sync::OnceLock<ReadyGate>,
    tunnels: std::sync::OnceLock<TunnelReport>,
    /// Tasks that must finish before a drained shutdown completes
    /// (connections and spliced upgrades).
    pub tracker: TaskTracker,
}

const STARTING: u8 = 0;
const READY: u8 = 1;
const DRAINING: u8 = 2;

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("phase", &self.phase)
            .finish_non_exhaustive()
    }
}

impl Shared {
    /// Config loaded and listeners bound: `/readyz` turns 200.
    pub fn set_ready(&self) {
        let _ = self
            .phase
            .compare_exchange(STARTING, READY, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Shutting down: `/readyz` turns 503 for good.
    pub fn set_draining(&self) {
        self.phase.store(DRAINING, Ordering::Release);
    }

    /// True while `/readyz` should answer 200.
    pub fn is_ready(&self) -> bool {
        self.phase.load(Ordering::Acquire) == READY && self.gate.get().is_none_or(|ready| ready())
    }

    /// Makes readiness also depend on `gate` (set once).
    pub fn set_gate(&self, gate: ReadyGate) {
        let _ = self.gate.set(gate);
    }

    /// Lists a tunnel client's tunnels in the admin endpoint (set once).
    pub fn set_tunnel_report(&self, report: TunnelReport) {
        let _ = self.tunnels.set(report);
    }

    /// A tunnel client's tunnels; `None` in a plain routing core.
    pub fn tunnels(&self) -> Option<Vec<TunnelSlot>> {
        self.tunnels.get().map(|report| report())
    }

    /// True once shutdown started.
    pub fn is_draining(&self) -> bool {
        self.phase.load(Ordering::Acquire) == DRAINING
    }
}

/// What the pipeline knows about the connection a request came on.
#[derive(Debug)]
pub struct ConnInfo {
    /// The client's address.
    pub client: SocketAddr,
    /// The client's IP as an `X-Forwarded-For` entry, made once per connection.
    pub client_ip: HeaderValue,
    /// The listener's settings.
    pub listener: Arc<Listener>,
    /// Whether the client connection is TLS.
    pub tls: bool,
    /// Its TLS version (`TLSv1.3`), for the access log.
    pub tls_version: Option<&'static str>,
    /// The server name the client asked for in its TLS handshake (SNI).
    pub sni: Option<Arc<str>>,
    /// The client's verified certificate (mutual TLS).
    pub client_cert: Option<Arc<portcullis_net::client_cert::ClientCertificate>>,
    /// The worker thread serving it, which picks its upstream pools.
    pub worker: usize,
    /// Its socket, watched for the client leaving while a request waits
    /// (HTTP/1 only; `None` for requests that come through a tunnel).
    pub socket: Option<ClientSocket>,
    /// Its end by use (the listener's `max_requests_per_connection` and
    /// `connection_lifetime`); here, where each request's future already
    /// holds the connection, so counting costs no reference of its own.
    pub retire: Option<Arc<portcullis_net::drain::Retire>>,
}

impl ConnInfo {
    /// Sets the `X-Forwarded-*` headers of a request from this connection
    /// bound upstream (`claimed`: the client sent an
    /// `X-Forwarded-Client-Cert`; `public_host`: the host it asked for).
    #[inline]
    pub fn set_forwarded(
        &self,
        headers: &mut http::HeaderMap,
        claimed: bool,
        public_host: Option<HeaderValue>,
    ) {
        let proto = if self.tls { "https" } else { "http" };
        forward::set_forwarded(
            headers,
            (
                &self.client_ip,
                self.client_cert.as_ref().map(|c| &c.header),
                claimed,
            ),
            proto,
            public_host,
            self.listener.trust_forwarded_headers,
        );
    }
}

/// One configuration made ready to serve: routes plus upstream pools.
pub struct Pipeline {
    config: Arc<Config>,
    /// Each route's plugin chain.
    chains: plugin::Chains,
    /// Upstream pools per worker thread, so connections stay on the thread
    /// that made them: `upstreams[worker][upstream]`.
    upstreams: Vec<Vec<Arc<UpstreamPool>>>,
    /// Each route's request metrics, by route index.
    stats: Vec<&'static metrics::RouteStats>,
    /// Each route's rate limit, mirror and auth cache, by route index.
    route_states: Vec<RouteState>,
    shared: Arc<Shared>,
}

/// Builds the JSON error answer the proxy gives on its own behalf.
pub fn error_response(
    status: StatusCode,
    message: &str,
    route: Option<&Route>,
    origin: Option<&HeaderValue>,
) -> Response<Body> {
    let mut resp = json_error(status, message, route, None);
    if let (Some(cors), Some(origin)) = (route.and_then(|r| r.error_cors.as_ref()), origin) {
        add_cors(resp.headers_mut(), cors, origin);
    }
    resp
}

/// Takes one request from `limit` for the key it counts by.
fn take_rate(
    limit: &crate::rate_limit::RateLimit,
    conn: &ConnInfo,
    headers: &http::HeaderMap,
) -> Result<(), Duration> {
    use crate::rate_limit::LimitKey;
    let mut buf = [0u8; 16];
    let key = match &limit.key {
        LimitKey::Route => None,
        LimitKey::Header(name) => Some(headers.get(name).map_or(&[][..], |v| v.as_bytes())),
        LimitKey::Client => {
            let trust = conn.listener.trust_forwarded_headers;
            let client = portcullis_net::client_addr::client_of(conn.client.ip(), trust, headers);
            Some(crate::rate_limit::ip_key(client, &mut buf))
        }
    };
    limit.take(key)
}

/// The answer to a request over its route's rate limit: 429 with
/// `Retry-After` (whole seconds, rounded up) saying when one would pass.
fn rate_limited(route: &Route, wait: Duration, origin: Option<&HeaderValue>) -> Response<Body> {
    let mut resp = error_response(
        StatusCode::TOO_MANY_REQUESTS,
        "rate limit exceeded",
        Some(route),
        origin,
    );
    crate::rate_limit::retry_after(resp.headers_mut(), wait);
    resp
}

/// Marks an answer given while the client may still be sending its body
/// (413): its HTTP/1 connection closes after it, and first reads and
/// drops what the client still sends, for a while, as nginx's lingering
/// close does. Closed at once, the socket's unread bytes would make the
/// kernel reset the connection, and a client still writing would see
/// the reset instead of the answer.
#[derive(Clone, Copy, Debug)]
pub struct Linger;

/// The 413 answer to a body over the route's `max_request_body`.
fn too_large(route: &Route, version: Version, origin: Option<&HeaderValue>) -> Response<Body> {
    let resp = error_response(
        StatusCode::PAYLOAD_TOO_LARGE,
        "request body too large",
        Some(route),
        origin,
    );
    closing(resp, version)
}

/// `resp`, closing its HTTP/1 connection after it with a lingering close
/// (HTTP/2 and HTTP/3 reset the one stream instead).
fn closing(mut resp: Response<Body>, version: Version) -> Response<Body> {
    if version < Version::HTTP_2 {
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
        resp.extensions_mut().insert(Linger);
    }
    resp
}

/// The proxy's JSON error answer: `{"error", "status", "route", "plugin"?}`.
pub fn json_error(
    status: StatusCode,
    message: &str,
    route: Option<&Route>,
    plugin: Option<&str>,
) -> Response<Body> {
    let mut body = serde_json::json!({
        "error": message,
        "status": status.as_u16(),
        "route": route.map(|r| &*r.name),
    });
    if let Some(plugin) = plugin {
        body["plugin"] = plugin.into();
    }
    let mut resp = json_response(status, &body);
    // A gRPC client gets it in gRPC's terms (see `grpc_local`).
    resp.extensions_mut()
        .insert(crate::grpc_local::LocalError(message.into()));
    resp
}

/// An answer that must have no body — to a HEAD request (`head`), or a
/// 204 or 304 — without one. hyper drops such a body itself over
/// HTTP/1.1, but over HTTP/2 (and h3 over HTTP/3) it sends what it is
/// given, and DATA there is a protocol error that the client's stack
/// turns into a reset: every HTTP/2 HEAD the proxy answered itself (a
/// health probe, a local answer, its JSON errors) failed so, as did a
/// local or plugin answer of 204 or 304 with a body. A HEAD answer keeps
/// the length the body had declared, as for GET. An upstream's answer,
/// bodiless already, is left as it is.
pub fn bodiless_answer(resp: Response<Body>, head: bool) -> Response<Body> {
    use http_body::Body as _;
    let status = resp.status();
    let never = status == StatusCode::NO_CONTENT || status == StatusCode::NOT_MODIFIED;
    if !(head || never) || resp.body().is_end_stream() {
        return resp;
    }
    let (mut parts, body) = resp.into_parts();
    if !never && let Some(len) = body.size_hint().exact() {
        parts
            .headers
            .entry(header::CONTENT_LENGTH)
            .or_insert_with(|| HeaderValue::from(len));
    }
    Response::from_parts(parts, Body::empty())
}

/// A small JSON answer the proxy makes itself (never cached).
pub fn json_response(status: StatusCode, body: &serde_json::Value) -> Response<Body> {
    let mut resp = Response::new(Body::full(body.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

/// The answer on a listener with `redirect_https`: 308 (the method and
/// body are kept, where 301 lets clients turn a POST into a GET) to the
/// same host, path and query over https on `port`.
fn https_redirect(host: Option<&str>, port: u16, uri: &http::Uri) -> Response<Body> {
    let Some(host) = host else {
        return error_response(
            StatusCode::BAD_REQUEST,
            "a redirect to https needs the request's host",
            None,
            None,
        );
    };
    let bracketed = if host.contains(':') {
        format!("[{host}]")
    } else {
        host.to_owned()
    };
    let port = if port == 443 {
        String::new()
    } else {
        format!(":{port}")
    };
    let target = uri.path_and_query().map_or("/", |pq| pq.as_str());
    let location = format!("https://{bracketed}{port}{target}");
    let mut resp = json_response(
        StatusCode::PERMANENT_REDIRECT,
        &serde_json::json!({ "location": location, "status": 308 }),
    );
    if let Ok(value) = HeaderValue::from_str(&location) {
        resp.headers_mut().insert(header::LOCATION, value);
    }
    resp
}

/// The answer to a request whose framing RFC 9112 says to refuse.
fn refused_response(refused: &request_head::Refused) -> Response<Body> {
    error_response(refused.status(), refused.message(), None, None)
}

fn add_cors(headers: &mut http::HeaderMap, cors: &Cors, origin: &HeaderValue) {
    let listed = origin
        .to_str()
        .is_ok_and(|o| cors.origins.iter().any(|x| x == o));
    if !(cors.allow_any || listed) {
        return;
    }
    // `*` may not be combined with credentials, so echo the origin then.
    let value = if cors.allow_any && !cors.allow_credentials {
        HeaderValue::from_static("*")
    } else {
        origin.clone()
    };
    headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, value);
    if cors.allow_credentials {
        headers.insert(
            header::ACCESS_CONTROL_ALLOW_CREDENTIALS,
            HeaderValue::from_static("true"),
        );
    }
    headers.append(header::VARY, HeaderValue::from_static("Origin"));
}

/// The client socket to watch for a request of `version` on `conn`: HTTP/1
/// only, where the connection polls its requests itself (see
/// `client_watch`).
fn watchable(conn: &ConnInfo, version: Version) -> Option<ClientSocket> {
    conn.socket.filter(|_| version < Version::HTTP_2)
}

/// The pipeline current in `shared`, through a handle of this worker's own.
///
/// A request holds the pipeline it started with until its response head
/// is ready, so a reload never changes a request midway. Cloning the one
/// `Arc<Pipeline>` for that made every worker write the same reference
/// count twice per request, a cache line that then moves between their
/// cores. Each worker instead wraps the current pipeline in an `Arc` of its
/// own, once per reload, and its requests clone that, as Envoy gives each
/// worker its own snapshot of the configuration. The worker keeps the
/// wrapper weakly, so an idle worker never holds an old pipeline after a
/// reload.
pub fn current(shared: &ArcSwap<Pipeline>) -> Arc<Arc<Pipeline>> {
    thread_local! {
        static LOCAL: RefCell<Weak<Arc<Pipeline>>> = const { RefCell::new(Weak::new()) };
    }
    let now = shared.load();
    LOCAL.with(|local| {
        let mut local = local.borrow_mut();
        if let Some(held) = local.upgrade()
            && Arc::ptr_eq(&*held, &*now)
        {
            return held;
        }
        let fresh = Arc::new(arc_swap::Guard::into_inner(now));
        *local = Arc::downgrade(&fresh);
        fresh
    })
}

impl Pipeline {
    /// Prepares a config for serving by `workers` threads. Builds upstream
    /// pools, taking over those of `previous` whose upstream did not change
    /// (a reload keeps their warm connections); opens nothing.
    pub fn new(
        config: Arc<Config>,
        chains: plugin::Chains,
        shared: Arc<Shared>,
        workers: usize,
        previous: Option<&Pipeline>,
    ) -> Pipeline {
        let workers = workers.max(1);
        let mut upstreams: Vec<Vec<Arc<UpstreamPool>>> = (0..workers).map(|_| Vec::new()).collect();
        // The previous pipeline's pools of the upstream `same` finds.
        let earlier = |same: &dyn Fn(&Upstream) -> bool| {
            previous.and_then(|p| {
                let j = p.config.upstreams.iter().position(|old| same(old))?;
                (p.upstreams.len() == workers).then_some((p, j))
            })
        };
        for (i, spec) in config.upstreams.iter().enumerate() {
            let kept = earlier(&|old| old.same_settings(spec));
            // Once per upstream (not per worker's pool), and not again for
            // one a reload keeps.
            if kept.is_none() && spec.tls.insecure_skip_verify && spec.may_use_tls() {
                tracing::warn!(upstream = %spec.name, "TLS certificate verification is off for this upstream");
            }
            // The same upstream with other endpoints (new addresses of
            // its hosts, an endpoint added to the list): the endpoints
            // both list keep their connections and ejections.
            let carried = match kept {
                Some(_) => None,
                None => earlier(&|old| old.same_but_endpoints(spec)),
            };
            let shared = forward::shared_endpoints(spec, carried.map(|(p, j)| &*p.upstreams[0][j]));
            for (w, pools) in upstreams.iter_mut().enumerate() {
                pools.push(match kept {
                    Some((p, j)) => p.upstreams[w][j].clone(),
                    None => Arc::new(UpstreamPool::new(
                        spec.clone(),
                        shared.clone(),
                        carried.map(|(p, j)| &*p.upstreams[w][j]),
                    )),
                });
            }
            // A kept upstream keeps its checks (and what they found).
            if kept.is_none() {
                forward::health::start(&upstreams[0][i]);
            }
            debug_assert_eq!(upstreams[0].len(), i + 1);
        }
        let stats = config
            .routes
            .iter()
            .map(|r| metrics::route(&r.name))
            .collect();
        let route_states =
            route_state::build(&config, previous.map(|p| (&*p.config, &p.route_states[..])));
        Pipeline {
            config,
            chains,
            upstreams,
            stats,
            route_states,
            shared,
        }
    }

    /// The config this pipeline serves.
    pub fn config(&self) -> &Arc<Config> {
        &self.config
    }

    /// Each route's live state, by route index.
    pub fn route_states(&self) -> &[RouteState] {
        &self.route_states
    }

    /// The routes' plugin chains.
    pub fn chains(&self) -> &plugin::Chains {
        &self.chains
    }

    /// What `fact` says of each upstream it says something of, by name:
    /// ejected endpoints, requests in flight, retries. The workers' pools
    /// share these, so the first worker's tell.
    pub fn upstream_facts<T>(
        &self,
        fact: impl Fn(&UpstreamPool) -> Option<T>,
    ) -> Vec<(Arc<str>, T)> {
        self.upstreams.first().map_or_else(Vec::new, |pools| {
            pools
                .iter()
                .filter_map(|p| Some((p.spec.name.clone(), fact(p)?)))
                .collect()
        })
    }

    /// Handles one request end to end (see [`crate::phases`]). Never
    /// fails: every problem becomes an HTTP answer.
    #[inline]
    pub async fn handle(&self, req: Request<Incoming>, conn: &ConnInfo) -> Response<ResponseBody> {
        crate::phases::drive(self, req, conn).await
    }

    async fn route_and_serve<B>(
        &self,
        req: Request<B>,
        conn: &ConnInfo,
        (log, request_id): (&mut Option<Box<AccessLog>>, Option<&HeaderValue>),
        stats: &mut &'static metrics::RouteStats,
    ) -> (Response<Body>, forward::Held)
    where
        B: http_body::Body + Into<Body> + Send,
    {
        let (mut parts, body) = req.into_parts();
        let origin = parts.headers.get(header::ORIGIN).cloned();
        if request_head::head_size(&parts) > conn.listener.max_request_header_size {
            return (
                error_response(
                    StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                    "request header too large",
                    None,
                    None,
                ),
                forward::Held::default(),
            );
        }
        let host = match request_head::request_host(parts.version, &parts.uri, &parts.headers) {
            Ok(host) => host,
            Err(refused) => return (refused_response(&refused), forward::Held::default()),
        };
        if request_head::unsupported_coding(&parts.headers, &body) {
            return (
                refused_response(&request_head::Refused::Coding),
                forward::Held::default(),
            );
        }
        let Some(path) = request_head::normalize_path(parts.uri.path()) else {
            return (
                error_response(StatusCode::BAD_REQUEST, "invalid path", None, None),
                forward::Held::default(),
            );
        };
        let config = &*self.config;
        let found = config.router.lookup(
            host.as_deref().unwrap_or(""),
            &path,
            &parts.method,
            &parts.headers,
            &config.routes,
        );
        if let Some(port) = conn.listener.redirect_https {
            // Health probes stay answered here: a balancer's check wants
            // its 200, not a redirect.
            let probe = found
                .as_ref()
                .is_some_and(|f| matches!(config.routes[f.route].action, Action::Health(_)));
            if !probe {
                return (
                    https_redirect(host.as_deref(), port, &parts.uri),
                    forward::Held::default(),
                );
            }
        }
        let Some(found) = found else {
            return (
                error_response(StatusCode::NOT_FOUND, "no route", None, None),
                forward::Held::default(),
            );
        };
        let route = &config.routes[found.route];
        if let Some(log) = log.as_mut() {
            log.route = Some(route.name.clone());
            log.logging = route.access_log;
        }
        // Read before the headers go upstream; only routes that compress
        // look.
        let coding = route
            .compress
            .as_ref()
            .and_then(|c| crate::compress::negotiate(&parts.headers, c));
        let head = route.compress.is_some() && parts.method == Method::HEAD;
        *stats = self.stats[found.route];
        // Before the plugins: a request over the limit costs no plugin
        // call. Health probes are never limited (a route without a limit).
        let state = &self.route_states[found.route];
        if let Some(limit) = &state.rate_limit
            && let Err(wait) = take_rate(limit, conn, &parts.headers)
        {
            return (
                rate_limited(route, wait, origin.as_ref()),
                forward::Held::default(),
            );
        }
        let mut body: Body = body.into();
        // Also before the plugins: one that reads the body never sees more
        // than the route takes.
        if let Some(max) = route.max_request_body {
            match http_body::Body::size_hint(&body).exact() {
                Some(n) if n > max => {
                    return (
                        too_large(route, parts.version, origin.as_ref()),
                        forward::Held::default(),
                    );
                }
                Some(_) => {}
                None => body.limit(max),
            }
        }
        // Then the auth service, before the plugins: they may act on who
        // it says the user is.
        if let Some(auth) = &route.auth_request {
            let pool = &self.upstreams[conn.worker % self.upstreams.len()][auth.upstream];
            let asked = crate::auth_request::Asked {
                method: &parts.method,
                uri: &parts.uri,
            };
            let context = (conn, &**route, origin.as_ref());
            // Boxed: only routes with an auth request pay for its future.
            let checked = Box::pin(crate::auth_request::check(
                (auth, state.auth_cache.as_deref()),
                pool,
                asked,
                &mut parts.headers,
                context,
            ));
            if let Err(resp) = checked.await {
                // The client may still be sending a body no one will read.
                let resp = if http_body::Body::is_end_stream(&body) {
                    resp
                } else {
                    closing(resp, parts.version)
                };
                return (resp, forward::Held::default());
            }
        }
        // The route's plugins run first, whatever the action, except for
        // health probes (a plugin must not make a pod look dead).
        let mut plugins = None;
        let chain = &self.chains.routes[found.route];
        if !chain.is_empty() && !matches!(route.action, Action::Health(_)) {
            let step = chain::on_request(
                chain,
                &parts.method,
                &parts.uri,
                &mut parts.headers,
                &path,
                &found.params,
                (found.route, route),
                conn,
                config,
            );
            let outcome = match step {
                chain::Step::Done(outcome) => outcome,
                // Boxed: reading the body is a large future, and inline it
                // would make every request's future larger, copied on
                // every move, plugins or not.
                chain::Step::ReadBody(pending) => {
                    Box::pin(pending.read(&mut body, &mut parts.headers, route, config)).await
                }
            };
            match outcome {
                chain::RequestOutcome::Forward(ctx) => plugins = ctx,
                // A body too large for the plugin (or the route), or a
                // plugin's own 413: the client may still be sending it.
                chain::RequestOutcome::Answer(resp)
                    if resp.status() == StatusCode::PAYLOAD_TOO_LARGE =>
                {
                    return (closing(resp, parts.version), forward::Held::default());
                }
                chain::RequestOutcome::Answer(resp) => return (resp, forward::Held::default()),
            }
        }
        let mut resp = match &route.action {
            Action::Health(probe) => {
                let ok = *probe == Probe::Live || self.shared.is_ready();
                let (status, text) = if ok {
                    (StatusCode::OK, "ok\n")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not ready\n")
                };
                let mut r = Response::new(Body::full(text));
                *r.status_mut() = status;
                r.headers_mut()
                    .insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
                r.headers_mut()
                    .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
                r
            }
            Action::Redirect(redirect) => match redirect_to(redirect, &found.params, &parts.uri) {
                Some(location) => {
                    let mut r = Response::new(Body::empty());
                    *r.status_mut() = redirect.status;
                    r.headers_mut().insert(header::LOCATION, location);
                    r
                }
                None => error_response(
                    StatusCode::BAD_REQUEST,
                    "invalid path parameter for the redirect",
                    Some(route),
                    origin.as_ref(),
                ),
            },
            Action::Respond(local) => {
                let mut r = Response::new(Body::full(local.body.clone()));
                *r.status_mut() = local.status;
                for (k, v) in &local.headers {
                    r.headers_mut().append(k.clone(), v.clone());
                }
                r
            }
            Action::Forward(i) => {
                let upstream = plugins.as_ref().and_then(|c| c.upstream).unwrap_or(*i);
                let pool = &self.upstreams[conn.worker % self.upstreams.len()][upstream];
                if let Some(log) = log.as_mut() {
                    log.upstream = Some(pool.spec.name.clone());
                }
                let plugin_path = plugins.as_mut().and_then(|p| p.path.take());
                let new_path = match plugin_path.map(Ok).unwrap_or_else(|| {
                    rewritten_path(
                        route,
                        &path,
                        matches!(path, Cow::Borrowed(_)),
                        &parts.uri,
                        &found.params,
                    )
                }) {
                    Ok(p) => p,
                    Err(e) => {
                        return (
                            error_response(
                                StatusCode::BAD_REQUEST,
                                &e,
                                Some(route),
                                origin.as_ref(),
                            ),
                            forward::Held::default(),
                        );
                    }
                };
                let upgrade = route.websocket
                    && parts.version == Version::HTTP_11
                    && forward::is_websocket_upgrade(&parts.headers);
                let client_upgrade = if upgrade {
                    parts.extensions.remove::<hyper::upgrade::OnUpgrade>()
                } else {
                    None
                };
                let mut headers = std::mem::take(&mut parts.headers);
                let claimed = forward::remove_hop_by_hop(&mut headers, upgrade);
                forward::join_cookie_crumbs(&mut headers);
                // The key as the client sent it, before the forwarded
                // headers are ours.
                let (affinity, set_cookie) = match pool.affinity(
                    conn.client.ip(),
                    conn.listener.trust_forwarded_headers,
                    &headers,
                ) {
                    Some((key, cookie)) => (Some(key), cookie),
                    None => (None, None),
                };
                // HTTP/2 clients send the host as :authority, HTTP/1 as Host.
                let public_host = match parts.uri.authority() {
                    Some(a) => HeaderValue::from_str(a.as_str()).ok(),
                    None => headers.get(header::HOST).cloned(),
                };
                conn.set_forwarded(&mut headers, claimed, public_host);
                if !pool.spec.preserve_host {
                    headers.remove(header::HOST);
                }
                if !route.request_headers.is_empty() {
                    route.request_headers.apply(&mut headers);
                }
                let timeout = route.timeout.unwrap_or(pool.spec.timeouts.request);
                // A share of the route's requests goes to its mirror too.
                let body = match &state.mirror {
                    Some(mirror) if mirror.takes() => {
                        let to = self.upstreams[conn.worker % self.upstreams.len()]
                            [mirror.upstream]
                            .clone();
                        let head = (&parts.method, &new_path, &headers);
                        // Boxed: only mirrored routes pay for its future.
                        let copied = Box::pin(crate::mirror::copy(mirror, to, head, body, timeout));
                        match copied.await {
                            Ok(body) => body,
                            Err(e) => {
                                log_forward_error(route, &pool.spec.name, &e, request_id);
                                let status = e.status();
                                let message = e.public_message();
                                return (
                                    error_response(status, message, Some(route), origin.as_ref()),
                                    forward::Held::default(),
                                );
                            }
                        }
                    }
                    _ => body,
                };
                let out = Outgoing {
                    method: parts.method.clone(),
                    path: new_path,
                    headers,
                    body,
                    affinity,
                };
                let watch = watchable(conn, parts.version);
                // Only a request that is logged reads the clock here.
                let asked = log.is_some().then(Instant::now);
                let sent = pool.send(out, &found.params, timeout, watch).await;
                // Only an upgrade the client asked for may switch protocols
                // (the own reader refuses the rest itself; hyper's does not).
                let sent = sent.and_then(|(resp, held)| {
                    if resp.status() == StatusCode::SWITCHING_PROTOCOLS && client_upgrade.is_none()
                    {
                        Err(ForwardError::Failed(
                            "upstream switched protocols without being asked".into(),
                        ))
                    } else {
                        Ok((resp, held))
                    }
                });
                match sent {
                    Ok((mut resp, held)) => {
                        if let (Some(log), Some(asked)) = (log.as_mut(), asked) {
                            log.upstream_header = Some(asked.elapsed());
                            log.endpoint = answered_by(pool, &held, &found.params);
                        }
                        if let Some(cookie) = set_cookie {
                            resp.headers_mut().append(header::SET_COOKIE, cookie);
                        }
                        if let Some(client_upgrade) = client_upgrade
                            .filter(|_| resp.status() == StatusCode::SWITCHING_PROTOCOLS)
                        {
                            let upstream_upgrade = hyper::upgrade::on(&mut resp);
                            forward::upgrade::splice(
                                &self.shared.tracker,
                                client_upgrade,
                                upstream_upgrade,
                                route.name.clone(),
                            );
                            let (parts, _) = resp.into_parts();
                            let mut r = Response::from_parts(parts, Body::empty());
                            *r.version_mut() = Version::HTTP_11;
                            return (r, forward::Held::default());
                        }
                        let (mut parts, body) = resp.into_parts();
                        // Before the hop-by-hop pass takes Transfer-Encoding.
                        forward::single_content_length(&mut parts.headers);
                        let _ = forward::remove_hop_by_hop(&mut parts.headers, false);
                        if let Some(ctx) = plugins.as_mut()
                            && let Some(answer) = chain::on_response(ctx, route, &mut parts)
                        {
                            return (answer, forward::Held::default());
                        }
                        parts.version = Version::HTTP_11;
                        let mut r = Response::from_parts(parts, body);
                        if !route.response_headers.is_empty() {
                            route.response_headers.apply(r.headers_mut());
                        }
                        if let Some(settings) = &route.compress {
                            r = crate::compress::apply(settings, coding, head, r);
                        }
                        return (r, held.with_read_timeout(pool.spec.timeouts.read));
                    }
                    Err(ForwardError::BodyTooLarge) => {
                        let e = ForwardError::BodyTooLarge;
                        log_forward_error(route, &pool.spec.name, &e, request_id);
                        return (
                            too_large(route, parts.version, origin.as_ref()),
                            forward::Held::default(),
                        );
                    }
                    Err(e) => {
                        log_forward_error(route, &pool.spec.name, &e, request_id);
                        return (
                            error_response(
                                e.status(),
                                e.public_message(),
                                Some(route),
                                origin.as_ref(),
                            ),
                            forward::Held::default(),
                        );
                    }
                }
            }
        };
        if !route.response_headers.is_empty() {
            route.response_headers.apply(resp.headers_mut());
        }
        if let Some(settings) = &route.compress {
            resp = crate::compress::apply(settings, coding, head, resp);
        }
        (resp, forward::Held::default())
    }
}

impl crate::phases::Phases for Pipeline {
    type Conn = ConnInfo;

    #[inline]
    fn entry<'c>(&self, conn: &'c ConnInfo, version: Version) -> crate::phases::Entry<'c> {
        crate::phases::Entry {
            client: conn.client,
            worker: conn.worker,
            tls_version: conn.tls_version,
            client_cert: conn.client_cert.as_ref(),
            request_ids: conn.listener.request_id,
            counted: Some(metrics::unrouted()),
            watch: watchable(conn, version),
        }
    }

    #[inline]
    fn trace(
        &self,
        conn: &ConnInfo,
    ) -> Option<(
        &Arc<portcullis_config::Tracing>,
        &Arc<UpstreamPool>,
        portcullis_obs::otlp::Arrival,
    )> {
        let tracing = self.config.tracing.as_ref()?;
        let pool = &self.upstreams[conn.worker % self.upstreams.len()][tracing.upstream];
        let from = portcullis_obs::otlp::Arrival {
            peer: conn.client.ip(),
            trust_forwarded: conn.listener.trust_forwarded_headers,
            https: conn.tls,
            trust_traceparent: tracing.trust_incoming,
        };
        Some((tracing, pool, from))
    }

    #[inline]
    fn serve<B>(
        &self,
        req: Request<B>,
        conn: &ConnInfo,
        ctx: &mut crate::phases::RequestCtx,
    ) -> impl std::future::Future<Output = (Response<Body>, forward::Held)> + Send
    where
        B: http_body::Body + Into<Body> + Send,
    {
        let (log, request_id, stats) = ctx.parts();
        self.route_and_serve(req, conn, (log, request_id), stats)
    }
}

/// Which endpoint gave `held`'s answer, for the access line.
fn answered_by(
    pool: &forward::UpstreamPool,
    held: &forward::Held,
    params: &matchit::Params<'_, '_>,
) -> Option<portcullis_obs::telemetry::AnsweredBy> {
    use portcullis_obs::telemetry::AnsweredBy;
    match (&pool.spec.target, held.endpoint()) {
        (portcullis_config::Target::Endpoints(_), Some(i)) => {
            Some(AnsweredBy::Endpoint(pool.spec.clone(), i))
        }
        (portcullis_config::Target::Template(t), _) => {
            let url = t.render(|name| params.get(name)).ok()?;
            let uri = http::Uri::try_from(url).ok()?;
            Some(AnsweredBy::Rendered(uri.authority()?.as_str().to_owned()))
        }
        _ => None,
    }
}

fn log_forward_error(
    route: &Route,
    upstream: &str,
    e: &ForwardError,
    request_id: Option<&HeaderValue>,
) {
    let request_id = portcullis_obs::request_id::text(request_id);
    match e {
        ForwardError::BadTarget(_) => {
            tracing::info!(route = %route.name, upstream, request_id, error = %e, "bad request target")
        }
        // Every request over the cap would log one: the access log and
        // the 503s counted by route say it already.
        ForwardError::Overloaded(_) => {
            tracing::debug!(route = %route.name, upstream, request_id, error = %e, "upstream overloaded")
        }
        // Not the upstream's failure: the access line's 499 says it, as
        // it does for an HTTP/2 client's reset, which logs nothing else.
        ForwardError::ClientGone => {
            tracing::debug!(route = %route.name, upstream, request_id, error = %e, "client left before the answer")
        }
        ForwardError::RequestBody(_)
        | ForwardError::RequestBodyTimeout(_)
        | ForwardError::BodyTooLarge => {
            tracing::info!(route = %route.name, upstream, request_id, error = %e, "request body not received")
        }
        _ => {
            tracing::warn!(route = %route.name, upstream, request_id, error = %e, "upstream request failed")
        }
    }
}

/// The `Location` of a route's redirect: its template filled from the
/// path parameters, the request's query after it unless stripped. `None`
/// when a parameter cannot go where it lands (a host part).
fn redirect_to(
    redirect: &portcullis_config::Redirect,
    params: &matchit::Params,
    uri: &http::Uri,
) -> Option<HeaderValue> {
    let mut to = redirect.to.render(|n| params.get(n)).ok()?;
    // A path that starts with `//` (or `/\`) is another host to a
    // browser: a parameter must not turn `/{rest}` into one.
    if to.starts_with('/') {
        let slashes = to.len() - to.trim_start_matches(['/', '\\']).len();
        to.replace_range(..slashes, "/");
    }
    if redirect.keep_query
        && let Some(query) = uri.query()
    {
        to.push(if to.contains('?') { '&' } else { '?' });
        to.push_str(query);
    }
    HeaderValue::from_str(&to).ok()
}

/// The path and query to send upstream, after the route's rewrite.
fn rewritten_path(
    route: &Route,
    path: &str,
    unchanged: bool,
    uri: &http::Uri,
    params: &matchit::Params,
) -> Result<PathAndQuery, String> {
    let new: Cow<str> = match &route.rewrite {
        // The common case: nothing changed, so reuse the received bytes.
        PathRewrite::Keep if unchanged => {
            return Ok(uri
                .path_and_query()
                .cloned()
                .unwrap_or_else(|| PathAndQuery::from_static("/")));
        }
        PathRewrite::Keep => Cow::Borrowed(path),
        PathRewrite::StripPrefix(prefix) => match path.strip_prefix(prefix.as_str()) {
            Some("") => Cow::Borrowed("/"),
            Some(rest) if rest.starts_with('/') => Cow::Borrowed(rest),
            _ => Cow::Borrowed(path),
        },
        PathRewrite::Template(t) => Cow::Owned(t.render(|n| params.get(n))?),
    };
    let full: Cow<str> = match uri.query() {
        Some(q) => Cow::Owned(format!("{new}?{q}")),
        None => new,
    };
    PathAndQuery::try_from(full.as_ref()).map_err(|e| format!("rewritten path is invalid: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pipeline() -> Pipeline {
        let source = portcullis_config::Source {
            name: "t.yaml".into(),
            text: "routes: [{ name: ok, match: { path: /ok }, respond: { status: 200 } }]".into(),
        };
        let config = portcullis_config::load_sources(&[source], &|_| None).unwrap();
        Pipeline::new(
            Arc::new(config),
            plugin::Chains::default(),
            Arc::default(),
            1,
            None,
        )
    }

    #[test]
    fn a_worker_shares_its_handle_while_held_and_follows_a_reload() {
        let shared = ArcSwap::from_pointee(pipeline());
        let first = current(&shared);
        assert!(Arc::ptr_eq(&*first, &shared.load_full()));
        // While a request holds it, the next request gets the same handle.
        let again = current(&shared);
        assert!(Arc::ptr_eq(&first, &again));
        assert_eq!(Arc::strong_count(&first), 2);
        // After a reload, the new pipeline; the old one stays with the
        // requests holding it.
        let old = Arc::downgrade(&*first);
        shared.store(Arc::new(pipeline()));
        let after = current(&shared);
        assert!(Arc::ptr_eq(&*after, &shared.load_full()));
        assert!(!Arc::ptr_eq(&after, &first));
        // Once they end, nothing of the worker's keeps it alive.
        drop((first, again));
        assert!(
            old.upgrade().is_none(),
            "the old pipeline outlived its requests"
        );
        // And with no request holding a handle, none is kept.
        let gone = Arc::downgrade(&after);
        drop(after);
        assert!(gone.upgrade().is_none());
    }
}
