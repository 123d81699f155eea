//! What each plugin instance's store holds, and the host functions.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use wasmtime::component::ResourceTable;
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

use super::bindings::{Level, portcullis::policy::host};
use super::cpu_deadline::CpuDeadline;
use super::stdio::PluginOutput;
use super::{RequestFacts, RequestHead, RouteInfo};

/// The per-instance store data.
pub struct State {
    /// The plugin's name, for its log lines and counters.
    pub plugin: Arc<str>,
    /// A WASI context with no files, environment, arguments or network;
    /// stdout and stderr go to the log.
    wasi: WasiCtx,
    table: ResourceTable,
    /// Memory cap for this instance.
    pub limits: MemoryCap,
    /// The current call's deadline.
    pub deadline: CpuDeadline,
    /// What the current request's head and route are made from, moved in
    /// for the length of a call (no copy); the records are built only if
    /// the plugin asks.
    pub request: Option<RequestFacts>,
    /// The config's route names by index.
    route_names: Arc<[Arc<str>]>,
    /// The route of a use on a route (`None`: the global chain).
    route: Option<Arc<str>>,
    /// The current request's headers, likewise.
    pub request_headers: http::HeaderMap,
    /// The current response's headers, likewise, during `on-response`.
    pub response_headers: http::HeaderMap,
}

impl State {
    /// State for an instance of `plugin` capped at `memory` bytes, each
    /// call at `timeout` of CPU time; `peak` is raised to the largest
    /// memory the instance reaches.
    pub fn new(
        plugin: Arc<str>,
        memory: usize,
        timeout: std::time::Duration,
        (route_names, route): (Arc<[Arc<str>]>, Option<Arc<str>>),
        peak: Arc<AtomicUsize>,
    ) -> State {
        State {
            wasi: WasiCtx::builder()
                .stdout(PluginOutput::stdout(plugin.clone()))
                .stderr(PluginOutput::stderr(plugin.clone()))
                // No network at all (the socket address check, which
                // refuses every address by default, is never reached).
                .allow_tcp(false)
                .allow_udp(false)
                .allow_ip_name_lookup(false)
                .build(),
            plugin,
            table: handle_table(),
            limits: MemoryCap::new(memory, peak),
            deadline: CpuDeadline::new(timeout),
            request: None,
            route_names,
            route,
            request_headers: http::HeaderMap::new(),
            response_headers: http::HeaderMap::new(),
        }
    }
}

/// The most host handles (streams, pollables, sockets refused, ...) one
/// instance may hold at once. Each is an entry in host memory, outside
/// the instance's memory cap; wasmtime's default (a million) would let
/// one plugin that never gives them back grow the proxy by tens of
/// megabytes per instance. A plugin needs a handful at a time; past this
/// the call that asks for more traps, and the instance is replaced.
const MAX_HANDLES: usize = 1024;

fn handle_table() -> ResourceTable {
    let mut table = ResourceTable::new();
    table.set_max_capacity(MAX_HANDLES);
    table
}

impl WasiView for State {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

/// Refuses memory growth past `max`, and remembers that it did so a trap
/// that follows can be reported as memory exhaustion.
pub struct MemoryCap {
    max: usize,
    /// Growth was refused at least once.
    pub hit: bool,
    /// The largest size a memory of the instance has grown to.
    peak: usize,
    /// The largest single growth since the instance began serving (its
    /// image and `configure` not counted).
    step: usize,
    /// Counting `step`: set once the instance is configured.
    pub serving: bool,
    /// The largest size any instance of the binding has reached (for
    /// `/metrics`): raised on growth only, which is rare, so calls pay
    /// nothing for it.
    shared_peak: Arc<AtomicUsize>,
}

impl MemoryCap {
    /// A cap of `max` bytes; `shared_peak` is raised to the largest size
    /// reached.
    pub fn new(max: usize, shared_peak: Arc<AtomicUsize>) -> MemoryCap {
        MemoryCap {
            max,
            hit: false,
            peak: 0,
            step: 0,
            serving: false,
            shared_peak,
        }
    }

