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

mod bindings;
mod cpu_deadline;
mod disk_cache;
mod file_kind;
mod header_call;
mod lift;
pub mod offload;
mod state;
mod stdio;
mod wasi;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use wasmtime::component::{Component, Func, HasSelf, Linker, TypedFunc};
use wasmtime::{Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store};

pub use bindings::{
    Decision, Forward, Header, HeaderEdits, Hooks, LocalResponse, RequestHead, ResponseHead,
    RouteInfo,
};
use bindings::{Policy, PolicyPre};
use lift::Lifted;
pub use offload::Lost;
use state::State;
pub use state::counters;

use portcullis_config::{Config, ConfigError, ConfigErrors, FailMode, PluginModule, PluginUse};
use portcullis_net::shard::{SHARDS, this_thread as shard};

/// How often the epoch advances; deadlines are whole ticks.
const TICK: Duration = Duration::from_millis(1);
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
    #[error("plugin `{plugin}` timed out after {timeout:?}")]
    Timeout {
        /// Plugin name.
        plugin: Arc<str>,
        /// The deadline.
        timeout: Duration,
    },
    /// The instance tried to grow its memory past the cap.
    #[error("plugin `{plugin}` ran out of memory (cap {cap} bytes)")]
    OutOfMemory {
        /// Plugin name.
        plugin: Arc<str>,
        /// The cap.
        cap: usize,
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

/// The process's plugin engine: compiler, linker and compile cache.
pub struct PluginHost {
    engine: Engine,
    linker: Linker<State>,
    compiled: Mutex<HashMap<[u8; 32], Component>>,
    /// Compiled code kept across restarts (`--plugin-cache`).
    disk: Option<disk_cache::DiskCache>,
    /// The modules of the configuration before the active one (none at
    /// start), whose files the disk cache keeps.
    previous: Mutex<Vec<[u8; 32]>>,
    /// Modules loaded from the disk cache, compiled, and found in it but
    /// refused (damaged, another user's, another module's).
    cache_outcomes: [std::sync::atomic::AtomicU64; 3],
}

/// How the disk cache served each module compiled since start: loaded,
/// compiled (not there, or no cache), refused (there, but not loaded);
/// `None` without `--plugin-cache` or before the first plugin.
pub fn disk_cache_outcomes() -> Option<[u64; 3]> {
    let host = HOST.get()?.as_ref().ok()?;
    host.disk.as_ref()?;
    Some(
        host.cache_outcomes
            .each_ref()
            .map(|n| n.load(std::sync::atomic::Ordering::Relaxed)),
    )
}

/// Indexes into `cache_outcomes`.
const LOADED: usize = 0;
const COMPILED: usize = 1;
const REFUSED: usize = 2;

static HOST: OnceLock<Result<PluginHost, String>> = OnceLock::new();
/// Where compiled plugins are kept on disk, when the operator said.
static DISK_CACHE: OnceLock<std::path::PathBuf> = OnceLock::new();

/// Keeps compiled plugins in `dir` across restarts (`--plugin-cache`).
/// Call before the first plugin is compiled; later calls change nothing.
pub fn use_disk_cache(dir: std::path::PathBuf) {
    let _ = DISK_CACHE.set(dir);
}

/// Drops compiled modules the active `config` no longer uses, so a proxy
/// reloaded with new plugin versions many times does not keep every
/// version's machine code. On disk, the modules of the configuration
/// before stay too: rolling a bad plugin version back (the usual next
/// reload) then loads its code instead of compiling it.
pub fn forget_unused(config: &Config) {
    // Policies without plugins never start the engine; a cache a run
    // with plugins filled is emptied all the same.
    if HOST.get().is_none()
        && config.plugins.is_empty()
        && let Some(dir) = DISK_CACHE.get()
    {
        let removed = disk_cache::clear(dir);
        if removed > 0 {
            tracing::info!(
                dir = %dir.display(),
                removed,
                "removed compiled plugins no policy uses from the plugin cache"
            );
        }
        return;
    }
    if let Some(Ok(host)) = HOST.get() {
        host.compiled
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|hash, _| config.plugins.iter().any(|m| &m.sha256 == hash));
        if let Some(disk) = &host.disk {
            let current: Vec<[u8; 32]> = config.plugins.iter().map(|m| m.sha256).collect();
            let mut previous = host.previous.lock().unwrap_or_else(|p| p.into_inner());
            let keep: Vec<[u8; 32]> = current.iter().chain(previous.iter()).copied().collect();
            *previous = current;
            drop(previous);
            let removed = disk.retain(&keep);
            if removed > 0 {
                tracing::info!(
                    dir = %disk.dir().display(),
                    removed,
                    "removed compiled plugins no policy uses from the plugin cache"
                );
            }
        }
    }
}

