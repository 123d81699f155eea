//! Plugins: modules (files or `builtin:NAME`) and their uses, with configs whose `{from_file}` values are read in.

use super::*;
use crate::Expansion;

pub(super) const DEFAULT_PLUGIN_TIMEOUT: Duration = Duration::from_millis(10);
/// A start's deadline: what real filters need to start (a Go filter's
/// runtime, a large Rust filter's tables: 100-300 ms of CPU), with room.
pub(super) const DEFAULT_START_TIMEOUT: Duration = Duration::from_secs(1);

/// The largest memory cap a plugin use may ask for (the pooling
/// allocator reserves this much address space per instance slot).
pub const MAX_PLUGIN_MEMORY: usize = 256 << 20;

pub(super) fn plugin_module(ctx: &mut Ctx, raw: &Spanned<RawPlugin>) -> Option<PluginModule> {
    use sha2::Digest;
    let p = &raw.value;
    let name = name(ctx, &p.name, "plugin");
    let (path, bytes, sha256) = if super::pull::is_oci(&p.path.value.0) {
        let text = ctx.text(&p.path)?;
        let (path, bytes) = super::pull::pulled(ctx, p, &text)?;
        let sha256: [u8; 32] = sha2::Sha256::digest(&bytes).into();
        (path, bytes.into(), sha256)
    } else {
        super::pull::settings_without_registry(ctx, p);
        plugin_bytes(ctx, &p.path)?
    };
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
        bytes,
        sha256,
        defined_at: ctx.pos(&raw.referenced),
    })
}

