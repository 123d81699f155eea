//! Request metrics: responses by route (or, on the tunnel server, by
//! runtime) and status code, latency histograms and body bytes; and the
//! same by upstream for what the routes forward (responses, failures,
//! time to the response head), for the admin listener's `/metrics`.
//!
//! Every request writes a few counters, so they are kept per thread shard
//! ([`portcullis_net::shard`]), each on its own cache lines: the workers never write
//! a line another one writes. `/metrics` sums the shards when read.
//!
//! A route's figures live as long as the process and are found by the
//! route's name, so a reload that keeps a route keeps counting into the
//! same counters (Prometheus counters must not go back to zero while the
//! process lives). Requests that matched no route count under `route=""`.
//!
//! Client connections that end in an error before or between requests
//! (a malformed head, one too large, too slow to arrive, cut short) never
//! become requests; they count by listener and reason instead.
//!
//! Here the counting; `render.rs` writes the figures for `/metrics`.
//!
//! Not `prometheus-client`: its counters are one atomic every worker
//! writes, and its families are found by label set under a lock on each
//! request; here each worker writes its own shard, found once per route.

use portcullis_net::stamp::Stamp;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU16, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use portcullis_net::shard::{SHARDS, this_thread};

mod render;

/// Upper bounds of the latency buckets, in microseconds (Prometheus `le`,
/// inclusive), from 0.5 ms to 10 s; a last bucket takes the rest.
const BUCKETS_US: [u64; 14] = [
    500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000,
    2_500_000, 5_000_000, 10_000_000,
];

/// Distinct status codes one shard of a route counts by code. A route
/// answers with a handful (200, 304, 404, 502...); any beyond these count
/// under `code="other"` rather than growing the shard (ten keep the shard
/// at two cache lines with the byte counters).
const CODES: usize = 10;

/// One thread's counters for one route.
#[repr(align(128))]
#[derive(Default)]
struct Shard {
    /// The status code each count slot holds; 0 while free.
    codes: [AtomicU16; CODES],
    counts: [AtomicU64; CODES],
    /// Responses whose code found no slot.
    other: AtomicU64,
    /// Requests per latency bucket (not cumulative; the last is +Inf).
    buckets: [AtomicU64; BUCKETS_US.len() + 1],
    /// Sum of the latencies, in microseconds.
    sum_us: AtomicU64,
    /// Body bytes received from the client and sent to it (routes and
    /// runtimes; an upstream's are its routes').
    bytes_in: AtomicU64,
    bytes_out: AtomicU64,
}

/// What requests are counted by: the routing core's routes, or the tunnel
/// server's runtimes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Family {
    Route,
    Runtime,
    Upstream,
}

impl Family {
    /// The label, the counter's name and help, the histogram's name and
    /// help.
    fn names(self) -> [&'static str; 5] {
        match self {
            Family::Route => [
                "route",
                "portcullis_requests_total",
                "Responses by route and status code (route=\"\": no route matched).",
                "portcullis_request_duration_seconds",
                "From the request head's arrival to the end of the response body \
                 (or the client leaving), by route.",
            ],
            Family::Runtime => [
                "runtime",
                "portcullis_tunnel_requests_total",
                "Responses by runtime and status code (runtime=\"\": no known runtime).",
                "portcullis_tunnel_request_duration_seconds",
                "From the request head's arrival to the end of the response body \
                 (or the client leaving), by runtime.",
            ],
            Family::Upstream => [
                "upstream",
                "portcullis_upstream_responses_total",
                "Responses upstreams gave to forwarded requests, by upstream and status code.",
                "portcullis_upstream_header_duration_seconds",
                "From sending a forwarded request to its response head, by upstream \
                 (answered requests only).",
            ],
        }
    }

    /// The byte counters' names; `None` where bytes are not counted.
    fn byte_names(self) -> Option<(&'static str, &'static str)> {
        match self {
            Family::Route => Some((
                "portcullis_request_bytes_total",
                "portcullis_response_bytes_total",
            )),
            Family::Runtime => Some((
                "portcullis_tunnel_request_bytes_total",
                "portcullis_tunnel_response_bytes_total",
            )),
            Family::Upstream => None,
        }
    }
}

