//! The request path: one [`pipeline::Pipeline`] per configuration,
//! shared by every listener (accept, route, plugins, forward, respond),
//! the route features (compression, rate limits, mirrors, auth requests)
//! with their live state ([`route_state`]), over the forwarding to
//! upstreams below it (portcullis-forward: pools, balancing, retries,
//! upgrades, the body type). [`server`] runs the
//! routing core's listeners over it.

// Public: the proxy's own answers (JSON errors), also the tunnel server's
// (tunnel).
pub mod answers;
mod auth_cache;
// Public: an auth request's settings, checked by the config (config).
pub mod auth_request;
mod callout;
// Public: the plugin chain's driver, for its fuzz target (fuzz).
pub mod chain;
mod compress;
// Public: what a connection tells its requests, made by the tunnel server too
// (tunnel).
pub mod conn_info;
// Public: a served connection's request accounting, shared with the tunnel
// server (tunnel).
pub mod connection;
mod discovery;
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
