//! OAuth 2.0 token introspection (RFC 7662).
//!
//! Takes the token of `Authorization: Bearer`, asks the authorization
//! server about it (a `POST` of `token=...` to its introspection endpoint,
//! an upstream of the policies, with the proxy's client credentials), and
//! lets the request on if the answer is `active`, from the config's
//! issuer, for one of its audiences, with every scope it requires. Fields
//! of the answer (`sub`, `client_id`, `username`, `scope`) can go to the
//! upstream as headers. Answers are kept (see [`cache`]) until the token's
//! `exp`, at most `cache_max_secs`, so a client's token is asked about
//! once, not on every request.
//!
//! Refusals are RFC 6750's: 401 with `WWW-Authenticate: Bearer` for no
//! token, `error="invalid_token"` for one the server does not vouch for,
//! 403 `error="insufficient_scope"` for missing scopes. No answer from the
//! server (down, slow, not an introspection answer) is a 503: the token is
//! neither let on nor called invalid.

pub mod answer;
pub mod cache;

use std::cell::{OnceCell, RefCell};
use std::collections::BTreeMap;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as B64;
use portcullis_sdk::{
    Callout, CalloutResult, Decision, HeaderEdits, Plugin, RequestHead, RouteInfo, bearer, header,
};
use serde::Deserialize;

use answer::Refusal;

/// The route's config.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The authorization server: an upstream of the policies, by name.
    upstream: String,
    /// Its introspection endpoint's path.
    path: String,
    /// The proxy's client credentials at the server (HTTP Basic, RFC 6749
    /// 2.3.1); both or neither.
    client_id: Option<String>,
    client_secret: Option<String>,
    /// How long the server may take to answer, in milliseconds.
    #[serde(default = "default_timeout")]
    timeout_ms: u32,
    /// The answer's `iss` must be this.
    issuer: Option<String>,
    /// Accepted audiences; the answer's `aud` must contain one.
    #[serde(default)]
    pub audiences: Vec<String>,
    /// Scopes the answer's `scope` must all hold.
    #[serde(default)]
    pub scopes: Vec<String>,
    /// Answer field → request header to set (string, number or bool).
    #[serde(default)]
    pub claims_to_headers: BTreeMap<String, String>,
    /// Answer 401 without a token (default), or let tokenless requests on.
    #[serde(default = "yes")]
    required: bool,
    /// How many answers each instance keeps (0: ask on every request).
    #[serde(default = "default_cache_size")]
    cache_size: usize,
    /// The longest an answer is kept, whatever its `exp`: a revoked token
    /// is refused at most this long after.
    #[serde(default = "default_cache_max")]
    pub cache_max_secs: u64,
}

fn default_timeout() -> u32 {
    2000
}

fn default_cache_size() -> usize {
    1024
}

fn default_cache_max() -> u64 {
    300
}

fn yes() -> bool {
    true
}

struct TokenIntrospection;

impl Plugin for TokenIntrospection {
    type Config = Config;

    fn validate(c: &Config) -> Result<(), String> {
        if c.upstream.is_empty() {
            return Err("`upstream`: the authorization server's upstream".into());
        }
        if !c.path.starts_with('/') {
            return Err(format!(
                "`path`: the introspection endpoint's path, from `/` (not `{}`)",
                c.path
            ));
        }
        if c.client_id.is_some() != c.client_secret.is_some() {
            return Err("give `client_id` and `client_secret` together".into());
        }
        if !(1..=60_000).contains(&c.timeout_ms) {
            return Err("`timeout_ms`: between 1 and 60000".into());
        }
        for name in c.claims_to_headers.values() {
            if !portcullis_sdk::is_header_name(name) {
                return Err(format!("`claims_to_headers`: `{name}` is no header name"));
            }
        }
        Ok(())
    }

    fn on_request(c: &Config, req: &RequestHead, _: &RouteInfo, _: Option<&[u8]>) -> Decision {
        let authorization = req.header("authorization");
        let Some(token) = authorization.as_deref().and_then(bearer::token) else {
            return if c.required {
                refused(&Refusal::Missing)
            } else {
                portcullis_sdk::forward_with(bearer::anonymous_edits(&c.claims_to_headers))
            };
        };
        let now = portcullis_sdk::now_unix_ms() / 1000;
        match with_cache(c, |cache| cache.get(&cache::key(token), now)) {
            Some(outcome) => decided(outcome),
            None => introspect(c, token),
        }
    }

