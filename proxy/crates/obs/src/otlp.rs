//! Spans for an OpenTelemetry collector (the policies' `tracing`): one
//! server span per sampled request, as Envoy's and ingress-nginx's
//! OpenTelemetry tracers record, sent in batches over OTLP/HTTP with JSON
//! (`POST /v1/traces`, the collector's port 4318) to a named upstream, so
//! the collector gets the upstreams' TLS, DNS and timeouts.
//!
//! Off the request's path: a span is written into its worker's batch when
//! the response ends (no lock, no other thread), and the batch goes out
//! on a task of the worker's own when 512 spans are in, or `flush_every`
//! after its first. A collector that is slow or away costs spans, never
//! requests: past four exports in flight, batches are dropped and counted.
//!
//! Not `opentelemetry-otlp`: it exports through its own HTTP client and
//! the SDK's batch processor (a channel to a thread of its own), where
//! spans here ride the upstreams' pools from each worker's own batch.

use std::cell::RefCell;
use std::fmt::Write as _;
use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use http::header::{self, HeaderMap, HeaderValue};
use http::uri::PathAndQuery;
use http::{Method, StatusCode, Version};

use crate::trace_context::TraceContext;
use portcullis_config::Tracing;

/// Spans in a batch that goes out at once without waiting for
/// `flush_every` (the OpenTelemetry SDKs' batch size).
const MAX_BATCH: usize = 512;
/// Exports in flight, every worker together, beyond which a batch is
/// dropped: a collector that stops answering must not pile them up.
const MAX_EXPORTS: usize = 4;
/// How long a worker that stops waits for its last spans to go out.
const LAST_EXPORT_WAIT: Duration = Duration::from_secs(2);

/// Where span batches go: the collector, an upstream reached through the
/// proxy's forwarding ([`portcullis_http::collector`]), which recording spans does
/// not depend on.
pub trait Collector: Send + Sync {
    /// Posts one export (OTLP JSON) to `path`: the collector's status, or
    /// why it could not be asked.
    fn post(
        &self,
        path: PathAndQuery,
        body: String,
    ) -> Pin<Box<dyn Future<Output = Result<StatusCode, String>> + Send + '_>>;
    /// Its name, for logs.
    fn name(&self) -> &str;
}

/// The spans total as `/metrics` lines, for a server that traces.
pub fn metric_samples() -> Vec<(String, f64)> {
    totals()
        .iter()
        .map(|(outcome, n)| (format!("{{outcome=\"{outcome}\"}}"), *n as f64))
        .collect()
}

/// A request's trace context, and what its span needs when it is sampled;
/// kept in its access-log record until the response ends.
pub struct Recording {
    /// The trace and this proxy's span in it.
    pub context: TraceContext,
    span: Option<Span>,
}

impl std::fmt::Debug for Recording {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recording")
            .field("context", &self.context)
            .field("sampled", &self.sampled())
            .finish()
    }
}

struct Span {
    start_unix_nanos: u64,
    collector: Arc<dyn Collector>,
    tracing: Arc<Tracing>,
    host: Option<HeaderValue>,
    /// The client: the socket's peer, or behind a trusted proxy the last
    /// `X-Forwarded-For` entry (as `rate_limit` and `hash_on` take it).
    client: IpAddr,
    https: bool,
    version: Version,
}

/// Where a request came from, as its trace and span take it.
#[derive(Debug, Clone, Copy)]
pub struct Arrival {
    /// The connection's peer.
    pub peer: IpAddr,
    /// Whether its `X-Forwarded-For` names the client (a trusted proxy).
    pub trust_forwarded: bool,
    /// Over TLS.
    pub https: bool,
    /// Whether its `traceparent` is joined (else a trace starts here).
    pub trust_traceparent: bool,
}

/// What a span says of its request once the response has ended: read
/// from the record that carries the [`Recording`] (the access log's,
/// `crate::telemetry`), which this module does not know.
pub struct Ended<'a> {
    /// Whose records the route keeps.
    pub logging: portcullis_config::AccessLogging,
    /// The response status.
    pub status: u16,
    /// Since the request head arrived.
    pub elapsed: Duration,
    /// The request method.
    pub method: &'a Method,
    /// The request path and query as received.
    pub path: Option<&'a PathAndQuery>,
    /// The connection's peer.
    pub peer: IpAddr,
    /// The route, when one matched.
    pub route: Option<&'a str>,
    /// The upstream, when forwarded.
    pub upstream: Option<&'a str>,
    /// The endpoint whose answer the client got.
    pub endpoint: Option<&'a dyn std::fmt::Display>,
    /// The request's id.
    pub request_id: Option<&'a HeaderValue>,
    /// The response body did not end.
    pub aborted: bool,
}

