//! What a plugin use in shadow mode or rolled out to a candidate reports
//! for `/status`, the status page and metrics: plain data, which the
//! plugin seam hands out and the shadow and rollout wrappers fill in.

use std::sync::Arc;
use std::time::SystemTime;

/// A shadow use's counts, for `/status` and the metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ShadowReport {
    /// Its share of requests, 1-100.
    pub percent: u32,
    /// Requests it ran on.
    pub ran: u64,
    /// Requests in its share it left alone: it asked for a body it could
    /// not be given without holding or refusing the request.
    pub skipped: u64,
    /// Calls that failed, and that ran out of time.
    pub failed: u64,
    pub timed_out: u64,
    /// Answers it would have made, by status, the lowest first (444: it
    /// would have reset the stream).
    pub would_answer: Vec<(u16, u64)>,
}

/// What a rollout is at, for `/status`, the status page and metrics.
#[derive(Debug, Clone)]
pub struct RolloutReport {
    pub candidate: Arc<str>,
    /// `rolling`, `holding` (its last step, under 100), `complete`,
    /// `rolled_back`.
    pub state: &'static str,
    pub percent: u32,
    pub steps: Vec<u32>,
    pub step: usize,
    /// Why it was rolled back, and when.
    pub reason: Option<String>,
    pub rolled_back_at: Option<SystemTime>,
    /// Outcomes since the rollout began, by version and outcome
    /// ([`crate::rollout::VERSIONS`], [`crate::rollout::OUTCOMES`]).
    pub outcomes: [[u64; 5]; 2],
}
