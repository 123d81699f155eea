//! The routing core's "forward" phase: the request made ready for the
//! upstream (path, headers, affinity, mirror), sent through the
//! upstream's pool, and the answer given the route's edits.

use super::*;

impl Pipeline {
    /// The upstream (the route's, or the one a plugin chose) and the
    /// request as it goes there, its body still to be set; or the
    /// client's answer.
    #[allow(clippy::result_large_err)] // unboxed as everywhere on this path
    pub(super) fn to_forward<'p>(
        &'p self,
        routed: &Routed<'_, '_>,
        conn: &ConnInfo,
        f: &mut Forwarding<'_, '_>,
    ) -> Result<(&'p UpstreamPool, Outgoing, Extra), Response<Body>> {
        let upstream = f.plugins.as_ref().and_then(|c| c.upstream);
        let upstream = upstream.unwrap_or(f.upstream);
        let pool = &self.upstreams[conn.worker % self.upstreams.len()][upstream];
        if let Some(log) = f.log.as_mut() {
            log.upstream = Some(pool.spec.name.clone());
        }
        let (out, extra) = self.outgoing(routed, conn, pool, f)?;
        Ok((pool, out, extra))
    }

    /// The body to send: `body` itself, or, for a request in the share
    /// of the route's mirror, a copy in the making (boxed: only mirrored
    /// routes pay for its future).
    pub(super) fn mirror_copy<'a>(
        &self,
        routed: &Routed<'a, '_>,
        conn: &ConnInfo,
        out: &'a mut Outgoing,
        body: Body,
        timeout: std::time::Duration,
    ) -> Mirrored<impl std::future::Future<Output = Result<Body, ForwardError>> + Send + 'a> {
        let mirror = match &routed.state.mirror {
            Some(mirror) if mirror.takes() => mirror,
            _ => return Mirrored::Plain(body),
        };
        let to = self.upstreams[conn.worker % self.upstreams.len()][mirror.upstream].clone();
        // The copy takes the fields from the map.
        out.forwarded.add_to(&mut out.headers);
        let head = (&out.method, &out.path, &out.headers);
        Mirrored::Copying(Box::pin(crate::mirror::copy(
            mirror, to, head, body, timeout,
        )))
    }

    /// The upstream's answer as the client gets it: the route's and its
    /// plugins' edits, or an upgrade spliced through; or the proxy's
    /// error answer.
    pub(super) fn upstream_answer<'c>(
        &self,
        routed: &Routed<'_, '_>,
        pool: &UpstreamPool,
        mut f: Forwarding<'c, '_>,
        sent: Result<(Response<Body>, forward::Held), ForwardError>,
        ((set_cookie, client_upgrade), asked): (Extra, Stamp),
    ) -> Answered<'c> {
        let route = routed.route;
        let (mut resp, held) = match sent {
            // Only an upgrade the client asked for may switch protocols
            // (the own reader refuses the rest itself; hyper's does not).
            Ok((resp, _))
                if resp.status() == StatusCode::SWITCHING_PROTOCOLS && client_upgrade.is_none() =>
            {
                let e =
                    ForwardError::Failed("upstream switched protocols without being asked".into());
                return Answered::Ready(failed(routed, pool, &f, &e));
            }
            Ok(sent) => sent,
            Err(e) => {
                // A plugin that stopped the request body answers it.
                let stopped = f.plugins.as_mut();
                if let Some(answer) = stopped.and_then(|c| chain::stopped_body(c, routed.route)) {
                    return Answered::Ready((answer, forward::Held::default()));
                }
                return Answered::Ready(failed(routed, pool, &f, &e));
            }
        };
        let took = asked.elapsed();
        pool.stats.record(resp.status().as_u16(), took);
        if let Some(log) = f.log.as_mut() {
            log.upstream_header = Some(took);
            log.endpoint = answered_by(pool, &held, &routed.params);
        }
        if let Some(cookie) = set_cookie {
            resp.headers_mut().append(header::SET_COOKIE, cookie);
        }
        if let Some(client_upgrade) =
            client_upgrade.filter(|_| resp.status() == StatusCode::SWITCHING_PROTOCOLS)
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
            return Answered::Ready((r, forward::Held::default()));
        }
        let (mut parts, body) = resp.into_parts();
        // The own HTTP/1.1 reader's answers have one plain length at most
        // and no hop-by-hop fields already (`forward::h1` reads both as it
        // parses the head), and skip the passes. Others' first have their
        // length made single, before the hop-by-hop pass takes
        // Transfer-Encoding.
        if !matches!(body, Body::Upstream { .. }) {
            forward::single_content_length(&mut parts.headers);
            let _ = forward::remove_hop_by_hop(&mut parts.headers, false);
        }
        let mut body = body;
        if let Some(ctx) = f.plugins.as_mut() {
            let filtered = match chain::whole_response(ctx, route, &mut parts, &mut body) {
                // The usual small answer, read with its head: head and
                // body through the route's one plugin in one visit.
                Some(chain::Whole::Sent(filtered)) => filtered,
                Some(chain::Whole::Held(head, whole)) => {
                    log_notes(f.log, ctx);
                    body = whole;
                    return held_for_body(f, parts, body, (held, pool), head);
                }
                None => {
                    let end_of_stream = http_body::Body::is_end_stream(&body);
                    let step = chain::on_response(ctx, route, &mut parts, end_of_stream);
                    log_notes(f.log, ctx);
                    match step {
                        chain::ResponseStep::Go => {
                            chain::filter_response_body(ctx, route, &mut parts, body)
                        }
                        chain::ResponseStep::Answer(answer) => Err(answer),
                        chain::ResponseStep::ReadBody(head) => {
                            return held_for_body(f, parts, body, (held, pool), head);
                        }
                    }
                }
            };
            log_notes(f.log, ctx);
            match filtered {
                Ok(filtered) => body = filtered,
                Err(answer) => return Answered::Ready((answer, forward::Held::default())),
            }
        }
        parts.version = Version::HTTP_11;
        let resp = respond_as_route(routed, Response::from_parts(parts, body));
        Answered::Ready((resp, held.with_read_timeout(pool.spec.timeouts.read)))
    }

    /// The answer of a response whose head a plugin holds for its body:
    /// the body read whole, the plugins run on it, and the answer made
    /// with what they left.
    pub(super) async fn body_first(
        &self,
        routed: &Routed<'_, '_>,
        pool: &UpstreamPool,
        first: BodyFirst<'_>,
    ) -> (Response<Body>, forward::Held) {
        let BodyFirst {
            ctx,
            mut parts,
            body,
            held,
            head,
        } = first;
        let Some(mut ctx) = ctx else {
            unreachable!("a plugin held the head")
        };
        let reading = (body, pool.spec.timeouts.read);
        let read = chain::read_whole(&mut ctx, routed.route, &mut parts, reading, head).await;
        // The access line is reached through the answer from here.
        match read {
            Ok(bytes) => {
                parts.version = Version::HTTP_11;
                let resp = Response::from_parts(parts, Body::full(bytes));
                (ctx.noted(respond_as_route(routed, resp)), held)
            }
            Err(answer) => (ctx.noted(answer), forward::Held::default()),
        }
    }

    /// The request as it goes upstream, its body still to be set: its path
    /// (the plugins' or the route's rewrite), its headers made ours
    /// (hop-by-hop fields out, forwarding fields set, the route's edits)
    /// and the affinity key. With the affinity cookie to set on the
    /// answer, and the client's side of an upgrade it asked for.
    // Unboxed as everywhere on this path (see `find_route`).
    #[allow(clippy::result_large_err)]
    fn outgoing(
        &self,
        routed: &Routed<'_, '_>,
        conn: &ConnInfo,
        pool: &UpstreamPool,
        f: &mut Forwarding<'_, '_>,
    ) -> Result<(Outgoing, Extra), Response<Body>> {
        let route = routed.route;
        let (method, uri, _) = f.asked;
        let plugin_path = f.plugins.as_mut().and_then(|p| p.path.take());
        let new_path = match plugin_path.map(Ok).unwrap_or_else(|| {
            let unchanged = matches!(f.path, Cow::Borrowed(_));
            rewritten_path(route, f.path, unchanged, uri, &routed.params)
        }) {
            Ok(p) => p,
            Err(e) => {
                let origin = routed.origin.as_ref();
                return Err(error_response(
                    StatusCode::BAD_REQUEST,
                    &e,
                    Some(route),
                    origin,
                ));
            }
        };
        let mut headers = std::mem::take(f.headers);
        let upgrade = f.upgrade.is_some();
        let client_upgrade = f.upgrade.take().flatten();
        let seen = forward::remove_hop_by_hop(&mut headers, upgrade);
        if seen.cookie {
            forward::join_cookie_crumbs(&mut headers);
        }
        // The key as the client sent it, before the forwarded headers are
        // ours.
        let trust = conn.listener.trust_forwarded_headers;
        let (affinity, set_cookie) = match pool.affinity(conn.client.ip(), trust, &headers) {
            Some((key, cookie)) => (Some(key), cookie),
            None => (None, None),
        };
        // HTTP/2 clients send the host as :authority, HTTP/1 as Host.
        let public_host = match uri.authority() {
            Some(a) => HeaderValue::from_str(a.as_str()).ok(),
            None => crate::request_head::first(&headers, &header::HOST).cloned(),
        };
        // Written by the send after the map's fields, not inserted here,
        // unless the route's edits (which may change them) read the map
        // first. A plugin's response hook that reads the request adds
        // them then (`plugin::ResponseLent::request_later`).
        let defer = route.request_headers.is_empty();
        let forwarded = conn.forwarded(&mut headers, seen, public_host, defer);
        // The client's `Host` stays in the map: unless the upstream
        // preserves it, the send writes the endpoint's in its place (a
        // removal here was ~450 instructions a request). A route that
        // gives its own `Host` (set or add) sends that one, and only that
        // one, whatever the upstream preserves.
        let mut own_host = false;
        if !route.request_headers.is_empty() {
            own_host = route.request_headers.gives(&header::HOST);
            if own_host {
                headers.remove(header::HOST);
            }
            route.request_headers.apply(&mut headers);
        }
        let out = Outgoing {
            method: method.clone(),
            path: new_path,
            headers,
            forwarded,
            body: Body::empty(),
            affinity,
            own_host,
            upgrade,
        };
        Ok((out, (set_cookie, client_upgrade)))
    }
}

