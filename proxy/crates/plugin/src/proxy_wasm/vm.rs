//! One VM of a proxy-wasm filter: its start as Envoy runs it
//! (`_initialize` or `_start`, the root context, `proxy_on_vm_start`,
//! `proxy_on_configure`), and the calls of its HTTP contexts, each under
//! the use's deadline and memory cap.

use wasmtime::{Func, Store, TypedFunc, Val};

use super::{Call, ProxyWasm, VmState};
use crate::PluginError;

/// The callbacks that bring a VM the outcome of what it asked for: HTTP
/// and gRPC calls, gRPC streams, Redis calls.
mod answers;
/// The root contexts of the uses a VM serves (one, and a second while a
/// reload that changed a use's config has the old and new both serving).
mod roots;

pub use roots::Root;

/// A context's callouts not yet answered, in the order made.
#[derive(Default)]
pub struct Waiting {
    /// By token; the callout itself until it is handed to the driver.
    pub(super) calls: std::collections::VecDeque<(u32, Option<crate::seam::Callout>)>,
    /// The `:path` the filter set before it paused.
    pub(super) path: Option<String>,
}

/// The first root context's id; HTTP contexts (and later root contexts)
/// count up from the next.
pub(super) const ROOT: i32 = 1;

pub struct Vm {
    store: Store<VmState>,
    pub generation: u64,
    next: u32,
    /// Each HTTP context's callouts not yet answered, and the path it set
    /// before it paused for them.
    pub waiting: std::collections::HashMap<u32, Waiting>,
    /// Its root contexts, one a use it serves, and which one the store
    /// holds the settings of ([`Vm::bind`]).
    roots: Vec<Root>,
    bound: usize,
    /// What of the bound root's is kept here, not in `roots`, so that a
    /// call of the use bound already (every call, but while a reload's
    /// two uses share the VM) touches nothing more than before there
    /// were roots: its use's address, its ticker's period, and the HTTP
    /// calls it made outside requests, not sent yet (sent on its worker
    /// once the call is over: [`super::ProxyWasm::on_home`],
    /// [`super::ProxyWasm::on_vm`]).
    bound_addr: usize,
    bound_context: u32,
    pub ticking: Option<std::time::Duration>,
    unsent: Vec<(u32, crate::seam::Callout)>,
    /// Every export a VM calls, typed, with its parameter count, by
    /// [`Export`] (`None`: not exported): looked up by name once, when the
    /// VM starts, not on every call.
    exports: [Option<(Typed, usize)>; Export::COUNT],
    /// A lent call's box, cleared, for the next call to fill in place:
    /// a fresh one each call cost an allocation and ~800 bytes moved.
    spare: Option<Box<Call>>,
    /// Whether its start is over (its calls then have the use's
    /// `timeout`, not its `start_timeout`).
    started: bool,
    /// How long its first root context's `proxy_on_configure` took.
    pub configure_took: std::time::Duration,
}

/// The exports a VM calls.
#[derive(Debug, Clone, Copy)]
pub enum Export {
    Initialize,
    Start,
    ContextCreate,
    VmStart,
    Configure,
    RequestHeaders,
    ResponseHeaders,
    RequestBody,
    ResponseBody,
    RequestTrailers,
    ResponseTrailers,
    HttpCallResponse,
    GrpcReceive,
    GrpcClose,
    GrpcInitialMetadata,
    GrpcTrailingMetadata,
    RedisCallResponse,
    Tick,
    QueueReady,
    Done,
    Log,
    Delete,
}

impl Export {
    const COUNT: usize = 22;
    const ALL: [Export; Export::COUNT] = [
        Export::Initialize,
        Export::Start,
        Export::ContextCreate,
        Export::VmStart,
        Export::Configure,
        Export::RequestHeaders,
        Export::ResponseHeaders,
        Export::RequestBody,
        Export::ResponseBody,
        Export::RequestTrailers,
        Export::ResponseTrailers,
        Export::HttpCallResponse,
        Export::GrpcReceive,
        Export::GrpcClose,
        Export::GrpcInitialMetadata,
        Export::GrpcTrailingMetadata,
        Export::RedisCallResponse,
        Export::Tick,
        Export::QueueReady,
        Export::Done,
        Export::Log,
        Export::Delete,
    ];

