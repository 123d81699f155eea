//! The routing core's phases (see [`crate::phases`]): route → plugins →
//! (answer | forward), for its listeners and the tunnel client.
//!
//! A [`Pipeline`] is built from one [`Config`] and never changes; a reload
//! builds a new one and swaps it in, while requests in flight keep theirs.
//! Here: the pipeline, its build and its [`Phases`](crate::phases::Phases)
//! implementation; `route.rs` routes and runs the guards and plugins,
//! `to_upstream.rs` forwards, `answers.rs` makes the proxy's own answers.

use std::borrow::Cow;
use std::cell::RefCell;

use portcullis_net::stamp::Stamp;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Instant;

use arc_swap::ArcSwap;
use http::header::{self, HeaderValue};
use http::uri::PathAndQuery;
use http::{Method, Request, Response, StatusCode, Version};
use tokio_util::task::TaskTracker;

use crate::route_state::{self, RouteState};
use crate::{chain, request_head};
use portcullis_config::{Action, Config, PathRewrite, Probe, Route, Upstream};
use portcullis_forward::client_watch::ClientSocket;
use portcullis_forward::{self as forward, ForwardError, Outgoing, UpstreamPool};
use portcullis_forward::{Body, ResponseBody};
use portcullis_obs::metrics;
use portcullis_obs::telemetry::AccessLog;
use portcullis_plugin as plugin;

mod route;
mod to_upstream;

use crate::answers::*;
pub use crate::answers::{Linger, error_response, json_error, json_response, make_bodiless};
pub use crate::conn_info::ConnInfo;
use route::*;
use to_upstream::*;

/// An extra condition for readiness (the tunnel client's: a tunnel that
/// answers pings).
pub type ReadyGate = Box<dyn Fn() -> bool + Send + Sync>;

/// One tunnel slot of a tunnel client, for its admin endpoint.
#[derive(Debug, Clone)]
pub struct TunnelSlot {
    /// The server it dials.
    pub server: String,
    /// Its number (the server's `slot`).
    pub slot: usize,
    /// `websocket` or `quic` while it has a tunnel.
    pub transport: Option<&'static str>,
    /// True while the server pings through it.
    pub up: bool,
    /// When its tunnel was made, while it has one.
    pub since: Option<std::time::SystemTime>,
    /// How long ago the server last pinged through it.
    pub last_ping: Option<std::time::Duration>,
}

/// The tunnel client's tunnels, for its admin endpoint.
pub type TunnelReport = Box<dyn Fn() -> Vec<TunnelSlot> + Send + Sync>;

/// Process-wide serving state that outlives any one pipeline.
#[derive(Default)]
pub struct Shared {
    phase: AtomicU8,
    gate: std::sync::OnceLock<ReadyGate>,
    tunnels: std::sync::OnceLock<TunnelReport>,
    /// Tasks that must finish before a drained shutdown completes
    /// (connections and spliced upgrades).
    pub tracker: TaskTracker,
    /// The workers' signs of life: a stalled worker is not ready.
    pub heartbeats: Arc<portcullis_net::worker_beat::Heartbeats>,
}

const STARTING: u8 = 0;
const READY: u8 = 1;
const DRAINING: u8 = 2;

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("phase", &self.phase)
            .finish_non_exhaustive()
    }
}

