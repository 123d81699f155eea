//! A filter's VMs, one a worker slot: started before traffic (`warm`),
//! or joined when the use it was reloaded from has them (`set.rs`), used
//! by the slot's requests, and started again off the request path when
//! one fails, at most [`MAX_RESTARTS_PER_SECOND`] a second.

use std::sync::MutexGuard;
use std::sync::atomic::Ordering;
use std::time::Duration;

use portcullis_net::shard::this_thread;

use super::*;

impl ProxyWasm {
    /// Starts a VM for shard `shard` off the request path (a blocking
    /// thread), unless one is starting already: after a VM failed, so the
    /// worker's next requests find a fresh one and no request waits for a
    /// start (which may take a second of CPU, on a worker serving other
    /// routes too).
    pub(super) fn restart_later(&self, shard: usize) {
        let Some(me) = self.me.upgrade() else {
            return;
        };
        if self.set.restarting[shard].0.swap(1, Ordering::AcqRel) == 1 {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.set.restarting[shard].0.store(0, Ordering::Release);
            return;
        };
        runtime.spawn_blocking(move || {
            // A filter failing without end gets its ten starts a second;
            // past them, the next start waits for the second to be out.
            if let Some((left, _)) = me.restarts_spent() {
                count(&me.name, "vm_restarts_refused");
                std::thread::sleep(left);
            }
            match me.start_all(shard) {
                Ok(vm) => {
                    let mut slot = me.slot(shard);
                    // Done before the VM can be seen, under the slot's
                    // lock: a request that fails the fresh VM at once
                    // must find no restart under way, or it would start
                    // none and the slot would stay empty.
                    me.set.restarting[shard].0.store(0, Ordering::Release);
                    if slot.is_none() {
                        *slot = Some(vm);
                    }
                    drop(slot);
                    // The failure said a fresh VM takes its place; this
                    // says when it has (the worker's requests on this
                    // filter failed by its `fail` until now).
                    tracing::info!(plugin = %me.name, shard, "proxy-wasm VM started again");
                }
                Err(e) => {
                    me.set.restarting[shard].0.store(0, Ordering::Release);
                    tracing::warn!(plugin = %me.name, error = %e, "proxy-wasm VM could not start again");
                }
            }
        });
    }

