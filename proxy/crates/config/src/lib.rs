//! Policy files → one validated, immutable runtime model.
//!
//! YAML is parsed into the raw structs of [`raw`] (unknown keys rejected),
//! then [`build`] checks everything at once and produces a [`Config`]. Every
//! error carries `file:line:column`; all of them are collected, not just the
//! first, so `portcullis check` can list them together.

mod build;
pub mod builtin_plugins;
pub mod envsubst;
mod features;
mod load;
mod raw;
pub mod router;
pub mod template;
mod units;

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http::uri::{Authority, Scheme};
use http::{HeaderName, HeaderValue, Method, StatusCode};
use rustls_pki_types::CertificateDer;

pub use build::{
    DEFAULT_KEEPALIVE_TIMEOUT, DEFAULT_MAX_HEADER_SIZE, MAX_PLUGIN_MEMORY, upstream_at,
};
pub use features::{
    AuthCacheSpec, Compression, DEFAULT_BROTLI, DEFAULT_LEVEL, DEFAULT_MIN_SIZE, DEFAULT_TYPES,
    LimitKey, MirrorSpec, RateLimitSpec, RequestIds, Tracing,
};
pub use load::{
    Source, default_sources, load_dir, load_dir_with_env, load_partial, load_policies,
    load_sources, read_dir, sort_errors,
};
pub use template::Template;
pub use units::{parse_duration, parse_rate, parse_size};

pub use router::{HostMatch, Matched, Router};

/// Where something was written in the policy files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pos {
    /// The file as it was named when loaded (directory joined with file name).
    pub file: Arc<str>,
    /// 1-based line; 0 for the file (or directory) as a whole.
    pub line: u64,
    /// 1-based column.
    pub column: u64,
}

impl fmt::Display for Pos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `dir:0:0:` would send an editor to a line that does not exist.
        if self.line == 0 {
            return f.write_str(&self.file);
        }
        write!(f, "{}:{}:{}", self.file, self.line, self.column)
    }
}

/// One problem in the policy files.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{pos}: {message}")]
pub struct ConfigError {
    /// Where the problem is.
    pub pos: Pos,
    /// What is wrong and, where it helps, what to do.
    pub message: String,
}

/// Every problem found in one load; never empty.
#[derive(Debug, Clone, thiserror::Error)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

/// The validated configuration: listeners, upstreams, routes and the router
/// that picks a route for a request. Immutable once built (a changed
/// copy, such as new upstream addresses, is a new config).
#[derive(Debug, Clone)]
pub struct Config {
    /// Listeners to bind, in file order.
    pub listeners: Vec<Listener>,
    /// Upstreams, indexed by [`Action::Forward`].
    pub upstreams: Vec<Arc<Upstream>>,
    /// Routes, indexed by the router's matches.
    pub routes: Vec<Arc<Route>>,
    /// Host and path lookup over `routes`.
    pub router: Router,
    /// Plugin modules, indexed by [`PluginUse::plugin`].
    pub plugins: Vec<Arc<PluginModule>>,
    /// Plugins run for every route before the route's own.
    pub global_plugins: Vec<PluginUse>,
    /// Spans to an OpenTelemetry collector, when the policies say so.
    pub tracing: Option<Arc<Tracing>>,
    /// Files read besides the policy files themselves (plugins, CA files,
    /// secrets), so a reload can watch where they live.
    pub files: Vec<std::path::PathBuf>,
    /// SHA-256 over everything the config was built from: policy texts,
    /// plugin modules, CA certificates and resolved plugin configs
    /// (secrets included). Equal fingerprints mean nothing to reload.
    pub fingerprint: [u8; 32],
}

impl Config {
    /// The index of the upstream called `name`.
    pub fn upstream_index(&self, name: &str) -> Option<usize> {
        self.upstreams.iter().position(|u| &*u.name == name)
    }

    /// The request timeout of `route`: its own, or its upstream's, or the
    /// default for a route that answers itself.
    pub fn request_timeout(&self, route: &Route) -> std::time::Duration {
        route.timeout.unwrap_or(match route.action {
            Action::Forward(i) => self.upstreams[i].timeouts.request,
            _ => build::DEFAULT_REQUEST_TIMEOUT,
        })
    }
}

