//! Where access lines go, as nginx's `access_log PATH buffer=64k
//! flush=1s`: each worker formats its lines into a buffer of its own, and
//! one thread writes buffers whole: a worker's once it fills, every
//! worker's at each flush interval, on drain and on exit. Lines never
//! interleave (one writer, whole lines), and a destination that does not
//! keep up (a blocked pipe, a full disk) loses lines, counted in
//! `portcullis_access_log_dropped_total`, rather than stalling requests.

use std::fs::File;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, sync_channel};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use crate::access_line::Clock;
pub use crate::access_line::Line;

/// The target access lines are filtered by: `RUST_LOG=info,access=off`
/// silences them.
pub const TARGET: &str = "access";

/// Where lines go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    /// The process's standard error, with the event log.
    Stderr,
    /// A file, appended to; opened again when it is moved away (as
    /// logrotate does), checked at each flush interval.
    File(PathBuf),
}

impl Destination {
    /// `stderr` or a file's path.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim() {
            "" => Err("give `stderr` or a file's path".into()),
            "stderr" => Ok(Destination::Stderr),
            path => Ok(Destination::File(PathBuf::from(path))),
        }
    }
}

/// How lines are written.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where.
    pub destination: Destination,
    /// A worker's lines go once its buffer holds this many bytes (0: each
    /// line at once), as nginx's `buffer=`.
    pub buffer: usize,
    /// And at least this often, as nginx's `flush=`.
    pub flush: Duration,
    /// JSON lines rather than text, as the event log.
    pub json: bool,
}

/// Workers' buffers: worker `w` writes into `w % SLOTS` (a power of two);
/// more workers than that share.
const SLOTS: usize = 64;

/// The log: every worker's buffer and the writer's wake-up.
struct Log {
    slots: Box<[Mutex<Slot>]>,
    buffer: usize,
    /// Full buffers a worker may have waiting before its lines are dropped.
    backlog: usize,
    json: bool,
    /// Whether the log filter lets target `access` through: asked once,
    /// as the writer starts (the filter is set just before, from
    /// `RUST_LOG`, and never changes); asking `tracing` for every request
    /// went through the filter's directives, ~190 instructions.
    filtered_in: bool,
    wake: SyncSender<Wake>,
}

/// One worker's lines.
#[derive(Default)]
struct Slot {
    /// Lines being added to.
    buf: Vec<u8>,
    lines: u64,
    /// Full buffers (and their line counts) the writer has yet to take,
    /// oldest first: taken with `buf`, so a worker's lines stay in order.
    full: Vec<(Vec<u8>, u64)>,
    clock: Clock,
}

enum Wake {
    /// A worker's buffer filled.
    Full,
    /// Write everything now; answer when done.
    Flush(Option<SyncSender<()>>),
}

static LOG: OnceLock<Log> = OnceLock::new();
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// Starts the writer (once per process; later calls change nothing).
/// Fails when a file destination cannot be opened, naming it.
pub fn start(settings: Settings) -> Result<(), String> {
    if LOG.get().is_some() {
        return Ok(());
    }
    let out = Output::open(&settings.destination)?;
    // Room for one wake per worker and the flush requests, so that a
    // flush is never refused for want of room.
    let (wake, woken) = sync_channel(SLOTS + 8);
    let log = Log {
        slots: (0..SLOTS).map(|_| Mutex::new(Slot::default())).collect(),
        buffer: settings.buffer,
        backlog: (256 * 1024 / settings.buffer.max(1)).clamp(2, 64),
        json: settings.json,
        filtered_in: tracing::enabled!(target: TARGET, tracing::Level::INFO),
        wake,
    };
    if LOG.set(log).is_err() {
        return Ok(());
    }
    let flush = settings.flush.max(Duration::from_millis(1));
    std::thread::Builder::new()
        .name("access-log".into())
        .spawn(move || write_out(woken, out, flush))
        .map(drop)
        .map_err(|e| format!("cannot start the access log's writer: {e}"))
}

/// True when a line written now would go somewhere: the writer runs and
/// the log filter lets target `access` through.
#[inline]
pub fn enabled() -> bool {
    LOG.get().is_some_and(|log| log.filtered_in)
}

