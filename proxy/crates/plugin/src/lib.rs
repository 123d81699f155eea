//! WebAssembly policy plugins (the `portcullis:policy` world in `wit/`):
//! compiling components, keeping instances, and calling them with a
//! deadline and a memory cap.
//!
//! - One [`wasmtime::Engine`] per process with the pooling allocator;
//!   components are compiled once per content hash (a reload that keeps a
//!   module reuses its compiled code) on a blocking thread.
//! - A [`Binding`] is one plugin attached with one config. It keeps idle
//!   instances for reuse, per thread; an instance that traps is thrown away.
//! - Calls are synchronous, on the calling worker's stack, except those
//!   given a large request body, which run on a few plugin threads
//!   ([`offload`]). Every call runs under a deadline in CPU time (checked
//!   at the ticks of an epoch ticker thread, each millisecond:
//!   [`cpu_deadline`]) and a memory cap, so a plugin that loops or hoards
//!   fails its own request, runs on its thread no longer than the
//!   deadline, and touches nothing else.
//!
//! Here: the host's limits and errors; `seam.rs` the interface every kind
//! of plugin implements and the request path calls; `host.rs` the engine
//! and compile caches, `binding.rs` a component plugin with its config and
//! its calls, `component.rs` that plugin behind the seam, `chains.rs` the
//! routes' chains, `use_binding.rs` one use bound, `kept.rs` the uses a
//! reload keeps, `facts.rs` what a
//! plugin is told.

mod bindings;
mod containment;
mod contract_v0_2;
mod cpu_deadline;
mod disk_cache;
mod file_kind;
mod header_call;
mod lift;
// Public: the plugin threads large bodies are called on, which the request
// path hands to (http).
pub mod offload;
mod state;
mod stdio;
// Public: bodies streamed to plugins, read by the request path (http).
pub mod stream_body;
mod wasi;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use wasmtime::component::{Component, Func, HasSelf, Linker, TypedFunc};
use wasmtime::{Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store};

use bindings::Hooks as WitHooks;
pub use bindings::{
    CalloutResult, Decision, Forward, Header, HeaderEdits, LocalResponse, RequestHead,
    ResponseBodyDecision, ResponseDecision, ResponseHead, RouteInfo,
};
use bindings::{Policy, PolicyPre};
pub use containment::counters;
use lift::Lifted;
pub use offload::Lost;
use state::State;

use portcullis_config::{Config, ConfigError, ConfigErrors, FailMode, PluginModule, PluginUse};
use portcullis_net::shard::{SHARDS, this_thread as shard};

mod binding;
mod chains;
mod component;
mod facts;
mod host;
mod kept;
mod proxy_wasm;
pub use proxy_wasm::{
    HISTOGRAM_BUCKETS as FILTER_HISTOGRAM_BUCKETS, Histogram as FilterHistogram,
    SHARED_BYTES_PER_PLUGIN, forget_plugins, gauges as filter_gauges,
    histograms as filter_histograms, shared_bytes,
};
// Public: rollout and shadow reports, shown by the binary's admin (bin).
pub mod rollout;
// Public: the interface every plugin kind implements and the request path
// calls (http).
pub mod seam;
mod shadow;
mod use_binding;
mod use_reports;

pub use binding::Binding;
use binding::*;
pub use chains::{Chains, empty_head, empty_route, prepare};
pub use facts::{RequestFacts, apply_edits, to_wit_headers};
pub use host::{PluginHost, disk_cache_outcomes, forget_unused, host, use_disk_cache};
pub use rollout::Rollout;
pub use seam::{
    BodyVerdict, Callout, CalloutAnswer, Callouts, Forwarded, GrpcReply, Hooks, LocalAnswer, Noted,
    Plugin, RequestLent, ResponseLent, ResponseVerdict, Steer, Stream, StreamEvent, Verdict,
    WholeVerdicts,
};
pub use shadow::Shadow;
pub use use_reports::{RolloutReport, ShadowReport};

/// How often the epoch advances; deadlines are whole ticks.
const TICK: Duration = Duration::from_millis(1);

