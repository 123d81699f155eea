//! Raw policy files → validated [`Config`]. Collects every error.
//!
//! Here: the checking context and the whole config put together; each
//! part's own checks are in `listeners.rs`, `upstreams.rs`, `routes.rs`,
//! `route_features.rs` and `plugins.rs`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, PathAndQuery};
use http::{HeaderName, HeaderValue, Method, StatusCode, Uri, header};
use serde_saphyr::{Location, Spanned};

use super::RequestIds;
use super::envsubst::expand;
use super::raw::{
    PolicyFile, RawAuthCache, RawAuthRequest, RawCompress, RawCors, RawHeaderEdits, RawHealthCheck,
    RawListener, RawListenerTls, RawMirror, RawPlugin, RawPluginUse, RawRateLimit, RawRoute,
    RawTracing, RawUpstream, Text, TextMap,
};
use super::router::{HostMatch, Router};
use super::template::Template;
use super::units::{parse_duration, parse_size};
use super::{
    AccessLogging, Action, AuthCacheSpec, AuthRequest, Balance, ClientAuthMode, Compression,
    Config, ConfigError, Cors, Dns, Endpoint, FailMode, HashOn, HeaderEdits, HealthCheck, Http3,
    LimitKey, Listener, ListenerTls, LocalResponse, MirrorSpec, PathRewrite, PluginModule,
    PluginUse, Pos, Probe, RateLimitSpec, Redirect, RetryBudget, Route, Target, Timeouts,
    TlsSettings, Tracing, Upstream,
};

mod listeners;
mod plugin_files;
mod plugins;
mod pull;
mod rollout;
mod route_features;
mod routes;
mod upstreams;

use listeners::*;
pub use plugins::MAX_PLUGIN_MEMORY;
use plugins::*;
use route_features::*;
use routes::*;
pub use upstreams::upstream_at;
use upstreams::*;

const DEFAULT_MAX_CONNECTIONS: usize = 16_384;
const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// nginx's `keepalive_timeout`: above the idle timeout of the balancers
/// that usually front the proxy (AWS ALB, ingress-nginx: 60 s), so they
/// close an idle connection before the proxy does and never reuse one just
/// as it closes.
pub const DEFAULT_KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(75);
/// A listener's `max_request_header_size` unless it says otherwise.
pub const DEFAULT_MAX_HEADER_SIZE: usize = 32 * 1024;
/// nginx's proxy_read_timeout, which the replaced routing service relied
/// on: for the response head, and between reads of the body.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
const DEFAULT_TIMEOUTS: Timeouts = Timeouts {
    connect: Duration::from_secs(5),
    request: DEFAULT_REQUEST_TIMEOUT,
    read: Duration::from_secs(60),
    idle: Duration::from_secs(90),
    // nginx's keepalive_time and keepalive_requests defaults.
    lifetime: Duration::from_secs(3600),
};
const DEFAULT_REQUESTS_PER_CONNECTION: u32 = 1000;
const DEFAULT_RETRIES: u32 = 1;
/// nginx's `fail_timeout` default.
const DEFAULT_EJECT_FOR: Duration = Duration::from_secs(10);
/// How often `dns: each_address` looks hosts up again (Envoy's default
/// `dns_refresh_rate`).
const DEFAULT_DNS_REFRESH: Duration = Duration::from_secs(5);
/// Health checks every 5 s with 2 s to answer: a dead endpoint is out
/// ~15 s after it stops answering (3 failures), as Kubernetes' readiness
/// probe defaults (period 10 s, 3 failures) would take it out of a
/// Service in 30 s.
const DEFAULT_HEALTH_INTERVAL: Duration = Duration::from_secs(5);
const DEFAULT_HEALTH_TIMEOUT: Duration = Duration::from_secs(2);
/// An auth service is on the request's path: it answers fast or not at
/// all (nginx leaves it at proxy_read_timeout's 60 s).
const DEFAULT_AUTH_TIMEOUT: Duration = Duration::from_secs(5);

