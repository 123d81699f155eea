//! A route as the policies state it: conditions, action, rewrites, header edits and features.

use crate::*;

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
    /// Whether the edits set or add `name`.
    pub fn gives(&self, name: &HeaderName) -> bool {
        self.set.iter().chain(&self.add).any(|(n, _)| n == name)
    }

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
