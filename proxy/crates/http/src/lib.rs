//! The request path: one [`pipeline::Pipeline`] per configuration,
//! shared by every listener (accept, route, plugins, forward, respond),
//! the route features (compression, rate limits, mirrors, auth requests)
//! with their live state ([`route_state`]), and forwarding to upstreams
//! ([`forward`]: pools, balancing, retries, upgrades). [`server`] runs the
//! routing core's listeners over it.

pub mod answers;
mod auth_cache;
pub mod auth_request;
pub mod body;
mod body_progress;
mod callout;
pub mod chain;
mod client_watch;
pub mod collector;
mod compress;
pub mod conn_info;
pub mod connection;
mod discovery;
pub mod forward;
mod grpc_local;
mod mirror;
pub mod phases;
pub mod pipeline;
pub mod rate_limit;
mod redis_calls;
pub mod request_head;
mod route_state;
pub mod server;
pub mod shared_limit;
mod tee;