    fn name(self) -> &'static str {
        match self {
            Export::Initialize => "_initialize",
            Export::Start => "_start",
            Export::ContextCreate => "proxy_on_context_create",
            Export::VmStart => "proxy_on_vm_start",
            Export::Configure => "proxy_on_configure",
            Export::RequestHeaders => "proxy_on_request_headers",
            Export::ResponseHeaders => "proxy_on_response_headers",
            Export::RequestBody => "proxy_on_request_body",
            Export::ResponseBody => "proxy_on_response_body",
            Export::RequestTrailers => "proxy_on_request_trailers",
            Export::ResponseTrailers => "proxy_on_response_trailers",
            Export::HttpCallResponse => "proxy_on_http_call_response",
            Export::GrpcReceive => "proxy_on_grpc_receive",
            Export::GrpcClose => "proxy_on_grpc_close",
            Export::GrpcInitialMetadata => "proxy_on_grpc_receive_initial_metadata",
            Export::GrpcTrailingMetadata => "proxy_on_grpc_receive_trailing_metadata",
            Export::RedisCallResponse => "proxy_on_redis_call_response",
            Export::Tick => "proxy_on_tick",
            Export::QueueReady => "proxy_on_queue_ready",
            Export::Done => "proxy_on_done",
            Export::Log => "proxy_on_log",
            Export::Delete => "proxy_on_delete",
        }
    }
}

/// An export, typed by its shape (the ABI's are all of `i32`s): a typed
/// call skips the checks an untyped one makes of every argument, ~2,000
/// instructions a call.
#[derive(Clone)]
enum Typed {
    P0R0(TypedFunc<(), ()>),
    P1R0(TypedFunc<i32, ()>),
    P1R1(TypedFunc<i32, i32>),
    P2R0(TypedFunc<(i32, i32), ()>),
    P2R1(TypedFunc<(i32, i32), i32>),
    P3R1(TypedFunc<(i32, i32, i32), i32>),
    P5R0(TypedFunc<(i32, i32, i32, i32, i32), ()>),
    /// Any other shape, called untyped.
    Other(Func),
}

impl Typed {
    fn of(f: Func, store: &Store<VmState>) -> Typed {
        let typed = |t: Option<Typed>| t.unwrap_or(Typed::Other(f));
        typed(
            f.typed::<(), ()>(store)
                .map(Typed::P0R0)
                .or_else(|_| f.typed::<i32, ()>(store).map(Typed::P1R0))
                .or_else(|_| f.typed::<i32, i32>(store).map(Typed::P1R1))
                .or_else(|_| f.typed::<(i32, i32), ()>(store).map(Typed::P2R0))
                .or_else(|_| f.typed::<(i32, i32), i32>(store).map(Typed::P2R1))
                .or_else(|_| f.typed::<(i32, i32, i32), i32>(store).map(Typed::P3R1))
                .or_else(|_| {
                    f.typed::<(i32, i32, i32, i32, i32), ()>(store)
                        .map(Typed::P5R0)
                })
                .ok(),
        )
    }

    /// Calls it with `args` (as many as it takes): its result, if any.
    fn call(&self, store: &mut Store<VmState>, a: &[i32]) -> wasmtime::Result<Option<i32>> {
        let at = |i: usize| a.get(i).copied().unwrap_or(0);
        match self {
            Typed::P0R0(f) => f.call(store, ()).map(|()| None),
            Typed::P1R0(f) => f.call(store, at(0)).map(|()| None),
            Typed::P1R1(f) => f.call(store, at(0)).map(Some),
            Typed::P2R0(f) => f.call(store, (at(0), at(1))).map(|()| None),
            Typed::P2R1(f) => f.call(store, (at(0), at(1))).map(Some),
            Typed::P3R1(f) => f.call(store, (at(0), at(1), at(2))).map(Some),
            Typed::P5R0(f) => f
                .call(store, (at(0), at(1), at(2), at(3), at(4)))
                .map(|()| None),
            Typed::Other(f) => {
                let ty = f.ty(&*store);
                let given: Vec<Val> = (0..ty.params().len()).map(|i| Val::I32(at(i))).collect();
                let mut out = vec![Val::I32(0); ty.results().len()];
                f.call(&mut *store, &given, &mut out)?;
                Ok(out.first().and_then(Val::i32))
            }
        }
    }
}

