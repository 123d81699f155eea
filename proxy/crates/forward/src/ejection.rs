//! Passive health: an endpoint whose connection could not be made sits
//! out of the rotation for a while (`eject_for`, default 10 s), as nginx
//! does with its defaults (`max_fails=1 fail_timeout=10s`). Without it,
//! a dead endpoint of two takes every other request: each pays a refused
//! connect and a retry, or a whole connect timeout when the address has
//! gone silent. Shared by all workers' pools of an upstream, so one
//! worker's failure spares the others the same attempt.
//!
//! Connect failures count at once: nothing was sent, so the failure says
//! the endpoint is unreachable, not that one request went wrong. With
//! `eject_after_5xx`, answers count too (Envoy's `consecutive_5xx`
//! outlier detection): that many 5xx in a row, or tries that got no
//! answer, and the endpoint is out as after a failed connect. One 503 is
//! a request gone wrong; five in a row is a pod that lost its database.
//!
//! Active health checks ([`super::health`]) mark endpoints down here too:
//! an endpoint is out while either says so.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Until when each endpoint of an upstream is out of the rotation.
pub struct Ejections {
    /// Milliseconds on [`now_ms`]'s clock; 0 while the endpoint is in, so
    /// the common case reads no clock.
    until_ms: Box<[AtomicU64]>,
    eject_for_ms: u64,
    /// Failing its active health check (until it passes again).
    down: Box<[AtomicBool]>,
    /// Failed answers in a row, counted when `eject_after` is not 0.
    fails: Box<[AtomicU32]>,
    eject_after: u32,
}

/// Milliseconds since the first call, plus one: never 0.
fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
}

impl Ejections {
    /// `endpoints` all in; `eject_for` zero turns ejection off;
    /// `eject_after` failed answers in a row take one out (0: answers do
    /// not count).
    pub fn new(endpoints: usize, eject_for: Duration, eject_after: u32) -> Ejections {
        Ejections {
            until_ms: (0..endpoints).map(|_| AtomicU64::new(0)).collect(),
            eject_for_ms: eject_for.as_millis() as u64,
            down: (0..endpoints).map(|_| AtomicBool::new(false)).collect(),
            fails: (0..endpoints).map(|_| AtomicU32::new(0)).collect(),
            eject_after,
        }
    }

    /// Gives endpoint `i` the state of endpoint `j` of `old` (the same
    /// endpoint before its upstream's endpoint list changed).
    pub fn take_over(&self, i: usize, old: &Ejections, j: usize) {
        let copy = |to: &AtomicU64, from: &AtomicU64| {
            to.store(from.load(Ordering::Relaxed), Ordering::Relaxed)
        };
        copy(&self.until_ms[i], &old.until_ms[j]);
        self.down[i].store(old.down[j].load(Ordering::Relaxed), Ordering::Relaxed);
        self.fails[i].store(old.fails[j].load(Ordering::Relaxed), Ordering::Relaxed);
    }

    /// Whether answers count ([`Ejections::answered`] is worth calling).
    pub fn counts_answers(&self) -> bool {
        self.eject_after > 0
    }

    /// Notes how endpoint `i` answered: with a 5xx or not at all
    /// (`failed`), or otherwise. True when this took it out (the caller
    /// logs the change once).
    pub fn answered(&self, i: usize, failed: bool) -> bool {
        let fails = &self.fails[i];
        if !failed {
            // Read first: a healthy endpoint's count stays 0, and its
            // cache line is not written on every answer.
            if fails.load(Ordering::Relaxed) != 0 {
                fails.store(0, Ordering::Relaxed);
            }
            return false;
        }
        if fails.fetch_add(1, Ordering::Relaxed) + 1 < self.eject_after {
            return false;
        }
        fails.store(0, Ordering::Relaxed);
        self.eject(i)
    }

    /// Takes endpoint `i` out after a failed connect. True when it was in
    /// until now (the caller logs the change once, not per request).
    pub fn eject(&self, i: usize) -> bool {
        if self.eject_for_ms == 0 {
            return false;
        }
        let was = self.until_ms[i].swap(now_ms() + self.eject_for_ms, Ordering::Relaxed);
        was == 0
    }

    /// Puts endpoint `i` back after a connect succeeded (it was tried
    /// because every endpoint was out, and it answers again).
    pub fn readmit(&self, i: usize) {
        if self.until_ms[i].load(Ordering::Relaxed) != 0 {
            self.until_ms[i].store(0, Ordering::Relaxed);
        }
    }

    /// Marks endpoint `i` down (failing its health check) or up.
    pub fn set_down(&self, i: usize, down: bool) {
        self.down[i].store(down, Ordering::Relaxed);
    }

