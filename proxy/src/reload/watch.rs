//! When to reload: changes in the watched directories (debounced), a slow
//! poll for changes whose events were lost, and SIGHUP.
//!
//! A ConfigMap volume changes by the kubelet's atomic swap: the visible
//! files are symlinks through `..data`, which the kubelet points at a new
//! timestamped directory by renaming a new link over it. Watching a
//! resolved file would see the first swap only, so the directory itself is
//! watched, and every read goes through the visible names again.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tokio::sync::mpsc;

use super::{Reloader, Trigger};

/// When the watcher reloads.
#[derive(Debug, Clone, Copy)]
pub struct WatchOptions {
    /// React to file events (otherwise only the poll and SIGHUP reload).
    pub events: bool,
    /// Quiet time after the last event before reloading, so a burst of
    /// writes becomes one reload.
    pub debounce: Duration,
    /// How often to check for changes anyway; zero turns the poll off.
    pub poll: Duration,
}

impl Default for WatchOptions {
    fn default() -> Self {
        WatchOptions {
            events: true,
            debounce: Duration::from_millis(100),
            poll: Duration::from_secs(10),
        }
    }
}

/// A burst may not postpone a reload forever (a file written slowly, byte
/// by byte): reload at the latest this many debounce periods after its
/// first event.
const MAX_DEBOUNCES: u32 = 10;

/// The sources of reload triggers, registered: once this exists, no
/// change is missed (and SIGHUP no longer ends the process).
pub struct Watch {
    reloader: Arc<Reloader>,
    options: WatchOptions,
    hangup: Option<tokio::signal::unix::Signal>,
    events: mpsc::UnboundedReceiver<()>,
    watcher: Option<RecommendedWatcher>,
    watched: HashSet<PathBuf>,
}

/// Installs the SIGHUP handler. Call it first thing: SIGHUP's default
/// action ends the process, and a reload signal sent while the policies
/// first load (plugins compiling can take seconds) must not kill it. A
/// SIGHUP that arrives before the watch runs is kept, and reloads then.
/// Handled even without a policy directory, for the same reason.
pub fn hangup_handler() -> Option<tokio::signal::unix::Signal> {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "cannot handle SIGHUP; reload through the admin endpoint");
            None
        }
    }
}

/// Registers the file watches for `reloader` and takes over `hangup`
/// (from [`hangup_handler`]), then checks the policies once: a change made
/// between the first load and the watches being in place sent no event.
/// Call before serving, so changes made as soon as the proxy listens are
/// seen.
pub async fn watch(
    reloader: Arc<Reloader>,
    options: WatchOptions,
    hangup: Option<tokio::signal::unix::Signal>,
) -> Watch {
    let (events_tx, events) = mpsc::unbounded_channel();
    let mut watcher = match reloader.dir() {
        Some(_) if options.events => start_watcher(events_tx),
        _ => None,
    };
    let mut watched = HashSet::new();
    if let Some(w) = watcher.as_mut() {
        update_watches(w, &mut watched, &reloader.status().watched);
        reloader.reload(Trigger::Poll).await;
    }
    Watch {
        reloader,
        options,
        hangup,
        events,
        watcher,
        watched,
    }
}

impl Watch {
    /// Reloads when the policies change, until the process ends.
    pub async fn run(mut self) {
        let reloader = self.reloader.clone();
        let poll_every = if self.options.poll.is_zero() || reloader.dir().is_none() {
            // Nothing outside the binary can change: never poll.
            Duration::from_secs(3600 * 24 * 365)
        } else {
            self.options.poll
        };
        let mut poll =
            tokio::time::interval_at(tokio::time::Instant::now() + poll_every, poll_every);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let trigger = tokio::select! {
                Some(()) = self.events.recv() => {
                    debounce(&mut self.events, self.options.debounce).await;
                    Trigger::Files
                }
                _ = poll.tick() => Trigger::Poll,
                Some(()) = async {
                    match self.hangup.as_mut() {
                        Some(h) => h.recv().await,
                        None => std::future::pending().await,
                    }
                } => Trigger::Signal,
            };
            reloader.reload(trigger).await;
            if let Some(w) = self.watcher.as_mut() {
                update_watches(w, &mut self.watched, &reloader.status().watched);
            }
        }
    }
}

/// Waits until no event came for `quiet`, draining what arrives meanwhile.
async fn debounce(events: &mut mpsc::UnboundedReceiver<()>, quiet: Duration) {
    for _ in 0..MAX_DEBOUNCES {
        match tokio::time::timeout(quiet, events.recv()).await {
            Ok(Some(())) => continue,
            _ => return,
        }
    }
    while events.try_recv().is_ok() {}
}

fn start_watcher(tx: mpsc::UnboundedSender<()>) -> Option<RecommendedWatcher> {
    let handler = move |event: notify::Result<notify::Event>| match event {
        // Reads (and the watcher's own bookkeeping) change nothing.
        Ok(e) if matches!(e.kind, EventKind::Access(_) | EventKind::Other) => {}
        Ok(_) => {
            let _ = tx.send(());
        }
        Err(e) => {
            // An overflowed queue loses events: check everything.
            tracing::warn!(error = %e, "file watcher error; checking the policies");
            let _ = tx.send(());
        }
    };
    match notify::recommended_watcher(handler) {
        Ok(w) => Some(w),
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch the policy directory; polling only");
            None
        }
    }
}

/// Watches `wanted` and stops watching directories no longer referred to.
fn update_watches(
    watcher: &mut RecommendedWatcher,
    watched: &mut HashSet<PathBuf>,
    wanted: &[PathBuf],
) {
    for dir in wanted {
        if watched.contains(dir) {
            continue;
        }
        match watcher.watch(dir, RecursiveMode::NonRecursive) {
            Ok(()) => {
                tracing::debug!(dir = %dir.display(), "watching for policy changes");
                watched.insert(dir.clone());
            }
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot watch; its changes are seen by the poll")
            }
        }
    }
    watched.retain(|dir| {
        if wanted.contains(dir) {
            return true;
        }
        let _ = watcher.unwatch(dir);
        false
    });
}
