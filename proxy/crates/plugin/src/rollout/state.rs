//! A rollout's state: its step, its judgement of each version's
//! outcomes over its window, and its registry across reloads.

use crate::use_reports::RolloutReport;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant, SystemTime};

/// Outcomes, by index in the counts.
pub const OUTCOMES: [&str; 5] = ["answered", "denied", "failed", "timed_out", "upstream_5xx"];
#[derive(Clone, Copy)]
pub(super) enum Outcome {
    Answered = 0,
    Denied = 1,
    Failed = 2,
    TimedOut = 3,
    Upstream5xx = 4,
}

/// Versions, by index in the counts.
pub const VERSIONS: [&str; 2] = ["current", "candidate"];

/// The schedule and judgement of a rollout, as the policy states them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spec {
    pub steps: Vec<u32>,
    pub interval: Duration,
    pub window: Duration,
    pub min_requests: u32,
    pub margin: u32,
}

/// A rollout's state, shared by the pipelines that have it.
#[derive(Debug)]
pub struct State {
    spec: Spec,
    /// The candidate's share now, percent (0 once rolled back).
    pub(super) percent: AtomicU32,
    /// When (ms after `born`) the step timer is next looked at.
    next_check: AtomicU64,
    born: Instant,
    judged: Mutex<Judged>,
    totals: [[AtomicU64; 5]; 2],
}

#[derive(Debug)]
struct Judged {
    step: usize,
    step_since: Instant,
    phase: Phase,
    windows: [Window; 2],
}

#[derive(Debug, Clone)]
enum Phase {
    /// Steps to come.
    Rolling,
    /// At its last step, under 100: held.
    Holding,
    /// At 100 for its interval: the candidate is promoted.
    Complete,
    RolledBack {
        reason: String,
        at: SystemTime,
    },
}

/// Outcomes of one version over about the last window: this window's
/// and the one before (requests, bad ones).
#[derive(Debug, Default)]
struct Window {
    start: Option<Instant>,
    this: (u64, u64),
    last: (u64, u64),
}

impl Window {
    fn roll(&mut self, now: Instant, length: Duration) {
        let start = *self.start.get_or_insert(now);
        let elapsed = now.saturating_duration_since(start);
        if elapsed >= length * 2 {
            (self.last, self.this, self.start) = ((0, 0), (0, 0), Some(now));
        } else if elapsed >= length {
            (self.last, self.this, self.start) = (self.this, (0, 0), Some(start + length));
        }
    }

    fn add(&mut self, now: Instant, length: Duration, bad: bool) {
        self.roll(now, length);
        self.this.0 += 1;
        self.this.1 += u64::from(bad);
    }

    fn sum(&mut self, now: Instant, length: Duration) -> (u64, u64) {
        self.roll(now, length);
        (self.this.0 + self.last.0, self.this.1 + self.last.1)
    }
}

/// Rollout states by what the policies say of them (route, versions and
/// their modules and configs, the spec): a new pipeline finds its
/// rollout's state while an old one still holds it.
fn registry() -> &'static Mutex<HashMap<String, Weak<State>>> {
    static STATES: OnceLock<Mutex<HashMap<String, Weak<State>>>> = OnceLock::new();
    STATES.get_or_init(Default::default)
}

impl State {
    /// The state of the rollout `key` names: the one a pipeline has
    /// already, or a new one.
    pub fn for_key(key: String, spec: Spec) -> Arc<State> {
        let mut states = registry().lock().unwrap_or_else(|p| p.into_inner());
        states.retain(|_, s| s.strong_count() > 0);
        if let Some(state) = states.get(&key).and_then(Weak::upgrade) {
            return state;
        }
        let now = Instant::now();
        // One share under 100 is held from the start.
        let phase = match spec.steps[..] {
            [only] if only < 100 => Phase::Holding,
            _ => Phase::Rolling,
        };
        let state = Arc::new(State {
            percent: AtomicU32::new(spec.steps[0]),
            next_check: AtomicU64::new(spec.interval.as_millis() as u64),
            born: now,
            judged: Mutex::new(Judged {
                step: 0,
                step_since: now,
                phase,
                windows: Default::default(),
            }),
            totals: Default::default(),
            spec,
        });
        states.insert(key, Arc::downgrade(&state));
        state
    }