/// Whether this process's address space is capped (`ulimit -v`).
fn address_space_limited() -> bool {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit only writes the struct it is given.
    let read = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut limit) };
    read != 0 || limit.rlim_cur != libc::RLIM_INFINITY
}

/// The process-wide host, made on first use (a proxy without plugins never
/// reserves the pool's address space or starts the epoch ticker).
pub fn host() -> Result<&'static PluginHost, String> {
    HOST.get_or_init(|| {
        PluginHost::new().map_err(|e| format!("cannot start the WebAssembly engine: {e:#}"))
    })
    .as_ref()
    .map_err(Clone::clone)
}

impl PluginHost {
    /// `wasm` (a component) compiled as this host compiles it, serialized
    /// with its symbol table: the machine code the proxy runs, with names,
    /// for mapping a profile of plugin code (bench/guest-profile.sh).
    pub fn precompile(&self, wasm: &[u8]) -> wasmtime::Result<Vec<u8>> {
        self.engine.precompile_component(wasm)
    }

    fn new() -> wasmtime::Result<PluginHost> {
        let mut pool = PoolingAllocationConfig::default();
        pool.total_component_instances(POOL_SLOTS)
            .total_core_instances(POOL_SLOTS * 4)
            .total_memories(POOL_SLOTS)
            .total_tables(POOL_SLOTS * 4)
            .max_memory_size(portcullis_config::MAX_PLUGIN_MEMORY)
            // Keep the start of reused memories and tables mapped (zeroed
            // by memset on release) rather than decommitted, saving the next
            // instance page faults there. Only 64 KiB: a Rust guest's first
            // MiB is mostly its unused shadow stack, and zeroing all of it
            // on every release cost more than the faults it saved (a new
            // instance per request: 7.9k -> 10.4k req/s with jwt-auth).
            .linear_memory_keep_resident(64 << 10)
            .table_keep_resident(64 << 10);
        let mut config = wasmtime::Config::new();
        config
            .epoch_interruption(true)
            // Plugins are small policies, not programs with deep recursion.
            // Calls are synchronous and run on the worker's own stack: no
            // fiber to switch to per call, and the epoch deadline bounds
            // how long one can hold the thread.
            .max_wasm_stack(512 << 10)
            .wasm_component_model(true)
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool))
            .memory_reservation(RESERVATION)
            .memory_guard_size(GUARD);
        let engine = match Engine::new(&config) {
            Ok(engine) => engine,
            // The pool reserves its address space up front (POOL_SLOTS
            // full reservations). Where that is refused (an address-space
            // rlimit, valgrind), plugins still run: instances are allocated
            // on demand, which costs more to create but the same per call,
            // as idle instances are reused.
            Err(e) => {
                config.allocation_strategy(InstanceAllocationStrategy::OnDemand);
                // Under an rlimit, 4 GiB per instance would run out after
                // a few instances: reserve only what the largest cap needs
                // and let bounds checks stand in for the guard.
                let limited = address_space_limited();
                if limited {
                    config
                        .memory_reservation(portcullis_config::MAX_PLUGIN_MEMORY as u64)
                        .memory_guard_size(64 << 10);
                }
                tracing::warn!(
                    error = format!("{e:#}"),
                    bounds_checked = limited,
                    "cannot reserve the plugin instance pool; allocating plugin instances on demand"
                );
                Engine::new(&config)?
            }
        };
        let mut linker = Linker::new(&engine);
        wasi::add_to_linker(&mut linker)?;
        Policy::add_to_linker::<State, HasSelf<State>>(&mut linker, |s| s)?;
        header_call::add_to_linker(&mut linker)?;
        let ticker = engine.weak();
        std::thread::Builder::new()
            .name("portcullis-wasm-epoch".into())
            .spawn(move || {
                while let Some(engine) = ticker.upgrade() {
                    engine.increment_epoch();
                    drop(engine);
                    std::thread::sleep(TICK);
                }
            })?;
        // A cache that cannot be used is no reason not to serve: plugins
        // are compiled as without one, and the log says why.
        let disk = DISK_CACHE.get().and_then(|dir| {
            disk_cache::DiskCache::open(dir, &engine)
                .inspect_err(|e| {
                    tracing::warn!(error = %e, "not using the plugin cache; compiling plugins at each start")
                })
                .ok()
        });
        Ok(PluginHost {
            engine,
            linker,
            compiled: Mutex::new(HashMap::new()),
            disk,
            previous: Mutex::new(Vec::new()),
            cache_outcomes: Default::default(),
        })
    }

    /// The compiled component of a module (compiled at most once per hash).
    /// Blocking: call from a blocking thread.
    fn compile(&self, module: &PluginModule) -> Result<Component, String> {
        if let Some(c) = self
            .compiled
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&module.sha256)
        {
            return Ok(c.clone());
        }
        let component = match self.cached(module) {
            Some(component) => component,
            None => {
                self.count(COMPILED);
                self.compile_and_keep(module)?
            }
        };
        self.compiled
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(module.sha256, component.clone());
        Ok(component)
    }

    fn count(&self, outcome: usize) {
        self.cache_outcomes[outcome].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The module's compiled code from the disk cache, if there is one and
    /// it holds a sound file for the module.
    fn cached(&self, module: &PluginModule) -> Option<Component> {
        let disk = self.disk.as_ref()?;
        let started = std::time::Instant::now();
        match disk.load(&self.engine, &module.sha256) {
            Ok(Some(component)) => {
                tracing::info!(
                    plugin = %module.path.display(),
                    ms = started.elapsed().as_millis() as u64,
                    "plugin loaded from the plugin cache"
                );
                self.count(LOADED);
                Some(component)
            }
            Ok(None) => None,
            Err(why) => {
                self.count(REFUSED);
                tracing::warn!(
                    plugin = %module.path.display(),
                    error = %why,
                    "not using the cached compiled plugin; compiling it again"
                );
                None
            }
        }
    }

    /// Compiles the module, and keeps the code in the disk cache if there
    /// is one.
    fn compile_and_keep(&self, module: &PluginModule) -> Result<Component, String> {
        let started = std::time::Instant::now();
        let component = Component::new(&self.engine, &module.bytes).map_err(|e| {
            format!(
                "plugin {}: {}",
                module.path.display(),
                file_kind::explain(&module.bytes, &e)
            )
        })?;
        let ms = started.elapsed().as_millis() as u64;
        match self
            .disk
            .as_ref()
            .map(|d| d.store(&module.sha256, &component))
        {
            None => tracing::info!(plugin = %module.path.display(), ms, "plugin compiled"),
            Some(Ok(file)) => tracing::info!(
                plugin = %module.path.display(),
                ms,
                file = %file.display(),
                "plugin compiled and kept in the plugin cache"
            ),
            Some(Err(why)) => tracing::warn!(
                plugin = %module.path.display(),
                ms,
                error = %why,
                "plugin compiled; cannot keep it in the plugin cache"
            ),
        }
        Ok(component)
    }
}

