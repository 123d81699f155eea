//! Per-thread shards for state the workers touch on every request (plugin
//! instances, request metrics): each thread takes its own slot, so two
//! workers never write the same cache line.
//!
//! A worker thread claims the slot of its index ([`claim`]), so what is
//! made for the workers before they serve (a proxy-wasm filter's VMs, a
//! component's first instances) is made for slots `0..workers`; other
//! threads take slots in turn on first use.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Slots per sharded structure. More threads than this share slots, which
/// stays correct (the slots are synchronized) and merely contends.
pub const SHARDS: usize = 16;

thread_local! {
    static SHARD: Cell<Option<usize>> = const { Cell::new(None) };
}

/// This thread's slot: the one it claimed, or one given out round-robin
/// on first use.
pub fn this_thread() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    SHARD.with(|s| match s.get() {
        Some(shard) => shard,
        None => {
            let shard = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
            s.set(Some(shard));
            shard
        }
    })
}

/// Makes this thread's slot worker `worker`'s (`worker % SHARDS`).
pub fn claim(worker: usize) {
    SHARD.with(|s| s.set(Some(worker % SHARDS)));
}

/// The slots `workers` worker threads claim.
pub fn of_workers(workers: usize) -> std::ops::Range<usize> {
    0..workers.clamp(1, SHARDS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_thread_has_the_slot_it_claimed() {
        std::thread::spawn(|| {
            claim(SHARDS + 3);
            assert_eq!(this_thread(), 3);
        })
        .join()
        .unwrap();
        assert_eq!(of_workers(4), 0..4);
        assert_eq!(of_workers(64), 0..SHARDS);
    }
}
