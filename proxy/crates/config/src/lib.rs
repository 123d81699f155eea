//! Policy files → one validated, immutable runtime model.
//!
//! YAML is parsed into the raw structs of [`raw`] (unknown keys rejected),
//! then [`build`] checks everything at once and produces a [`Config`]. Every
//! error carries `file:line:column`; all of them are collected, not just the
//! first, so `portcullis check` can list them together.

mod build;
mod builtin_plugins;
mod diagnose;
// Public: `${VAR}` expansion, also done in plugin configs and fuzzed (plugin,
// fuzz).
pub mod envsubst;
mod features;
mod listener;
mod load;
mod plugin_use;
mod raw;
mod route;
mod router;
mod template;
mod units;
mod upstream;

use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use http::uri::{Authority, Scheme};
use http::{HeaderName, HeaderValue, Method, StatusCode};
use rustls_pki_types::CertificateDer;

pub use build::{
    DEFAULT_KEEPALIVE_TIMEOUT, DEFAULT_MAX_HEADER_SIZE, MAX_PLUGIN_MEMORY, upstream_at,
};
pub use features::{
    AuthCacheSpec, Compression, DEFAULT_BROTLI, DEFAULT_LEVEL, DEFAULT_MIN_SIZE, DEFAULT_TYPES,
    LimitKey, MirrorSpec, RateLimitSpec, RequestIds, Tracing,
};
pub use listener::*;
pub use load::{
    Source, default_sources, load_dir, load_dir_with_env, load_partial, load_policies,
    load_sources, read_dir, sort_errors,
};
pub use plugin_use::*;
pub use route::*;
pub use template::Template;
pub use units::{parse_duration, parse_rate, parse_size};
pub use upstream::*;

pub use router::{HostMatch, Matched, Router};

/// Where something was written in the policy files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pos {
    /// The file as it was named when loaded (directory joined with file name).
    pub file: Arc<str>,
    /// 1-based line; 0 for the file (or directory) as a whole.
    pub line: u64,
    /// 1-based column.
    pub column: u64,
}

impl fmt::Display for Pos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `dir:0:0:` would send an editor to a line that does not exist.
        if self.line == 0 {
            return f.write_str(&self.file);
        }
        write!(f, "{}:{}:{}", self.file, self.line, self.column)
    }
}

/// One problem in the policy files.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{pos}: {message}")]
pub struct ConfigError {
    /// Where the problem is.
    pub pos: Pos,
    /// What is wrong and, where it helps, what to do.
    pub message: String,
}

/// Every problem found in one load; never empty.
#[derive(Debug, Clone, thiserror::Error)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

/// The validated configuration: listeners, upstreams, routes and the router
/// that picks a route for a request. Immutable once built (a changed
/// copy, such as new upstream addresses, is a new config).
#[derive(Debug, Clone)]
pub struct Config {
    /// Listeners to bind, in file order.
    pub listeners: Vec<Listener>,
    /// Upstreams, indexed by [`Action::Forward`].
    pub upstreams: Vec<Arc<Upstream>>,
    /// Routes, indexed by the router's matches.
    pub routes: Vec<Arc<Route>>,
    /// Host and path lookup over `routes`.
    pub router: Router,
    /// Plugin modules, indexed by [`PluginUse::plugin`].
    pub plugins: Vec<Arc<PluginModule>>,
    /// Plugins run for every route before the route's own.
    pub global_plugins: Vec<PluginUse>,
    /// Spans to an OpenTelemetry collector, when the policies say so.
    pub tracing: Option<Arc<Tracing>>,
    /// Files read besides the policy files themselves (plugins, CA files,
    /// secrets), so a reload can watch where they live.
    pub files: Vec<std::path::PathBuf>,
    /// SHA-256 over everything the config was built from: policy texts,
    /// plugin modules, CA certificates and resolved plugin configs
    /// (secrets included). Equal fingerprints mean nothing to reload.
    pub fingerprint: [u8; 32],
}

impl Config {
    /// The index of the upstream called `name`.
    pub fn upstream_index(&self, name: &str) -> Option<usize> {
        self.upstreams.iter().position(|u| &*u.name == name)
    }

    /// The request timeout of `route`: its own, or its upstream's, or the
    /// default for a route that answers itself.
    pub fn request_timeout(&self, route: &Route) -> std::time::Duration {
        route.timeout.unwrap_or(match route.action {
            Action::Forward(i) => self.upstreams[i].timeouts.request,
            _ => build::DEFAULT_REQUEST_TIMEOUT,
        })
    }
}