/// One live plugin instance, kept boxed: checked out and back in on every
/// call, it moves as a pointer rather than as ~100 bytes copied by
/// `memcpy` three times a call.
struct Instance {
    store: Store<State>,
    policy: Policy,
    /// The `on-request` export, type-checked at instantiation as
    /// [`OnRequest`].
    on_request: Func,
}

/// `on-request`, its result lifted through [`lift`]'s shortcut.
type OnRequest<'a> = TypedFunc<(Option<&'a [u8]>,), (Lifted,)>;

/// A plugin attached with one config: instantiates on demand, keeps idle
/// instances, and applies the deadline and memory cap to every call.
pub struct Binding {
    /// The plugin's name.
    pub plugin: Arc<str>,
    /// Failure policy.
    pub fail: FailMode,
    /// Which calls the plugin wants.
    pub hooks: Hooks,
    pre: PolicyPre<State>,
    engine: Engine,
    config_json: String,
    timeout: Duration,
    memory: usize,
    fresh: bool,
    idle: [Shard; SHARDS],
    /// The config's route names by index, for `current-route`.
    route_names: Arc<[Arc<str>]>,
    /// The route the binding is on; `None` for the global chain.
    route: Option<Arc<str>>,
    /// The largest memory any of its instances has reached, in bytes.
    memory_peak: Arc<std::sync::atomic::AtomicUsize>,
}

