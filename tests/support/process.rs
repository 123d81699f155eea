//! The `portcullis` binary as a child process, for what only a process
//! shows: signals, exit codes, memory.

use std::net::SocketAddr;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, watch};

/// The `/metrics` line counting `n` connections on `listener` that ended
/// for `reason` before any request.
pub fn connection_errors(listener: &str, reason: &str, n: u64) -> String {
    format!(r#"portcullis_connection_errors_total{{listener="{listener}",reason="{reason}"}} {n}"#)
}

/// A running `portcullis serve`.
pub struct ProxyProcess {
    /// The child; killed when dropped.
    pub child: Child,
    /// Address of the first listener, read from its "listening" log line.
    pub addr: SocketAddr,
    /// Address of the admin listener (on a free port unless `args` set one).
    pub admin: Option<SocketAddr>,
    /// Every address logged before the process was ready, by log message
    /// (`listening`, `public listening`, `tunnel listening`, ...).
    pub addrs: std::collections::HashMap<String, SocketAddr>,
    /// Every log line so far.
    pub logs: Arc<Mutex<Vec<String>>>,
    /// How many lines `logs` holds, for a wait on the next one.
    logged: watch::Receiver<usize>,
    lines: mpsc::UnboundedReceiver<String>,
    _dir: Option<tempfile::TempDir>,
}

impl ProxyProcess {
    /// Writes `yaml` as the only policy file and starts `portcullis serve`
    /// on it with `args` added, waiting (90 s at most) until it listens.
    pub async fn start(yaml: &str, args: &[&str]) -> ProxyProcess {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("policy.yaml"), yaml).expect("write policy");
        let mut proxy = Self::start_on(dir.path(), args).await;
        proxy._dir = Some(dir);
        proxy
    }

    /// Starts `portcullis serve --policies dir` with `args` added (and the
    /// admin listener on a free port unless `args` name one), waiting (90 s
    /// at most) until it listens.
    pub async fn start_on(dir: &std::path::Path, args: &[&str]) -> ProxyProcess {
        let mut all = vec![
            "serve".to_owned(),
            "--policies".to_owned(),
            dir.display().to_string(),
        ];
        all.extend(args.iter().map(|a| a.to_string()));
        Self::launch(&all, &[], "listening").await
    }

    /// Starts `portcullis` with `args` (plus the admin listener on a free
    /// port unless `args` name one) and `env`, waiting (90 s at most) for
    /// the log line whose message is `ready`.
    pub async fn launch(args: &[String], env: &[(&str, String)], ready: &str) -> ProxyProcess {
        Self::launch_confined(args, env, ready, Confine::default()).await
    }

    /// [`launch`](Self::launch), with the process confined as `confine`
    /// says.
    pub async fn launch_confined(
        args: &[String],
        env: &[(&str, String)],
        ready: &str,
        confine: Confine,
    ) -> ProxyProcess {
        let admin_args: &[&str] = if args.iter().any(|a| a == "--admin") {
            &[]
        } else {
            &["--admin", "127.0.0.1:0"]
        };
        let mut child = if confine.system_files.is_empty() {
            Command::new(super::binary())
        } else {
            // A mount namespace of its own (in a user namespace, so no
            // privilege is needed) where the test's files stand in for
            // system ones: /etc/hosts with the addresses a test picks,
            // the resolver's configuration, for the system resolver.
            let mut c = Command::new("unshare");
            c.args(["--user", "--map-root-user", "--mount", "--"]).args([
                "sh",
                "-c",
                r#"while [ "$1" != -- ]; do mount --bind "$1" "$2" || exit 1; shift 2; done; shift; exec "$@""#,
                "sh",
            ]);
            for (ours, system) in &confine.system_files {
                c.arg(ours).arg(system);
            }
            c.arg("--").arg(super::binary());
            c
        };
        child
            .args(args)
            .args(admin_args)
            // Access lines within moments, not the second a deployment
            // batches them for: tests wait for them. A test's `env` may
            // set it back.
            .env("PORTCULLIS_ACCESS_LOG_FLUSH", "10ms")
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .env("PORTCULLIS_LOG_FORMAT", "json")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if confine.address_space.is_some() || confine.cpu.is_some() {
            let limits = Confine {
                system_files: Vec::new(),
                ..confine
            };
            // SAFETY: setrlimit and sched_setaffinity are async-signal-safe,
            // and the closure owns plain values (no path to free).
            unsafe {
                child.pre_exec(move || limits.apply());
            }
        }
        let mut child = child.spawn().expect("spawn portcullis");
        let stderr = child.stderr.take().expect("stderr");
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (tx, mut rx) = mpsc::unbounded_channel();
        let (count, logged) = watch::channel(0);
        let sink = logs.clone();
        tokio::spawn(async move {
            let mut reader = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                let n = {
                    let mut logs = sink.lock().expect("log lock");
                    logs.push(line.clone());
                    logs.len()
                };
                count.send_replace(n);
                let _ = tx.send(line);
            }
        });
        let mut addrs = std::collections::HashMap::new();
        // Generous: a large plugin (CPython's 18 MB component) compiles
        // for 10 s and more in a debug build on two busy cores. A process
        // that exits ends the wait at once.
        let started = tokio::time::timeout(Duration::from_secs(90), async {
            while let Some(line) = rx.recv().await {
                let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
                    continue;
                };
                let message = v["message"].as_str().unwrap_or_default().to_owned();
                if let Some(addr) = v["addr"].as_str().and_then(|a| a.parse().ok()) {
                    addrs.entry(message.clone()).or_insert(addr);
                }
                if message == ready {
                    return Some(());
                }
            }
            None
        })
        .await
        .ok()
        .flatten();
        let admin = addrs.get("admin listening").copied();
        let addr = addrs
            .get("listening")
            .copied()
            .unwrap_or(SocketAddr::from(([0, 0, 0, 0], 0)));
        started.unwrap_or_else(|| {
            panic!(
                "portcullis did not start listening; logs: {:?}",
                logs.lock().map(|l| l.clone())
            )
        });
        ProxyProcess {
            child,
            addr,
            admin,
            addrs,
            logs,
            logged,
            lines: rx,
            _dir: None,
        }
    }

    /// Keeps `dir` (its policies, say) as long as the process.
    pub fn keep(&mut self, dir: tempfile::TempDir) {
        self._dir = Some(dir);
    }

    /// `http://addr` + `path`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// `http://admin` + `path`.
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin.expect("admin listener"), path)
    }

    /// The admin endpoint's `/status`.
    pub async fn status(&self) -> serde_json::Value {
        super::client::get(&self.admin_url("/status")).await.json()
    }

    /// Waits until `/status` satisfies `done` (20 s at most) and returns it.
    /// The admin endpoint is the reload's readiness signal.
    pub async fn wait_status(
        &self,
        what: &str,
        done: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            let status = self.status().await;
            if done(&status) {
                return status;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "status never showed {what}: {status:#}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Scrapes `/metrics` until every line of `want` is there (request
    /// counters are written when a response body is dropped, which can be
    /// just after the client has read it), failing after 10 s with the
    /// last scrape; returns that scrape.
    pub async fn metrics_showing(&self, want: &[String]) -> String {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let answer = super::client::get(&self.admin_url("/metrics")).await;
            let text = String::from_utf8_lossy(&answer.body).into_owned();
            if want.iter().all(|w| text.lines().any(|l| l == w)) {
                return text;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "metrics lack some of {want:#?}:\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id().expect("running")
    }

    /// Sends a signal by name (`TERM`, `INT`, ...).
    pub fn signal(&self, sig: &str) {
        let status = std::process::Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.pid().to_string())
            .status()
            .expect("kill");
        assert!(status.success(), "kill -{sig} failed");
    }

    /// Resident memory now (VmRSS) in KiB.
    pub fn rss_kib(&self) -> u64 {
        self.proc_status_kib("VmRSS:")
    }

    fn proc_status_kib(&self, field: &str) -> u64 {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.pid())).expect("proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("proc status field")
    }

    /// Peak resident memory (VmHWM) in KiB.
    pub fn peak_rss_kib(&self) -> u64 {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.pid())).expect("proc status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmHWM")
    }

    /// The first log line containing `needle`, waited for.
    pub async fn find_log(&self, needle: &str) -> String {
        // A line the proxy wrote may still be in the pipe or the reader
        // when what the test looked at (an answer, /status) says it was
        // written: wait for it, 20 s at most.
        let mut logged = self.logged.clone();
        let found = tokio::time::timeout(Duration::from_secs(20), async {
            loop {
                logged.borrow_and_update();
                let found = {
                    let logs = self.logs.lock().expect("log lock");
                    logs.iter().find(|l| l.contains(needle)).cloned()
                };
                if found.is_some() {
                    return found;
                }
                // A line pushed since the count was marked seen makes
                // `changed` return at once.
                if logged.changed().await.is_err() {
                    return None;
                }
            }
        })
        .await;
        found.ok().flatten().unwrap_or_else(|| {
            let logs = self.logs.lock().expect("log lock");
            panic!("no log line with `{needle}` within 20s in {logs:#?}")
        })
    }

    /// How many log lines so far contain `needle`.
    pub fn count_logs(&self, needle: &str) -> usize {
        let logs = self.logs.lock().expect("log lock");
        logs.iter().filter(|l| l.contains(needle)).count()
    }

    /// Access lines so far whose path contains `path_part`, counted by
    /// the worker that served them.
    pub fn access_per_worker(&self, path_part: &str, workers: usize) -> Vec<usize> {
        let mut per_worker = vec![0; workers];
        for line in self.logs.lock().unwrap().iter() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            if v["target"] == "access" && v["path"].as_str().is_some_and(|p| p.contains(path_part))
            {
                per_worker[v["worker"].as_u64().expect("worker in the access line") as usize] += 1;
            }
        }
        per_worker
    }

    /// The ports of the TCP sockets this process listens on, from
    /// /proc: its socket inodes matched against the kernel's tables.
    pub fn listening_tcp_ports(&self) -> Vec<u16> {
        let pid = self.pid();
        let inodes: std::collections::HashSet<String> =
            std::fs::read_dir(format!("/proc/{pid}/fd"))
                .expect("the process's descriptors")
                .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
                .filter_map(|link| {
                    let link = link.to_string_lossy().into_owned();
                    let inode = link.strip_prefix("socket:[")?.strip_suffix(']')?;
                    Some(inode.to_owned())
                })
                .collect();
        let mut ports = Vec::new();
        for table in ["tcp", "tcp6"] {
            let text = std::fs::read_to_string(format!("/proc/{pid}/net/{table}"))
                .expect("the kernel's TCP table");
            for row in text.lines().skip(1) {
                let cols: Vec<&str> = row.split_whitespace().collect();
                // local_address is cols[1] (`ADDR:PORT`, hex), st cols[3]
                // (0A: LISTEN), inode cols[9].
                if cols.len() > 9 && cols[3] == "0A" && inodes.contains(cols[9]) {
                    let port = cols[1].rsplit(':').next().expect("a port");
                    ports.push(u16::from_str_radix(port, 16).expect("a hex port"));
                }
            }
        }
        ports.sort_unstable();
        ports.dedup();
        ports
    }

    /// Waits for a log line containing `needle` (20 s at most).
    pub async fn wait_for_log(&mut self, needle: &str) -> String {
        tokio::time::timeout(Duration::from_secs(20), async {
            while let Some(line) = self.lines.recv().await {
                if line.contains(needle) {
                    return line;
                }
            }
            panic!("log ended without `{needle}`");
        })
        .await
        .unwrap_or_else(|_| panic!("no log line with `{needle}` within 20s"))
    }

    /// Waits for the process to exit (`limit` at most).
    pub async fn wait_exit(&mut self, limit: Duration) -> ExitStatus {
        tokio::time::timeout(limit, self.child.wait())
            .await
            .expect("process exits in time")
            .expect("wait")
    }
}

