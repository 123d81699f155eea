//! The request path: one [`pipeline::Pipeline`] per configuration,
//! shared by every listener (accept, route, plugins, forward, respond),
//! the route features (compression, rate limits, mirrors, auth requests)
//! with their live state ([`route_state`]), and forwarding to upstreams
//! ([`forward`]: pools, balancing, retries, upgrades). [`server`] runs the
//! routing core's listeners over it.

// Public: the proxy's own answers (JSON errors), also the tunnel server's
// (tunnel).
pub mod answers;
mod auth_cache;
// Public: an auth request's settings, checked by the config (config).
pub mod auth_request;
// Public: the request path's body type, which the tunnel server's public side
// carries (tunnel).
pub mod body;
mod body_progress;
mod callout;
// Public: the plugin chain's driver, for its fuzz target (fuzz).
pub mod chain;
mod client_watch;
// Public: the trace collector the request path implements for obs (obs).
pub mod collector;
mod compress;
// Public: what a connection tells its requests, made by the tunnel server too
// (tunnel).
pub mod conn_info;
// Public: a served connection's request accounting, shared with the tunnel
// server (tunnel).
pub mod connection;
mod discovery;
// Public: forwarding to upstreams, used by the tunnel server, the binary,
// tests and fuzz targets (bin, fuzz, tests, tunnel).
pub mod forward;
mod grpc_local;
// Public: HTTP/3 serving, one copy for the routing core's listeners and the
// tunnel server's public side (tunnel).
pub mod http3;
mod mirror;
// Public: the phase driver, which the tunnel server's public side runs
// requests through (tunnel).
pub mod phases;
// Public: the pipeline one configuration serves through (bin, tunnel).
pub mod pipeline;
// Public: rate limits and their shared store (bin, tunnel).
pub mod rate_limit;
mod redis_calls;
// Public: the request head's checks, for the tunnel server and a fuzz target
// (fuzz, tunnel).
pub mod request_head;
mod route_state;
// Public: the routing core's server and its control (bin, tests, tunnel).
pub mod server;
// Public: limits shared between proxies through Redis, set up by the binary
// (bin).
pub mod shared_limit;
mod tee;
