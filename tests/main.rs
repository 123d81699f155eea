//! Integration tests: the real proxy (in-process or the binary) with real
//! upstream servers and clients over loopback.

mod support;

mod access_log;
mod admin_access;
mod architecture;
mod auth_request;
mod balancing;
mod body_limit;
mod check_cli;
mod check_structure;
mod compression;
mod containment;
mod default_routes;
mod dns;
mod docs;
mod errors;
mod health_check;
mod idle_connections;
mod lifecycle;
mod metrics;
mod mirror;
mod plugin_cache;
mod plugins;
mod rate_limit;
mod reload;
mod request_id;
mod retries;
mod routing;
mod status_page;
mod streaming;
mod tls_listener;
mod tls_upstream;
mod tracing_otlp;
mod tunnel;
mod upstream_h1;
mod upstream_h1_vs_hyper;
mod upstream_paths_agree;
