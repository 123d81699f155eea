//! A component plugin attached with one config: its idle instances per
//! thread, and the calls into it under a deadline and a memory cap
//! (`component.rs` is how the driver sees it).

use super::*;

/// A component linked and checked against the contract it was built
/// for: 0.3, or 0.2 (`contract_v0_2.rs`).
#[derive(Clone)]
pub(super) enum Pre {
    Now(PolicyPre<State>),
    V0_2(bindings::v0_2::PolicyPre<State>),
}

impl Pre {
    fn instance_pre(&self) -> &wasmtime::component::InstancePre<State> {
        match self {
            Pre::Now(p) => p.instance_pre(),
            Pre::V0_2(p) => p.instance_pre(),
        }
    }
}

/// An instance's exports, by contract.
pub(super) enum Exports {
    Now(Policy),
    V0_2(bindings::v0_2::Policy),
}

impl Exports {
    pub(super) fn configure(
        &self,
        store: &mut Store<State>,
        config: &str,
    ) -> wasmtime::Result<Result<(), String>> {
        match self {
            Exports::Now(p) => p.call_configure(store, config),
            Exports::V0_2(p) => p.call_configure(store, config),
        }
    }

    pub(super) fn validate_config(
        &self,
        store: &mut Store<State>,
        config: &str,
    ) -> wasmtime::Result<Result<(), String>> {
        match self {
            Exports::Now(p) => p.call_validate_config(store, config),
            Exports::V0_2(p) => p.call_validate_config(store, config),
        }
    }

    /// Whether it wants requests, and responses.
    pub(super) fn hooks(&self, store: &mut Store<State>) -> wasmtime::Result<(bool, bool)> {
        use bindings::v0_2::Hooks as Old;
        Ok(match self {
            Exports::Now(p) => {
                let h = p.call_hooks(store)?;
                (
                    h.contains(WitHooks::REQUEST),
                    h.contains(WitHooks::RESPONSE),
                )
            }
            Exports::V0_2(p) => {
                let h = p.call_hooks(store)?;
                (h.contains(Old::REQUEST), h.contains(Old::RESPONSE))
            }
        })
    }
}

/// One live plugin instance, kept boxed: checked out and back in on every
/// call, it moves as a pointer rather than as ~100 bytes copied by
/// `memcpy` three times a call.
pub(super) struct Instance {
    pub(super) store: Store<State>,
    pub(super) policy: Exports,
    /// The `on-request` export, type-checked at instantiation as
    /// [`OnRequest`] of its contract's `decision`.
    pub(super) on_request: Func,
}

/// `on-request`, its result lifted through [`lift`]'s shortcut.
pub(super) type OnRequest<'a, D> = TypedFunc<(Option<&'a [u8]>,), (Lifted<D>,)>;

/// What a call is lent of the response: its head and headers.
pub(super) type ResponseParts<'a> = (ResponseHead, &'a mut http::HeaderMap);

/// A plugin attached with one config: instantiates on demand, keeps idle
/// instances, and applies the deadline and memory cap to every call.
pub struct Binding {
    /// The plugin's name.
    pub plugin: Arc<str>,
    /// Failure policy.
    pub fail: FailMode,
    /// Which calls the plugin wants.
    pub(super) hooks: crate::seam::Hooks,
    pub(super) pre: Pre,
    pub(super) engine: Engine,
    pub(super) config_json: String,
    pub(super) timeout: Duration,
    /// An instance's start's budget (its start-up and `configure`).
    pub(super) start_timeout: Duration,
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