/// A plugin's WebAssembly component, read from disk.
#[derive(Debug)]
pub struct PluginModule {
    /// Name routes use.
    pub name: Arc<str>,
    /// The file it was read from.
    pub path: std::path::PathBuf,
    /// The component's bytes.
    pub bytes: Arc<[u8]>,
    /// SHA-256 of the bytes (also the compile cache key).
    pub sha256: [u8; 32],
    /// Where it was defined.
    pub defined_at: Pos,
}

/// What a plugin failure does to the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailMode {
    /// Answer that request with an error (500, or 503 on timeout).
    Closed,
    /// Let the request through as if the plugin had not been there.
    Open,
}

/// A plugin attached to a route (or globally), with its config.
#[derive(Debug, Clone)]
pub struct PluginUse {
    /// Index into `Config::plugins`.
    pub plugin: usize,
    /// The config handed to the plugin, as JSON (env and files resolved).
    pub config_json: String,
    /// Failure policy.
    pub fail: FailMode,
    /// Deadline per call, in CPU time the call uses.
    pub timeout: Duration,
    /// Memory cap per instance, bytes.
    pub memory: usize,
    /// A new instance for every request (nothing can carry over between
    /// requests) instead of reusing idle ones.
    pub fresh_instances: bool,
    /// Where it was attached.
    pub defined_at: Pos,
}

/// A TCP listener that serves HTTP/1.1 and cleartext HTTP/2 on one port.
#[derive(Debug, Clone)]
pub struct Listener {
    /// Unique name, used in logs.
    pub name: String,
    /// Address to bind; port 0 picks a free port.
    pub bind: SocketAddr,
    /// Connections served at once; further clients wait in the accept queue.
    pub max_connections: usize,
    /// Time a request head may take: a new connection's first from the
    /// accept, a later one on a keep-alive connection from its first byte.
    pub header_read_timeout: Duration,
    /// Time an idle keep-alive connection may wait for its next request
    /// after a response (a head it starts has `header_read_timeout`).
    pub keepalive_timeout: Duration,
    /// Requests a client connection carries before it is closed (nginx's
    /// `keepalive_requests`): the last HTTP/1.1 answer says `Connection:
    /// close`, HTTP/2 gets a GOAWAY; 0: no limit.
    pub max_requests_per_connection: u32,
    /// How long a client connection is kept, from its accept, before the
    /// next answer closes it the same way (nginx's `keepalive_time`,
    /// Envoy's `max_connection_duration`); zero: no limit.
    pub connection_lifetime: Duration,
    /// Largest request head (request line and headers) accepted; larger gets 431.
    pub max_request_header_size: usize,
    /// Keep `X-Forwarded-Proto`/`-Host` from the client (behind an ingress controller).
    pub trust_forwarded_headers: bool,
    /// Connections start with a PROXY protocol header (version 1 or 2)
    /// giving the client's address (behind a TCP balancer).
    pub proxy_protocol: bool,
    /// What the listener does with each request's `X-Request-Id`.
    pub request_id: RequestIds,
    /// HTTPS: the handshake's settings; `None` for cleartext.
    pub tls: Option<ListenerTls>,
    /// Answer every request (but health probes) with a redirect to the
    /// same URL over https, on this port.
    pub redirect_https: Option<u16>,
    /// Where the listener was defined.
    pub defined_at: Pos,
}

/// A listener's TLS: its certificate (read again when the files change)
/// and whether clients must present one.
#[derive(Clone)]
pub struct ListenerTls {
    /// The handshake, ready to run.
    pub acceptor: tokio_rustls::TlsAcceptor,
    /// The certificate file, for logs.
    pub cert: PathBuf,
    /// The certificates served, for their expiry.
    pub certificates: Arc<portcullis_net::cert_files::ByServerName>,
    /// Which client certificates it asks for.
    pub client_auth: ClientAuthMode,
    /// A digest of its client CA and session ticket keys (not of its
    /// certificates, which are reread at handshakes), for the config's
    /// fingerprint.
    pub material: [u8; 32],
}

/// Whether a listener asks for client certificates (`client_ca`), and
/// whether a client may go without one (`client_auth: optional`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuthMode {
    /// No `client_ca`: no client certificates.
    Off,
    /// Every client presents one from `client_ca`.
    Required,
    /// A client may present none; one it presents must be valid.
    Optional,
}

