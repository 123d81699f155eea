//! The VMs a filter's uses share: one a worker slot, as Envoy keeps one
//! VM per worker for a module and VM configuration whatever the plugin
//! configs in it. A use made by a reload that changed only its `config`
//! joins its old use's VMs (its own root context in each, `vm::roots`)
//! instead of starting new ones, so its first request finds them warm.
//!
//! Envoy configures the new root context on the worker, stalling it for
//! the filter's `proxy_on_configure`. Here it is configured from the
//! reload's thread under the VM's lock, which a request on the old use on
//! that worker waits for: so a use joins only when the filter's last
//! configure took no longer than its per-request `timeout` (which bounds
//! any one call a request makes); a slower one gets VMs of its own, as
//! every use did before.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use bytes::Bytes;
use portcullis_net::shard::SHARDS;
use wasmtime::Module;

use super::{Count, ProxyWasm, VmSlot};

/// What uses must have alike to share VMs: the same module (compiled
/// once per content), VM configuration, name, root id and budgets.
struct Key {
    module: Module,
    vm_config: Bytes,
    name: Arc<str>,
    root_id: Arc<str>,
    budgets: (usize, Duration, Duration),
}

impl Key {
    fn same(&self, other: &Key) -> bool {
        Module::same(&self.module, &other.module)
            && self.vm_config == other.vm_config
            && self.name == other.name
            && self.root_id == other.root_id
            && self.budgets == other.budgets
    }
}

/// The VMs of one or more uses.
pub(super) struct VmSet {
    /// Each thread shard's VM: `None` until started, and after one
    /// failed.
    pub(super) vms: [VmSlot; SHARDS],
    /// 1 while a shard's VM is starting again off the request path.
    pub(super) restarting: [Count; SHARDS],
    /// Numbers the VMs, so a request's stream names the one it is on.
    pub(super) generations: AtomicU64,
    /// VMs dropped for a failure in the current second, and when it began.
    pub(super) restarts: Mutex<(std::time::Instant, u32)>,
    pub(super) memory_peak: Arc<AtomicUsize>,
    /// The uses it serves (a fresh VM configures a root context for each
    /// that is still alive).
    users: Mutex<Vec<Weak<ProxyWasm>>>,
    /// The longest a root context's configure took in it, in nanoseconds.
    configure_took: AtomicU64,
    /// What a use must have to join it (its module kept alive by the
    /// uses, which hold it anyway, not by the list of sets).
    key: Key,
}

/// The sets uses may join.
static SETS: Mutex<Vec<Weak<VmSet>>> = Mutex::new(Vec::new());

impl VmSet {
    fn new(key: Key) -> VmSet {
        VmSet {
            key,
            vms: std::array::from_fn(|_| VmSlot::default()),
            restarting: std::array::from_fn(|_| Count::default()),
            generations: AtomicU64::new(0),
            restarts: Mutex::new((std::time::Instant::now(), 0)),
            memory_peak: Default::default(),
            users: Mutex::new(Vec::new()),
            configure_took: AtomicU64::new(0),
        }
    }

    /// The set for a use of `module` with these settings: one that serves
    /// a use alike and configures within its `timeout`, or a new one. (A
    /// rollout's candidate is another plugin by name, so never shares the
    /// current version's VMs.)
    pub(super) fn for_use(module: &Module, settings: &super::Settings) -> Arc<VmSet> {
        let key = Key {
            module: module.clone(),
            vm_config: settings.vm_config.clone(),
            name: settings.name.clone(),
            root_id: settings.root_id.clone(),
            budgets: (settings.memory, settings.timeout, settings.start_timeout),
        };
        let mut sets = SETS.lock().unwrap_or_else(|p| p.into_inner());
        sets.retain(|set| set.strong_count() > 0);
        let within = u64::try_from(settings.timeout.as_nanos()).unwrap_or(u64::MAX);
        let joined = (sets.iter().filter_map(Weak::upgrade))
            .find(|set| set.key.same(&key) && set.configure_took.load(Ordering::Relaxed) <= within);
        if let Some(set) = joined {
            return set;
        }
        let set = Arc::new(VmSet::new(key));
        sets.push(Arc::downgrade(&set));
        set
    }

    /// Counts `filter` among the uses it serves.
    pub(super) fn serve(&self, filter: Weak<ProxyWasm>) {
        let mut users = self.users.lock().unwrap_or_else(|p| p.into_inner());
        users.retain(|u| u.strong_count() > 0);
        users.push(filter);
    }

    /// The uses it serves other than `but`.
    pub(super) fn others(&self, but: &ProxyWasm) -> Vec<Arc<ProxyWasm>> {
        let users = self.users.lock().unwrap_or_else(|p| p.into_inner());
        users
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|u| !std::ptr::eq(&**u, but))
            .collect()
    }

    /// Notes a root context's configure time.
    pub(super) fn configured_in(&self, took: Duration) {
        let nanos = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.configure_took.fetch_max(nanos, Ordering::Relaxed);
    }

    /// Shard `shard`'s VM slot, locked.
    pub(super) fn slot(&self, shard: usize) -> MutexGuard<'_, Option<Box<super::Vm>>> {
        self.vms[shard].0.lock().unwrap_or_else(|p| p.into_inner())
    }
}