impl Shared {
    /// Config loaded and listeners bound: `/readyz` turns 200.
    pub fn set_ready(&self) {
        let _ = self
            .phase
            .compare_exchange(STARTING, READY, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Shutting down: `/readyz` turns 503 for good.
    pub fn set_draining(&self) {
        self.phase.store(DRAINING, Ordering::Release);
    }

    /// True while `/readyz` should answer 200: started, not draining,
    /// every worker beating, and the gate (if any) open.
    pub fn is_ready(&self) -> bool {
        self.phase.load(Ordering::Acquire) == READY
            && self.heartbeats.stalled().is_empty()
            && self.gate.get().is_none_or(|ready| ready())
    }

    /// Makes readiness also depend on `gate` (set once).
    pub fn set_gate(&self, gate: ReadyGate) {
        let _ = self.gate.set(gate);
    }

    /// Lists a tunnel client's tunnels in the admin endpoint (set once).
    pub fn set_tunnel_report(&self, report: TunnelReport) {
        let _ = self.tunnels.set(report);
    }

    /// A tunnel client's tunnels; `None` in a plain routing core.
    pub fn tunnels(&self) -> Option<Vec<TunnelSlot>> {
        self.tunnels.get().map(|report| report())
    }

    /// True once shutdown started.
    pub fn is_draining(&self) -> bool {
        self.phase.load(Ordering::Acquire) == DRAINING
    }
}

/// One configuration made ready to serve: routes plus upstream pools.
pub struct Pipeline {
    config: Arc<Config>,
    /// Each route's plugin chain.
    chains: plugin::Chains,
    /// Upstream pools per worker thread, so connections stay on the thread
    /// that made them: `upstreams[worker][upstream]`.
    upstreams: Vec<Vec<Arc<UpstreamPool>>>,
    /// Each route's request metrics, by route index.
    stats: Vec<&'static metrics::RouteStats>,
    /// Each route's rate limit, mirror and auth cache, by route index.
    route_states: Vec<RouteState>,
    shared: Arc<Shared>,
}

/// What plugins in shadow mode noted so far, moved into the access line
/// (the check inline: most requests have nothing to move).
#[inline(always)]
fn log_notes(log: &mut Option<Box<AccessLog>>, ctx: &mut chain::PluginContext<'_>) {
    if ctx.has_notes() {
        move_notes(log, ctx);
    }
}

#[cold]
fn move_notes(log: &mut Option<Box<AccessLog>>, ctx: &mut chain::PluginContext<'_>) {
    let notes = ctx.take_notes();
    if let Some(log) = log.as_mut() {
        for n in &notes {
            log.note_shadow(&n.plugin, &n.what);
        }
    }
}

/// The client socket to watch for a request of `version` on `conn`: HTTP/1
/// only, where the connection polls its requests itself (see
/// `client_watch`).
fn watchable(conn: &ConnInfo, version: Version) -> Option<ClientSocket> {
    conn.socket.filter(|_| version < Version::HTTP_2)
}

/// The pipeline current in `shared`, through a handle of this worker's own.
///
/// A request holds the pipeline it started with until its response head
/// is ready, so a reload never changes a request midway. Cloning the one
/// `Arc<Pipeline>` for that made every worker write the same reference
/// count twice per request, a cache line that then moves between their
/// cores. Each worker instead wraps the current pipeline in an `Arc` of its
/// own, once per reload, and its requests clone that, as Envoy gives each
/// worker its own snapshot of the configuration. The worker holds its
/// wrapper between requests: held weakly, one connection's requests one
/// after another (nothing else holding it) made and freed it each time,
/// the shared count written twice per request after all. A reload tells
/// each worker to let go of the old one ([`let_go_if_stale`]), so an idle
/// worker does not keep an old pipeline alive.
pub fn current(shared: &ArcSwap<Pipeline>) -> Arc<Arc<Pipeline>> {
    let now = shared.load();
    WORKERS_OWN.with(|local| {
        let mut local = local.borrow_mut();
        if let Some(held) = local.as_ref()
            && Arc::ptr_eq(&**held, &*now)
        {
            return held.clone();
        }
        let fresh = Arc::new(arc_swap::Guard::into_inner(now));
        *local = Some(fresh.clone());
        fresh
    })
}

thread_local! {
    /// This worker's handle on the pipeline its last request took (the
    /// outer `Arc` is the worker's own count, the point of it).
    #[allow(clippy::redundant_allocation)]
    static WORKERS_OWN: RefCell<Option<Arc<Arc<Pipeline>>>> = const { RefCell::new(None) };
}

/// Drops this worker's handle unless it is on the pipeline current in
/// `shared`: run on every worker after a reload.
pub fn let_go_if_stale(shared: &ArcSwap<Pipeline>) {
    let now = shared.load();
    WORKERS_OWN.with(|local| {
        let mut local = local.borrow_mut();
        if local
            .as_ref()
            .is_some_and(|held| !Arc::ptr_eq(&**held, &*now))
        {
            *local = None;
        }
    });
}

impl Pipeline {
    /// Prepares a config for serving by `workers` threads. Builds upstream
    /// pools, taking over those of `previous` whose upstream did not change
    /// (a reload keeps their warm connections); opens nothing.
    pub fn new(
        config: Arc<Config>,
        chains: plugin::Chains,
        shared: Arc<Shared>,
        workers: usize,
        previous: Option<&Pipeline>,
    ) -> Pipeline {
        let workers = workers.max(1);
        let mut upstreams: Vec<Vec<Arc<UpstreamPool>>> = (0..workers).map(|_| Vec::new()).collect();
        // The previous pipeline's pools of the upstream `same` finds.
        let earlier = |same: &dyn Fn(&Upstream) -> bool| {
            previous.and_then(|p| {
                let j = p.config.upstreams.iter().position(|old| same(old))?;
                (p.upstreams.len() == workers).then_some((p, j))
            })
        };
        for (i, spec) in config.upstreams.iter().enumerate() {
            let kept = earlier(&|old| old.same_settings(spec));
            // Once per upstream (not per worker's pool), and not again for
            // one a reload keeps.
            if kept.is_none() && spec.tls.insecure_skip_verify && spec.may_use_tls() {
                tracing::warn!(upstream = %spec.name, "TLS certificate verification is off for this upstream");
            }
            // The same upstream with other endpoints (new addresses of
            // its hosts, an endpoint added to the list): the endpoints
            // both list keep their connections and ejections.
            let carried = match kept {
                Some(_) => None,
                None => earlier(&|old| old.same_but_endpoints(spec)),
            };
            let shared = forward::shared_endpoints(spec, carried.map(|(p, j)| &*p.upstreams[0][j]));
            for (w, pools) in upstreams.iter_mut().enumerate() {
                pools.push(match kept {
                    Some((p, j)) => p.upstreams[w][j].clone(),
                    None => Arc::new(UpstreamPool::new(
                        spec.clone(),
                        shared.clone(),
                        carried.map(|(p, j)| &*p.upstreams[w][j]),
                    )),
                });
            }
            // A kept upstream keeps its checks (and what they found).
            if kept.is_none() {
                forward::health::start(&upstreams[0][i]);
            }
            debug_assert_eq!(upstreams[0].len(), i + 1);
        }
        let stats = config
            .routes
            .iter()
            .map(|r| metrics::route(&r.name))
            .collect();
        let route_states =
            route_state::build(&config, previous.map(|p| (&*p.config, &p.route_states[..])));
        // Plugins' callouts outside requests go out through these pools.
        let callouts: Arc<dyn plugin::Callouts> = Arc::new(crate::callout::PoolCallouts {
            config: config.clone(),
            upstreams: upstreams.clone(),
        });
        chains.set_callouts(&callouts);
        Pipeline {
            config,
            chains,
            upstreams,
            stats,
            route_states,
            shared,
        }
    }

    /// The config this pipeline serves.
    pub fn config(&self) -> &Arc<Config> {
        &self.config
    }

    /// Each route's live state, by route index.
    pub fn route_states(&self) -> &[RouteState] {
        &self.route_states
    }

    /// The routes' plugin chains.
    pub fn chains(&self) -> &plugin::Chains {
        &self.chains
    }

    /// What `fact` says of each upstream it says something of, by name:
    /// ejected endpoints, requests in flight, retries. The workers' pools
    /// share these, so the first worker's tell.
    pub fn upstream_facts<T>(
        &self,
        fact: impl Fn(&UpstreamPool) -> Option<T>,
    ) -> Vec<(Arc<str>, T)> {
        self.upstreams.first().map_or_else(Vec::new, |pools| {
            pools
                .iter()
                .filter_map(|p| Some((p.spec.name.clone(), fact(p)?)))
                .collect()
        })
    }

    /// Handles one request end to end (see [`crate::phases`]). Never
    /// fails: every problem becomes an HTTP answer.
    ///
    /// The driver's own future, not one around it: a future of a few
    /// kilobytes moved once more per request showed as +6,000
    /// instructions per request (`bench/instructions-diff.sh`).
    #[inline]
    /// `B`: hyper's body on HTTP/1.1 and HTTP/2, the proxy's own on
    /// HTTP/3 ([`crate::http3`]).
    pub fn handle<'a, B>(
        &'a self,
        req: Request<B>,
        conn: &'a ConnInfo,
    ) -> impl std::future::Future<Output = Response<ResponseBody>> + Send + 'a
    where
        B: http_body::Body + Into<Body> + Send + 'a,
    {
        crate::phases::drive(self, req, conn)
    }
}

impl crate::phases::Phases for Pipeline {
    type Conn = ConnInfo;

