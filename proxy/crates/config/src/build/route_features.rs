//! Route features and tracing as specs: auth requests and their caches, mirrors, rate limits, compression, CORS, the policies' `tracing`.

use super::*;

pub(super) fn auth_request(
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
    let copy_headers = header_names(ctx, &a.copy_headers, "").filter(|names| {
        // Copied into the forwarded request: a framing field of the auth
        // service's answer would frame the request wrongly.
        let framing = names
            .iter()
            .position(|n| portcullis_net::framing::is_framing(n.as_str()));
        if let Some(i) = framing {
            let message = format!(
                "`copy_headers` names `{}`, which frames a message: the proxy alone sets it",
                names[i]
            );
            ctx.err(&a.copy_headers[i].referenced, message);
        }
        framing.is_none()
    });
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
pub(super) fn header_names(ctx: &mut Ctx, texts: &[Text], what: &str) -> Option<Vec<HeaderName>> {
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
pub(super) fn fixed_upstream(
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

pub(super) fn mirror(
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

pub(super) fn tracing_settings(
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

pub(super) fn auth_cache(ctx: &mut Ctx, c: &RawAuthCache) -> Option<AuthCacheSpec> {
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

pub(super) fn rate_limit(ctx: &mut Ctx, raw: &Spanned<RawRateLimit>) -> Option<RateLimitSpec> {
    use crate::units::parse_rate;
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
    let shared = ctx.flag(&l.shared, false);
    let ((count, period), burst, key) = (rate?, burst?, key?);
    let described = ctx.text(&l.rate)?.trim().to_owned();
    Some(RateLimitSpec {
        count,
        period,
        burst,
        key,
        described,
        shared,
    })
}

pub(super) fn compression(ctx: &mut Ctx, raw: &Spanned<RawCompress>) -> Option<Compression> {
    use crate::{DEFAULT_BROTLI, DEFAULT_LEVEL, DEFAULT_MIN_SIZE, DEFAULT_TYPES};
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

pub(super) fn cors(ctx: &mut Ctx, raw: &Spanned<RawCors>) -> Cors {
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
