//! A component plugin attached with one config: its idle instances per
//! thread, and the calls into it under a deadline and a memory cap
//! (`component.rs` is how the driver sees it).

use super::*;

/// One live plugin instance, kept boxed: checked out and back in on every
/// call, it moves as a pointer rather than as ~100 bytes copied by
/// `memcpy` three times a call.
pub(super) struct Instance {
    pub(super) store: Store<State>,
    pub(super) policy: Policy,
    /// The `on-request` export, type-checked at instantiation as
    /// [`OnRequest`].
    pub(super) on_request: Func,
}

/// `on-request`, its result lifted through [`lift`]'s shortcut.
pub(super) type OnRequest<'a> = TypedFunc<(Option<&'a [u8]>,), (Lifted,)>;

/// A plugin attached with one config: instantiates on demand, keeps idle
/// instances, and applies the deadline and memory cap to every call.
pub struct Binding {
    /// The plugin's name.
    pub plugin: Arc<str>,
    /// Failure policy.
    pub fail: FailMode,
    /// Which calls the plugin wants.
    pub(super) hooks: crate::seam::Hooks,
    pub(super) pre: PolicyPre<State>,
    pub(super) engine: Engine,
    pub(super) config_json: String,
    pub(super) timeout: Duration,
    pub(super) memory: usize,
    pub(super) fresh: bool,
    pub(super) idle: [Shard; SHARDS],
    /// The config's route names by index, for `current-route`.
    pub(super) route_names: Arc<[Arc<str>]>,
    /// The route the binding is on; `None` for the global chain.
    pub(super) route: Option<Arc<str>>,
    /// The largest memory any of its instances has reached, in bytes.
    pub(super) memory_peak: Arc<std::sync::atomic::AtomicUsize>,
}

impl std::fmt::Debug for Binding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Binding")
            .field("plugin", &self.plugin)
            .finish_non_exhaustive()
    }
}

impl Binding {
    /// Starts a call's deadline ([`cpu_deadline`]: the call's first tick
    /// reads its thread's CPU clock, later ones only if it runs on).
    pub(super) fn arm(store: &mut Store<State>) {
        store.set_epoch_deadline(1);
        store.data_mut().deadline.arm();
    }

    pub(super) fn classify(&self, e: wasmtime::Error, store: &Store<State>) -> PluginError {
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

    pub(super) fn instantiate(&self) -> Result<Box<Instance>, PluginError> {
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

    pub(super) fn checkout(&self) -> Result<Box<Instance>, PluginError> {
        let slot = &self.idle[shard()];
        slot.calls
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let idle = slot.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match idle {
            Some(i) => Ok(i),
            None => self.instantiate(),
        }
    }

    pub(super) fn checkin(&self, instance: Box<Instance>) {
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
    pub(super) fn call_on_request(
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
    pub(super) fn call_on_response(
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
