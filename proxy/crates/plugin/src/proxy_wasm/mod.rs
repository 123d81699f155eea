//! Envoy's proxy-wasm filters (ABI 0.2.1 and 0.2.0, core modules built
//! for `wasm32-wasip1` or `wasm32-unknown-unknown`) as a kind of plugin
//! behind the seam ([`crate::seam::Plugin`]).
//!
//! As in Envoy, a filter runs in a VM (one instance of the module) per
//! worker thread, which lives across requests: its root context is
//! configured once when the VM starts (and a use reloaded with another
//! config gets a root context of its own in the same VM: `set.rs`,
//! `vm/roots.rs`), and each request gets an HTTP
//! context on the VM of the thread it runs on, from its request headers to
//! its end (`proxy_on_done`, `proxy_on_log`, `proxy_on_delete`). Every call
//! runs under the use's CPU deadline and memory cap; a call that traps,
//! runs out of time or memory fails its request (by the use's `fail`
//! mode), and its VM is dropped with the contexts on it: the requests
//! still on it fail their next call, and the thread's next request starts
//! a fresh VM.
//!
//! Here: the use; `vms.rs` and `set.rs` its VMs, `vm.rs` a VM's start
//! and calls, `abi.rs`
//! and `wasi.rs` the host calls, `call.rs` what a call is lent,
//! `properties.rs` the attributes,
//! `map.rs` the serialized header map, `names.rs` the header names it asked
//! for, kept parsed, `guest.rs` the guest's memory.

mod abi;
mod bodies;
mod call;
mod callout;
mod filter_state;
mod foreign;
mod grpc;
mod grpc_stream;
mod guest;
mod imports;
mod log;
mod map;
mod names;
mod properties;
mod queue;
mod redis;
mod set;
mod shared;
mod tick;
mod vm;
mod vms;
mod wasi;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::Bytes;
use portcullis_config::FailMode;
use portcullis_net::shard::SHARDS;
use wasmtime::{Engine, InstancePre, Linker, Module};

use crate::cpu_deadline::CpuDeadline;
use crate::seam::{self, LocalAnswer, ResponseVerdict, Stream, Verdict};
use crate::state::MemoryCap;
use crate::{PluginError, RequestFacts};
use vm::Vm;

/// The exports that make a core module a proxy-wasm filter.
/// A filter VM's memory cap unless its use sets one: Go's runtime (Go
/// filters, Higress's hub) grows its heap in steps as it starts, and
/// Higress's ai-data-masking (Rust) with its README's `replace_roles`
/// needs more than 96 MiB in `proxy_on_configure` (Envoy sets no cap). It bounds a
/// runaway filter; memory not grown into is not taken.
pub const DEFAULT_MEMORY: usize = 128 << 20;

/// Higress's filters (its wasm-go SDK and its hub) mark themselves with
/// `_0_2_100`, its Envoy's ABI: 0.2.1 and its host extensions.
const ABI_VERSIONS: [&str; 3] = [
    "proxy_abi_version_0_2_1",
    "proxy_abi_version_0_2_0",
    "proxy_abi_version_0_2_100",
];

pub use shared::{
    BUCKETS as HISTOGRAM_BUCKETS, Histogram, SHARED_BYTES_PER_PLUGIN, forget_plugins, gauges,
    histograms, shared_bytes,
};

/// Whether `module` is a proxy-wasm filter.
pub fn is_filter(module: &Module) -> bool {
    module.exports().any(|e| ABI_VERSIONS.contains(&e.name()))
}

/// What a VM's store holds: the use's settings, and what the current call
/// is lent of its request.
pub struct VmState {
    plugin: Arc<str>,
    root_id: Arc<str>,
    /// `proxy_get_buffer_bytes`' plugin and VM configurations.
    config: Bytes,
    vm_config: Bytes,
    route_names: Arc<[Arc<str>]>,
    /// The route of a use on a route (`None`: the global chain).
    route: Option<Arc<str>>,
    /// The policies' upstreams, which `proxy_http_call` may name.
    upstreams: UpstreamNames,
    next_token: u32,
    limits: MemoryCap,
    deadline: CpuDeadline,
    /// The tick period the root context set (`None`: no ticks).
    tick: Option<Duration>,
    /// The VM this is.
    home: queue::Home,
    /// Its memory and allocator, once instantiated.
    exports: guest::Exports,
    call: Box<Call>,
    /// The context the current call is for (its first argument, or the
    /// one `proxy_set_effective_context` named).
    context: u32,
    /// The bound use's root context (`vm::roots`).
    root_context: u32,
    /// What each HTTP context keeps (`proxy_set_property`).
    filter_state: filter_state::FilterState,
    /// While the VM starts, the last lines the filter logged: a filter
    /// that refuses its configuration usually says why.
    start_log: Option<std::collections::VecDeque<String>>,
    /// Its gRPC calls in flight.
    grpc: grpc::Calls,
    /// Its gRPC streams open.
    streams: grpc_stream::Streams,
    /// Its Redis calls (Higress's).
    redis: redis::Calls,
    /// The header names it asked for last, parsed.
    names: names::Names,
}

