//! What is left of an upstream connection's reuse (`max_age`,
//! `max_requests`), carried by the connection and checked by its pool.

#[cfg(doc)]
use portcullis_net::coarse_clock::coarse_now;

/// What is left of a connection's reuse: worked out when it is dialled,
/// so the checks on every request are two integer compares.
#[derive(Clone, Copy, Debug)]
pub struct Worn {
    /// When it is too old to be used again, by [`coarse_now`] in
    /// milliseconds (`u64::MAX`: never).
    deadline_ms: u64,
    /// Requests it may still be used for (`u32::MAX`: no limit).
    left: u32,
}

impl Worn {
    /// Whether the connection is to be closed rather than used again
    /// (`now_ms`: [`coarse_now`] in milliseconds).
    pub(super) fn spent(&self, now_ms: u64) -> bool {
        self.left == 0 || now_ms >= self.deadline_ms
    }

    /// Counts one more request (only ever on one that is not spent).
    pub(super) fn used(&mut self) {
        if self.left != u32::MAX {
            self.left = self.left.saturating_sub(1);
        }
    }
}

impl Default for Worn {
    /// No limit (a connection made outside a pool).
    fn default() -> Worn {
        Worn {
            deadline_ms: u64::MAX,
            left: u32::MAX,
        }
    }
}

impl Worn {
    /// Reuse until `deadline_ms` ([`coarse_now`] in milliseconds;
    /// `u64::MAX`: never too old) for `left` more requests (`u32::MAX`:
    /// no limit).
    pub(super) fn new(deadline_ms: u64, left: u32) -> Worn {
        Worn { deadline_ms, left }
    }
}