/// The upstream's answer as [`Pipeline::upstream_answer`] leaves it.
// The large variant is the one nearly every request takes: boxing it to
// even the sizes out would allocate per request.
#[allow(clippy::large_enum_variant)]
pub(super) enum Answered<'c> {
    /// Ready to send.
    Ready((Response<Body>, forward::Held)),
    /// A plugin holds its head until the body is read
    /// ([`Pipeline::body_first`]; boxed: few routes take it).
    BodyFirst(Box<BodyFirst<'c>>),
}

/// The answer to make once the body of a response whose head a plugin
/// holds is read.
fn held_for_body<'c>(
    mut f: Forwarding<'c, '_>,
    parts: http::response::Parts,
    body: Body,
    (held, pool): (forward::Held, &UpstreamPool),
    head: chain::HeldHead,
) -> Answered<'c> {
    let ctx = f.plugins.take();
    let held = held.with_read_timeout(pool.spec.timeouts.read);
    Answered::BodyFirst(Box::new(BodyFirst {
        ctx,
        parts,
        body,
        held,
        head,
    }))
}

/// A response whose head a plugin holds for its body.
pub(super) struct BodyFirst<'c> {
    ctx: Option<Box<chain::PluginContext<'c>>>,
    parts: http::response::Parts,
    body: Body,
    held: forward::Held,
    head: chain::HeldHead,
}

