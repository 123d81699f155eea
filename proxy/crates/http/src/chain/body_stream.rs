//! A body streamed through the body hooks of the plugins that see every
//! body ([`plugin::Hooks::request_body`], [`plugin::Hooks::response_body`]),
//! piece by piece, as Envoy runs a filter's body callbacks: each plugin
//! (in chain order for a request, last first for a response) gets each
//! piece and may pass it on, replace it, or keep it to see with the next
//! (up to [`plugin::seam::MAX_BUFFERED_BODY`]).
//!
//! Trailers follow the body's end through the same plugins
//! ([`plugin::Plugin::on_request_trailers`] and `on_response_trailers`).
//!
//! Once the head has gone, what stops a body (a plugin's answer, its
//! failure when closed, a kept body past the bound) stops it there: a
//! request body ends the upstream request with the client answered by
//! the plugin ([`stopped_body`]: 413 past the bound, as from Envoy); a
//! response body is cut off, as Envoy resets the stream.

use std::pin::Pin;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll, ready};

use bytes::BytesMut;
use http_body::Frame;

use super::*;
use portcullis_forward::BodyError;

/// What stopped a request body once its head had gone, for the answer.
enum Stopped {
    Answer(LocalAnswer),
    TooLarge,
    Failed(PluginError),
}

/// Between a request body streaming to the upstream and its request:
/// whether the request's plugins still take calls, and what stopped the
/// body.
#[derive(Default)]
pub struct BodyStop {
    ended: AtomicBool,
    stopped: Mutex<Option<(usize, Stopped)>>,
}

impl BodyStop {
    /// The request's plugin streams end: no call after this.
    pub(super) fn end(&self) {
        self.ended.store(true, Ordering::Release);
    }
}

/// `body` through the request body hooks of `ctx`'s plugins that see
/// every body and were not given it whole; `body` itself (no allocation)
/// when there are none. `headers` are the request's as forwarded.
pub fn filter_request_body(
    ctx: &mut PluginContext<'_>,
    headers: &http::HeaderMap,
    route: &Route,
    body: Body,
) -> Body {
    let chain = ctx.chain;
    let before = ctx.whole_from.unwrap_or(chain.len());
    let seeing = |(_, b): &(usize, &Arc<dyn Plugin>)| b.hooks().request_body;
    // Most requests have no body: that is one look, where the chain's
    // hooks are a virtual call a plugin.
    if http_body::Body::is_end_stream(&body)
        || !chain[..before].iter().enumerate().any(|p| seeing(&p))
    {
        return body;
    }
    let stop = Arc::new(BodyStop::default());
    ctx.body_stop = Some(stop.clone());
    let stages = (chain[..before].iter().enumerate())
        .filter(seeing)
        .map(|(place, b)| Stage {
            plugin: b.clone(),
            place,
            stream: ctx.streams.get(place),
            kept: None,
        })
        .collect();
    Body::boxed(Filtered {
        inner: body,
        first: None,
        stages,
        facts: ctx.facts.clone(),
        side: Side::Request {
            headers: headers.clone(),
            stop,
        },
        route: route.name.clone(),
        ended: false,
        after: None,
    })
}

/// The client's answer when a plugin stopped the request body (the
/// upstream request failed for it); `None` when none did.
pub fn stopped_body(ctx: &mut PluginContext<'_>, route: &Route) -> Option<Response<Body>> {
    let stop = ctx.body_stop.as_ref()?;
    let (place, why) = stop
        .stopped
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take()?;
    let binding = &*ctx.chain[place];
    Some(match why {
        Stopped::Answer(local) => local_answer(binding, route, local),
        Stopped::TooLarge => json_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "request body too large for the route's plugin",
            route,
            Some(binding.name()),
        ),
        Stopped::Failed(e) => plugin_error(route, &e),
    })
}