/// The names an HTTP call may give an upstream of the policies, each
/// with the upstream's own: its name, and the cluster names Istio and
/// Higress give a service (`outbound|PORT||HOST`) for each of its
/// endpoints, so a Higress filter calling out reaches it as written.
pub type UpstreamNames = Arc<[(Arc<str>, Arc<str>)]>;

/// Lines of a start's log kept for its error.
const START_LOG_LINES: usize = 5;

impl VmState {
    /// A token for an HTTP call, a gRPC call or stream: one count for
    /// all, so an answer's token tells which it is for.
    fn take_token(&mut self) -> u32 {
        let token = self.next_token;
        self.next_token = token.wrapping_add(1).max(1);
        token
    }

    /// Notes a line the filter logged at `level` (proxy-wasm's: 3 is a
    /// warning), while it starts.
    fn said(&mut self, level: i32, line: &str) {
        let Some(log) = self.start_log.as_mut() else {
            return;
        };
        // Its own complaints, not its chatter.
        if level < 3 {
            return;
        }
        if log.len() == START_LOG_LINES {
            log.pop_front();
        }
        log.push_back(line.to_owned());
    }
}

use call::{Call, Pairs};

/// A proxy-wasm filter attached with one config.
pub struct ProxyWasm {
    name: Arc<str>,
    fail: FailMode,
    root_id: Arc<str>,
    config: Bytes,
    vm_config: Bytes,
    timeout: Duration,
    /// A VM start's budget (`_initialize` to `proxy_on_configure`).
    start_timeout: Duration,
    memory: usize,
    engine: Engine,
    pre: InstancePre<VmState>,
    route_names: Arc<[Arc<str>]>,
    upstreams: UpstreamNames,
    route: Option<Arc<str>>,
    /// Its VMs, which a use it was reloaded from may share (`set.rs`).
    set: Arc<set::VmSet>,
    /// Calls by shard, each on its own cache line: one counter shared by
    /// the workers would move between their cores on every call.
    calls: [Count; SHARDS],
    /// Callouts in flight that no request waits on, by shard (its VM's).
    background: [Count; SHARDS],
    /// Itself, for its VMs' tickers (which stop when it is dropped).
    me: Weak<ProxyWasm>,
    /// Where its root contexts' HTTP calls go: the pools of the newest
    /// pipeline it is in (a use kept across a reload is in two).
    callouts: Mutex<Option<Arc<dyn seam::Callouts>>>,
}

/// The most VMs a use starts again in a second after failures: a filter
/// that fails every call costs its workers at most this many starts, and
/// its requests fail at once for the rest of the second.
const MAX_RESTARTS_PER_SECOND: u32 = 10;

impl std::fmt::Debug for ProxyWasm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProxyWasm")
            .field("plugin", &self.name)
            .finish_non_exhaustive()
    }
}

/// A shard's VM, its lock alone on its cache line (the workers lock
/// theirs on every call).
#[derive(Default)]
#[repr(align(128))]
struct VmSlot(Mutex<Option<Box<Vm>>>);

/// A counter alone on its cache line.
#[derive(Default)]
#[repr(align(128))]
struct Count(AtomicU64);

/// How a use is set up.
pub struct Settings {
    pub name: Arc<str>,
    pub fail: FailMode,
    pub root_id: Arc<str>,
    pub config: Bytes,
    pub vm_config: Bytes,
    pub timeout: Duration,
    pub start_timeout: Duration,
    pub memory: usize,
    pub route_names: Arc<[Arc<str>]>,
    /// The policies' upstreams, by every name a call may give them.
    pub upstreams: UpstreamNames,
    pub route: Option<Arc<str>>,
}

/// A stream: the VM's shard (8 bits), its generation (24) and the HTTP
/// context's id (32).
fn stream(shard: usize, generation: u64, context: u32) -> Stream {
    Stream(((shard as u64) << 56) | ((generation & 0xff_ffff) << 32) | u64::from(context))
}

fn parts(s: Stream) -> (usize, u64, u32) {
    ((s.0 >> 56) as usize, (s.0 >> 32) & 0xff_ffff, s.0 as u32)
}

