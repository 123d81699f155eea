//! The one request path: every listener's requests (the routing core's,
//! the tunnel client's, the tunnel server's public side and peers) go
//! through [`drive`], which runs the phases of [`Phases`] the same way for
//! all (Pingora's `ProxyHttp` is the model):
//!
//! 1. **admit**: the trace is joined or started, the access-log record
//!    and the metrics' pending count opened, the request id kept, made
//!    or left, as the connection's [`Entry`] says;
//! 2. **route, plugins, forward**: [`Phases::serve`], the one part each
//!    kind of listener does its own way (the routing core routes, runs
//!    plugins and forwards to an upstream of the policies; the tunnel
//!    server routes by host name and forwards to a carried upstream, a
//!    runtime's tunnel: `forward::carried`);
//! 3. **respond**: gRPC clients get the proxy's own errors in gRPC's
//!    terms, HEAD and 204/304 answers lose any body, the request id goes
//!    back when it was made here, [`Phases::finish`] adds its last
//!    touches, and the body carries the log record and the count to the
//!    response's end, where 499s and cut bodies are told apart.

use portcullis_net::stamp::Stamp;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use http::header::{self, HeaderValue};
use http::{Method, Request, Response, Version};

use crate::answers::make_bodiless;
use portcullis_config::{RequestIds, Tracing};
use portcullis_forward::client_watch::ClientSocket;
use portcullis_forward::{Body, ResponseBody};
use portcullis_forward::{Held, UpstreamPool};
use portcullis_net::client_cert::ClientCertificate;
use portcullis_obs::metrics::{self, RouteStats};
use portcullis_obs::otlp::{Arrival, Recording};
use portcullis_obs::telemetry::AccessLog;

/// How a request enters: what its connection tells every phase.
pub struct Entry<'c> {
    /// The client: the peer, or the address its PROXY header gave.
    pub client: SocketAddr,
    /// The worker thread serving it.
    pub worker: usize,
    /// Its connection's TLS version, for the access line.
    pub tls_version: Option<&'static str>,
    /// The client's verified certificate (mutual TLS), for the access line.
    pub client_cert: Option<&'c Arc<ClientCertificate>>,
    /// Whether its id is kept, made when missing, or left alone.
    pub request_ids: RequestIds,
    /// The metrics its answer counts in until a phase knows better; `None`:
    /// not counted here (a tunnel server counts a request where the
    /// public reached, not again on the peer that serves it).
    pub counted: Option<&'static RouteStats>,
    /// The client's socket, watched while the answer is written.
    pub watch: Option<ClientSocket>,
}

/// One request's state across the phases. Dropped with the request's
/// future when its client leaves first: the access line and the count
/// are then written as 499, under the route (or runtime) known by then.
pub struct RequestCtx {
    /// Its access-log record (`None` when no line is written).
    pub log: Option<Box<AccessLog>>,
    /// Its id, when it has one.
    pub request_id: Option<HeaderValue>,
    /// Its count in the metrics, when it is counted here.
    counted: Option<metrics::Pending>,
    /// Where [`RequestCtx::stats`] points when it is not.
    uncounted: &'static RouteStats,
}

impl RequestCtx {
    /// The metrics it counts in (its route's, or its runtime's), for a
    /// phase to set once it knows them.
    pub fn stats(&mut self) -> &mut &'static RouteStats {
        self.parts().2
    }

    /// Its log record, id and metrics at once.
    pub fn parts(
        &mut self,
    ) -> (
        &mut Option<Box<AccessLog>>,
        Option<&HeaderValue>,
        &mut &'static RouteStats,
    ) {
        let stats = match &mut self.counted {
            Some(counted) => &mut counted.stats,
            None => &mut self.uncounted,
        };
        (&mut self.log, self.request_id.as_ref(), stats)
    }
}

/// What one kind of listener does in the phases [`drive`] runs.
pub trait Phases: Sync {
    /// What is known of the connection (and listener) a request came on.
    type Conn: Sync;