impl ClientAuthMode {
    /// As `/status` shows it.
    pub fn as_str(self) -> &'static str {
        match self {
            ClientAuthMode::Off => "off",
            ClientAuthMode::Required => "required",
            ClientAuthMode::Optional => "optional",
        }
    }
}

impl std::fmt::Debug for ListenerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenerTls")
            .field("cert", &self.cert)
            .field("client_auth", &self.client_auth)
            .finish_non_exhaustive()
    }
}

/// How requests are spread over an upstream's endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Balance {
    /// Each endpoint in turn.
    RoundRobin,
    /// The endpoint with the fewest requests in flight.
    LeastRequests,
    /// The endpoint a key of the request picks (see [`HashOn`]), the same
    /// for the same key in every worker and replica.
    Hash,
}

/// What `balance: hash` picks an endpoint by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HashOn {
    /// The client's address (the connection's, its PROXY header's, or on
    /// a listener that trusts forwarded headers the last
    /// `X-Forwarded-For` entry), as nginx's `ip_hash`.
    Client,
    /// A request header's value.
    Header(HeaderName),
    /// A cookie's value (a session).
    Cookie(String),
}

/// Upstream timeouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// TCP (and TLS) connection establishment.
    pub connect: Duration,
    /// From sending the request to receiving the response head.
    pub request: Duration,
    /// The longest the upstream may send nothing while its response body
    /// is waited on (nginx's `proxy_read_timeout` for the body); zero:
    /// no limit.
    pub read: Duration,
    /// How long an unused pooled connection is kept.
    pub idle: Duration,
    /// How long a connection is reused at most, counted from its dial
    /// (nginx's `keepalive_time`, Envoy's `max_connection_duration`):
    /// then it is closed once its request is done, so connections through
    /// a ClusterIP Service move to pods that came up since; zero: no limit.
    pub lifetime: Duration,
}

/// Which requests of a route get an access line (nginx's `access_log
/// off` in a location; Envoy's status-code access log filter).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AccessLogging {
    /// Every request.
    #[default]
    All,
    /// Answers of 400 and above only: a health route probed every few
    /// seconds logs its failures, not its successes.
    Errors,
    /// None.
    Off,
}

/// A route's auth subrequest: see [`portcullis_http::auth_request`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthRequest {
    /// The auth service (an upstream with endpoints), by index.
    pub upstream: usize,
    /// The path and query asked for.
    pub path: http::uri::PathAndQuery,
    /// Headers of an allowing answer copied onto the forwarded request
    /// (a client's own copies are removed first).
    pub copy_headers: Vec<HeaderName>,
    /// Where a 401 redirects instead, with `{url}` replaced by the
    /// original URL, percent-encoded.
    pub signin: Option<String>,
    /// For the auth service's whole answer.
    pub timeout: Duration,
    /// Allowing answers kept for a while, if set.
    pub cache: Option<AuthCacheSpec>,
}

/// Active health checks of an upstream's endpoints (Envoy's
/// `health_checks`, HAProxy's `check`): each endpoint is asked for `path`
/// every `interval`; 2xx and 3xx pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HealthCheck {
    /// Path and query asked for (after the endpoint's base path).
    pub path: String,
    pub interval: Duration,
    /// For the whole probe: connect, TLS, the answer's head.
    pub timeout: Duration,
    /// Failed probes in a row that take an endpoint out of the rotation.
    pub unhealthy_after: u32,
    /// Passed probes in a row that bring it back.
    pub healthy_after: u32,
}

/// TLS settings for `https` endpoints.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsSettings {
    /// Extra trusted roots (from `ca_file`); the system roots are trusted too.
    pub ca_certs: Vec<CertificateDer<'static>>,
    /// Name to verify and send as SNI instead of the endpoint host.
    pub server_name: Option<String>,
    /// Skip certificate verification (testing only; logged loudly).
    pub insecure_skip_verify: bool,
}