/// A component instance's memory cap unless its use sets one.
pub const DEFAULT_COMPONENT_MEMORY: usize = 16 << 20;
/// Instance slots in the pooling allocator (each plugin instance takes one
/// while it exists, idle or busy).
const POOL_SLOTS: u32 = 1000;
/// Address space reserved for each plugin memory: all that a 32-bit
/// memory can address, followed by wasmtime's default guard, so no load or
/// store can reach past the reservation. Cranelift then compiles them with
/// no bounds check (an access past the memory's end hits unmapped pages
/// and traps through the signal handler): ~1,000 fewer instructions per
/// request with jwt-auth's cache hit, whose token digest and compare are
/// loads in a loop. Virtual only: 4 TiB for the pool.
const RESERVATION: u64 = 4 << 30;
const GUARD: u64 = 32 << 20;
/// Idle instances kept per binding and thread shard. Calls are
/// synchronous, so a thread uses one instance of a binding at a time.
const MAX_IDLE: usize = 4;
/// One thread's idle instances ([`portcullis_net::shard`]: each thread takes its
/// own, so a worker reuses the instance it used last, whose memory and
/// host state are still in that core's caches, where an instance handed
/// between workers arrives cold), alone on its cache lines: adjacent
/// shards in one line would bounce it between the workers' cores on
/// every call (two workers, two shards, one 64-byte line before this).
#[derive(Default)]
#[repr(align(128))]
// Boxed on purpose: see `Instance`.
#[allow(clippy::vec_box)]
struct Shard {
    idle: Mutex<Vec<Box<Instance>>>,
    /// Calls made on this thread: counted in the line the thread already
    /// holds for `idle`, so the count costs no line shared between cores.
    calls: std::sync::atomic::AtomicU64,
}

impl std::ops::Deref for Shard {
    type Target = Mutex<Vec<Box<Instance>>>;
    fn deref(&self) -> &Self::Target {
        &self.idle
    }
}

/// Why a plugin call failed.
#[derive(Debug, thiserror::Error)]
pub enum PluginError {
    /// The call ran past its deadline.
    #[error("plugin `{plugin}` timed out after {timeout:?} in {during} (the use's `{setting}`)")]
    Timeout {
        /// Plugin name.
        plugin: Arc<str>,
        /// The deadline.
        timeout: Duration,
        /// The call it ran out in (`proxy_on_configure`, `on-request`).
        during: &'static str,
        /// The setting that sets this deadline: `timeout`, or for a
        /// filter's start `start_timeout`.
        setting: &'static str,
    },
    /// The instance tried to grow its memory past the cap.
    #[error(
        "plugin `{plugin}` ran out of memory (cap {cap} bytes) in {during} (the use's `memory`)"
    )]
    OutOfMemory {
        /// Plugin name.
        plugin: Arc<str>,
        /// The cap.
        cap: usize,
        /// The call that reached it.
        during: &'static str,
    },
    /// The plugin trapped (a panic, an unreachable, a bad access...).
    #[error("plugin `{plugin}` failed: {message}")]
    Trap {
        /// Plugin name.
        plugin: Arc<str>,
        /// What wasmtime reported.
        message: String,
    },
    /// The plugin refused its config or could not be instantiated.
    #[error("plugin `{plugin}` could not start: {message}")]
    Setup {
        /// Plugin name.
        plugin: Arc<str>,
        /// Why.
        message: String,
    },
}

impl PluginError {
    /// The status the client gets when the plugin fails closed.
    pub fn status(&self) -> http::StatusCode {
        match self {
            PluginError::Timeout { .. } => http::StatusCode::SERVICE_UNAVAILABLE,
            _ => http::StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// A short kind for logs and error bodies.
    pub fn kind(&self) -> &'static str {
        match self {
            PluginError::Timeout { .. } => "plugin timed out",
            PluginError::OutOfMemory { .. } => "plugin ran out of memory",
            PluginError::Trap { .. } => "plugin failed",
            PluginError::Setup { .. } => "plugin could not start",
        }
    }

    /// The plugin's name.
    pub fn plugin(&self) -> &str {
        match self {
            PluginError::Timeout { plugin, .. }
            | PluginError::OutOfMemory { plugin, .. }
            | PluginError::Trap { plugin, .. }
            | PluginError::Setup { plugin, .. } => plugin,
        }
    }
}

#[cfg(test)]
mod tests;
