//! Running a route's plugin chain on a request and its response.
//!
//! Plugins run in order (global ones first). Each may let the request on
//! with header edits, a new path or another upstream; answer it itself; or
//! ask for the body first, which is then read (up to the plugin's bound)
//! and forwarded exactly as the plugin saw it. Response hooks run in
//! reverse order on the upstream's response head.

mod body;
mod body_stream;
mod callout;
mod local;
mod response;
mod whole;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header;
use http::uri::PathAndQuery;
use http::{Response, StatusCode};

use crate::conn_info::ConnInfo;
use portcullis_config::{Config, FailMode, Route};
use portcullis_forward::Body;
use portcullis_plugin::{
    self as plugin, LocalAnswer, Plugin, PluginError, RequestFacts, ResponseVerdict, Verdict,
};

pub use body_stream::{filter_request_body, filter_response_body, stopped_body};
pub use callout::PendingCallout;
pub use local::error_message;
use local::{local_answer, local_through, misbehaved};
pub use response::{HeldHead, ResponseStep, on_response, read_whole};
pub use whole::{Whole, whole_response};

/// What the request hooks decided.
pub enum RequestOutcome<'a> {
    /// Go on to the upstream, with what the response hooks or the
    /// forwarding need (`None` when nothing).
    Forward(Option<Box<PluginContext<'a>>>),
    /// Answer now with this.
    Answer(Response<Body>),
}

/// How far the request hooks got without waiting on anything.
pub enum Step<'a> {
    /// All of them ran.
    Done(RequestOutcome<'a>),
    /// A plugin asked for the body: read it with [`PendingBody::read`],
    /// which runs the rest of the chain.
    ReadBody(Box<PendingBody<'a>>),
    /// A plugin made a callout: send it ([`PendingCallout::request`])
    /// and give its answer to [`PendingCallout::answered`], which runs
    /// the rest of the chain.
    Callout(Box<PendingCallout<'a>>),
}

/// What the request hooks have set so far: the context the response
/// hooks get, made once and boxed from the start, so it goes from step to
/// step and on to the forwarding as a pointer (moved by value, its ~400
/// bytes were copied three times a request: ~270 instructions on `/pw`,
/// bench/instructions.sh).
struct Progress<'a>(Box<PluginContext<'a>>);

impl<'a> Progress<'a> {
    /// Nothing set yet, on a request of `facts`.
    fn new(chain: &'a [Arc<dyn Plugin>], facts: Option<RequestFacts>) -> Progress<'a> {
        Progress(Box::new(PluginContext {
            facts,
            request_headers: http::HeaderMap::new(),
            request_later: Default::default(),
            chain,
            upstream: None,
            path: None,
            body: None,
            whole_from: None,
            keeps_request_headers: false,
            body_stop: None,
            notes: None,
            streams: Streams {
                held: smallvec::SmallVec::new(),
            },
        }))
    }

    /// All of it, moved out; an empty progress left in its place.
    fn take(&mut self, chain: &'a [Arc<dyn Plugin>]) -> Progress<'a> {
        std::mem::replace(self, Progress::new(chain, None))
    }
}

impl<'a> std::ops::Deref for Progress<'a> {
    type Target = PluginContext<'a>;
    fn deref(&self) -> &PluginContext<'a> {
        &self.0
    }
}

impl std::ops::DerefMut for Progress<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

/// What plugins keep of the request between calls ([`plugin::Stream`]),
/// by their place in the chain; ended when the request is over, however
/// it ends (its [`PluginContext`] ends them when dropped). Empty, and
/// allocation-free, for plugins that keep nothing.
struct Streams {
    /// Inline for the usual chain of one or two plugins that keep a
    /// stream: a vector's allocation and free cost ~150 instructions a
    /// request (bench/instructions.sh, `/pw`).
    held: smallvec::SmallVec<[(usize, plugin::Stream); 2]>,
}

impl Streams {
    fn get(&self, at: usize) -> plugin::Stream {
        self.held
            .iter()
            .find(|(i, _)| *i == at)
            .map_or(plugin::Stream::NONE, |(_, s)| *s)
    }

    /// What `at` keeps, taken out: the taker ends it.
    fn take(&mut self, at: usize) -> plugin::Stream {
        match self.held.iter().position(|(i, _)| *i == at) {
            Some(i) => self.held.swap_remove(i).1,
            None => plugin::Stream::NONE,
        }
    }

    /// Keeps what `at` keeps now (a later call may change it: a wrapper's
    /// flags, a stream a callout's answer made).
    fn set(&mut self, at: usize, stream: plugin::Stream) {
        if stream == plugin::Stream::NONE {
            return;
        }
        match self.held.iter_mut().find(|(i, _)| *i == at) {
            Some((_, held)) => *held = stream,
            None => self.held.push((at, stream)),
        }
    }
}

/// A chain stopped at the plugin that asked for the request body.
pub struct PendingBody<'a> {
    chain: &'a [Arc<dyn Plugin>],
    /// Index (among the request hooks) of the plugin that asked.
    at: usize,
    max: u32,
    progress: Progress<'a>,
}

/// What the response hooks need, kept from the request hooks.
pub struct PluginContext<'a> {
    /// What the request hooks saw, kept only when a response hook will
    /// want it (`None` otherwise, or while lent to a call).
    facts: Option<RequestFacts>,
    /// The request headers as forwarded, likewise: the forwarding leaves
    /// them here ([`PluginContext::request_headers_slot`]).
    request_headers: http::HeaderMap,
    /// The proxy's forwarding fields not yet in `request_headers`, added
    /// when a response hook first reads them (see
    /// [`plugin::ResponseLent::request_later`]).
    request_later: plugin::Forwarded,
    /// Whether a response hook will read them.
    keeps_request_headers: bool,
    /// Borrowed from the pipeline, which outlives the request: no
    /// reference count shared by the workers to bump per request.
    chain: &'a [Arc<dyn Plugin>],
    /// Another upstream (index), if a plugin chose one.
    pub upstream: Option<usize>,
    /// The path to send, if a plugin set one (it replaces the route's rewrite).
    pub path: Option<PathAndQuery>,
    /// The request body a plugin set, for the body read to take.
    body: Option<Bytes>,
    /// Where plugins were given the request body whole from (see
    /// `Progress`).
    whole_from: Option<usize>,
    /// What the request body's plugins decided once its head went: set by
    /// [`filter_request_body`].
    body_stop: Option<Arc<body_stream::BodyStop>>,
    /// What plugins in shadow mode would have done, for the access line
    /// (boxed: rare; every byte here is copied into the box per request).
    notes: Option<Box<Notes>>,
    streams: Streams,
}

