//! Portcullis: a WebAssembly-extensible edge proxy. This crate is the
//! binary's own part (commands, the admin listener and its status,
//! reloads) over the crates in `proxy/crates/`, lowest first:
//! `portcullis-net`, `-config`, `-obs`, `-plugin` (the only one that links
//! wasmtime), `-http` (the request path) and `-tunnel`. See
//! docs/architecture.md for what each owns and one request's path.
//!
//! Their modules are re-exported here under their old names, so
//! `portcullis::config`, `portcullis::pipeline` and the like keep naming
//! what they named.

pub mod admin;
pub mod admin_status;
pub mod commands;
pub mod dev_certs;
pub mod log_flags;
pub mod new_plugin;
pub mod peer_flags;
pub mod reload;
pub mod state_flags;

pub use portcullis_config as config;
pub use portcullis_http::{
    auth_cache, auth_request, body, chain, client_watch, collector, compress, discovery, forward,
    grpc_local, mirror, pipeline, rate_limit, request_head, route_state, server, tee,
};
pub use portcullis_net::{
    balance, cert_expiry, cert_files, cert_identity, client_addr, client_cert, coarse_clock, der,
    drain, files, framing, h1_or_h2, handshake_head, head_deadline, linger, pem, proxy_protocol,
    resolve, shard, shared_dial, sockets, ticket_keys, tls_listen, unparsed_head, worker_beat,
    worker_idle,
};
pub use portcullis_obs::{
    admin_http, metrics, otlp, request_id, status_page, telemetry, trace_context,
};
pub use portcullis_plugin as plugin;
pub use portcullis_tunnel as tunnel;
