//! What filters share across VMs (every worker's, every filter's, as in
//! Envoy with no `vm_id`): shared data with compare-and-swap, and the
//! metrics they define, counters into `portcullis_plugin_counter_total`,
//! gauges into `portcullis_plugin_gauge` and histograms into
//! `portcullis_plugin_histogram`, labelled with the plugin.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;
use wasmtime::{Caller, Linker};

use super::VmState;
use super::guest::{Status, give, read, write, write_u32};

/// Status codes only these calls return.
const CAS_MISMATCH: i32 = 8;
const INTERNAL_FAILURE: i32 = 10;

/// Shared data may hold this much in all (keys and values): a filter that
/// stores without end fails its requests instead of growing the proxy.
const MAX_SHARED_BYTES: usize = 16 << 20;

#[derive(Default)]
struct SharedData {
    /// Value and its CAS (1 on first set, +1 on each).
    entries: HashMap<Vec<u8>, (Bytes, u32)>,
    bytes: usize,
}

fn shared() -> &'static Mutex<SharedData> {
    static SHARED: OnceLock<Mutex<SharedData>> = OnceLock::new();
    SHARED.get_or_init(Default::default)
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
                data.entries.get(&key).cloned()
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
            let mut data = shared().lock().unwrap_or_else(|p| p.into_inner());
            let (old_len, current) = match data.entries.get(&key) {
                Some((v, now)) => (key.len() + v.len(), *now),
                None => (0, 0),
            };
            if cas != 0 && cas as u32 != current {
                return Ok(CAS_MISMATCH);
            }
            let bytes = data.bytes - old_len + key.len() + value.len();
            if bytes > MAX_SHARED_BYTES {
                return Ok(INTERNAL_FAILURE);
            }
            data.bytes = bytes;
            data.entries
                .insert(key, (value, current.wrapping_add(1).max(1)));
            Ok(Status::Ok as i32)
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
            let id = {
                let mut m = metrics().lock().unwrap_or_else(|p| p.into_inner());
                match m.ids.get(&key) {
                    Some(id) => *id,
                    None => {
                        m.defined.push(key.clone());
                        let id = m.defined.len() as u32;
                        m.ids.insert(key, id);
                        id
                    }
                }
            };
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
            let Some(key) = defined(id) else {
                return Ok(Status::NotFound as i32);
            };
            let value = match key.kind {
                COUNTER => crate::state::counters()
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&(key.plugin.clone(), key.name.clone()))
                    .copied()
                    .unwrap_or(0),
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
    let Some(key) = defined(id) else {
        return Status::NotFound as i32;
    };
    match key.kind {
        COUNTER => {
            let mut counters = crate::state::counters()
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let value = counters.entry((key.plugin, key.name)).or_default();
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