    /// Whether endpoint `i` is failing its health check.
    pub fn is_down(&self, i: usize) -> bool {
        self.down[i].load(Ordering::Relaxed)
    }

    /// Whether endpoint `i` is out of the rotation now.
    pub fn is_out(&self, i: usize) -> bool {
        if self.is_down(i) {
            return true;
        }
        let until = self.until_ms[i].load(Ordering::Relaxed);
        if until == 0 {
            return false;
        }
        if now_ms() < until {
            return true;
        }
        // Its time is up: back in, and later checks skip the clock.
        let _ = self.until_ms[i].compare_exchange(until, 0, Ordering::Relaxed, Ordering::Relaxed);
        false
    }

    /// How long endpoint `i` stays out; `None` while it is in.
    pub fn remaining(&self, i: usize) -> Option<Duration> {
        let until = self.until_ms[i].load(Ordering::Relaxed);
        let now = now_ms();
        (until > now).then(|| Duration::from_millis(until - now))
    }

    /// The first endpoint that is in, walking the rotation from `start`.
    /// When every endpoint is out, `start`: a connect attempt that may
    /// succeed beats a certain 502 (Envoy's panic mode does the same).
    pub fn first_in(&self, start: usize, n: usize) -> usize {
        (0..n)
            .map(|k| (start + k) % n)
            .find(|&i| !self.is_out(i))
            .unwrap_or(start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ejected_endpoint_is_skipped_until_its_time_is_up() {
        let e = Ejections::new(3, Duration::from_millis(30), 0);
        assert_eq!(e.first_in(1, 3), 1);
        assert!(e.eject(1));
        assert!(!e.eject(1), "already out: not a new ejection");
        assert!(e.is_out(1));
        assert!(
            e.remaining(1)
                .is_some_and(|d| d <= Duration::from_millis(30))
        );
        assert_eq!(e.remaining(0), None);
        assert_eq!(e.first_in(1, 3), 2);
        std::thread::sleep(Duration::from_millis(40));
        assert!(!e.is_out(1));
        assert_eq!(e.first_in(1, 3), 1);
    }

    #[test]
    fn with_every_endpoint_out_the_rotation_goes_on_as_if_none_were() {
        let e = Ejections::new(2, Duration::from_secs(10), 0);
        e.eject(0);
        e.eject(1);
        assert_eq!(e.first_in(1, 2), 1);
        e.readmit(1);
        assert!(!e.is_out(1));
        assert!(e.is_out(0));
    }

    #[test]
    fn a_failing_health_check_takes_an_endpoint_out_whatever_its_connects() {
        let e = Ejections::new(3, Duration::ZERO, 0);
        e.set_down(1, true);
        assert!(e.is_out(1));
        assert_eq!(e.first_in(1, 3), 2);
        // A connect that worked does not bring it back; passing does.
        e.readmit(1);
        assert!(e.is_out(1));
        e.set_down(1, false);
        assert_eq!(e.first_in(1, 3), 1);
        // All down: the rotation goes on over all of them.
        (0..3).for_each(|i| e.set_down(i, true));
        assert_eq!(e.first_in(2, 3), 2);
    }

    #[test]
    fn failed_answers_in_a_row_take_an_endpoint_out() {
        let e = Ejections::new(2, Duration::from_secs(10), 3);
        assert!(!e.answered(0, true));
        assert!(!e.answered(0, true));
        // A good answer starts the count again.
        assert!(!e.answered(0, false));
        assert!(!e.answered(0, true));
        assert!(!e.answered(0, true));
        assert!(!e.is_out(0));
        assert!(e.answered(0, true));
        assert!(e.is_out(0));
        assert!(!e.is_out(1));
    }

    #[test]
    fn an_endpoint_that_stays_in_a_new_list_keeps_its_state() {
        let old = Ejections::new(3, Duration::from_secs(10), 2);
        old.eject(0);
        old.set_down(2, true);
        old.answered(1, true);
        // The new list: old 2, old 1, then a new endpoint.
        let new = Ejections::new(3, Duration::from_secs(10), 2);
        new.take_over(0, &old, 2);
        new.take_over(1, &old, 1);
        assert!(new.is_down(0) && new.is_out(0));
        assert!(!new.is_out(1));
        // One failed answer was counted before: one more takes it out.
        assert!(new.answered(1, true));
        assert!(!new.is_out(2));
    }

    #[test]
    fn zero_turns_ejection_off() {
        let e = Ejections::new(2, Duration::ZERO, 0);
        assert!(!e.eject(0));
        assert!(!e.is_out(0));
    }
}
