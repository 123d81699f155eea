//! Plugin calls given a large request body, run off the serving worker.
//!
//! A header check takes about a microsecond and runs inline on the worker
//! thread. A call given a body takes time in proportion to it:
//! webhook-signature hashes at ~6.5 ns a byte (release build, this repo's
//! 2-core VM), so a 25 MiB GitHub push holds its thread for ~170 ms. On a
//! worker, every other connection of that worker (each worker is a
//! single-threaded runtime) would wait that long. So calls with a body of
//! [`OFFLOAD_AT`] bytes or more run on tokio's blocking pool, the instance
//! moving with the call; the worker goes on serving meanwhile.
//!
//! At most one such call per core runs at once: they are CPU work, and more
//! would only share the cores and hold more instance memory (up to the
//! plugin's cap each). The others wait their turn holding no thread.

use std::sync::{Arc, LazyLock};

use bytes::Bytes;
use tokio::sync::Semaphore;

use super::{Binding, Decision, PluginError, RequestFacts};

/// Bodies from this size on are handed to the blocking pool. Below it the
/// call costs less than the hand-off would save (at webhook-signature's
/// rate, 16 KiB is ~0.1 ms of hashing; a hand-off is two thread wake-ups).
pub const OFFLOAD_AT: usize = 16 << 10;

/// Offloaded calls allowed to run at once.
static RUNNING: LazyLock<Semaphore> = LazyLock::new(|| {
    Semaphore::new(std::thread::available_parallelism().map_or(1, std::num::NonZero::get))
});

/// The call could not run: the runtime shut down before the blocking pool
/// took it. The request and its headers went with it.
#[derive(Debug)]
pub struct Lost;

impl Binding {
    /// [`Binding::on_request`] with the request body, on the blocking pool
    /// when the body is large ([`OFFLOAD_AT`]). The facts and headers move
    /// to the call's thread and back, as they move into the instance.
    pub async fn on_request_with_body(
        self: &Arc<Self>,
        req: &mut Option<RequestFacts>,
        headers: &mut http::HeaderMap,
        body: &Bytes,
    ) -> Result<Result<Decision, PluginError>, Lost> {
        if body.len() < OFFLOAD_AT {
            return Ok(self.on_request(req, headers, Some(body)));
        }
        // The semaphore is never closed.
        let Ok(turn) = RUNNING.acquire().await else {
            return Err(Lost);
        };
        let binding = self.clone();
        let mut facts = req.take();
        let mut moved = std::mem::take(headers);
        let body = body.clone();
        let call = tokio::task::spawn_blocking(move || {
            // Held until the call ends, even if the request is dropped
            // while it runs (the client left): the core is busy until then.
            let _turn = turn;
            let result = binding.on_request(&mut facts, &mut moved, Some(&body));
            (facts, moved, result)
        });
        match call.await {
            Ok((facts, moved, result)) => {
                *req = facts;
                *headers = moved;
                Ok(result)
            }
            // A panic in the call is the host's bug: it unwinds into the
            // request's task, as it would have inline.
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(_) => Err(Lost),
        }
    }
}
