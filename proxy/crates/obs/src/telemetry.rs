//! Logging setup and the access log.

use portcullis_net::stamp::Stamp;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use http::Method;
use http::uri::PathAndQuery;
use tracing_subscriber::EnvFilter;

/// Whether logs are JSON lines (`PORTCULLIS_LOG_FORMAT=json`) rather than text.
pub fn json_format() -> bool {
    std::env::var("PORTCULLIS_LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("json"))
}

/// Event lines waiting for stderr at most; past them, lines are dropped
/// and counted ([`dropped_lines`]).
const EVENT_BACKLOG: usize = 8192;

/// The event log's writer thread, kept for the flush at exit.
static EVENTS: Mutex<Option<tracing_appender::non_blocking::WorkerGuard>> = Mutex::new(None);
/// Its count of lines dropped.
static EVENTS_DROPPED: OnceLock<tracing_appender::non_blocking::ErrorCounter> = OnceLock::new();

/// Installs the global subscriber: text or JSON (`PORTCULLIS_LOG_FORMAT`),
/// filtered by `RUST_LOG` (default `info`), to stderr through a thread of
/// its own, so that a stderr that blocks (a pipe nobody reads) drops and
/// counts lines instead of stalling the thread that logs (a worker, the
/// accept loop); and starts the access log's writer with `access` (its
/// destination, buffer and flush interval). Fails when the access log's
/// file cannot be opened.
pub fn init(access: crate::access_log::Settings) -> Result<(), String> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = json_format();
    // Colours only for a person at a terminal: in a file or `kubectl logs`
    // the escape codes are noise around every field.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(true)
        .buffered_lines_limit(EVENT_BACKLOG)
        .thread_name("event-log")
        .finish(std::io::stderr());
    let _ = EVENTS_DROPPED.set(writer.error_counter());
    *EVENTS.lock().unwrap_or_else(|p| p.into_inner()) = Some(guard);
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(writer);
    // A second init (tests that start several servers) is harmless: ignore it.
    let _ = if json {
        builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init()
    } else {
        builder.try_init()
    };
    crate::access_log::start(access)
}

/// Writes the access log's and the event log's last lines, waiting at
/// most `limit` for each destination that blocks: at exit.
pub fn finish(limit: Duration) {
    crate::access_log::finish(limit);
    // The writer's guard flushes when dropped, and may wait on a stderr
    // that blocks (or print to a stdout that does): dropped on a thread
    // of its own, waited for no longer than `limit`.
    let guard = EVENTS.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some(guard) = guard {
        let (done, flushed) = std::sync::mpsc::sync_channel(1);
        let flushing = std::thread::Builder::new()
            .name("event-log-flush".into())
            .spawn(move || {
                drop(guard);
                let _ = done.send(());
            });
        if flushing.is_ok() {
            let _ = flushed.recv_timeout(limit);
        }
    }
}

/// Event-log lines dropped so far: stderr did not keep up.
pub fn dropped_lines() -> u64 {
    EVENTS_DROPPED.get().map_or(0, |c| c.dropped_lines() as u64)
}

pub use crate::access_log::TARGET as ACCESS_TARGET;

