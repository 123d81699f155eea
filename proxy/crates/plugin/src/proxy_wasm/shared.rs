//! What filters share across VMs (every worker's, every filter's, as in
//! Envoy with no `vm_id`): shared data with compare-and-swap, and the
//! metrics they define, counters into `portcullis_plugin_counter_total`,
//! gauges into `portcullis_plugin_gauge` and histograms into
//! `portcullis_plugin_histogram`, labelled with the plugin.
//!
//! Each plugin has a share of shared data ([`SHARED_BYTES_PER_PLUGIN`]:
//! the keys and values whose current value it wrote), so one that stores
//! without end fails its own writes, never another's; and a plugin removed
//! from the policies takes its entries with it ([`forget_plugins`]). Each
//! defines at most `containment::MAX_OWN_NAMES` metrics.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;
use wasmtime::{Caller, Linker};

use super::VmState;
use super::guest::{Status, give, read, write, write_u32};
use crate::containment::{self, MAX_NAME_LEN, MAX_OWN_NAMES};

/// Status codes only these calls return.
const CAS_MISMATCH: i32 = 8;
const INTERNAL_FAILURE: i32 = 10;

/// What one plugin's shared data may hold (keys and values it wrote): a
/// filter that stores without end fails its own writes (`INTERNAL_FAILURE`,
/// counted as `shared_data_refused`) instead of growing the proxy, and
/// the others keep their room.
pub const SHARED_BYTES_PER_PLUGIN: usize = 16 << 20;

/// The id given for a metric definition refused (past the plugin's
/// names): calls on it succeed and keep nothing, so the filter carries on.
const SINK: u32 = u32::MAX;

/// A value in shared data.
struct Entry {
    value: Bytes,
    /// 1 on first set, +1 on each.
    cas: u32,
    /// The plugin whose write this value is: its share holds it.
    owner: Arc<str>,
}

#[derive(Default)]
struct SharedData {
    entries: HashMap<Vec<u8>, Entry>,
    /// Bytes (keys and values) each plugin's entries hold.
    bytes: HashMap<Arc<str>, usize>,
}

fn shared() -> &'static Mutex<SharedData> {
    static SHARED: OnceLock<Mutex<SharedData>> = OnceLock::new();
    SHARED.get_or_init(Default::default)
}

/// Drops the shared data `removed` plugins wrote: called when a reload
/// takes them out of the policies, so a filter that filled its share
/// leaves nothing behind once it is gone.
pub fn forget_plugins(removed: &[Arc<str>]) {
    if removed.is_empty() {
        return;
    }
    let removed: HashSet<&str> = removed.iter().map(|p| &**p).collect();
    let mut data = shared().lock().unwrap_or_else(|p| p.into_inner());
    data.entries.retain(|_, e| !removed.contains(&*e.owner));
    data.bytes.retain(|p, _| !removed.contains(&**p));
}

/// The bytes (keys and values) of `plugin`'s shared data now.
pub fn shared_bytes(plugin: &str) -> usize {
    let data = shared().lock().unwrap_or_else(|p| p.into_inner());
    data.bytes.get(plugin).copied().unwrap_or(0)
}

/// Stores `value` under `key` for `plugin`, if `cas` (when not 0) is the
/// entry's and the plugin's share has room: the status to return.
fn store(plugin: &Arc<str>, key: Vec<u8>, value: Bytes, cas: u32) -> i32 {
    let mut data = shared().lock().unwrap_or_else(|p| p.into_inner());
    let (old_len, current, old_owner) = match data.entries.get(&key) {
        Some(e) => (key.len() + e.value.len(), e.cas, Some(e.owner.clone())),
        None => (0, 0, None),
    };
    if cas != 0 && cas != current {
        return CAS_MISMATCH;
    }
    let own_old = if old_owner.as_ref() == Some(plugin) {
        old_len
    } else {
        0
    };
    let had = data.bytes.get(plugin).copied().unwrap_or(0);
    let after = had - own_old + key.len() + value.len();
    if after > SHARED_BYTES_PER_PLUGIN {
        drop(data);
        containment::count(plugin, "shared_data_refused");
        return INTERNAL_FAILURE;
    }
    // The value another plugin wrote leaves its share.
    if let Some(owner) = old_owner.filter(|o| o != plugin)
        && let Some(b) = data.bytes.get_mut(&owner)
    {
        *b -= old_len;
    }
    data.bytes.insert(plugin.clone(), after);
    let entry = Entry {
        value,
        cas: current.wrapping_add(1).max(1),
        owner: plugin.clone(),
    };
    data.entries.insert(key, entry);
    Status::Ok as i32
}