impl std::fmt::Debug for Binding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Binding")
            .field("plugin", &self.plugin)
            .finish_non_exhaustive()
    }
}

impl Binding {
    /// The calls made to this plugin use (both hooks) since its
    /// configuration was loaded.
    pub fn calls(&self) -> u64 {
        self.idle
            .iter()
            .map(|s| s.calls.load(std::sync::atomic::Ordering::Relaxed))
            .sum()
    }

    /// The route the binding is on (`None`: the global chain), the
    /// largest memory one of its instances has reached (its image and
    /// `configure` included), and its cap, in bytes.
    pub fn memory_use(&self) -> (Option<&str>, usize, usize) {
        (
            self.route.as_deref(),
            self.memory_peak.load(std::sync::atomic::Ordering::Relaxed),
            self.memory,
        )
    }

    /// Starts a call's deadline ([`cpu_deadline`]: the call's first tick
    /// reads its thread's CPU clock, later ones only if it runs on).
    fn arm(store: &mut Store<State>) {
        store.set_epoch_deadline(1);
        store.data_mut().deadline.arm();
    }

    fn classify(&self, e: wasmtime::Error, store: &Store<State>) -> PluginError {
        let plugin = self.plugin.clone();
        if matches!(
            e.downcast_ref::<wasmtime::Trap>(),
            Some(wasmtime::Trap::Interrupt)
        ) {
            return PluginError::Timeout {
                plugin,
                timeout: self.timeout,
            };
        }
        if store.data().limits.hit {
            return PluginError::OutOfMemory {
                plugin,
                cap: self.memory,
            };
        }
        PluginError::Trap {
            plugin,
            // The root cause says what happened ("wasm `unreachable`
            // instruction executed"); the outer layers only that a call failed.
            message: e.root_cause().to_string(),
        }
    }

    fn instantiate(&self) -> Result<Box<Instance>, PluginError> {
        let setup = |message: String| PluginError::Setup {
            plugin: self.plugin.clone(),
            message,
        };
        let mut store = Store::new(
            &self.engine,
            State::new(
                self.plugin.clone(),
                self.memory,
                self.timeout,
                self.route_names.clone(),
                self.memory_peak.clone(),
            ),
        );
        store.limiter(|s| &mut s.limits);
        store.epoch_deadline_callback(|mut s| Ok(s.data_mut().deadline.on_tick()));
        Self::arm(&mut store);
        let instance = self
            .pre
            .instance_pre()
            .instantiate(&mut store)
            .map_err(|e| setup(format!("{e:#}")))?;
        let policy = Policy::new(&mut store, &instance).map_err(|e| setup(format!("{e:#}")))?;
        let on_request = *instance
            .get_typed_func::<(Option<&[u8]>,), (Lifted,)>(&mut store, "on-request")
            .map_err(|e| setup(format!("{e:#}")))?
            .func();
        Self::arm(&mut store);
        let configured = policy.call_configure(&mut store, &self.config_json);
        store.data_mut().limits.serving = true;
        match configured {
            Ok(Ok(())) => Ok(Box::new(Instance {
                store,
                policy,
                on_request,
            })),
            Ok(Err(message)) => Err(setup(format!("config refused: {message}"))),
            Err(e) => Err(self.classify(e, &store)),
        }
    }

    fn checkout(&self) -> Result<Box<Instance>, PluginError> {
        let slot = &self.idle[shard()];
        slot.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let idle = slot.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match idle {
            Some(i) => Ok(i),
            None => self.instantiate(),
        }
    }