/// `body` through the response body hooks of `ctx`'s plugins that see
/// every body; `body` itself (no allocation) when none does. Their
/// streams are ended with the body, as Envoy logs a stream once its
/// response is sent. A body whole at hand with its head goes through
/// them at once ([`through_now`]); the answer to send instead, when a
/// plugin failed on it.
#[allow(clippy::result_large_err)] // unboxed as everywhere on this path
pub fn filter_response_body(
    ctx: &mut PluginContext<'_>,
    route: &Route,
    resp: &mut http::response::Parts,
    mut body: Body,
) -> Result<Body, Response<Body>> {
    let chain = ctx.chain;
    let seeing = |b: &Arc<dyn Plugin>| b.hooks().response_body;
    if !chain.iter().any(seeing) || http_body::Body::is_end_stream(&body) {
        return Ok(body);
    }
    let first = match at_hand(&mut body) {
        Some(None) => return through_now(ctx, route, resp, Bytes::new()),
        Some(Some(Ok(frame))) if frame.is_data() && http_body::Body::is_end_stream(&body) => {
            let whole = frame.into_data().unwrap_or_default();
            return through_now(ctx, route, resp, whole);
        }
        // A piece of a longer body (or its error): the stream's first.
        Some(first) => first,
        None => None,
    };
    let stages = (chain.iter().enumerate().rev())
        .filter(|(_, b)| seeing(b))
        .map(|(place, b)| Stage {
            plugin: b.clone(),
            place,
            stream: ctx.streams.take(place),
            kept: None,
        })
        .collect();
    Ok(Body::boxed(Filtered {
        inner: body,
        first,
        stages,
        facts: ctx.facts.take(),
        side: Side::Response {
            request_headers: std::mem::take(&mut ctx.request_headers),
            request_later: std::mem::take(&mut ctx.request_later),
            status: resp.status.as_u16(),
        },
        route: route.name.clone(),
        ended: false,
        after: None,
    }))
}

/// The body's next frame if it has one at hand (read with the head),
/// without waiting: `None` if it would wait.
fn at_hand(body: &mut Body) -> Option<Option<Result<Frame<Bytes>, BodyError>>> {
    // A waker that does nothing: the poll that waits registers the task's
    // own, as a later poll replaces an earlier one's.
    let mut cx = Context::from_waker(std::task::Waker::noop());
    match http_body::Body::poll_frame(Pin::new(body), &mut cx) {
        Poll::Ready(frame) => Some(frame),
        Poll::Pending => None,
    }
}

/// A response body whole at hand (`whole`, its last piece) through the
/// body hooks of `ctx`'s plugins that see every body, last first, before
/// its head goes: no stream to set up (a box, its stages, a poll per
/// piece). The calls are those the stream would make, with the same
/// outcomes (the head counts as gone, as it would be), but for a
/// plugin's failure: the head has not gone, so it is answered, as Envoy
/// answers it (503) when the body came with the head. The plugins'
/// streams end with the request's context. What to send.
#[allow(clippy::result_large_err)]
pub(super) fn through_now(
    ctx: &mut PluginContext<'_>,
    route: &Route,
    resp: &mut http::response::Parts,
    mut whole: Bytes,
) -> Result<Body, Response<Body>> {
    let chain = ctx.chain;
    let mut changed = false;
    let places = chain.iter().enumerate().rev();
    for (place, binding) in places.filter(|(_, b)| b.hooks().response_body) {
        let mut stream = ctx.streams.get(place);
        let mut gone = http::HeaderMap::new();
        let status = (resp.status.as_u16(), &mut gone);
        let request = (&mut ctx.request_headers, &mut ctx.request_later);
        let lent = lend_gone(&mut ctx.facts, request, status, true);
        let called = binding.on_response_body(&mut stream, lent, &whole);
        ctx.streams.set(place, stream);
        let at = (&mut whole, &mut changed);
        if let Some(stop) = after_whole_body(ctx, &**binding, route, called, at) {
            return stop;
        }
    }
    Ok(whole_sent(resp, whole, changed))
}

/// What one plugin's call on a whole response body, its head not sent
/// yet, makes of it: `whole` replaced (and `changed` set), or (`Some`)
/// what to send instead.
#[allow(clippy::result_large_err)]
pub(super) fn after_whole_body(
    ctx: &mut PluginContext<'_>,
    binding: &dyn Plugin,
    route: &Route,
    called: Result<plugin::BodyVerdict, PluginError>,
    (whole, changed): (&mut Bytes, &mut bool),
) -> Option<Result<Body, Response<Body>>> {
    match called {
        Ok(plugin::BodyVerdict::Continue(Some(new))) => (*whole, *changed) = (new, true),
        // A pause at the body's end lets it go, as in the stream.
        Ok(plugin::BodyVerdict::Continue(None) | plugin::BodyVerdict::Pause) => {}
        Ok(plugin::BodyVerdict::Noted(noted)) => ctx.note(*noted),
        // As from the stream (and from Envoy): the response cut off.
        Ok(plugin::BodyVerdict::Respond(_)) => {
            tracing::warn!(plugin = %binding.name(), route = %route.name, "plugin answered after the response head went; response cut off");
            // It fails at once, as the stream's next piece would.
            let e: BodyError = "a plugin stopped the response body".into();
            let cut = futures_util::stream::iter([Err::<Frame<Bytes>, _>(e)]);
            return Some(Ok(Body::boxed(http_body_util::StreamBody::new(cut))));
        }
        Err(e) => {
            if let Some(Stopped::Failed(e)) = failed(binding, &route.name, e) {
                return Some(Err(plugin_error(route, &e)));
            }
        }
    }
    None
}