/// A metric a filter defined: its plugin, name and kind.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct MetricKey {
    plugin: Arc<str>,
    name: String,
    kind: i32,
}

#[derive(Default)]
struct Metrics {
    /// By id - 1.
    defined: Vec<MetricKey>,
    ids: HashMap<MetricKey, u32>,
    /// Metrics each plugin defined.
    per_plugin: HashMap<Arc<str>, usize>,
    gauges: HashMap<(Arc<str>, String), i64>,
    histograms: HashMap<(Arc<str>, String), Histogram>,
}

/// Envoy's default histogram bucket bounds (its `supported_buckets`).
pub const BUCKETS: [f64; 19] = [
    0.5, 1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 2500.0, 5000.0, 10000.0, 30000.0,
    60000.0, 300000.0, 600000.0, 1800000.0, 3600000.0,
];

/// A histogram's values: how many fell at or under each of [`BUCKETS`]
/// (not cumulative), their sum and count.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    pub buckets: [u64; BUCKETS.len()],
    pub sum: f64,
    pub count: u64,
}

fn metrics() -> &'static Mutex<Metrics> {
    static METRICS: OnceLock<Mutex<Metrics>> = OnceLock::new();
    METRICS.get_or_init(Default::default)
}

const COUNTER: i32 = 0;
const GAUGE: i32 = 1;
const HISTOGRAM: i32 = 2;

/// Every gauge filters set, by plugin and name, for `/metrics`.
pub fn gauges() -> Vec<((Arc<str>, String), i64)> {
    let m = metrics().lock().unwrap_or_else(|p| p.into_inner());
    let mut all: Vec<_> = m.gauges.iter().map(|(k, v)| (k.clone(), *v)).collect();
    all.sort();
    all
}

/// Every histogram filters recorded into, by plugin and name.
pub fn histograms() -> Vec<((Arc<str>, String), Histogram)> {
    let m = metrics().lock().unwrap_or_else(|p| p.into_inner());
    let mut all: Vec<_> = m
        .histograms
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all
}