/// Why forwarding to an upstream failed, as counted in
/// `portcullis_upstream_errors_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum UpstreamError {
    /// No connection: refused, DNS, TLS handshake.
    Connect = 1,
    /// Connecting took longer than the connect timeout.
    ConnectTimeout,
    /// No response head within the request timeout.
    Timeout,
    /// The connection failed after the request was sent (reset, closed,
    /// a malformed answer).
    Failed,
    /// `max_requests` already in flight: refused without trying.
    Overloaded,
}

impl UpstreamError {
    const ALL: [UpstreamError; 5] = [
        UpstreamError::Connect,
        UpstreamError::ConnectTimeout,
        UpstreamError::Timeout,
        UpstreamError::Failed,
        UpstreamError::Overloaded,
    ];

    fn reason(self) -> &'static str {
        match self {
            UpstreamError::Connect => "connect",
            UpstreamError::ConnectTimeout => "connect_timeout",
            UpstreamError::Timeout => "timeout",
            UpstreamError::Failed => "failed",
            UpstreamError::Overloaded => "overloaded",
        }
    }

    /// The failure a code slot holds, if any: failures count in the same
    /// slots as statuses, under codes no HTTP status uses (1 to 5).
    fn of_code(code: u16) -> Option<UpstreamError> {
        Self::ALL.into_iter().find(|e| *e as u16 == code)
    }
}

/// The counters of one route or runtime (by name), for the life of the
/// process.
pub struct RouteStats {
    family: Family,
    name: Arc<str>,
    /// Made by the first request a thread counts here: a runtime's
    /// requests stay on its tunnel's thread, so most names hold one.
    shards: [OnceLock<Box<Shard>>; SHARDS],
}

impl RouteStats {
    fn new(family: Family, name: Arc<str>) -> RouteStats {
        RouteStats {
            family,
            name,
            shards: Default::default(),
        }
    }

    /// Counts one response with `status`, `elapsed` after its request
    /// arrived.
    pub fn record(&self, status: u16, elapsed: Duration) {
        let shard = self.shards[this_thread()].get_or_init(Box::default);
        shard.count(status);
        let us = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        let bucket = BUCKETS_US.partition_point(|&le| le < us);
        shard.buckets[bucket].fetch_add(1, Relaxed);
        shard.sum_us.fetch_add(us, Relaxed);
    }

    /// Counts `bytes` of request body received from a client.
    pub fn received(&self, bytes: u64) {
        let shard = self.shards[this_thread()].get_or_init(Box::default);
        shard.bytes_in.fetch_add(bytes, Relaxed);
    }

    /// Counts `bytes` of response body sent to a client, as they go (not
    /// summed in [`Pending`] for its end: 8 bytes more in every response
    /// body, which is moved a dozen times).
    pub fn sent(&self, bytes: u64) {
        let shard = self.shards[this_thread()].get_or_init(Box::default);
        shard.bytes_out.fetch_add(bytes, Relaxed);
    }

    /// Counts a request an upstream did not answer (an upstream's
    /// counters only).
    pub fn failed(&self, why: UpstreamError) {
        self.shards[this_thread()]
            .get_or_init(Box::default)
            .count(why as u16);
    }
}

impl Shard {
    fn count(&self, status: u16) {
        for (slot, code) in self.codes.iter().enumerate() {
            let mut held = code.load(Relaxed);
            if held == 0 {
                // Claim the free slot; another thread sharing this shard
                // may have claimed it first, for the same code or another.
                held = match code.compare_exchange(0, status, Relaxed, Relaxed) {
                    Ok(_) => status,
                    Err(now) => now,
                };
            }
            if held == status {
                self.counts[slot].fetch_add(1, Relaxed);
                return;
            }
        }
        self.other.fetch_add(1, Relaxed);
    }
}