/// One fixed upstream address: `scheme://authority[/base]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    /// `http` or `https`.
    pub scheme: Scheme,
    /// Host and port; the host is resolved at connect time.
    pub authority: Authority,
    /// A path prefix put before every forwarded path, without trailing `/`.
    pub base_path: Option<Arc<str>>,
    /// The `Host` header for this endpoint, made once rather than per request.
    pub host_header: HeaderValue,
    /// Its share of the requests against the others' (nginx's `weight=`):
    /// 1 unless written after the URL.
    pub weight: u32,
    /// With `dns: each_address`, the one address of the host this
    /// endpoint stands for (the host still names it in `Host`, SNI and
    /// certificate checks); `None`: the host is looked up at connect time.
    pub address: Option<std::net::SocketAddr>,
}

impl std::fmt::Display for Endpoint {
    /// The authority, and the address when the endpoint is one of its
    /// host's: `api-headless:8080 (10.1.2.3)`, so logs tell pods apart.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.address {
            Some(a) => write!(f, "{} ({})", self.authority, a.ip()),
            None => f.write_str(self.authority.as_str()),
        }
    }
}

impl Endpoint {
    /// An endpoint from a parsed URL; `None` without scheme or host.
    pub fn from_uri(uri: &http::Uri) -> Option<Endpoint> {
        let authority = uri.authority()?.clone();
        Some(Endpoint {
            scheme: uri.scheme()?.clone(),
            host_header: HeaderValue::from_str(authority.as_str()).ok()?,
            authority,
            base_path: Some(uri.path().trim_end_matches('/'))
                .filter(|p| !p.is_empty())
                .map(Into::into),
            weight: 1,
            address: None,
        })
    }
}

/// Where an upstream's requests go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A fixed set of endpoints, balanced.
    Endpoints(Vec<Endpoint>),
    /// A URL built per request from the route's path parameters.
    Template(Template),
}

/// How an upstream's endpoint hosts become the addresses it connects to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Dns {
    /// Each host is looked up as a connection is made, and is one endpoint
    /// whatever its addresses (a ClusterIP Service: its one address
    /// balances).
    Connect,
    /// Every address a host has is an endpoint of its own (a headless
    /// Service's pods; Envoy's `STRICT_DNS`), looked up again every
    /// `refresh`; `declared` are the endpoints as written, which the
    /// upstream's `target` expands.
    EachAddress {
        /// How often hosts are looked up again.
        refresh: Duration,
        /// The endpoints as the policy lists them.
        declared: Arc<[Endpoint]>,
    },
}

/// A named destination with its connection settings.
#[derive(Debug, Clone)]
pub struct Upstream {
    /// Name used by routes and logs.
    pub name: Arc<str>,
    /// Endpoints or URL template.
    pub target: Target,
    /// Balancing across endpoints.
    pub balance: Balance,
    /// With `balance: hash`, what picks the endpoint.
    pub hash_on: HashOn,
    /// With `hash_on: cookie:NAME`, a request without the cookie gets one
    /// with this Max-Age (Envoy's hash-policy cookie `ttl`); `None`: it
    /// goes round robin.
    pub hash_cookie_ttl: Option<Duration>,
    /// Timeouts.
    pub timeouts: Timeouts,
    /// Extra attempts, each on another endpoint, for requests whose
    /// connection could not be made (nothing was sent, so any method).
    pub retries: u32,
    /// How long an endpoint whose connect failed stays out of the
    /// rotation; zero: never taken out.
    pub eject_for: Duration,
    /// Answers in a row that are 5xx, or none at all (the connection
    /// lost, the try timed out), after which an endpoint is out for
    /// `eject_for` too (Envoy's `consecutive_5xx` outlier detection);
    /// `None`: only failed connects eject.
    pub eject_after_5xx: Option<u32>,
    /// Answer statuses (502, 503, 504) after which an idempotent request
    /// in hand is sent again, up to `retries` times (Envoy's `retry_on`
    /// `gateway-error`, nginx's `proxy_next_upstream http_503`).
    pub retry_on: Vec<u16>,
    /// `retry_on: [reset]`: also send such a request again when its
    /// connection (or HTTP/2 stream) ended after it was sent, before any
    /// answer came (Envoy's `reset`, nginx's default `proxy_next_upstream
    /// error`).
    pub retry_on_reset: bool,
    /// How long each try of a request that `retry_on` may send again
    /// waits for its answer before the next try (Envoy's
    /// `per_try_timeout`; it counts as a 504); `None`: the request
    /// timeout alone.
    pub per_try_timeout: Option<Duration>,
    /// The share of the upstream's requests that may be `retry_on`
    /// retries at once.
    pub retry_budget: RetryBudget,
    /// Requests in flight to the upstream (all endpoints, all workers)
    /// beyond which more are answered 503 at once (Envoy's circuit
    /// breaker `max_requests`); `None`: no cap.
    pub max_requests: Option<usize>,
    /// Requests one connection carries at most before it is closed
    /// (nginx's `keepalive_requests`, Envoy's
    /// `max_requests_per_connection`); 0: no limit.
    pub max_requests_per_connection: u32,
    /// Active health checks, if any.
    pub health_check: Option<HealthCheck>,
    /// TLS for `https` endpoints.
    pub tls: TlsSettings,
    /// Speak HTTP/2 to the upstream (prior knowledge on cleartext, ALPN on TLS).
    pub http2: bool,
    /// Send the client's `Host` instead of the endpoint's.
    pub preserve_host: bool,
    /// How endpoint hosts become addresses.
    pub dns: Dns,
    /// Where the upstream was defined.
    pub defined_at: Pos,
}

