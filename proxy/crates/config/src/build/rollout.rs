//! A plugin use's `rollout`: the candidate's use (the use's settings,
//! with the candidate's plugin and config) and its schedule.

use super::*;
use crate::raw::RawRollout;
use crate::{Rollout, RolloutKey};

/// How long each step is held by default.
const DEFAULT_INTERVAL: Duration = Duration::from_secs(300);
/// The outcomes compared by default: the last minute's.
const DEFAULT_WINDOW: Duration = Duration::from_secs(60);
const DEFAULT_MIN_REQUESTS: u32 = 20;
const DEFAULT_MARGIN: u32 = 5;

/// `current`'s rollout as `raw` states it.
pub(super) fn rollout(
    ctx: &mut Ctx,
    current: &PluginUse,
    raw: &Spanned<RawRollout>,
    (u, plugin_index): (&RawPluginUse, &HashMap<String, usize>),
) -> Option<Rollout> {
    let r = &raw.value;
    let name = ctx.text(&r.to)?;
    let name = name.trim();
    let Some(&plugin) = plugin_index.get(name) else {
        if !ctx.lost(name) {
            let mut known: Vec<_> = plugin_index.keys().map(String::as_str).collect();
            known.sort_unstable();
            let hint = ctx.unparsed_hint();
            ctx.err(
                &r.to.referenced,
                format!(
                    "unknown plugin `{name}` to roll out; defined under `plugins:`: {}{hint}",
                    known.join(", ")
                ),
            );
        }
        return None;
    };
    if plugin == current.plugin {
        ctx.err(
            &r.to.referenced,
            format!("`{name}` is the plugin the use runs already: roll out another plugin (a new version under a name of its own)"),
        );
        return None;
    }
    let mut candidate = current.clone();
    candidate.plugin = plugin;
    if let Some(config) = &r.config {
        let asked = current.expansion.as_ref().and_then(|e| e.asked);
        let expansion = expand_configs(ctx, Some(config), u.vm_config.as_ref(), asked);
        candidate.config_json = config.value.to_string();
        candidate.expansion = Some(Box::new(expansion));
    }
    let steps = steps(ctx, r, &raw.referenced)?;
    let positive = |what: &'static str| {
        move |s: &str| {
            let d = parse_duration(s)?;
            if d.is_zero() {
                Err(format!("rollout {what} `{s}` must be above 0"))
            } else {
                Ok(d)
            }
        }
    };
    let interval = ctx.parse_or(&r.interval, DEFAULT_INTERVAL, positive("interval"));
    let window = ctx.parse_or(&r.window, DEFAULT_WINDOW, positive("window"));
    let key = ctx.parse_or(&r.key, RolloutKey::Client, rollout_key);
    let min_requests = ctx.parse_or(&r.min_requests, DEFAULT_MIN_REQUESTS, |s| {
        s.parse::<u32>()
            .ok()
            .filter(|n| *n >= 1)
            .ok_or_else(|| format!("rollout min_requests `{s}` is not a count of 1 or more"))
    });
    let margin = ctx.parse_or(&r.margin, DEFAULT_MARGIN, |s| {
        s.trim_end_matches('%')
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|n| *n <= 100)
            .ok_or_else(|| format!("rollout margin `{s}` is not a share from 0 to 100"))
    });
    Some(Rollout {
        candidate,
        steps,
        interval,
        key,
        window,
        min_requests,
        margin,
    })
}

/// `percent` (one share, held) or `steps` (rising shares): one of them.
fn steps(ctx: &mut Ctx, r: &RawRollout, at: &Location) -> Option<Vec<u32>> {
    let share = |ctx: &mut Ctx, t: &Text| {
        ctx.parse(t, |s| {
            s.trim_end_matches('%')
                .trim()
                .parse::<u32>()
                .ok()
                .filter(|n| (1..=100).contains(n))
                .ok_or_else(|| format!("rollout share `{s}` is not a share from 1 to 100"))
        })
    };
    match (&r.percent, &r.steps) {
        (Some(p), None) => Some(vec![share(ctx, p)?]),
        (None, Some(list)) => {
            let mut steps = Vec::with_capacity(list.value.len());
            for t in &list.value {
                let n = share(ctx, t)?;
                if steps.last().is_some_and(|&last| n <= last) {
                    ctx.err(
                        &t.referenced,
                        format!(
                            "rollout steps rise: `{n}` comes after {}",
                            steps[steps.len() - 1]
                        ),
                    );
                    return None;
                }
                steps.push(n);
            }
            if steps.is_empty() {
                ctx.err(&list.referenced, "rollout `steps` is empty");
                return None;
            }
            Some(steps)
        }
        (Some(p), Some(_)) => {
            ctx.err(
                &p.referenced,
                "a rollout has `percent` (one share, held) or `steps`, not both",
            );
            None
        }
        (None, None) => {
            ctx.err(
                at,
                "a rollout needs `percent` (one share, held) or `steps` (shares taken in turn)",
            );
            None
        }
    }
}

/// `client`, `header:NAME` or `cookie:NAME`.
fn rollout_key(s: &str) -> Result<RolloutKey, String> {
    if s == "client" {
        return Ok(RolloutKey::Client);
    }
    let named = |name: &str| {
        let name = name.trim();
        HeaderName::from_bytes(name.as_bytes())
            .map(|_| name.to_ascii_lowercase())
            .map_err(|_| format!("`{name}` is not a header name"))
    };
    if let Some(name) = s.strip_prefix("header:") {
        return Ok(RolloutKey::Header(named(name)?));
    }
    if let Some(name) = s.strip_prefix("cookie:") {
        let name = name.trim();
        if name.is_empty() || name.contains(['=', ';', ' ']) {
            return Err(format!("`{name}` is not a cookie name"));
        }
        return Ok(RolloutKey::Cookie(name.to_owned()));
    }
    Err(format!(
        "`{s}` is not a rollout key; use client, header:NAME or cookie:NAME"
    ))
}