    fn checkin(&self, instance: Box<Instance>) {
        if self.fresh {
            return;
        }
        if instance.store.data().limits.cramped() {
            tracing::debug!(plugin = %self.plugin, memory = self.memory, "plugin instance near its memory cap; a fresh one takes its place");
            *state::counters()
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .entry((self.plugin.clone(), "recycled".into()))
                .or_default() += 1;
            return;
        }
        let mut idle = self.idle[shard()].lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < MAX_IDLE {
            idle.push(instance);
        }
    }

    /// Calls `on-request`. The request's facts and headers are lent to the
    /// instance for the call (moved in and back, not copied); the plugin
    /// reads through host calls only what it needs, and the request head
    /// and route records are built only if it asks, so a header-only check
    /// pays for one header. A failed instance is dropped, not reused.
    pub fn on_request(
        &self,
        req: &mut Option<RequestFacts>,
        headers: &mut http::HeaderMap,
        body: Option<&[u8]>,
    ) -> Result<Decision, PluginError> {
        let mut inst = self.checkout()?;
        Self::arm(&mut inst.store);
        // The header map is swapped in and back (between calls the store
        // holds an empty one; a swap neither makes nor drops one). The
        // facts are moved: a swap of their ~250 bytes went word by word
        // in a loop, where a move is one copy and leaves a `None` to drop.
        let data = inst.store.data_mut();
        data.request = req.take();
        std::mem::swap(&mut data.request_headers, headers);
        // SAFETY: `on_request` was type-checked as `OnRequest` when the
        // instance was made.
        let on_request = unsafe { OnRequest::new_unchecked(inst.on_request) };
        let result = on_request
            .call(&mut inst.store, (body,))
            .map(|(Lifted(decision),)| decision);
        let data = inst.store.data_mut();
        std::mem::swap(&mut data.request_headers, headers);
        *req = data.request.take();
        match result {
            Ok(d) => {
                self.checkin(inst);
                Ok(d)
            }
            Err(e) => Err(self.classify(e, &inst.store)),
        }
    }

    /// Calls `on-response`, lending the request (facts, headers) and the
    /// response's headers to the instance for the call.
    pub fn on_response(
        &self,
        req: &mut Option<RequestFacts>,
        req_headers: &mut http::HeaderMap,
        resp: ResponseHead,
        resp_headers: &mut http::HeaderMap,
    ) -> Result<HeaderEdits, PluginError> {
        let mut inst = self.checkout()?;
        Self::arm(&mut inst.store);
        let data = inst.store.data_mut();
        data.request = req.take();
        std::mem::swap(&mut data.request_headers, req_headers);
        std::mem::swap(&mut data.response_headers, resp_headers);
        let result = inst.policy.call_on_response(&mut inst.store, resp);
        let data = inst.store.data_mut();
        std::mem::swap(&mut data.request_headers, req_headers);
        std::mem::swap(&mut data.response_headers, resp_headers);
        *req = data.request.take();
        match result {
            Ok(edits) => {
                self.checkin(inst);
                Ok(edits)
            }
            Err(e) => Err(self.classify(e, &inst.store)),
        }
    }
}

/// A request head with nothing in it (no allocation).
pub fn empty_head() -> RequestHead {
    RequestHead {
        method: String::new(),
        scheme: String::new(),
        authority: String::new(),
        path: String::new(),
        query: None,
        client_addr: String::new(),
        tls: false,
        sni: None,
    }
}

/// Route info with nothing in it (no allocation).
pub fn empty_route() -> RouteInfo {
    RouteInfo {
        name: String::new(),
        params: Vec::new(),
    }
}

/// Every route's plugin chain (global plugins first), ready to call.
#[derive(Debug, Default, Clone)]
pub struct Chains {
    /// By route index.
    pub routes: Vec<Arc<[Arc<Binding>]>>,
}

