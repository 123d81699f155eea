//! Who may use an admin listener, beyond reaching its port: it answers
//! only requests addressed to an IP address or `localhost` (a DNS name
//! could be a web page's own, rebound to this address), refuses
//! cross-site requests to what changes state (a page in an operator's
//! browser could otherwise `POST /reload`), and with a token file
//! (`--admin-token-file`) wants `Authorization: Bearer TOKEN` for
//! `/status` (which shows the configuration) and `/reload`. The token is
//! read at the start and again when its file changes; a file that can no
//! longer be read leaves the last good token in force, and never touches
//! the endpoints the token does not guard.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use http::{HeaderMap, Method, StatusCode, header};
use sha2::{Digest, Sha256};

use crate::admin_answer::{Answer, json};

/// The endpoints the token guards; `/metrics`, `/readyz` and the static
/// status page stay open to the scraper and the kubelet.
const GUARDED: [&str; 2] = ["/status", "/reload"];

/// Shorter tokens could be guessed.
const MIN_TOKEN_LEN: usize = 16;

/// An admin listener's access rules.
#[derive(Debug, Clone, Default)]
pub struct AdminAccess {
    /// The bearer token (a mounted Secret), read at the start and again
    /// whenever its file changes, so a rotated Secret takes effect at once.
    token: Option<Arc<TokenFile>>,
}

/// The token file and the last good token read from it.
#[derive(Debug)]
struct TokenFile {
    path: PathBuf,
    state: Mutex<Token>,
}

#[derive(Debug)]
struct Token {
    /// The last token read that was good.
    token: String,
    /// What the file was when last read (good or not), to tell a change.
    seen: Option<Stamp>,
}

/// A file's identity and version, as `stat` tells them.
type Stamp = (u64, u64, i64, i64, u64);

fn stamp(path: &Path) -> Option<Stamp> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.dev(), m.ino(), m.mtime(), m.mtime_nsec(), m.size()))
}

impl TokenFile {
    /// The token: the file read again if it changed since; if that read
    /// fails (the file went, or is short, oversized, not a regular file),
    /// the last good token, with the failure logged once per change.
    fn current(&self) -> String {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let now = stamp(&self.path);
        if now != state.seen {
            state.seen = now;
            match read_token(&self.path) {
                Ok(token) => state.token = token,
                Err(e) => {
                    tracing::warn!("admin token: {e}; keeping the token read before");
                }
            }
        }
        state.token.clone()
    }
}

impl AdminAccess {
    /// No token: the host and cross-site rules only.
    pub fn open() -> AdminAccess {
        AdminAccess::default()
    }

    /// With the bearer token in `file`; the file is read now, so a missing
    /// or too short token stops the start.
    pub fn with_token_file(file: PathBuf) -> Result<AdminAccess, String> {
        let seen = stamp(&file);
        let token = read_token(&file)?;
        Ok(AdminAccess {
            token: Some(Arc::new(TokenFile {
                path: file,
                state: Mutex::new(Token { token, seen }),
            })),
        })
    }

    /// Whether a token guards `/status` and `/reload`.
    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    /// `Ok` when the request may go on; otherwise the answer refusing it.
    pub fn check(
        &self,
        method: &Method,
        path: &str,
        headers: &HeaderMap,
    ) -> Result<(), Box<Answer>> {
        let token_ok = match &self.token {
            // Only read when a request presents one: `/metrics` and the
            // probes never wait on the file.
            Some(file) if headers.contains_key(header::AUTHORIZATION) => {
                bearer_matches(headers, &file.current())
            }
            _ => false,
        };
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or("");
        if !token_ok && !host.is_empty() && !addressed_by_ip_or_localhost(host) {
            return Err(refuse(
                StatusCode::FORBIDDEN,
                &format!(
                    "the admin listener answers requests addressed to an IP address or localhost, not `{host}`: a name could be a web page's own, pointed here (DNS rebinding); with --admin-token-file, requests carrying the token may use any name"
                ),
            ));
        }
        if !matches!(*method, Method::GET | Method::HEAD) && cross_site(headers, host) {
            return Err(refuse(
                StatusCode::FORBIDDEN,
                "cross-site requests cannot change the admin listener's state (Origin or Sec-Fetch-Site says this came from another site's page)",
            ));
        }
        if self.token.is_some() && !token_ok && GUARDED.contains(&path) {
            let mut answer = refuse(
                StatusCode::UNAUTHORIZED,
                &format!("{path} needs the admin token: `Authorization: Bearer TOKEN`"),
            );
            answer.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer realm=\"portcullis admin\""),
            );
            return Err(answer);
        }
        Ok(())
    }
}