type Registry = HashMap<(Family, Arc<str>), &'static RouteStats>;

/// Every route's and runtime's counters ever made, by name.
fn registry() -> &'static Mutex<Registry> {
    static REGISTRY: OnceLock<Mutex<Registry>> = OnceLock::new();
    REGISTRY.get_or_init(Default::default)
}

/// The counters of `family`'s `name`, made on first use. They are never
/// freed: a request's record refers to them without a reference count the
/// workers would share, and a route's figures outlive reloads. Each
/// distinct name costs ~300 bytes once, and 256 more for each thread
/// that counts into it (so a route ~4.5 KiB at most), so names come only from the configuration (routes) or the tokens file
/// (runtimes), never from a request.
fn stats(family: Family, name: &Arc<str>) -> &'static RouteStats {
    let mut all = registry().lock().unwrap_or_else(|p| p.into_inner());
    all.entry((family, name.clone()))
        .or_insert_with(|| Box::leak(Box::new(RouteStats::new(family, name.clone()))))
}

/// The counters of the route named `route`.
pub fn route(route: &Arc<str>) -> &'static RouteStats {
    stats(Family::Route, route)
}

/// The counters of requests that matched no route.
pub fn unrouted() -> &'static RouteStats {
    static UNROUTED: OnceLock<&'static RouteStats> = OnceLock::new();
    UNROUTED.get_or_init(|| route(&Arc::from("")))
}

/// The counters of a tunnel server's runtime (an id from its tokens file).
pub fn runtime(id: &str) -> &'static RouteStats {
    stats(Family::Runtime, &Arc::from(id))
}

/// The counters of the upstream named `name`: what the routes forward
/// there.
pub fn upstream(name: &Arc<str>) -> &'static RouteStats {
    stats(Family::Upstream, name)
}

/// The counters of tunnel-server requests for no known runtime.
pub fn no_runtime() -> &'static RouteStats {
    static NONE: OnceLock<&'static RouteStats> = OnceLock::new();
    NONE.get_or_init(|| runtime(""))
}