impl Vm {
    pub fn start(
        filter: &ProxyWasm,
        state: VmState,
        generation: u64,
    ) -> Result<Box<Vm>, PluginError> {
        let mut store = Store::new(&filter.engine, state);
        store.limiter(|s| &mut s.limits);
        store.epoch_deadline_callback(|mut s| Ok(s.data_mut().deadline.on_tick()));
        arm(&mut store);
        let setup = |message: String| PluginError::Setup {
            plugin: filter.name.clone(),
            message,
        };
        let instance = filter
            .pre
            .instantiate(&mut store)
            .map_err(|e| setup(format!("{e:#}")))?;
        let exports = super::guest::Exports::of(&instance, &mut store);
        store.data_mut().exports = exports;
        let called = Export::ALL.map(|name| {
            let f = instance.get_func(&mut store, name.name())?;
            Some((Typed::of(f, &store), f.ty(&store).params().len()))
        });
        let mut vm = Box::new(Vm {
            store,
            generation,
            next: ROOT as u32 + 1,
            waiting: Default::default(),
            roots: vec![Root::of(filter, ROOT as u32)],
            bound: 0,
            bound_addr: roots::addr(filter),
            bound_context: ROOT as u32,
            ticking: None,
            unsent: Vec::new(),
            exports: called,
            spare: None,
            started: false,
            configure_took: Default::default(),
        });
        if let Err(e) = vm.run_start(filter) {
            return Err(with_start_log(e, vm.store.data_mut().start_log.take()));
        }
        vm.store.data_mut().start_log = None;
        vm.store.data_mut().limits.serving = true;
        // Started: calls from now on have the use's `timeout`.
        vm.store.data_mut().deadline.set_budget(filter.timeout);
        vm.started = true;
        vm.unsent = std::mem::take(&mut vm.store.data_mut().call.callouts);
        Ok(vm)
    }

    /// The start's calls, as Envoy makes them: the module's own start, the
    /// root context, `proxy_on_vm_start` and `proxy_on_configure`.
    fn run_start(&mut self, filter: &ProxyWasm) -> Result<(), PluginError> {
        let setup = |message: &str| PluginError::Setup {
            plugin: filter.name.clone(),
            message: message.to_owned(),
        };
        // A reactor (`_initialize`) or, from older toolchains, a command
        // whose `_start` sets the runtime up, as Envoy calls them.
        for start in [Export::Initialize, Export::Start] {
            if self.export(start).is_some() {
                self.call(filter, start, &[], 0)?;
                break;
            }
        }
        self.call(filter, Export::ContextCreate, &[ROOT, 0], 0)?;
        let vm_config = self.store.data().vm_config.len() as i32;
        if self.call(filter, Export::VmStart, &[ROOT, vm_config], 1)? == Some(0) {
            return Err(setup("refused to start (proxy_on_vm_start returned false)"));
        }
        let config = self.store.data().config.len() as i32;
        let began = std::time::Instant::now();
        let configured = self.call(filter, Export::Configure, &[ROOT, config], 1)?;
        self.configure_took = began.elapsed();
        if configured == Some(0) {
            return Err(setup(
                "refused its configuration (proxy_on_configure returned false)",
            ));
        }
        Ok(())
    }

    /// A new HTTP context under the root context: its id.
    pub fn new_context(&mut self, filter: &ProxyWasm) -> Result<u32, PluginError> {
        let id = self.next;
        self.next = self.next.wrapping_add(1).max(ROOT as u32 + 1);
        let root = self.root();
        self.call(filter, Export::ContextCreate, &[id as i32, root], 0)?;
        Ok(id)
    }

    /// `proxy_on_request_headers` for context `id`, lent `call`: the call
    /// back, and the filter's action (0: continue, 1: pause).
    pub fn request_headers(
        &mut self,
        filter: &ProxyWasm,
        id: u32,
        call: Box<Call>,
        end_of_stream: bool,
    ) -> (Box<Call>, Result<i32, PluginError>) {
        // The pseudo-headers count as fields, as in Envoy.
        let n = call.request_headers().len() as i32 + 4;
        self.lent(filter, Export::RequestHeaders, (id, n, end_of_stream), call)
    }

    /// `proxy_on_response_headers`, likewise.
    pub fn response_headers(
        &mut self,
        filter: &ProxyWasm,
        id: u32,
        call: Box<Call>,
        end_of_stream: bool,
    ) -> (Box<Call>, Result<i32, PluginError>) {
        let n = call.response_headers().len() as i32 + 1;
        let args = (id, n, end_of_stream);
        self.lent(filter, Export::ResponseHeaders, args, call)
    }

