//! The process's one wasmtime engine and its compile caches (in memory, and on disk with `--plugin-cache`).

use super::*;

/// The process's plugin engine: compiler, linker and compile cache.
pub struct PluginHost {
    pub(super) engine: Engine,
    pub(super) linker: Linker<State>,
    pub(super) compiled: Mutex<HashMap<[u8; 32], Component>>,
    /// Compiled proxy-wasm filters (core modules), likewise: a reload that
    /// keeps a filter does not compile it again (a 6.5 MB Go filter takes
    /// ~2 s of CPU to compile).
    pub(super) filters: Mutex<HashMap<[u8; 32], wasmtime::Module>>,
    /// Compiled code kept across restarts (`--plugin-cache`).
    pub(super) disk: Option<disk_cache::DiskCache>,
    /// The modules of the configuration before the active one (none at
    /// start), whose files the disk cache keeps.
    pub(super) previous: Mutex<Vec<[u8; 32]>>,
    /// Modules loaded from the disk cache, compiled, and found in it but
    /// refused (damaged, another user's, another module's).
    pub(super) cache_outcomes: [std::sync::atomic::AtomicU64; 3],
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
pub(super) const LOADED: usize = 0;
pub(super) const COMPILED: usize = 1;
pub(super) const REFUSED: usize = 2;

pub(super) static HOST: OnceLock<Result<PluginHost, String>> = OnceLock::new();
/// Where compiled plugins are kept on disk, when the operator said.
pub(super) static DISK_CACHE: OnceLock<std::path::PathBuf> = OnceLock::new();

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
        host.filters
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
pub(super) fn address_space_limited() -> bool {
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

    pub(super) fn new() -> wasmtime::Result<PluginHost> {
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
        bindings::v0_2::Policy::add_to_linker::<State, HasSelf<State>>(&mut linker, |s| s)?;
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
            filters: Mutex::new(HashMap::new()),
            disk,
            previous: Mutex::new(Vec::new()),
            cache_outcomes: Default::default(),
        })
    }

    /// The compiled component of a module (compiled at most once per hash).
    /// Blocking: call from a blocking thread.
    pub(super) fn compile(&self, module: &PluginModule) -> Result<Component, String> {
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

    /// The compiled filter of a core module (compiled at most once per
    /// hash while a configuration uses it). Blocking: call from a blocking
    /// thread.
    pub(super) fn compile_filter(&self, module: &PluginModule) -> Result<wasmtime::Module, String> {
        let filters = || self.filters.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(compiled) = filters().get(&module.sha256) {
            return Ok(compiled.clone());
        }
        let started = std::time::Instant::now();
        let shown = module.path.display();
        let loaded = self.disk.as_ref().and_then(|disk| {
            match disk.load_module(&self.engine, &module.sha256) {
                Ok(Some(compiled)) => Some(compiled),
                Ok(None) => None,
                Err(why) => {
                    self.count(REFUSED);
                    tracing::warn!(plugin = %shown, error = %why, "not using the cached compiled plugin; compiling it again");
                    None
                }
            }
        });
        let compiled = match loaded {
            Some(compiled) => {
                self.count(LOADED);
                let ms = started.elapsed().as_millis() as u64;
                tracing::info!(plugin = %shown, ms, "plugin loaded from the plugin cache");
                compiled
            }
            None => {
                self.count(COMPILED);
                let compiled = wasmtime::Module::new(&self.engine, &module.bytes)
                    .map_err(|e| format!("plugin {shown}: invalid module: {e:#}"))?;
                let ms = started.elapsed().as_millis() as u64;
                let kept = self
                    .disk
                    .as_ref()
                    .map(|d| d.store_module(&module.sha256, &compiled));
                match kept {
                    None => tracing::info!(plugin = %shown, ms, "plugin compiled"),
                    Some(Ok(file)) => {
                        tracing::info!(plugin = %shown, ms, file = %file.display(), "plugin compiled and kept in the plugin cache")
                    }
                    Some(Err(why)) => {
                        tracing::warn!(plugin = %shown, ms, error = %why, "plugin compiled; cannot keep it in the plugin cache")
                    }
                }
                compiled
            }
        };
        filters().insert(module.sha256, compiled.clone());
        Ok(compiled)
    }

    pub(super) fn count(&self, outcome: usize) {
        self.cache_outcomes[outcome].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// The module's compiled code from the disk cache, if there is one and
    /// it holds a sound file for the module.
    pub(super) fn cached(&self, module: &PluginModule) -> Option<Component> {
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
    pub(super) fn compile_and_keep(&self, module: &PluginModule) -> Result<Component, String> {
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