impl Upstream {
    /// Whether requests to this upstream may go over TLS: an `https`
    /// endpoint, or a URL template (its scheme is known per request).
    pub fn may_use_tls(&self) -> bool {
        match &self.target {
            Target::Endpoints(eps) => eps.iter().any(|e| e.scheme == Scheme::HTTPS),
            Target::Template(_) => true,
        }
    }

    /// True when `other` connects the same way, wherever it was written: a
    /// reload then keeps this upstream's pooled connections.
    pub fn same_settings(&self, other: &Upstream) -> bool {
        self.target == other.target && self.same_connecting(other)
    }

    /// Whether `other` is this upstream with the same settings, its
    /// endpoints aside: connections to the endpoints both list can be kept.
    pub fn same_but_endpoints(&self, other: &Upstream) -> bool {
        matches!(
            (&self.target, &other.target),
            (Target::Endpoints(_), Target::Endpoints(_))
        ) && self.same_connecting(other)
    }

    /// Everything but the target.
    fn same_connecting(&self, other: &Upstream) -> bool {
        self.name == other.name
            && self.dns == other.dns
            && self.balance == other.balance
            && self.hash_on == other.hash_on
            && self.hash_cookie_ttl == other.hash_cookie_ttl
            && self.timeouts == other.timeouts
            && self.retries == other.retries
            && self.eject_for == other.eject_for
            && self.eject_after_5xx == other.eject_after_5xx
            && self.health_check == other.health_check
            && self.max_requests_per_connection == other.max_requests_per_connection
            && self.max_requests == other.max_requests
            && self.retry_on == other.retry_on
            && self.retry_on_reset == other.retry_on_reset
            && self.per_try_timeout == other.per_try_timeout
            && self.retry_budget == other.retry_budget
            && self.tls == other.tls
            && self.http2 == other.http2
            && self.preserve_host == other.preserve_host
    }
}

/// How many `retry_on` retries an upstream lets run at once (Envoy's
/// `retry_budget`): `percent` of its requests in flight, and never fewer
/// than `min_concurrent`. During an outage every request may fail once;
/// without a bound, retrying them all would double the load on what is
/// left of the upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryBudget {
    /// Retries in flight as a share of requests in flight, 1 to 100.
    pub percent: u32,
    /// Retries always allowed at once, however few requests are in flight.
    pub min_concurrent: usize,
}

impl Default for RetryBudget {
    /// Envoy's defaults.
    fn default() -> RetryBudget {
        RetryBudget {
            percent: 20,
            min_concurrent: 3,
        }
    }
}

impl RetryBudget {
    /// Whether one more retry fits, with `retrying` retries and
    /// `requests` requests in flight.
    pub fn allows(&self, retrying: usize, requests: usize) -> bool {
        let share = requests.saturating_mul(self.percent as usize) / 100;
        retrying < share.max(self.min_concurrent)
    }
}

/// Header changes applied in order: remove, set, add.
#[derive(Debug, Clone, Default)]
pub struct HeaderEdits {
    /// Headers appended (kept alongside existing values).
    pub add: Vec<(HeaderName, HeaderValue)>,
    /// Headers replaced.
    pub set: Vec<(HeaderName, HeaderValue)>,
    /// Headers removed.
    pub remove: Vec<HeaderName>,
}

