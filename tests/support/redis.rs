//! A real `redis-server` (Debian's package; the test command installs it)
//! on a loopback port, without persistence, for the shared registry and
//! rate limits.

use std::process::Stdio;

use tokio::process::{Child, Command};

/// A running `redis-server`; killed when dropped.
pub struct Redis {
    child: Option<Child>,
    pub port: u16,
    /// `redis://127.0.0.1:PORT`, or `rediss://localhost:PORT` with TLS.
    pub url: String,
    dir: tempfile::TempDir,
    /// Its TLS certificate, key and CA files and its password, when it
    /// speaks TLS and wants one.
    secure: Option<(std::path::PathBuf, String)>,
}

/// A loopback port free now (redis-server takes no port 0).
fn free_port() -> u16 {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("probe port");
    probe.local_addr().expect("probe address").port()
}

impl Redis {
    /// Starts one on a free port, returning once it accepts connections.
    pub async fn start() -> Redis {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = free_port();
        let mut redis = Redis {
            child: None,
            port,
            url: format!("redis://127.0.0.1:{port}"),
            dir,
            secure: None,
        };
        redis.restart().await;
        redis
    }

    /// Starts one that speaks only TLS (a certificate for `localhost`
    /// from `pki`) and wants `password`; its CA is at [`Redis::ca`].
    pub async fn start_tls(pki: &super::tls::TestPki, password: &str) -> Redis {
        let dir = tempfile::tempdir().expect("tempdir");
        for (file, pem) in [
            ("redis.crt", &pki.leaf_pem),
            ("redis.key", &pki.leaf_key_pem),
            ("ca.crt", &pki.ca_pem),
        ] {
            std::fs::write(dir.path().join(file), pem).expect("write a TLS file");
        }
        let port = free_port();
        let mut redis = Redis {
            child: None,
            port,
            url: format!("rediss://localhost:{port}"),
            secure: Some((dir.path().to_owned(), password.to_owned())),
            dir,
        };
        redis.restart().await;
        redis
    }

    /// The CA file of a TLS one.
    pub fn ca(&self) -> std::path::PathBuf {
        self.dir.path().join("ca.crt")
    }

    /// Starts it (again) on its port, with no data: a Redis that lost
    /// everything, as one without persistence does when it restarts.
    pub async fn restart(&mut self) {
        let mut command = Command::new(
            std::env::var("PORTCULLIS_REDIS_SERVER").unwrap_or_else(|_| "redis-server".into()),
        );
        let port = self.port.to_string();
        match &self.secure {
            None => command.args(["--port", &port]),
            Some((dir, password)) => command
                .args([
                    "--port",
                    "0",
                    "--tls-port",
                    &port,
                    "--tls-auth-clients",
                    "no",
                ])
                .arg("--tls-cert-file")
                .arg(dir.join("redis.crt"))
                .arg("--tls-key-file")
                .arg(dir.join("redis.key"))
                .arg("--tls-ca-cert-file")
                .arg(dir.join("ca.crt"))
                .args(["--requirepass", password]),
        };
        let mut child = command
            .args(["--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--loglevel", "notice"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("redis-server (Debian's redis-server package; tests/run.sh installs it)");
        let stdout = child.stdout.take().expect("stdout");
        super::wait_ready(
            stdout,
            "Ready to accept connections",
            &format!("redis-server on port {}", self.port),
        )
        .await;
        self.child = Some(child);
    }

    /// Kills it (SIGKILL) and waits for it to be gone.
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill().await;
        }
    }

    /// A connection for the test's own commands.
    pub async fn connection(&self) -> redis::aio::MultiplexedConnection {
        redis::Client::open(self.url.as_str())
            .expect("a Redis URL")
            .get_multiplexed_async_connection()
            .await
            .expect("connect to the test's redis-server")
    }

    /// The runtimes each tunnel server holds, as the registry records
    /// them: `(runtime, server instance)` fields, sorted.
    pub async fn holders(&self) -> Vec<(String, String)> {
        let mut conn = self.connection().await;
        let fields: Vec<String> = redis::cmd("HKEYS")
            .arg("{portcullis-tunnels}:holders")
            .query_async(&mut conn)
            .await
            .expect("HKEYS");
        let mut out: Vec<(String, String)> = fields
            .iter()
            .filter_map(|f| f.split_once('\n'))
            .map(|(r, s)| (r.to_owned(), s.to_owned()))
            .collect();
        out.sort();
        out
    }
}