impl ProxyWasm {
    /// The use of `module` with `settings`: linked, and started once
    /// (configured) to check that it starts, which `check` reports.
    pub fn new(
        engine: &Engine,
        module: &Module,
        settings: Settings,
    ) -> Result<Arc<ProxyWasm>, String> {
        let mut linker: Linker<VmState> = Linker::new(engine);
        linker.allow_shadowing(true);
        let linked = abi::add_to_linker(&mut linker)
            .and_then(|()| log::add_to_linker(&mut linker))
            .and_then(|()| foreign::add_to_linker(&mut linker))
            .and_then(|()| callout::add_to_linker(&mut linker))
            .and_then(|()| filter_state::add_to_linker(&mut linker))
            .and_then(|()| grpc::add_to_linker(&mut linker))
            .and_then(|()| grpc_stream::add_to_linker(&mut linker))
            .and_then(|()| redis::add_to_linker(&mut linker))
            .and_then(|()| shared::add_to_linker(&mut linker))
            .and_then(|()| tick::add_to_linker(&mut linker))
            .and_then(|()| queue::add_to_linker(&mut linker))
            .and_then(|()| wasi::add_to_linker(&mut linker));
        linked.map_err(|e| format!("cannot be linked: {e:#}"))?;
        imports::stand_ins(&mut linker, module)?;
        let pre = linker
            .instantiate_pre(module)
            .map_err(|e| format!("cannot be linked: {e:#}"))?;
        let set = set::VmSet::for_use(module, &settings);
        let filter = ProxyWasm {
            name: settings.name,
            fail: settings.fail,
            root_id: settings.root_id,
            config: settings.config,
            vm_config: settings.vm_config,
            timeout: settings.timeout,
            start_timeout: settings.start_timeout,
            memory: settings.memory,
            engine: engine.clone(),
            pre,
            route_names: settings.route_names,
            upstreams: settings.upstreams,
            route: settings.route,
            set,
            calls: std::array::from_fn(|_| Count::default()),
            background: std::array::from_fn(|_| Count::default()),
            me: Weak::new(),
            callouts: Mutex::new(None),
        };
        let filter = Arc::new_cyclic(|me| ProxyWasm {
            me: me.clone(),
            ..filter
        });
        filter.set.serve(filter.me.clone());
        // Started once here (or configured in the VM of the use it was
        // reloaded from), which `check` reports, and kept as the first
        // worker's VM (the others start in `warm`).
        filter.warm_shard(0).map_err(|e| e.to_string())?;
        Ok(filter)
    }
}

use crate::containment::count;

