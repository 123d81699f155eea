//! Changing a running server: a new config applied (listeners opened, kept or closed, the pipeline swapped), and what it reports of its listeners.

use super::*;

/// What a reload changed in the listeners.
#[derive(Debug, Default)]
pub struct ListenerChanges {
    /// Listeners bound by this reload, with their addresses.
    pub added: Vec<(String, SocketAddr)>,
    /// Listeners closed by this reload.
    pub removed: Vec<(String, SocketAddr)>,
    /// Complete when every socket of the removed listeners is closed.
    pub closing: Vec<mpsc::Receiver<()>>,
}

impl ListenerChanges {
    /// Waits until the removed listeners refuse connections (their open
    /// connections may still be finishing).
    pub async fn closed(&mut self) {
        for c in &mut self.closing {
            while c.recv().await.is_some() {}
        }
    }
}

impl Control {
    /// Swaps in a new configuration whose plugins are already prepared:
    /// binds listeners it adds (and fails whole, changing nothing, when one
    /// cannot be bound), swaps the pipeline (requests in flight keep the old
    /// one; the next request on any connection gets the new one), then
    /// starts the new listeners and closes the removed ones, whose open
    /// connections finish their requests. Listeners both versions have keep
    /// their sockets and connections.
    pub fn apply(
        &self,
        config: Config,
        chains: portcullis_plugin::Chains,
    ) -> Result<ListenerChanges, ServeError> {
        let mut active = self.active();
        let mut fresh = Vec::new();
        for spec in self.opens.opened(&config)? {
            if !active.iter().any(|a| a.is(spec)) {
                // An error drops the sockets bound so far, which closes them.
                fresh.push((spec.clone(), bind_sockets(spec, self.workers)?));
            }
        }
        let config = self.addresses.expand(config);
        let previous = self.pipeline.load_full();
        let config = Arc::new(config);
        self.swap_pipeline(Pipeline::new(
            config.clone(),
            chains,
            self.shared.clone(),
            self.workers,
            Some(&previous),
        ));
        // What the plugins taken out of the policies left in what
        // plugins share goes with them.
        let removed: Vec<Arc<str>> = (previous.config().plugins.iter())
            .filter(|p| !config.plugins.iter().any(|n| n.name == p.name))
            .map(|p| p.name.clone())
            .collect();
        portcullis_plugin::forget_plugins(&removed);
        drop(previous);
        // What the old policies and the new ones' start freed goes back to
        // the system here, off the workers (`worker_idle::release_now`).
        portcullis_net::worker_idle::release_now();
        self.addresses.config_applied();

        let mut changes = ListenerChanges::default();
        let mut kept = Vec::with_capacity(config.listeners.len());
        for a in active.drain(..) {
            match config.listeners.iter().find(|s| a.is(s)) {
                Some(spec) => {
                    let settings = ListenerSettings::new(spec, Some(&a.settings.load()), a.addr);
                    if let Some(endpoint) = &a.http3 {
                        http3::reconfigure(endpoint, &settings);
                    }
                    a.settings.store(Arc::new(settings));
                    kept.push(a);
                }
                None => {
                    tracing::info!(listener = %a.name, addr = %a.addr, "listener removed; closing it");
                    a.stop.cancel();
                    changes.removed.push((a.name, a.addr));
                    changes.closing.push(a.closed);
                }
            }
        }
        for (spec, bound) in fresh {
            let addr = bound.0;
            tracing::info!(listener = %spec.name, addr = %addr, workers = self.workers, http3 = spec.http3.is_some(), "listening");
            changes.added.push((spec.name.clone(), addr));
            kept.push(self.start_listener(&spec, bound));
        }
        *active = kept;
        Ok(changes)
    }

