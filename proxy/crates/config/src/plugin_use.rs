//! A plugin module and each use of it, as the policies state them.

use crate::*;

/// A plugin's WebAssembly component, read from disk.
#[derive(Debug)]
pub struct PluginModule {
    /// Name routes use.
    pub name: Arc<str>,
    /// The file it was read from.
    pub path: std::path::PathBuf,
    /// The component's bytes.
    pub bytes: Arc<[u8]>,
    /// SHA-256 of the bytes (also the compile cache key).
    pub sha256: [u8; 32],
    /// Where it was defined.
    pub defined_at: Pos,
}

/// What a plugin failure does to the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailMode {
    /// Answer that request with an error (500, or 503 on timeout).
    Closed,
    /// Let the request through as if the plugin had not been there.
    Open,
}

/// A plugin attached to a route (or globally), with its config.
#[derive(Debug, Clone)]
pub struct PluginUse {
    /// Index into `Config::plugins`.
    pub plugin: usize,
    /// The config handed to the plugin, as JSON: env and files resolved
    /// for a component, as written for a proxy-wasm filter (unless the
    /// use says `expand_config`).
    pub config_json: String,
    /// The values in it that came from `${VAR}` or `from_file` (a
    /// secret, maybe), each with where it came from: see
    /// [`crate::redact`].
    pub substituted: Arc<[(String, String)]>,
    /// Failure policy.
    pub fail: FailMode,
    /// Deadline per call, in CPU time the call uses.
    pub timeout: Duration,
    /// Deadline for starting an instance or VM, in CPU time.
    pub start_timeout: Duration,
    /// Memory cap per instance, bytes; `None`: the kind's default (16 MiB
    /// for a component, 128 MiB for a proxy-wasm filter, whose Go runtime
    /// grows past 96 MiB as some filters start).
    pub memory: Option<usize>,
    /// A new instance for every request (nothing can carry over between
    /// requests) instead of reusing idle ones.
    pub fresh_instances: bool,
    /// A proxy-wasm filter's root id and VM configuration (as JSON, like
    /// `config_json`); set only for filters (a component refuses them).
    pub root_id: Option<Arc<str>>,
    pub vm_config_json: Option<String>,
    /// `mode: shadow`: the share of requests (1-100) it runs on, with
    /// nothing it decides enforced; `None` for a use that is enforced.
    pub shadow: Option<u32>,
    /// A candidate version rolled out beside this one (boxed: rare).
    pub rollout: Option<Box<Rollout>>,
    /// Where it was attached.
    pub defined_at: Pos,
    /// The configs resolved, kept until the plugin's kind is known.
    pub(crate) expansion: Option<Box<Expansion>>,
}

/// A use's rollout of a candidate version: its share grows through
/// `steps`, each held for `interval`, and falls to 0 (rolled back) when
/// the candidate's share of bad outcomes (denied, failed, timed out, an
/// upstream's 5xx) over `window` exceeds the current version's by more
/// than `margin` points once it has `min_requests` there.
#[derive(Debug, Clone)]
pub struct Rollout {
    /// The candidate's use: its plugin and config, the rest as the use's.
    pub candidate: PluginUse,
    /// Shares in percent, rising; the last is held (100: the rollout
    /// completes after its interval, the candidate promoted).
    pub steps: Vec<u32>,
    pub interval: Duration,
    pub key: RolloutKey,
    pub window: Duration,
    pub min_requests: u32,
    /// Percentage points.
    pub margin: u32,
}

/// What splits a rollout's requests, so a client sees one version.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum RolloutKey {
    /// The client's address (as plugins see it).
    Client,
    /// A request header's value (lowercase name).
    Header(String),
    /// A cookie's value.
    Cookie(String),
}

/// A use's configs with `${ENV}` and `{from_file}` resolved, what that
/// brought in, and what went wrong: taken or dropped once the plugin's
/// kind is known (see `build::plugins::settle_config`).
#[derive(Debug, Clone)]
pub(crate) struct Expansion {
    pub(crate) asked: Option<bool>,
    pub(crate) config_json: String,
    pub(crate) vm_config_json: Option<String>,
    pub(crate) substituted: Vec<(String, String)>,
    pub(crate) errors: Vec<ConfigError>,
}

impl PluginModule {
    /// A core WebAssembly module (a proxy-wasm filter), not a component:
    /// the version word after `\0asm` is 1 (a component's is 0x0d with
    /// layer 1).
    pub fn is_core_module(&self) -> bool {
        self.bytes.get(4..8) == Some(&[1, 0, 0, 0])
    }
}
