//! Sending requests to upstreams: one pooled keep-alive client per upstream,
//! endpoint balancing, timeouts, and retries of requests that never left.

mod headers;
mod tls;
pub mod upgrade;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderMap, Method, Request, Response, StatusCode, Uri, Version};
use hyper::body::Incoming;
use hyper_rustls::{FixedServerNameResolver, HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

pub use headers::{is_upgrade, remove_hop_by_hop, set_forwarded};

use crate::body::Body;
use crate::config::{Balance, Endpoint, Target, Upstream};

/// Why a request could not be forwarded; each maps to one status code.
#[derive(Debug, thiserror::Error)]
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
}

impl ForwardError {
    /// The status the client gets.
    pub fn status(&self) -> StatusCode {
        match self {
            ForwardError::Unreachable(_) | ForwardError::Failed(_) => StatusCode::BAD_GATEWAY,
            ForwardError::ConnectTimeout | ForwardError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ForwardError::BadTarget(_) => StatusCode::BAD_REQUEST,
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

type Connector = HttpsConnector<HttpConnector>;

/// An upstream's live state: its client pool and balancing counters.
pub struct UpstreamPool {
    /// The upstream's settings.
    pub spec: Arc<Upstream>,
    client: Client<Connector, Body>,
    in_flight: Arc<[AtomicUsize]>,
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
}

fn idempotent(m: &Method) -> bool {
    matches!(
        *m,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE | Method::TRACE
    )
}

impl UpstreamPool {
    /// Builds the client for an upstream. No connection is opened yet.
    pub fn new(spec: Arc<Upstream>) -> UpstreamPool {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(spec.timeouts.connect));
        http.set_nodelay(true);
        http.set_keepalive(Some(Duration::from_secs(60)));
        let tls = tls::client_config(&spec.tls);
        if spec.tls.insecure_skip_verify {
            tracing::warn!(upstream = %spec.name, "TLS certificate verification is off for this upstream");
        }
        let builder = HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http();
        let builder = match &spec.tls.server_name {
            Some(name) => builder.with_server_name_resolver(FixedServerNameResolver::new(
                rustls_pki_types::ServerName::try_from(name.clone()).unwrap_or_else(|_| {
                    rustls_pki_types::ServerName::try_from("invalid.invalid".to_owned())
                        .expect("static name is valid")
                }),
            )),
            None => builder,
        };
        let connector = if spec.http2 {
            builder.enable_http2().wrap_connector(http)
        } else {
            builder.enable_http1().wrap_connector(http)
        };
        let mut client = Client::builder(TokioExecutor::new());
        client
            .pool_idle_timeout(spec.timeouts.idle)
            .pool_timer(TokioTimer::new())
            .timer(TokioTimer::new())
            .http2_only(spec.http2)
            // Fat windows keep a long, fast path full (the defaults are 64 KiB).
            .http2_initial_stream_window_size(4 << 20)
            .http2_initial_connection_window_size(8 << 20)
            .http2_keep_alive_interval(Some(Duration::from_secs(20)))
            .http2_keep_alive_while_idle(false);
        let endpoints = match &spec.target {
            Target::Endpoints(e) => e.len(),
            Target::Template(_) => 1,
        };
        UpstreamPool {
            client: client.build(connector),
            in_flight: (0..endpoints).map(|_| AtomicUsize::new(0)).collect(),
            next: AtomicUsize::new(0),
            spec,
        }
    }

    /// Picks the endpoint for an attempt.
    fn pick(&self, endpoints: &[Endpoint]) -> usize {
        let n = endpoints.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        match self.spec.balance {
            Balance::RoundRobin => start,
            Balance::LeastRequests => (0..n)
                .map(|i| (start + i) % n)
                .min_by_key(|&i| self.in_flight[i].load(Ordering::Relaxed))
                .unwrap_or(start),
        }
    }

    fn uri(
        scheme: &Scheme,
        authority: &Authority,
        base: Option<&str>,
        path: &PathAndQuery,
    ) -> Result<Uri, ForwardError> {
        let mut parts = http::uri::Parts::default();
        parts.scheme = Some(scheme.clone());
        parts.authority = Some(authority.clone());
        parts.path_and_query = Some(match base {
            None => path.clone(),
            Some(base) => {
                let joined = format!("{base}{}", path.as_str());
                PathAndQuery::try_from(joined)
                    .map_err(|e| ForwardError::BadTarget(e.to_string()))?
            }
        });
        Uri::from_parts(parts).map_err(|e| ForwardError::BadTarget(e.to_string()))
    }

    /// Sends `out` to the upstream and waits for the response head, within
    /// `timeout`. Bodiless idempotent requests whose connection could not be
    /// made are retried on the next endpoint, up to `retries` times.
    pub async fn send(
        &self,
        out: Outgoing,
        params: &matchit::Params<'_, '_>,
        timeout: Duration,
    ) -> Result<(Response<Incoming>, Option<InFlight>), ForwardError> {
        let rendered;
        let endpoints: &[Endpoint] = match &self.spec.target {
            Target::Endpoints(e) => e,
            Target::Template(t) => {
                let url = t
                    .render(|name| params.get(name))
                    .map_err(ForwardError::BadTarget)?;
                let ep = Uri::try_from(url.as_str())
                    .ok()
                    .and_then(|u| {
                        Some(Endpoint {
                            scheme: u.scheme()?.clone(),
                            authority: u.authority()?.clone(),
                            base_path: Some(u.path().trim_end_matches('/'))
                                .filter(|p| !p.is_empty())
                                .map(Into::into),
                        })
                    })
                    .ok_or_else(|| {
                        ForwardError::BadTarget(format!("`{url}` is not a valid upstream URL"))
                    })?;
                rendered = [ep];
                &rendered
            }
        };
        let version = if self.spec.http2 {
            Version::HTTP_2
        } else {
            Version::HTTP_11
        };
        let retryable = self.spec.retries > 0
            && idempotent(&out.method)
            && http_body::Body::is_end_stream(&out.body);
        let attempts = if retryable { 1 + self.spec.retries } else { 1 };
        let Outgoing {
            method,
            path,
            mut headers,
            mut body,
        } = out;
        let attempt_all = async {
            let mut last = None;
            for attempt in 0..attempts {
                let i = self.pick(endpoints);
                let ep = &endpoints[i];
                let uri = Self::uri(&ep.scheme, &ep.authority, ep.base_path.as_deref(), &path)?;
                let last_attempt = attempt + 1 == attempts;
                // Keep a copy of the head only while a retry is still possible.
                let hdrs = if last_attempt {
                    std::mem::take(&mut headers)
                } else {
                    headers.clone()
                };
                let b = if last_attempt {
                    std::mem::replace(&mut body, Body::empty())
                } else {
                    Body::empty()
                };
                let mut req = Request::new(b);
                *req.method_mut() = method.clone();
                *req.uri_mut() = uri;
                *req.version_mut() = version;
                *req.headers_mut() = hdrs;
                self.in_flight[i].fetch_add(1, Ordering::Relaxed);
                let guard = InFlight(self.in_flight.clone(), i);
                match self.client.request(req).await {
                    Ok(resp) => return Ok((resp, Some(guard))),
                    Err(e) if e.is_connect() => {
                        let err = classify_connect(&e);
                        tracing::debug!(upstream = %self.spec.name, endpoint = %ep.authority, attempt, error = %err, "connect failed");
                        last = Some(err);
                    }
                    Err(e) => return Err(ForwardError::Failed(error_chain(&e))),
                }
            }
            Err(last.unwrap_or(ForwardError::Unreachable("no endpoint".into())))
        };
        match tokio::time::timeout(timeout, attempt_all).await {
            Ok(r) => r,
            Err(_) => Err(ForwardError::Timeout(timeout)),
        }
    }
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}

fn classify_connect(e: &hyper_util::client::legacy::Error) -> ForwardError {
    let mut src: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(inner) = src {
        if let Some(io) = inner.downcast_ref::<std::io::Error>()
            && io.kind() == std::io::ErrorKind::TimedOut
        {
            return ForwardError::ConnectTimeout;
        }
        src = inner.source();
    }
    ForwardError::Unreachable(error_chain(e))
}