/// Where a plugin's component comes from and its bytes: a standard
/// plugin built into the binary (`builtin:NAME`), or a file (relative to
/// the policy file).
pub(super) fn plugin_bytes(
    ctx: &mut Ctx,
    path: &Text,
) -> Option<(std::path::PathBuf, Arc<[u8]>, [u8; 32])> {
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
        let sha256: [u8; 32] = <sha2::Sha256 as sha2::Digest>::digest(bytes).into();
        return Some((text.into(), bytes.into(), sha256));
    }
    let file = ctx.path(path)?;
    match super::plugin_files::read(&file) {
        Ok((bytes, sha256)) => Some((file, bytes, sha256)),
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

pub(super) fn plugin_use(
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
        if ctx.lost(name.trim()) {
            return None;
        }
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
    let root_id = match &u.root_id {
        Some(t) => Some(Arc::from(ctx.text(t)?.trim())),
        None => None,
    };
    let asked = match &u.expand_config {
        Some(t) => Some(ctx.parse(t, |s| match boolean_word(s) {
            "true" => Ok(true),
            "false" => Ok(false),
            _ => Err(format!("`{s}` is not a boolean; write true or false")),
        })?),
        None => None,
    };
    let expansion = Some(Box::new(expand_configs(
        ctx,
        u.config.as_ref(),
        u.vm_config.as_ref(),
        asked,
    )));
    let written = |c: &Spanned<serde_json::Value>| c.value.to_string();
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
    let start_timeout = ctx.parse_or(&u.start_timeout, DEFAULT_START_TIMEOUT, |s| {
        let d = parse_duration(s)?;
        if d.is_zero() || d > Duration::from_secs(60) {
            Err(format!(
                "plugin start_timeout `{s}` must be above 0 and at most 60s"
            ))
        } else {
            Ok(d)
        }
    });
    // Unset: the plugin's kind's default (`PluginUse::memory`).
    let memory = ctx.parse_or(&u.memory, None, |s| {
        let n = parse_size(s)? as usize;
        if (1 << 20..=MAX_PLUGIN_MEMORY).contains(&n) {
            Ok(Some(n))
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
    let shadow = shadow(ctx, u);
    let mut made = PluginUse {
        plugin,
        shadow,
        rollout: None,
        substituted: Arc::new([]),
        fresh_instances,
        root_id,
        vm_config_json: u.vm_config.as_ref().map(written),
        config_json: u.config.as_ref().map_or_else(|| "{}".to_owned(), written),
        expansion,
        fail,
        timeout,
        start_timeout,
        memory,
        defined_at: ctx.pos(&raw.referenced),
    };
    if let Some(r) = &u.rollout
        && !rollout_in_shadow(ctx, u, shadow)
    {
        made.rollout = super::rollout::rollout(ctx, &made, r, (u, plugin_index)).map(Box::new);
    }
    Some(made)
}

/// A use's configs resolved (`${ENV}`, `{from_file}`), with what that
/// brought in and its errors, held until the plugin's kind is known: a
/// filter's config goes as written (Envoy's do, and theirs use `$1` and
/// `${...}` of their own); a component's is resolved.
pub(super) fn expand_configs(
    ctx: &mut Ctx,
    config: Option<&Spanned<serde_json::Value>>,
    vm_config: Option<&Spanned<serde_json::Value>>,
    asked: Option<bool>,
) -> Expansion {
    let (errors_from, from) = (ctx.errors.len(), ctx.substituted.len());
    let resolved = |ctx: &mut Ctx<'_>, c: &Spanned<serde_json::Value>| {
        let mut value = c.value.clone();
        resolve_config(ctx, &mut value, &c.referenced);
        value.to_string()
    };
    let config_json = match config {
        Some(c) => resolved(ctx, c),
        None => "{}".to_owned(),
    };
    let vm_config_json = vm_config.map(|c| resolved(ctx, c));
    let (substituted, errors) = (
        ctx.substituted.split_off(from),
        ctx.errors.split_off(errors_from),
    );
    Expansion {
        asked,
        config_json,
        vm_config_json,
        substituted,
        errors,
    }
}

/// A use in shadow mode with a rollout: refused at `mode` (a candidate
/// is tried in shadow on a use of its own, then rolled out).
fn rollout_in_shadow(ctx: &mut Ctx, u: &RawPluginUse, shadow: Option<u32>) -> bool {
    let (Some(_), Some(mode)) = (shadow, &u.mode) else {
        return false;
    };
    ctx.err(
        &mode.referenced,
        "a use in `mode: shadow` cannot have a `rollout`; try the candidate in shadow on a use of its own, then roll it out",
    );
    true
}

/// `mode` and `shadow_percent`: the share a shadow use runs on.
fn shadow(ctx: &mut Ctx, u: &RawPluginUse) -> Option<u32> {
    let shadow = ctx.parse_or(&u.mode, false, |s| match s {
        "enforce" => Ok(false),
        "shadow" => Ok(true),
        _ => Err(format!("`{s}` is not a plugin mode; use enforce or shadow")),
    });
    let percent = ctx.parse_or(&u.shadow_percent, 100, |s| {
        s.trim_end_matches('%')
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=100).contains(n))
            .ok_or_else(|| format!("shadow_percent `{s}` is not a share from 1 to 100"))
    });
    if let (Some(t), false) = (&u.shadow_percent, shadow) {
        ctx.err(
            &t.referenced,
            "`shadow_percent` is for a use with `mode: shadow`".to_owned(),
        );
    }
    shadow.then_some(percent)
}

/// Settles what `use` gets once its plugin's kind is known: the resolved
/// configs (and their errors) for a component or a use that asks
/// (`expand_config: true`), the written ones for a proxy-wasm filter.
/// The upstreams a standard plugin's config names
/// ([`builtin_plugins::upstream_keys`]), checked against the policies'
/// own; a missing or mistyped key is the plugin's to report.
pub(super) fn named_upstreams(
    ctx: &mut Ctx,
    u: &PluginUse,
    module: &PluginModule,
    upstreams: &[Arc<Upstream>],
) {
    use crate::builtin_plugins;
    let path = module.path.to_string_lossy();
    let Some(builtin) = path.strip_prefix(builtin_plugins::PREFIX) else {
        return;
    };
    let keys = builtin_plugins::upstream_keys(builtin.trim());
    if keys.is_empty() {
        return;
    }
    let Ok(config) = serde_json::from_str::<serde_json::Value>(&u.config_json) else {
        return;
    };
    for key in keys {
        let Some(name) = config.get(key).and_then(|v| v.as_str()) else {
            continue;
        };
        if upstreams.iter().any(|up| &*up.name == name) {
            continue;
        }
        let mut known: Vec<&str> = upstreams.iter().map(|up| &*up.name).collect();
        known.sort_unstable();
        let known = if known.is_empty() {
            "none".to_owned()
        } else {
            known.join(", ")
        };
        ctx.errors.push(ConfigError {
            pos: u.defined_at.clone(),
            message: format!(
                "`{key}: {name}` in {}'s config names no upstream; defined under `upstreams:`: {known}",
                builtin.trim()
            ),
        });
    }
}

pub(super) fn settle_config(ctx: &mut Ctx, u: &mut PluginUse, module: &PluginModule) {
    let Some(e) = u.expansion.take() else { return };
    if !e.asked.unwrap_or(!module.is_core_module()) {
        return;
    }
    u.config_json = e.config_json;
    u.vm_config_json = e.vm_config_json;
    ctx.errors.extend(e.errors);
    // The plugin's own refusals may quote its config: what came from the
    // environment or a file is kept out of them too.
    ctx.substituted.extend_from_slice(&e.substituted);
    u.substituted = e.substituted.into();
}

/// Expands `${ENV}` in every string of a plugin config and replaces
/// `{from_file: path}` with the file's contents (a mounted Secret), so
/// plugins get secrets without any access of their own.
pub(super) fn resolve_config(ctx: &mut Ctx, value: &mut serde_json::Value, at: &Location) {
    use serde_json::Value;
    match value {
        Value::String(s) => match expand(s, ctx.env) {
            Ok(v) => {
                ctx.substituted(s, &v);
                *s = v;
            }
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
                match portcullis_net::files::read_bounded_text(
                    &path,
                    portcullis_net::files::SMALL_LIMIT,
                ) {
                    // Secrets mounted from files usually end in a newline
                    // that is not part of the secret.
                    Ok(text) => {
                        let secret = text.trim_end_matches(['\n', '\r']);
                        if !secret.is_empty() {
                            let reference = format!("contents of {}", path.display());
                            ctx.substituted.push((secret.to_owned(), reference));
                        }
                        *value = Value::String(secret.to_owned())
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