    fn on_callout(c: &Config, req: &RequestHead, _: &RouteInfo, result: CalloutResult) -> Decision {
        // The token again: an instance keeps nothing of a request.
        let authorization = req.header("authorization");
        let Some(token) = authorization.as_deref().and_then(bearer::token) else {
            return refused(&Refusal::Missing);
        };
        let now = portcullis_sdk::now_unix_ms() / 1000;
        let judged = match result {
            CalloutResult::Answered(r) if r.status == 200 => answer::judge(c, &r.body, now),
            CalloutResult::Answered(r) => Err(format!("the server answered {}", r.status)),
            CalloutResult::TimedOut => Err(format!("no answer within {} ms", c.timeout_ms)),
            CalloutResult::Failed(why) => Err(why),
        };
        match judged {
            Ok(j) => {
                let key = cache::key(token);
                with_cache(c, |cache| {
                    cache.insert(key, j.until, j.outcome.clone(), now)
                });
                decided(j.outcome)
            }
            Err(why) => unavailable(&why),
        }
    }
}

thread_local! {
    static CACHE: OnceCell<RefCell<cache::AnswerCache>> = const { OnceCell::new() };
}

fn with_cache<R>(c: &Config, f: impl FnOnce(&mut cache::AnswerCache) -> R) -> R {
    CACHE.with(|cell| {
        let cache = cell.get_or_init(|| RefCell::new(cache::AnswerCache::new(c.cache_size)));
        f(&mut cache.borrow_mut())
    })
}

/// The introspection request for `token` (RFC 7662, 2.1).
#[cold]
fn introspect(c: &Config, token: &[u8]) -> Decision {
    portcullis_sdk::count("introspected", 1);
    let body = form_urlencoded::Serializer::new(String::new())
        .append_pair("token", &String::from_utf8_lossy(token))
        .append_pair("token_type_hint", "access_token")
        .finish();
    let mut headers = vec![
        header("content-type", "application/x-www-form-urlencoded"),
        header("accept", "application/json"),
    ];
    if let (Some(id), Some(secret)) = (&c.client_id, &c.client_secret) {
        // Each part form-encoded before the Basic encoding (RFC 6749, 2.3.1).
        let encode = |s: &str| form_urlencoded::byte_serialize(s.as_bytes()).collect::<String>();
        let pair = format!("{}:{}", encode(id), encode(secret));
        headers.push(header(
            "authorization",
            &format!("Basic {}", B64.encode(pair)),
        ));
    }
    Decision::Callout(Callout {
        upstream: c.upstream.clone(),
        method: "POST".into(),
        path: c.path.clone(),
        headers,
        body: body.into_bytes(),
        timeout_ms: c.timeout_ms,
    })
}

fn decided(outcome: Result<HeaderEdits, Refusal>) -> Decision {
    match outcome {
        Ok(edits) => portcullis_sdk::forward_with(edits),
        Err(why) => refused(&why),
    }
}

/// RFC 6750's answer to a refused token (3, 3.1).
#[cold]
fn refused(why: &Refusal) -> Decision {
    portcullis_sdk::count("refused", 1);
    portcullis_sdk::log(
        portcullis_sdk::Level::Debug,
        &format!("token refused: {why:?}"),
    );
    let (status, message, challenge) = match why {
        Refusal::Missing => (401, "missing bearer token", "Bearer".to_owned()),
        Refusal::Scope(missing) => (
            403,
            "the token lacks a scope this route requires",
            format!(r#"Bearer error="insufficient_scope", scope="{missing}""#),
        ),
        _ => (
            401,
            "invalid bearer token",
            r#"Bearer error="invalid_token""#.to_owned(),
        ),
    };
    let mut answer = portcullis_sdk::error_response(status, message);
    answer.headers.push(header("www-authenticate", &challenge));
    Decision::Respond(answer)
}

/// No usable answer from the server: the request can be neither let on
/// nor refused as unauthorized.
#[cold]
fn unavailable(why: &str) -> Decision {
    portcullis_sdk::count("introspection_failed", 1);
    portcullis_sdk::log(
        portcullis_sdk::Level::Warn,
        &format!("token introspection failed: {why}"),
    );
    portcullis_sdk::respond(503, "token introspection unavailable")
}

portcullis_sdk::plugin!(TokenIntrospection);