    /// Shard `shard`'s VM slot, locked.
    pub(super) fn slot(&self, shard: usize) -> MutexGuard<'_, Option<Box<Vm>>> {
        self.set.slot(shard)
    }

    /// Makes sure shard `shard` has a VM with this use's root context:
    /// its own in the running VM of a use it shares VMs with, or a VM
    /// started for it (and the other uses it shares them with).
    pub(super) fn warm_shard(&self, shard: usize) -> Result<(), PluginError> {
        loop {
            {
                let mut slot = self.slot(shard);
                if let Some(vm) = slot.as_mut() {
                    if vm.serves(self) {
                        return Ok(());
                    }
                    return match vm.add_root(self) {
                        Ok(took) => {
                            self.set.configured_in(took);
                            Ok(())
                        }
                        Err((e, usable)) => {
                            if !usable {
                                tracing::warn!(plugin = %self.name, error = %e, "proxy-wasm VM failed configuring a reloaded use; a fresh one takes its place");
                                *slot = None;
                                drop(slot);
                                self.count_restart();
                                self.restart_later(shard);
                            }
                            Err(e)
                        }
                    };
                }
            }
            // Started without the slot's lock (a start may take a second);
            // one another use started meanwhile is configured instead.
            let vm = self.start_all(shard)?;
            let mut slot = self.slot(shard);
            if slot.is_none() {
                *slot = Some(vm);
                return Ok(());
            }
        }
    }

    /// A VM for shard `shard` with this use's root context first, then
    /// those of the other uses sharing its VMs (one that fails to
    /// configure again is left out, its requests on this shard failing by
    /// its `fail`).
    pub(super) fn start_all(&self, shard: usize) -> Result<Box<Vm>, PluginError> {
        let mut vm = self.start(shard)?;
        self.set.configured_in(vm.configure_took);
        for other in self.set.others(self) {
            match vm.add_root(&other) {
                Ok(took) => self.set.configured_in(took),
                Err((e, true)) => {
                    tracing::warn!(plugin = %other.name, error = %e, "proxy-wasm use refused its configuration in a fresh VM");
                }
                Err((e, false)) => return Err(e),
            }
        }
        vm.bind(self);
        Ok(vm)
    }

    /// Runs `f` on the VM `home` names, if it still runs; a VM whose call
    /// failed is dropped.
    pub(super) fn on_home(
        &self,
        home: &queue::Home,
        f: impl FnOnce(&mut Vm, &ProxyWasm) -> Result<(), PluginError>,
    ) {
        let mut slot = self.slot(home.shard);
        let Some(vm) = slot.as_mut().filter(|vm| vm.generation == home.generation) else {
            return;
        };
        if !vm.bind(self) {
            return;
        }
        let result = f(vm, self);
        // What the call asked for goes even if the call then failed, as
        // it would have gone the moment it was made.
        if vm.has_unsent() {
            let calls = vm.take_unsent();
            callout::send_from_root(self, &vm.home(), calls);
        }
        match result {
            Ok(()) => tick::keep_ticking(self, home.shard, vm),
            Err(e) => {
                tracing::warn!(plugin = %self.name, error = %e, "proxy-wasm VM failed outside a request; a fresh one takes its place");
                self.count_restart();
                *slot = None;
                drop(slot);
                self.restart_later(home.shard);
            }
        }
    }

    /// Whether a VM may start now: not while this second's restarts are
    /// spent.
    pub(super) fn may_restart(&self) -> Result<(), PluginError> {
        let Some((_, dropped)) = self.restarts_spent() else {
            return Ok(());
        };
        count(&self.name, "vm_restarts_refused");
        Err(PluginError::Trap {
            plugin: self.name.clone(),
            message: format!(
                "its VMs failed {dropped} times within a second; none starts again until the second is out"
            ),
        })
    }

    /// While this second's restarts are spent: how long it has left, and
    /// the failures in it.
    pub(super) fn restarts_spent(&self) -> Option<(Duration, u32)> {
        let (since, dropped) = *self.set.restarts.lock().unwrap_or_else(|p| p.into_inner());
        let left = Duration::from_secs(1).checked_sub(since.elapsed())?;
        (dropped >= MAX_RESTARTS_PER_SECOND).then_some((left, dropped))
    }

    /// Counts a VM dropped for a failure, against this second's restarts.
    pub(super) fn count_restart(&self) {
        {
            let mut restarts = self.set.restarts.lock().unwrap_or_else(|p| p.into_inner());
            if restarts.0.elapsed() >= Duration::from_secs(1) {
                *restarts = (std::time::Instant::now(), 0);
            }
            restarts.1 += 1;
        }
        count(&self.name, "vm_restarts");
    }

    pub(super) fn start(&self, shard: usize) -> Result<Box<Vm>, PluginError> {
        let generation = self.set.generations.fetch_add(1, Ordering::Relaxed);
        let home = queue::Home {
            filter: self.me.clone(),
            shard,
            generation,
        };
        let state = VmState {
            plugin: self.name.clone(),
            root_id: self.root_id.clone(),
            config: self.config.clone(),
            vm_config: self.vm_config.clone(),
            route_names: self.route_names.clone(),
            route: self.route.clone(),
            upstreams: self.upstreams.clone(),
            next_token: 1,
            limits: MemoryCap::new(self.memory, self.set.memory_peak.clone()),
            deadline: CpuDeadline::new(self.start_timeout),
            tick: None,
            home,
            exports: guest::Exports::default(),
            call: Box::default(),
            context: 0,
            root_context: vm::ROOT as u32,
            filter_state: Default::default(),
            start_log: Some(Default::default()),
            grpc: Default::default(),
            streams: Default::default(),
            redis: Default::default(),
            names: Default::default(),
        };
        Vm::start(self, state, generation)
    }

    /// Runs `f` on this thread's VM (started if there is none), or on the
    /// VM `stream` names; a VM whose call failed is dropped.
    pub(super) fn on_vm<T>(
        &self,
        stream: &mut Stream,
        f: impl FnOnce(&mut Vm, &mut Stream) -> Result<T, PluginError>,
    ) -> Result<T, PluginError> {
        let shard = if *stream == Stream::NONE {
            this_thread()
        } else {
            parts(*stream).0
        };
        self.calls[shard].0.fetch_add(1, Ordering::Relaxed);
        let mut slot = self.slot(shard);
        let Some(vm) = slot.as_mut() else {
            if *stream != Stream::NONE {
                return Err(self.lost());
            }
            // Started off the request path: this request fails by the
            // use's `fail`, and the next ones find the fresh VM.
            self.may_restart()?;
            self.restart_later(shard);
            return Err(PluginError::Setup {
                plugin: self.name.clone(),
                message: "its VM on this worker is starting (again, after a failure)".into(),
            });
        };
        if !vm.bind(self) {
            // A VM started again without this use's root context (its
            // configure failed there): its requests on this worker fail
            // by its `fail`.
            return Err(PluginError::Setup {
                plugin: self.name.clone(),
                message: "its VM on this worker does not have it configured".into(),
            });
        }
        if vm.has_unsent() {
            // The HTTP calls its start made (a key set fetched when
            // configured, say), sent now that it is on its worker.
            let started = vm.take_unsent();
            let home = vm.home();
            callout::send_from_root(self, &home, started);
        }
        if *stream != Stream::NONE && parts(*stream).1 != vm.generation & 0xff_ffff {
            return Err(self.lost());
        }
        if *stream == Stream::NONE {
            let id = vm.new_context(self)?;
            *stream = stream_of(shard, vm.generation, id);
        }
        let result = f(vm, stream);
        if result.is_err() {
            tracing::warn!(plugin = %self.name, "proxy-wasm VM failed; a fresh one takes its place");
            self.count_restart();
            *slot = None;
            drop(slot);
            self.restart_later(shard);
        } else {
            tick::keep_ticking(self, shard, vm);
        }
        result
    }

    /// The VM of `stream` failed ending it: a fresh one takes its place
    /// (the request itself is answered already).
    pub(super) fn ending_failed(&self, stream: Stream, e: &PluginError) {
        let (shard, generation, _) = parts(stream);
        tracing::warn!(plugin = %self.name, error = %e, "proxy-wasm VM failed ending a request; a fresh one takes its place");
        let mut slot = self.slot(shard);
        if slot
            .as_ref()
            .is_some_and(|vm| vm.generation & 0xff_ffff == generation)
        {
            *slot = None;
            drop(slot);
            self.restart_later(shard);
        }
    }

    /// Counts a call made in a visit to the VM of `stream` beyond the
    /// one [`Self::on_vm`] counts.
    pub(super) fn count_call(&self, stream: Stream) {
        self.calls[parts(stream).0]
            .0
            .fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn lost(&self) -> PluginError {
        PluginError::Trap {
            plugin: self.name.clone(),
            message: "the request's VM failed on an earlier call".into(),
        }
    }
}
