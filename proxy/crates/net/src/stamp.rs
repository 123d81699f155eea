//! A request's time stamps: when its head arrived, when it was sent on,
//! and how long each took. Precise (unlike `coarse_clock`): a request's
//! duration is often under a millisecond, and it goes into histograms
//! and the access log.
//!
//! Hand-written for its cost (#66): `Instant::now` then `elapsed` cost
//! ~65 instructions a pair beyond the clock's own call (std's `Timespec`
//! carries seconds and nanoseconds apart and checks every step of their
//! subtraction), four to five pairs a request; here a stamp is one count
//! of nanoseconds, and a duration one subtraction.

use std::time::Duration;

/// A point on the monotonic clock (the one `Instant` reads), in
/// nanoseconds since the clock's own start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Stamp(u64);

impl Stamp {
    /// Now.
    #[inline]
    pub fn now() -> Stamp {
        let mut t = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `t` is a valid timespec to write; CLOCK_MONOTONIC exists
        // on every Linux (std's `Instant` reads it the same way), and on
        // failure `t` stays zero: durations read 0, never a fault.
        unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
        Stamp(t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64)
    }

    /// The time from this stamp to now (0 for a stamp from the future,
    /// which the clock never gives).
    #[inline]
    pub fn elapsed(self) -> Duration {
        Stamp::now().since(self)
    }

    /// The time from `earlier` to this stamp, 0 if it is later.
    #[inline]
    pub fn since(self, earlier: Stamp) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }

    /// The stamp `d` before this one (the clock's start at the earliest).
    pub fn before(self, d: Duration) -> Stamp {
        Stamp(
            self.0
                .saturating_sub(d.as_nanos().min(u128::from(u64::MAX)) as u64),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// It reads the clock `Instant` reads: a span measured by both, one
    /// inside the other, agrees to the nesting.
    #[test]
    fn measures_what_instant_measures() {
        let outer = Instant::now();
        let stamp = Stamp::now();
        let inner = Instant::now();
        std::thread::sleep(Duration::from_millis(20));
        let inner = inner.elapsed();
        let took = stamp.elapsed();
        let outer = outer.elapsed();
        assert!(took >= inner, "{took:?} < {inner:?}");
        assert!(took <= outer, "{took:?} > {outer:?}");
        assert!(took >= Duration::from_millis(20), "{took:?}");
    }

    #[test]
    fn durations_never_run_backwards() {
        let now = Stamp::now();
        let earlier = now.before(Duration::from_millis(30));
        assert_eq!(now.since(earlier), Duration::from_millis(30));
        assert_eq!(earlier.since(now), Duration::ZERO);
        assert_eq!(Stamp(5).before(Duration::from_secs(1)), Stamp(0));
    }
}