/// The whole body to send; the head is not sent yet, so its length
/// follows a replaced body.
pub(super) fn whole_sent(resp: &mut http::response::Parts, whole: Bytes, changed: bool) -> Body {
    if changed && resp.headers.contains_key(http::header::CONTENT_LENGTH) {
        resp.headers
            .insert(http::header::CONTENT_LENGTH, whole.len().into());
    }
    Body::full(whole)
}

/// One plugin's place in the body's way.
struct Stage {
    plugin: Arc<dyn Plugin>,
    place: usize,
    stream: plugin::Stream,
    /// What it kept to see with the next piece.
    kept: Option<BytesMut>,
}

enum Side {
    /// A request body: its headers as forwarded, and where to leave what
    /// stopped it (the request's plugins own their streams).
    Request {
        headers: http::HeaderMap,
        stop: Arc<BodyStop>,
    },
    /// A response body: the request as forwarded and the status sent
    /// (the head itself has gone: its calls see none of it); the stages
    /// own their streams, ended with the body.
    Response {
        request_headers: http::HeaderMap,
        request_later: plugin::Forwarded,
        status: u16,
    },
}

struct Filtered {
    inner: Body,
    /// A frame taken from `inner` before the stream began, sent first.
    first: Option<Result<Frame<Bytes>, BodyError>>,
    stages: Vec<Stage>,
    facts: Option<RequestFacts>,
    side: Side,
    route: Arc<str>,
    /// Whether the plugins have seen the end of the body.
    ended: bool,
    /// The trailers, held while the last data goes.
    after: Option<Frame<Bytes>>,
}

impl Filtered {
    /// `piece` through every stage: what comes out the end.
    fn run(&mut self, mut piece: Bytes, end_of_stream: bool) -> Result<Bytes, BodyError> {
        if let Side::Request { stop, .. } = &self.side
            && stop.ended.load(Ordering::Acquire)
        {
            return Ok(piece);
        }
        for stage in &mut self.stages {
            let given = match stage.kept.take() {
                Some(mut kept) => {
                    kept.extend_from_slice(&piece);
                    kept.freeze()
                }
                None => piece,
            };
            let called = call(
                stage,
                &mut self.facts,
                &mut self.side,
                &given,
                end_of_stream,
            );
            let name = stage.plugin.name();
            let route = &self.route;
            let stopped = match called {
                Ok(plugin::BodyVerdict::Continue(new)) => {
                    piece = new.unwrap_or(given);
                    continue;
                }
                // The head and its access line have gone (the plugin
                // counted it): sent on.
                Ok(plugin::BodyVerdict::Noted(_)) => {
                    piece = given;
                    continue;
                }
                Ok(plugin::BodyVerdict::Pause) if end_of_stream => {
                    piece = given;
                    continue;
                }
                Ok(plugin::BodyVerdict::Pause)
                    if given.len() <= plugin::seam::MAX_BUFFERED_BODY as usize =>
                {
                    stage.kept = Some(BytesMut::from(given));
                    return Ok(Bytes::new());
                }
                Ok(plugin::BodyVerdict::Pause) => {
                    tracing::warn!(plugin = %name, route = %route, "body too large for the plugin to keep; stopped");
                    Stopped::TooLarge
                }
                Ok(plugin::BodyVerdict::Respond(local)) => Stopped::Answer(*local),
                Err(e) => match failed(&*stage.plugin, route, e) {
                    Some(stopped) => stopped,
                    None => {
                        piece = given;
                        continue;
                    }
                },
            };
            let place = stage.place;
            return Err(self.stop(place, stopped));
        }
        Ok(piece)
    }

    /// The trailers held in `after` through every stage, in the body's
    /// order, each editing them in place (Envoy's trailers callbacks).
    fn run_trailers(&mut self) -> Result<(), BodyError> {
        let Some(Ok(mut trailers)) = self.after.take().map(Frame::into_trailers) else {
            return Ok(());
        };
        let ended =
            matches!(&self.side, Side::Request { stop, .. } if stop.ended.load(Ordering::Acquire));
        for stage in self.stages.iter_mut().filter(|_| !ended) {
            let called = call_trailers(stage, &mut self.facts, &mut self.side, &mut trailers);
            let stopped = match called {
                Ok(None) => continue,
                Ok(Some(local)) => Stopped::Answer(local),
                Err(e) => match failed(&*stage.plugin, &self.route, e) {
                    Some(stopped) => stopped,
                    None => continue,
                },
            };
            let place = stage.place;
            return Err(self.stop(place, stopped));
        }
        self.after = Some(Frame::trailers(trailers));
        Ok(())
    }