impl Recording {
    /// Joins or starts the request's trace (setting the `traceparent` the
    /// upstream gets); `collector` is where its span goes, on this worker.
    pub fn begin<C: Collector + 'static>(
        tracing: &Arc<Tracing>,
        collector: &Arc<C>,
        headers: &mut HeaderMap,
        (authority, version): (Option<&http::uri::Authority>, Version),
        from: Arrival,
    ) -> Recording {
        let context =
            crate::trace_context::join(headers, tracing.threshold, from.trust_traceparent);
        let span = context.sampled.then(|| Span {
            start_unix_nanos: unix_nanos(SystemTime::now()),
            collector: collector.clone(),
            tracing: tracing.clone(),
            // HTTP/2 clients send the host as :authority, HTTP/1 as Host.
            host: match authority {
                Some(a) => HeaderValue::from_str(a.host()).ok(),
                None => headers.get(header::HOST).cloned(),
            },
            client: portcullis_net::client_addr::client_of(
                from.peer,
                from.trust_forwarded,
                headers,
            ),
            https: from.https,
            version,
        });
        Recording { context, span }
    }

    /// Whether the request's span is recorded.
    pub fn sampled(&self) -> bool {
        self.span.is_some()
    }

    /// Records the span of the request `log` describes, now that its
    /// response has ended, unless the route keeps no record of it
    /// (`access_log: false`, or `errors` and it succeeded).
    pub fn finish(self, log: &Ended<'_>) {
        use portcullis_config::AccessLogging;
        let Some(span) = self.span else { return };
        match log.logging {
            AccessLogging::All => {}
            AccessLogging::Errors if log.status >= 400 => {}
            AccessLogging::Errors | AccessLogging::Off => return,
        }
        let end = span.start_unix_nanos + log.elapsed.as_nanos() as u64;
        // A response dropped as its thread ends (its thread-locals gone)
        // loses its span rather than panicking in a destructor.
        let _ = BATCH.try_with(|batch| batch.borrow_mut().add(&self.context, span, log, end));
    }
}

fn unix_nanos(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

static EXPORTED: AtomicU64 = AtomicU64::new(0);
static FAILED: AtomicU64 = AtomicU64::new(0);
static DROPPED: AtomicU64 = AtomicU64::new(0);
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);
static EXPORT_ENDED: tokio::sync::Notify = tokio::sync::Notify::const_new();
/// Whether the last export failed: its warning is written once, not per
/// batch, until one succeeds again.
static FAILING: AtomicBool = AtomicBool::new(false);

/// Spans exported, refused or lost by the collector, and dropped here
/// (too many exports in flight), since the process started.
pub fn totals() -> [(&'static str, u64); 3] {
    [
        ("exported", EXPORTED.load(Ordering::Relaxed)),
        ("failed", FAILED.load(Ordering::Relaxed)),
        ("dropped", DROPPED.load(Ordering::Relaxed)),
    ]
}

thread_local! {
    static BATCH: RefCell<Batch> = RefCell::new(Batch::default());
}

/// A worker's spans waiting to go out: the export's JSON up to its last
/// span, handed to the export as it is (no copy) with the tail added.
#[derive(Default)]
struct Batch {
    export: String,
    count: usize,
    /// Where they go: the collector and the settings of the config
    /// that made them (a reload's spans start a batch of their own).
    sink: Option<(Arc<dyn Collector>, Arc<Tracing>)>,
    timer: bool,
}

impl Batch {
    fn add(&mut self, context: &TraceContext, span: Span, log: &Ended<'_>, end: u64) {
        if self
            .sink
            .as_ref()
            .is_some_and(|(_, t)| !Arc::ptr_eq(t, &span.tracing))
        {
            self.flush();
        }
        if self.count == 0 {
            envelope_head(&mut self.export, &span.tracing.service_name);
        } else {
            self.export.push(',');
        }
        encode_span(&mut self.export, context, &span, log, end);
        self.count += 1;
        let every = span.tracing.flush_every;
        self.sink = Some((span.collector, span.tracing));
        if self.count >= MAX_BATCH {
            self.flush();
        } else if !self.timer {
            let Ok(runtime) = tokio::runtime::Handle::try_current() else {
                self.flush();
                return;
            };
            self.timer = true;
            runtime.spawn(async move {
                tokio::time::sleep(every).await;
                BATCH.with_borrow_mut(|batch| {
                    batch.timer = false;
                    batch.flush();
                });
            });
        }
    }

    /// Sends the spans in on a task of their own, or drops them when too
    /// many exports are in flight (or no runtime is left to send them).
    fn flush(&mut self) {
        let count = std::mem::take(&mut self.count);
        // The next batch is likely as long: one allocation, no growing.
        let next = String::with_capacity(self.export.capacity());
        let mut export = std::mem::replace(&mut self.export, next);
        let Some((collector, tracing)) = self.sink.clone().filter(|_| count > 0) else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            DROPPED.fetch_add(count as u64, Ordering::Relaxed);
            return;
        };
        if IN_FLIGHT.fetch_add(1, Ordering::Relaxed) >= MAX_EXPORTS {
            IN_FLIGHT.fetch_sub(1, Ordering::Relaxed);
            DROPPED.fetch_add(count as u64, Ordering::Relaxed);
            return;
        }
        export.push_str(ENVELOPE_TAIL);
        runtime.spawn(send(collector, tracing.path.clone(), export, count));
    }
}

