//! What a worker thread does when it runs out of work, at most once a
//! second: the binary's hook, which hands the allocator's freed pages
//! back to the system (mimalloc does so only on a thread's next
//! allocation, which an idle worker never makes: 2,000 parked
//! connections kept their freed buffers resident, 28 KiB each, until a
//! request came). Envoy's heap shrinker does the same for tcmalloc.

use std::cell::Cell;
use std::sync::OnceLock;
use std::time::Duration;

static HOOK: OnceLock<fn()> = OnceLock::new();

/// The least time between two runs of the hook on one thread.
const EVERY: Duration = Duration::from_secs(1);

thread_local! {
    /// When the hook last ran on this thread (the coarse clock's time).
    static LAST: Cell<Duration> = const { Cell::new(Duration::ZERO) };
}

/// Sets the hook (once; the binary's choice of allocator knows what to
/// call).
pub fn set_hook(hook: fn()) {
    let _ = HOOK.set(hook);
}

/// Called by a worker's runtime each time the worker parks (tokio's
/// `on_thread_park`): runs the hook if a second has passed since this
/// thread last did. A few nanoseconds otherwise.
pub fn parked() {
    let Some(hook) = HOOK.get() else { return };
    let now = crate::coarse_clock::coarse_now();
    if now.saturating_sub(LAST.get()) >= EVERY {
        LAST.set(now);
        hook();
    }
}

/// A current-thread runtime builder for a worker: the hook on park.
pub fn runtime() -> tokio::runtime::Builder {
    let mut builder = tokio::runtime::Builder::new_current_thread();
    builder.enable_all().on_thread_park(parked);
    builder
}