    /// Leaves what stopped a request body for its answer; the error that
    /// ends the body.
    fn stop(&self, place: usize, stopped: Stopped) -> BodyError {
        match &self.side {
            Side::Request { stop, .. } => {
                *stop.stopped.lock().unwrap_or_else(|p| p.into_inner()) = Some((place, stopped));
                "a plugin stopped the request body".into()
            }
            Side::Response { .. } => {
                if let Stopped::Answer(_) = stopped {
                    tracing::warn!(route = %self.route, "plugin answered after the response head went; response cut off");
                }
                "a plugin stopped the response body".into()
            }
        }
    }
}

/// A plugin's failed body call under its `fail` mode: `None` to go on (open),
/// or what stops the body (closed).
fn failed(plugin: &dyn Plugin, route: &str, e: PluginError) -> Option<Stopped> {
    let name = plugin.name();
    count_failure(plugin, &e);
    if plugin.fail() == FailMode::Open {
        tracing::warn!(plugin = %name, route = %route, error = %e, "plugin failed on a body; body let through (fail: open)");
        return None;
    }
    tracing::warn!(plugin = %name, route = %route, error = %e, "plugin failed on a body; stopped (fail: closed)");
    Some(Stopped::Failed(e))
}

/// What a body or trailers call is lent once the head has gone: its
/// status, and `gone` (empty) for its headers.
fn lend_gone<'a>(
    facts: &'a mut Option<RequestFacts>,
    (request_headers, request_later): (&'a mut http::HeaderMap, &'a mut plugin::Forwarded),
    (status, gone): (u16, &'a mut http::HeaderMap),
    end_of_stream: bool,
) -> plugin::ResponseLent<'a> {
    plugin::ResponseLent {
        facts,
        request_headers,
        request_later,
        status,
        headers: gone,
        end_of_stream,
        head_sent: true,
    }
}

/// One stage's call on the trailers.
fn call_trailers(
    stage: &mut Stage,
    facts: &mut Option<RequestFacts>,
    side: &mut Side,
    trailers: &mut http::HeaderMap,
) -> Result<Option<LocalAnswer>, PluginError> {
    match side {
        Side::Request { headers, .. } => {
            let lent = plugin::RequestLent {
                facts,
                headers,
                end_of_stream: true,
            };
            stage
                .plugin
                .on_request_trailers(&mut stage.stream, lent, trailers)
        }
        Side::Response {
            request_headers,
            request_later,
            status,
        } => {
            let mut gone = http::HeaderMap::new();
            let request = (request_headers, request_later);
            let lent = lend_gone(facts, request, (*status, &mut gone), true);
            stage
                .plugin
                .on_response_trailers(&mut stage.stream, lent, trailers)
        }
    }
}

/// One stage's call on `body`.
fn call(
    stage: &mut Stage,
    facts: &mut Option<RequestFacts>,
    side: &mut Side,
    body: &Bytes,
    end_of_stream: bool,
) -> Result<plugin::BodyVerdict, PluginError> {
    match side {
        Side::Request { headers, .. } => {
            let lent = plugin::RequestLent {
                facts,
                headers,
                end_of_stream,
            };
            stage.plugin.on_request_body(&mut stage.stream, lent, body)
        }
        Side::Response {
            request_headers,
            request_later,
            status,
        } => {
            let mut gone = http::HeaderMap::new();
            let request = (request_headers, request_later);
            let lent = lend_gone(facts, request, (*status, &mut gone), end_of_stream);
            stage.plugin.on_response_body(&mut stage.stream, lent, body)
        }
    }
}

impl Drop for Filtered {
    /// A response body's stages end their streams (a request body's are
    /// the request's plugins' to end).
    fn drop(&mut self) {
        if let Side::Response { .. } = self.side {
            for stage in self.stages.drain(..) {
                if stage.stream != plugin::Stream::NONE {
                    stage.plugin.end(stage.stream);
                }
            }
        }
    }
}

impl http_body::Body for Filtered {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        loop {
            if this.ended {
                return Poll::Ready(this.after.take().map(Ok));
            }
            let frame = match this.first.take() {
                Some(first) => Some(first),
                None => ready!(Pin::new(&mut this.inner).poll_frame(cx)),
            };
            let (piece, end_of_stream) = match frame {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => (data, http_body::Body::is_end_stream(&this.inner)),
                    // Trailers end the body: the plugins see its end first.
                    Err(trailers) => {
                        this.after = Some(trailers);
                        (Bytes::new(), true)
                    }
                },
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                None => (Bytes::new(), true),
            };
            this.ended = end_of_stream;
            let out = this.run(piece, end_of_stream)?;
            this.run_trailers()?;
            if !out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(out))));
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.after.is_none()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        // A plugin may change the length: only its end is known.
        http_body::SizeHint::default()
    }
}
