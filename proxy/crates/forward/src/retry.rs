//! What bounds `retry_on`'s retries: each try's own deadline
//! (`per_try_timeout`) and the retries an upstream lets run at once
//! (`retry_budget`), with the counts operators see.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use tokio::time::Sleep;

use portcullis_config::RetryBudget;

/// `fut`'s output, or `None` when `timer` (a try's deadline) goes off
/// first. The timer is boxed and made only for upstreams with a
/// `per_try_timeout`, so the others' requests carry 8 bytes for it.
pub(super) async fn within<F: Future>(timer: &mut Pin<Box<Sleep>>, fut: F) -> Option<F::Output> {
    tokio::select! {
        biased;
        out = fut => Some(out),
        () = timer.as_mut() => None,
    }
}

/// An upstream's retries, shared by the workers' pools.
#[derive(Debug, Default)]
pub struct RetryCounts {
    /// Retries in flight (the budget's count).
    retrying: AtomicUsize,
    /// Retries made since the upstream was set up.
    retried: AtomicU64,
    /// Retries the budget refused: the answer at hand was passed on.
    refused: AtomicU64,
}

impl RetryCounts {
    /// Retries made, and retries the budget refused.
    pub fn totals(&self) -> (u64, u64) {
        (
            self.retried.load(Ordering::Relaxed),
            self.refused.load(Ordering::Relaxed),
        )
    }
}

/// A request's place in the retry budget: none, or the one its retry
/// under way holds, given back when the next try takes one or when the
/// request is done with its tries. Atomic only to be shareable by the
/// closures that decide on retries across awaits; one request's tries
/// never race.
pub(super) struct RetrySlot<'a> {
    counts: &'a RetryCounts,
    held: AtomicBool,
}

impl<'a> RetrySlot<'a> {
    pub(super) fn new(counts: &'a RetryCounts) -> RetrySlot<'a> {
        RetrySlot {
            counts,
            held: AtomicBool::new(false),
        }
    }

    /// Takes a place for one more retry under `budget`, with `requests`
    /// requests in flight to the upstream; false when the budget is spent.
    pub(super) fn take(&self, budget: &RetryBudget, requests: usize) -> bool {
        // The place of the try before is given back first: that try is
        // over, and should not count against this one.
        self.give_back();
        let retrying = self.counts.retrying.fetch_add(1, Ordering::Relaxed);
        if budget.allows(retrying, requests) {
            self.counts.retried.fetch_add(1, Ordering::Relaxed);
            self.held.store(true, Ordering::Relaxed);
            true
        } else {
            self.counts.retrying.fetch_sub(1, Ordering::Relaxed);
            self.counts.refused.fetch_add(1, Ordering::Relaxed);
            false
        }
    }

    fn give_back(&self) {
        // A load, not a swap: every request drops a slot, and almost
        // none holds a place; a locked read-modify-write each would cost
        // cycles for nothing. Only this request's task touches the flag.
        if self.held.load(Ordering::Relaxed) {
            self.held.store(false, Ordering::Relaxed);
            self.counts.retrying.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl Drop for RetrySlot<'_> {
    fn drop(&mut self) {
        self.give_back();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_is_a_share_of_requests_with_a_floor() {
        let budget = RetryBudget {
            percent: 20,
            min_concurrent: 3,
        };
        // Few requests: the floor.
        assert!(budget.allows(2, 1));
        assert!(!budget.allows(3, 1));
        // Many: a fifth of them.
        assert!(budget.allows(19, 100));
        assert!(!budget.allows(20, 100));
    }

    #[test]
    fn a_place_is_held_until_given_back_and_refusals_are_counted() {
        let counts = RetryCounts::default();
        let budget = RetryBudget {
            percent: 1,
            min_concurrent: 1,
        };
        let (a, b) = (RetrySlot::new(&counts), RetrySlot::new(&counts));
        assert!(a.take(&budget, 2));
        assert!(!b.take(&budget, 2), "one retry already in flight");
        // A second retry of the same request replaces its first.
        assert!(a.take(&budget, 2));
        drop(a);
        assert!(b.take(&budget, 2));
        assert_eq!(counts.totals(), (3, 1));
    }
}