    /// What a failed call into `during` (`on-request`, `configure`...)
    /// was; `configure` is an instance's start, under `start_timeout`.
    pub(super) fn classify(
        &self,
        e: wasmtime::Error,
        store: &Store<State>,
        during: &'static str,
    ) -> PluginError {
        let plugin = self.plugin.clone();
        if matches!(
            e.downcast_ref::<wasmtime::Trap>(),
            Some(wasmtime::Trap::Interrupt)
        ) {
            let (timeout, setting) = match during {
                "configure" => (self.start_timeout, "start_timeout"),
                _ => (self.timeout, "timeout"),
            };
            return PluginError::Timeout {
                plugin,
                timeout,
                during,
                setting,
            };
        }
        if store.data().limits.hit {
            return PluginError::OutOfMemory {
                plugin,
                cap: self.memory,
                during,
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
                self.start_timeout,
                (self.route_names.clone(), self.route.clone()),
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
        let (policy, on_request) = match &self.pre {
            Pre::Now(_) => (
                Exports::Now(
                    Policy::new(&mut store, &instance).map_err(|e| setup(format!("{e:#}")))?,
                ),
                instance
                    .get_typed_func::<(Option<&[u8]>,), (Lifted<Decision>,)>(
                        &mut store,
                        "on-request",
                    )
                    .map(|f| *f.func()),
            ),
            Pre::V0_2(_) => (
                Exports::V0_2(
                    bindings::v0_2::Policy::new(&mut store, &instance)
                        .map_err(|e| setup(format!("{e:#}")))?,
                ),
                instance
                    .get_typed_func::<(Option<&[u8]>,), (Lifted<bindings::v0_2::Decision>,)>(
                        &mut store,
                        "on-request",
                    )
                    .map(|f| *f.func()),
            ),
        };
        let on_request = on_request.map_err(|e| setup(format!("{e:#}")))?;
        Self::arm(&mut store);
        let configured = policy.configure(&mut store, &self.config_json);
        store.data_mut().limits.serving = true;
        // Started: calls from now on have the use's `timeout`.
        store.data_mut().deadline.set_budget(self.timeout);
        match configured {
            Ok(Ok(())) => Ok(Box::new(Instance {
                store,
                policy,
                on_request,
            })),
            Ok(Err(message)) => Err(setup(format!("config refused: {message}"))),
            Err(e) => Err(self.classify(e, &store, "configure")),
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
            crate::containment::count(&self.plugin, "recycled");
            return;
        }
        let mut idle = self.idle[shard()].lock().unwrap_or_else(|p| p.into_inner());
        if idle.len() < MAX_IDLE {
            idle.push(instance);
        }
    }

    /// Runs `call` on an instance lent the request's facts and headers
    /// (moved in and back, not copied), and the response's headers when
    /// given: the plugin reads through host calls only what it needs, and
    /// the request head and route records are built only if it asks, so a
    /// header-only check pays for one header. A failed instance is
    /// dropped, not reused.
    fn lent<R>(
        &self,
        (during, req): (&'static str, &mut Option<RequestFacts>),
        headers: &mut http::HeaderMap,
        mut response: Option<&mut http::HeaderMap>,
        call: impl FnOnce(&mut Instance) -> wasmtime::Result<R>,
    ) -> Result<R, PluginError> {
        let mut inst = self.checkout()?;
        Self::arm(&mut inst.store);
        // Header maps are swapped in and back (between calls the store
        // holds empty ones; a swap neither makes nor drops one). The
        // facts are moved: a swap of their ~250 bytes went word by word
        // in a loop, where a move is one copy and leaves a `None` to drop.
        let data = inst.store.data_mut();
        data.request = req.take();
        std::mem::swap(&mut data.request_headers, headers);
        if let Some(r) = response.as_deref_mut() {
            std::mem::swap(&mut data.response_headers, r);
        }
        let result = call(&mut inst);
        let data = inst.store.data_mut();
        std::mem::swap(&mut data.request_headers, headers);
        if let Some(r) = response {
            std::mem::swap(&mut data.response_headers, r);
        }
        *req = data.request.take();
        match result {
            Ok(r) => {
                self.checkin(inst);
                Ok(r)
            }
            Err(e) => Err(self.classify(e, &inst.store, during)),
        }
    }

    /// Calls `on-request`.
    pub(super) fn call_on_request(
        &self,
        req: &mut Option<RequestFacts>,
        headers: &mut http::HeaderMap,
        body: Option<&[u8]>,
    ) -> Result<Decision, PluginError> {
        self.lent(("on-request", req), headers, None, |inst| {
            match inst.policy {
                Exports::Now(_) => {
                    // SAFETY: `on_request` was type-checked as this
                    // `OnRequest` when the instance was made.
                    let f = unsafe { OnRequest::<Decision>::new_unchecked(inst.on_request) };
                    f.call(&mut inst.store, (body,)).map(|(Lifted(d),)| d)
                }
                Exports::V0_2(_) => {
                    // SAFETY: as above, with 0.2's `decision`.
                    let f = unsafe {
                        OnRequest::<bindings::v0_2::Decision>::new_unchecked(inst.on_request)
                    };
                    let (Lifted(d),) = f.call(&mut inst.store, (body,))?;
                    Ok(crate::contract_v0_2::decision(d))
                }
            }
        })
    }

    /// Calls `on-callout` with what came of the plugin's callout.
    pub(super) fn call_on_callout(
        &self,
        req: &mut Option<RequestFacts>,
        headers: &mut http::HeaderMap,
        result: CalloutResult,
    ) -> Result<Decision, PluginError> {
        self.lent(("on-callout", req), headers, None, |inst| {
            match &inst.policy {
                Exports::Now(p) => p.call_on_callout(&mut inst.store, &result),
                Exports::V0_2(_) => Err(never_asked("on-callout")),
            }
        })
    }

    /// Calls `on-response`, lending the request and the response's headers.
    pub(super) fn call_on_response(
        &self,
        req: &mut Option<RequestFacts>,
        req_headers: &mut http::HeaderMap,
        (head, headers): ResponseParts<'_>,
    ) -> Result<ResponseDecision, PluginError> {
        let during = ("on-response", req);
        self.lent(during, req_headers, Some(headers), |inst| {
            match &inst.policy {
                Exports::Now(p) => p.call_on_response(&mut inst.store, head),
                Exports::V0_2(p) => {
                    let head = bindings::v0_2::ResponseHead {
                        status: head.status,
                    };
                    let edits = p.call_on_response(&mut inst.store, head)?;
                    Ok(ResponseDecision::Forward(crate::contract_v0_2::edits(
                        edits,
                    )))
                }
            }
        })
    }

    /// Calls `on-response-body` with the whole body, lending as
    /// `on-response` does.
    pub(super) fn call_on_response_body(
        &self,
        req: &mut Option<RequestFacts>,
        req_headers: &mut http::HeaderMap,
        (head, headers): ResponseParts<'_>,
        body: &[u8],
    ) -> Result<ResponseBodyDecision, PluginError> {
        let during = ("on-response-body", req);
        self.lent(during, req_headers, Some(headers), |inst| {
            match &inst.policy {
                Exports::Now(p) => p.call_on_response_body(&mut inst.store, head, body),
                Exports::V0_2(_) => Err(never_asked("on-response-body")),
            }
        })
    }
}

/// A call the driver makes only after a decision 0.2 cannot give.
fn never_asked(call: &str) -> wasmtime::Error {
    wasmtime::Error::msg(format!(
        "{call} called on a 0.2 component, which never asks for it"
    ))
}
