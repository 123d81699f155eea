//! A plugin call's deadline, counted in CPU time its thread spent rather
//! than wall-clock time.
//!
//! The epoch ticker advances with the wall clock. Had the deadline been a
//! number of ticks, a call whose worker thread was descheduled (cores
//! shared with a busy neighbour, a host under load) would fail as a
//! timeout although the plugin used almost none of it: once in ~2 million
//! calls on the 2-core bench machine under full load. The deadline is
//! there to stop a plugin that spins, so it is measured in what spinning
//! uses: the thread's CPU time (calls are synchronous, on the caller's
//! thread, so that thread's CPU clock is the call's).
//!
//! Reading that clock is a system call (~0.1-0.2 us, not in the vDSO), too
//! much for every call of a header check that takes ~0.5 us. So a call is
//! armed to stop at the next tick, which most calls never reach; the first
//! tick a call does reach reads the clock once, and only a call still
//! running a whole deadline later reads it again. Before the first tick a
//! call runs at most one tick of wall time, so it can use at most the
//! deadline plus one tick of CPU: the same bound ticks alone gave.

use std::time::Duration;

use wasmtime::UpdateDeadline;

use super::TICK;

/// One instance's deadline state, reset by [`CpuDeadline::arm`] before
/// every call into the instance.
#[derive(Debug)]
pub struct CpuDeadline {
    budget: Duration,
    /// The thread's CPU time at the call's first tick.
    started: Option<Duration>,
}

impl CpuDeadline {
    /// A deadline of `budget` CPU time per call.
    pub fn new(budget: Duration) -> CpuDeadline {
        CpuDeadline {
            budget,
            started: None,
        }
    }

    /// Makes the budget `budget` from the next call on (a start has a
    /// budget of its own).
    pub fn set_budget(&mut self, budget: Duration) {
        self.budget = budget;
    }

    /// Starts a call: its first epoch tick must call [`Self::on_tick`]
    /// (the caller sets the store's epoch deadline to one tick).
    pub fn arm(&mut self) {
        self.started = None;
    }

    /// At an epoch tick the call reached: go on for as many ticks as the
    /// budget has left, or stop the call once its thread has used it.
    pub fn on_tick(&mut self) -> UpdateDeadline {
        self.at(thread_cpu_time())
    }

    /// [`Self::on_tick`] with the thread's CPU time given (`None` when the
    /// clock cannot be read: then the deadline falls back to ticks).
    fn at(&mut self, now: Option<Duration>) -> UpdateDeadline {
        match (self.started, now) {
            (None, now) => {
                self.started = Some(now.unwrap_or_default());
                UpdateDeadline::Continue(ticks(self.budget))
            }
            (Some(start), Some(now)) if now.saturating_sub(start) < self.budget => {
                UpdateDeadline::Continue(ticks(self.budget - now.saturating_sub(start)))
            }
            _ => UpdateDeadline::Interrupt,
        }
    }
}

/// Whole ticks covering `d`, at least one.
fn ticks(d: Duration) -> u64 {
    (d.as_nanos().div_ceil(TICK.as_nanos()) as u64).max(1)
}

/// CPU time the calling thread has used.
fn thread_cpu_time() -> Option<Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec for the call's duration.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return None;
    }
    Some(Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn continues(u: UpdateDeadline) -> Option<u64> {
        match u {
            UpdateDeadline::Continue(n) => Some(n),
            _ => None,
        }
    }

    #[test]
    fn the_first_tick_grants_the_whole_budget() {
        let mut d = CpuDeadline::new(Duration::from_millis(10));
        d.arm();
        assert_eq!(continues(d.at(Some(Duration::from_secs(5)))), Some(10));
    }

    #[test]
    fn ticks_without_cpu_time_do_not_end_the_call() {
        let mut d = CpuDeadline::new(Duration::from_millis(10));
        d.arm();
        let start = Duration::from_secs(5);
        d.at(Some(start));
        // A deadline's worth of ticks passed, but the thread ran 3 ms of
        // them: 7 ms are left, seven ticks.
        assert_eq!(
            continues(d.at(Some(start + Duration::from_millis(3)))),
            Some(7)
        );
        assert_eq!(
            continues(d.at(Some(start + Duration::from_micros(9_500)))),
            Some(1)
        );
    }

    #[test]
    fn the_call_stops_once_its_thread_used_the_budget() {
        let mut d = CpuDeadline::new(Duration::from_millis(10));
        d.arm();
        let start = Duration::from_secs(5);
        d.at(Some(start));
        assert!(matches!(
            d.at(Some(start + Duration::from_millis(10))),
            UpdateDeadline::Interrupt
        ));
    }

    #[test]
    fn arming_starts_the_next_call_afresh() {
        let mut d = CpuDeadline::new(Duration::from_millis(10));
        d.arm();
        d.at(Some(Duration::from_secs(5)));
        d.arm();
        assert_eq!(continues(d.at(Some(Duration::from_secs(9)))), Some(10));
    }

    #[test]
    fn without_a_cpu_clock_the_deadline_is_counted_in_ticks() {
        let mut d = CpuDeadline::new(Duration::from_millis(10));
        d.arm();
        assert_eq!(continues(d.at(None)), Some(10));
        assert!(matches!(d.at(None), UpdateDeadline::Interrupt));
    }

    #[test]
    fn the_thread_clock_counts_running_not_sleeping() {
        let mut d = CpuDeadline::new(Duration::from_millis(20));
        d.arm();
        assert!(continues(d.on_tick()).is_some());
        // Asleep for twice the budget: the thread used next to no CPU.
        std::thread::sleep(Duration::from_millis(40));
        assert!(continues(d.on_tick()).is_some());
        // Spinning for the budget uses it up.
        let spin = thread_cpu_time().expect("thread CPU clock");
        while thread_cpu_time().expect("thread CPU clock") - spin < Duration::from_millis(20) {
            std::hint::spin_loop();
        }
        assert!(matches!(d.on_tick(), UpdateDeadline::Interrupt));
    }
}