    /// How a request on `conn` enters (`version`: its HTTP version).
    fn entry<'c>(&self, conn: &'c Self::Conn, version: Version) -> Entry<'c>;

    /// Where a sampled request's span goes, and where the request came
    /// from as the span takes it; `None` when requests here are not traced.
    fn trace(&self, conn: &Self::Conn) -> Option<(&Arc<Tracing>, &Arc<UpstreamPool>, Arrival)>;

    /// Route, plugins and forward: the answer, and what its body holds
    /// until it ends. Sets `ctx.stats` once the route (or runtime) is
    /// known, and the log record's route and upstream.
    fn serve<B>(
        &self,
        req: Request<B>,
        conn: &Self::Conn,
        ctx: &mut RequestCtx,
    ) -> impl Future<Output = (Response<Body>, Held)> + Send
    where
        B: http_body::Body + Into<Body> + Send;

    /// Last touches on the answer before it goes out (the tunnel server's
    /// `Alt-Svc`, say); nothing by default.
    fn finish(&self, _resp: &mut Response<Body>, _version: Version, _conn: &Self::Conn) {}
}

/// Handles one request end to end through `phases`. Never fails: every
/// problem becomes an HTTP answer.
#[inline]
pub async fn drive<P, B>(phases: &P, mut req: Request<B>, conn: &P::Conn) -> Response<ResponseBody>
where
    P: Phases,
    B: http_body::Body + Into<Body> + Send,
{
    let start = Stamp::now();
    let version = req.version();
    let entry = phases.entry(conn, version);
    // Before the access-log record: a sampled request needs one.
    let trace = phases.trace(conn).map(|(tracing, pool, from)| {
        // An HTTP/1 request has none: nothing is cloned.
        let authority = req.uri().authority().cloned();
        let head = (authority.as_ref(), version);
        Recording::begin(tracing, pool, req.headers_mut(), head, from)
    });
    let mut log = AccessLog::start(
        (req.method(), req.uri().path_and_query(), version),
        (entry.client, entry.worker),
        start,
        trace.as_ref().is_some_and(Recording::sampled),
    );
    let (request_id, made) = match entry.request_ids {
        RequestIds::Keep => (
            crate::request_head::first(req.headers(), &portcullis_obs::request_id::HEADER).cloned(),
            false,
        ),
        RequestIds::Make => (
            Some(portcullis_obs::request_id::ensure(req.headers_mut())),
            true,
        ),
        RequestIds::Off => (None, false),
    };
    if let Some(log) = log.as_mut() {
        log.request_id = request_id.clone();
        log.tls = entry.tls_version;
        log.client_cert = entry.client_cert.cloned();
        log.trace = trace.map(Box::new);
    }
    let counted = entry
        .counted
        .map(|stats| metrics::Pending::unanswered(stats, start));
    let head = req.method() == Method::HEAD;
    // Read before the request is taken apart; a GET never looks.
    let grpc = crate::grpc_local::is_grpc(req.method(), req.headers())
        .then(|| req.headers().get(header::CONTENT_TYPE).cloned());
    let mut ctx = RequestCtx {
        log,
        request_id,
        counted,
        uncounted: metrics::unrouted(),
    };
    let (mut resp, held) = phases.serve(req, conn, &mut ctx).await;
    let status = resp.status().as_u16();
    // Logged and counted with the HTTP status chosen; answered in gRPC's
    // terms.
    match grpc {
        Some(content_type) => resp = crate::grpc_local::answer(resp, content_type),
        None => make_bodiless(&mut resp, head),
    }
    let RequestCtx {
        mut log,
        request_id,
        mut counted,
        ..
    } = ctx;
    if let Some(log) = log.as_mut() {
        log.status = status;
        // What plugins in shadow mode noted of a request their context
        // did not see to the end (an answer made on the way).
        if let Some(crate::chain::Notes(notes)) = resp.extensions_mut().remove() {
            for n in &notes {
                log.note_shadow(&n.plugin, &n.what);
            }
        }
    }
    if let Some(counted) = counted.as_mut() {
        counted.status = status;
    }
    if made && let Some(id) = request_id {
        portcullis_obs::request_id::answer_with(resp.headers_mut(), id);
    }
    phases.finish(&mut resp, version, conn);
    resp.map(|body| ResponseBody::new(body, log, counted, held).watching(entry.watch))
}