/// Sends the spans of this worker's batch now and waits (a while) for
/// every export in flight: the last spans of a stopping proxy get out.
pub async fn flush_and_wait() {
    BATCH.with_borrow_mut(Batch::flush);
    let _ = tokio::time::timeout(LAST_EXPORT_WAIT, async {
        loop {
            let ended = EXPORT_ENDED.notified();
            tokio::pin!(ended);
            ended.as_mut().enable();
            if IN_FLIGHT.load(Ordering::Relaxed) == 0 {
                return;
            }
            ended.await;
        }
    })
    .await;
}

async fn send(collector: Arc<dyn Collector>, path: PathAndQuery, body: String, count: usize) {
    let failure = match collector.post(path, body).await {
        Ok(status) if status.is_success() => None,
        Ok(status) => Some(format!("the collector answered {status}")),
        Err(e) => Some(e),
    };
    match failure {
        None => {
            EXPORTED.fetch_add(count as u64, Ordering::Relaxed);
            if FAILING.swap(false, Ordering::Relaxed) {
                tracing::info!(
                    upstream = collector.name(),
                    "spans reach the collector again"
                );
            }
        }
        Some(error) => {
            FAILED.fetch_add(count as u64, Ordering::Relaxed);
            if !FAILING.swap(true, Ordering::Relaxed) {
                tracing::warn!(upstream = collector.name(), %error, spans = count, "spans not exported; further failures are only counted (portcullis_trace_spans_total) until one succeeds");
            }
        }
    }
    IN_FLIGHT.fetch_sub(1, Ordering::Relaxed);
    EXPORT_ENDED.notify_waiters();
}

