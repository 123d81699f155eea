//! Portcullis: a WebAssembly-extensible edge proxy. This crate is the
//! binary's own part (commands, the admin listener and its status,
//! reloads) over the crates in `proxy/crates/`, lowest first:
//! `portcullis-net`, `-config`, `-obs`, `-forward` (upstreams and the body
//! type), `-plugin` (the only one that links
//! wasmtime), `-http` (the request path) and `-tunnel`. See
//! docs/architecture.md for what each owns and one request's path.
//!
//! The modules the tests, fuzz targets and examples use are re-exported
//! here (`portcullis::config`, `portcullis::server`, ...).

mod admin;
mod admin_status;
// Public: the commands main.rs runs (bin).
pub mod commands;
// Public: the development certificates `serve --dev-certs` writes (bin).
pub mod dev_certs;
// Public: the log flags the command line parses (bin).
pub mod log_flags;
// Public: `portcullis new-plugin`'s template, also built by the packaging
// tests (bin, tests).
pub mod new_plugin;
// Public: the tunnel peers' flags the command line parses (bin).
pub mod peer_flags;
// Public: reloads on a signal or a file change, started by main.rs (bin).
pub mod reload;
// Public: the state store's flags the command line parses (bin).
pub mod state_flags;

// What the tests, the fuzz targets and the examples name through this
// crate, and nothing more: the other crates' modules are reached through
// those crates.
pub use portcullis_config as config;
pub use portcullis_forward as forward;
pub use portcullis_http::{chain, request_head, server};
pub use portcullis_net::{
    cert_expiry, cert_identity, der, framing, h1_request, h1_response, handshake_head,
    proxy_protocol, worker_idle,
};
pub use portcullis_obs::{telemetry, trace_context};
pub use portcullis_plugin as plugin;
pub use portcullis_tunnel as tunnel;