/// Compiles every plugin the config uses, instantiates each use once and
/// asks the plugin to validate its config. Errors name the plugin, the
/// route and the place in the policy files.
pub async fn prepare(config: &Config) -> Result<Chains, ConfigErrors> {
    if config.plugins.is_empty() {
        return Ok(Chains {
            routes: config
                .routes
                .iter()
                .map(|_| Arc::from(Vec::new()))
                .collect(),
        });
    }
    let fail_at = |pos: &portcullis_config::Pos, message: String| {
        ConfigErrors(vec![ConfigError {
            pos: pos.clone(),
            message,
        }])
    };
    let host = host().map_err(|e| fail_at(&config.plugins[0].defined_at, e))?;

    // Compile (CPU-heavy) off the async workers.
    let modules = config.plugins.clone();
    let compiled = tokio::task::spawn_blocking(move || {
        modules
            .iter()
            .map(|m| {
                host.compile(m).and_then(|c| {
                    // A plugin importing more than the plugin WASI set
                    // (files, sockets) is refused here, naming the import.
                    host.linker
                        .instantiate_pre(&c)
                        .map_err(|e| format!("{} cannot be linked: {e:#}", m.path.display()))
                })
            })
            .collect::<Vec<_>>()
    })
    .await
    .map_err(|e| {
        fail_at(
            &config.plugins[0].defined_at,
            format!("plugin compilation crashed: {e}"),
        )
    })?;
    let mut errors = Vec::new();
    let mut pres = Vec::with_capacity(compiled.len());
    for (module, result) in config.plugins.iter().zip(compiled) {
        match result.and_then(|pre| {
            PolicyPre::new(pre).map_err(|e| {
                format!(
                    "{} does not export the portcullis:policy world: {e:#}",
                    module.path.display()
                )
            })
        }) {
            Ok(pre) => pres.push(Some(pre)),
            Err(message) => {
                errors.push(ConfigError {
                    pos: module.defined_at.clone(),
                    message,
                });
                pres.push(None);
            }
        }
    }
    // Uses of modules that failed to compile are skipped (their error is
    // reported); the others are still checked, so one run lists all.
    let route_names: Arc<[Arc<str>]> = config.routes.iter().map(|r| r.name.clone()).collect();
    let bind = |u: &PluginUse, route: Option<&str>| {
        let module = &config.plugins[u.plugin];
        let pre = pres[u.plugin].clone();
        let engine = host.engine.clone();
        let u = u.clone();
        let name = module.name.clone();
        let route_names = route_names.clone();
        let on = route.map_or_else(|| "the global chain".to_owned(), |r| format!("route `{r}`"));
        let route: Option<Arc<str>> = route.map(Arc::from);
        async move {
            let Some(pre) = pre else { return Ok(None) };
            let mut binding = Binding {
                plugin: name.clone(),
                fail: u.fail,
                hooks: Hooks::empty(),
                pre,
                engine,
                config_json: u.config_json.clone(),
                timeout: u.timeout,
                memory: u.memory,
                fresh: u.fresh_instances,
                idle: std::array::from_fn(|_| Shard::default()),
                route_names,
                route,
                memory_peak: Default::default(),
            };
            let at = |message: String| ConfigError {
                pos: u.defined_at.clone(),
                message: format!("plugin `{name}` on {on}: {message}"),
            };
            // Instantiating runs the plugin's start-up and `configure`,
            // which validates the config; a plugin that cannot start is
            // refused here rather than on the first request.
            let mut inst = match binding.instantiate() {
                Ok(i) => i,
                Err(PluginError::Setup { message, .. }) => return Err(at(message)),
                Err(e) => return Err(at(e.to_string())),
            };
            Binding::arm(&mut inst.store);
            match inst
                .policy
                .call_validate_config(&mut inst.store, &u.config_json)
            {
                Ok(Ok(())) => {}
                Ok(Err(m)) => return Err(at(format!("invalid config: {m}"))),
                Err(e) => return Err(at(binding.classify(e, &inst.store).to_string())),
            }
            Binding::arm(&mut inst.store);
            binding.hooks = match inst.policy.call_hooks(&mut inst.store) {
                Ok(h) => h,
                Err(e) => return Err(at(binding.classify(e, &inst.store).to_string())),
            };
            // Not kept: idle instances are per thread, and this is not a
            // worker's; kept, it would hold a pool slot for nothing.
            drop(inst);
            Ok(Some(Arc::new(binding)))
        }
    };

    let mut global = Vec::new();
    for u in &config.global_plugins {
        match bind(u, None).await {
            Ok(Some(b)) => global.push(b),
            Ok(None) => {}
            Err(e) => errors.push(e),
        }
    }
    let mut routes = Vec::with_capacity(config.routes.len());
    for route in &config.routes {
        let mut chain = global.clone();
        for u in &route.plugins {
            match bind(u, Some(&route.name)).await {
                Ok(Some(b)) => chain.push(b),
                Ok(None) => {}
                Err(e) => errors.push(e),
            }
        }
        routes.push(Arc::from(chain));
    }
    if errors.is_empty() {
        Ok(Chains { routes })
    } else {
        Err(ConfigErrors(errors))
    }
}