    #[inline]
    fn entry<'c>(&self, conn: &'c ConnInfo, version: Version) -> crate::phases::Entry<'c> {
        crate::phases::Entry {
            client: conn.client,
            worker: conn.worker,
            tls_version: conn.tls_version,
            client_cert: conn.client_cert.as_ref(),
            request_ids: conn.listener.request_id,
            counted: Some(metrics::unrouted()),
            watch: watchable(conn, version),
        }
    }

    #[inline]
    fn trace(
        &self,
        conn: &ConnInfo,
    ) -> Option<(
        &Arc<portcullis_config::Tracing>,
        &Arc<UpstreamPool>,
        portcullis_obs::otlp::Arrival,
    )> {
        let tracing = self.config.tracing.as_ref()?;
        let pool = &self.upstreams[conn.worker % self.upstreams.len()][tracing.upstream];
        let from = portcullis_obs::otlp::Arrival {
            peer: conn.client.ip(),
            trust_forwarded: conn.listener.trust_forwarded_headers,
            https: conn.tls,
            trust_traceparent: tracing.trust_incoming,
        };
        Some((tracing, pool, from))
    }

    #[inline]
    fn serve<B>(
        &self,
        req: Request<B>,
        conn: &ConnInfo,
        ctx: &mut crate::phases::RequestCtx,
    ) -> impl std::future::Future<Output = (Response<Body>, forward::Held)> + Send
    where
        B: http_body::Body + Into<Body> + Send,
    {
        let (log, request_id, stats) = ctx.parts();
        self.route_and_serve(req, conn, (log, request_id), stats)
    }

    #[inline]
    fn finish(&self, resp: &mut Response<Body>, _version: Version, conn: &ConnInfo) {
        // Set on listeners that serve HTTP/3 too, for their HTTP/1.1 and
        // HTTP/2 connections only.
        if let Some(alt_svc) = &conn.alt_svc {
            resp.headers_mut().insert(header::ALT_SVC, alt_svc.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pipeline() -> Pipeline {
        let source = portcullis_config::Source {
            name: "t.yaml".into(),
            text: "routes: [{ name: ok, match: { path: /ok }, respond: { status: 200 } }]".into(),
        };
        let config = portcullis_config::load_sources(&[source], &|_| None).unwrap();
        Pipeline::new(
            Arc::new(config),
            plugin::Chains::default(),
            Arc::default(),
            1,
            None,
        )
    }

    #[test]
    fn a_worker_keeps_its_handle_and_lets_go_of_it_after_a_reload() {
        let shared = ArcSwap::from_pointee(pipeline());
        let first = current(&shared);
        assert!(Arc::ptr_eq(&*first, &shared.load_full()));
        // The next request gets the same handle, whether the first still
        // holds it or not.
        let again = current(&shared);
        assert!(Arc::ptr_eq(&first, &again));
        drop((first, again));
        let kept = current(&shared);
        assert_eq!(Arc::strong_count(&kept), 2, "the worker's and this one");
        // After a reload, the new pipeline; the old one stays with the
        // requests holding it.
        let old = Arc::downgrade(&*kept);
        shared.store(Arc::new(pipeline()));
        let after = current(&shared);
        assert!(Arc::ptr_eq(&*after, &shared.load_full()));
        assert!(!Arc::ptr_eq(&after, &kept));
        // Once they end, nothing of the worker's keeps it alive.
        drop(kept);
        assert!(
            old.upgrade().is_none(),
            "the old pipeline outlived its requests"
        );
        // A worker idle through a reload lets go when told of it.
        let held = Arc::downgrade(&*after);
        drop(after);
        let_go_if_stale(&shared);
        assert!(held.upgrade().is_some(), "the current one is kept");
        shared.store(Arc::new(pipeline()));
        let_go_if_stale(&shared);
        assert!(
            held.upgrade().is_none(),
            "an idle worker kept an old pipeline"
        );
    }
}
