//! Canary routing: requests with a given header or cookie, and a share of
//! the rest, go to an alternate upstream.
//!
//! The share is spread evenly (an accumulator, not a coin toss), so 10%
//! means one request in ten per instance, not "about" one in ten.

use std::sync::atomic::{AtomicU32, Ordering};

use portcullis_sdk::{Decision, Plugin, RequestHead, RouteInfo};
use serde::Deserialize;

/// A header or cookie that selects the canary.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Match {
    name: String,
    /// Any value when absent.
    value: Option<String>,
}

/// The route's config.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The alternate upstream's name.
    upstream: String,
    /// Share of the other requests sent there, 0–100.
    #[serde(default)]
    percent: u32,
    header: Option<Match>,
    cookie: Option<Match>,
}

/// The value of cookie `name` in a `Cookie` header.
pub fn cookie<'a>(header: &'a str, name: &str) -> Option<&'a str> {
    header.split(';').map(str::trim).find_map(|kv| {
        kv.split_once('=')
            .filter(|(k, _)| *k == name)
            .map(|(_, v)| v)
    })
}

fn selected(m: &Option<Match>, value: Option<&str>) -> bool {
    match (m, value) {
        (Some(m), Some(v)) => m.value.as_deref().is_none_or(|want| want == v),
        _ => false,
    }
}

static ACCUMULATOR: AtomicU32 = AtomicU32::new(0);

struct CanaryRoute;

impl Plugin for CanaryRoute {
    type Config = Config;

    fn validate(c: &Config) -> Result<(), String> {
        if c.percent > 100 {
            return Err(format!("`percent` is {}, above 100", c.percent));
        }
        if c.upstream.is_empty() {
            return Err("`upstream` is empty".into());
        }
        Ok(())
    }

    fn on_request(
        c: &Config,
        req: &RequestHead,
        _route: &RouteInfo,
        _body: Option<&[u8]>,
    ) -> Decision {
        let header_value = c.header.as_ref().and_then(|h| req.header_str(&h.name));
        let by_header = selected(&c.header, header_value.as_deref());
        let cookies = if c.cookie.is_some() {
            // HTTP/2 clients send each cookie as a field of its own.
            req.header_joined("cookie", "; ")
        } else {
            None
        };
        let by_cookie = selected(
            &c.cookie,
            c.cookie
                .as_ref()
                .and_then(|k| cookie(cookies.as_deref()?, &k.name)),
        );
        let by_share = c.percent > 0 && {
            let acc = ACCUMULATOR.load(Ordering::Relaxed) + c.percent;
            ACCUMULATOR.store(acc % 100, Ordering::Relaxed);
            acc >= 100
        };
        if by_header || by_cookie || by_share {
            portcullis_sdk::count("canary", 1);
            portcullis_sdk::route_to(&c.upstream)
        } else {
            portcullis_sdk::forward()
        }
    }
}

portcullis_sdk::plugin!(CanaryRoute);

#[cfg(test)]
mod tests {
    use super::cookie;

    #[test]
    fn cookies_are_found_by_name() {
        assert_eq!(cookie("a=1; canary=yes; b=2", "canary"), Some("yes"));
        assert_eq!(cookie("a=1", "canary"), None);
        assert_eq!(cookie("canaryx=1", "canary"), None);
    }
}
