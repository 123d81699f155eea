//! Test harness: real upstream servers, a real HTTP client, and the proxy
//! started in-process or as the `portcullis` binary.

#![allow(dead_code)]

pub mod aioquic;
pub mod browser;
pub mod client;
pub mod configmap;
pub mod envoy;
pub mod nginx;
pub mod process;
pub mod redis;
pub mod registry;
pub mod tls;
pub mod token_service;
pub mod upstream;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use portcullis::config::{self, Source};
use portcullis::server::Server;
use tokio::sync::oneshot;

/// An in-process proxy; shuts down when dropped.
pub struct Proxy {
    /// Address of the first listener.
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    done: Option<tokio::task::JoinHandle<()>>,
    /// Kept so files referenced by the policies stay on disk.
    pub dir: Option<tempfile::TempDir>,
}

impl Proxy {
    /// Starts the proxy on these policy sources with this environment.
    pub async fn start_sources(sources: Vec<Source>, env: HashMap<String, String>) -> Proxy {
        let config = config::load_sources(&sources, &|n| env.get(n).cloned())
            .unwrap_or_else(|e| panic!("test policies are invalid:\n{e}"));
        Self::start_config(config, None).await
    }

    /// Starts the proxy on one YAML policy text.
    pub async fn start_yaml(yaml: &str) -> Proxy {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("policy.yaml"), yaml).expect("write policy");
        let config =
            config::load_dir(dir.path()).unwrap_or_else(|e| panic!("test policy is invalid:\n{e}"));
        Self::start_config(config, Some(dir)).await
    }

    /// The built-in default policies, with the environment pointing the
    /// upstreams at test servers and the listener at a free port.
    pub async fn start_default(env: &[(&str, String)]) -> Proxy {
        let mut vars: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        vars.entry("PORTCULLIS_LISTEN".into())
            .or_insert_with(|| "127.0.0.1:0".into());
        Self::start_sources(config::default_sources(), vars).await
    }

    /// Starts the proxy on the policy directory `dir` (kept alive with the
    /// proxy) with `${ENV}` looked up in `env`.
    pub async fn start_dir(dir: tempfile::TempDir, env: &[(&str, String)]) -> Proxy {
        let vars: HashMap<String, String> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect();
        let config = config::load_dir_with_env(dir.path(), &|n| vars.get(n).cloned())
            .unwrap_or_else(|e| panic!("test policies are invalid:\n{e}"));
        Self::start_config(config, Some(dir)).await
    }

    /// Starts the proxy on an already loaded config.
    pub async fn start_config_for_test(config: config::Config) -> Proxy {
        Self::start_config(config, None).await
    }

    async fn start_config(config: config::Config, dir: Option<tempfile::TempDir>) -> Proxy {
        // Two workers, so tests cover requests spread over threads.
        let server = Server::bind(config, 2).await.expect("bind");
        let addr = server.local_addrs()[0].1;
        let (tx, rx) = oneshot::channel();
        let drain = portcullis::server::Drain {
            delay: Duration::ZERO,
            grace: Duration::from_secs(5),
        };
        let done = tokio::spawn(async move {
            let _ = server
                .run(
                    async {
                        let _ = rx.await;
                    },
                    drain,
                )
                .await;
        });
        Proxy {
            addr,
            stop: Some(tx),
            done: Some(done),
            dir,
        }
    }

    /// `http://addr` + `path`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Stops the proxy and waits for its drain.
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(done) = self.done.take() {
            let _ = tokio::time::timeout(Duration::from_secs(10), done).await;
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

/// Runs `portcullis check --policies dir`: whether it passed, its stdout
/// and its stderr.
pub fn check(dir: &std::path::Path) -> (bool, String, String) {
    check_with(dir, &[])
}

/// [`check`] with `extra` arguments.
pub fn check_with(dir: &std::path::Path, extra: &[&std::ffi::OsStr]) -> (bool, String, String) {
    let out = std::process::Command::new(binary())
        .arg("check")
        .arg("--policies")
        .arg(dir)
        .args(extra)
        .output()
        .expect("run check");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Checks `yaml` (a policy file alone) with `portcullis check`, which
/// must fail with, for each `(line, message)`, an error on that line of
/// policy.yaml containing the message.
pub fn assert_check_errors(yaml: &str, expected: &[(usize, &str)]) {
    let dir = policy_dir(yaml, &[]);
    let (ok, _, stderr) = check(dir.path());
    assert!(!ok, "{stderr}");
    for (line, message) in expected {
        let at = format!("policy.yaml:{line}:");
        assert!(
            stderr
                .lines()
                .any(|l| l.contains(&at) && l.contains(message)),
            "line {line}, {message}: {stderr}"
        );
    }
}

/// A loopback port nothing listens on, held until the guard is dropped:
/// bound (with `SO_REUSEADDR`, as tokio binds listeners) and never
/// listening, so connections to it are refused, the kernel gives it to
/// no outgoing connection as its local port, and a server started on it
/// later binds and listens beside the guard. A port only released can be
/// taken in between by any connection the other tests make.
pub fn reserved_port() -> (u16, socket2::Socket) {
    bound_port(true)
}

/// A loopback socket bound to a port of the kernel's choosing, never
/// listening; with `SO_REUSEADDR` when `reuse` (a server may then listen
/// on the port beside it).
fn bound_port(reuse: bool) -> (u16, socket2::Socket) {
    let socket =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    socket.set_reuse_address(reuse).expect("SO_REUSEADDR");
    let any = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
    socket.bind(&any.into()).expect("bind");
    let port = socket
        .local_addr()
        .expect("addr")
        .as_socket()
        .expect("an IP address")
        .port();
    (port, socket)
}

/// A loopback port with nothing listening on it, for as long as the tests
/// run: bound (without `SO_REUSEADDR`) and never listening, so connections
/// to it are refused and no other socket takes it. A port only bound and
/// released, as this was, went to another test's server or connection now
/// and then, and a request meant to find nothing got that server's 404.
pub fn closed_port() -> u16 {
    let (port, socket) = bound_port(false);
    // Held until the test process ends.
    std::mem::forget(socket);
    port
}

/// A built plugin component (plugins/build.sh puts them in plugins/dist).
pub fn plugin_file(name: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../plugins/dist")
        .join(format!("{name}.wasm"));
    assert!(
        path.exists(),
        "{} is missing: run plugins/build.sh (tests/run.sh does)",
        path.display()
    );
    path
}

/// A temporary policy directory holding `yaml` as policy.yaml and copies
/// of the named plugins.
pub fn policy_dir(yaml: &str, plugins: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("policy.yaml"), yaml).expect("write policy");
    for p in plugins {
        std::fs::copy(plugin_file(p), dir.path().join(format!("{p}.wasm"))).expect("copy plugin");
    }
    dir
}

/// Path of the built `portcullis` binary.
pub fn binary() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_portcullis"))
}

