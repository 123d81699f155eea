//! An upstream as the policies state it: endpoints, balancing, timeouts, retries, TLS, DNS, health checks.

use crate::*;

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