/// What plugins in shadow mode would have done to a request answered
/// without its context (a plugin's or the proxy's answer), carried in
/// the answer's extensions to its access line.
#[derive(Debug, Clone, Default)]
pub struct Notes(pub Vec<plugin::Noted>);

impl PluginContext<'_> {
    /// Where the forwarding leaves the request's head once it has gone,
    /// when a response hook reads it (`None`: none does): the map sent is
    /// the map kept, no copy made for the hooks (~500 instructions a
    /// request of a header-only proxy-wasm filter, bench/instructions.sh).
    /// With the map, where the forwarding fields it leaves out of it go.
    pub fn request_headers_slot(
        &mut self,
    ) -> Option<(&mut http::HeaderMap, &mut plugin::Forwarded)> {
        self.keeps_request_headers
            .then_some((&mut self.request_headers, &mut self.request_later))
    }

    /// Whether plugins in shadow mode noted anything.
    #[inline]
    pub fn has_notes(&self) -> bool {
        self.notes.is_some()
    }

    /// What plugins in shadow mode noted so far, taken.
    pub fn take_notes(&mut self) -> Vec<plugin::Noted> {
        self.notes.take().map(|n| n.0).unwrap_or_default()
    }

    fn note(&mut self, noted: plugin::Noted) {
        self.notes.get_or_insert_default().0.push(noted);
    }

    /// `resp` with the notes taken into its extensions, if there are any.
    pub fn noted(&mut self, mut resp: Response<Body>) -> Response<Body> {
        if let Some(notes) = self.notes.take() {
            resp.extensions_mut().insert(*notes);
        }
        resp
    }
}

impl Drop for PluginContext<'_> {
    /// A request body still streaming calls no plugin after this; then
    /// what plugins keep of the request ends.
    fn drop(&mut self) {
        if let Some(stop) = &self.body_stop {
            stop.end();
        }
        for (at, stream) in self.streams.held.drain(..) {
            self.chain[at].end(stream);
        }
        // The request head kept for the response hooks serves a later
        // response head on this worker, as a head not kept does.
        if self.keeps_request_headers {
            portcullis_forward::h1::spare_maps::give(std::mem::take(&mut self.request_headers));
        }
    }
}

fn plugin_error(route: &Route, e: &PluginError) -> Response<Body> {
    json_error(e.status(), e.kind(), route, Some(e.plugin()))
}

fn json_error(
    status: StatusCode,
    message: &str,
    route: &Route,
    plugin: Option<&str>,
) -> Response<Body> {
    crate::answers::json_error(status, message, Some(route), plugin)
}

