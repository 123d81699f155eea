//! A route's `auth_request` (nginx's `auth_request`, Envoy's `ext_authz`
//! over HTTP): before a request is forwarded, an auth service such as
//! oauth2-proxy is asked about it, and its answer decides.
//!
//! The service gets a GET of its configured path with the client's
//! headers (the session cookie, the token), minus hop-by-hop and body
//! headers, plus `X-Original-URI`, `X-Original-Method` and the
//! `X-Forwarded-*` the upstream would get; never the body.
//! - 2xx: the request goes on, carrying the answer's `copy_headers`
//!   (who the user is). A client's own copies of those are always
//!   removed, so only the service can set them.
//! - 401 with `signin` set: a 302 to the sign-in page, the original URL
//!   in it (ingress-nginx's `auth-signin`).
//! - any other answer: passed to the client as it came (status, headers,
//!   body up to 64 KiB), as Envoy does: a 401's `WWW-Authenticate`, a
//!   403's reason.
//! - no answer (unreachable, timed out): 503, logged; the request is not
//!   let through.
//!
//! With `cache`, allowing answers are kept a while per session
//! ([`crate::auth_cache`]).

use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Method, Response, StatusCode};
use http_body_util::BodyExt;

use crate::answers::error_response;
use crate::auth_cache::AuthCache;
use crate::conn_info::ConnInfo;
use portcullis_config::{AuthRequest, Route};
use portcullis_forward::Body;
use portcullis_forward::{self as forward, Outgoing, UpstreamPool};

/// The most of an auth service's answer body kept (to pass on, or to
/// read an allowing answer to its end so its connection is reused).
const MAX_BODY: usize = 64 * 1024;

const ORIGINAL_URI: HeaderName = HeaderName::from_static("x-original-uri");
const ORIGINAL_METHOD: HeaderName = HeaderName::from_static("x-original-method");

/// What the request asked about: its head as the client sent it.
pub struct Asked<'a> {
    pub method: &'a Method,
    pub uri: &'a http::Uri,
}

/// Asks the auth service about a request. `Ok` lets it through, with the
/// answer's `copy_headers` set on `headers`; `Err` is the client's
/// answer.
pub async fn check(
    (auth, cache): (&AuthRequest, Option<&AuthCache>),
    pool: &UpstreamPool,
    asked: Asked<'_>,
    headers: &mut HeaderMap,
    (conn, route, origin): (&ConnInfo, &Route, Option<&HeaderValue>),
) -> Result<(), Response<Body>> {
    // As the client wrote it, port and all: HTTP/2's :authority, else Host.
    let authority = match asked.uri.authority() {
        Some(a) => HeaderValue::from_str(a.as_str()).ok(),
        None => headers.get(header::HOST).cloned(),
    };
    // Only the service may say who the user is.
    for name in &auth.copy_headers {
        headers.remove(name);
    }
    // A session allowed a moment ago is let through as it was then.
    let cached = cache.and_then(|cache| Some((cache, cache.key_of(headers, asked.uri)?)));
    if let Some((cache, key)) = cached
        && let Some(copied) = cache.get(key)
    {
        tracing::debug!(route = %route.name, "auth request answered from the cache");
        for (name, value) in copied {
            headers.append(name, value);
        }
        return Ok(());
    }
    let sent = subrequest_headers(headers, &asked, authority, conn, pool);
    // The URL the client asked for, as the upstream would be told it
    // (behind a trusted balancer, the scheme and host it reports).
    let original = auth.signin.is_some().then(|| original_url(&sent, &asked));
    let (parts, body) = ask(auth, pool, sent, (route, origin)).await?;
    // The status decides.
    if parts.status.is_success() {
        let copied: Vec<_> = auth
            .copy_headers
            .iter()
            .flat_map(|name| {
                let values = parts.headers.get_all(name).iter();
                values.map(move |value| (name.clone(), value.clone()))
            })
            .collect();
        for (name, value) in &copied {
            headers.append(name.clone(), value.clone());
        }
        if let Some((cache, key)) = cached {
            cache.put(key, copied);
        }
        return Ok(());
    }
    tracing::debug!(route = %route.name, status = parts.status.as_u16(), "auth service refused the request");
    if parts.status == StatusCode::UNAUTHORIZED
        && let (Some(signin), Some(original)) = (&auth.signin, &original)
    {
        return Err(sign_in(signin, original));
    }
    let mut resp = Response::new(Body::full(body));
    *resp.status_mut() = parts.status;
    let mut kept = parts.headers;
    forward::remove_hop_by_hop(&mut kept, false);
    kept.remove(header::CONTENT_LENGTH);
    *resp.headers_mut() = kept;
    Err(resp)
}

