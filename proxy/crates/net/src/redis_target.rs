//! Where a Redis is and how to sign in to it: the URL a flag gives
//! (`redis://[USER@]HOST:PORT[/DB]`, `rediss://` for TLS), the CA that
//! signs its certificate, and the password from a file or the
//! environment, never from the command line.

use std::path::PathBuf;
use std::time::Duration;

/// How long connecting to Redis (TCP, TLS, AUTH) may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a command may wait for its answer: the registry and the rate
/// limits would rather fall back to what they know than wait.
pub const RESPONSE_TIMEOUT: Duration = Duration::from_secs(1);

/// A Redis to connect to.
#[derive(Clone)]
pub struct RedisTarget {
    /// The URL as given, without a password (a password in it is refused).
    pub url: String,
    /// PEM file of the CA that signs the server's certificate
    /// (`rediss://`); the system's roots when absent.
    pub ca: Option<PathBuf>,
    /// The password (or ACL user's password).
    pub password: Option<String>,
}

impl std::fmt::Debug for RedisTarget {
    // The password stays out of logs and debug output.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTarget")
            .field("url", &self.url)
            .field("ca", &self.ca)
            .field("password", &self.password.as_ref().map(|_| "<set>"))
            .finish()
    }
}

impl RedisTarget {
    /// Checks `url` (named `flag` in errors) and the CA and password that
    /// go with it.
    pub fn new(
        flag: &str,
        url: &str,
        ca: Option<PathBuf>,
        password: Option<String>,
    ) -> Result<RedisTarget, String> {
        let target = RedisTarget {
            url: url.to_owned(),
            ca,
            password: password.map(|p| p.trim_end_matches(['\r', '\n']).to_owned()),
        };
        let scheme = url.split_once("://").map(|(s, _)| s);
        if !matches!(scheme, Some("redis" | "rediss")) {
            return Err(format!(
                "{flag}: {url:?} is not a Redis URL: give redis://HOST:PORT[/DB] or rediss://HOST:PORT[/DB]"
            ));
        }
        if target.ca.is_some() && scheme != Some("rediss") {
            return Err(format!(
                "{flag}: a CA is for TLS: use rediss:// with it, not {url:?}"
            ));
        }
        let info = target.info(flag)?;
        if info.redis_settings().password().is_some() {
            return Err(format!(
                "{flag}: the URL holds a password, which the command line would show to anyone on the host: put it in a file (--*-password-file) or the environment"
            ));
        }
        Ok(target)
    }

    fn info(&self, flag: &str) -> Result<redis::ConnectionInfo, String> {
        use redis::IntoConnectionInfo;
        self.url
            .as_str()
            .into_connection_info()
            .map_err(|e| format!("{flag}: {:?}: {e}", self.url))
    }

    /// A client for the target: TLS with the CA when `rediss://`.
    pub fn client(&self) -> Result<redis::Client, String> {
        let mut info = self.info("redis")?;
        if let Some(password) = &self.password {
            let settings = info.redis_settings().clone().set_password(password);
            info = info.set_redis_settings(settings);
        }
        if !self.url.starts_with("rediss://") {
            return redis::Client::open(info).map_err(|e| e.to_string());
        }
        // redis-rs builds its TLS config with rustls' process default
        // provider; this tree has two, so one is named (the same as
        // every other client config here).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let root_cert = match &self.ca {
            Some(ca) => Some(
                std::fs::read(ca)
                    .map_err(|e| format!("cannot read the Redis CA {}: {e}", ca.display()))?,
            ),
            None => None,
        };
        let certs = redis::TlsCertificates {
            client_tls: None,
            root_cert,
        };
        redis::Client::build_with_tls(info, certs).map_err(|e| e.to_string())
    }

    /// The settings for a connection: bounded connect and answer times.
    pub fn connection_config() -> redis::AsyncConnectionConfig {
        redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(CONNECT_TIMEOUT))
            .set_response_timeout(Some(RESPONSE_TIMEOUT))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked() {
        assert!(RedisTarget::new("--registry", "redis://127.0.0.1:6379/2", None, None).is_ok());
        assert!(RedisTarget::new("--registry", "rediss://redis.internal:6380", None, None).is_ok());
        let no_scheme = RedisTarget::new("--registry", "127.0.0.1:6379", None, None).unwrap_err();
        assert!(no_scheme.contains("--registry") && no_scheme.contains("not a Redis URL"));
        let password =
            RedisTarget::new("--registry", "redis://u:secret@127.0.0.1:6379", None, None)
                .unwrap_err();
        assert!(password.contains("holds a password"), "{password}");
        let ca_without_tls = RedisTarget::new(
            "--registry",
            "redis://127.0.0.1:6379",
            Some("ca.pem".into()),
            None,
        )
        .unwrap_err();
        assert!(ca_without_tls.contains("rediss://"), "{ca_without_tls}");
    }

    #[test]
    fn password_is_kept_out_of_debug_output() {
        let target = RedisTarget::new(
            "--state",
            "redis://127.0.0.1:6379",
            None,
            Some("hunter2-hunter2\n".into()),
        )
        .unwrap();
        assert_eq!(target.password.as_deref(), Some("hunter2-hunter2"));
        assert!(!format!("{target:?}").contains("hunter2"));
    }
}