impl ProxyWasm {
    /// Where its calls outside requests go now.
    fn callouts(&self) -> Option<Arc<dyn seam::Callouts>> {
        self.callouts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

fn stream_of(shard: usize, generation: u64, id: u32) -> Stream {
    stream(shard, generation, id)
}

impl seam::Plugin for ProxyWasm {
    fn name(&self) -> &Arc<str> {
        &self.name
    }

    fn fail(&self) -> FailMode {
        self.fail
    }

    fn hooks(&self) -> seam::Hooks {
        // The SDKs export every callback: a filter that does nothing on
        // the response still has its context ended then.
        seam::Hooks {
            request: true,
            response: true,
            local_answers: true,
            response_body: true,
            request_body: true,
        }
    }

    fn memory_use(&self) -> (Option<&str>, usize, usize) {
        (
            self.route.as_deref(),
            self.set.memory_peak.load(Ordering::Relaxed),
            self.memory,
        )
    }

    fn calls(&self) -> u64 {
        self.calls.iter().map(|c| c.0.load(Ordering::Relaxed)).sum()
    }

    /// A VM lives on its worker thread.
    fn runs_anywhere(&self) -> bool {
        false
    }

    fn on_request(
        &self,
        stream: &mut Stream,
        facts: &mut Option<RequestFacts>,
        headers: &mut http::HeaderMap,
        body: Option<&[u8]>,
    ) -> Result<Verdict, PluginError> {
        let fresh = *stream == Stream::NONE;
        self.on_vm(stream, |vm, stream| {
            let bodiless = facts.as_ref().is_none_or(|f| f.bodiless);
            let id = parts(*stream).2;
            // A body read for a plugin before this one: this one's head
            // call comes first, as the body is there to follow.
            if fresh && body.is_some() {
                let mut call = vm.blank();
                call.lend(facts, headers, None);
                let (mut call, action) = vm.request_headers(self, id, call, false);
                call.unlend();
                action?;
                if let Some(local) = call.local.take() {
                    return Ok(Verdict::Respond(Box::new(local)));
                }
                callout::keep(vm, id, &mut call);
                vm.recycle(call);
            }
            let mut call = vm.blank();
            call.lend(facts, headers, None);
            call.request_body = body.map(Bytes::copy_from_slice);
            let (mut call, action) = match body {
                None => vm.request_headers(self, id, call, bodiless),
                Some(_) => vm.body(self, id, call, (false, true)),
            };
            call.unlend();
            let action = action?;
            let body_to_come = body.is_none() && !bodiless;
            let verdict = callout::verdict(self, vm, id, &mut call, (action, body_to_come));
            vm.recycle(call);
            verdict
        })
    }

    fn on_request_body(
        &self,
        stream: &mut Stream,
        lent: seam::RequestLent<'_>,
        body: &Bytes,
    ) -> Result<seam::BodyVerdict, PluginError> {
        self.on_vm(stream, |vm, stream| {
            let mut call = vm.blank();
            call.lend(lent.facts, lent.headers, None);
            call.request_body = Some(body.clone());
            let eos = lent.end_of_stream;
            let (mut call, action) = vm.body(self, parts(*stream).2, call, (false, eos));
            call.unlend();
            let verdict = action.map(|action| {
                bodies::body_verdict(&mut call, action, eos, |c| c.request_body.take())
            });
            vm.recycle(call);
            verdict
        })
    }

    fn on_request_trailers(
        &self,
        stream: &mut Stream,
        lent: seam::RequestLent<'_>,
        trailers: &mut http::HeaderMap,
    ) -> Result<Option<LocalAnswer>, PluginError> {
        self.on_vm(stream, |vm, stream| {
            bodies::request_trailers(self, vm, parts(*stream).2, lent, trailers)
        })
    }

    fn on_response_trailers(
        &self,
        stream: &mut Stream,
        lent: seam::ResponseLent<'_>,
        trailers: &mut http::HeaderMap,
    ) -> Result<Option<LocalAnswer>, PluginError> {
        self.on_vm(stream, |vm, stream| {
            bodies::response_trailers(self, vm, parts(*stream).2, lent, trailers)
        })
    }

    fn on_callout(
        &self,
        stream: &mut Stream,
        facts: &mut Option<RequestFacts>,
        headers: &mut http::HeaderMap,
        answer: crate::seam::CalloutAnswer,
    ) -> Result<Verdict, PluginError> {
        self.on_vm(stream, |vm, stream| {
            callout::answer(self, vm, parts(*stream).2, (facts, headers), answer)
        })
    }

    fn on_response(
        &self,
        stream: &mut Stream,
        lent: seam::ResponseLent<'_>,
    ) -> Result<ResponseVerdict, PluginError> {
        self.on_vm(stream, |vm, stream| {
            let end_of_stream = lent.end_of_stream;
            let (mut call, action) = bodies::lend(vm, lent, None, |vm, call| {
                vm.response_headers(self, parts(*stream).2, call, end_of_stream)
            });
            let local = call.local.take();
            vm.recycle(call);
            Ok(bodies::head_verdict(local, action?, end_of_stream))
        })
    }

    fn on_response_whole(
        &self,
        stream: &mut Stream,
        lent: seam::ResponseLent<'_>,
        body: &Bytes,
    ) -> seam::WholeVerdicts {
        bodies::whole(self, stream, lent, body)
    }

    fn on_response_body(
        &self,
        stream: &mut Stream,
        lent: seam::ResponseLent<'_>,
        body: &Bytes,
    ) -> Result<seam::BodyVerdict, PluginError> {
        self.on_vm(stream, |vm, stream| {
            let end_of_stream = lent.end_of_stream;
            let given = Some(body.clone());
            let (mut call, action) = bodies::lend(vm, lent, given, |vm, call| {
                vm.body(self, parts(*stream).2, call, (true, end_of_stream))
            });
            let taken = |c: &mut Call| c.response_body.take();
            let verdict =
                action.map(|action| bodies::body_verdict(&mut call, action, end_of_stream, taken));
            vm.recycle(call);
            verdict
        })
    }

    fn set_callouts(&self, callouts: Arc<dyn seam::Callouts>) {
        *self.callouts.lock().unwrap_or_else(|p| p.into_inner()) = Some(callouts);
    }

    fn end(&self, stream: Stream) {
        let (shard, generation, id) = parts(stream);
        let mut slot = self.slot(shard);
        if let Some(vm) = slot.as_mut()
            && vm.generation & 0xff_ffff == generation
            && vm.bind(self)
            && let Err(e) = vm.end(self, id)
        {
            drop(slot);
            self.ending_failed(stream, &e);
        }
    }

    fn warm(&self, shards: std::ops::Range<usize>) -> Result<(), PluginError> {
        for shard in shards {
            self.warm_shard(shard)?;
        }
        Ok(())
    }

    fn ready(&self) -> usize {
        (0..SHARDS)
            .filter(|&s| self.slot(s).as_ref().is_some_and(|vm| vm.serves(self)))
            .count()
    }
}