/// Runs the request hooks of `chain`, without waiting on anything: a
/// plain function, so a route's plugins cost no future of their own (and
/// no allocation) unless one asks for the body.
#[allow(clippy::too_many_arguments)]
pub fn on_request<'a>(
    chain: &'a [Arc<dyn Plugin>],
    (method, uri, bodiless): (&http::Method, &http::Uri, bool),
    headers: &mut http::HeaderMap,
    path: &str,
    params: &matchit::Params<'_, '_>,
    (route_index, route): (usize, &Route),
    conn: &ConnInfo,
    config: &Config,
) -> Step<'a> {
    let facts = RequestFacts {
        method: method.clone(),
        uri: uri.clone(),
        normalized: (path != uri.path()).then(|| path.to_owned()),
        rewritten: None,
        client: conn.client.ip(),
        tls: conn.tls,
        sni: conn.sni.clone(),
        client_cert: conn.client_cert.clone(),
        route: route_index,
        params: params
            .iter()
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
            .collect(),
        bodiless,
    };
    let progress = Progress::new(chain, Some(facts));
    run_from(chain, 0, progress, headers, None, route, config)
}

/// The plugins of `chain` with a request hook, in order, with their
/// places in the chain.
fn request_hooks(chain: &[Arc<dyn Plugin>]) -> impl Iterator<Item = (usize, &Arc<dyn Plugin>)> {
    chain.iter().enumerate().filter(|(_, b)| b.hooks().request)
}

/// Runs the request hooks from the `start`th on, inline (`body`: the
/// request body, once read for a plugin): stops at the first that asks
/// for the body or makes a callout.
fn run_from<'a>(
    chain: &'a [Arc<dyn Plugin>],
    start: usize,
    mut progress: Progress<'a>,
    headers: &mut http::HeaderMap,
    body: Option<Bytes>,
    route: &Route,
    config: &Config,
) -> Step<'a> {
    for (at, (place, binding)) in request_hooks(chain).enumerate().skip(start) {
        let mut stream = progress.streams.get(place);
        let given = body.as_deref();
        let result = binding.on_request(&mut stream, &mut progress.facts, headers, given);
        progress.streams.set(place, stream);
        let flow = after_call(&**binding, result, &mut progress, route, config);
        let waiting = Waiting {
            chain,
            at,
            place,
            body: body.clone(),
        };
        if let Some(step) = waiting.step(flow, &mut progress, headers, route) {
            return step;
        }
    }
    Step::Done(finish(chain, progress))
}

/// Where the chain stands when a plugin's call is done.
struct Waiting<'a> {
    chain: &'a [Arc<dyn Plugin>],
    /// The plugin's index among the request hooks, and place in the chain.
    at: usize,
    place: usize,
    /// The request body, when it has been read for a plugin.
    body: Option<Bytes>,
}

impl<'a> Waiting<'a> {
    /// What `flow` makes of the chain: `None` to go on to the next plugin,
    /// or the step to take (`progress` lent, not moved: it is ~400 bytes,
    /// and most calls go on).
    fn step(
        self,
        flow: Flow,
        progress: &mut Progress<'a>,
        headers: &mut http::HeaderMap,
        route: &Route,
    ) -> Option<Step<'a>> {
        let Waiting {
            chain,
            at,
            place,
            body,
        } = self;
        let answer = |progress: &mut Progress<'a>, resp| {
            Some(Step::Done(RequestOutcome::Answer(progress.noted(resp))))
        };
        match flow {
            Flow::Next => None,
            Flow::Answer(resp) => answer(progress, resp),
            Flow::Local(resp) => {
                let resp = local_through(chain, place, progress, headers, route, resp);
                answer(progress, resp)
            }
            Flow::WantsBody(_) if body.is_some() => {
                let binding = &chain[place];
                let e = PluginError::Trap {
                    plugin: binding.name().clone(),
                    message: "asked for the body twice".into(),
                };
                fail(&**binding, route, &e).and_then(|resp| answer(progress, resp))
            }
            Flow::WantsBody(max) => Some(Step::ReadBody(Box::new(PendingBody {
                chain,
                at,
                max,
                progress: progress.take(chain),
            }))),
            Flow::Callout(request) => Some(Step::Callout(Box::new(PendingCallout::new(
                (chain, at, place),
                progress.take(chain),
                request,
                body,
            )))),
        }
    }
}

/// What a plugin's answer leaves the chain to do.
enum Flow {
    /// Answer the request with what the plugin made.
    Local(Response<Body>),
    /// On to the next plugin.
    Next,
    /// Answer the request with this.
    Answer(Response<Body>),
    /// The plugin wants the body, up to this many bytes.
    WantsBody(u32),
    /// The plugin made a callout and waits for its answer.
    Callout(Box<plugin::Callout>),
}

