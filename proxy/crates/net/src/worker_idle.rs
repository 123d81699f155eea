//! What a worker thread does when it runs out of work, at most once a
//! second: the binary's hook, which hands the allocator's freed pages
//! back to the system (mimalloc does so only on a thread's next
//! allocation, which an idle worker never makes: 2,000 parked
//! connections kept their freed buffers resident, 28 KiB each, until a
//! request came). Envoy's heap shrinker does the same for tcmalloc.
//!
//! Only when no request waits on the worker for its answer ([`Busy`]): a
//! worker also parks while a request waits on its upstream, and the hook
//! run then (after a reload, hundreds of `madvise` calls for the pages the
//! old policies freed) delayed that request: ~30% of what the first
//! request after a reload cost more than the rest (bench/first-request.sh).

use std::cell::Cell;
use std::sync::OnceLock;
use std::time::Duration;

/// The hook; its argument: whether to release everything now, however
/// recently freed (the allocator otherwise lets fresh frees settle).
static HOOK: OnceLock<fn(bool)> = OnceLock::new();

/// The least time between two runs of the hook on one thread.
const EVERY: Duration = Duration::from_secs(1);

thread_local! {
    /// When the hook last ran on this thread (the coarse clock's time).
    static LAST: Cell<Duration> = const { Cell::new(Duration::ZERO) };
    /// Requests on this thread waiting for their answers.
    static BUSY: Cell<usize> = const { Cell::new(0) };
}

/// A request waiting for its answer on this thread, from its arrival until
/// dropped: while any is, the worker's parks run no hook.
pub struct Busy(());

impl Busy {
    /// Counts a request in.
    #[inline]
    pub fn new() -> Busy {
        BUSY.with(|b| b.set(b.get() + 1));
        Busy(())
    }
}

impl Default for Busy {
    fn default() -> Busy {
        Busy::new()
    }
}

impl Drop for Busy {
    #[inline]
    fn drop(&mut self) {
        // Saturating: a runtime that moved a request between threads (none
        // of the workers' does) must not wrap the count.
        let _ = BUSY.try_with(|b| b.set(b.get().saturating_sub(1)));
    }
}

/// Sets the hook (once; the binary's choice of allocator knows what to
/// call).
pub fn set_hook(hook: fn(bool)) {
    let _ = HOOK.set(hook);
}

/// Runs the hook at once, releasing everything freed so far: for the
/// thread that applied a reload, once it has, so that what the old
/// policies and the new ones' start freed is given back there rather than
/// at a worker's next idle park, where it delayed the next request to
/// arrive by ~0.5 ms (bench/first-request.sh).
pub fn release_now() {
    if let Some(hook) = HOOK.get() {
        hook(true);
    }
}

/// Called by a worker's runtime each time the worker parks (tokio's
/// `on_thread_park`): runs the hook if a second has passed since this
/// thread last did and no request waits here. A few nanoseconds
/// otherwise.
pub fn parked() {
    let Some(hook) = HOOK.get() else { return };
    if BUSY.get() > 0 {
        return;
    }
    let now = crate::coarse_clock::coarse_now();
    if now.saturating_sub(LAST.get()) >= EVERY {
        LAST.set(now);
        hook(false);
    }
}

/// A current-thread runtime builder for a worker: the hook on park.
pub fn runtime() -> tokio::runtime::Builder {
    let mut builder = tokio::runtime::Builder::new_current_thread();
    builder.enable_all().on_thread_park(parked);
    builder
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A park while a request waits for its answer runs no hook; the park
    /// after it ends does, then none again within the second.
    #[test]
    fn a_waiting_request_keeps_the_hook_off_its_parks() {
        static RUNS: AtomicUsize = AtomicUsize::new(0);
        static FORCED: AtomicUsize = AtomicUsize::new(0);
        fn count(force: bool) {
            RUNS.fetch_add(1, Ordering::Relaxed);
            FORCED.fetch_add(usize::from(force), Ordering::Relaxed);
        }
        set_hook(count);
        let waiting = Busy::new();
        let other = Busy::new();
        parked();
        drop(waiting);
        parked();
        assert_eq!(RUNS.load(Ordering::Relaxed), 0, "ran while requests waited");
        drop(other);
        parked();
        assert_eq!(RUNS.load(Ordering::Relaxed), 1);
        parked();
        assert_eq!(RUNS.load(Ordering::Relaxed), 1, "ran twice within a second");
        assert_eq!(FORCED.load(Ordering::Relaxed), 0, "a park forced it");
        // After a reload: at once, forced, whatever the second.
        release_now();
        assert_eq!(RUNS.load(Ordering::Relaxed), 2);
        assert_eq!(FORCED.load(Ordering::Relaxed), 1);
    }
}