/// Sends the subrequest with `sent` to the auth service and reads its
/// answer: the head, and the body (empty when over 64 KiB, cut or slow);
/// no answer is the client's 503.
async fn ask(
    auth: &AuthRequest,
    pool: &UpstreamPool,
    sent: HeaderMap,
    (route, origin): (&Route, Option<&HeaderValue>),
) -> Result<(http::response::Parts, bytes::Bytes), Response<Body>> {
    let out = Outgoing {
        method: Method::GET,
        path: auth.path.clone(),
        headers: sent,
        forwarded: Default::default(),
        body: Body::empty(),
        affinity: None,
        own_host: false,
        upgrade: false,
    };
    let params = matchit::Params::new();
    let answer = pool.send(out, &params, auth.timeout, None, None);
    // Counted in the auth service's upstream metrics as forwarded
    // requests are in theirs.
    let asked_at = std::time::Instant::now();
    let (resp, held) = match tokio::time::timeout(auth.timeout, answer).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(e)) => {
            if let Some(why) = e.upstream_error() {
                pool.stats.failed(why);
            }
            return Err(unavailable(route, &pool.spec.name, &e.to_string(), origin));
        }
        Err(_) => {
            pool.stats
                .failed(portcullis_obs::metrics::UpstreamError::Timeout);
            let e = format!("no answer within {:?}", auth.timeout);
            return Err(unavailable(route, &pool.spec.name, &e, origin));
        }
    };
    pool.stats
        .record(resp.status().as_u16(), asked_at.elapsed());
    // The body is read to pass a refusal's on, and so that the connection
    // can serve again; one too large, cut or slow is
    // left out (and its connection closed), whatever the status said.
    let (parts, body) = resp.into_parts();
    let read = http_body_util::Limited::new(body, MAX_BODY).collect();
    let body = match tokio::time::timeout(auth.timeout, read).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        _ => {
            tracing::debug!(route = %route.name, status = parts.status.as_u16(), "auth service's answer body left out (over 64 KiB, cut or slow)");
            bytes::Bytes::new()
        }
    };
    drop(held);
    Ok((parts, body))
}

/// The headers the auth service gets: the client's end-to-end ones, no
/// body's, the original method and URI, and `X-Forwarded-*`.
fn subrequest_headers(
    headers: &HeaderMap,
    asked: &Asked<'_>,
    public_host: Option<HeaderValue>,
    conn: &ConnInfo,
    pool: &UpstreamPool,
) -> HeaderMap {
    let mut out = headers.clone();
    let seen = forward::remove_hop_by_hop(&mut out, false);
    // An HTTP/2 client's cookies, one field each, go as one line: an auth
    // service reading one Cookie header would miss the session otherwise.
    if seen.cookie {
        forward::join_cookie_crumbs(&mut out);
    }
    for name in [
        header::CONTENT_LENGTH,
        header::CONTENT_TYPE,
        header::CONTENT_ENCODING,
        header::EXPECT,
    ] {
        out.remove(name);
    }
    conn.forwarded(&mut out, seen, public_host, false);
    if !pool.spec.preserve_host {
        out.remove(header::HOST);
    }
    if let Some(pq) = asked.uri.path_and_query()
        && let Ok(v) = HeaderValue::from_str(pq.as_str())
    {
        out.insert(ORIGINAL_URI, v);
    }
    if let Ok(v) = HeaderValue::from_str(asked.method.as_str()) {
        out.insert(ORIGINAL_METHOD, v);
    }
    out
}

/// The answer when the auth service could not be asked: the request is
/// not let through unchecked.
fn unavailable(
    route: &Route,
    upstream: &str,
    error: &str,
    origin: Option<&HeaderValue>,
) -> Response<Body> {
    tracing::warn!(route = %route.name, upstream, error, "auth service did not answer; request refused");
    error_response(
        StatusCode::SERVICE_UNAVAILABLE,
        "auth service unavailable",
        Some(route),
        origin,
    )
}

/// `scheme://host/path?query` from the `X-Forwarded-Proto` and `-Host`
/// just set for the subrequest.
fn original_url(sent: &HeaderMap, asked: &Asked<'_>) -> String {
    let text = |name: &str| sent.get(name).and_then(|v| v.to_str().ok()).unwrap_or("");
    let path = asked.uri.path_and_query().map_or("/", |p| p.as_str());
    format!(
        "{}://{}{path}",
        text("x-forwarded-proto"),
        text("x-forwarded-host")
    )
}

/// A 302 to `signin`, `{url}` in it replaced by the original URL,
/// percent-encoded as a query value.
fn sign_in(signin: &str, original: &str) -> Response<Body> {
    let location = signin.replace("{url}", &portcullis_net::client_cert::url_encode(original));
    let mut resp = Response::new(Body::empty());
    *resp.status_mut() = StatusCode::FOUND;
    match HeaderValue::from_str(&location) {
        Ok(v) => {
            resp.headers_mut().insert(header::LOCATION, v);
        }
        Err(_) => *resp.status_mut() = StatusCode::UNAUTHORIZED,
    }
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}
