//! Upstreams: endpoints or a URL template, balancing, timeouts, retries, ejection, TLS, DNS, health checks.

use super::*;

/// Parses a fixed endpoint URL: `http(s)://host[:port][/base]`.
/// The most a weight may be, and all of an upstream's together: the
/// round-robin schedule has one slot per unit.
pub(super) const MAX_WEIGHT: u32 = 100;
pub(super) const MAX_WEIGHTS: u32 = 10_000;

/// Whether `name` can name a cookie (an HTTP token, RFC 6265 §4.1.1).
pub(super) fn cookie_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b))
}

/// An endpoint: its URL, then optionally ` weight=N` (as nginx writes it).
pub(super) fn endpoint(s: &str) -> Result<Endpoint, String> {
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

pub(super) fn endpoint_url(s: &str) -> Result<Endpoint, String> {
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

pub(super) fn upstream_template(s: &str) -> Result<Target, String> {
    let t = Template::parse(s, true)?;
    if t.is_static() {
        return Ok(Target::Endpoints(vec![endpoint(s)?]));
    }
    if !(s.starts_with("http://") || s.starts_with("https://")) {
        return Err(format!("`{s}` must start with http:// or https://"));
    }
    Ok(Target::Template(t))
}

pub(super) fn tls_settings(ctx: &mut Ctx, raw: &Option<crate::raw::RawTls>) -> TlsSettings {
    let Some(raw) = raw else {
        return TlsSettings::default();
    };
    let mut ca_certs = Vec::new();
    if let Some(t) = &raw.ca_file
        && let Some(path) = ctx.path(t)
    {
        match portcullis_net::pem::certificates(&path) {
            Ok(certs) => ca_certs = certs,
            Err(e) => ctx.err(&t.referenced, format!("ca_file: {e}")),
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

pub(super) fn upstream(ctx: &mut Ctx, raw: &Spanned<RawUpstream>) -> Option<Upstream> {
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
pub(super) fn requests_per_connection(ctx: &mut Ctx, t: &Option<Text>) -> u32 {
    ctx.parse_or(t, DEFAULT_REQUESTS_PER_CONNECTION, |s| {
        s.parse::<u32>().map_err(|_| {
            format!("max_requests_per_connection `{s}` is not a number of requests (0: no limit)")
        })
    })
}

/// An upstream with every setting at its default.
pub(super) fn plain_upstream(name: Arc<str>, target: Target, defined_at: Pos) -> Upstream {
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
pub(super) fn dns(ctx: &mut Ctx, u: &RawUpstream, target: Option<&Target>) -> Dns {
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

pub(super) fn health_check(ctx: &mut Ctx, raw: &Spanned<RawHealthCheck>) -> Option<HealthCheck> {
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