/// One request's access-log record, written when dropped (that is, when the
/// response body has been sent, or the client went away).
#[derive(Debug)]
pub struct AccessLog {
    /// Request method.
    pub method: Method,
    /// Request path and query as received.
    pub path: Option<PathAndQuery>,
    /// Client address.
    pub client: SocketAddr,
    /// The worker thread serving the connection (which one is hot, and
    /// whether connections are spread evenly).
    pub worker: usize,
    /// Response status.
    pub status: u16,
    /// Route name, when one matched.
    pub route: Option<Arc<str>>,
    /// Upstream name, when forwarded.
    pub upstream: Option<Arc<str>>,
    /// The endpoint whose answer the client got (nginx's
    /// `$upstream_addr`, Envoy's `%UPSTREAM_HOST%`): which pod, when a
    /// host's addresses are endpoints.
    pub endpoint: Option<AnsweredBy>,
    /// From the first try until the upstream's response head, connecting
    /// and retries included (nginx's `$upstream_header_time`): the
    /// upstream's share of `duration`.
    pub upstream_header: Option<Duration>,
    /// When the request head was received.
    pub start: Stamp,
    /// Response body bytes sent.
    pub bytes_sent: u64,
    /// The response body did not end: it broke (an upstream reset
    /// mid-body), or its client left before its end.
    pub aborted: bool,
    /// The request's `X-Request-Id`.
    pub request_id: Option<http::HeaderValue>,
    /// The connection's TLS version (`TLSv1.3`); none in cleartext.
    pub tls: Option<&'static str>,
    /// The request's HTTP version, as nginx's `$server_protocol` and
    /// Envoy's `%PROTOCOL%` name it (`HTTP/1.1`, `HTTP/2`, `HTTP/3`).
    pub protocol: http::Version,
    /// The client's verified certificate (mutual TLS): its subject is
    /// logged, as nginx's `$ssl_client_s_dn`, so the log says who made
    /// each request.
    pub client_cert: Option<Arc<portcullis_net::client_cert::ClientCertificate>>,
    /// Whose lines the route keeps (`access_log` on the route).
    pub logging: portcullis_config::AccessLogging,
    /// The request's trace, with the policies' `tracing`: its id is
    /// logged, and a sampled request's span recorded when this is dropped.
    pub trace: Option<Box<crate::otlp::Recording>>,
    /// What plugins in shadow mode would have done: `plugin:what`,
    /// comma-separated (`what` an answer's status, `failed` or
    /// `timed_out`).
    pub shadow: Option<Box<str>>,
}

impl AccessLog {
    /// A record for a request whose head arrived at `start`, or `None`
    /// when access logging is off and the record is not `needed` anyway
    /// (a sampled request's span is made from it). Boxed: the record
    /// rides in every response body, which hyper moves several times,
    /// and a `None` of the record inline was moved whole each time, access
    /// logging off or on.
    pub fn start(
        (method, path, protocol): (&Method, Option<&PathAndQuery>, http::Version),
        (client, worker): (SocketAddr, usize),
        start: Stamp,
        needed: bool,
    ) -> Option<Box<AccessLog>> {
        let wanted = needed || crate::access_log::enabled();
        wanted.then(|| {
            Box::new(AccessLog {
                method: method.clone(),
                path: path.cloned(),
                client,
                worker,
                // Until the answer's is set: a record dropped before
                // that is a request whose client left (see
                // `metrics::Pending::unanswered`).
                status: crate::metrics::CLIENT_CLOSED_REQUEST,
                route: None,
                upstream: None,
                endpoint: None,
                upstream_header: None,
                start,
                bytes_sent: 0,
                aborted: false,
                request_id: None,
                tls: None,
                protocol,
                client_cert: None,
                logging: portcullis_config::AccessLogging::All,
                trace: None,
                shadow: None,
            })
        })
    }

    /// Notes what a plugin in shadow mode would have done.
    /// (Rare: the text is made again for each note, and takes 16 bytes
    /// of every request's record, not a `String`'s 24.)
    pub fn note_shadow(&mut self, plugin: &str, what: &str) {
        let text = match self.shadow.take() {
            Some(before) => format!("{before},{plugin}:{what}"),
            None => format!("{plugin}:{what}"),
        };
        self.shadow = Some(text.into_boxed_str());
    }
}

/// An HTTP version as access lines name it.
fn protocol_name(version: http::Version) -> &'static str {
    match version {
        http::Version::HTTP_09 => "HTTP/0.9",
        http::Version::HTTP_10 => "HTTP/1.0",
        http::Version::HTTP_2 => "HTTP/2",
        http::Version::HTTP_3 => "HTTP/3",
        _ => "HTTP/1.1",
    }
}

/// Which endpoint answered a request.
#[derive(Debug)]
pub enum AnsweredBy {
    /// Endpoint `.1` of the upstream (shown as the endpoint shows itself:
    /// `host:port`, and the address for one of a host's addresses).
    Endpoint(Arc<portcullis_config::Upstream>, usize),
    /// The authority a URL template rendered.
    Rendered(String),
}

