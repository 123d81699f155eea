//! What one plugin may take of what every plugin shares, so that one
//! that misbehaves (or is hostile) costs only itself:
//!
//! - **metric names**: the counters a plugin keeps (`host.count`, a
//!   proxy-wasm filter's metrics) are at most [`MAX_OWN_NAMES`] names per
//!   plugin; one more is refused and counted (`metrics_refused`), so a
//!   plugin that names a counter per request cannot grow `/metrics`
//!   without end;
//! - **log lines**: a plugin's lines (its log calls, stdout and stderr,
//!   whatever its kind) share one budget of [`LOG_LINES_PER_SECOND`]; the
//!   rest are dropped and counted (`log_lines_dropped`), and the drop is
//!   reported once a second;
//! - **framing**: a plugin's edits of the fields that frame a message
//!   ([`portcullis_net::framing`]) are ignored and counted
//!   (`framing_edits_refused`): the proxy alone frames messages. One edit
//!   is taken: removing `Content-Length`, which a filter that changes a
//!   body does (as the proxy-wasm SDKs' examples do), and which only
//!   leaves the proxy to frame the body itself (by its length when whole,
//!   in chunks when it streams).
//!
//! The proxy's own counts of a plugin (`failures`, `deadline_hits`, the
//! refusals above...) are in the same family and never refused.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// Distinct counter (or metric) names one plugin may define itself.
pub const MAX_OWN_NAMES: usize = 500;
/// The longest name a plugin may give a metric.
pub const MAX_NAME_LEN: usize = 128;
/// Lines one plugin may log in a second, all its instances and streams
/// together.
pub const LOG_LINES_PER_SECOND: u32 = 100;
/// Longest log line kept; the rest of a longer one is cut.
pub const MAX_LOG_LINE: usize = 4096;

/// Counter values by plugin and counter name.
#[derive(Default)]
pub struct Counters {
    values: HashMap<(Arc<str>, String), u64>,
    /// How many names each plugin has defined itself.
    own: HashMap<Arc<str>, usize>,
}

impl Counters {
    /// Adds `delta` to the proxy's own count `name` of `plugin`.
    pub fn add(&mut self, plugin: &Arc<str>, name: &str, delta: u64) {
        match self.values.get_mut(&(plugin.clone(), name.to_owned())) {
            Some(v) => *v = v.saturating_add(delta),
            None => {
                self.values.insert((plugin.clone(), name.to_owned()), delta);
            }
        }
    }

    /// Adds `delta` to a counter `plugin` keeps itself, unless it is a new
    /// name past its [`MAX_OWN_NAMES`] or longer than [`MAX_NAME_LEN`]
    /// (then counted as `metrics_refused`). Whether it was kept.
    pub fn add_own(&mut self, plugin: &Arc<str>, name: &str, delta: u64) -> bool {
        if let Some(v) = self.values.get_mut(&(plugin.clone(), name.to_owned())) {
            *v = v.saturating_add(delta);
            return true;
        }
        if !self.may_define(plugin, name) {
            return false;
        }
        self.values.insert((plugin.clone(), name.to_owned()), delta);
        true
    }

    /// Whether `plugin` may define one more name of its own, `name`
    /// (counted as defined if so; as `metrics_refused` if not).
    pub fn may_define(&mut self, plugin: &Arc<str>, name: &str) -> bool {
        let own = self.own.entry(plugin.clone()).or_default();
        if *own >= MAX_OWN_NAMES || name.len() > MAX_NAME_LEN {
            self.add(plugin, "metrics_refused", 1);
            return false;
        }
        *own += 1;
        true
    }

    /// The count `name` of `plugin`, 0 if none.
    pub fn get(&self, plugin: &str, name: &str) -> u64 {
        let key: (Arc<str>, String) = (plugin.into(), name.to_owned());
        self.values.get(&key).copied().unwrap_or(0)
    }

    /// Sets a counter a plugin keeps (defined already) to `value`.
    pub fn value_mut(&mut self, plugin: &Arc<str>, name: &str) -> &mut u64 {
        self.values
            .entry((plugin.clone(), name.to_owned()))
            .or_default()
    }

    /// Every counter, by plugin and name.
    pub fn iter(&self) -> impl Iterator<Item = (&(Arc<str>, String), &u64)> {
        self.values.iter()
    }
}

/// Counters plugins keep (`host.count`, proxy-wasm counters) and the
/// proxy's own counts of each plugin.
pub fn counters() -> &'static Mutex<Counters> {
    static COUNTERS: OnceLock<Mutex<Counters>> = OnceLock::new();
    COUNTERS.get_or_init(Default::default)
}

/// Adds one to the proxy's own count `name` of `plugin`.
pub fn count(plugin: &Arc<str>, name: &str) {
    counters()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .add(plugin, name, 1);
}

