//! HTTP Basic authentication against an htpasswd list: nginx's
//! `auth_basic` with `auth_basic_user_file`, ingress-nginx's `auth-type:
//! basic`, Envoy's `basic_auth` filter.
//!
//! The list is the text of an htpasswd file in the config (`htpasswd: {
//! from_file: /run/secrets/htpasswd }` reads a mounted Secret), one
//! `user:hash` per line. Hashes are bcrypt (`htpasswd -B`: `$2y$`, `$2a$`,
//! `$2b$`) or `{SHA}` (`htpasswd -s`, unsalted SHA-1: Envoy's only format,
//! weak; kept for files made for it). MD5 (`$apr1$`, htpasswd's default
//! without `-B`) and crypt are refused when the config is checked, with
//! the command that makes a bcrypt line.
//!
//! A request without valid credentials gets 401 with `WWW-Authenticate:
//! Basic realm="..."`, so a browser asks for them. One that passes goes
//! on without its `Authorization` header (the password stays here) unless
//! `keep_authorization`, and with the user's name in `user_header` when
//! set (a client's own copy of that header is always replaced).
//!
//! bcrypt is slow on purpose: cost 5 (`htpasswd -B`'s default) takes a few
//! milliseconds, and each step up doubles it. Credentials that passed are
//! remembered by a SHA-256 of the header's value (see [`Remembered`]), so
//! a client pays once per plugin instance; refusals are never remembered
//! (anyone can make those), so bound wrong guesses with the route's
//! `rate_limit`, and give the plugin a `timeout` that fits the cost. A
//! user not on the list is checked against a decoy at the list's cost, so
//! a refusal's time does not tell which users exist.

use std::cell::RefCell;
use std::collections::HashMap;

use base64::Engine;
use portcullis_sdk::{Decision, HeaderEdits, Plugin, RequestHead, RouteInfo, header};
use serde::Deserialize;
use sha1::Digest as _;
use subtle::ConstantTimeEq;

/// The route's config.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The lines of an htpasswd file.
    htpasswd: String,
    /// The realm browsers show.
    #[serde(default = "default_realm")]
    realm: String,
    /// A header set to the user's name for the upstream.
    #[serde(default)]
    user_header: Option<String>,
    /// Pass the `Authorization` header on (it holds the password).
    #[serde(default)]
    keep_authorization: bool,
    /// Credentials remembered per instance after they passed (0: check
    /// every request).
    #[serde(default = "default_cache_size")]
    cache_size: usize,
}

fn default_realm() -> String {
    "Restricted".into()
}

fn default_cache_size() -> usize {
    1024
}

/// How one user's password is checked.
#[derive(Debug, Clone, PartialEq)]
pub enum Hash {
    /// A bcrypt hash, as written.
    Bcrypt(String),
    /// SHA-1 of the password.
    Sha1([u8; 20]),
}

impl Hash {
    /// Parses the hash part of an htpasswd line.
    pub fn parse(s: &str) -> Result<Hash, String> {
        if s.starts_with("$2y$") || s.starts_with("$2a$") || s.starts_with("$2b$") {
            s.parse::<bcrypt::HashParts>()
                .map_err(|e| format!("not a bcrypt hash: {e}"))?;
            return Ok(Hash::Bcrypt(s.to_owned()));
        }
        if let Some(b64) = s.strip_prefix("{SHA}") {
            let digest = base64::engine::general_purpose::STANDARD
                .decode(b64)
                .ok()
                .and_then(|d| <[u8; 20]>::try_from(d).ok())
                .ok_or("{SHA} needs the base64 of a 20-byte SHA-1 digest")?;
            return Ok(Hash::Sha1(digest));
        }
        if s.starts_with("$apr1$") || s.starts_with("$1$") {
            return Err(
                "MD5 hashes are not supported: make the line with `htpasswd -nB USER` (bcrypt)"
                    .into(),
            );
        }
        Err("unknown hash format (crypt?): make the line with `htpasswd -nB USER` (bcrypt)".into())
    }

    /// Whether `password` matches.
    pub fn matches(&self, password: &str) -> bool {
        match self {
            Hash::Bcrypt(hash) => bcrypt::verify(password, hash).unwrap_or(false),
            Hash::Sha1(digest) => {
                let got: [u8; 20] = sha1::Sha1::digest(password.as_bytes()).into();
                got.ct_eq(digest).into()
            }
        }
    }
}

