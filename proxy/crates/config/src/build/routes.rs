//! Routes: host and path patterns, conditions, actions, rewrites and header edits.

use super::*;

/// Parameter names a matchit pattern captures (`{id}` and `{*rest}`).
pub(super) fn pattern_params(pattern: &str) -> Vec<String> {
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

pub(super) fn host_match(s: &str) -> Result<HostMatch, String> {
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

pub(super) type RouteParts = (Route, HostMatch, Vec<String>);

/// The index of the upstream `t` names; an error naming the defined ones
/// when there is none of that name.
pub(super) fn named_upstream(
    ctx: &mut Ctx,
    t: &Text,
    upstream_index: &HashMap<String, Option<usize>>,
) -> Option<usize> {
    let up = ctx.text(t)?;
    match upstream_index.get(up.trim()) {
        Some(&Some(i)) => Some(i),
        // Defined, but in error (reported there).
        Some(None) => None,
        None if ctx.lost(up.trim()) => None,
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

pub(super) fn route(
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
                .filter(|c| (200..=599).contains(&c.as_u16()))
                .ok_or_else(|| {
                    format!("`{s}` is not an HTTP status code a route can answer with (200-599)")
                })
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
            .map(|h| ctx.edited_pairs(h, "respond.headers"))
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
    let request_headers = ctx.header_edits(&r.request_headers, "request_headers");
    let response_headers = ctx.header_edits(&r.response_headers, "response_headers");
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
