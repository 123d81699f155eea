//! Wrong peer tokens, counted by source address: after
//! [`MAX_FAILURES`] in a [`WINDOW`], the address's wrong tokens are
//! answered 429 after [`LOCKED_OUT_DELAY`] for the rest of it, and logged
//! once, not once per attempt. A real peer shares the token and is never
//! kept out (a good token is served from any address, so a guesser
//! behind the same NAT cannot lock it out); someone guessing is slowed to
//! a try per second per stream, and cannot flood the log.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Wrong tokens an address may present in a window.
pub const MAX_FAILURES: u32 = 10;
/// The window, from an address's first failure.
pub const WINDOW: Duration = Duration::from_secs(60);
/// How long a locked-out address's wrong token waits for its 429.
pub const LOCKED_OUT_DELAY: Duration = Duration::from_secs(1);
/// Addresses tracked at most; past this, windows that ended are dropped
/// (an attacker with many addresses costs this much memory, no more).
const MAX_TRACKED: usize = 100_000;

/// Failures by source address: how many, since when.
#[derive(Default)]
pub struct Refusals {
    failures: Mutex<HashMap<IpAddr, (u32, Instant)>>,
}

impl Refusals {
    /// How long `from` is refused yet, if it is locked out.
    pub fn locked_out(&self, from: IpAddr) -> Option<Duration> {
        let failures = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        let (count, since) = failures.get(&from)?;
        let left = WINDOW.checked_sub(since.elapsed())?;
        (*count >= MAX_FAILURES).then_some(left)
    }

    /// Counts a wrong token from `from`; whether to log it (its first in
    /// the window, and the one that locks it out).
    pub fn failed(&self, from: IpAddr) -> Failure {
        let mut failures = self.failures.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        if failures.len() >= MAX_TRACKED {
            failures.retain(|_, (_, since)| now.duration_since(*since) < WINDOW);
        }
        let entry = failures.entry(from).or_insert((0, now));
        if now.duration_since(entry.1) >= WINDOW {
            *entry = (0, now);
        }
        entry.0 += 1;
        match entry.0 {
            1 => Failure::First,
            MAX_FAILURES => Failure::LockedOut,
            _ => Failure::Again,
        }
    }
}

/// What a wrong token was, for the log.
#[derive(Debug, PartialEq, Eq)]
pub enum Failure {
    /// The address's first in its window.
    First,
    /// Another, under the limit.
    Again,
    /// The one that reached the limit: refused for the rest of the window.
    LockedOut,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_address_is_locked_out_after_its_failures_and_others_are_not() {
        let r = Refusals::default();
        let (guesser, peer): (IpAddr, IpAddr) =
            ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        assert_eq!(r.failed(guesser), Failure::First);
        for _ in 2..MAX_FAILURES {
            assert_eq!(r.failed(guesser), Failure::Again);
            assert!(r.locked_out(guesser).is_none());
        }
        assert_eq!(r.failed(guesser), Failure::LockedOut);
        let left = r.locked_out(guesser).expect("locked out");
        assert!(left <= WINDOW && left > WINDOW / 2, "{left:?}");
        assert!(r.locked_out(peer).is_none());
    }
}