    fn judged(&self) -> std::sync::MutexGuard<'_, Judged> {
        self.judged.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes the next step when the current one has been held for its
    /// interval (looked at only when due: one clock read a request).
    pub(super) fn tick(&self, name: &str) {
        let now_ms = self.born.elapsed().as_millis() as u64;
        if now_ms < self.next_check.load(Ordering::Relaxed) {
            return;
        }
        let mut j = self.judged();
        let now = Instant::now();
        if !matches!(j.phase, Phase::Rolling) {
            self.next_check.store(u64::MAX, Ordering::Relaxed);
            return;
        }
        let due = j.step_since + self.spec.interval;
        if now < due {
            let at = due.saturating_duration_since(self.born).as_millis() as u64;
            self.next_check.store(at, Ordering::Relaxed);
            return;
        }
        let steps = &self.spec.steps;
        if j.step + 1 < steps.len() {
            j.step += 1;
            j.step_since = now;
            self.percent.store(steps[j.step], Ordering::Relaxed);
            let at = now_ms + self.spec.interval.as_millis() as u64;
            self.next_check.store(at, Ordering::Relaxed);
            tracing::info!(
                plugin = name,
                percent = steps[j.step],
                "plugin rollout took its next step"
            );
        } else if steps[j.step] >= 100 {
            j.phase = Phase::Complete;
            self.next_check.store(u64::MAX, Ordering::Relaxed);
            tracing::info!(
                plugin = name,
                "plugin rollout complete: the candidate serves every request"
            );
        } else {
            j.phase = Phase::Holding;
            self.next_check.store(u64::MAX, Ordering::Relaxed);
        }
    }

    /// Counts an outcome of `version` (0 current, 1 candidate), and rolls
    /// back when the candidate does worse than the margin allows.
    pub(super) fn record(&self, names: (&str, &str), version: usize, outcome: Outcome) {
        self.totals[version][outcome as usize].fetch_add(1, Ordering::Relaxed);
        let mut j = self.judged();
        // At its last step while rolling: still judged (it may not be
        // held for its interval yet), as while holding.
        if !matches!(j.phase, Phase::Rolling | Phase::Holding) {
            return;
        }
        let (now, window) = (Instant::now(), self.spec.window);
        j.windows[version].add(now, window, !matches!(outcome, Outcome::Answered));
        if version == 0 {
            return;
        }
        let (cn, cb) = j.windows[1].sum(now, window);
        if cn < u64::from(self.spec.min_requests) {
            return;
        }
        let (un, ub) = j.windows[0].sum(now, window);
        let rate = |bad: u64, n: u64| {
            if n == 0 {
                0.0
            } else {
                bad as f64 * 100.0 / n as f64
            }
        };
        let (c, u) = (rate(cb, cn), rate(ub, un));
        if c <= u + f64::from(self.spec.margin) {
            return;
        }
        let (current, candidate) = names;
        let reason = format!(
            "`{candidate}` did worse than `{current}`: {cb} of {cn} requests denied, failed, timed out or answered 5xx ({c:.0}%), against {ub} of {un} ({u:.0}%), over {window:?}; the margin is {} points",
            self.spec.margin
        );
        tracing::warn!(plugin = current, candidate, reason = %reason, "plugin rollout rolled back: every request goes to the current version");
        self.percent.store(0, Ordering::Relaxed);
        self.next_check.store(u64::MAX, Ordering::Relaxed);
        j.phase = Phase::RolledBack {
            reason,
            at: SystemTime::now(),
        };
    }

    /// Where it is, for `/status`, the status page and metrics.
    pub(super) fn report(&self, candidate: Arc<str>) -> RolloutReport {
        let j = self.judged();
        let (state, reason, at) = match &j.phase {
            Phase::Rolling => ("rolling", None, None),
            Phase::Holding => ("holding", None, None),
            Phase::Complete => ("complete", None, None),
            Phase::RolledBack { reason, at } => ("rolled_back", Some(reason.clone()), Some(*at)),
        };
        let totals = &self.totals;
        RolloutReport {
            candidate,
            state,
            percent: self.percent.load(Ordering::Relaxed),
            steps: self.spec.steps.clone(),
            step: j.step,
            reason,
            rolled_back_at: at,
            outcomes: std::array::from_fn(|v| {
                std::array::from_fn(|o| totals[v][o].load(Ordering::Relaxed))
            }),
        }
    }
}