/// The users of an htpasswd text, by name; errors name the line.
pub fn parse_htpasswd(text: &str) -> Result<HashMap<String, Hash>, String> {
    let mut users = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let at = |e: String| format!("htpasswd line {}: {e}", i + 1);
        let (user, hash) = line
            .split_once(':')
            .ok_or_else(|| at("not `user:hash`".into()))?;
        if user.is_empty() {
            return Err(at("no user name".into()));
        }
        let hash = Hash::parse(hash).map_err(at)?;
        if users.insert(user.to_owned(), hash).is_some() {
            return Err(at(format!("`{user}` is listed twice")));
        }
    }
    if users.is_empty() {
        return Err("htpasswd lists no user".into());
    }
    Ok(users)
}

/// The user and password of an `Authorization: Basic` value.
pub fn credentials(value: &str) -> Option<(String, String)> {
    let (scheme, rest) = value.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(rest.trim())
        .ok()?;
    let text = String::from_utf8(decoded).ok()?;
    let (user, password) = text.split_once(':')?;
    Some((user.to_owned(), password.to_owned()))
}

/// Credentials that passed, by a SHA-256 of the `Authorization` value (a
/// digest, so the passwords are not kept in the clear), with the user
/// they named. At `capacity` the table starts over: a client that passed
/// pays one more check, no more.
pub struct Remembered {
    capacity: usize,
    passed: HashMap<[u8; 32], String>,
}

impl Remembered {
    fn key(value: &str) -> [u8; 32] {
        sha2::Sha256::digest(value.as_bytes()).into()
    }

    /// The user whose credentials `value` carried, if they passed before.
    pub fn get(&self, value: &str) -> Option<&str> {
        self.passed.get(&Self::key(value)).map(String::as_str)
    }

    /// Remembers that `value` passed as `user`.
    pub fn insert(&mut self, value: &str, user: &str) {
        if self.capacity == 0 {
            return;
        }
        if self.passed.len() >= self.capacity {
            self.passed.clear();
        }
        self.passed.insert(Self::key(value), user.to_owned());
    }
}

/// This instance's parsed list and what passed (an instance has one
/// config, which `validate` already accepted).
struct State {
    users: HashMap<String, Hash>,
    remembered: Remembered,
    /// Checked against for a user not on the list, so a refusal takes as
    /// long whether or not the user exists (the time would tell which
    /// names are worth guessing passwords for).
    decoy: Option<Hash>,
}

/// A bcrypt hash at the cost of the list's first bcrypt line (`None`
/// without one: `{SHA}` checks take microseconds either way).
pub fn decoy(users: &HashMap<String, Hash>) -> Option<Hash> {
    let cost = users.values().find_map(|h| match h {
        Hash::Bcrypt(text) => text.parse::<bcrypt::HashParts>().ok().map(|p| p.get_cost()),
        Hash::Sha1(_) => None,
    })?;
    // A fixed salt: no random draw, the same work as a real line's check.
    let parts = bcrypt::hash_with_salt("decoy", cost, *b"portcullis-decoy").ok()?;
    Some(Hash::Bcrypt(
        parts.format_for_version(bcrypt::Version::TwoY),
    ))
}

thread_local! {
    static STATE: RefCell<Option<State>> = const { RefCell::new(None) };
}

/// Checks `value` (an `Authorization` header) against `c`'s users: the
/// user's name when it passes.
fn check(c: &Config, value: &str) -> Option<String> {
    STATE.with_borrow_mut(|state| {
        let state = state.get_or_insert_with(|| {
            let users = parse_htpasswd(&c.htpasswd).unwrap_or_default();
            State {
                decoy: decoy(&users),
                users,
                remembered: Remembered {
                    capacity: c.cache_size,
                    passed: HashMap::new(),
                },
            }
        });
        if let Some(user) = state.remembered.get(value) {
            return Some(user.to_owned());
        }
        let (user, password) = credentials(value)?;
        let Some(hash) = state.users.get(&user) else {
            if let Some(decoy) = &state.decoy {
                decoy.matches(&password);
            }
            return None;
        };
        if !hash.matches(&password) {
            return None;
        }
        state.remembered.insert(value, &user);
        Some(user)
    })
}

struct BasicAuth;

impl Plugin for BasicAuth {
    type Config = Config;

    fn validate(c: &Config) -> Result<(), String> {
        parse_htpasswd(&c.htpasswd)?;
        if c.realm.contains('"') || c.realm.chars().any(char::is_control) {
            return Err("realm cannot hold `\"` or control characters".into());
        }
        if let Some(h) = &c.user_header
            && !portcullis_sdk::is_header_name(h)
        {
            return Err(format!("user_header `{h}` is not a header name"));
        }
        Ok(())
    }

