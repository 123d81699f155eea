//! Registry credentials from a Docker config file (what a
//! `kubernetes.io/dockerconfigjson` Secret mounts as `.dockerconfigjson`)
//! and the registry's `WWW-Authenticate` challenge.

use std::path::Path;

use base64::Engine as _;
use http::HeaderValue;

/// A user name and password (or token) for one registry.
#[derive(Clone)]
pub struct Credentials {
    user: String,
    password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({}, <redacted>)", self.user)
    }
}

impl Credentials {
    /// `Authorization: Basic …`.
    pub fn basic(&self) -> HeaderValue {
        let pair = format!("{}:{}", self.user, self.password);
        let mut v = HeaderValue::try_from(format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(pair)
        ))
        .expect("base64 is a valid header value");
        v.set_sensitive(true);
        v
    }

    /// The entry for `registry` (`HOST[:PORT]`) in the Docker config file
    /// at `path`: `None` when it has none.
    pub fn from_docker_config(path: &Path, registry: &str) -> Result<Option<Credentials>, String> {
        let shown = path.display();
        let text =
            std::fs::read(path).map_err(|e| format!("cannot read pull secret {shown}: {e}"))?;
        let config: serde_json::Value = serde_json::from_slice(&text)
            .map_err(|e| format!("pull secret {shown} is not a Docker config (JSON): {e}"))?;
        let Some(auths) = config.get("auths").and_then(|a| a.as_object()) else {
            return Err(format!(
                "pull secret {shown} has no `auths` (a Docker config: {{\"auths\": {{\"HOST\": {{\"auth\": \"…\"}}}}}})"
            ));
        };
        // Keys are written `HOST[:PORT]`, `https://HOST[:PORT]` or
        // `https://HOST/v1/` by docker login and kubectl; Docker Hub's as
        // `https://index.docker.io/v1/` (or another of its names).
        let hub = crate::reference::DOCKER_HUB_NAMES;
        let entry = auths.iter().find(|(key, _)| {
            let key = key.split_once("://").map_or(key.as_str(), |(_, k)| k);
            let host = key.split('/').next().unwrap_or("");
            host == registry || (hub.contains(&registry) && hub.contains(&host))
        });
        let Some((key, entry)) = entry else {
            return Ok(None);
        };
        let field = |name: &str| {
            entry
                .get(name)
                .and_then(|v| v.as_str())
                .filter(|s| !s.is_empty())
        };
        if let Some(auth) = field("auth") {
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(auth.trim())
                .ok()
                .and_then(|d| String::from_utf8(d).ok());
            let Some((user, password)) = decoded.as_deref().and_then(|d| d.split_once(':')) else {
                return Err(format!(
                    "pull secret {shown}: the `auth` of `{key}` is not base64 of USER:PASSWORD"
                ));
            };
            return Ok(Some(Credentials {
                user: user.into(),
                password: password.into(),
            }));
        }
        match (field("username"), field("password")) {
            (Some(user), Some(password)) => Ok(Some(Credentials {
                user: user.into(),
                password: password.into(),
            })),
            _ => Err(format!(
                "pull secret {shown}: `{key}` has neither `auth` nor `username` and `password`"
            )),
        }
    }
}

/// What a registry's `WWW-Authenticate` asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Challenge {
    Basic,
    Bearer {
        realm: String,
        service: Option<String>,
        scope: Option<String>,
    },
    Other(String),
}

impl Challenge {
    /// `Basic realm="…"` or `Bearer realm="…",service="…",scope="…"`.
    pub fn parse(header: &str) -> Challenge {
        let header = header.trim();
        let (scheme, params) = header.split_once(' ').unwrap_or((header, ""));
        if scheme.eq_ignore_ascii_case("basic") {
            return Challenge::Basic;
        }
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Challenge::Other(scheme.to_owned());
        }
        let params = params_of(params);
        let get = |k: &str| {
            params
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(k))
                .map(|(_, v)| v.clone())
        };
        match get("realm") {
            Some(realm) => Challenge::Bearer {
                realm,
                service: get("service"),
                scope: get("scope"),
            },
            None => Challenge::Other("Bearer without a realm".into()),
        }
    }
}

/// `k="v",k2=v2` pairs; a quoted value may hold commas (a scope listing
/// `pull,push`).
fn params_of(text: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut rest = text.trim();
    while let Some((key, after)) = rest.split_once('=') {
        let key = key.trim().trim_start_matches(',').trim().to_owned();
        let after = after.trim_start();
        let (value, next) = match after.strip_prefix('"') {
            Some(quoted) => match quoted.find('"') {
                Some(end) => (&quoted[..end], &quoted[end + 1..]),
                None => (quoted, ""),
            },
            None => match after.find(',') {
                Some(end) => (&after[..end], &after[end..]),
                None => (after, ""),
            },
        };
        out.push((key, value.to_owned()));
        rest = next.trim_start().trim_start_matches(',');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges_parse_as_registries_send_them() {
        assert_eq!(
            Challenge::parse(r#"Basic realm="Registry Realm""#),
            Challenge::Basic
        );
        assert_eq!(
            Challenge::parse(
                r#"Bearer realm="https://auth.example/token",service="reg",scope="repository:a/b:pull,push""#
            ),
            Challenge::Bearer {
                realm: "https://auth.example/token".into(),
                service: Some("reg".into()),
                scope: Some("repository:a/b:pull,push".into()),
            }
        );
        assert_eq!(
            Challenge::parse("Negotiate"),
            Challenge::Other("Negotiate".into())
        );
    }

    #[test]
    fn docker_config_entries_are_found_by_registry() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        let auth = base64::engine::general_purpose::STANDARD.encode("ann:s3cret");
        std::fs::write(
            &path,
            format!(r#"{{"auths":{{"https://reg.example:5000":{{"auth":"{auth}"}},"other.example":{{"username":"bob","password":"pw"}}}}}}"#),
        )
        .unwrap();
        let c = Credentials::from_docker_config(&path, "reg.example:5000")
            .unwrap()
            .unwrap();
        assert_eq!(
            c.basic(),
            HeaderValue::from_str(&format!("Basic {auth}")).unwrap()
        );
        let c = Credentials::from_docker_config(&path, "other.example")
            .unwrap()
            .unwrap();
        assert_eq!(format!("{c:?}"), "Credentials(bob, <redacted>)");
        assert!(
            Credentials::from_docker_config(&path, "third.example")
                .unwrap()
                .is_none()
        );
        // Docker Hub's entry, as `docker login` writes it, for any of its
        // names.
        std::fs::write(
            &path,
            format!(r#"{{"auths":{{"https://index.docker.io/v1/":{{"auth":"{auth}"}}}}}}"#),
        )
        .unwrap();
        for name in ["docker.io", "registry-1.docker.io"] {
            let c = Credentials::from_docker_config(&path, name).unwrap();
            assert!(c.is_some(), "{name}");
        }
        assert!(
            Credentials::from_docker_config(&path, "ghcr.io")
                .unwrap()
                .is_none()
        );
        std::fs::write(&path, "{}").unwrap();
        let e = Credentials::from_docker_config(&path, "x").unwrap_err();
        assert!(e.contains("has no `auths`"), "{e}");
    }
}
