//! `serve`'s flags for the state store replicas share (`--state`): shared
//! rate limits.

use std::path::PathBuf;

use portcullis_net::redis_target::RedisTarget;

/// The flags as given.
#[derive(Debug, clap::Args)]
pub struct StateFlags {
    /// Redis that replicas share state in: routes' `rate_limit` with
    /// `shared: true` are counted there across replicas, and proxy-wasm
    /// filters' Redis calls (Higress's) go there.
    /// `redis://[USER@]HOST:PORT[/DB]`, or `rediss://` for TLS; the
    /// password comes from --state-password-file or
    /// PORTCULLIS_STATE_PASSWORD, never from the URL.
    #[arg(long, value_name = "URL", env = "PORTCULLIS_STATE")]
    pub state: Option<String>,
    /// The CA (PEM) that signs the state store's certificate (rediss://);
    /// default: the system's roots.
    #[arg(
        long,
        value_name = "FILE",
        env = "PORTCULLIS_STATE_CA",
        requires = "state"
    )]
    pub state_ca: Option<PathBuf>,
    /// File holding the state store's password (a mounted Secret).
    #[arg(
        long,
        value_name = "FILE",
        env = "PORTCULLIS_STATE_PASSWORD_FILE",
        requires = "state"
    )]
    pub state_password_file: Option<PathBuf>,
}

impl StateFlags {
    /// The store, `None` without `--state`; an error names the flag.
    pub fn target(self) -> Result<Option<RedisTarget>, String> {
        let Some(url) = self.state else {
            return Ok(None);
        };
        let password = crate::peer_flags::secret(
            self.state_password_file,
            "PORTCULLIS_STATE_PASSWORD",
            "state store password",
        )?;
        RedisTarget::new("--state", &url, self.state_ca, password).map(Some)
    }
}