/// Limits a child process starts under.
#[derive(Debug, Default, Clone)]
pub struct Confine {
    /// Address space in bytes (`ulimit -v`).
    pub address_space: Option<u64>,
    /// The one CPU it may run on (`taskset -c`).
    pub cpu: Option<usize>,
    /// Files it sees in place of system ones, as (file, system path):
    /// /etc/hosts, /etc/resolv.conf, /etc/nsswitch.conf (edits to a file
    /// written in place show through).
    pub system_files: Vec<(std::path::PathBuf, &'static str)>,
}

impl Confine {
    /// Applies the limits to the calling process (in the child, before exec).
    fn apply(&self) -> std::io::Result<()> {
        if let Some(bytes) = self.address_space {
            let limit = libc::rlimit {
                rlim_cur: bytes,
                rlim_max: bytes,
            };
            // SAFETY: `limit` is a valid rlimit.
            if unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        if let Some(cpu) = self.cpu {
            pin_to_cpu(cpu)?;
        }
        Ok(())
    }
}

/// Restricts the calling thread (and what it starts later) to `cpu`.
pub fn pin_to_cpu(cpu: usize) -> std::io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is an empty set; CPU_SET writes in bounds
    // for cpu < CPU_SETSIZE, and sched_setaffinity reads the set it is given.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}
