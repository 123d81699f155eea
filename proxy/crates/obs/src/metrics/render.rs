//! The request metrics in Prometheus' text format: each route's (and
//! runtime's, and upstream's) shards summed when `/metrics` is read.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::OnceLock;
use std::sync::atomic::Ordering::Relaxed;

use super::{BUCKETS_US, Family, RouteStats, UpstreamError, connection_errors, registry};

/// One route's figures, summed over the shards.
pub(super) struct Totals {
    pub(super) codes: BTreeMap<u16, u64>,
    pub(super) other: u64,
    pub(super) buckets: [u64; BUCKETS_US.len() + 1],
    pub(super) sum_us: u64,
    pub(super) bytes_in: u64,
    pub(super) bytes_out: u64,
}

impl Totals {
    fn answered(&self) -> bool {
        self.other != 0 || !self.codes.is_empty()
    }
}

impl RouteStats {
    pub(super) fn totals(&self) -> Totals {
        let mut t = Totals {
            codes: BTreeMap::new(),
            other: 0,
            buckets: [0; BUCKETS_US.len() + 1],
            sum_us: 0,
            bytes_in: 0,
            bytes_out: 0,
        };
        for shard in self.shards.iter().filter_map(OnceLock::get) {
            for (code, count) in shard.codes.iter().zip(&shard.counts) {
                let code = code.load(Relaxed);
                let count = count.load(Relaxed);
                if code != 0 && count != 0 {
                    *t.codes.entry(code).or_default() += count;
                }
            }
            t.other += shard.other.load(Relaxed);
            for (sum, b) in t.buckets.iter_mut().zip(&shard.buckets) {
                *sum += b.load(Relaxed);
            }
            t.sum_us += shard.sum_us.load(Relaxed);
            t.bytes_in += shard.bytes_in.load(Relaxed);
            t.bytes_out += shard.bytes_out.load(Relaxed);
        }
        t
    }
}

/// Writes the request metrics in Prometheus text format: every route (and
/// runtime) seen so far, by name, with the codes it answered.
pub fn render(out: &mut String) {
    let mut all: Vec<&'static RouteStats> = registry()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .values()
        .copied()
        .collect();
    all.sort_by(|a, b| (a.family, &a.name).cmp(&(b.family, &b.name)));
    for family in [Family::Route, Family::Runtime, Family::Upstream] {
        let totals: Vec<_> = all
            .iter()
            .filter(|r| r.family == family)
            .map(|r| (label(&r.name), r.totals()))
            .collect();
        if !totals.is_empty() {
            render_family(out, family, &totals);
        }
    }
    out.push_str(
        "# HELP portcullis_connection_errors_total Client connections that ended in an error \
         outside any request, by listener and reason (malformed, head_too_large, \
         header_timeout, keepalive_timeout, incomplete, tls_handshake, plain_http, other).\n# TYPE portcullis_connection_errors_total counter\n",
    );
    for (listener, reasons) in connection_errors()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
    {
        let listener = label(listener);
        for (reason, n) in reasons {
            let _ = writeln!(
                out,
                "portcullis_connection_errors_total{{listener=\"{listener}\",reason=\"{reason}\"}} {n}"
            );
        }
    }
    let _ = writeln!(
        out,
        "# HELP portcullis_access_log_dropped_total Access-log lines not written: the \
         destination did not keep up (a blocked pipe) or failed (a full disk).\n\
         # TYPE portcullis_access_log_dropped_total counter\n\
         portcullis_access_log_dropped_total {}",
        crate::access_log::dropped()
    );
    let _ = writeln!(
        out,
        "# HELP portcullis_log_lines_dropped_total Event-log lines (warnings, errors) not \
         written: stderr did not keep up (a pipe nobody reads).\n\
         # TYPE portcullis_log_lines_dropped_total counter\n\
         portcullis_log_lines_dropped_total {}",
        crate::telemetry::dropped_lines()
    );
    let _ = writeln!(
        out,
        "# HELP portcullis_connections_parked Idle HTTP/1 keep-alive client connections \
         parked: kept without their HTTP state and buffers until their next request.\n\
         # TYPE portcullis_connections_parked gauge\n\
         portcullis_connections_parked {}",
        portcullis_net::h1_or_h2::parked_connections()
    );
    // What every exporter serves about its own process.
    crate::process_metrics::render(out);
}

fn render_family(out: &mut String, family: Family, totals: &[(String, Totals)]) {
    let [by, total, total_help, duration, duration_help] = family.names();
    let _ = writeln!(out, "# HELP {total} {total_help}\n# TYPE {total} counter");
    for (name, t) in totals {
        for (code, n) in t.codes.iter().filter(|(c, _)| **c >= 100) {
            let _ = writeln!(out, "{total}{{{by}=\"{name}\",code=\"{code}\"}} {n}");
        }
        if t.other != 0 {
            let _ = writeln!(out, "{total}{{{by}=\"{name}\",code=\"other\"}} {}", t.other);
        }
    }
    if family == Family::Upstream {
        let errors = "portcullis_upstream_errors_total";
        let _ = writeln!(
            out,
            "# HELP {errors} Forwarded requests an upstream did not answer, by upstream and \
             reason (connect, connect_timeout, timeout, failed, overloaded).\n# TYPE {errors} counter"
        );
        for (name, t) in totals {
            for (code, n) in &t.codes {
                if let Some(e) = UpstreamError::of_code(*code) {
                    let reason = e.reason();
                    let _ = writeln!(out, "{errors}{{{by}=\"{name}\",reason=\"{reason}\"}} {n}");
                }
            }
        }
    }
    if let Some((received, sent)) = family.byte_names() {
        for (metric, help, pick) in [
            (received, "Request body bytes received from clients", true),
            (sent, "Response body bytes sent to clients", false),
        ] {
            let _ = writeln!(
                out,
                "# HELP {metric} {help}, by {by}.\n# TYPE {metric} counter"
            );
            // Like the histogram, only for what answered something.
            for (name, t) in totals.iter().filter(|(_, t)| t.answered()) {
                let n = if pick { t.bytes_in } else { t.bytes_out };
                let _ = writeln!(out, "{metric}{{{by}=\"{name}\"}} {n}");
            }
        }
    }
    let _ = writeln!(
        out,
        "# HELP {duration} {duration_help}\n# TYPE {duration} histogram"
    );
    for (name, t) in totals {
        let count: u64 = t.buckets.iter().sum();
        if count == 0 {
            continue;
        }
        let mut cumulative = 0;
        for (i, n) in t.buckets.iter().enumerate() {
            cumulative += n;
            let le = BUCKETS_US
                .get(i)
                .map_or_else(|| "+Inf".to_owned(), |us| seconds(*us));
            let _ = writeln!(
                out,
                "{duration}_bucket{{{by}=\"{name}\",le=\"{le}\"}} {cumulative}"
            );
        }
        let _ = writeln!(
            out,
            "{duration}_sum{{{by}=\"{name}\"}} {}",
            seconds(t.sum_us)
        );
        let _ = writeln!(out, "{duration}_count{{{by}=\"{name}\"}} {count}");
    }
}

/// Microseconds as seconds, without float noise (`0.0025`, not `0.0025000000000000001`).
pub(super) fn seconds(us: u64) -> String {
    let s = format!("{}.{:06}", us / 1_000_000, us % 1_000_000);
    s.trim_end_matches('0').trim_end_matches('.').to_owned()
}

/// Escapes a Prometheus label value.
pub fn label(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}