/// Error collector and value parser for one file at a time.
struct Ctx<'e> {
    env: &'e dyn Fn(&str) -> Option<String>,
    file: Arc<str>,
    errors: Vec<ConfigError>,
    /// Files the policies refer to (plugins, CA files, secrets): a reload
    /// watches them too.
    files: Vec<std::path::PathBuf>,
    /// Policy files that did not parse: a name unknown here may be defined
    /// in one of them, which an "unknown upstream" error then says.
    unparsed: &'e [Arc<str>],
    /// Names of entries those files define with an error (reported
    /// there): a reference to one is not unknown.
    lost: &'e [String],
    /// Values that came from the environment or a file (a secret, maybe),
    /// each with the reference it came from: an error names the
    /// reference, never the value.
    substituted: Vec<(String, String)>,
}

/// `s`, or `true`/`false` for any spelling YAML has for those (1.1's
/// yes/no/on/off/y/n too, in any case). Values are read as written, so a
/// switch written `websocket: yes` or `True` still reads as one, where a
/// header value `yes` stays `yes`.
fn boolean_word(s: &str) -> &str {
    const TRUE: [&str; 4] = ["true", "yes", "on", "y"];
    const FALSE: [&str; 4] = ["false", "no", "off", "n"];
    if TRUE.iter().any(|w| s.eq_ignore_ascii_case(w)) {
        "true"
    } else if FALSE.iter().any(|w| s.eq_ignore_ascii_case(w)) {
        "false"
    } else {
        s
    }
}

