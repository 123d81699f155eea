//! The routing core's "route" and "plugins" phases: the request head
//! checked, the route found, its guards and plugins run, and the answer
//! of a route that answers here.

use super::*;

impl Pipeline {
    /// The routing core's "route, plugins, forward": the head checked,
    /// the route found, its guards (rate limit, body limit, auth service)
    /// and plugins run, then its action: forwarded, or answered here.
    /// Near 100 lines for one reason: the upstream exchange is awaited in
    /// this future itself (see the forward step).
    pub(super) async fn route_and_serve<B>(
        &self,
        req: Request<B>,
        conn: &ConnInfo,
        (log, request_id): (&mut Option<Box<AccessLog>>, Option<&HeaderValue>),
        stats: &mut &'static metrics::RouteStats,
    ) -> (Response<Body>, forward::Held)
    where
        B: http_body::Body + Into<Body> + Send,
    {
        let done = |resp| (resp, forward::Held::default());
        let (mut parts, body) = req.into_parts();
        let scanned = request_head::scan(&parts);
        let origin = scanned.origin.cloned();
        let host = match admit(&parts, scanned, &body, conn) {
            Ok(host) => host,
            Err(resp) => return done(resp),
        };
        let Some(path) = request_head::normalize_path(parts.uri.path()) else {
            return done(error_response(
                StatusCode::BAD_REQUEST,
                "invalid path",
                None,
                None,
            ));
        };
        let found = match self.find_route((host.as_deref(), &path), &parts, conn) {
            Ok(found) => found,
            Err(resp) => return done(resp),
        };
        let route = &self.config.routes[found.route];
        if let Some(log) = log.as_mut() {
            log.route = Some(route.name.clone());
            log.logging = route.access_log;
        }
        // Read before the headers go upstream; only routes that compress
        // look.
        let coding = (route.compress.as_ref())
            .filter(|_| scanned.accept_encoding)
            .and_then(|c| crate::compress::negotiate(&parts.headers, c));
        let head = route.compress.is_some() && parts.method == Method::HEAD;
        *stats = self.stats[found.route];
        let routed = Routed {
            index: found.route,
            route,
            state: &self.route_states[found.route],
            params: found.params,
            origin,
            compress: (coding, head),
        };
        let mut body: Body = body.into();
        body.count_into(self.stats[found.route]);
        let asked = (&parts.method, &parts.uri, parts.version);
        // Most routes have neither guards nor plugins: their futures (each
        // copied into this one's when made, ~100 instructions a request)
        // are not made.
        if guarded(&routed)
            && let Err(resp) = self
                .guard(&routed, conn, asked, &mut parts.headers, &mut body)
                .await
        {
            return done(resp);
        }
        let plugins = match self.chains.routes[found.route].is_empty() {
            true => Ok(None),
            false => {
                let head = (&mut parts.headers, path.as_ref());
                (self.plugins_on_request(&routed, conn, asked, head, &mut body)).await
            }
        };
        let mut plugins = match plugins {
            Ok(plugins) => plugins,
            Err(resp) => return done(resp),
        };
        if let Some(ctx) = plugins.as_mut() {
            log_notes(log, ctx);
        }
        let Action::Forward(upstream) = route.action else {
            let resp = self.local_action(&routed, &parts.uri);
            return done(respond_as_route(&routed, resp));
        };
        // hyper's HTTP/1.1 server marks a request with an `Upgrade` field
        // (its side of the switch, which a splice needs anyway): others
        // skip the two field lookups (~90 instructions a request).
        let upgrade = route.websocket
            && parts.version == Version::HTTP_11
            && parts
                .extensions
                .get::<hyper::upgrade::OnUpgrade>()
                .is_some()
            && forward::is_websocket_upgrade(&parts.headers);
        let forwarding = Forwarding {
            upstream,
            plugins,
            asked,
            path: &path,
            upgrade: upgrade.then(|| parts.extensions.remove::<hyper::upgrade::OnUpgrade>()),
            headers: &mut parts.headers,
            log,
            request_id,
        };
        // Forward. The exchange is awaited here rather than in a function
        // of its own: that future (holding the exchange's) moved once more
        // per request cost ~950 instructions of memcpy on /plain.
        let mut f = forwarding;
        let (pool, mut out, extra) = match self.to_forward(&routed, conn, &mut f) {
            Ok(ready) => ready,
            Err(resp) => return done(resp),
        };
        let timeout = route.timeout.unwrap_or(pool.spec.timeouts.request);
        // A route without a mirror passes the body straight on: through
        // the mirror's step it was moved in and out (~80 instructions).
        out.body = match routed.state.mirror.is_some() {
            false => body,
            true => match self.mirror_copy(&routed, conn, &mut out, body, timeout) {
                Mirrored::Plain(body) => body,
                Mirrored::Copying(copy) => match copy.await {
                    Ok(body) => body,
                    Err(e) => return failed(&routed, pool, &f, &e),
                },
            },
        };
        let watch = watchable(conn, f.asked.2);
        // For the upstream's time to answer, in its metrics and the log.
        let asked = Stamp::now();
        let kept = f.plugins.as_mut().and_then(|c| c.request_headers_slot());
        let sent = pool.send(out, &routed.params, timeout, watch, kept).await;
        match self.upstream_answer(&routed, pool, f, sent, (extra, asked)) {
            Answered::Ready(answer) => answer,
            // Boxed: only a plugin holding the head pays for this future.
            Answered::BodyFirst(first) => Box::pin(self.body_first(&routed, pool, *first)).await,
        }
    }