    fn on_request(
        c: &Config,
        req: &RequestHead,
        _route: &RouteInfo,
        _body: Option<&[u8]>,
    ) -> Decision {
        let user = req
            .header_str("authorization")
            .and_then(|value| check(c, &value));
        let Some(user) = user else {
            return unauthorized(&c.realm);
        };
        let mut edits = HeaderEdits {
            remove: Vec::new(),
            set: Vec::new(),
            add: Vec::new(),
        };
        if !c.keep_authorization {
            edits.remove.push("authorization".into());
        }
        if let Some(h) = &c.user_header {
            edits.set.push(header(h, &user));
        }
        portcullis_sdk::forward_with(edits)
    }
}

#[cold]
fn unauthorized(realm: &str) -> Decision {
    portcullis_sdk::count("refused", 1);
    match portcullis_sdk::respond(401, "authentication required") {
        Decision::Respond(mut r) => {
            let challenge = format!("Basic realm=\"{realm}\", charset=\"UTF-8\"");
            r.headers.push(header("www-authenticate", &challenge));
            Decision::Respond(r)
        }
        other => other,
    }
}

portcullis_sdk::plugin!(BasicAuth);

#[cfg(test)]
mod tests {
    use super::*;

    fn basic(user_pass: &str) -> String {
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(user_pass)
        )
    }

    #[test]
    fn bcrypt_and_sha_lines_check_their_passwords() {
        let bcrypt_line = bcrypt::hash("s3cret", 4).unwrap();
        // `htpasswd -nbs bob hunter2`.
        let text =
            format!("# users\nalice:{bcrypt_line}\n\nbob:{{SHA}}87u9ZqY9S/F0eUBXjsPQEDUw4h0=\n");
        let users = parse_htpasswd(&text).unwrap();
        assert!(users["alice"].matches("s3cret"));
        assert!(!users["alice"].matches("s3cret "));
        assert!(users["bob"].matches("hunter2"));
        assert!(!users["bob"].matches("hunter3"));
    }

    #[test]
    fn an_unknown_user_costs_a_check_at_the_lists_cost() {
        let line = bcrypt::hash("s3cret", 6).unwrap();
        let users = parse_htpasswd(&format!("alice:{line}")).unwrap();
        let Some(Hash::Bcrypt(text)) = decoy(&users) else {
            panic!("no decoy for a bcrypt list");
        };
        assert!(text.starts_with("$2y$06$"), "{text}");
        assert!(Hash::Bcrypt(text).matches("decoy"));
        let sha_only = parse_htpasswd("bob:{SHA}87u9ZqY9S/F0eUBXjsPQEDUw4h0=").unwrap();
        assert_eq!(decoy(&sha_only), None);
    }

    #[test]
    fn unsupported_and_broken_lines_are_named() {
        let e = parse_htpasswd("carol:$apr1$abc$def").unwrap_err();
        assert!(e.contains("line 1") && e.contains("htpasswd -nB"), "{e}");
        let e = parse_htpasswd("ok:{SHA}87u9ZqY9S/F0eUBXjsPQEDUw4h0=\nnocolon").unwrap_err();
        assert!(e.contains("line 2"), "{e}");
        assert!(parse_htpasswd("dave:$2y$05$short").is_err());
        assert!(parse_htpasswd("# nobody\n").is_err());
        let e = parse_htpasswd(
            "e:{SHA}87u9ZqY9S/F0eUBXjsPQEDUw4h0=\ne:{SHA}87u9ZqY9S/F0eUBXjsPQEDUw4h0=",
        )
        .unwrap_err();
        assert!(e.contains("twice"), "{e}");
    }

    #[test]
    fn only_basic_credentials_with_a_colon_are_read() {
        assert_eq!(
            credentials(&basic("alice:pa:ss")),
            Some(("alice".into(), "pa:ss".into()))
        );
        assert_eq!(
            credentials(&basic("alice:x").replace("Basic", "basic")),
            Some(("alice".into(), "x".into()))
        );
        assert_eq!(credentials(&basic("no-colon")), None);
        assert_eq!(credentials("Bearer abc"), None);
        assert_eq!(credentials("Basic !!!"), None);
    }

    #[test]
    fn what_passed_is_remembered_up_to_the_capacity() {
        let mut r = Remembered {
            capacity: 2,
            passed: HashMap::new(),
        };
        r.insert("a", "alice");
        r.insert("b", "bob");
        assert_eq!(r.get("a"), Some("alice"));
        r.insert("c", "carol");
        assert_eq!(r.get("a"), None, "full: started over");
        assert_eq!(r.get("c"), Some("carol"));
        let mut off = Remembered {
            capacity: 0,
            passed: HashMap::new(),
        };
        off.insert("a", "alice");
        assert_eq!(off.get("a"), None);
    }
}
