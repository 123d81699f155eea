//! What the proxy tells about itself: request metrics and their
//! exposition, the access log, trace context and spans for an
//! OpenTelemetry collector, request ids, and the plumbing and status page
//! of the admin listeners.
//!
//! Uses `portcullis-net` and `portcullis-config` only; spans reach their
//! collector through [`otlp::Collector`], which the request path
//! implements.

mod access_line;
// Public: the access log writer, for both kinds of server and the binary's
// flags (bin, http, tunnel).
pub mod access_log;
// Public: who may use an admin listener, for both admin servers (bin, tunnel).
pub mod admin_access;
// Public: admin answers (JSON, Prometheus text), for both admin servers (bin,
// tunnel).
pub mod admin_answer;
// Public: the admin listener's plumbing, for both admin servers (bin, tunnel).
pub mod admin_http;
// Public: the metrics registry every part counts into (bin, http, tunnel).
pub mod metrics;
// Public: spans sent to an OpenTelemetry collector (bin, http, tunnel).
pub mod otlp;
mod process_metrics;
// Public: request ids, made on both kinds of server (http, tunnel).
pub mod request_id;
// Public: the status page both admin servers serve (bin, tunnel).
pub mod status_page;
// Public: logging and tracing set up by the binary, and its spans on the
// request path (bin, http).
pub mod telemetry;
// Public: W3C trace context parsing, for its fuzz target (fuzz).
pub mod trace_context;