    /// Whether the instance is too near its cap to be reused: less room
    /// left than two of its largest growths while serving. Runtimes with
    /// a garbage collector (SpiderMonkey, as componentize-js builds it)
    /// grow their heap call after call, in steps, and collect late;
    /// reused, such an instance would sooner or later run out in the
    /// middle of a request, which then fails. A fresh instance costs an
    /// instantiation, once in thousands of calls. An instance that does
    /// not grow while serving (CPython counts references; most Rust
    /// plugins) is never replaced, however near its cap its image is.
    pub fn cramped(&self) -> bool {
        self.max.saturating_sub(self.peak) < self.step.saturating_mul(2)
    }
}

impl wasmtime::ResourceLimiter for MemoryCap {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.max {
            self.hit = true;
            return Ok(false);
        }
        if self.serving {
            self.step = self.step.max(desired.saturating_sub(current));
        }
        if desired > self.peak {
            self.peak = desired;
            self.shared_peak.fetch_max(desired, Ordering::Relaxed);
        }
        Ok(true)
    }

    fn table_growing(
        &mut self,
        _current: usize,
        desired: usize,
        _maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        Ok(desired <= 100_000)
    }
}

impl host::Host for State {
    fn log(&mut self, level: Level, message: String) {
        if !crate::containment::may_log(&self.plugin) {
            return;
        }
        let plugin = &*self.plugin;
        // Bounded, so a plugin cannot flood the log with one call.
        let message = crate::containment::log_line(&message);
        match level {
            Level::Trace => tracing::trace!(target: "plugin", plugin, "{message}"),
            Level::Debug => tracing::debug!(target: "plugin", plugin, "{message}"),
            Level::Info => tracing::info!(target: "plugin", plugin, "{message}"),
            Level::Warn => tracing::warn!(target: "plugin", plugin, "{message}"),
            Level::Error => tracing::error!(target: "plugin", plugin, "{message}"),
        }
    }

    fn now_unix_ms(&mut self) -> u64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
    }

    fn current_request(&mut self) -> RequestHead {
        match &self.request {
            Some(facts) => facts.head(&self.request_headers),
            None => super::empty_head(),
        }
    }

    fn current_route(&mut self) -> RouteInfo {
        match &self.request {
            Some(facts) => facts.route_info(self.route.as_ref(), &self.route_names),
            None => super::empty_route(),
        }
    }

    fn client_certificate(&mut self) -> Option<super::bindings::Certificate> {
        let cert = self.request.as_ref()?.client_cert.as_deref()?;
        let id = &cert.identity;
        Some(super::bindings::Certificate {
            sha256: cert.sha256.clone(),
            subject: id.subject.clone(),
            dns_names: id.dns_names.clone(),
            uris: id.uris.clone(),
            emails: id.emails.clone(),
            ip_addresses: id.ip_addresses.clone(),
            der: cert.der.to_vec(),
        })
    }

    // The linker serves these two through `header_call`'s shortcuts; these
    // are the bindings' plain versions, which the trait requires.
    fn request_header(&mut self, name: String) -> Option<Vec<u8>> {
        first(&self.request_headers, &name)
    }

    fn request_headers(&mut self) -> Vec<super::bindings::Header> {
        super::to_wit_headers(&self.request_headers)
    }

    fn response_header(&mut self, name: String) -> Option<Vec<u8>> {
        first(&self.response_headers, &name)
    }

    fn response_headers(&mut self) -> Vec<super::bindings::Header> {
        super::to_wit_headers(&self.response_headers)
    }

    fn count(&mut self, name: String, delta: u64) {
        // A plugin may not make unbounded numbers of counters.
        crate::containment::counters()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .add_own(&self.plugin, &name, delta);
    }
}

impl super::bindings::portcullis::policy::types::Host for State {}

fn first(headers: &http::HeaderMap, name: &str) -> Option<Vec<u8>> {
    // Looking up by &str parses (and lower-cases) the name; no allocation.
    headers.get(name).map(|v| v.as_bytes().to_vec())
}