impl Ctx<'_> {
    pub(super) fn pos(&self, loc: &Location) -> Pos {
        Pos {
            file: self.file.clone(),
            line: loc.line(),
            column: loc.column(),
        }
    }

    pub(super) fn err(&mut self, loc: &Location, message: impl Into<String>) {
        let pos = self.pos(loc);
        let message = crate::envsubst::redact(message.into(), &self.substituted);
        self.errors.push(ConfigError { pos, message });
    }

    /// Notes that `raw` expanded to `value`, to keep `value` out of errors.
    pub(super) fn substituted(&mut self, raw: &str, value: &str) {
        // A value written in the file itself (a default, `:+true`) is no
        // secret, and replacing it would garble messages that use it.
        if raw.contains("${") && !value.is_empty() && !raw.contains(value) {
            self.substituted
                .push((value.to_owned(), format!("value of {raw}")));
        }
    }

    /// The value with `${ENV}` references expanded.
    /// For an unknown name: the files it may be defined in, when some did
    /// not parse (their errors are reported too).
    /// Whether `name` is defined in an entry left out for an error.
    pub(super) fn lost(&self, name: &str) -> bool {
        self.lost.iter().any(|l| l == name)
    }

    pub(super) fn unparsed_hint(&self) -> String {
        if self.unparsed.is_empty() {
            return String::new();
        }
        let names: Vec<&str> = self.unparsed.iter().map(|f| &**f).collect();
        format!(" (or in what of {} did not parse)", names.join(", "))
    }

    pub(super) fn text(&mut self, t: &Text) -> Option<String> {
        match expand(&t.value.0, self.env) {
            Ok(v) => {
                self.substituted(&t.value.0, &v);
                Some(v)
            }
            Err(e) => {
                self.err(&t.referenced, e);
                None
            }
        }
    }

    pub(super) fn parse<T>(
        &mut self,
        t: &Text,
        f: impl FnOnce(&str) -> Result<T, String>,
    ) -> Option<T> {
        let s = self.text(t)?;
        match f(s.trim()) {
            Ok(v) => Some(v),
            Err(e) => {
                self.err(&t.referenced, e);
                None
            }
        }
    }

    pub(super) fn parse_or<T>(
        &mut self,
        t: &Option<Text>,
        default: T,
        f: impl FnOnce(&str) -> Result<T, String>,
    ) -> T {
        match t {
            Some(t) => self.parse(t, f).unwrap_or(default),
            None => default,
        }
    }

    pub(super) fn flag(&mut self, t: &Option<Text>, default: bool) -> bool {
        self.parse_or(t, default, |s| match boolean_word(s) {
            "true" => Ok(true),
            "false" => Ok(false),
            _ => Err(format!("`{s}` is not a boolean; write true or false")),
        })
    }

    /// An `enabled` switch: on unless written `false` or empty (as
    /// `${SECRET:+true}` expands when SECRET is unset); `None` when it is
    /// neither.
    pub(super) fn switch(&mut self, t: &Option<Text>) -> Option<bool> {
        let Some(t) = t else { return Some(true) };
        self.parse(t, |s| match boolean_word(s) {
            "" | "false" => Ok(false),
            "true" => Ok(true),
            _ => Err(format!(
                "`{s}` is not a boolean; write true or false (empty means false)"
            )),
        })
    }

    pub(super) fn duration(&mut self, t: &Option<Text>, default: Duration) -> Duration {
        self.parse_or(t, default, parse_duration)
    }

    /// Resolves a file path written in a policy relative to that policy's directory.
    pub(super) fn path(&mut self, t: &Text) -> Option<std::path::PathBuf> {
        let s = self.text(t)?;
        let p = Path::new(&s);
        let path = if p.is_absolute() {
            p.to_path_buf()
        } else {
            Path::new(&*self.file)
                .parent()
                .unwrap_or(Path::new("."))
                .join(p)
        };
        self.files.push(path.clone());
        Some(path)
    }

    pub(super) fn header_pairs(&mut self, map: &TextMap) -> Vec<(HeaderName, HeaderValue)> {
        let mut out = Vec::with_capacity(map.value.len());
        for (name, value) in &map.value {
            let Ok(name) = HeaderName::from_str(name) else {
                self.err(
                    &map.referenced,
                    format!("`{name}` is not a valid header name"),
                );
                continue;
            };
            if let Some(v) = self.parse(value, |s| {
                HeaderValue::from_str(s).map_err(|_| format!("`{s}` is not a valid header value"))
            }) {
                out.push((name, v));
            }
        }
        out
    }

    /// The header fields a policy's `field` sets, adds or answers with:
    /// any but those that frame a message ([`portcullis_net::framing`]),
    /// which are refused where they are named.
    pub(super) fn edited_pairs(
        &mut self,
        map: &TextMap,
        field: &str,
    ) -> Vec<(HeaderName, HeaderValue)> {
        let pairs = self.header_pairs(map);
        pairs
            .into_iter()
            .filter(|(name, _)| self.not_framing(&map.referenced, name.as_str(), field))
            .collect()
    }

    /// Whether `name` may be edited by a policy; if not, says so at `at`.
    fn not_framing(&mut self, at: &Location, name: &str, field: &str) -> bool {
        if !portcullis_net::framing::is_framing(name) {
            return true;
        }
        self.err(
            at,
            format!(
                "`{field}` edits `{name}`, which frames the message: the proxy alone sets it \
                 (and {}), as a value that disagreed with the body would mix one answer's \
                 bytes into the next on a shared connection; remove it",
                portcullis_net::framing::listed()
            ),
        );
        false
    }

    pub(super) fn header_edits(
        &mut self,
        raw: &Option<RawHeaderEdits>,
        field: &str,
    ) -> HeaderEdits {
        let Some(raw) = raw else {
            return HeaderEdits::default();
        };
        let add = raw
            .add
            .as_ref()
            .map(|m| self.edited_pairs(m, field))
            .unwrap_or_default();
        let set = raw
            .set
            .as_ref()
            .map(|m| self.edited_pairs(m, field))
            .unwrap_or_default();
        let remove = raw
            .remove
            .iter()
            .filter_map(|t| {
                let name = self.parse(t, |s| {
                    HeaderName::from_str(s).map_err(|_| format!("`{s}` is not a valid header name"))
                })?;
                self.not_framing(&t.referenced, name.as_str(), field)
                    .then_some(name)
            })
            .collect();
        HeaderEdits { add, set, remove }
    }
}

/// A route waiting for the router, which needs every route first.
struct PendingRoute {
    index: usize,
    host: HostMatch,
    patterns: Vec<String>,
    at: Location,
    file: Arc<str>,
}