impl HeaderEdits {
    /// True when there is nothing to do (the common case: skip the work).
    pub fn is_empty(&self) -> bool {
        self.add.is_empty() && self.set.is_empty() && self.remove.is_empty()
    }

    /// Applies the edits to `headers`.
    pub fn apply(&self, headers: &mut http::HeaderMap) {
        for name in &self.remove {
            headers.remove(name);
        }
        for (name, value) in &self.set {
            headers.insert(name.clone(), value.clone());
        }
        for (name, value) in &self.add {
            headers.append(name.clone(), value.clone());
        }
    }
}

/// How the request path is changed before forwarding.
#[derive(Debug, Clone)]
pub enum PathRewrite {
    /// Forward the path as received.
    Keep,
    /// Remove this prefix (at a segment boundary).
    StripPrefix(String),
    /// Replace the path with a template over the path parameters.
    Template(Template),
}

/// CORS headers added to the proxy's own error answers on a route, so a
/// browser client can read the error from a cross-origin call.
#[derive(Debug, Clone)]
pub struct Cors {
    /// `*` was listed: any origin.
    pub allow_any: bool,
    /// Listed origins.
    pub origins: Vec<String>,
    /// Send `Access-Control-Allow-Credentials: true` (then the origin is echoed).
    pub allow_credentials: bool,
}

/// Which probe a health route answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// 200 while the process serves.
    Live,
    /// 200 once the config is loaded and listeners are bound, 503 while draining.
    Ready,
}

/// A fixed answer.
#[derive(Debug, Clone)]
pub struct LocalResponse {
    /// Status code.
    pub status: StatusCode,
    /// Headers.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// Body.
    pub body: bytes::Bytes,
}

/// What a route does with a request.
#[derive(Debug, Clone)]
pub enum Action {
    /// Forward to `Config::upstreams[i]`.
    Forward(usize),
    /// Answer locally.
    Respond(LocalResponse),
    /// Answer with a redirect.
    Redirect(Redirect),
    /// Answer a health probe.
    Health(Probe),
}

/// A route's redirect (nginx's `return 301 ...`, Envoy's redirect action).
#[derive(Debug, Clone)]
pub struct Redirect {
    /// The `Location`, filled from the path parameters: an `http(s)` URL
    /// or a path starting with `/`.
    pub to: Template,
    /// 301, 302, 303, 307 or 308.
    pub status: StatusCode,
    /// Whether the request's query is appended.
    pub keep_query: bool,
}

/// A route: match conditions beyond host and path, and what to do.
#[derive(Debug)]
pub struct Route {
    /// Name used in logs and error bodies.
    pub name: Arc<str>,
    /// What to do.
    pub action: Action,
    /// Allowed methods; `None` allows all.
    pub methods: Option<Vec<Method>>,
    /// Headers that must be present with exactly these values.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// Path change before forwarding.
    pub rewrite: PathRewrite,
    /// Changes to the upstream request's headers.
    pub request_headers: HeaderEdits,
    /// Changes to the response's headers.
    pub response_headers: HeaderEdits,
    /// Overrides the upstream's request timeout.
    pub timeout: Option<Duration>,
    /// Pass WebSocket (HTTP Upgrade) requests through.
    pub websocket: bool,
    /// CORS headers on the proxy's own error answers.
    pub error_cors: Option<Cors>,
    /// Responses compressed for clients that take gzip.
    pub compress: Option<Compression>,
    /// Requests beyond this rate are answered 429.
    pub rate_limit: Option<RateLimitSpec>,
    /// Request bodies larger than this are answered 413 (nginx's
    /// client_max_body_size); `None`: no limit.
    pub max_request_body: Option<u64>,
    /// Which of the route's requests get an access line.
    pub access_log: AccessLogging,
    /// Each request first asked of an auth service (nginx's
    /// `auth_request`, Envoy's `ext_authz`).
    pub auth_request: Option<Box<AuthRequest>>,
    /// A share of the requests also sent to another upstream.
    pub mirror: Option<MirrorSpec>,
    /// Plugins run on this route, in order (after the global ones).
    pub plugins: Vec<PluginUse>,
    /// Where the route was defined.
    pub defined_at: Pos,
}