    /// `proxy_on_request_body` or `proxy_on_response_body` (`response`)
    /// with the body the call holds (for a response, what the filter kept
    /// by pausing and the new piece), likewise.
    pub fn body(
        &mut self,
        filter: &ProxyWasm,
        id: u32,
        call: Box<Call>,
        (response, end_of_stream): (bool, bool),
    ) -> (Box<Call>, Result<i32, PluginError>) {
        let (name, body) = match response {
            false => (Export::RequestBody, &call.request_body),
            true => (Export::ResponseBody, &call.response_body),
        };
        let n = body.as_ref().map_or(0, |b| b.len() as i32);
        self.lent(filter, name, (id, n, end_of_stream), call)
    }

    /// `proxy_on_request_trailers` or `proxy_on_response_trailers`
    /// (`response`) with the trailers the call holds, likewise; a module
    /// without the export lets them go.
    pub fn trailers(
        &mut self,
        filter: &ProxyWasm,
        id: u32,
        call: Box<Call>,
        response: bool,
    ) -> (Box<Call>, Result<i32, PluginError>) {
        let name = match response {
            false => Export::RequestTrailers,
            true => Export::ResponseTrailers,
        };
        if self.export(name).is_none() {
            return (call, Ok(0));
        }
        let n = call.trailers.as_ref().map_or(0, |t| t.len() as i32);
        let (call, result) = self.with_call(call, |vm| vm.call(filter, name, &[id as i32, n], 1));
        (call, result.map(|r| r.unwrap_or(0)))
    }

    fn lent(
        &mut self,
        filter: &ProxyWasm,
        name: Export,
        (id, size, end_of_stream): (u32, i32, bool),
        call: Box<Call>,
    ) -> (Box<Call>, Result<i32, PluginError>) {
        let (call, result) = self.with_call(call, |vm| {
            // ABI 0.2.1 passes end_of_stream; 0.2.0 does not.
            match vm.params(name) {
                Some(3) => vm.call(filter, name, &[id as i32, size, end_of_stream as i32], 1),
                _ => vm.call(filter, name, &[id as i32, size], 1),
            }
        });
        (call, result.map(|r| r.unwrap_or(0)))
    }

    /// Runs `f` with `call` in the store for its host calls; `call` back
    /// after. Swapped with the store's spare box, not moved: a `Call` is
    /// ~800 bytes, a box one word.
    fn with_call<T>(&mut self, call: Box<Call>, f: impl FnOnce(&mut Self) -> T) -> (Box<Call>, T) {
        let spare = std::mem::replace(&mut self.store.data_mut().call, call);
        let out = f(self);
        (
            std::mem::replace(&mut self.store.data_mut().call, spare),
            out,
        )
    }

    /// The tick period the bound root context set.
    pub fn tick_period(&self) -> Option<std::time::Duration> {
        self.store.data().tick
    }

    /// `proxy_on_tick` on the bound root context.
    pub fn tick(&mut self, filter: &ProxyWasm) -> Result<(), PluginError> {
        let root = self.root();
        self.on_root(filter, Export::Tick, &[root])
    }

    /// `proxy_on_queue_ready` on the bound root context for queue `token`.
    pub fn queue_ready(&mut self, filter: &ProxyWasm, token: u32) -> Result<(), PluginError> {
        let root = self.root();
        self.on_root(filter, Export::QueueReady, &[root, token as i32])
    }

    /// A call on the root context, outside any request; the HTTP calls it
    /// made are sent.
    fn on_root(
        &mut self,
        filter: &ProxyWasm,
        name: Export,
        args: &[i32],
    ) -> Result<(), PluginError> {
        let blank = self.blank();
        let (call, result) = self.with_call(blank, |vm| vm.call(filter, name, args, 0));
        result?;
        self.root_calls(call);
        Ok(())
    }

    /// Keeps the HTTP calls a root context call left in `call`, for the
    /// driver to send ([`Vm::take_unsent`]), and takes the call back.
    pub fn root_calls(&mut self, mut call: Box<Call>) {
        self.unsent.append(&mut call.callouts);
        self.recycle(call);
    }

    /// Which VM this is.
    pub fn home(&self) -> super::queue::Home {
        self.store.data().home.clone()
    }

