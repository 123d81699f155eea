//! Tunnel client authentication: a tokens file mapping runtime id → token
//! hash, as a Kubernetes Secret or ConfigMap would hold it:
//!
//! ```yaml
//! runtime-a: sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
//! ```
//!
//! Tokens are long random strings, so one SHA-256 is the right hash (as for
//! API tokens; a slow password hash adds nothing against a random secret).
//! The file is read again when it changes, so rotating a token or adding a
//! runtime needs no restart; a file that does not parse keeps the last good
//! one in force.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime};

use sha2::{Digest, Sha256};

/// The hash to put in the tokens file for `token`: `sha256:<hex>`.
pub fn hash_token(token: &str) -> String {
    format!(
        "sha256:{}",
        hex::encode(Sha256::digest(token.trim().as_bytes()))
    )
}

/// Tokens that examples publish (this repository's deploy/ shipped
/// `change-me`) or that people type when asked for one: a tokens file
/// holding one of their hashes lets in anyone who read the example.
const PLACEHOLDERS: &[&str] = &[
    "change-me",
    "changeme",
    "change_me",
    "replace-me",
    "REPLACE-ME",
    "replaceme",
    "token",
    "secret",
    "password",
    "example",
    "test",
    "admin",
];

/// Whether `token` is a placeholder from an example, never to be used.
pub fn is_placeholder(token: &str) -> bool {
    let token = token.trim();
    PLACEHOLDERS.iter().any(|p| p.eq_ignore_ascii_case(token))
}

/// The placeholder whose hash `hash` is, if any.
fn placeholder_of(hash: &[u8; 32]) -> Option<&'static str> {
    // Hashed once, not for every entry of every tokens file read.
    static HASHES: std::sync::OnceLock<Vec<[u8; 32]>> = std::sync::OnceLock::new();
    let hashes = HASHES.get_or_init(|| {
        PLACEHOLDERS
            .iter()
            .map(|p| Sha256::digest(p.as_bytes()).into())
            .collect()
    });
    hashes
        .iter()
        .position(|h| h == hash)
        .map(|i| PLACEHOLDERS[i])
}

/// How to make a token and its line in the tokens file, for errors.
pub const HOW_TO_MAKE_A_TOKEN: &str = "make a random one with `head -c 32 /dev/urandom | base64 > token` and put `portcullis hash-token < token` here";

/// Compares in time independent of where the inputs differ (`subtle`:
/// `black_box` alone promises nothing about constant time).
pub(super) fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    use subtle::ConstantTimeEq;
    a.ct_eq(b).into()
}

/// A runtime id as it appears in a host name: one DNS label.
pub fn valid_runtime_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 63
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !id.starts_with('-')
        && !id.ends_with('-')
}

/// Why a tunnel client was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// No such runtime, or the token is not its token.
    BadCredentials,
    /// Too many failures from this address for this runtime lately.
    RateLimited,
}

/// The tokens file, read when it changes.
pub struct Tokens {
    path: PathBuf,
    state: Mutex<State>,
}

struct State {
    /// What the file held when last read: modification time and length,
    /// to skip re-parsing an unchanged file.
    seen: Option<(SystemTime, u64)>,
    hashes: HashMap<String, [u8; 32]>,
    /// Recent failures (count, since) by source address and runtime id
    /// (empty for ids the file does not have).
    failures: HashMap<(IpAddr, String), (u32, Instant)>,
}

/// Failed attempts allowed per source address per window.
const MAX_FAILURES: u32 = 10;
const FAILURE_WINDOW: Duration = Duration::from_secs(60);

