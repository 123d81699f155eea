//! A VM's root contexts, one for each use it serves. A reload that
//! changes only a use's `config` keeps the use's VMs, as Envoy does: the
//! new use's root context is made and configured in each running VM
//! beside the old one's (`proxy_on_context_create`, `proxy_on_configure`;
//! no second `proxy_on_vm_start`), so its first request finds the VM's
//! runtime warm (a fresh Go VM's first request cost ~0.06 ms more,
//! bench/first-request.sh). Requests already on the old use finish on
//! its root context, which is ended (`proxy_on_done`, `proxy_on_delete`)
//! as the VM's next request ends once its use is gone.
//!
//! The store holds one use's settings at a time (its name, configs,
//! route, upstreams): [`Vm::bind`] puts the calling use's there before
//! its call, a pointer compare when it is the one bound already.

use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use super::{Export, ProxyWasm, ROOT, Vm};
use crate::PluginError;
use crate::proxy_wasm::UpstreamNames;

/// A use's root context in a VM, and what the store holds while it is
/// bound.
pub struct Root {
    filter: Weak<ProxyWasm>,
    /// The use's address, for [`Vm::bind`]'s test (the weak reference
    /// keeps it from being reused while this lives).
    addr: usize,
    context: u32,
    plugin: Arc<str>,
    root_id: Arc<str>,
    config: bytes::Bytes,
    route_names: Arc<[Arc<str>]>,
    route: Option<Arc<str>>,
    upstreams: UpstreamNames,
    /// The tick period it set, kept here while another root is bound.
    tick: Option<Duration>,
    /// The period its ticker runs at, and the HTTP calls it made outside
    /// requests not sent yet, kept here while another root is bound
    /// ([`Vm::ticking`]).
    ticking: Option<Duration>,
    unsent: Vec<(u32, crate::seam::Callout)>,
}

impl Root {
    pub(in crate::proxy_wasm) fn of(filter: &ProxyWasm, context: u32) -> Root {
        Root {
            filter: filter.me.clone(),
            addr: addr(filter),
            context,
            plugin: filter.name.clone(),
            root_id: filter.root_id.clone(),
            config: filter.config.clone(),
            route_names: filter.route_names.clone(),
            route: filter.route.clone(),
            upstreams: filter.upstreams.clone(),
            tick: None,
            ticking: None,
            unsent: Vec::new(),
        }
    }
}

pub(super) fn addr(filter: &ProxyWasm) -> usize {
    filter as *const ProxyWasm as usize
}

impl Vm {
    /// The bound root context's id.
    #[inline]
    pub(in crate::proxy_wasm) fn root(&self) -> i32 {
        self.bound_context as i32
    }

    /// A fresh id for a root context after the first: counted down from
    /// the top, where HTTP contexts (counted up from the first root's)
    /// reach only after 4 billion requests on the VM.
    fn next_root_id(&self) -> u32 {
        let lowest = self
            .roots
            .iter()
            .map(|r| r.context)
            .filter(|&c| c != ROOT as u32);
        lowest.min().map_or(u32::MAX, |c| c - 1)
    }

    /// Puts `filter`'s root context's settings in the store for its
    /// calls; `false` if this VM does not serve it.
    #[inline]
    pub(in crate::proxy_wasm) fn bind(&mut self, filter: &ProxyWasm) -> bool {
        self.bound_addr == addr(filter) || self.bind_other(addr(filter))
    }

    /// Whether this VM has `filter`'s root context.
    pub(in crate::proxy_wasm) fn serves(&self, filter: &ProxyWasm) -> bool {
        self.roots.iter().any(|r| r.addr == addr(filter))
    }

    #[cold]
    fn bind_other(&mut self, to: usize) -> bool {
        let Some(at) = self.roots.iter().position(|r| r.addr == to) else {
            return false;
        };
        self.bind_at(at);
        true
    }