/// Applies one plugin's verdict (or failure) to the request; its header
/// edits are made already.
fn after_call(
    binding: &dyn Plugin,
    result: Result<Verdict, PluginError>,
    progress: &mut Progress<'_>,
    route: &Route,
    config: &Config,
) -> Flow {
    match result {
        Ok(Verdict::Continue(f)) => {
            if let Some(body) = f.body {
                progress.body = Some(body);
            }
            if let Some(p) = f.path {
                match plugin_path(&p) {
                    Some(pq) => {
                        if let Some(f) = progress.facts.as_mut() {
                            f.rewritten = Some(pq.clone());
                        }
                        progress.path = Some(pq);
                    }
                    None => {
                        tracing::warn!(plugin = %binding.name(), route = %route.name, path = %p, "plugin set an invalid path");
                        return Flow::Answer(misbehaved(
                            binding,
                            route,
                            "plugin set an invalid path",
                        ));
                    }
                }
            }
            if let Some(name) = f.upstream {
                match config.upstream_index(&name) {
                    Some(u) => progress.upstream = Some(u),
                    None => {
                        tracing::warn!(plugin = %binding.name(), route = %route.name, upstream = %name, "plugin chose an unknown upstream");
                        return Flow::Answer(misbehaved(
                            binding,
                            route,
                            "plugin chose an unknown upstream",
                        ));
                    }
                }
            }
            Flow::Next
        }
        Ok(Verdict::Respond(local)) => Flow::Local(local_answer(binding, route, *local)),
        Ok(Verdict::Noted(noted)) => {
            progress.note(*noted);
            Flow::Next
        }
        Ok(Verdict::ReadBody(max)) => Flow::WantsBody(max),
        Ok(Verdict::Callout(request)) => Flow::Callout(request),
        Err(e) => match fail(binding, route, &e) {
            Some(resp) => Flow::Answer(resp),
            None => Flow::Next,
        },
    }
}

/// What a response call is lent.
fn lend<'a>(
    facts: &'a mut Option<RequestFacts>,
    (request_headers, request_later): (&'a mut http::HeaderMap, &'a mut plugin::Forwarded),
    parts: &'a mut http::response::Parts,
    end_of_stream: bool,
) -> plugin::ResponseLent<'a> {
    plugin::ResponseLent {
        facts,
        request_headers,
        request_later,
        status: parts.status.as_u16(),
        headers: &mut parts.headers,
        end_of_stream,
        head_sent: false,
    }
}

/// The path a plugin set, when it can be sent: origin form (`/...`,
/// with a query perhaps), nothing a request target may not hold.
pub fn plugin_path(path: &str) -> Option<PathAndQuery> {
    let pq = PathAndQuery::try_from(path).ok()?;
    path.starts_with('/').then_some(pq)
}

/// What the request hooks leave for the forwarding and the response hooks.
fn finish<'a>(chain: &'a [Arc<dyn Plugin>], progress: Progress<'a>) -> RequestOutcome<'a> {
    // Response hooks read the request too; keep it only when one will.
    let wants_response = chain
        .iter()
        .any(|b| b.hooks().response || b.hooks().request_body);
    if !wants_response
        && progress.upstream.is_none()
        && progress.path.is_none()
        && !progress.has_notes()
    {
        return RequestOutcome::Forward(None);
    }
    let mut context = progress.0;
    if wants_response {
        context.keeps_request_headers = true;
    } else {
        context.facts = None;
    }
    context.body = None;
    RequestOutcome::Forward(Some(context))
}

/// Counts a plugin failure in the plugin's metrics.
fn count_failure(binding: &dyn Plugin, e: &PluginError) {
    let mut c = plugin::counters().lock().unwrap_or_else(|p| p.into_inner());
    c.add(binding.name(), "failures", 1);
    if matches!(e, PluginError::Timeout { .. }) {
        c.add(binding.name(), "deadline_hits", 1);
    }
}

/// Logs a plugin failure and applies its failure policy: `Some` answer
/// when closed, `None` (carry on) when open.
fn fail(binding: &dyn Plugin, route: &Route, e: &PluginError) -> Option<Response<Body>> {
    count_failure(binding, e);
    match binding.fail() {
        FailMode::Closed => {
            tracing::warn!(plugin = %binding.name(), route = %route.name, error = %e, "plugin failed; request refused (fail: closed)");
            Some(plugin_error(route, e))
        }
        FailMode::Open => {
            tracing::warn!(plugin = %binding.name(), route = %route.name, error = %e, "plugin failed; request let through (fail: open)");
            None
        }
    }
}
