//! Reloading the policies while serving: read and validate the whole new
//! configuration, compile its plugins off the workers, then swap it in at
//! once, or keep the running one and report why not.
//!
//! [`Reloader`] does one reload; [`watch`] decides when (file events with a
//! debounce, a slow poll for lost events, SIGHUP); the admin endpoint shows
//! its [`Status`] and can ask for a reload.

mod watch;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

pub use watch::{Watch, WatchOptions, hangup_handler, watch};

use portcullis_config::Config;
use portcullis_http::server::Control;

/// What asked for a reload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// A change seen in a watched directory.
    Files,
    /// The periodic check for changes whose events were lost.
    Poll,
    /// SIGHUP.
    Signal,
    /// `POST /reload` on the admin listener.
    Admin,
}

impl Trigger {
    /// The name shown in logs and on the status endpoint.
    pub fn as_str(self) -> &'static str {
        match self {
            Trigger::Files => "files",
            Trigger::Poll => "poll",
            Trigger::Signal => "signal",
            Trigger::Admin => "admin",
        }
    }

    /// Asked for by a person: always reported, even when it repeats the
    /// last error.
    fn explicit(self) -> bool {
        matches!(self, Trigger::Signal | Trigger::Admin)
    }
}

/// How a reload ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The new configuration serves new requests.
    Applied {
        /// Its generation.
        generation: u64,
    },
    /// The files hold what is already serving.
    Unchanged,
    /// Something was wrong; the running configuration keeps serving.
    Rejected {
        /// Every error, one per line, as `file:line:column: message`.
        message: String,
    },
}

/// A rejected reload, as the status endpoint shows it.
#[derive(Debug, Clone)]
pub struct Failure {
    /// When it was rejected.
    pub at: SystemTime,
    /// What asked for it.
    pub trigger: Trigger,
    /// Every error, one per line.
    pub message: String,
}

/// The reload history the admin endpoint reports.
#[derive(Debug, Clone)]
pub struct Status {
    /// 1 for the configuration the process started with, then +1 per
    /// applied reload.
    pub generation: u64,
    /// The active configuration's fingerprint (hex SHA-256).
    pub fingerprint: String,
    /// When the active configuration was applied.
    pub loaded_at: SystemTime,
    /// Reloads applied.
    pub applied: u64,
    /// Reloads rejected (a repeat of the same error counts once).
    pub rejected: u64,
    /// Checks that found nothing new.
    pub unchanged: u64,
    /// The rejection the files still hold: cleared when a reload applies
    /// or finds the files back to what serves.
    pub last_error: Option<Failure>,
    /// When a reload was last rejected, kept after later successes.
    pub last_rejected_at: Option<SystemTime>,
    /// Whether the most recent reload that changed anything was rejected
    /// (the files on disk are not what is serving).
    pub pending_error: bool,
    /// How long the last applied reload took, from reading the files to
    /// the swap.
    pub last_duration: Option<Duration>,
    /// Directories watched for changes.
    pub watched: Vec<PathBuf>,
}

/// The longest a reload may spend reading the policies and their files,
/// pulls from registries among them (each bounded at 30 s).
const READ_DEADLINE: Duration = Duration::from_secs(60);

/// Reloads one policy directory into one server.
pub struct Reloader {
    dir: Option<PathBuf>,
    /// Without a directory: the fixed sources the server was started on
    /// (the built-in set when `None`).
    fixed: Option<Arc<Vec<portcullis_config::Source>>>,
    control: Arc<Control>,
    status: Mutex<Status>,
    /// One reload at a time: a SIGHUP during a file-triggered reload waits
    /// and then re-reads.
    running: tokio::sync::Mutex<()>,
}

impl Reloader {
    /// A reloader for the server behind `control`, which serves the
    /// policies of `dir` (or the built-in set).
    pub fn new(dir: Option<PathBuf>, control: Arc<Control>) -> Reloader {
        let config = control.pipeline().config().clone();
        let watched = dir
            .as_deref()
            .map(|d| watch_dirs(d, &config))
            .unwrap_or_default();
        Reloader {
            status: Mutex::new(Status {
                generation: 1,
                fingerprint: hex::encode(config.fingerprint),
                loaded_at: SystemTime::now(),
                applied: 0,
                rejected: 0,
                unchanged: 0,
                last_error: None,
                last_rejected_at: None,
                pending_error: false,
                last_duration: None,
                watched,
            }),
            dir,
            fixed: None,
            control,
            running: tokio::sync::Mutex::new(()),
        }
    }

    /// A reloader for a server started on fixed `sources` (not a
    /// directory): reloads find them unchanged.
    pub fn with_sources(
        sources: Vec<portcullis_config::Source>,
        control: Arc<Control>,
    ) -> Reloader {
        let mut reloader = Reloader::new(None, control);
        reloader.fixed = Some(Arc::new(sources));
        reloader
    }

    /// The policy directory, if not the built-in set.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The server this reloads.
    pub fn control(&self) -> &Arc<Control> {
        &self.control
    }