    /// The route for a request's host and path, or its answer: a
    /// redirect to HTTPS on a listener that says so (health probes stay
    /// answered: a balancer's check wants its 200), else 404.
    // The answer is unboxed as everywhere on this path: boxing it would
    // cost an allocation per refused request to save a move.
    #[allow(clippy::result_large_err)]
    pub(super) fn find_route<'p>(
        &self,
        (host, path): (Option<&str>, &'p str),
        parts: &http::request::Parts,
        conn: &ConnInfo,
    ) -> Result<portcullis_config::Matched<'_, 'p>, Response<Body>> {
        let config = &*self.config;
        let routes = &config.routes;
        let (method, headers) = (&parts.method, &parts.headers);
        let found = (config.router).lookup(host.unwrap_or(""), path, method, headers, routes);
        if let Some(port) = conn.listener.redirect_https {
            let probe = found
                .as_ref()
                .is_some_and(|f| matches!(routes[f.route].action, Action::Health(_)));
            if !probe {
                return Err(https_redirect(host, port, &parts.uri));
            }
        }
        found.ok_or_else(|| error_response(StatusCode::NOT_FOUND, "no route", None, None))
    }

    /// The route's guards, before any plugin runs: its rate limit (a
    /// request over it costs no plugin call; health probes have none),
    /// its body limit (a plugin that reads the body never sees more than
    /// the route takes), and its auth service (the plugins may act on who
    /// it says the user is). `Err` is the client's answer.
    pub(super) async fn guard(
        &self,
        routed: &Routed<'_, '_>,
        conn: &ConnInfo,
        (method, uri, version): Asked<'_>,
        headers: &mut http::HeaderMap,
        body: &mut Body,
    ) -> Result<(), Response<Body>> {
        let Routed {
            route,
            state,
            origin,
            ..
        } = routed;
        if let Some(limit) = &state.rate_limit
            && let Err(wait) = take_rate(limit, conn, headers).await
        {
            return Err(rate_limited(route, wait, origin.as_ref()));
        }
        if let Some(max) = route.max_request_body {
            match http_body::Body::size_hint(body).exact() {
                Some(n) if n > max => return Err(too_large(route, version, origin.as_ref())),
                Some(_) => {}
                None => body.limit(max),
            }
        }
        let Some(auth) = &route.auth_request else {
            return Ok(());
        };
        let pool = &self.upstreams[conn.worker % self.upstreams.len()][auth.upstream];
        let asked = crate::auth_request::Asked { method, uri };
        let context = (conn, &**route, origin.as_ref());
        // Boxed: only routes with an auth request pay for its future.
        let checked = Box::pin(crate::auth_request::check(
            (auth, state.auth_cache.as_deref()),
            pool,
            asked,
            headers,
            context,
        ));
        checked.await.map_err(|resp| {
            // The client may still be sending a body no one will read.
            if http_body::Body::is_end_stream(body) {
                resp
            } else {
                closing(resp, version)
            }
        })
    }