fn refuse(status: StatusCode, why: &str) -> Box<Answer> {
    Box::new(json(status, serde_json::json!({ "error": why })))
}

fn read_token(file: &Path) -> Result<String, String> {
    let text = portcullis_net::files::read_bounded_text(file, 64 << 10)
        .map_err(|e| format!("--admin-token-file {}: {e}", file.display()))?;
    let token = text.trim();
    if token.len() < MIN_TOKEN_LEN {
        return Err(format!(
            "--admin-token-file {}: the token is {} characters; use at least {MIN_TOKEN_LEN} random ones (`head -c 32 /dev/urandom | base64`)",
            file.display(),
            token.len()
        ));
    }
    Ok(token.to_owned())
}

/// Compares digests in constant time, so the time taken tells nothing of
/// how much of the token was right.
fn bearer_matches(headers: &HeaderMap, token: &str) -> bool {
    let Some(presented) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
    else {
        return false;
    };
    use subtle::ConstantTimeEq;
    let a: [u8; 32] = Sha256::digest(presented.trim().as_bytes()).into();
    let b: [u8; 32] = Sha256::digest(token.as_bytes()).into();
    a.ct_eq(&b).into()
}

/// `host[:port]` naming an IP address or `localhost`.
fn addressed_by_ip_or_localhost(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        // An IPv6 literal: [addr] or [addr]:port.
        return rest
            .split_once(']')
            .is_some_and(|(addr, _)| addr.parse::<std::net::Ipv6Addr>().is_ok());
    } else {
        host.rsplit_once(':').map_or(host, |(name, _)| name)
    };
    let name = name.strip_suffix('.').unwrap_or(name);
    name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::Ipv4Addr>().is_ok()
}