/// Builds as much of the config as is valid, and lists every error: what
/// has errors is left out (a route with a bad match, a plugin whose file
/// cannot be read and its uses), so `check` can go on to ask the plugins
/// that do load about their configs.
pub(super) fn build(
    files: &[(Arc<str>, PolicyFile)],
    env: &dyn Fn(&str) -> Option<String>,
    (unparsed, lost, every_plugin): (&[Arc<str>], &[String], bool),
) -> (Config, Vec<ConfigError>) {
    let mut ctx = Ctx {
        env,
        file: "".into(),
        errors: Vec::new(),
        files: Vec::new(),
        unparsed,
        lost,
        substituted: Vec::new(),
    };
    let mut listeners = Vec::new();
    let mut upstreams: Vec<Arc<Upstream>> = Vec::new();
    // By name: the upstream's index, or `None` for one defined with errors
    // (reported where it is defined; a route using it adds nothing).
    let mut upstream_index: HashMap<String, Option<usize>> = HashMap::new();
    let mut plugin_defs: Vec<(Arc<str>, &Spanned<RawPlugin>, Pos)> = Vec::new();
    let mut plugin_index: HashMap<String, usize> = HashMap::new();

    for (file, policy) in files {
        ctx.file = file.clone();
        for l in &policy.listeners {
            if let Some(listener) = listener(&mut ctx, l) {
                if let Some(dup) = listeners
                    .iter()
                    .find(|o: &&Listener| o.name == listener.name)
                {
                    let msg = format!(
                        "listener `{}` is already defined at {}",
                        listener.name, dup.defined_at
                    );
                    ctx.err(&l.referenced, msg);
                } else if let Some(dup) = listeners
                    .iter()
                    .find(|o: &&Listener| o.bind == listener.bind && o.bind.port() != 0)
                {
                    let msg = format!(
                        "address {} is already bound by listener `{}` ({})",
                        listener.bind, dup.name, dup.defined_at
                    );
                    ctx.err(&l.referenced, msg);
                } else {
                    listeners.push(listener);
                }
            }
        }
        for p in &policy.plugins {
            // Only plugins some route uses are read (below), so a policy
            // may define one whose file is absent while nothing uses it;
            // `check` reads them all (`every_plugin`).
            if let Some(n) = name(&mut ctx, &p.value.name, "plugin") {
                if let Some(&i) = plugin_index.get(&n) {
                    let at: &Pos = &plugin_defs[i].2;
                    let msg = format!("plugin `{n}` is already defined at {at}");
                    ctx.err(&p.referenced, msg);
                } else {
                    plugin_index.insert(n, plugin_defs.len());
                    plugin_defs.push((file.clone(), p, ctx.pos(&p.referenced)));
                }
            }
        }
        for u in &policy.upstreams {
            let Some(up) = upstream(&mut ctx, u) else {
                if let Ok(name) = expand(&u.value.name.value.0, ctx.env) {
                    upstream_index.entry(name.trim().to_owned()).or_insert(None);
                }
                continue;
            };
            if let Some(&Some(i)) = upstream_index.get(&*up.name) {
                let msg = format!(
                    "upstream `{}` is already defined at {}",
                    up.name, upstreams[i].defined_at
                );
                ctx.err(&u.referenced, msg);
            } else {
                upstream_index.insert(up.name.to_string(), Some(upstreams.len()));
                upstreams.push(Arc::new(up));
            }
        }
    }

    // Uses come after every file's definitions, so a route may use an
    // upstream or plugin defined in another file.
    let mut global_plugins = Vec::new();
    for (file, policy) in files {
        ctx.file = file.clone();
        for u in &policy.global_plugins {
            if let Some(pu) = plugin_use(&mut ctx, u, &plugin_index) {
                global_plugins.push(pu);
            }
        }
    }
    let mut tracing = None;
    let mut tracing_at: Option<Pos> = None;
    for (file, policy) in files {
        ctx.file = file.clone();
        let Some(t) = &policy.tracing else { continue };
        match &tracing_at {
            Some(at) => ctx.err(&t.referenced, format!("tracing is already set at {at}")),
            None => {
                tracing_at = Some(ctx.pos(&t.referenced));
                tracing = tracing_settings(&mut ctx, t, &upstream_index, &upstreams);
            }
        }
    }
    let mut routes: Vec<Arc<Route>> = Vec::new();
    let mut pending: Vec<PendingRoute> = Vec::new();
    let mut route_names: HashMap<String, Pos> = HashMap::new();
    for (file, policy) in files {
        ctx.file = file.clone();
        for r in &policy.routes {
            let Some((route, host, patterns)) =
                route(&mut ctx, r, &upstream_index, &plugin_index, &mut upstreams)
            else {
                continue;
            };
            if let Some(pos) = route_names.get(&*route.name) {
                let msg = format!("route `{}` is already defined at {pos}", route.name);
                ctx.err(&r.referenced, msg);
                continue;
            }
            route_names.insert(route.name.to_string(), route.defined_at.clone());
            pending.push(PendingRoute {
                index: routes.len(),
                host,
                patterns,
                at: r.value.matcher.referenced,
                file: file.clone(),
            });
            routes.push(Arc::new(route));
        }
    }

    let mut router = Router::default();
    for p in &pending {
        for pattern in &p.patterns {
            if let Err(e) = router.insert(&p.host, pattern, p.index, &routes) {
                ctx.file = p.file.clone();
                ctx.err(&p.at, e);
            }
        }
    }

    // Read the plugins that are used, and renumber the uses to match.
    let mut used = vec![every_plugin; plugin_defs.len()];
    for u in global_plugins
        .iter()
        .chain(routes.iter().flat_map(|r| r.plugins.iter()))
    {
        used[u.plugin] = true;
        if let Some(r) = &u.rollout {
            used[r.candidate.plugin] = true;
        }
    }
    let mut plugins: Vec<Arc<PluginModule>> = Vec::new();
    let mut renumber = vec![usize::MAX; plugin_defs.len()];
    for (i, (file, def, _)) in plugin_defs.iter().enumerate() {
        if used[i] {
            ctx.file = file.clone();
            if let Some(m) = plugin_module(&mut ctx, def) {
                renumber[i] = plugins.len();
                plugins.push(Arc::new(m));
            }
        }
    }
    // Uses of a plugin that could not be read go (its error is reported);
    // the others get the config their plugin's kind takes.
    let mut renumbered = |uses: &mut Vec<PluginUse>| {
        uses.retain_mut(|u| {
            u.plugin = renumber[u.plugin];
            if u.plugin == usize::MAX {
                return false;
            }
            settle_config(&mut ctx, u, &plugins[u.plugin]);
            named_upstreams(&mut ctx, u, &plugins[u.plugin], &upstreams);
            // A rollout to a plugin that could not be read goes too.
            if let Some(r) = u.rollout.as_mut() {
                let c = &mut r.candidate;
                c.plugin = renumber[c.plugin];
                if c.plugin == usize::MAX {
                    u.rollout = None;
                } else {
                    settle_config(&mut ctx, c, &plugins[c.plugin]);
                    named_upstreams(&mut ctx, c, &plugins[c.plugin], &upstreams);
                }
            }
            true
        });
    };
    renumbered(&mut global_plugins);
    for r in &mut routes {
        // Nothing else holds the routes yet.
        if let Some(r) = Arc::get_mut(r) {
            renumbered(&mut r.plugins);
        }
    }

    let config = Config {
        listeners,
        upstreams,
        routes,
        router,
        plugins,
        global_plugins,
        tracing,
        files: ctx.files,
        fingerprint: [0; 32],
    };
    (config, ctx.errors)
}

fn name(ctx: &mut Ctx, t: &Text, what: &str) -> Option<String> {
    ctx.parse(t, |s| {
        let ok = !s.is_empty()
            && s.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
        if ok {
            Ok(s.to_owned())
        } else {
            Err(format!(
                "`{s}` is not a valid {what} name (letters, digits, `-`, `_`, `.`)"
            ))
        }
    })
}