impl AnsweredBy {
    /// What it shows, when that is one string already: the line writes
    /// it as is, not through the formatting machinery (~150 instructions).
    fn as_str(&self) -> Option<&str> {
        match self {
            AnsweredBy::Endpoint(upstream, i) => match &upstream.target {
                portcullis_config::Target::Endpoints(eps) => eps
                    .get(*i)
                    .filter(|ep| ep.address.is_none())
                    .map(|ep| ep.authority.as_str()),
                _ => Some("-"),
            },
            AnsweredBy::Rendered(authority) => Some(authority),
        }
    }
}

impl std::fmt::Display for AnsweredBy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AnsweredBy::Endpoint(upstream, i) => match &upstream.target {
                portcullis_config::Target::Endpoints(eps) if *i < eps.len() => eps[*i].fmt(f),
                _ => f.write_str("-"),
            },
            AnsweredBy::Rendered(authority) => f.write_str(authority),
        }
    }
}

impl Drop for AccessLog {
    fn drop(&mut self) {
        use portcullis_config::AccessLogging;
        let trace_id = self.trace.as_ref().map(|t| t.context.trace_hex());
        if let Some(trace) = self.trace.take() {
            trace.finish(&crate::otlp::Ended {
                logging: self.logging,
                status: self.status,
                elapsed: self.start.elapsed(),
                method: &self.method,
                path: self.path.as_ref(),
                peer: self.client.ip(),
                route: self.route.as_deref(),
                upstream: self.upstream.as_deref(),
                endpoint: self.endpoint.as_ref().map(|e| e as &dyn std::fmt::Display),
                request_id: self.request_id.as_ref(),
                aborted: self.aborted,
            });
        }
        match self.logging {
            AccessLogging::All => {}
            AccessLogging::Errors if self.status >= 400 => {}
            AccessLogging::Errors | AccessLogging::Off => return,
        }
        // Kept for its span alone (`access=off`).
        if !crate::access_log::enabled() {
            return;
        }
        let path = self.path.as_ref().map_or("/", |p| p.as_str());
        // Whole microseconds, printed as milliseconds with three decimals.
        let duration = self.start.elapsed().as_micros();
        crate::access_log::write(self.worker, None, |line| {
            line.word(crate::field!("method"), self.method.as_str());
            line.str(crate::field!("path"), path);
            line.uint(crate::field!("status"), self.status.into());
            line.str(crate::field!("route"), self.route.as_deref().unwrap_or("-"));
            line.str(
                crate::field!("upstream"),
                self.upstream.as_deref().unwrap_or("-"),
            );
            match &self.endpoint {
                Some(endpoint) => match endpoint.as_str() {
                    Some(text) => line.word(crate::field!("endpoint"), text),
                    None => line.display(crate::field!("endpoint"), endpoint),
                },
                None => line.word(crate::field!("endpoint"), "-"),
            }
            line.millis(crate::field!("duration_ms"), duration);
            // Absent when no upstream answered (a local answer, a 502).
            if let Some(took) = self.upstream_header {
                line.millis(crate::field!("upstream_header_ms"), took.as_micros());
            }
            line.uint(crate::field!("bytes"), self.bytes_sent);
            line.word(crate::field!("protocol"), protocol_name(self.protocol));
            line.addr(crate::field!("client"), &self.client);
            line.uint(crate::field!("worker"), self.worker as u64);
            line.bool(crate::field!("aborted"), self.aborted);
            line.str(
                crate::field!("request_id"),
                crate::request_id::text(self.request_id.as_ref()),
            );
            // Absent (not "-") in cleartext: most deployments have no TLS
            // here and should not pay for the fields.
            if let Some(tls) = self.tls {
                line.str(crate::field!("tls"), tls);
            }
            if let Some(cert) = &self.client_cert {
                line.str(crate::field!("client_cert"), &cert.identity.subject);
            }
            // Absent without `tracing`, as `tls` in cleartext.
            if let Some(id) = trace_id.as_ref().and_then(|t| std::str::from_utf8(t).ok()) {
                line.str(crate::field!("trace_id"), id);
            }
            // Absent unless a plugin in shadow mode would have acted.
            if let Some(shadow) = &self.shadow {
                line.str(crate::field!("shadow"), shadow);
            }
        });
    }
}
