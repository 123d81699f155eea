//! Per-thread shards for state the workers touch on every request (plugin
//! instances, request metrics): each thread takes its own slot, so two
//! workers never write the same cache line.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Slots per sharded structure. More threads than this share slots, which
/// stays correct (the slots are synchronized) and merely contends.
pub const SHARDS: usize = 16;

/// This thread's slot, given out round-robin on first use.
pub fn this_thread() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
    }
    SHARD.with(|s| *s)
}