/// The start of an OTLP `ExportTraceServiceRequest` in JSON, up to its
/// spans.
fn envelope_head(out: &mut String, service_name: &str) {
    out.push_str(r#"{"resourceSpans":[{"resource":{"attributes":["#);
    attribute(out, "service.name", service_name);
    out.push_str(r#"]},"scopeSpans":[{"scope":{"name":"portcullis","version":"#);
    json_string(out, env!("CARGO_PKG_VERSION"));
    out.push_str(r#"},"spans":["#);
}

/// What closes the request after its spans.
const ENVELOPE_TAIL: &str = "]}]}]}";

/// One server span in OTLP's JSON encoding: ids in hex, 64-bit numbers as
/// strings, the attributes of OpenTelemetry's HTTP server conventions.
fn encode_span(out: &mut String, context: &TraceContext, span: &Span, log: &Ended<'_>, end: u64) {
    out.push_str(r#"{"traceId":""#);
    out.push_str(std::str::from_utf8(&context.trace_hex()).unwrap_or_default());
    out.push_str(r#"","spanId":""#);
    push_hex(out, context.span_id);
    if let Some(parent) = context.parent {
        out.push_str(r#"","parentSpanId":""#);
        push_hex(out, parent);
    }
    out.push_str(r#"","#);
    out.push_str(r#""name":"#);
    match log.route {
        Some(route) => json_string(out, &format!("{} {route}", log.method)),
        None => json_string(out, log.method.as_str()),
    }
    let mut digits = itoa::Buffer::new();
    out.push_str(r#","kind":2,"startTimeUnixNano":""#);
    out.push_str(digits.format(span.start_unix_nanos));
    out.push_str(r#"","endTimeUnixNano":""#);
    out.push_str(digits.format(end));
    out.push_str(r#"","attributes":["#);
    attribute(out, "http.request.method", log.method.as_str());
    out.push(',');
    let path = log.path.map_or("/", |p| p.path());
    attribute(out, "url.path", path);
    out.push(',');
    attribute(out, "url.scheme", if span.https { "https" } else { "http" });
    if let Some(host) = span.host.as_ref().and_then(|h| h.to_str().ok()) {
        out.push(',');
        attribute(out, "server.address", host_only(host));
    }
    for (key, ip) in [
        ("client.address", span.client),
        ("network.peer.address", log.peer),
    ] {
        out.push_str(r#",{"key":""#);
        out.push_str(key);
        out.push_str(r#"","value":{"stringValue":""#);
        match ip {
            // Octet by octet: a quarter of the instructions of Display.
            IpAddr::V4(ip) => {
                for (i, octet) in ip.octets().into_iter().enumerate() {
                    if i > 0 {
                        out.push('.');
                    }
                    out.push_str(digits.format(octet));
                }
            }
            ip => {
                let _ = write!(out, "{ip}");
            }
        }
        out.push_str(r#""}}"#);
    }
    out.push(',');
    let version = match span.version {
        Version::HTTP_2 => "2",
        Version::HTTP_3 => "3",
        Version::HTTP_10 => "1.0",
        _ => "1.1",
    };
    attribute(out, "network.protocol.version", version);
    out.push_str(r#",{"key":"http.response.status_code","value":{"intValue":""#);
    out.push_str(digits.format(log.status));
    out.push_str(r#""}}"#);
    let endpoint = log.endpoint.map(ToString::to_string);
    for (key, value) in [
        ("portcullis.route", log.route),
        ("portcullis.upstream", log.upstream),
        ("portcullis.endpoint", endpoint.as_deref()),
        (
            "portcullis.request_id",
            log.request_id.and_then(|v| v.to_str().ok()),
        ),
    ] {
        if let Some(value) = value {
            out.push(',');
            attribute(out, key, value);
        }
    }
    let error = if log.aborted {
        Some("response_aborted".to_owned())
    } else {
        (log.status >= 500).then(|| log.status.to_string())
    };
    match error {
        // Server spans: a 4xx is the client's error, not the span's.
        Some(error) => {
            out.push(',');
            attribute(out, "error.type", &error);
            out.push_str(r#"],"status":{"code":2}}"#);
        }
        None => out.push_str("]}"),
    }
}

/// `n` as 16 lower-case hex digits.
fn push_hex(out: &mut String, n: u64) {
    let mut digits = [0u8; 16];
    crate::request_id::hex_into(n, &mut digits);
    out.push_str(std::str::from_utf8(&digits).unwrap_or_default());
}

/// `host[:port]` without the port (an IPv6 literal keeps its brackets).
fn host_only(host: &str) -> &str {
    match host.rfind(':') {
        Some(i) if !host[i..].contains(']') => &host[..i],
        _ => host,
    }
}

/// A string attribute; `key` is one of ours, which needs no escaping.
fn attribute(out: &mut String, key: &'static str, value: &str) {
    out.push_str(r#"{"key":""#);
    out.push_str(key);
    out.push_str(r#"","value":{"stringValue":"#);
    json_string(out, value);
    out.push_str("}}");
}

/// `s` as a JSON string: quotes, backslashes and control characters
/// escaped, the runs between them copied whole.
fn json_string(out: &mut String, s: &str) {
    out.push('"');
    let mut from = 0;
    for (i, b) in s.bytes().enumerate() {
        let escaped = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            0..=0x1f => "",
            _ => continue,
        };
        // An ASCII byte: both slices end on character boundaries.
        out.push_str(&s[from..i]);
        if escaped.is_empty() {
            let _ = write!(out, "\\u{b:04x}");
        } else {
            out.push_str(escaped);
        }
        from = i + 1;
    }
    out.push_str(&s[from..]);
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_are_escaped_as_json() {
        let mut out = String::new();
        json_string(&mut out, "a\"b\\c\nd\u{1}é");
        let back: String = serde_json::from_str(&out).unwrap();
        assert_eq!(back, "a\"b\\c\nd\u{1}é");
    }

    #[test]
    fn the_envelope_is_otlp_json() {
        let mut export = String::new();
        envelope_head(&mut export, "edge \"one\"");
        export.push_str(r#"{"traceId":"01","spanId":"02"},{"traceId":"03","spanId":"04"}"#);
        export.push_str(ENVELOPE_TAIL);
        let body: serde_json::Value = serde_json::from_str(&export).unwrap();
        let resource = &body["resourceSpans"][0];
        assert_eq!(
            resource["resource"]["attributes"][0],
            serde_json::json!({"key": "service.name", "value": {"stringValue": "edge \"one\""}})
        );
        let scope = &resource["scopeSpans"][0];
        assert_eq!(scope["scope"]["name"], "portcullis");
        assert_eq!(scope["spans"].as_array().unwrap().len(), 2);
        assert_eq!(scope["spans"][1]["spanId"], "04");
    }

    #[test]
    fn ports_are_cut_from_hosts() {
        assert_eq!(host_only("example.com:8443"), "example.com");
        assert_eq!(host_only("example.com"), "example.com");
        assert_eq!(host_only("[::1]:80"), "[::1]");
        assert_eq!(host_only("[::1]"), "[::1]");
    }
}
