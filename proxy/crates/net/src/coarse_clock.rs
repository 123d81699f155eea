//! The coarse monotonic clock for bookkeeping that needs no precision
//! (idle connections, connection lifetimes, a body's last progress).

use std::time::Duration;

/// The coarse monotonic clock: a few milliseconds of resolution, plenty
/// for idle timeouts of seconds, and read from the vDSO without the time
/// stamp counter (~3 ns against ~25 for `Instant::now`, on every request's
/// checkout and return of a connection). Through the C library, whose
/// vDSO lookup tools such as valgrind support (rustix's own lookup faults
/// under valgrind).
pub fn coarse_now() -> Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec to write; this clock exists on every
    // Linux since 2.6.32, and on failure `t` stays zero (no idle timeout
    // then, never a fault).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut t) };
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// The coarse real-time clock's whole seconds since the Unix epoch, for
/// fields of whole seconds (an answer's `Date`); 0 when it cannot be
/// read.
pub fn coarse_wall_seconds() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: as in `coarse_now`.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME_COARSE, &mut t) };
    t.tv_sec as u64
}

/// A duration in whole milliseconds (plain integer work, unlike
/// `as_millis`'s 128 bits): deadlines on [`coarse_now`]'s clock.
pub fn millis(d: Duration) -> u64 {
    d.as_secs() * 1000 + u64::from(d.subsec_millis())
}
