//! A VM's root contexts, one for each use it serves. A reload that
//! changes only a use's `config` keeps the use's VMs, as Envoy does: the
//! new use's root context is made and configured in each running VM
//! beside the old one's (`proxy_on_context_create`, `proxy_on_configure`;
//! no second `proxy_on_vm_start`), so its first request finds the VM's
//! runtime warm (a fresh Go VM's first request cost ~0.06 ms more,
//! bench/first-request.sh). Requests already on the old use finish on
//! its root context, which is ended (`proxy_on_done`, `proxy_on_delete`)
//! on the VM's next call once its use is gone.
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
    /// The period its ticker runs at, if one does.
    ticking: Option<Duration>,
    /// HTTP calls it made outside requests (as it was configured, in a
    /// tick) not sent yet: sent on its worker once the call is over
    /// ([`ProxyWasm::on_home`], [`ProxyWasm::on_vm`]).
    pub(super) unsent: Vec<(u32, crate::seam::Callout)>,
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

fn addr(filter: &ProxyWasm) -> usize {
    filter as *const ProxyWasm as usize
}

impl Vm {
    /// The bound root context's id.
    pub(in crate::proxy_wasm) fn root(&self) -> i32 {
        self.roots[self.bound].context as i32
    }

    /// A fresh id for an HTTP or root context.
    pub(super) fn next_id(&mut self) -> u32 {
        loop {
            let id = self.next;
            self.next = self.next.wrapping_add(1).max(ROOT as u32 + 1);
            // After the ids wrap (4 billion contexts), past the roots'.
            if !self.roots.iter().any(|r| r.context == id) {
                return id;
            }
        }
    }

    /// Puts `filter`'s root context's settings in the store for its
    /// calls; `false` if this VM does not serve it.
    #[inline]
    pub(in crate::proxy_wasm) fn bind(&mut self, filter: &ProxyWasm) -> bool {
        self.roots[self.bound].addr == addr(filter) || self.bind_other(addr(filter))
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
        let was = self.bound;
        self.roots[was].tick = self.store.data().tick;
        self.bound = at;
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

    /// The period the bound root's ticker runs at, if one does.
    pub(in crate::proxy_wasm) fn ticking(&mut self) -> &mut Option<Duration> {
        &mut self.roots[self.bound].ticking
    }

    /// Whether the bound root has HTTP calls to send.
    #[inline]
    pub(in crate::proxy_wasm) fn has_unsent(&self) -> bool {
        !self.roots[self.bound].unsent.is_empty()
    }

    /// The bound root's HTTP calls to send.
    pub(in crate::proxy_wasm) fn take_unsent(&mut self) -> Vec<(u32, crate::seam::Callout)> {
        std::mem::take(&mut self.roots[self.bound].unsent)
    }

    /// How many root contexts it has.
    #[inline]
    pub(in crate::proxy_wasm) fn roots(&self) -> usize {
        self.roots.len()
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
        let context = self.next_id();
        self.roots.push(Root::of(filter, context));
        self.bind_at(self.roots.len() - 1);
        self.starting(filter, true);
        let began = Instant::now();
        let configured = self.configure_root(filter, context);
        let took = began.elapsed();
        self.starting(filter, false);
        match configured {
            Ok(()) => {
                let made = std::mem::take(&mut self.store.data_mut().call.callouts);
                self.roots[self.bound].unsent = made;
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
    /// `proxy_on_delete`, as Envoy ends a removed config's), on a call
    /// of `filter`'s, which stays bound. An error leaves the VM unusable.
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
