//! How a request body streamed to an upstream is getting on, and the
//! error a body ends with: what the client watch, the tee and the
//! upstream exchange read of a body without depending on the body type.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// How a request body streamed to an upstream is getting on: the upstream
/// is not expected to answer before the body has arrived, so the wait for
/// its answer counts from the body's last progress (see
/// [`crate::client_watch::exchange`]).
#[derive(Debug)]
pub struct BodyProgress {
    /// When a frame last came, by the coarse clock, in milliseconds.
    last_ms: AtomicU64,
    done: AtomicBool,
    /// Whether the body went over its route's limit.
    pub(crate) too_large: AtomicBool,
    /// Whether the client's body broke its framing (a bad chunk).
    pub(crate) malformed: AtomicBool,
    /// Whether the body was last found waiting on the client (rather
    /// than not asked for: an upstream that stopped reading it).
    pub(crate) waiting: AtomicBool,
}

impl BodyProgress {
    pub(crate) fn started() -> BodyProgress {
        BodyProgress {
            last_ms: AtomicU64::new(coarse_ms()),
            done: AtomicBool::new(false),
            too_large: AtomicBool::new(false),
            malformed: AtomicBool::new(false),
            waiting: AtomicBool::new(false),
        }
    }

    pub(crate) fn moved(&self, ended: bool) {
        self.last_ms.store(coarse_ms(), Ordering::Relaxed);
        self.waiting.store(false, Ordering::Relaxed);
        if ended {
            self.done.store(true, Ordering::Relaxed);
        }
    }

    /// When a wait of `timeout` counted from the body's last progress
    /// ends: `None` if it has already passed. Both waits on a body (for
    /// the upstream's answer, for a plugin's read) start again from there.
    pub fn wait_ends(&self, timeout: Duration) -> Option<tokio::time::Instant> {
        self.wait_left(timeout)
            .map(|rest| tokio::time::Instant::now() + rest)
    }

    /// What is left of that wait from now (`None`: nothing).
    pub fn wait_left(&self, timeout: Duration) -> Option<Duration> {
        let quiet = coarse_ms().saturating_sub(self.last_ms.load(Ordering::Relaxed));
        let rest = timeout.checked_sub(Duration::from_millis(quiet))?;
        (!rest.is_zero()).then_some(rest)
    }

    /// Whether all of the body has been read.
    pub fn done(&self) -> bool {
        self.done.load(Ordering::Relaxed)
    }

    /// Whether the body went over its route's `max_request_body` (the
    /// request then failed for that, whatever the upstream side saw).
    pub fn too_large(&self) -> bool {
        self.too_large.load(Ordering::Relaxed)
    }

    /// Whether the client's body broke its framing (a bad chunk size
    /// line, a chunk of the wrong length): the client's fault, a 400,
    /// whatever the upstream side reported.
    pub fn malformed(&self) -> bool {
        self.malformed.load(Ordering::Relaxed)
    }

    /// Whether the rest of the body is awaited from the client (not done,
    /// and last polled in vain).
    pub fn waiting_on_client(&self) -> bool {
        !self.done() && self.waiting.load(Ordering::Relaxed)
    }
}

fn coarse_ms() -> u64 {
    portcullis_net::coarse_clock::coarse_now().as_millis() as u64
}

/// A body's error: hyper's, or the upstream reader's (boxed: errors are
/// rare, and this keeps the type small).
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;