/// Adds the shared-data and metric calls to `linker`.
pub fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    type C<'a> = Caller<'a, VmState>;
    type R = wasmtime::Result<i32>;
    linker.func_wrap(
        "env",
        "proxy_get_shared_data",
        |mut c: C<'_>, key_ptr: i32, key_len: i32, ret_ptr: i32, ret_len: i32, ret_cas: i32| -> R {
            let key = read(&mut c, key_ptr, key_len)?;
            let found = {
                let data = shared().lock().unwrap_or_else(|p| p.into_inner());
                data.entries.get(&key).map(|e| (e.value.clone(), e.cas))
            };
            let Some((value, cas)) = found else {
                return Ok(Status::NotFound as i32);
            };
            write_u32(&mut c, ret_cas, cas)?;
            if value.is_empty() {
                return Ok(Status::Ok as i32);
            }
            give(&mut c, &value, (ret_ptr, ret_len))
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_set_shared_data",
        |mut c: C<'_>, key_ptr: i32, key_len: i32, ptr: i32, len: i32, cas: i32| -> R {
            let key = read(&mut c, key_ptr, key_len)?;
            let value = Bytes::from(read(&mut c, ptr, len)?);
            Ok(store(&c.data().plugin, key, value, cas as u32))
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_define_metric",
        |mut c: C<'_>, kind: i32, name_ptr: i32, name_len: i32, ret_id: i32| -> R {
            if !(COUNTER..=HISTOGRAM).contains(&kind) {
                return Ok(Status::BadArgument as i32);
            }
            let name = String::from_utf8_lossy(&read(&mut c, name_ptr, name_len)?).into_owned();
            let key = MetricKey {
                plugin: c.data().plugin.clone(),
                name,
                kind,
            };
            let id = define(key);
            write_u32(&mut c, ret_id, id)?;
            Ok(Status::Ok as i32)
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_increment_metric",
        |_: C<'_>, id: i32, delta: i64| -> R {
            Ok(update(id, |value| value.saturating_add(delta)))
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_record_metric",
        |_: C<'_>, id: i32, value: i64| -> R {
            if id as u32 == SINK {
                return Ok(Status::Ok as i32);
            }
            if let Some(key) = defined(id).filter(|k| k.kind == HISTOGRAM) {
                record(key, value);
                return Ok(Status::Ok as i32);
            }
            Ok(update(id, |_| value))
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_metric",
        |mut c: C<'_>, id: i32, ret: i32| -> R {
            if id as u32 == SINK {
                write(&mut c, ret, &0u64.to_le_bytes())?;
                return Ok(Status::Ok as i32);
            }
            let Some(key) = defined(id) else {
                return Ok(Status::NotFound as i32);
            };
            let value = match key.kind {
                COUNTER => containment::counters()
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&key.plugin, &key.name),
                GAUGE => {
                    let m = metrics().lock().unwrap_or_else(|p| p.into_inner());
                    m.gauges.get(&(key.plugin, key.name)).copied().unwrap_or(0) as u64
                }
                _ => return Ok(Status::BadArgument as i32),
            };
            write(&mut c, ret, &value.to_le_bytes())?;
            Ok(Status::Ok as i32)
        },
    )?;
    Ok(())
}

/// The id of metric `key`, defined now if new and within its plugin's
/// names; [`SINK`] if refused (counted as `metrics_refused`).
fn define(key: MetricKey) -> u32 {
    let mut m = metrics().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(id) = m.ids.get(&key) {
        return *id;
    }
    let defined = m.per_plugin.entry(key.plugin.clone()).or_default();
    if *defined >= MAX_OWN_NAMES || key.name.len() > MAX_NAME_LEN {
        drop(m);
        containment::count(&key.plugin, "metrics_refused");
        return SINK;
    }
    *defined += 1;
    m.defined.push(key.clone());
    let id = m.defined.len() as u32;
    m.ids.insert(key, id);
    id
}

fn defined(id: i32) -> Option<MetricKey> {
    let m = metrics().lock().unwrap_or_else(|p| p.into_inner());
    m.defined.get((id as u32).checked_sub(1)? as usize).cloned()
}

/// Records `value` in a histogram, as Envoy's record of an unsigned
/// value (a negative one is a huge one there; here it counts as 0).
fn record(key: MetricKey, value: i64) {
    let value = value.max(0) as f64;
    let mut m = metrics().lock().unwrap_or_else(|p| p.into_inner());
    let h = m.histograms.entry((key.plugin, key.name)).or_default();
    if let Some(i) = BUCKETS.iter().position(|le| value <= *le) {
        h.buckets[i] += 1;
    }
    h.sum += value;
    h.count += 1;
}

/// Sets metric `id` to `f` of its value. Counters only go up (as
/// Prometheus requires); a histogram is recorded into, not set or
/// incremented (`BadArgument`, as from Envoy).
fn update(id: i32, f: impl FnOnce(i64) -> i64) -> i32 {
    if id as u32 == SINK {
        return Status::Ok as i32;
    }
    let Some(key) = defined(id) else {
        return Status::NotFound as i32;
    };
    match key.kind {
        COUNTER => {
            let mut counters = containment::counters()
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let value = counters.value_mut(&key.plugin, &key.name);
            let next = f(*value as i64);
            if next < *value as i64 {
                return Status::BadArgument as i32;
            }
            *value = next as u64;
        }
        GAUGE => {
            let mut m = metrics().lock().unwrap_or_else(|p| p.into_inner());
            let value = m.gauges.entry((key.plugin, key.name)).or_default();
            *value = f(*value);
        }
        _ => return Status::BadArgument as i32,
    }
    Status::Ok as i32
}