    /// A copy of the reload history.
    pub fn status(&self) -> Status {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Status> {
        self.status.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reads the policies again and applies them when they changed and are
    /// valid. Never disturbs the running configuration on failure.
    pub async fn reload(&self, trigger: Trigger) -> Outcome {
        let _one = self.running.lock().await;
        let started = Instant::now();
        // Reading and hashing plugin files is blocking I/O.
        let dir = self.dir.clone();
        let fixed = self.fixed.clone();
        let reading = tokio::task::spawn_blocking(move || match fixed {
            Some(sources) if dir.is_none() => {
                portcullis_config::load_sources(&sources, &|n| std::env::var(n).ok())
            }
            _ => portcullis_config::load_policies(dir.as_deref()),
        });
        // Files are regular and bounded (portcullis_net::files), but a
        // network file system can still stall a read: the reload gives up
        // and frees the next one; the stalled thread ends on its own.
        let loaded = match tokio::time::timeout(READ_DEADLINE, reading).await {
            Ok(joined) => joined
                .map_err(|e| format!("reading the policies crashed: {e}"))
                .and_then(|r| r.map_err(|e| e.to_string())),
            Err(_) => Err(format!(
                "reading the policies and the files they name took over {READ_DEADLINE:?}; is a file on a stalled network mount, or a registry slow?"
            )),
        };
        let config = match loaded {
            Ok(config) => config,
            Err(message) => return self.reject(trigger, message),
        };
        let fingerprint = hex::encode(config.fingerprint);
        {
            let mut status = self.lock();
            if status.fingerprint == fingerprint {
                status.unchanged += 1;
                // The files are back to what serves: the error is history.
                status.pending_error = false;
                status.last_error = None;
                if trigger.explicit() {
                    tracing::info!(trigger = trigger.as_str(), "reload: policies unchanged");
                }
                return Outcome::Unchanged;
            }
        }
        // Compiles new plugin modules on blocking threads, not the workers.
        let chains = match portcullis_plugin::prepare(&config).await {
            Ok(chains) => chains,
            Err(e) => return self.reject(trigger, e.to_string()),
        };
        // Every worker's VMs and instances started before the new
        // policies take traffic; one that cannot start rejects the reload
        // (the old policies keep serving).
        if let Err(e) = chains.warm(self.control.workers()).await {
            return self.reject(trigger, e);
        }
        let watched = self
            .dir
            .as_deref()
            .map(|d| watch_dirs(d, &config))
            .unwrap_or_default();
        self.control.look_up_new_hosts(&config).await;
        let counts = (config.routes.len(), config.plugins.len());
        let mut changes = match self.control.apply(config, chains) {
            Ok(changes) => changes,
            Err(e) => return self.reject(trigger, e.to_string()),
        };
        // Report the reload once removed listeners refuse connections; a
        // worker stuck for a second does not hold the report back.
        let _ = tokio::time::timeout(Duration::from_secs(1), changes.closed()).await;
        portcullis_plugin::forget_unused(self.control.pipeline().config());
        let took = started.elapsed();
        let generation = {
            let mut status = self.lock();
            status.generation += 1;
            status.applied += 1;
            status.fingerprint = fingerprint.clone();
            status.loaded_at = SystemTime::now();
            status.pending_error = false;
            status.last_error = None;
            status.last_duration = Some(took);
            status.watched = watched;
            status.generation
        };
        tracing::info!(
            trigger = trigger.as_str(),
            generation,
            fingerprint = %&fingerprint[..12],
            // The listeners opened: a tunnel client opens none of the
            // policies' (the tunnel carries its traffic) unless told to.
            listeners = self.control.listeners().len(),
            routes = counts.0,
            plugins = counts.1,
            added = ?changes.added,
            removed = ?changes.removed,
            took_ms = took.as_secs_f64() * 1e3,
            "reload: configuration applied"
        );
        Outcome::Applied { generation }
    }

    fn reject(&self, trigger: Trigger, message: String) -> Outcome {
        let mut status = self.lock();
        // The poll re-reads a broken file every few seconds; say so once.
        let repeat = status.pending_error
            && status
                .last_error
                .as_ref()
                .is_some_and(|f| f.message == message);
        if !repeat || trigger.explicit() {
            status.rejected += 1;
            tracing::error!(
                trigger = trigger.as_str(),
                generation = status.generation,
                "reload rejected; still serving the previous configuration:\n{message}"
            );
        }
        status.pending_error = true;
        status.last_rejected_at = Some(SystemTime::now());
        status.last_error = Some(Failure {
            at: SystemTime::now(),
            trigger,
            message: message.clone(),
        });
        Outcome::Rejected { message }
    }
}

/// The directories whose changes can change the configuration: the policy
/// directory and the directories of the files it refers to (a Secret
/// mounted elsewhere, for instance).
fn watch_dirs(dir: &Path, config: &Config) -> Vec<PathBuf> {
    let mut dirs = vec![dir.to_path_buf()];
    for file in &config.files {
        if let Some(parent) = file.parent()
            && !dirs.iter().any(|d| d == parent)
        {
            dirs.push(parent.to_path_buf());
        }
    }
    dirs
}