/// What the answer gets besides the upstream's: the affinity cookie to
/// set, and the client's side of an upgrade it asked for.
pub(super) type Extra = (Option<HeaderValue>, Option<hyper::upgrade::OnUpgrade>);

/// A request's body, or its mirror's copy in the making.
pub(super) enum Mirrored<F> {
    Plain(Body),
    Copying(std::pin::Pin<Box<F>>),
}

/// The proxy's answer when forwarding failed, logged.
pub(super) fn failed(
    routed: &Routed<'_, '_>,
    pool: &UpstreamPool,
    f: &Forwarding<'_, '_>,
    e: &ForwardError,
) -> (Response<Body>, forward::Held) {
    let (route, origin) = (routed.route, routed.origin.as_ref());
    log_forward_error(route, &pool.spec.name, e, f.request_id);
    if let Some(why) = e.upstream_error() {
        pool.stats.failed(why);
    }
    let resp = match e {
        ForwardError::BodyTooLarge => too_large(route, f.asked.2, origin),
        e => error_response(e.status(), e.public_message(), Some(route), origin),
    };
    (resp, forward::Held::default())
}

/// A request on its way to an upstream.
pub(super) struct Forwarding<'c, 'a> {
    /// The route's upstream (a plugin may choose another).
    pub(super) upstream: usize,
    pub(super) plugins: Option<Box<chain::PluginContext<'c>>>,
    pub(super) asked: Asked<'a>,
    /// The normalized path.
    pub(super) path: &'a Cow<'a, str>,
    /// A WebSocket upgrade the route passes: with the client's side of
    /// it, if hyper offers one.
    pub(super) upgrade: Option<Option<hyper::upgrade::OnUpgrade>>,
    /// The request's headers, lent: taken whole only for the send
    /// (every map left empty by a take is one more to drop, ~60
    /// instructions).
    pub(super) headers: &'a mut http::HeaderMap,
    pub(super) log: &'a mut Option<Box<AccessLog>>,
    pub(super) request_id: Option<&'a HeaderValue>,
}

/// `resp` with the route's response header edits and compression.
pub(super) fn respond_as_route(
    routed: &Routed<'_, '_>,
    mut resp: Response<Body>,
) -> Response<Body> {
    let route = routed.route;
    if !route.response_headers.is_empty() {
        route.response_headers.apply(resp.headers_mut());
    }
    if let Some(settings) = &route.compress {
        let (coding, head) = routed.compress;
        resp = crate::compress::apply(settings, coding, head, resp);
    }
    resp
}

/// Which endpoint gave `held`'s answer, for the access line.
pub(super) fn answered_by(
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

pub(super) fn log_forward_error(
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

/// The path and query to send upstream, after the route's rewrite.
pub(super) fn rewritten_path(
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
