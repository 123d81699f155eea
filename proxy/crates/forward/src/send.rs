//! Sending one request to an upstream: the endpoint picked, the request
//! sent and its answer read, retried within the budget.

use super::*;

impl UpstreamPool {
    // Past 100 lines for one reason: the exchange and its retries are one
    // future, and each part made an awaited function of its own would be a
    // future moved once more per request (a copy of kilobytes; see
    // pipeline/to_upstream.rs). Its synchronous parts are functions below
    // (targets, the retry plan, the next endpoint, hyper's request, the
    // error as the client sees it): +30 instructions a request on /plain,
    // measured against the one-piece version in one sitting.
    /// Sends `out` to the upstream and waits for the response head, within
    /// `timeout`. A request whose connection could not be made is retried
    /// on the next endpoint in, up to `retries` times: nothing was sent,
    /// so any method and body may go again (as nginx's and Envoy's connect
    /// failure retries do); the endpoint is ejected for `eject_for`. A
    /// request that a stale pooled connection gave back unsent is always
    /// sent again on a new connection. With `kept`, the request's head
    /// is left there, on every outcome, with the forwarding fields not in
    /// its map beside it (the own HTTP/1.1 exchange writes them from
    /// there; a reader of the map adds them first).
    pub async fn send(
        &self,
        out: Outgoing,
        params: &matchit::Params<'_, '_>,
        timeout: Duration,
        client: Option<ClientSocket>,
        kept: Option<(&mut HeaderMap, &mut Forwarded)>,
    ) -> Result<(Response<Body>, Held), ForwardError> {
        // Before anything is read or dialled: a request over the cap
        // costs the upstream nothing.
        let mut admitted = match self.request_cap {
            None => None,
            Some(max) => {
                Some(Admitted::take(&self.requests, max).ok_or(ForwardError::Overloaded(max))?)
            }
        };
        let mut rendered = None;
        let (endpoints, template) = self.endpoints(params, &mut rendered)?;
        let version = if self.spec.http2 {
            Version::HTTP_2
        } else {
            Version::HTTP_11
        };
        let Outgoing {
            method,
            path,
            headers: mut owned,
            forwarded: mut owned_forwarded,
            mut body,
            affinity,
            own_host,
            upgrade,
        } = out;
        // The head stays in `kept`, when given, whatever the outcome: a
        // plugin's response hooks read the request as it was forwarded,
        // also on the proxy's own error answer, without a copy per request.
        let keeping = kept.is_some();
        let (headers, forwarded): (&mut HeaderMap, &mut Forwarded) = match kept {
            Some((kept, later)) => {
                *kept = owned;
                *later = owned_forwarded;
                (kept, later)
            }
            None => (&mut owned, &mut owned_forwarded),
        };
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
        let Plan {
            attempts,
            replay_on_status,
            per_try,
        } = self.plan(endpoints.len(), || whole && !upgrade && idempotent(&method));
        // Requests in hand are exchanged with HTTP/1.1 upstreams by this
        // task (`h1`); streamed bodies and upgrades go through hyper's
        // connection task, which reads the response while the body is
        // still going out.
        let in_task = version == Version::HTTP_11 && !upgrade && whole;
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
                    i = self.next_endpoint(i, n, affinity);
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
                let host = (!self.spec.preserve_host && !own_host && version == Version::HTTP_11)
                    .then_some(&ep.host_header);
                // Only least-requests reads the counts; other policies skip
                // the shared atomics on the hot path.
                let guard = (self.spec.balance == Balance::LeastRequests).then(|| {
                    let slot = if template { 0 } else { i };
                    self.in_flight[slot].fetch_add(1, Ordering::Relaxed);
                    InFlight(self.in_flight.clone(), slot as u32)
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
                                    (&*headers, &*forwarded),
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
                                    Ok((resp, ..)) => Some(resp.status().is_server_error()),
                                    Err(h1::ExchangeError::Closed(_)) if reused => None,
                                    Err(_) => Some(true),
                                },
                            );
                            match outcome {
                                Err(h1::ExchangeError::RanOut) => {
                                    last = Some(ran_out()?);
                                    continue 'attempts;
                                }
                                Ok((resp, ..)) if retry_status(resp.status()) => {
                                    // Its body unread, the connection goes.
                                    tracing::debug!(upstream = %self.spec.name, endpoint = %ep, status = resp.status().as_u16(), attempt, "answer to retry");
                                    continue 'attempts;
                                }
                                Ok((resp, framing, keep_alive)) => {
                                    // The head's map serves the next
                                    // response's, unless the caller keeps it.
                                    if !keeping {
                                        conn.recycle(headers);
                                    }
                                    let home = keep_alive.then_some(slot as Arc<dyn h1::Home>);
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
                            forwarded.add_to(headers);
                            // hyper takes the map: a copy while a retry
                            // may need it or the caller keeps it.
                            let head = if last_attempt && !keeping {
                                std::mem::take(headers)
                            } else {
                                headers.clone()
                            };
                            let to = (ep, &path, version);
                            self.hyper_request(&method, to, (head, host, own_host), b)?
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
                                    lease: conn.into_lease().map(Box::new),
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
        let mut result =
            match client_watch::exchange(attempt_all, timeout, client, progress.as_deref()).await {
                Ok(r) => r,
                Err(Cut::TimedOut) => Err(ForwardError::Timeout(timeout)),
                Err(Cut::BodyStalled) => Err(ForwardError::RequestBodyTimeout(timeout)),
                Err(Cut::ClientGone) => Err(ForwardError::ClientGone),
            };
        // Rewritten in place: the answer, a few hundred bytes, not moved.
        if let Err(e) = &mut result {
            as_client_sees(e, progress.as_deref());
        }
        result
    }

    /// The endpoints a request may go to, and whether they come from a
    /// template: the upstream's, or the one its template renders with the
    /// route's parameters (kept in `rendered`).
    #[inline]
    fn endpoints<'a>(
        &'a self,
        params: &matchit::Params<'_, '_>,
        rendered: &'a mut Option<Endpoint>,
    ) -> Result<(&'a [Endpoint], bool), ForwardError> {
        let t = match &self.spec.target {
            Target::Endpoints(e) => return Ok((e, false)),
            Target::Template(t) => t,
        };
        let url = t
            .render(|name| params.get(name))
            .map_err(ForwardError::BadTarget)?;
        let ep = Uri::try_from(url.as_str())
            .ok()
            .and_then(|u| Endpoint::from_uri(&u))
            .ok_or_else(|| {
                ForwardError::BadTarget(format!("`{url}` is not a valid upstream URL"))
            })?;
        Ok((std::slice::from_ref(rendered.insert(ep)), true))
    }

    /// How many tries a request gets over `n` endpoints, and whether its
    /// answers may be thrown away for another (`replayable`: whole in
    /// hand, no upgrade, idempotent; asked only of upstreams that retry
    /// on answers).
    #[inline]
    fn plan(&self, n: usize, replayable: impl FnOnce() -> bool) -> Plan {
        // As nginx's proxy_next_upstream: a retry goes to another endpoint,
        // so a single-endpoint upstream never pays for keeping a copy. Only
        // a failed connect is retried, before any byte of the request left:
        // a streamed body is still untouched then.
        let retryable = self.spec.retries > 0 && n > 1;
        let mut attempts = if retryable {
            1 + self.spec.retries.min(n as u32 - 1)
        } else {
            1
        };
        // A request whose answer may be thrown away for another: whole in
        // hand and safe to send twice. It gets its `retries` even with one
        // endpoint (a Kubernetes Service picks another pod).
        let replay_on_status =
            (!self.spec.retry_on.is_empty() || self.spec.retry_on_reset) && replayable();
        if replay_on_status {
            attempts = attempts.max(1 + self.spec.retries);
        }
        Plan {
            attempts,
            replay_on_status,
            // Each try of a request that may be sent again gets its own
            // deadline; others wait for the request timeout alone.
            per_try: self.spec.per_try_timeout.filter(|_| replay_on_status),
        }
    }

    /// The endpoint a retry goes to after `i` failed: the request's
    /// affinity key's next choice (as its later requests will make once
    /// the failed endpoint is out), or the next one in.
    fn next_endpoint(&self, i: usize, n: usize, affinity: Option<u64>) -> usize {
        match affinity.filter(|_| self.seeds.len() == n) {
            Some(key) => affinity::pick(key, &self.seeds, &self.weights, |j| {
                j == i || self.ejections.is_out(j)
            }),
            None => self.ejections.first_in((i + 1) % n, n),
        }
    }

    /// The request for hyper's client: `head` with the `Host` the
    /// endpoint wants (`host`, for HTTP/1.1), or none where HTTP/2 names
    /// the host in the URI (the client's goes unless preserved).
    fn hyper_request(
        &self,
        method: &Method,
        (ep, path, version): (&Endpoint, &PathAndQuery, Version),
        (head, host, own_host): (HeaderMap, Option<&HeaderValue>, bool),
        body: Body,
    ) -> Result<Request<Body>, ForwardError> {
        let mut r = Request::new(body);
        *r.method_mut() = method.clone();
        *r.uri_mut() = Self::uri(ep, path, version)?;
        *r.version_mut() = version;
        *r.headers_mut() = head;
        match host {
            Some(host) => {
                r.headers_mut().insert(http::header::HOST, host.clone());
            }
            None if !self.spec.preserve_host && !own_host => {
                r.headers_mut().remove(http::header::HOST);
            }
            None => {}
        }
        Ok(r)
    }
}

/// How a request is tried.
struct Plan {
    attempts: u32,
    /// Whether an answer may be dropped for another try (`retry_on`,
    /// `retry_on_reset`).
    replay_on_status: bool,
    /// Each try's deadline, when answers may be dropped.
    per_try: Option<Duration>,
}

/// An exchange's error as the client's: however the upstream side
/// reported it (hyper's "user body error", an HTTP/2 reset), a body cut
/// for its size is the client's 413, and one the client broke its 400
/// (the upstream got a cut body, as hyper aborts the request, and no
/// failure counts against it).
fn as_client_sees(e: &mut ForwardError, progress: Option<&BodyProgress>) {
    let Some(progress) = progress else {
        return;
    };
    if progress.too_large() {
        *e = ForwardError::BodyTooLarge;
    } else if progress.malformed()
        && let ForwardError::Failed(why) = e
    {
        *e = ForwardError::RequestBody(std::mem::take(why));
    }
}