    /// The route's plugins on the request, whatever the action, except for
    /// health probes (a plugin must not make a pod look dead): their
    /// context for the response, or the answer one of them gave.
    pub(super) async fn plugins_on_request(
        &self,
        routed: &Routed<'_, '_>,
        conn: &ConnInfo,
        (method, uri, version): Asked<'_>,
        (headers, path): (&mut http::HeaderMap, &str),
        body: &mut Body,
    ) -> Result<Option<Box<chain::PluginContext<'_>>>, Response<Body>> {
        let Routed { index, route, .. } = *routed;
        let chain = &self.chains.routes[index];
        if chain.is_empty() || matches!(route.action, Action::Health(_)) {
            return Ok(None);
        }
        let config = &*self.config;
        let facts = (index, route);
        let bodiless = http_body::Body::is_end_stream(&*body);
        let step = chain::on_request(
            chain,
            (method, uri, bodiless),
            headers,
            path,
            &routed.params,
            facts,
            conn,
            config,
        );
        let outcome = match step {
            chain::Step::Done(outcome) => outcome,
            // Boxed: reading the body or a callout is a large future, and
            // inline it would make every request's future larger, copied
            // on every move, plugins or not.
            step => {
                let context = (conn, version, routed.origin.as_ref());
                Box::pin(self.steps(step, context, body, headers, route)).await
            }
        };
        match outcome {
            chain::RequestOutcome::Forward(mut ctx) => {
                // Plugins that see every body get it as it streams up.
                if let Some(c) = ctx.as_mut() {
                    let taken = std::mem::replace(body, Body::empty());
                    *body = chain::filter_request_body(c, headers, route, taken);
                }
                Ok(ctx)
            }
            // A body too large for the plugin (or the route), or a
            // plugin's own 413: the client may still be sending it.
            chain::RequestOutcome::Answer(resp)
                if resp.status() == StatusCode::PAYLOAD_TOO_LARGE =>
            {
                Err(closing(resp, version))
            }
            chain::RequestOutcome::Answer(resp) => Err(resp),
        }
    }

    /// Takes the chain's steps that wait (a body to read, a callout to
    /// send) until it is done. A callout is waited for within its own
    /// timeout and what is left of the route's (from the first one): past
    /// that, the request is answered 504 without asking the plugin again;
    /// and a client that leaves meanwhile is noticed (on HTTP/1, from a
    /// second on; on HTTP/2 its stream's reset drops this), its callout
    /// dropped with its upstream socket, and logged as 499.
    async fn steps<'c>(
        &'c self,
        mut step: chain::Step<'c>,
        (conn, version, origin): (&ConnInfo, Version, Option<&HeaderValue>),
        body: &mut Body,
        headers: &mut http::HeaderMap,
        route: &Route,
    ) -> chain::RequestOutcome<'c> {
        let config = &*self.config;
        let deadline = self.plugin_wait(route, conn).map(|d| Instant::now() + d);
        loop {
            step = match step {
                chain::Step::Done(outcome) => return outcome,
                chain::Step::ReadBody(pending) => pending.read(body, headers, route, config).await,
                chain::Step::Callout(mut pending) => {
                    let answer = match pending.request() {
                        Some(request) => {
                            let (timeout, bound) = match deadline {
                                Some(d)
                                    if d.saturating_duration_since(Instant::now())
                                        < request.timeout =>
                                {
                                    (d.saturating_duration_since(Instant::now()), true)
                                }
                                _ => (request.timeout, false),
                            };
                            let call = std::pin::pin!(self.callout(conn, request));
                            let watch = watchable(conn, version);
                            match portcullis_forward::client_watch::exchange(
                                call, timeout, watch, None,
                            )
                            .await
                            {
                                Ok(answer) => answer,
                                Err(portcullis_forward::client_watch::Cut::ClientGone) => {
                                    let e = ForwardError::ClientGone;
                                    let resp = error_response(
                                        e.status(),
                                        e.public_message(),
                                        Some(route),
                                        origin,
                                    );
                                    return chain::RequestOutcome::Answer(resp);
                                }
                                Err(_) if bound => {
                                    tracing::info!(route = %route.name, plugin = pending.plugin(), "the route's timeout passed while a plugin waited on its callout");
                                    let resp = json_error(
                                        StatusCode::GATEWAY_TIMEOUT,
                                        "plugin callout timeout: the route's timeout passed",
                                        Some(route),
                                        Some(pending.plugin()),
                                    );
                                    return chain::RequestOutcome::Answer(resp);
                                }
                                Err(_) => plugin::CalloutAnswer::Failed {
                                    timed_out: true,
                                    why: format!("no answer within {timeout:?}"),
                                },
                            }
                        }
                        None => plugin::CalloutAnswer::Failed {
                            timed_out: false,
                            why: "no request".into(),
                        },
                    };
                    if let plugin::CalloutAnswer::Failed { why, .. } = &answer {
                        tracing::info!(route = %route.name, plugin = pending.plugin(), error = %why, "plugin callout failed");
                    }
                    pending.answered(answer, headers, route, config)
                }
            };
        }
    }

    /// How long a request may wait on its plugins' callouts: its route's
    /// timeout, or the request timeout of the upstream it forwards to;
    /// `None` for a route that answers here without a timeout of its own
    /// (each callout's own timeout then bounds it).
    fn plugin_wait(&self, route: &Route, conn: &ConnInfo) -> Option<std::time::Duration> {
        route.timeout.or_else(|| match route.action {
            Action::Forward(i) => {
                let pools = &self.upstreams[conn.worker % self.upstreams.len()];
                Some(pools[i].spec.timeouts.request)
            }
            _ => None,
        })
    }

    /// Sends a plugin's callout to the upstream it names.
    async fn callout(&self, conn: &ConnInfo, request: plugin::Callout) -> plugin::CalloutAnswer {
        if request.redis {
            return crate::redis_calls::send(&request.body, request.timeout).await;
        }
        let Some(index) = self.config.upstream_index(&request.upstream) else {
            let why = format!("no upstream `{}` in the policies", request.upstream);
            return plugin::CalloutAnswer::Failed {
                timed_out: false,
                why,
            };
        };
        let pool = &self.upstreams[conn.worker % self.upstreams.len()][index];
        crate::callout::send(pool, request).await
    }

    /// The answer of a route that answers here (a health probe, a
    /// redirect, a fixed answer); the caller forwards the others.
    pub(super) fn local_action(&self, routed: &Routed<'_, '_>, uri: &http::Uri) -> Response<Body> {
        let route = routed.route;
        match &route.action {
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
            Action::Redirect(redirect) => match redirect_to(redirect, &routed.params, uri) {
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
                    routed.origin.as_ref(),
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
            // Not reached: the caller forwards these.
            Action::Forward(_) => {
                let status = StatusCode::INTERNAL_SERVER_ERROR;
                error_response(
                    status,
                    "forwarding route answered locally",
                    Some(route),
                    None,
                )
            }
        }
    }
}

