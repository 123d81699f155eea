//! What the proxy tells about itself: request metrics and their
//! exposition, the access log, trace context and spans for an
//! OpenTelemetry collector, request ids, and the plumbing and status page
//! of the admin listeners.
//!
//! Uses `portcullis-net` and `portcullis-config` only; spans reach their
//! collector through [`otlp::Collector`], which the request path
//! implements.

mod access_line;
pub mod access_log;
pub mod admin_access;
pub mod admin_answer;
pub mod admin_http;
pub mod metrics;
pub mod otlp;
mod process_metrics;
pub mod request_id;
pub mod status_page;
pub mod telemetry;
pub mod trace_context;