    /// Hands each worker its socket of a listener.
    pub(super) fn start_listener(
        &self,
        spec: &Listener,
        (addr, sockets, udp): Bound,
    ) -> ActiveListener {
        let settings = ListenerSettings::new(spec, None, addr);
        let settings = Arc::new(ArcSwap::from_pointee(settings));
        let stop = self.stop_accepting.child_token();
        let (open, closed) = mpsc::channel(1);
        let (balance, inboxes) = Balance::new(self.workers);
        for ((socket, worker), inbox) in sockets.into_iter().zip(&self.to_workers).zip(inboxes) {
            // A worker that is gone has stopped serving anyway.
            let _ = worker.send(WorkerCommand::Listen {
                socket,
                settings: settings.clone(),
                stop: stop.clone(),
                open: open.clone(),
                balance: balance.clone(),
                inbox,
            });
        }
        let http3 = udp.map(|udp| self.start_http3(udp, &settings, &stop));
        ActiveListener {
            name: spec.name.clone(),
            bind: spec.bind,
            addr,
            settings,
            stop,
            closed,
            http3,
        }
    }

    /// The bound address of each listener, by name.
    pub fn local_addrs(&self) -> Vec<(String, SocketAddr)> {
        self.active()
            .iter()
            .map(|l| (l.name.clone(), l.addr))
            .collect()
    }

    /// Each listener with its open connections.
    pub fn listeners(&self) -> Vec<ListenerStatus> {
        self.active()
            .iter()
            .map(|l| {
                let s = l.settings.load();
                let max = s.spec.max_connections;
                ListenerStatus {
                    name: l.name.clone(),
                    addr: l.addr,
                    connections: max.saturating_sub(s.limit.available_permits()),
                    max_connections: max,
                    http3: l.http3.is_some(),
                    tls: s
                        .spec
                        .tls
                        .as_ref()
                        .map(|t| (t.client_auth, t.certificates.expiries())),
                }
            })
            .collect()
    }

    pub(super) fn active(&self) -> std::sync::MutexGuard<'_, Vec<ActiveListener>> {
        // Nothing under this lock is expected to panic; if something did,
        // the listeners still serve and the list is the best record left.
        self.listeners.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `task` on worker `worker % workers`, in that worker's runtime.
    pub fn spawn_on_worker(
        &self,
        worker: usize,
        task: impl FnOnce(WorkerContext) -> LocalTask + Send + 'static,
    ) {
        let _ = self.to_workers[worker % self.workers].send(WorkerCommand::Spawn(Box::new(task)));
    }

    /// The number of worker threads.
    pub fn workers(&self) -> usize {
        self.workers
    }

    /// The configuration serving new requests now.
    pub fn pipeline(&self) -> Arc<Pipeline> {
        self.pipeline.load_full()
    }

    /// What `dns: each_address` upstreams' hosts resolved to.
    pub fn addresses(&self) -> &crate::discovery::AddressBook {
        &self.addresses
    }

    /// Looks up the `each_address` hosts of `config` (a reload's, before
    /// [`Control::apply`]) that were never resolved, so a new upstream
    /// starts out spread over its addresses.
    pub async fn look_up_new_hosts(&self, config: &Config) {
        let new: Vec<_> = crate::discovery::hosts(config)
            .into_keys()
            .filter(|hp| !self.addresses.knows(hp))
            .collect();
        if !new.is_empty() {
            self.addresses.look_up(new, config).await;
        }
    }

    /// Swaps in the serving configuration with its `each_address`
    /// upstreams listing the addresses known now, when that changes them.
    /// Only those upstreams change: the others keep their pools, and they
    /// keep the connections of the addresses that stayed.
    pub fn refresh_addresses(&self) {
        // Held as `apply` holds it: a reload and a refresh never interleave.
        let _active = self.active();
        let current = self.pipeline.load_full();
        let Some(config) = self.addresses.expanded(current.config()) else {
            return;
        };
        self.swap_pipeline(Pipeline::new(
            Arc::new(config),
            current.chains().clone(),
            self.shared.clone(),
            self.workers,
            Some(&current),
        ));
    }

    /// Serves new requests with `pipeline`, and has each worker let go of
    /// its handle on the old one (an idle worker would keep it).
    fn swap_pipeline(&self, pipeline: Pipeline) {
        self.pipeline.store(Arc::new(pipeline));
        for worker in 0..self.workers {
            self.spawn_on_worker(worker, |ctx| {
                Box::pin(async move { crate::pipeline::let_go_if_stale(&ctx.pipeline) })
            });
        }
    }

    /// The serving state (readiness, drain).
    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }
}
