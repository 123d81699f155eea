//! Plugin calls given a large request body, run off the serving worker.
//!
//! A header check takes about a microsecond and runs inline on the worker
//! thread. A call given a body takes time in proportion to it:
//! webhook-signature hashes at ~6.5 ns a byte (release build, this repo's
//! 2-core VM), so a 25 MiB GitHub push holds its thread for ~170 ms. On a
//! worker, every other connection of that worker (each worker is a
//! single-threaded runtime) would wait that long. So calls with a body of
//! [`OFFLOAD_AT`] bytes or more run on a small pool of plugin threads, the
//! instance moving with the call; the worker goes on serving meanwhile.
//!
//! The pool has a fixed set of long-lived threads (one per core, at most
//! [`MAX_THREADS`]) taking calls in arrival order. Fixed, because idle
//! instances are kept per thread ([`portcullis_net::shard`]) and one that took a
//! large body keeps the memory it grew: threads that came and went (as
//! tokio's blocking pool's do) would each leave instances behind. They are
//! CPU work, so more threads than cores would only share the cores.

use std::sync::mpsc;
use std::sync::{Arc, LazyLock, Mutex};

use bytes::Bytes;

use super::{Plugin, PluginError, RequestFacts, Stream, Verdict};

/// Bodies from this size on go to the plugin threads. Below it the call
/// costs less than the hand-off would save (at webhook-signature's rate,
/// 16 KiB is ~0.1 ms of hashing; a hand-off is two thread wake-ups).
pub const OFFLOAD_AT: usize = 16 << 10;

/// The most plugin threads, whatever the core count: each keeps an idle
/// instance per plugin use, with up to that use's memory cap.
const MAX_THREADS: usize = 4;

type Job = Box<dyn FnOnce() + Send>;

/// The queue the plugin threads take calls from.
static QUEUE: LazyLock<Option<mpsc::Sender<Job>>> = LazyLock::new(|| {
    let (queue, jobs) = mpsc::channel::<Job>();
    let jobs = Arc::new(Mutex::new(jobs));
    let threads = std::thread::available_parallelism()
        .map_or(1, std::num::NonZero::get)
        .min(MAX_THREADS);
    let mut started = 0;
    for i in 0..threads {
        let jobs = jobs.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("portcullis-plugin-{i}"))
            .spawn(move || {
                loop {
                    // The lock is held only while waiting for a job.
                    let job = jobs.lock().unwrap_or_else(|p| p.into_inner()).recv();
                    match job {
                        Ok(job) => job(),
                        Err(_) => return,
                    }
                }
            });
        match spawned {
            Ok(_) => started += 1,
            Err(e) => tracing::warn!(error = %e, "cannot start a plugin thread"),
        }
    }
    // Without a thread, large-body calls run inline as before.
    (started > 0).then_some(queue)
});

/// The call was dropped unrun (the plugin threads are gone), and the
/// request's facts and headers with it. Not expected: the threads live as
/// long as the process, and a panic in a call is caught and re-raised in
/// the request's task.
#[derive(Debug)]
pub struct Lost;

/// [`Plugin::on_request`] with the request body, on a plugin thread
/// when the body is large ([`OFFLOAD_AT`]) and the plugin's calls may
/// run anywhere. The facts and headers move to the call's thread and
/// back, as they move into the instance.
pub async fn on_request_with_body(
    plugin: &Arc<dyn Plugin>,
    stream: &mut Stream,
    req: &mut Option<RequestFacts>,
    headers: &mut http::HeaderMap,
    body: &Bytes,
) -> Result<Result<Verdict, PluginError>, Lost> {
    let queue = match &*QUEUE {
        Some(queue) if body.len() >= OFFLOAD_AT && plugin.runs_anywhere() => queue,
        _ => return Ok(plugin.on_request(stream, req, headers, Some(body))),
    };
    let (done, result) = tokio::sync::oneshot::channel();
    let binding = plugin.clone();
    let mut facts = req.take();
    let mut moved = std::mem::take(headers);
    let body = body.clone();
    // Only kinds whose stream is plain bookkeeping run here
    // (`runs_anywhere`): a shadow use's flags, say, never a worker's VM.
    let mut carried = *stream;
    let job: Job = Box::new(move || {
        // A request whose client left while it waited is not worked on.
        if done.is_closed() {
            return;
        }
        let call = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            binding.on_request(&mut carried, &mut facts, &mut moved, Some(&body))
        }));
        let _ = done.send(call.map(|result| (facts, moved, carried, result)));
    });
    if queue.send(job).is_err() {
        return Err(Lost);
    }
    match result.await {
        Ok(Ok((facts, moved, carried, result))) => {
            *req = facts;
            *headers = moved;
            *stream = carried;
            Ok(result)
        }
        // A panic in the call is the host's bug: it unwinds into the
        // request's task, as it would have inline.
        Ok(Err(panic)) => std::panic::resume_unwind(panic),
        Err(_) => Err(Lost),
    }
}
