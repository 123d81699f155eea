//! Portcullis: a WebAssembly-extensible edge proxy. This crate is the
//! binary's own part (commands, the admin listener and its status,
//! reloads) over the crates in `proxy/crates/`, lowest first:
//! `portcullis-net`, `-config`, `-obs`, `-plugin` (the only one that links
//! wasmtime), `-http` (the request path) and `-tunnel`. See
//! docs/architecture.md for what each owns and one request's path.
//!
//! The modules the tests, fuzz targets and examples use are re-exported
//! here (`portcullis::config`, `portcullis::server`, ...).

pub mod admin;
pub mod admin_status;
pub mod commands;
pub mod dev_certs;
pub mod log_flags;
pub mod new_plugin;
pub mod peer_flags;
pub mod reload;
pub mod state_flags;

// What the tests, the fuzz targets and the examples name through this
// crate, and nothing more: the other crates' modules are reached through
// those crates.
pub use portcullis_config as config;
pub use portcullis_http::{chain, forward, request_head, server};
pub use portcullis_net::{
    cert_expiry, cert_identity, der, framing, handshake_head, proxy_protocol, worker_idle,
};
pub use portcullis_obs::{telemetry, trace_context};
pub use portcullis_plugin as plugin;
pub use portcullis_tunnel as tunnel;