/// Why a client connection ended in an error, as a metric label.
fn reason(error: &(dyn std::error::Error + 'static)) -> &'static str {
    let Some(e) = error.downcast_ref::<hyper::Error>() else {
        // A parked idle connection's timeout: the keep-alive timeout, as
        // hyper's is below.
        if error.is::<portcullis_net::h1_or_h2::KeepAliveTimeout>() {
            return "keepalive_timeout";
        }
        return "other";
    };
    if e.is_parse_too_large() {
        "head_too_large"
    } else if e.is_parse() {
        "malformed"
    } else if e.is_timeout() {
        // hyper's head clock, which has the keep-alive timeout: an idle
        // keep-alive connection, or a later head too slow to arrive.
        "keepalive_timeout"
    } else if e.is_incomplete_message() {
        "incomplete"
    } else {
        "other"
    }
}

/// Connection errors by listener, then reason. Off the request path, so
/// a plain map behind a lock.
type ConnectionErrors = BTreeMap<String, BTreeMap<&'static str, u64>>;

fn connection_errors() -> &'static Mutex<ConnectionErrors> {
    static ERRORS: OnceLock<Mutex<ConnectionErrors>> = OnceLock::new();
    ERRORS.get_or_init(Default::default)
}

/// Counts a client connection on `listener` that ended with `error`, and
/// returns the reason it was counted under.
pub fn connection_error(listener: &str, error: &(dyn std::error::Error + 'static)) -> &'static str {
    let reason = reason(error);
    count_connection_error(listener, reason);
    reason
}

/// Counts a client connection on `listener` closed because its first
/// request head did not arrive within the header-read timeout.
pub fn connection_timed_out(listener: &str) {
    count_connection_error(listener, "header_timeout");
}

/// Counts a client connection on `listener` that ended for `reason`
/// before any request (`tls_handshake`, `plain_http`, ...).
pub fn count_connection_error(listener: &str, reason: &'static str) {
    let mut all = connection_errors()
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    // The listener's name is copied once, not per error (a flood of
    // garbage is when this runs most).
    let reasons = match all.get_mut(listener) {
        Some(reasons) => reasons,
        None => all.entry(listener.to_owned()).or_default(),
    };
    *reasons.entry(reason).or_default() += 1;
}

/// A request being answered: counted when dropped, that is when its
/// response body has been sent or the client went away, like the access
/// log.
pub struct Pending {
    /// The route's counters.
    pub stats: &'static RouteStats,
    /// The response status.
    pub status: u16,
    /// When the request head arrived.
    pub start: Stamp,
}

impl Pending {
    /// A request whose head arrived at `start`, counted under `stats` (the
    /// route sets its own once matched) and as 499 unless its answer's
    /// status is set: a request dropped while it waits (its HTTP/2 stream
    /// reset, its tunnel stream reset by a public client that left) is
    /// nginx's "client closed request", as an HTTP/1 client noticed
    /// leaving is.
    pub fn unanswered(stats: &'static RouteStats, start: Stamp) -> Pending {
        Pending {
            stats,
            status: CLIENT_CLOSED_REQUEST,
            start,
        }
    }
}

/// nginx's code for a client that left before its answer: logged and
/// counted, never sent.
pub const CLIENT_CLOSED_REQUEST: u16 = 499;

impl Drop for Pending {
    fn drop(&mut self) {
        self.stats.record(self.status, self.start.elapsed());
    }
}

pub use render::{label, render};

#[cfg(test)]
mod tests {
    use super::render::seconds;
    use super::*;

    /// Counters of a route name no other test uses (they are global).
    fn fresh(name: &str) -> &'static RouteStats {
        let stats = route(&Arc::from(name));
        assert_eq!(
            stats.totals().buckets.iter().sum::<u64>(),
            0,
            "{name} reused"
        );
        stats
    }

    #[test]
    fn counts_by_code_and_bucket() {
        let stats = fresh("unit-codes");
        stats.record(200, Duration::from_micros(500));
        stats.record(200, Duration::from_micros(501));
        stats.record(502, Duration::from_secs(11));
        let t = stats.totals();
        assert_eq!(t.codes, BTreeMap::from([(200, 2), (502, 1)]));
        // 500 us is inside the first bucket (le is inclusive), 501 us in
        // the second, 11 s beyond the last bound.
        assert_eq!(t.buckets[0], 1);
        assert_eq!(t.buckets[1], 1);
        assert_eq!(t.buckets[BUCKETS_US.len()], 1);
        assert_eq!(t.sum_us, 500 + 501 + 11_000_000);
    }

    #[test]
    fn codes_beyond_the_slots_count_as_other() {
        let stats = fresh("unit-many-codes");
        for code in 200..200 + CODES as u16 + 3 {
            stats.record(code, Duration::ZERO);
        }
        stats.record(200, Duration::ZERO);
        let t = stats.totals();
        assert_eq!(t.codes.len(), CODES);
        assert_eq!(t.codes[&200], 2);
        assert_eq!(t.other, 3);
    }

    #[test]
    fn a_route_keeps_its_counters_by_name() {
        let a = route(&Arc::from("unit-same"));
        let b = route(&Arc::from("unit-same"));
        assert!(std::ptr::eq(a, b));
        assert!(!std::ptr::eq(a, route(&Arc::from("unit-other"))));
    }

    #[test]
    fn threads_sum_into_one_figure() {
        let stats = fresh("unit-threads");
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..1000 {
                        stats.record(204, Duration::from_millis(3));
                    }
                });
            }
        });
        let t = stats.totals();
        assert_eq!(t.codes[&204], 4000);
        assert_eq!(t.buckets[3], 4000, "3 ms is in the le=0.005 bucket");
    }

    #[test]
    fn renders_prometheus_text() {
        let stats = fresh("unit-render \"quoted\"");
        stats.record(404, Duration::from_micros(1_200));
        drop(Pending {
            stats,
            status: 200,
            start: Stamp::now().before(Duration::from_millis(30)),
        });
        stats.received(99);
        stats.sent(1200);
        stats.sent(34);
        let mut out = String::new();
        render(&mut out);
        let r = r#"route="unit-render \"quoted\"""#;
        for line in [
            format!("portcullis_requests_total{{{r},code=\"200\"}} 1"),
            format!("portcullis_requests_total{{{r},code=\"404\"}} 1"),
            format!("portcullis_request_duration_seconds_bucket{{{r},le=\"0.001\"}} 0"),
            format!("portcullis_request_duration_seconds_bucket{{{r},le=\"0.0025\"}} 1"),
            format!("portcullis_request_duration_seconds_bucket{{{r},le=\"0.025\"}} 1"),
            format!("portcullis_request_duration_seconds_bucket{{{r},le=\"0.05\"}} 2"),
            format!("portcullis_request_duration_seconds_bucket{{{r},le=\"+Inf\"}} 2"),
            format!("portcullis_request_duration_seconds_count{{{r}}} 2"),
            format!("portcullis_request_bytes_total{{{r}}} 99"),
            format!("portcullis_response_bytes_total{{{r}}} 1234"),
        ] {
            assert!(out.lines().any(|l| l == line), "no {line:?} in\n{out}");
        }
        assert_eq!(
            out.matches("# TYPE portcullis_requests_total counter")
                .count(),
            1
        );
    }

    #[test]
    fn a_name_costs_a_shard_per_thread_that_counts() {
        // The figures the docs give for what each route or runtime holds.
        assert_eq!(std::mem::size_of::<Shard>(), 256);
        assert!(std::mem::size_of::<RouteStats>() <= 320);
        let stats = RouteStats::new(Family::Runtime, Arc::from("one-thread"));
        let made = |s: &RouteStats| s.shards.iter().filter(|s| s.get().is_some()).count();
        assert_eq!(made(&stats), 0);
        stats.record(200, Duration::from_millis(1));
        stats.record(200, Duration::from_millis(2));
        assert_eq!(made(&stats), 1);
        std::thread::scope(|t| {
            t.spawn(|| stats.record(404, Duration::from_millis(1)));
        });
        // The other thread counted into its own shard (or, with more than
        // SHARDS threads about, a shared one); the totals sum them all.
        let totals = stats.totals();
        assert_eq!(totals.codes.get(&200), Some(&2));
        assert_eq!(totals.codes.get(&404), Some(&1));
    }

    #[test]
    fn upstream_failures_count_apart_from_its_answers() {
        let up = upstream(&Arc::from("unit-upstream"));
        up.record(200, Duration::from_micros(700));
        up.record(503, Duration::from_micros(700));
        up.failed(UpstreamError::Connect);
        up.failed(UpstreamError::Connect);
        up.failed(UpstreamError::Timeout);
        let mut out = String::new();
        render(&mut out);
        let u = r#"upstream="unit-upstream""#;
        for line in [
            format!("portcullis_upstream_responses_total{{{u},code=\"200\"}} 1"),
            format!("portcullis_upstream_responses_total{{{u},code=\"503\"}} 1"),
            format!("portcullis_upstream_errors_total{{{u},reason=\"connect\"}} 2"),
            format!("portcullis_upstream_errors_total{{{u},reason=\"timeout\"}} 1"),
            // Only answers are timed.
            format!("portcullis_upstream_header_duration_seconds_count{{{u}}} 2"),
        ] {
            assert!(out.lines().any(|l| l == line), "no {line:?} in\n{out}");
        }
        // Failures are no status code, and upstreams count no bytes.
        assert!(!out.contains(&format!("{u},code=\"1\"")), "{out}");
        assert!(!out.contains(&format!("bytes_total{{{u}}}")), "{out}");
    }

    #[test]
    fn seconds_are_exact() {
        assert_eq!(seconds(500), "0.0005");
        assert_eq!(seconds(2_500_000), "2.5");
        assert_eq!(seconds(10_000_000), "10");
        assert_eq!(seconds(0), "0");
    }
}
