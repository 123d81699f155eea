//! Ticks: `proxy_set_tick_period_milliseconds` from a root context, and
//! `proxy_on_tick` called on it every period for as long as its VM lives,
//! as Envoy runs a timer per VM on its worker. A tick that fails drops
//! the VM as a failed request call does (and ends its ticks).

use std::sync::Weak;
use std::time::Duration;

use wasmtime::{Caller, Linker};

use super::vm::Vm;
use super::{ProxyWasm, VmState};

/// Adds the tick call to `linker`.
pub fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_set_tick_period_milliseconds",
        |mut c: Caller<'_, VmState>, ms: i32| -> wasmtime::Result<i32> {
            let ms = ms as u32;
            // The epoch ticks each millisecond: a shorter period is one.
            c.data_mut().tick = (ms > 0).then(|| Duration::from_millis(u64::from(ms)));
            Ok(0)
        },
    )?;
    Ok(())
}

/// Starts (or stops) `vm`'s ticks when its filter changed their period;
/// on a thread outside a runtime (a `check`), nothing ticks.
#[inline]
pub fn keep_ticking(filter: &ProxyWasm, shard: usize, vm: &mut Vm) {
    // After every call of every request: the check inline, the rest not.
    if vm.tick_period() != vm.ticking {
        tick_anew(filter, shard, vm);
    }
}

#[cold]
fn tick_anew(filter: &ProxyWasm, shard: usize, vm: &mut Vm) {
    let wanted = vm.tick_period();
    vm.ticking = wanted;
    let (Some(period), Ok(runtime)) = (wanted, tokio::runtime::Handle::try_current()) else {
        return;
    };
    let ticker = Ticker {
        filter: filter.me.clone(),
        shard,
        generation: vm.generation,
        period,
    };
    runtime.spawn(ticker.run());
}

struct Ticker {
    filter: Weak<ProxyWasm>,
    shard: usize,
    generation: u64,
    period: Duration,
}

impl Ticker {
    /// Ticks until the VM is gone, its period changed, or its use was
    /// dropped (a reload).
    async fn run(self) {
        let mut every = tokio::time::interval(self.period);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // The first tick is at once; Envoy's first is a period away.
        every.tick().await;
        loop {
            every.tick().await;
            let Some(filter) = self.filter.upgrade() else {
                return;
            };
            let home = super::queue::Home {
                filter: self.filter.clone(),
                shard: self.shard,
                generation: self.generation,
            };
            let mut going = false;
            filter.on_home(&home, |vm, filter| {
                going = vm.ticking == Some(self.period);
                if going { vm.tick(filter) } else { Ok(()) }
            });
            if !going {
                return;
            }
        }
    }
}