    fn bind_at(&mut self, at: usize) {
        let was = &mut self.roots[self.bound];
        was.tick = self.store.data().tick;
        was.ticking = self.ticking;
        was.unsent = std::mem::take(&mut self.unsent);
        self.bound = at;
        let root = &mut self.roots[at];
        self.bound_addr = root.addr;
        self.bound_context = root.context;
        self.ticking = root.ticking;
        self.unsent = std::mem::take(&mut root.unsent);
        let root = &self.roots[at];
        let state = self.store.data_mut();
        state.plugin = root.plugin.clone();
        state.root_id = root.root_id.clone();
        state.config = root.config.clone();
        state.route_names = root.route_names.clone();
        state.route = root.route.clone();
        state.upstreams = root.upstreams.clone();
        state.tick = root.tick;
        state.root_context = root.context;
        state.home.filter = root.filter.clone();
    }

    /// Whether the bound root has HTTP calls to send.
    #[inline]
    pub(in crate::proxy_wasm) fn has_unsent(&self) -> bool {
        !self.unsent.is_empty()
    }

    /// The bound root's HTTP calls to send.
    pub(in crate::proxy_wasm) fn take_unsent(&mut self) -> Vec<(u32, crate::seam::Callout)> {
        std::mem::take(&mut self.unsent)
    }

    /// Makes and configures `filter`'s root context in this running VM,
    /// under `filter`'s start budget: how long the configure took. The
    /// error says whether the VM is still usable: a filter that refuses
    /// its config leaves it as it was; an error of any other kind (a trap,
    /// the budget) leaves it unusable, for the caller to drop.
    pub(in crate::proxy_wasm) fn add_root(
        &mut self,
        filter: &ProxyWasm,
    ) -> Result<Duration, (PluginError, bool)> {
        let was = self.bound;
        let context = self.next_root_id();
        self.roots.push(Root::of(filter, context));
        self.bind_at(self.roots.len() - 1);
        self.starting(filter, true);
        let began = Instant::now();
        let configured = self.configure_root(filter, context);
        let took = began.elapsed();
        self.starting(filter, false);
        match configured {
            Ok(()) => {
                self.unsent = std::mem::take(&mut self.store.data_mut().call.callouts);
                Ok(took)
            }
            Err((e, usable)) => {
                self.bind_at(was);
                self.roots.pop();
                Err((e, usable))
            }
        }
    }

    /// Its start's budget and error names while `starting`; the use's
    /// `timeout` after.
    fn starting(&mut self, filter: &ProxyWasm, starting: bool) {
        let budget = match starting {
            true => filter.start_timeout,
            false => filter.timeout,
        };
        self.store.data_mut().deadline.set_budget(budget);
        self.started = !starting;
    }

    fn configure_root(
        &mut self,
        filter: &ProxyWasm,
        context: u32,
    ) -> Result<(), (PluginError, bool)> {
        let broken = |e| (e, false);
        self.call(filter, Export::ContextCreate, &[context as i32, 0], 0)
            .map_err(broken)?;
        let config = self.store.data().config.len() as i32;
        let args = [context as i32, config];
        if self
            .call(filter, Export::Configure, &args, 1)
            .map_err(broken)?
            == Some(0)
        {
            let refused = PluginError::Setup {
                plugin: filter.name.clone(),
                message: "refused its configuration (proxy_on_configure returned false)".into(),
            };
            return Err((refused, true));
        }
        Ok(())
    }

    /// Ends the root contexts of uses that are gone (`proxy_on_done`,
    /// `proxy_on_delete`, as Envoy ends a removed config's), as a request
    /// of `filter`'s ends (`filter` stays bound). An error leaves the VM
    /// unusable.
    #[cold]
    pub(in crate::proxy_wasm) fn end_gone_roots(
        &mut self,
        filter: &ProxyWasm,
    ) -> Result<(), PluginError> {
        while let Some(at) = self.roots.iter().position(|r| r.filter.strong_count() == 0) {
            let root = self.roots.remove(at);
            let context = root.context as i32;
            for (name, results) in [(Export::Done, 1), (Export::Delete, 0)] {
                if self.exports[name as usize].is_some() {
                    self.call(filter, name, &[context], results)?;
                }
            }
            self.bound = self
                .roots
                .iter()
                .position(|r| r.addr == addr(filter))
                .unwrap_or(0);
        }
        Ok(())
    }
}