/// What a plugin's view of the request is made from. The WIT records
/// (`request-head`, `route-info`, six strings and a list) are built from
/// these only when a plugin asks for them, which most header checks never do.
#[derive(Debug, Clone)]
pub struct RequestFacts {
    /// Method.
    pub method: http::Method,
    /// The request target as received (a clone shares its bytes).
    pub uri: http::Uri,
    /// The normalized path, when it differs from the target's.
    pub normalized: Option<String>,
    /// The path and query a plugin set; later plugins see it.
    pub rewritten: Option<http::uri::PathAndQuery>,
    /// The client's address.
    pub client: std::net::IpAddr,
    /// Whether the client connection is TLS.
    pub tls: bool,
    /// The server name the client asked for in its TLS handshake.
    pub sni: Option<std::sync::Arc<str>>,
    /// The client's verified certificate (mutual TLS).
    pub client_cert: Option<Arc<portcullis_net::client_cert::ClientCertificate>>,
    /// The route's index in the config.
    pub route: usize,
    /// The route's path parameters (empty for routes without any).
    pub params: Vec<(String, String)>,
}

impl RequestFacts {
    /// The request head as plugins see it; `headers` supplies the host
    /// when the target has no authority (HTTP/1.1 origin form).
    pub fn head(&self, headers: &http::HeaderMap) -> RequestHead {
        let authority = self
            .uri
            .authority()
            .map(|a| a.as_str().to_owned())
            .or_else(|| {
                headers
                    .get(http::header::HOST)
                    .and_then(|h| h.to_str().ok())
                    .map(str::to_owned)
            })
            .unwrap_or_default();
        let (path, query) = match &self.rewritten {
            Some(pq) => (pq.path(), pq.query()),
            None => (
                self.normalized.as_deref().unwrap_or(self.uri.path()),
                self.uri.query(),
            ),
        };
        RequestHead {
            method: self.method.as_str().to_owned(),
            scheme: if self.tls { "https" } else { "http" }.to_owned(),
            authority,
            path: path.to_owned(),
            query: query.map(str::to_owned),
            client_addr: self.client.to_canonical().to_string(),
            tls: self.tls,
            sni: self.sni.as_deref().map(str::to_owned),
        }
    }

    /// The route as plugins see it.
    pub fn route_info(&self, names: &[Arc<str>]) -> RouteInfo {
        RouteInfo {
            name: names
                .get(self.route)
                .map_or_else(String::new, |n| n.to_string()),
            params: self.params.clone(),
        }
    }
}

/// Headers in the plugin's form.
pub fn to_wit_headers(headers: &http::HeaderMap) -> Vec<Header> {
    headers
        .iter()
        .map(|(k, v)| Header {
            name: k.as_str().to_owned(),
            value: v.as_bytes().to_vec(),
        })
        .collect()
}

/// Applies a plugin's header edits; invalid names or values are skipped
/// and reported.
pub fn apply_edits(headers: &mut http::HeaderMap, edits: &HeaderEdits, plugin: &str) {
    use http::{HeaderName, HeaderValue};
    for name in &edits.remove {
        if let Ok(n) = HeaderName::from_bytes(name.as_bytes()) {
            headers.remove(n);
        }
    }
    let valid = |h: &Header| match (
        HeaderName::from_bytes(h.name.as_bytes()),
        HeaderValue::from_bytes(&h.value),
    ) {
        (Ok(n), Ok(v)) => Some((n, v)),
        _ => {
            tracing::warn!(plugin, header = %h.name, "plugin set an invalid header; skipped");
            None
        }
    };
    for h in &edits.set {
        if let Some((n, v)) = valid(h) {
            headers.insert(n, v);
        }
    }
    for h in &edits.add {
        if let Some((n, v)) = valid(h) {
            headers.append(n, v);
        }
    }
}

#[cfg(test)]
mod tests;