/// Whether a browser says the request came from another site's page.
fn cross_site(headers: &HeaderMap, host: &str) -> bool {
    if let Some(site) = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok())
        && matches!(site, "cross-site" | "same-site")
    {
        return true;
    }
    match headers
        .get(header::ORIGIN)
        .map(|v| v.to_str().unwrap_or("null"))
    {
        None => false,
        // `Origin: scheme://host[:port]` must name this listener as the
        // request's Host does; `null` (a sandboxed or file page) never does.
        Some(origin) => origin
            .split_once("://")
            .is_none_or(|(_, authority)| !authority.eq_ignore_ascii_case(host)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    #[test]
    fn names_cross_site_pages_and_a_token_are_told_apart() {
        let open = AdminAccess::open();
        let get = |h: &[(&str, &str)]| open.check(&Method::GET, "/status", &headers(h));
        let post = |h: &[(&str, &str)]| open.check(&Method::POST, "/reload", &headers(h));
        for host in [
            "127.0.0.1:9901",
            "localhost:9901",
            "[::1]:9901",
            "10.1.2.3",
            "LOCALHOST.",
        ] {
            assert!(get(&[("host", host)]).is_ok(), "{host}");
            assert!(post(&[("host", host)]).is_ok(), "{host}");
        }
        for host in ["evil.example:9901", "127.0.0.1.evil.example", "[evil]:80"] {
            let refused = get(&[("host", host)]).unwrap_err();
            assert_eq!(refused.status(), StatusCode::FORBIDDEN, "{host}");
        }
        // Same origin passes; another site's page does not.
        let h = "127.0.0.1:9901";
        assert!(post(&[("host", h), ("origin", "http://127.0.0.1:9901")]).is_ok());
        assert!(post(&[("host", h), ("sec-fetch-site", "same-origin")]).is_ok());
        for refused in [
            post(&[("host", h), ("origin", "https://evil.example")]),
            post(&[("host", h), ("origin", "null")]),
            post(&[("host", h), ("sec-fetch-site", "cross-site")]),
        ] {
            assert_eq!(refused.unwrap_err().status(), StatusCode::FORBIDDEN);
        }
        // Reading is not changing: a GET with a foreign Origin is left to
        // the browser's CORS, which this listener never opens.
        assert!(get(&[("host", h), ("origin", "https://evil.example")]).is_ok());

        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "short").unwrap();
        assert!(AdminAccess::with_token_file(file.clone()).is_err());
        std::fs::write(&file, "0123456789abcdef-token\n").unwrap();
        let guarded = AdminAccess::with_token_file(file).unwrap();
        let check = |path, h: &[(&str, &str)]| guarded.check(&Method::GET, path, &headers(h));
        let without = check("/status", &[("host", h)]).unwrap_err();
        assert_eq!(without.status(), StatusCode::UNAUTHORIZED);
        assert!(without.headers().contains_key(header::WWW_AUTHENTICATE));
        let wrong = [
            ("host", h),
            ("authorization", "Bearer 0123456789abcdef-tokeN"),
        ];
        assert_eq!(
            check("/status", &wrong).unwrap_err().status(),
            StatusCode::UNAUTHORIZED
        );
        let right = [
            ("host", "admin.internal"),
            ("authorization", "Bearer 0123456789abcdef-token"),
        ];
        assert!(check("/status", &right).is_ok());
        assert!(check("/metrics", &[("host", h)]).is_ok());
    }

    #[test]
    fn a_token_file_that_turns_bad_leaves_the_last_good_token() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("token");
        std::fs::write(&file, "first-token-0123456789\n").unwrap();
        let access = AdminAccess::with_token_file(file.clone()).unwrap();
        let status = |token: &str| {
            let bearer = format!("Bearer {token}");
            let h = headers(&[("host", "127.0.0.1"), ("authorization", &bearer)]);
            access.check(&Method::GET, "/status", &h).is_ok()
        };
        let open = |path| {
            let h = headers(&[("host", "127.0.0.1")]);
            access.check(&Method::GET, path, &h).is_ok()
        };
        assert!(status("first-token-0123456789"));
        // Rotated: the new token at once, the old one no more.
        std::fs::write(&file, "second-token-0123456789-x\n").unwrap();
        assert!(status("second-token-0123456789-x"));
        assert!(!status("first-token-0123456789"));
        // Gone, short, too large, a FIFO: the last good token stands, and
        // the open endpoints stay open.
        let fifo = std::ffi::CString::new(file.as_os_str().as_encoded_bytes()).unwrap();
        let bad: [&dyn Fn(); 4] = [
            &|| std::fs::remove_file(&file).unwrap(),
            &|| std::fs::write(&file, "short").unwrap(),
            &|| std::fs::write(&file, vec![b'a'; 128 << 10]).unwrap(),
            &|| {
                std::fs::remove_file(&file).unwrap();
                assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
            },
        ];
        for (i, turn_bad) in bad.iter().enumerate() {
            turn_bad();
            assert!(status("second-token-0123456789-x"), "case {i}");
            assert!(!status("short"), "case {i}");
            for path in ["/metrics", "/readyz", "/healthz"] {
                assert!(open(path), "case {i}: {path}");
            }
        }
        std::fs::remove_file(&file).unwrap();
        std::fs::write(&file, "third-token-0123456789-xy\n").unwrap();
        assert!(status("third-token-0123456789-xy"));
    }
}