impl Tokens {
    /// Reads the tokens file; an error names the file and the problem.
    pub fn load(path: PathBuf) -> Result<Tokens, String> {
        let tokens = Tokens {
            path,
            state: Mutex::new(State {
                seen: None,
                hashes: HashMap::new(),
                failures: HashMap::new(),
            }),
        };
        let mut state = tokens.lock();
        tokens.refresh(&mut state)?;
        drop(state);
        Ok(tokens)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Re-reads the file if it changed. On error the previous contents stay.
    fn refresh(&self, state: &mut State) -> Result<(), String> {
        let shown = self.path.display();
        let meta = std::fs::metadata(&self.path).map_err(|e| format!("{shown}: {e}"))?;
        let stamp = (
            meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            meta.len(),
        );
        if state.seen == Some(stamp) {
            return Ok(());
        }
        let text = portcullis_net::files::read_bounded_text(
            &self.path,
            portcullis_net::files::SMALL_LIMIT,
        )
        .map_err(|e| format!("{shown}: {e}"))?;
        let hashes = parse(&text).map_err(|e| format!("{shown}: {e}"))?;
        if state.seen.is_some() {
            tracing::info!(file = %shown, runtimes = hashes.len(), "tokens file reloaded");
        }
        state.hashes = hashes;
        state.seen = Some(stamp);
        Ok(())
    }

    /// Whether `id` is (still) allowed to connect at all.
    pub fn knows(&self, id: &str) -> bool {
        self.current(id).is_some()
    }

    /// The token hash `id` has now (the file re-read if it changed), so a
    /// tunnel can be closed when its runtime's token is rotated or removed.
    pub fn current(&self, id: &str) -> Option<[u8; 32]> {
        let mut state = self.lock();
        if let Err(e) = self.refresh(&mut state) {
            tracing::error!("tokens file: {e}; keeping the previous one");
        }
        state.hashes.get(id).copied()
    }

    /// Checks that `token` is `id`'s token, rate-limiting failures per
    /// source address and runtime: many runtimes may share one address
    /// (a NAT, a carrier-grade NAT, a balancer that hides addresses), and
    /// one of them retrying a stale token must lock out only itself.
    /// Runtime ids are public (they are host names); ids the file does
    /// not have share one limit per address, so inventing ids buys no
    /// more attempts. On success, returns the hash matched.
    pub fn verify(&self, source: IpAddr, id: &str, token: &str) -> Result<[u8; 32], Refusal> {
        let mut state = self.lock();
        let now = Instant::now();
        if let Err(e) = self.refresh(&mut state) {
            tracing::error!("tokens file: {e}; keeping the previous one");
        }
        let known = state.hashes.contains_key(id);
        let key = (source, if known { id.to_owned() } else { String::new() });
        if let Some((count, since)) = state.failures.get(&key)
            && now.duration_since(*since) < FAILURE_WINDOW
            && *count >= MAX_FAILURES
        {
            return Err(Refusal::RateLimited);
        }
        let presented: [u8; 32] = Sha256::digest(token.trim().as_bytes()).into();
        // An unknown id is compared against a dummy, so timing does not
        // tell which ids exist.
        let expected = state.hashes.get(id).copied();
        let matches = constant_time_eq(&presented, &expected.unwrap_or([0; 32]));
        if let (true, Some(hash)) = (matches, expected) {
            state.failures.remove(&key);
            return Ok(hash);
        }
        if state.failures.len() > 100_000 {
            state
                .failures
                .retain(|_, (_, since)| now.duration_since(*since) < FAILURE_WINDOW);
        }
        let entry = state.failures.entry(key).or_insert((0, now));
        if now.duration_since(entry.1) >= FAILURE_WINDOW {
            *entry = (0, now);
        }
        entry.0 += 1;
        Err(Refusal::BadCredentials)
    }
}

fn parse(text: &str) -> Result<HashMap<String, [u8; 32]>, String> {
    let raw: HashMap<String, String> = if text.trim().is_empty() {
        HashMap::new()
    } else {
        serde_saphyr::from_str(text).map_err(|e| {
            let at = e
                .location()
                .map(|l| format!("{}:{}: ", l.line(), l.column()))
                .unwrap_or_default();
            format!("{at}not a map of runtime id to token hash: {e}")
        })?
    };
    let mut out = HashMap::with_capacity(raw.len());
    for (id, hash) in raw {
        if !valid_runtime_id(&id) {
            return Err(format!(
                "runtime id `{id}` must be a DNS label: lower-case letters, digits and `-`"
            ));
        }
        let bytes = hash
            .strip_prefix("sha256:")
            .and_then(|h| hex::decode(h).ok())
            .and_then(|b| <[u8; 32]>::try_from(b).ok())
            .ok_or_else(|| {
                format!(
                    "runtime `{id}`: `{hash}` is not a token hash; make one with `portcullis hash-token`"
                )
            })?;
        if let Some(token) = placeholder_of(&bytes) {
            return Err(format!(
                "runtime `{id}`: this is the hash of `{token}`, a placeholder anyone can read in examples, so anyone could connect as `{id}` and take its traffic; {HOW_TO_MAKE_A_TOKEN}"
            ));
        }
        out.insert(id, bytes);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verifies_tokens_and_limits_failures() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens.yaml");
        std::fs::write(&path, format!("rt-a: {}\n", hash_token("secret-a"))).unwrap();
        let tokens = Tokens::load(path).unwrap();
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        let hash = tokens.verify(ip, "rt-a", "secret-a\n").unwrap();
        assert_eq!(Some(hash), tokens.current("rt-a"));
        assert_eq!(
            tokens.verify(ip, "rt-b", "secret-a"),
            Err(Refusal::BadCredentials)
        );
        for _ in 0..MAX_FAILURES {
            let _ = tokens.verify(ip, "rt-a", "wrong");
        }
        assert_eq!(
            tokens.verify(ip, "rt-a", "secret-a"),
            Err(Refusal::RateLimited)
        );
        let other: IpAddr = "192.0.2.2".parse().unwrap();
        assert!(tokens.verify(other, "rt-a", "secret-a").is_ok());
    }

    #[test]
    fn a_failing_runtime_does_not_lock_out_others_at_its_address() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tokens.yaml");
        let file = format!(
            "rt-a: {}\nrt-b: {}\n",
            hash_token("secret-a"),
            hash_token("secret-b")
        );
        std::fs::write(&path, file).unwrap();
        let tokens = Tokens::load(path).unwrap();
        let nat: IpAddr = "198.51.100.1".parse().unwrap();
        for _ in 0..MAX_FAILURES {
            assert_eq!(
                tokens.verify(nat, "rt-a", "stale"),
                Err(Refusal::BadCredentials)
            );
        }
        assert_eq!(
            tokens.verify(nat, "rt-a", "secret-a"),
            Err(Refusal::RateLimited)
        );
        // Another runtime behind the same address is not held back.
        assert!(tokens.verify(nat, "rt-b", "secret-b").is_ok());
        // Ids the file does not have share one limit per address: a new
        // made-up id per attempt gets no more tries.
        for i in 0..MAX_FAILURES {
            let _ = tokens.verify(nat, &format!("made-up-{i}"), "x");
        }
        assert_eq!(
            tokens.verify(nat, "made-up-new", "x"),
            Err(Refusal::RateLimited)
        );
        assert!(tokens.verify(nat, "rt-b", "secret-b").is_ok());
    }

    #[test]
    fn rejects_malformed_files() {
        assert!(
            parse("Runtime_A: sha256:00")
                .unwrap_err()
                .contains("DNS label")
        );
        assert!(parse("rt: md5:00").unwrap_err().contains("hash-token"));
        assert!(parse("[1, 2]").is_err());
        assert!(parse("").unwrap().is_empty());
        assert!(parse("{}").unwrap().is_empty());
    }

    #[test]
    fn refuses_the_hash_of_a_placeholder_token() {
        for token in ["change-me", "REPLACE-ME", "secret"] {
            let err = parse(&format!("rt-a: {}", hash_token(token))).unwrap_err();
            assert!(err.contains(&format!("hash of `{token}`")), "{err}");
            assert!(err.contains("runtime `rt-a`"), "{err}");
        }
        assert!(is_placeholder(" Change-Me\n"));
        assert!(!is_placeholder("3q2+7w8vLJHkL0sFQm1r"));
        assert!(parse(&format!("rt-a: {}", hash_token("3q2+7w8vLJHkL0sFQm1r"))).is_ok());
    }
}