/// One plugin's log budget in the current second.
struct Window {
    began: Instant,
    logged: u32,
    dropped: u64,
}

/// Whether `plugin` may log one more line now. A line past its budget is
/// counted as dropped; the first line of the next second that had drops
/// reports them.
pub fn may_log(plugin: &Arc<str>) -> bool {
    static WINDOWS: OnceLock<Mutex<HashMap<Arc<str>, Window>>> = OnceLock::new();
    let mut windows = WINDOWS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let now = Instant::now();
    let w = windows.entry(plugin.clone()).or_insert(Window {
        began: now,
        logged: 0,
        dropped: 0,
    });
    if now.duration_since(w.began).as_secs() >= 1 {
        if w.dropped > 0 {
            tracing::warn!(target: "plugin", plugin = &**plugin, dropped = w.dropped,
                "plugin log lines dropped (over {LOG_LINES_PER_SECOND} a second)");
        }
        *w = Window {
            began: now,
            logged: 0,
            dropped: 0,
        };
    }
    if w.logged < LOG_LINES_PER_SECOND {
        w.logged += 1;
        return true;
    }
    w.dropped += 1;
    drop(windows);
    count(plugin, "log_lines_dropped");
    false
}

/// `message` cut to [`MAX_LOG_LINE`] bytes, at a character boundary.
pub fn log_line(message: &str) -> &str {
    &message[..message.floor_char_boundary(MAX_LOG_LINE)]
}

/// How a plugin edits a header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Edit {
    /// Sets, adds or replaces a value.
    Set,
    /// Removes every value.
    Remove,
}

/// Whether a plugin may make `edit` to the header `name`; a framing
/// field's edit is refused, counted and logged (at debug: the counter
/// tells an operator), but for the removal of `Content-Length`.
pub fn may_edit(plugin: &Arc<str>, name: &str, edit: Edit) -> bool {
    if !portcullis_net::framing::is_framing(name)
        || (edit == Edit::Remove && name.eq_ignore_ascii_case("content-length"))
    {
        return true;
    }
    tracing::debug!(
        plugin = &**plugin,
        header = name,
        "plugin edited a field that frames the message; ignored (the proxy frames messages)"
    );
    count(plugin, "framing_edits_refused");
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plugin_defines_at_most_its_share_of_names() {
        let mut c = Counters::default();
        let (greedy, other): (Arc<str>, Arc<str>) = ("greedy".into(), "other".into());
        for i in 0..MAX_OWN_NAMES {
            assert!(c.add_own(&greedy, &format!("n{i}"), 1));
        }
        assert!(!c.add_own(&greedy, "one-more", 1));
        assert!(c.add_own(&greedy, "n0", 1), "a name it has is kept");
        assert_eq!(c.get("greedy", "n0"), 2);
        assert_eq!(c.get("greedy", "metrics_refused"), 1);
        assert!(
            c.add_own(&other, "n0", 1),
            "another plugin's share is its own"
        );
        assert!(!c.add_own(&other, &"x".repeat(MAX_NAME_LEN + 1), 1));
        c.add(&greedy, "failures", 1);
        assert_eq!(
            c.get("greedy", "failures"),
            1,
            "the proxy's counts are never refused"
        );
    }

    #[test]
    fn framing_fields_are_not_the_plugins_to_edit() {
        let plugin: Arc<str> = "framing-test".into();
        assert!(may_edit(&plugin, "x-user", Edit::Set));
        assert!(may_edit(&plugin, "x-user", Edit::Remove));
        assert!(!may_edit(&plugin, "Content-Length", Edit::Set));
        assert!(may_edit(&plugin, "Content-Length", Edit::Remove));
        assert!(!may_edit(&plugin, "transfer-encoding", Edit::Set));
        assert!(!may_edit(&plugin, "connection", Edit::Remove));
        assert_eq!(
            counters()
                .lock()
                .unwrap()
                .get("framing-test", "framing_edits_refused"),
            3
        );
    }

    #[test]
    fn a_plugin_logs_at_most_its_budget_a_second() {
        let plugin: Arc<str> = "chatty".into();
        let logged = (0..LOG_LINES_PER_SECOND * 3)
            .filter(|_| may_log(&plugin))
            .count();
        // Within one second (or, on a slow machine, two).
        assert!(logged <= 2 * LOG_LINES_PER_SECOND as usize, "{logged}");
        assert!(logged >= LOG_LINES_PER_SECOND as usize, "{logged}");
        let dropped = counters()
            .lock()
            .unwrap()
            .get("chatty", "log_lines_dropped");
        assert_eq!(dropped as usize, 3 * LOG_LINES_PER_SECOND as usize - logged);
    }
}