/// Reads `out`, a server's log, until a line holds `ready` (20 s at
/// most), failing with what it printed when it ends or stalls first; the
/// log goes on being read after, so the server never blocks on a full
/// pipe. `what` names the server in the failure.
pub async fn wait_ready<R>(out: R, ready: &str, what: &str)
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
{
    use tokio::io::AsyncBufReadExt;
    let mut lines = tokio::io::BufReader::new(out).lines();
    let seen = tokio::time::timeout(std::time::Duration::from_secs(20), async {
        let mut seen = Vec::new();
        while let Ok(Some(line)) = lines.next_line().await {
            if line.contains(ready) {
                return Ok(());
            }
            seen.push(line);
        }
        Err(seen)
    })
    .await;
    match seen {
        Ok(Ok(())) => {}
        Ok(Err(seen)) => panic!("{what} exited: {seen:#?}"),
        Err(_) => panic!("{what} not ready within 20s"),
    }
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
}

/// What tests/run.sh installs under the target directory (`relative` in
/// `$CARGO_TARGET_DIR`, or `$env` when set), failing with how to get it.
pub fn installed(env: &str, relative: &str, how: &str) -> PathBuf {
    if let Some(path) = std::env::var_os(env) {
        return PathBuf::from(path);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(
        || PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"),
        PathBuf::from,
    );
    let path = target.join(relative);
    assert!(
        path.exists(),
        "{} is missing: tests/run.sh installs it ({how})",
        path.display()
    );
    path
}