    /// Ends context `id`: `proxy_on_done`, `proxy_on_log`,
    /// `proxy_on_delete`, as Envoy ends a stream.
    pub fn end(&mut self, filter: &ProxyWasm, id: u32) -> Result<(), PluginError> {
        // Checked first: hashing the id costs more than the rest of this
        // bookkeeping, and few requests wait on a callout.
        if !self.waiting.is_empty() {
            self.waiting.remove(&id);
        }
        self.store.data_mut().filter_state.end(id);
        for (name, results) in [(Export::Done, 1), (Export::Log, 0), (Export::Delete, 0)] {
            if self.export(name).is_some() {
                self.call(filter, name, &[id as i32], results)?;
            }
        }
        // The root contexts of uses gone are ended here: once a request,
        // and only while a reload's two uses share the VM.
        if self.roots.len() > 1 {
            self.end_gone_roots(filter)?;
        }
        Ok(())
    }

    fn params(&self, name: Export) -> Option<usize> {
        self.export(name).map(|(_, n)| n)
    }

    /// Export `name` and its parameter count, if the module has it.
    fn export(&self, name: Export) -> Option<(&Typed, usize)> {
        self.exports[name as usize].as_ref().map(|(f, n)| (f, *n))
    }

    /// A blank call to lend the next export call, filled in place.
    pub fn blank(&mut self) -> Box<Call> {
        self.spare.take().unwrap_or_default()
    }

    /// Takes back a call lent (what the filter left in it is dropped),
    /// for [`Self::blank`] to give again.
    pub fn recycle(&mut self, mut call: Box<Call>) {
        call.clear();
        self.spare = Some(call);
    }

    /// Calls export `name` with `args` under a fresh deadline; its one
    /// result, if it has `results` (a missing export is a setup error).
    fn call(
        &mut self,
        filter: &ProxyWasm,
        name: Export,
        args: &[i32],
        results: usize,
    ) -> Result<Option<i32>, PluginError> {
        let Some((f, _)) = &self.exports[name as usize] else {
            return Err(PluginError::Setup {
                plugin: filter.name.clone(),
                message: format!("the module does not export {}", name.name()),
            });
        };
        arm(&mut self.store);
        // Every export's first argument is the context it is for.
        self.store.data_mut().context = args.first().map_or(0, |&id| id as u32);
        match f.call(&mut self.store, args) {
            // A filter's result where one is wanted (0 if it gave none).
            Ok(out) => Ok((results > 0).then(|| out.unwrap_or(0))),
            Err(e) => Err(classify(
                filter,
                e,
                &self.store,
                (name.name(), self.started),
            )),
        }
    }
}

/// A start's error with what the filter logged as it failed (its own
/// words on why it refused its configuration, say), when it did.
fn with_start_log(e: PluginError, log: Option<std::collections::VecDeque<String>>) -> PluginError {
    let Some(log) = log.filter(|l| !l.is_empty()) else {
        return e;
    };
    let said = Vec::from(log).join(" | ");
    match e {
        PluginError::Setup { plugin, message } | PluginError::Trap { plugin, message } => {
            PluginError::Setup {
                plugin,
                message: format!("{message}; it logged: {said}"),
            }
        }
        e => e,
    }
}

fn arm(store: &mut Store<VmState>) {
    store.set_epoch_deadline(1);
    store.data_mut().deadline.arm();
}

/// What a failed call into export `during` was, with the setting that
/// bounds it named (a start's deadline is `start_timeout`).
fn classify(
    filter: &ProxyWasm,
    e: wasmtime::Error,
    store: &Store<VmState>,
    (during, started): (&'static str, bool),
) -> PluginError {
    let plugin = filter.name.clone();
    if matches!(
        e.downcast_ref::<wasmtime::Trap>(),
        Some(wasmtime::Trap::Interrupt)
    ) {
        let (timeout, setting) = match started {
            true => (filter.timeout, "timeout"),
            false => (filter.start_timeout, "start_timeout"),
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
            cap: filter.memory,
            during,
        };
    }
    PluginError::Trap {
        plugin,
        message: e.root_cause().to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::Export;

    /// A VM's exports are found in `Export::ALL`'s order and looked up by
    /// discriminant: the two must agree.
    #[test]
    fn exports_are_listed_in_discriminant_order() {
        for (at, export) in Export::ALL.iter().enumerate() {
            assert_eq!(*export as usize, at, "{export:?}");
        }
    }
}