/// The request's method, URI and version, as the phases after routing
/// read them.
pub(super) type Asked<'a> = (&'a Method, &'a http::Uri, Version);

/// A request matched to its route, as the phases after routing take it.
pub(super) struct Routed<'r, 'p> {
    /// The route's index.
    pub(super) index: usize,
    pub(super) route: &'r Route,
    pub(super) state: &'r RouteState,
    /// The path parameters the route's pattern captured.
    pub(super) params: matchit::Params<'r, 'p>,
    /// The request's `Origin`, for the CORS headers of error answers.
    pub(super) origin: Option<HeaderValue>,
    /// The coding the client takes, and whether the request is a HEAD
    /// (read before the headers go upstream).
    pub(super) compress: (Option<crate::compress::Coding>, bool),
}

/// The `Location` of a route's redirect: its template filled from the
/// path parameters, the request's query after it unless stripped. `None`
/// when a parameter cannot go where it lands (a host part).
pub(super) fn redirect_to(
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

/// The request head admitted (its size, its host and its body's coding
/// as RFC 9112 wants them): its host, or the client's error.
#[allow(clippy::result_large_err)] // unboxed as everywhere on this path
#[inline]
fn admit<'a, B: http_body::Body>(
    parts: &'a http::request::Parts,
    scanned: request_head::Scanned<'a>,
    body: &B,
    conn: &ConnInfo,
) -> Result<Option<std::borrow::Cow<'a, str>>, Response<Body>> {
    if scanned.size > conn.listener.max_request_header_size {
        let status = StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE;
        return Err(error_response(
            status,
            "request header too large",
            None,
            None,
        ));
    }
    let host = request_head::host_of(parts.version, &parts.uri, scanned.host)
        .map_err(|refused| refused_response(&refused))?;
    request_head::admit_coding(&parts.headers, body)
        .map_err(|refused| refused_response(&refused))?;
    Ok(host)
}

/// Whether `routed` has a guard for [`Pipeline::guard`] to run: a rate
/// limit, a body limit or an auth request.
fn guarded(routed: &Routed<'_, '_>) -> bool {
    routed.state.rate_limit.is_some()
        || routed.route.max_request_body.is_some()
        || routed.route.auth_request.is_some()
}
