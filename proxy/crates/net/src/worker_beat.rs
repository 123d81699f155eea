//! Each worker's sign of life, for readiness: a worker marks the time
//! every tick of its runtime's timer ([`BEAT_EVERY`]), and one not heard
//! from for [`STALLED_AFTER`] is stalled: something blocks its thread
//! (a write to a pipe nobody reads, a lock never let go), so the
//! connections it holds and the ones it is given are not served. A
//! stalled worker makes `/readyz` answer 503, so that balancers and
//! Kubernetes stop sending traffic to a process that only looks alive
//! (cloudflared's half-dead connection that still reports ready is the
//! failure this avoids).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::coarse_clock::{coarse_now, millis};

/// How often a worker marks the time.
pub const BEAT_EVERY: Duration = Duration::from_millis(500);
/// How long a worker may go unheard before it is stalled: ten beats, far
/// above what a busy worker's timer lags.
pub const STALLED_AFTER: Duration = Duration::from_secs(5);

/// Workers tracked; more share slots (a stalled one may then be missed
/// while its slot-mate beats, never reported falsely).
const SLOTS: usize = 64;

/// The workers' last beats, on the coarse clock, in milliseconds (0: a
/// slot no worker has beaten yet).
pub struct Heartbeats {
    beats: [AtomicU64; SLOTS],
}

impl Default for Heartbeats {
    fn default() -> Self {
        Heartbeats {
            beats: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl Heartbeats {
    /// Marks worker `worker` alive now.
    pub fn beat(&self, worker: usize) {
        // Never 0, which means "not started".
        let now = millis(coarse_now()).max(1);
        self.beats[worker % SLOTS].store(now, Ordering::Relaxed);
    }

    /// The workers not heard from within [`STALLED_AFTER`], by slot.
    pub fn stalled(&self) -> Vec<usize> {
        let now = millis(coarse_now());
        let limit = millis(STALLED_AFTER);
        (self.beats.iter().enumerate())
            .filter(|(_, b)| {
                let last = b.load(Ordering::Relaxed);
                last != 0 && now.saturating_sub(last) > limit
            })
            .map(|(i, _)| i)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_worker_unheard_for_too_long_is_stalled_and_one_never_started_is_not() {
        let h = Heartbeats::default();
        assert!(h.stalled().is_empty());
        h.beat(0);
        h.beat(1);
        assert!(h.stalled().is_empty());
        // Worker 1's last beat, long ago.
        let long_ago = millis(coarse_now()).saturating_sub(millis(STALLED_AFTER) + 1_000);
        h.beats[1].store(long_ago.max(1), Ordering::Relaxed);
        if long_ago > 0 {
            assert_eq!(h.stalled(), [1]);
        }
        h.beat(1);
        assert!(h.stalled().is_empty());
    }
}
