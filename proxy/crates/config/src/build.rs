//! Raw policy files → validated [`Config`]. Collects every error.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::uri::{Authority, PathAndQuery};
use http::{HeaderName, HeaderValue, Method, StatusCode, Uri, header};
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject;
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
    Config, ConfigError, Cors, Dns, Endpoint, FailMode, HashOn, HeaderEdits, HealthCheck, LimitKey,
    Listener, ListenerTls, LocalResponse, MirrorSpec, PathRewrite, PluginModule, PluginUse, Pos,
    Probe, RateLimitSpec, Redirect, RetryBudget, Route, Target, Timeouts, TlsSettings, Tracing,
    Upstream,
};

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
    fn pos(&self, loc: &Location) -> Pos {
        Pos {
            file: self.file.clone(),
            line: loc.line(),
            column: loc.column(),
        }
    }

    fn err(&mut self, loc: &Location, message: impl Into<String>) {
        let pos = self.pos(loc);
        self.errors.push(ConfigError {
            pos,
            message: message.into(),
        });
    }

    /// The value with `${ENV}` references expanded.
    /// For an unknown name: the files it may be defined in, when some did
    /// not parse (their errors are reported too).
    fn unparsed_hint(&self) -> String {
        if self.unparsed.is_empty() {
            return String::new();
        }
        let names: Vec<&str> = self.unparsed.iter().map(|f| &**f).collect();
        format!(" (or in {}, which did not parse)", names.join(", "))
    }

    fn text(&mut self, t: &Text) -> Option<String> {
        match expand(&t.value.0, self.env) {
            Ok(v) => Some(v),
            Err(e) => {
                self.err(&t.referenced, e);
                None
            }
        }
    }

    fn parse<T>(&mut self, t: &Text, f: impl FnOnce(&str) -> Result<T, String>) -> Option<T> {
        let s = self.text(t)?;
        match f(s.trim()) {
            Ok(v) => Some(v),
            Err(e) => {
                self.err(&t.referenced, e);
                None
            }
        }
    }

    fn parse_or<T>(
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

    fn flag(&mut self, t: &Option<Text>, default: bool) -> bool {
        self.parse_or(t, default, |s| match boolean_word(s) {
            "true" => Ok(true),
            "false" => Ok(false),
            _ => Err(format!("`{s}` is not a boolean; write true or false")),
        })
    }

    /// An `enabled` switch: on unless written `false` or empty (as
    /// `${SECRET:+true}` expands when SECRET is unset); `None` when it is
    /// neither.
    fn switch(&mut self, t: &Option<Text>) -> Option<bool> {
        let Some(t) = t else { return Some(true) };
        self.parse(t, |s| match boolean_word(s) {
            "" | "false" => Ok(false),
            "true" => Ok(true),
            _ => Err(format!(
                "`{s}` is not a boolean; write true or false (empty means false)"
            )),
        })
    }

    fn duration(&mut self, t: &Option<Text>, default: Duration) -> Duration {
        self.parse_or(t, default, parse_duration)
    }

    /// Resolves a file path written in a policy relative to that policy's directory.
    fn path(&mut self, t: &Text) -> Option<std::path::PathBuf> {
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

    fn header_pairs(&mut self, map: &TextMap) -> Vec<(HeaderName, HeaderValue)> {
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

    fn header_edits(&mut self, raw: &Option<RawHeaderEdits>) -> HeaderEdits {
        let Some(raw) = raw else {
            return HeaderEdits::default();
        };
        let add = raw
            .add
            .as_ref()
            .map(|m| self.header_pairs(m))
            .unwrap_or_default();
        let set = raw
            .set
            .as_ref()
            .map(|m| self.header_pairs(m))
            .unwrap_or_default();
        let remove = raw
            .remove
            .iter()
            .filter_map(|t| {
                self.parse(t, |s| {
                    HeaderName::from_str(s).map_err(|_| format!("`{s}` is not a valid header name"))
                })
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
    unparsed: &[Arc<str>],
) -> (Config, Vec<ConfigError>) {
    let mut ctx = Ctx {
        env,
        file: "".into(),
        errors: Vec::new(),
        files: Vec::new(),
        unparsed,
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
            // may define one whose file is absent while nothing uses it.
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
    let mut used = vec![false; plugin_defs.len()];
    for u in global_plugins
        .iter()
        .chain(routes.iter().flat_map(|r| r.plugins.iter()))
    {
        used[u.plugin] = true;
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
    // Uses of a plugin that could not be read go (its error is reported).
    let renumbered = |uses: &mut Vec<PluginUse>| {
        uses.retain_mut(|u| {
            u.plugin = renumber[u.plugin];
            u.plugin != usize::MAX
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

fn listener(ctx: &mut Ctx, raw: &Spanned<RawListener>) -> Option<Listener> {
    let l = &raw.value;
    let name = name(ctx, &l.name, "listener");
    let bind = ctx.parse(&l.bind, |s| {
        // `:8080` is shorthand for all IPv4 interfaces, as in Go and nginx.
        let full = if s.starts_with(':') {
            format!("0.0.0.0{s}")
        } else {
            s.to_owned()
        };
        SocketAddr::from_str(&full).map_err(|_| {
            format!("`{s}` is not a bind address; write it like 0.0.0.0:8080 or [::]:8080")
        })
    });
    let max_connections = ctx.parse_or(&l.max_connections, DEFAULT_MAX_CONNECTIONS, |s| match s
        .parse::<usize>()
    {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("`{s}` is not a positive number of connections")),
    });
    let header_read_timeout = ctx.duration(&l.header_read_timeout, DEFAULT_HEADER_READ_TIMEOUT);
    let keepalive_timeout = ctx.duration(&l.keepalive_timeout, DEFAULT_KEEPALIVE_TIMEOUT);
    let max_requests_per_connection = requests_per_connection(ctx, &l.max_requests_per_connection);
    let connection_lifetime = ctx.duration(&l.connection_lifetime, DEFAULT_TIMEOUTS.lifetime);
    let max_request_header_size =
        ctx.parse_or(&l.max_request_header_size, DEFAULT_MAX_HEADER_SIZE, |s| {
            let n = parse_size(s)?;
            if (1024..=1 << 20).contains(&n) {
                Ok(n as usize)
            } else {
                Err(format!(
                    "`{s}` is out of range: the request header limit must be between 1KiB and 1MiB"
                ))
            }
        });
    let trust_forwarded_headers = ctx.flag(&l.trust_forwarded_headers, false);
    let proxy_protocol = ctx.flag(&l.proxy_protocol, false);
    let request_id = ctx.parse_or(&l.request_id, RequestIds::Keep, |s| match boolean_word(s) {
        "keep" => Ok(RequestIds::Keep),
        // `on`, `off` and their kin are taken as the modes they suggest.
        "make" | "true" => Ok(RequestIds::Make),
        "off" | "false" => Ok(RequestIds::Off),
        _ => Err(format!(
            "`{s}` is not a request id mode; use keep, make or off"
        )),
    });
    let tls = l
        .tls
        .as_ref()
        .and_then(|t| listener_tls(ctx, t, name.as_deref().unwrap_or_default()));
    // `true` for the standard port, or the HTTPS listener's port.
    let redirect_https = l.redirect_https.as_ref().and_then(|t| {
        ctx.parse(t, |s| match boolean_word(s) {
            "false" => Ok(None),
            "true" => Ok(Some(443)),
            _ => match s.parse::<u16>() {
                Ok(port) if port > 0 => Ok(Some(port)),
                _ => Err(format!("`{s}` is neither true, false nor a port")),
            },
        })
        .flatten()
    });
    if let (Some(_), Some(t)) = (&l.tls, &l.redirect_https)
        && redirect_https.is_some()
    {
        ctx.err(
            &t.referenced,
            "an HTTPS listener does not redirect to https",
        );
    }
    Some(Listener {
        name: name?,
        bind: bind?,
        max_connections,
        header_read_timeout,
        keepalive_timeout,
        max_requests_per_connection,
        connection_lifetime,
        max_request_header_size,
        trust_forwarded_headers,
        proxy_protocol,
        request_id,
        tls,
        redirect_https,
        defined_at: ctx.pos(&raw.referenced),
    })
}

/// A listener's `tls`: the certificate and key are read (and checked to
/// belong together) now, so `check` reports a bad pair at its line.
fn listener_tls(
    ctx: &mut Ctx,
    raw: &Spanned<RawListenerTls>,
    listener: &str,
) -> Option<ListenerTls> {
    let t = &raw.value;
    // `cert` and `key` for one certificate; `certificates` for several,
    // chosen by SNI.
    let pairs: Vec<(&Text, &Text)> = match (&t.cert, &t.key, &t.certificates) {
        (Some(cert), Some(key), None) => vec![(cert, key)],
        (None, None, Some(list)) if !list.value.is_empty() => list
            .value
            .iter()
            .map(|p| (&p.value.cert, &p.value.key))
            .collect(),
        (None, None, Some(list)) => {
            ctx.err(&list.referenced, "`certificates` lists no certificate");
            return None;
        }
        (_, _, None) => {
            ctx.err(
                &raw.referenced,
                "`tls` needs both `cert` and `key` (or a `certificates` list)",
            );
            return None;
        }
        (_, _, Some(list)) => {
            ctx.err(
                &list.referenced,
                "give either `cert` and `key`, or `certificates`, not both",
            );
            return None;
        }
    };
    let optional = match &t.client_auth {
        None => false,
        Some(mode) => {
            let optional = ctx.parse(mode, |s| match s {
                "required" => Ok(false),
                "optional" => Ok(true),
                _ => Err(format!(
                    "client_auth `{s}`: expected `required` or `optional`"
                )),
            })?;
            if t.client_ca.is_none() {
                ctx.err(
                    &mode.referenced,
                    "`client_auth` needs `client_ca`: the CA client certificates must chain to",
                );
                return None;
            }
            optional
        }
    };
    let client_auth = match &t.client_ca {
        None => None,
        Some(ca) => {
            let path = ctx.path(ca)?;
            match CertificateDer::pem_file_iter(&path)
                .and_then(|it| it.collect::<Result<Vec<_>, _>>())
            {
                Ok(roots) if !roots.is_empty() => {
                    Some(portcullis_net::tls_listen::ClientAuth { roots, optional })
                }
                Ok(_) => {
                    ctx.err(
                        &ca.referenced,
                        format!("{} holds no PEM certificate", path.display()),
                    );
                    return None;
                }
                Err(e) => {
                    ctx.err(
                        &ca.referenced,
                        format!("cannot read client CA file {}: {e}", path.display()),
                    );
                    return None;
                }
            }
        }
    };
    // Each pair is read here, so a bad one is reported at its own line.
    let mut paths = Vec::with_capacity(pairs.len());
    for (cert_text, key_text) in pairs {
        let (Some(cert), Some(key)) = (ctx.path(cert_text), ctx.path(key_text)) else {
            continue;
        };
        match portcullis_net::cert_files::CertFiles::load(cert.clone(), key.clone()) {
            Ok(_) => paths.push((cert, key)),
            Err(e) => ctx.err(&cert_text.referenced, e),
        }
    }
    let mode = match &client_auth {
        None => ClientAuthMode::Off,
        Some(auth) if auth.optional => ClientAuthMode::Optional,
        Some(_) => ClientAuthMode::Required,
    };
    // What a session resumed here was authenticated against: the listener
    // and its client-certificate rules. Bound into file-keyed tickets, and
    // part of the config's fingerprint, so a rotated client CA or ticket
    // key file is a change a reload applies.
    let mut material = {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(listener.as_bytes());
        h.update([0, mode as u8]);
        for root in client_auth.iter().flat_map(|a| &a.roots) {
            h.update((root.len() as u64).to_le_bytes());
            h.update(root.as_ref());
        }
        <[u8; 32]>::from(h.finalize())
    };
    let tickets: Option<Arc<dyn rustls::server::ProducesTickets>> = match &t.session_ticket_keys {
        None => None,
        Some(list) => {
            let files: Vec<_> = list.iter().filter_map(|f| ctx.path(f)).collect();
            if files.len() != list.len() {
                return None;
            }
            match portcullis_net::ticket_keys::FileTicketer::from_files(&files, material) {
                Ok((ticketer, keys)) => {
                    use sha2::Digest;
                    material = sha2::Sha256::new()
                        .chain_update(material)
                        .chain_update(keys)
                        .finalize()
                        .into();
                    Some(Arc::new(ticketer))
                }
                Err(e) => {
                    let at = list.first().map_or(&raw.referenced, |f| &f.referenced);
                    ctx.err(at, e);
                    return None;
                }
            }
        }
    };
    let acceptor = portcullis_net::tls_listen::acceptor_by_name(
        &paths,
        client_auth,
        tickets,
        portcullis_net::tls_listen::HTTP_ALPN,
    );
    match acceptor {
        Ok((acceptor, certificates)) if !paths.is_empty() => Some(ListenerTls {
            acceptor,
            cert: paths[0].0.clone(),
            certificates,
            client_auth: mode,
            material,
        }),
        Ok(_) => None,
        Err(e) => {
            ctx.err(&raw.referenced, e);
            None
        }
    }
}

/// Parses a fixed endpoint URL: `http(s)://host[:port][/base]`.
/// The most a weight may be, and all of an upstream's together: the
/// round-robin schedule has one slot per unit.
const MAX_WEIGHT: u32 = 100;
const MAX_WEIGHTS: u32 = 10_000;

/// Whether `name` can name a cookie (an HTTP token, RFC 6265 §4.1.1).
fn cookie_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// An endpoint: its URL, then optionally ` weight=N` (as nginx writes it).
fn endpoint(s: &str) -> Result<Endpoint, String> {
    let mut words = s.split_whitespace();
    let url = words.next().unwrap_or_default();
    let mut ep = endpoint_url(url)?;
    for word in words {
        ep.weight = word
            .strip_prefix("weight=")
            .and_then(|w| w.parse::<u32>().ok())
            .filter(|w| (1..=MAX_WEIGHT).contains(w))
            .ok_or_else(|| {
                format!("`{word}` after the URL: only weight=N, N from 1 to {MAX_WEIGHT}")
            })?;
    }
    Ok(ep)
}

fn endpoint_url(s: &str) -> Result<Endpoint, String> {
    let uri: Uri = s
        .parse()
        .map_err(|_| format!("`{s}` is not a URL; write it like http://service:8080"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err(format!("`{s}` must start with http:// or https://"));
    }
    let authority: Authority = uri
        .authority()
        .filter(|a| !a.host().is_empty())
        .cloned()
        .ok_or_else(|| format!("`{s}` has no host"))?;
    if authority.as_str().contains('@') {
        return Err(format!(
            "`{s}`: credentials in upstream URLs are not supported; use request_headers"
        ));
    }
    if uri.query().is_some() {
        return Err(format!("`{s}`: an upstream URL cannot have a query"));
    }
    Endpoint::from_uri(&uri).ok_or_else(|| format!("`{s}` is not a usable upstream URL"))
}

fn upstream_template(s: &str) -> Result<Target, String> {
    let t = Template::parse(s, true)?;
    if t.is_static() {
        return Ok(Target::Endpoints(vec![endpoint(s)?]));
    }
    if !(s.starts_with("http://") || s.starts_with("https://")) {
        return Err(format!("`{s}` must start with http:// or https://"));
    }
    Ok(Target::Template(t))
}

fn tls_settings(ctx: &mut Ctx, raw: &Option<super::raw::RawTls>) -> TlsSettings {
    let Some(raw) = raw else {
        return TlsSettings::default();
    };
    let mut ca_certs = Vec::new();
    if let Some(t) = &raw.ca_file
        && let Some(path) = ctx.path(t)
    {
        match CertificateDer::pem_file_iter(&path).and_then(|it| it.collect::<Result<Vec<_>, _>>())
        {
            Ok(certs) if !certs.is_empty() => ca_certs = certs,
            Ok(_) => ctx.err(
                &t.referenced,
                format!("{} holds no PEM certificate", path.display()),
            ),
            Err(e) => ctx.err(
                &t.referenced,
                format!("cannot read CA file {}: {e}", path.display()),
            ),
        }
    }
    let server_name = raw.server_name.as_ref().and_then(|t| {
        ctx.parse(t, |s| {
            rustls_pki_types::ServerName::try_from(s)
                .map(|_| s.to_owned())
                .map_err(|_| format!("`{s}` is not a valid TLS server name"))
        })
    });
    let insecure_skip_verify = ctx.flag(&raw.insecure_skip_verify, false);
    TlsSettings {
        ca_certs,
        server_name,
        insecure_skip_verify,
    }
}

fn upstream(ctx: &mut Ctx, raw: &Spanned<RawUpstream>) -> Option<Upstream> {
    let u = &raw.value;
    let name = name(ctx, &u.name, "upstream");
    let target = match (u.endpoints.is_empty(), &u.url) {
        (false, None) => {
            let eps: Vec<_> = u
                .endpoints
                .iter()
                .filter_map(|t| ctx.parse(t, endpoint))
                .collect();
            let weights: u32 = eps.iter().map(|e| e.weight).sum();
            if weights > MAX_WEIGHTS {
                ctx.err(
                    &raw.referenced,
                    format!("the endpoints' weights add up to {weights}, more than {MAX_WEIGHTS}"),
                );
                None
            } else {
                (eps.len() == u.endpoints.len()).then_some(Target::Endpoints(eps))
            }
        }
        (true, Some(t)) => ctx.parse(t, upstream_template),
        _ => {
            ctx.err(&raw.referenced, "an upstream needs either `endpoints` (a list of URLs) or `url` (a URL template), not both");
            None
        }
    };
    let balance = ctx.parse_or(&u.balance, Balance::RoundRobin, |s| match s {
        "round_robin" => Ok(Balance::RoundRobin),
        "least_requests" => Ok(Balance::LeastRequests),
        "hash" => Ok(Balance::Hash),
        _ => Err(format!(
            "`{s}` is not a balancing policy; use round_robin, least_requests or hash"
        )),
    });
    let hash_on = match &u.hash_on {
        None => HashOn::Client,
        Some(t) if balance != Balance::Hash => {
            ctx.err(&t.referenced, "hash_on is for `balance: hash`");
            HashOn::Client
        }
        Some(t) => ctx
            .parse(t, |s| match s.split_once(':') {
                None if s == "client" => Ok(HashOn::Client),
                Some(("header", name)) => HeaderName::from_bytes(name.trim().as_bytes())
                    .map(HashOn::Header)
                    .map_err(|_| format!("hash_on `{s}`: `{name}` is not a header name")),
                Some(("cookie", name)) if cookie_name(name.trim()) => {
                    Ok(HashOn::Cookie(name.trim().to_owned()))
                }
                _ => Err(format!(
                    "hash_on `{s}`: use client, header:NAME or cookie:NAME"
                )),
            })
            .unwrap_or(HashOn::Client),
    };
    let hash_cookie_ttl = u.hash_cookie_ttl.as_ref().and_then(|t| {
        ctx.parse(t, |s| match parse_duration(s)? {
            _ if !matches!(hash_on, HashOn::Cookie(_)) => {
                Err("hash_cookie_ttl is for `hash_on: cookie:NAME`: the cookie it sets".into())
            }
            d if d.as_secs() == 0 => Err(format!(
                "hash_cookie_ttl `{s}`: at least 1s (a cookie's Max-Age is in seconds)"
            )),
            d => Ok(d),
        })
    });
    let timeouts = match &u.timeouts {
        Some(t) => Timeouts {
            connect: ctx.duration(&t.connect, DEFAULT_TIMEOUTS.connect),
            request: ctx.duration(&t.request, DEFAULT_TIMEOUTS.request),
            read: ctx.duration(&t.read, DEFAULT_TIMEOUTS.read),
            idle: ctx.duration(&t.idle, DEFAULT_TIMEOUTS.idle),
            lifetime: ctx.duration(&t.lifetime, DEFAULT_TIMEOUTS.lifetime),
        },
        None => DEFAULT_TIMEOUTS,
    };
    let retries = ctx.parse_or(&u.retries, DEFAULT_RETRIES, |s| {
        s.parse::<u32>()
            .ok()
            .filter(|n| *n <= 10)
            .ok_or_else(|| format!("`{s}` is not a retry count from 0 to 10"))
    });
    let eject_for = ctx.duration(&u.eject_for, DEFAULT_EJECT_FOR);
    let eject_after_5xx = u.eject_after_5xx.as_ref().and_then(|t| {
        ctx.parse(t, |s| {
            let n = s
                .parse::<u32>()
                .ok()
                .filter(|n| (1..=1000).contains(n))
                .ok_or_else(|| {
                    format!("eject_after_5xx `{s}` is not a count of answers from 1 to 1000")
                })?;
            if eject_for.is_zero() {
                return Err("eject_after_5xx with eject_for 0s never takes an endpoint out".into());
            }
            Ok(n)
        })
    });
    // 0 stands for `reset` while parsing.
    let retry_on: Vec<u16> = u
        .retry_on
        .iter()
        .filter_map(|t| {
            ctx.parse(t, |s| match s.trim() {
                "502" => Ok(502),
                "503" => Ok(503),
                "504" => Ok(504),
                "reset" => Ok(0),
                _ => Err(format!(
                    "retry_on `{s}`: only 502, 503, 504 and reset say the request was not acted on"
                )),
            })
        })
        .collect();
    let retry_on_reset = retry_on.contains(&0);
    let retry_on: Vec<u16> = retry_on.into_iter().filter(|&s| s != 0).collect();
    let per_try_timeout = u.per_try_timeout.as_ref().and_then(|t| {
        ctx.parse(t, |s| match parse_duration(s)? {
            d if d.is_zero() => Err(
                "per_try_timeout 0s: leave it out for tries bounded by the request timeout alone"
                    .into(),
            ),
            _ if !retry_on.contains(&504) => Err(
                "per_try_timeout needs 504 in retry_on: a try that runs out counts as a gateway timeout, and only then is the next one made"
                    .into(),
            ),
            d => Ok(d),
        })
    });
    let retry_budget = match &u.retry_budget {
        None => RetryBudget::default(),
        Some(b) if retry_on.is_empty() && !retry_on_reset => {
            ctx.err(
                &b.referenced,
                "retry_budget bounds the retries retry_on makes; this upstream has no retry_on",
            );
            RetryBudget::default()
        }
        Some(b) => {
            let defaults = RetryBudget::default();
            RetryBudget {
                percent: ctx.parse_or(&b.value.percent, defaults.percent, |s| {
                    s.trim_end_matches('%')
                        .trim()
                        .parse::<u32>()
                        .ok()
                        .filter(|n| (1..=100).contains(n))
                        .ok_or_else(|| {
                            format!("retry_budget percent `{s}` is not a share from 1 to 100")
                        })
                }),
                min_concurrent: ctx.parse_or(
                    &b.value.min_concurrent,
                    defaults.min_concurrent,
                    |s| {
                        s.parse::<usize>().map_err(|_| {
                            format!("retry_budget min_concurrent `{s}` is not a number of retries")
                        })
                    },
                ),
            }
        }
    };
    let max_requests = u.max_requests.as_ref().and_then(|t| {
        ctx.parse(t, |s| {
            s.parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("max_requests `{s}` is not a positive number of requests"))
        })
    });
    let dns = dns(ctx, u, target.as_ref());
    let max_requests_per_connection = requests_per_connection(ctx, &u.max_requests_per_connection);
    if let (Some(t), Some(_), Some(target)) = (&u.eject_after_5xx, eject_after_5xx, &target) {
        let single = match target {
            // A host may have several addresses, each an endpoint.
            Target::Endpoints(_) if dns != Dns::Connect => false,
            Target::Endpoints(eps) => eps.len() == 1,
            Target::Template(_) => true,
        };
        if single {
            ctx.err(
                &t.referenced,
                "eject_after_5xx needs two endpoints or more: a single one (or a URL template) is never taken out of the rotation",
            );
        }
    }
    let health_check = match (&u.health_check, &target) {
        (Some(h), Some(Target::Template(_))) => {
            ctx.err(
                &h.referenced,
                "health_check needs `endpoints`: a URL template's hosts are only known per request",
            );
            None
        }
        (Some(h), _) => health_check(ctx, h),
        (None, _) => None,
    };
    let tls = tls_settings(ctx, &u.tls);
    let http2 = ctx.flag(&u.http2, false);
    let preserve_host = ctx.flag(&u.preserve_host, false);
    Some(Upstream {
        name: name?.into(),
        target: target?,
        balance,
        hash_on,
        hash_cookie_ttl,
        timeouts,
        retries,
        eject_for,
        eject_after_5xx,
        retry_on,
        retry_on_reset,
        per_try_timeout,
        retry_budget,
        max_requests,
        max_requests_per_connection,
        health_check,
        tls,
        http2,
        preserve_host,
        dns,
        defined_at: ctx.pos(&raw.referenced),
    })
}

/// A `max_requests_per_connection` (listener or upstream side).
fn requests_per_connection(ctx: &mut Ctx, t: &Option<Text>) -> u32 {
    ctx.parse_or(t, DEFAULT_REQUESTS_PER_CONNECTION, |s| {
        s.parse::<u32>().map_err(|_| {
            format!("max_requests_per_connection `{s}` is not a number of requests (0: no limit)")
        })
    })
}

/// An upstream with every setting at its default.
fn plain_upstream(name: Arc<str>, target: Target, defined_at: Pos) -> Upstream {
    Upstream {
        name,
        target,
        balance: Balance::RoundRobin,
        hash_on: HashOn::Client,
        hash_cookie_ttl: None,
        timeouts: DEFAULT_TIMEOUTS,
        retries: DEFAULT_RETRIES,
        eject_for: DEFAULT_EJECT_FOR,
        eject_after_5xx: None,
        retry_on: Vec::new(),
        retry_on_reset: false,
        per_try_timeout: None,
        retry_budget: RetryBudget::default(),
        max_requests: None,
        max_requests_per_connection: DEFAULT_REQUESTS_PER_CONNECTION,
        health_check: None,
        tls: TlsSettings::default(),
        http2: false,
        preserve_host: false,
        dns: Dns::Connect,
        defined_at,
    }
}

/// An upstream called `name` with every setting at its default, sending
/// to `url` (`http://otel-collector:4318`): for a service a command-line
/// flag names, as the tunnel server's OpenTelemetry collector.
pub fn upstream_at(name: &str, url: &str) -> Result<Upstream, String> {
    let ep = endpoint_url(url)?;
    let at = Pos {
        file: "command line".into(),
        line: 0,
        column: 0,
    };
    Ok(plain_upstream(name.into(), Target::Endpoints(vec![ep]), at))
}

/// An upstream's `dns` and `dns_refresh`.
fn dns(ctx: &mut Ctx, u: &RawUpstream, target: Option<&Target>) -> Dns {
    let each = ctx.parse_or(&u.dns, false, |s| match s {
        "connect" => Ok(false),
        "each_address" => Ok(true),
        _ => Err(format!("dns `{s}`: use connect (the default: a host is looked up as each connection is made) or each_address (each of its addresses is an endpoint)")),
    });
    let refresh = u.dns_refresh.as_ref().and_then(|t| {
        ctx.parse(t, |s| match parse_duration(s)? {
            _ if !each => Err("dns_refresh is for `dns: each_address`".into()),
            d if d.is_zero() => Err(format!(
                "dns_refresh `{s}`: hosts must be looked up again some time; use at least 1ms"
            )),
            d => Ok(d),
        })
    });
    match (each, target) {
        (true, Some(Target::Endpoints(eps))) => Dns::EachAddress {
            refresh: refresh.unwrap_or(DEFAULT_DNS_REFRESH),
            declared: eps.as_slice().into(),
        },
        (true, Some(Target::Template(_))) => {
            if let Some(t) = &u.dns {
                ctx.err(&t.referenced, "dns: each_address needs `endpoints`: a URL template's hosts are only known per request");
            }
            Dns::Connect
        }
        _ => Dns::Connect,
    }
}

fn health_check(ctx: &mut Ctx, raw: &Spanned<RawHealthCheck>) -> Option<HealthCheck> {
    let h = &raw.value;
    let path = ctx.parse(&h.path, |s| {
        if s.starts_with('/') && http::uri::PathAndQuery::try_from(s).is_ok() {
            Ok(s.to_owned())
        } else {
            Err(format!(
                "health_check path `{s}` must be a path starting with `/`"
            ))
        }
    });
    let interval = ctx.duration(&h.interval, DEFAULT_HEALTH_INTERVAL);
    let timeout = ctx.duration(&h.timeout, DEFAULT_HEALTH_TIMEOUT);
    let count = |ctx: &mut Ctx, t: &Option<Text>, default: u32| {
        ctx.parse_or(t, default, |s| {
            s.parse::<u32>()
                .ok()
                .filter(|n| (1..=100).contains(n))
                .ok_or_else(|| format!("`{s}` is not a count of probes from 1 to 100"))
        })
    };
    let unhealthy_after = count(ctx, &h.unhealthy_after, 3);
    let healthy_after = count(ctx, &h.healthy_after, 2);
    if interval.is_zero() || timeout.is_zero() {
        ctx.err(
            &raw.referenced,
            "health_check interval and timeout must be above 0",
        );
        return None;
    }
    if timeout > interval {
        ctx.err(
            &raw.referenced,
            format!(
                "health_check timeout ({timeout:?}) is longer than its interval ({interval:?})"
            ),
        );
        return None;
    }
    Some(HealthCheck {
        path: path?,
        interval,
        timeout,
        unhealthy_after,
        healthy_after,
    })
}

/// Parameter names a matchit pattern captures (`{id}` and `{*rest}`).
fn pattern_params(pattern: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = pattern;
    while let Some(i) = rest.find('{') {
        let after = &rest[i + 1..];
        if let Some(stripped) = after.strip_prefix('{') {
            rest = stripped;
            continue;
        }
        let Some(end) = after.find('}') else { break };
        out.push(after[..end].trim_start_matches('*').to_owned());
        rest = &after[end + 1..];
    }
    out
}

fn host_match(s: &str) -> Result<HostMatch, String> {
    let s = s.to_ascii_lowercase();
    let valid = |h: &str| {
        !h.is_empty()
            && h.split('.')
                .all(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'))
    };
    if let Some(domain) = s.strip_prefix("*.") {
        if valid(domain) {
            return Ok(HostMatch::Suffix(format!(".{domain}")));
        }
    } else if valid(&s) {
        return Ok(HostMatch::Exact(s));
    }
    Err(format!(
        "`{s}` is not a host match; write a host name (api.example.com) or a wildcard (*.example.com), without port"
    ))
}

type RouteParts = (Route, HostMatch, Vec<String>);

/// The index of the upstream `t` names; an error naming the defined ones
/// when there is none of that name.
fn named_upstream(
    ctx: &mut Ctx,
    t: &Text,
    upstream_index: &HashMap<String, Option<usize>>,
) -> Option<usize> {
    let up = ctx.text(t)?;
    match upstream_index.get(up.trim()) {
        Some(&Some(i)) => Some(i),
        // Defined, but in error (reported there).
        Some(None) => None,
        None => {
            let mut known: Vec<_> = upstream_index.keys().map(String::as_str).collect();
            known.sort_unstable();
            let defined = if known.is_empty() {
                "no upstream is defined".to_owned()
            } else {
                format!("defined upstreams: {}", known.join(", "))
            };
            let hint = ctx.unparsed_hint();
            ctx.err(
                &t.referenced,
                format!("unknown upstream `{up}`; {defined}{hint}"),
            );
            None
        }
    }
}

fn auth_request(
    ctx: &mut Ctx,
    raw: &Spanned<RawAuthRequest>,
    upstream_index: &HashMap<String, Option<usize>>,
    upstreams: &[Arc<Upstream>],
) -> Option<Box<AuthRequest>> {
    let a = &raw.value;
    let upstream = fixed_upstream(ctx, &a.upstream, upstream_index, upstreams, "auth_request");
    let path = ctx.parse(&a.path, |s| {
        http::uri::PathAndQuery::try_from(s)
            .ok()
            .filter(|_| s.starts_with('/'))
            .ok_or_else(|| format!("auth_request path `{s}` must be a path starting with `/`"))
    });
    let copy_headers = header_names(ctx, &a.copy_headers, "");
    let signin = match &a.signin {
        None => Some(None),
        Some(t) => ctx
            .parse(t, |s| {
                let checked = s.replace("{url}", "x");
                match Uri::try_from(checked.as_str()) {
                    Ok(u) if matches!(u.scheme_str(), Some("http" | "https")) => {
                        Ok(s.to_owned())
                    }
                    _ => Err(format!(
                        "signin `{s}` must be an http(s) URL (`{{url}}` stands for the original one)"
                    )),
                }
            })
            .map(Some),
    };
    let timeout = ctx.duration(&a.timeout, DEFAULT_AUTH_TIMEOUT);
    let cache = match &a.cache {
        None => Some(None),
        Some(c) => auth_cache(ctx, &c.value).map(Some),
    };
    Some(Box::new(AuthRequest {
        upstream: upstream?,
        path: path?,
        copy_headers: copy_headers?,
        signin: signin?,
        timeout,
        cache: cache?,
    }))
}

/// Header names, each error reported (as `{what}`NAME` is not a header
/// name`); `None` if any is not one.
fn header_names(ctx: &mut Ctx, texts: &[Text], what: &str) -> Option<Vec<HeaderName>> {
    let names: Vec<_> = texts
        .iter()
        .filter_map(|t| {
            ctx.parse(t, |s| {
                HeaderName::from_bytes(s.trim().as_bytes())
                    .map_err(|_| format!("{what}`{s}` is not a header name"))
            })
        })
        .collect();
    (names.len() == texts.len()).then_some(names)
}

/// An upstream named for a side request (`what`: an auth request, a
/// mirror), which must have endpoints: a URL template is filled from the
/// route's own parameters, for its own requests only.
fn fixed_upstream(
    ctx: &mut Ctx,
    t: &Text,
    upstream_index: &HashMap<String, Option<usize>>,
    upstreams: &[Arc<Upstream>],
    what: &str,
) -> Option<usize> {
    let i = named_upstream(ctx, t, upstream_index)?;
    if matches!(upstreams[i].target, Target::Template(_)) {
        ctx.err(
            &t.referenced,
            format!("{what} needs an upstream with `endpoints`, not a URL template"),
        );
        return None;
    }
    Some(i)
}

fn mirror(
    ctx: &mut Ctx,
    raw: &Spanned<RawMirror>,
    upstream_index: &HashMap<String, Option<usize>>,
    upstreams: &[Arc<Upstream>],
) -> Option<MirrorSpec> {
    let m = &raw.value;
    let upstream = fixed_upstream(ctx, &m.upstream, upstream_index, upstreams, "mirror");
    let percent = ctx.parse_or(&m.percent, 100, |s| {
        s.trim_end_matches('%')
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=100).contains(n))
            .ok_or_else(|| format!("mirror percent `{s}` is not a share from 1 to 100"))
    });
    Some(MirrorSpec {
        upstream: upstream?,
        percent,
    })
}

fn tracing_settings(
    ctx: &mut Ctx,
    raw: &Spanned<RawTracing>,
    upstream_index: &HashMap<String, Option<usize>>,
    upstreams: &[Arc<Upstream>],
) -> Option<Arc<Tracing>> {
    let t = &raw.value;
    if !ctx.switch(&t.enabled)? {
        return None;
    }
    let upstream = fixed_upstream(ctx, &t.upstream, upstream_index, upstreams, "tracing");
    let path = ctx.parse_or(&t.path, PathAndQuery::from_static("/v1/traces"), |s| {
        if !s.starts_with('/') {
            return Err(format!("tracing path `{s}` does not start with `/`"));
        }
        PathAndQuery::try_from(s).map_err(|e| format!("tracing path `{s}`: {e}"))
    });
    let threshold = ctx.parse_or(&t.sample_percent, 1u128 << 64, |s| {
        let percent = s
            .trim_end_matches('%')
            .trim()
            .parse::<f64>()
            .ok()
            .filter(|p| (0.0..=100.0).contains(p))
            .ok_or_else(|| format!("sample_percent `{s}` is not a share from 0 to 100"))?;
        Ok(Tracing::threshold_of(percent))
    });
    let service_name = ctx.parse_or(&t.service_name, Arc::from("portcullis"), |s| {
        if s.is_empty() {
            Err("service_name is empty".into())
        } else {
            Ok(Arc::from(s))
        }
    });
    let flush_every = ctx.parse_or(
        &t.flush_every,
        Duration::from_secs(5),
        |s| match parse_duration(s)? {
            d if d.is_zero() => Err("flush_every 0s: spans need a moment to gather".into()),
            d => Ok(d),
        },
    );
    let trust_incoming = ctx.flag(&t.trust_incoming, true);
    Some(Arc::new(Tracing {
        upstream: upstream?,
        path,
        threshold,
        service_name,
        flush_every,
        trust_incoming,
    }))
}

fn auth_cache(ctx: &mut Ctx, c: &RawAuthCache) -> Option<AuthCacheSpec> {
    let ttl = ctx.parse(&c.ttl, |s| match parse_duration(s)? {
        d if d.is_zero() => Err("auth_request cache ttl 0s: leave `cache` out instead".into()),
        d => Ok(d),
    });
    let key = match &c.key {
        None => vec![header::COOKIE, header::AUTHORIZATION],
        Some(names) => header_names(ctx, names, "cache key ")?,
    };
    let per_uri = ctx.flag(&c.per_uri, false);
    Some(AuthCacheSpec {
        ttl: ttl?,
        key,
        per_uri,
    })
}

fn route(
    ctx: &mut Ctx,
    raw: &Spanned<RawRoute>,
    upstream_index: &HashMap<String, Option<usize>>,
    plugin_index: &HashMap<String, usize>,
    upstreams: &mut Vec<Arc<Upstream>>,
) -> Option<RouteParts> {
    let r = &raw.value;
    let m = &r.matcher.value;
    let name = name(ctx, &r.name, "route");

    let host = match &m.host {
        Some(t) => ctx.parse(t, host_match)?,
        None => HostMatch::Any,
    };
    let mut patterns = Vec::new();
    for t in m.path.iter().chain(m.paths.iter()) {
        if let Some(p) = ctx.parse(t, |s| {
            if s.starts_with('/') {
                Ok(s.to_owned())
            } else {
                Err(format!("path `{s}` must start with `/`"))
            }
        }) {
            patterns.push(p);
        }
    }
    if let Some(t) = &m.path_prefix
        && let Some(prefix) = ctx.parse(t, |s| {
            if s.starts_with('/') && !s.contains('{') {
                Ok(s.trim_end_matches('/').to_owned())
            } else {
                Err(format!(
                    "path_prefix `{s}` must start with `/` and hold no parameters"
                ))
            }
        })
    {
        // A prefix covers the path itself, its directory form and
        // everything below, the remainder captured as {rest}.
        if prefix.is_empty() {
            patterns.extend(["/".to_owned(), "/{*rest}".to_owned()]);
        } else {
            patterns.extend([
                prefix.clone(),
                format!("{prefix}/"),
                format!("{prefix}/{{*rest}}"),
            ]);
        }
    }
    if patterns.is_empty() && m.path.is_none() && m.paths.is_empty() && m.path_prefix.is_none() {
        ctx.err(
            &r.matcher.referenced,
            "a route needs `path`, `paths` or `path_prefix` in its match",
        );
        return None;
    }
    let methods = if m.methods.is_empty() {
        None
    } else {
        Some(
            m.methods
                .iter()
                .filter_map(|t| {
                    ctx.parse(t, |s| {
                        let upper = s.to_ascii_uppercase();
                        Method::from_bytes(upper.as_bytes())
                            .map_err(|_| format!("`{s}` is not an HTTP method"))
                    })
                })
                .collect::<Vec<_>>(),
        )
    };
    let headers = m
        .headers
        .as_ref()
        .map(|h| ctx.header_pairs(h))
        .unwrap_or_default();

    // Every parameter a template uses must be captured by every pattern,
    // or some requests would render it empty.
    let check_params = |ctx: &mut Ctx, t: &Template, at: &Location, what: &str| {
        for p in t.params() {
            if let Some(pat) = patterns
                .iter()
                .find(|pat| !pattern_params(pat).iter().any(|x| x == p))
            {
                ctx.err(
                    at,
                    format!("{what} uses `{{{p}}}` but path `{pat}` does not capture it"),
                );
            }
        }
    };

    let actions = [
        r.upstream.is_some(),
        r.url.is_some(),
        r.respond.is_some(),
        r.redirect.is_some(),
        r.health.is_some(),
    ];
    if actions.iter().filter(|a| **a).count() != 1 {
        ctx.err(
            &raw.referenced,
            "a route needs exactly one of `upstream`, `url`, `respond`, `redirect` or `health`",
        );
        return None;
    }
    let timeout = r
        .timeout
        .as_ref()
        .and_then(|t| ctx.parse(t, parse_duration));
    let action = if let Some(t) = &r.upstream {
        let i = named_upstream(ctx, t, upstream_index)?;
        if let Target::Template(tpl) = &upstreams[i].target {
            let tpl = tpl.clone();
            let up = ctx.text(t)?;
            check_params(ctx, &tpl, &t.referenced, &format!("upstream `{up}`"));
        }
        Action::Forward(i)
    } else if let Some(t) = &r.url {
        let target = ctx.parse(t, upstream_template)?;
        if let Target::Template(tpl) = &target {
            check_params(ctx, tpl, &t.referenced, "url");
        }
        let pos = ctx.pos(&t.referenced);
        upstreams.push(Arc::new(plain_upstream(name.clone()?.into(), target, pos)));
        Action::Forward(upstreams.len() - 1)
    } else if let Some(resp) = &r.respond {
        let status = ctx.parse(&resp.value.status, |s| {
            s.parse::<u16>()
                .ok()
                .and_then(|n| StatusCode::from_u16(n).ok())
                .ok_or_else(|| format!("`{s}` is not an HTTP status code"))
        })?;
        let body = resp
            .value
            .body
            .as_ref()
            .and_then(|b| ctx.text(b))
            .unwrap_or_default();
        let headers = resp
            .value
            .headers
            .as_ref()
            .map(|h| ctx.header_pairs(h))
            .unwrap_or_default();
        Action::Respond(LocalResponse {
            status,
            headers,
            body: Bytes::from(body),
        })
    } else if let Some(raw) = &r.redirect {
        let d = &raw.value;
        let to = ctx.parse(&d.to, |s| {
            let url = s.starts_with("https://") || s.starts_with("http://");
            if !url && !s.starts_with('/') {
                return Err(format!(
                    "redirect `{s}` must be an http(s) URL or a path starting with `/`"
                ));
            }
            Template::parse(s, url)
        });
        if let Some(tpl) = &to {
            check_params(ctx, tpl, &d.to.referenced, "redirect");
        }
        let status = ctx.parse_or(&d.status, StatusCode::MOVED_PERMANENTLY, |s| {
            match s.parse::<u16>() {
                Ok(n @ (301 | 302 | 303 | 307 | 308)) => {
                    Ok(StatusCode::from_u16(n).expect("a valid status"))
                }
                _ => Err(format!(
                    "redirect status `{s}` must be 301, 302, 303, 307 or 308"
                )),
            }
        });
        let keep_query = !ctx.flag(&d.strip_query, false);
        Action::Redirect(Redirect {
            to: to?,
            status,
            keep_query,
        })
    } else {
        let t = r.health.as_ref()?;
        ctx.parse(t, |s| match s {
            "live" => Ok(Action::Health(Probe::Live)),
            "ready" => Ok(Action::Health(Probe::Ready)),
            _ => Err(format!("`{s}` is not a probe; use live or ready")),
        })?
    };

    let rewrite = match (&r.strip_prefix, &r.rewrite) {
        (Some(_), Some(_)) => {
            ctx.err(
                &raw.referenced,
                "use either `strip_prefix` or `rewrite`, not both",
            );
            PathRewrite::Keep
        }
        (Some(t), None) => ctx
            .parse(t, |s| {
                if s.starts_with('/') && s.len() > 1 {
                    Ok(PathRewrite::StripPrefix(s.trim_end_matches('/').to_owned()))
                } else {
                    Err(format!(
                        "strip_prefix `{s}` must start with `/` and not be `/` alone"
                    ))
                }
            })
            .unwrap_or(PathRewrite::Keep),
        (None, Some(t)) => match ctx.parse(t, |s| {
            if s.starts_with('/') {
                Template::parse(s, false)
            } else {
                Err(format!("rewrite `{s}` must start with `/`"))
            }
        }) {
            Some(tpl) => {
                check_params(ctx, &tpl, &t.referenced, "rewrite");
                PathRewrite::Template(tpl)
            }
            None => PathRewrite::Keep,
        },
        (None, None) => PathRewrite::Keep,
    };
    let request_headers = ctx.header_edits(&r.request_headers);
    let response_headers = ctx.header_edits(&r.response_headers);
    let websocket = ctx.flag(&r.websocket, false);
    let error_cors = r.error_cors.as_ref().map(|c| cors(ctx, c));
    let compress = r.compress.as_ref().and_then(|c| compression(ctx, c));
    let rate_limit = r.rate_limit.as_ref().and_then(|l| rate_limit(ctx, l));
    let auth_request = r
        .auth_request
        .as_ref()
        .and_then(|a| auth_request(ctx, a, upstream_index, upstreams));
    let mirror = r
        .mirror
        .as_ref()
        .and_then(|m| mirror(ctx, m, upstream_index, upstreams));
    let max_request_body = r.max_request_body.as_ref().and_then(|t| {
        ctx.parse(t, |s| match parse_size(s)? {
            0 => Err(format!(
                "max_request_body `{s}`: must be above 0 (leave it out for no limit)"
            )),
            n => Ok(n),
        })
    });
    let access_log = ctx.parse_or(&r.access_log, AccessLogging::All, |s| {
        match boolean_word(s) {
            "true" => Ok(AccessLogging::All),
            "errors" => Ok(AccessLogging::Errors),
            "false" => Ok(AccessLogging::Off),
            _ => Err(format!(
                "access_log `{s}`: true (every request), errors (status 400 and above) or false"
            )),
        }
    });
    let plugins = r
        .plugins
        .iter()
        .filter_map(|u| plugin_use(ctx, u, plugin_index))
        .collect();
    Some((
        Route {
            name: name?.into(),
            action,
            methods,
            headers,
            rewrite,
            request_headers,
            response_headers,
            timeout,
            websocket,
            error_cors,
            compress,
            rate_limit,
            max_request_body,
            access_log,
            auth_request,
            mirror,
            plugins,
            defined_at: ctx.pos(&raw.referenced),
        },
        host,
        patterns,
    ))
}

fn rate_limit(ctx: &mut Ctx, raw: &Spanned<RawRateLimit>) -> Option<RateLimitSpec> {
    use super::units::parse_rate;
    let l = &raw.value;
    let rate = ctx.parse(&l.rate, parse_rate);
    let burst = match &l.burst {
        None => Some(0),
        Some(t) => ctx.parse(t, |s| {
            s.parse::<u32>()
                .map_err(|_| format!("burst `{s}`: a whole number of requests, 0 or more"))
        }),
    };
    let key = match &l.key {
        None => Some(LimitKey::Client),
        Some(t) => ctx.parse(t, |s| match s {
            "client" => Ok(LimitKey::Client),
            "route" => Ok(LimitKey::Route),
            _ => match s.strip_prefix("header:") {
                Some(name) => HeaderName::from_bytes(name.trim().as_bytes())
                    .map(LimitKey::Header)
                    .map_err(|_| format!("key `{s}`: `{}` is not a header name", name.trim())),
                None => Err(format!(
                    "key `{s}`: expected `client`, `route` or `header:NAME`"
                )),
            },
        }),
    };
    let ((count, period), burst, key) = (rate?, burst?, key?);
    let described = ctx.text(&l.rate)?.trim().to_owned();
    Some(RateLimitSpec {
        count,
        period,
        burst,
        key,
        described,
    })
}

fn compression(ctx: &mut Ctx, raw: &Spanned<RawCompress>) -> Option<Compression> {
    use super::{DEFAULT_BROTLI, DEFAULT_LEVEL, DEFAULT_MIN_SIZE, DEFAULT_TYPES};
    let settings = match &raw.value {
        RawCompress::Flag(flag) => {
            let flag = Spanned::new(flag.clone(), raw.referenced, raw.defined);
            return ctx.flag(&Some(flag), false).then(|| Compression {
                types: DEFAULT_TYPES.iter().map(|t| t.to_string()).collect(),
                min_size: DEFAULT_MIN_SIZE,
                level: DEFAULT_LEVEL,
                brotli: Some(DEFAULT_BROTLI),
            });
        }
        RawCompress::Settings(settings) => settings,
    };
    let types = match &settings.types {
        None => DEFAULT_TYPES.iter().map(|t| t.to_string()).collect(),
        Some(list) => list
            .iter()
            .filter_map(|t| {
                ctx.parse(t, |s| {
                    let s = s.trim().to_ascii_lowercase();
                    match s.split_once('/') {
                        Some((kind, sub)) if !kind.is_empty() && !sub.is_empty() && kind != "*" => {
                            Ok(s)
                        }
                        _ => Err(format!(
                            "`{s}` is not a media type; write it like application/json or text/*"
                        )),
                    }
                })
            })
            .collect(),
    };
    let min_size = ctx.parse_or(&settings.min_size, DEFAULT_MIN_SIZE, parse_size);
    let level = ctx.parse_or(&settings.level, DEFAULT_LEVEL, |s| match s.parse::<u32>() {
        Ok(n @ 1..=9) => Ok(n),
        _ => Err(format!(
            "`{s}` is not a gzip level; use 1 (fastest) to 9 (smallest)"
        )),
    });
    let brotli = ctx.parse_or(
        &settings.brotli,
        Some(DEFAULT_BROTLI),
        |s| match boolean_word(s) {
            "false" => Ok(None),
            "true" => Ok(Some(DEFAULT_BROTLI)),
            _ => match s.parse::<u32>() {
                Ok(n @ 0..=11) => Ok(Some(n)),
                _ => Err(format!(
                    "`{s}` is not a brotli quality; use 0 (fastest) to 11 (smallest), or false"
                )),
            },
        },
    );
    Some(Compression {
        types,
        min_size,
        level,
        brotli,
    })
}

fn cors(ctx: &mut Ctx, raw: &Spanned<RawCors>) -> Cors {
    let mut origins = Vec::new();
    for t in &raw.value.allow_origins {
        if let Some(s) = ctx.text(t) {
            // One value may hold a comma-separated list, so a single
            // environment variable can carry several origins.
            origins.extend(
                s.split(',')
                    .map(str::trim)
                    .filter(|o| !o.is_empty())
                    .map(str::to_owned),
            );
        }
    }
    let allow_any = origins.iter().any(|o| o == "*");
    origins.retain(|o| o != "*");
    let allow_credentials = ctx.flag(&raw.value.allow_credentials, false);
    Cors {
        allow_any,
        origins,
        allow_credentials,
    }
}

const DEFAULT_PLUGIN_TIMEOUT: Duration = Duration::from_millis(10);
const DEFAULT_PLUGIN_MEMORY: usize = 16 << 20;
/// The largest memory cap a plugin use may ask for (the pooling
/// allocator reserves this much address space per instance slot).
pub const MAX_PLUGIN_MEMORY: usize = 256 << 20;

fn plugin_module(ctx: &mut Ctx, raw: &Spanned<RawPlugin>) -> Option<PluginModule> {
    use sha2::Digest;
    let p = &raw.value;
    let name = name(ctx, &p.name, "plugin");
    let (path, bytes) = plugin_bytes(ctx, &p.path)?;
    let sha256: [u8; 32] = sha2::Sha256::digest(&bytes).into();
    if let Some(pin) = &p.sha256 {
        let expected = ctx.text(pin)?;
        let actual = hex::encode(sha256);
        let shaped =
            expected.trim().len() == 64 && expected.trim().bytes().all(|b| b.is_ascii_hexdigit());
        if !shaped {
            // A typo or a cut-off paste would otherwise read as a
            // mismatch (and YAML turns an all-digit pin into a number).
            ctx.err(
                &pin.referenced,
                format!(
                    "the pin `{}` for plugin {} is not a sha256 (64 hex digits, as `sha256sum` prints them); the file's is {actual}",
                    expected.trim(),
                    path.display()
                ),
            );
            return None;
        }
        if !expected.trim().eq_ignore_ascii_case(&actual) {
            ctx.err(
                &pin.referenced,
                format!(
                    "plugin {} has sha256 {actual}, but the policy pins {}",
                    path.display(),
                    expected.trim()
                ),
            );
            return None;
        }
    }
    Some(PluginModule {
        name: name?.into(),
        path,
        bytes: bytes.into(),
        sha256,
        defined_at: ctx.pos(&raw.referenced),
    })
}

/// Where a plugin's component comes from and its bytes: a standard
/// plugin built into the binary (`builtin:NAME`), or a file (relative to
/// the policy file).
fn plugin_bytes(ctx: &mut Ctx, path: &Text) -> Option<(std::path::PathBuf, Vec<u8>)> {
    use crate::builtin_plugins;
    let text = ctx.text(path)?;
    if let Some(builtin) = text.strip_prefix(builtin_plugins::PREFIX) {
        let Some(bytes) = builtin_plugins::get(builtin.trim()) else {
            ctx.err(
                &path.referenced,
                format!(
                    "no built-in plugin `{}`; the built-in plugins are {}",
                    builtin.trim(),
                    builtin_plugins::names()
                ),
            );
            return None;
        };
        return Some((text.into(), bytes.to_vec()));
    }
    let file = ctx.path(path)?;
    match std::fs::read(&file) {
        Ok(bytes) => Some((file, bytes)),
        Err(e) => {
            let hint = if e.kind() == std::io::ErrorKind::NotFound {
                " (a standard plugin needs no file: name it `builtin:NAME`; mount a \
                 plugin of your own next to the policy)"
            } else {
                ""
            };
            ctx.err(
                &path.referenced,
                format!("cannot read plugin {}: {e}{hint}", file.display()),
            );
            None
        }
    }
}

fn plugin_use(
    ctx: &mut Ctx,
    raw: &Spanned<RawPluginUse>,
    plugin_index: &HashMap<String, usize>,
) -> Option<PluginUse> {
    let u = &raw.value;
    if !ctx.switch(&u.enabled)? {
        return None;
    }
    let name = ctx.text(&u.plugin)?;
    let Some(&plugin) = plugin_index.get(name.trim()) else {
        let hint = ctx.unparsed_hint();
        let mut known: Vec<_> = plugin_index.keys().map(String::as_str).collect();
        known.sort_unstable();
        ctx.err(
            &u.plugin.referenced,
            format!(
                "unknown plugin `{name}`; defined under `plugins:`: {}{hint}",
                if known.is_empty() {
                    "none".into()
                } else {
                    known.join(", ")
                }
            ),
        );
        return None;
    };
    let config_json = match &u.config {
        Some(c) => {
            let mut value = c.value.clone();
            resolve_config(ctx, &mut value, &c.referenced);
            value.to_string()
        }
        None => "{}".to_owned(),
    };
    let fail = ctx.parse_or(&u.fail, FailMode::Closed, |s| match s {
        "closed" => Ok(FailMode::Closed),
        "open" => Ok(FailMode::Open),
        _ => Err(format!("`{s}` is not a failure policy; use closed or open")),
    });
    let timeout = ctx.parse_or(&u.timeout, DEFAULT_PLUGIN_TIMEOUT, |s| {
        let d = parse_duration(s)?;
        if d.is_zero() || d > Duration::from_secs(10) {
            Err(format!(
                "plugin timeout `{s}` must be above 0 and at most 10s"
            ))
        } else {
            Ok(d)
        }
    });
    let memory = ctx.parse_or(&u.memory, DEFAULT_PLUGIN_MEMORY, |s| {
        let n = parse_size(s)? as usize;
        if (1 << 20..=MAX_PLUGIN_MEMORY).contains(&n) {
            Ok(n)
        } else {
            Err(format!(
                "plugin memory `{s}` must be between 1MiB and 256MiB"
            ))
        }
    });
    let fresh_instances = ctx.parse_or(&u.instances, false, |s| match s {
        "reuse" => Ok(false),
        "per-request" => Ok(true),
        _ => Err(format!(
            "`{s}` is not an instance policy; use reuse or per-request"
        )),
    });
    Some(PluginUse {
        plugin,
        fresh_instances,
        config_json,
        fail,
        timeout,
        memory,
        defined_at: ctx.pos(&raw.referenced),
    })
}

/// Expands `${ENV}` in every string of a plugin config and replaces
/// `{from_file: path}` with the file's contents (a mounted Secret), so
/// plugins get secrets without any access of their own.
fn resolve_config(ctx: &mut Ctx, value: &mut serde_json::Value, at: &Location) {
    use serde_json::Value;
    match value {
        Value::String(s) => match expand(s, ctx.env) {
            Ok(v) => *s = v,
            Err(e) => ctx.err(at, format!("in plugin config: {e}")),
        },
        Value::Array(items) => items.iter_mut().for_each(|v| resolve_config(ctx, v, at)),
        Value::Object(map) => {
            if map.len() == 1
                && let Some(Value::String(file)) = map.get("from_file")
            {
                let file = match expand(file, ctx.env) {
                    Ok(f) => f,
                    Err(e) => return ctx.err(at, format!("in plugin config: {e}")),
                };
                let path = Path::new(&*ctx.file)
                    .parent()
                    .unwrap_or(Path::new("."))
                    .join(&file);
                ctx.files.push(path.clone());
                match std::fs::read_to_string(&path) {
                    // Secrets mounted from files usually end in a newline
                    // that is not part of the secret.
                    Ok(text) => {
                        *value = Value::String(text.trim_end_matches(['\n', '\r']).to_owned())
                    }
                    Err(e) => ctx.err(
                        at,
                        format!("in plugin config: cannot read {}: {e}", path.display()),
                    ),
                }
                return;
            }
            map.values_mut().for_each(|v| resolve_config(ctx, v, at));
        }
        _ => {}
    }
}
