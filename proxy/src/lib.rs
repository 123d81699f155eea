//! Portcullis: a WebAssembly-extensible edge proxy.
//!
//! A request is followed through: [`server`] (accept, HTTP/1.1 and h2c) →
//! [`pipeline`] (route, answer or forward) → [`router`] (host and path
//! lookup) → [`forward`] (upstream pool, balancing, retries, upgrades).
//! [`config`] turns policy files into the immutable model all of them read.

pub mod admin;
pub mod admin_http;
pub mod admin_status;
pub mod auth_cache;
pub mod auth_request;
pub mod balance;
pub mod body;
pub mod builtin_plugins;
pub mod cert_expiry;
pub mod cert_files;
pub mod cert_identity;
pub mod chain;
pub mod client_addr;
pub mod client_cert;
pub mod client_watch;
pub mod coarse_clock;
pub mod collector;
pub mod commands;
pub mod compress;
pub mod config;
pub mod der;
pub mod discovery;
pub mod drain;
pub mod forward;
pub mod grpc_local;
pub mod h1_or_h2;
pub mod head_deadline;
pub mod linger;
pub mod metrics;
pub mod mirror;
pub mod otlp;
pub mod pipeline;
pub mod plugin;
pub mod proxy_protocol;
pub mod rate_limit;
pub mod reload;
pub mod request_head;
pub mod request_id;
pub mod resolve;
pub mod route_state;
pub mod server;
pub mod shard;
pub mod shared_dial;
pub mod sockets;
pub mod status_page;
pub mod tee;
pub mod telemetry;
pub mod ticket_keys;
pub mod tls_listen;
pub mod trace_context;
pub mod tunnel;
pub mod unparsed_head;
