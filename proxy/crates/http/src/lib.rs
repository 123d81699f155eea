//! The request path: one [`pipeline::Pipeline`] per configuration,
//! shared by every listener (accept, route, plugins, forward, respond),
//! the route features (compression, rate limits, mirrors, auth requests)
//! with their live state ([`route_state`]), and forwarding to upstreams
//! ([`forward`]: pools, balancing, retries, upgrades). [`server`] runs the
//! routing core's listeners over it.

pub mod answers;
pub mod auth_cache;
pub mod auth_request;
pub mod body;
pub mod body_progress;
pub mod callout;
pub mod chain;
pub mod client_watch;
pub mod collector;
pub mod compress;
pub mod conn_info;
pub mod connection;
pub mod discovery;
pub mod forward;
pub mod grpc_local;
pub mod mirror;
pub mod phases;
pub mod pipeline;
pub mod rate_limit;
mod redis_calls;
pub mod request_head;
pub mod route_state;
pub mod server;
pub mod shared_limit;
pub mod tee;