/// Writes one line from `worker`, its fields set by `fill` (`message`
/// first, when given); nothing when the writer is not running.
#[inline]
pub fn write(worker: usize, message: Option<&str>, fill: impl FnOnce(&mut Line<'_>)) {
    let Some(log) = LOG.get() else { return };
    let mut slot = log.slots[worker % SLOTS]
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let slot = &mut *slot;
    if slot.buf.capacity() == 0 {
        // Room for the line that crosses the mark too.
        slot.buf.reserve(log.buffer + 2048);
    }
    let mut line = Line::begin(&mut slot.buf, log.json, &mut slot.clock, message);
    fill(&mut line);
    line.end();
    slot.lines += 1;
    if slot.buf.len() >= log.buffer {
        let buf = std::mem::take(&mut slot.buf);
        let lines = std::mem::take(&mut slot.lines);
        if slot.full.len() >= log.backlog {
            // The destination is not keeping up: the newest lines go.
            DROPPED.fetch_add(lines, Relaxed);
            return;
        }
        slot.full.push((buf, lines));
        if slot.full.len() == 1 {
            // Full: the writer is busy, and takes this one next anyway.
            let _ = log.wake.try_send(Wake::Full);
        }
    }
}

/// The access line of a connection whose head hyper refused: `status`
/// the answer's (0 when none was seen), `error` hyper's reason.
pub fn refused_head(
    listener: &str,
    (client, worker): (SocketAddr, usize),
    status: u16,
    error: &hyper::Error,
) {
    if !enabled() {
        return;
    }
    let status = match status {
        0 if error.is_parse_too_large() => 431,
        0 => 400,
        s => s,
    };
    write(worker, Some("request head refused"), |line| {
        line.str(crate::field!("method"), "-");
        line.str(crate::field!("path"), "-");
        line.uint(crate::field!("status"), status.into());
        line.str(crate::field!("route"), "-");
        line.str(crate::field!("upstream"), "-");
        line.addr(crate::field!("client"), &client);
        line.uint(crate::field!("worker"), worker as u64);
        line.str(crate::field!("listener"), listener);
        line.display(crate::field!("error"), error);
    });
}

/// Asks for every buffered line to be written now (a drain begins).
pub fn flush() {
    if let Some(log) = LOG.get() {
        let _ = log.wake.try_send(Wake::Flush(None));
    }
}

/// Writes every buffered line and waits until they are out, or `limit`
/// passed (a destination that blocks): at exit.
pub fn finish(limit: Duration) {
    let Some(log) = LOG.get() else { return };
    let (done, written) = sync_channel(1);
    if log.wake.try_send(Wake::Flush(Some(done))).is_ok() {
        let _ = written.recv_timeout(limit);
    }
}

/// Lines dropped so far: the destination did not keep up or failed.
pub fn dropped() -> u64 {
    DROPPED.load(Relaxed)
}

/// The writer thread: waits for a full buffer, a flush or the interval.
fn write_out(woken: Receiver<Wake>, mut out: Output, every: Duration) {
    let Some(log) = LOG.get() else { return };
    let mut next = Instant::now() + every;
    loop {
        let wait = next.saturating_duration_since(Instant::now());
        let done = match woken.recv_timeout(wait) {
            Ok(Wake::Full) => {
                take(log, false, &mut out);
                None
            }
            Ok(Wake::Flush(done)) => {
                take(log, true, &mut out);
                done
            }
            Err(RecvTimeoutError::Timeout) => None,
            Err(RecvTimeoutError::Disconnected) => return,
        };
        if let Some(done) = done {
            let _ = done.send(());
        }
        if Instant::now() >= next {
            out.reopen_if_moved();
            take(log, true, &mut out);
            next = Instant::now() + every;
        }
    }
}

/// Writes every worker's full buffers and, when `all`, the lines in the
/// making too.
fn take(log: &Log, all: bool, out: &mut Output) {
    for slot in log.slots.iter() {
        let (full, partial) = {
            let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
            let full = std::mem::take(&mut slot.full);
            let partial = (all && !slot.buf.is_empty()).then(|| {
                (
                    std::mem::take(&mut slot.buf),
                    std::mem::take(&mut slot.lines),
                )
            });
            (full, partial)
        };
        for (buf, lines) in full.into_iter().chain(partial) {
            out.write(&buf, lines);
        }
    }
}

/// The destination, open.
enum Output {
    Stderr,
    File {
        path: PathBuf,
        file: File,
        /// Warned of a failed write since the last good one.
        warned: bool,
    },
}

impl Output {
    fn open(to: &Destination) -> Result<Output, String> {
        match to {
            Destination::Stderr => Ok(Output::Stderr),
            Destination::File(path) => Ok(Output::File {
                file: append(path)?,
                path: path.clone(),
                warned: false,
            }),
        }
    }

    fn write(&mut self, buf: &[u8], lines: u64) {
        let written = match self {
            // Through stderr's lock, which the event log takes too: no
            // event lands inside a batch.
            Output::Stderr => std::io::stderr().lock().write_all(buf),
            Output::File { file, .. } => file.write_all(buf),
        };
        match (written, self) {
            (Ok(()), Output::File { warned, .. }) => *warned = false,
            (Ok(()), Output::Stderr) => {}
            (Err(e), Output::File { path, warned, .. }) => {
                DROPPED.fetch_add(lines, Relaxed);
                if !*warned {
                    *warned = true;
                    tracing::warn!(path = %path.display(), error = %e, "access log: lines not written; further failures are only counted (portcullis_access_log_dropped_total)");
                }
            }
            (Err(_), Output::Stderr) => {
                DROPPED.fetch_add(lines, Relaxed);
            }
        }
    }

    /// Opens the file's path again when the file there is no longer the
    /// one written (rotated away, or deleted).
    fn reopen_if_moved(&mut self) {
        use std::os::unix::fs::MetadataExt;
        let Output::File { path, file, .. } = self else {
            return;
        };
        let same = match (std::fs::metadata(&*path), file.metadata()) {
            (Ok(there), Ok(ours)) => there.ino() == ours.ino() && there.dev() == ours.dev(),
            _ => false,
        };
        if !same {
            match append(path) {
                Ok(new) => *file = new,
                Err(e) => tracing::warn!(error = %e, "access log: cannot open the file again"),
            }
        }
    }
}

fn append(path: &std::path::Path) -> Result<File, String> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| format!("access log {}: {e}", path.display()))
}
