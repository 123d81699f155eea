//! Logs never stall traffic: run as `serve > fifo 2>&1` with a reader
//! that never reads, one warning per request (an upstream that refuses)
//! used to block a worker for good once the pipe filled, while `/healthz`
//! and `/readyz` stayed 200; on `tunnel-server`, refused tunnel
//! connections did the same. A worker that something does block is not
//! ready.

use std::os::unix::fs::OpenOptionsExt;
use std::process::Stdio;

use super::*;
use crate::support::{closed_port, reserved_port};

/// A `portcullis` process whose stdout and stderr go into a FIFO that is
/// open for reading and never read, as `serve > fifo 2>&1` with a stuck
/// reader; it listens on the ports the test gave it.
struct Stuck {
    _child: tokio::process::Child,
    _reader: std::fs::File,
    _dir: tempfile::TempDir,
    admin: String,
}

impl Stuck {
    async fn launch(args: &[String], dir: tempfile::TempDir, admin: u16) -> Stuck {
        let fifo = dir.path().join("log.fifo");
        let path = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid path; mkfifo only creates the file.
        assert_eq!(unsafe { libc::mkfifo(path.as_ptr(), 0o600) }, 0);
        let reader = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&fifo)
            .unwrap();
        let writer = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
        let child = tokio::process::Command::new(crate::support::binary())
            .args(args)
            .args(["--admin", &format!("127.0.0.1:{admin}")])
            .env("PORTCULLIS_LOG_FORMAT", "json")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(writer.try_clone().unwrap())
            .stderr(writer)
            .kill_on_drop(true)
            .spawn()
            .expect("spawn portcullis");
        let stuck = Stuck {
            _child: child,
            _reader: reader,
            _dir: dir,
            admin: format!("http://127.0.0.1:{admin}"),
        };
        // The admin listener answering is the start's signal (its log
        // lines go nowhere anyone reads).
        eventually(
            "the admin listener answers",
            Duration::from_secs(60),
            || async {
                let url = format!("{}/healthz", stuck.admin);
                let req = Request::get(url).body(body(Bytes::new())).unwrap();
                let asked = client::http1().request(req);
                let answer = tokio::time::timeout(Duration::from_secs(1), asked).await;
                answer.is_ok_and(|a| a.is_ok_and(|a| a.status() == 200))
            },
        )
        .await;
        stuck
    }

    /// Whether `/readyz` answers 200, and the event-log lines dropped.
    async fn ready_and_dropped(&self) -> (bool, u64) {
        let ready = client::get(&format!("{}/readyz", self.admin)).await.status == 200;
        let metrics = client::get(&format!("{}/metrics", self.admin)).await;
        let metrics = String::from_utf8_lossy(&metrics.body).into_owned();
        let dropped = metrics
            .lines()
            .find_map(|l| l.strip_prefix("portcullis_log_lines_dropped_total "))
            .map_or(0, |v| v.parse().unwrap());
        (ready, dropped)
    }
}

/// Twelve thousand requests, each warning of an upstream that refuses
/// (more lines than the pipe and the event log's backlog hold): all are
/// answered (502) though nobody reads the log, the lines that did not
/// fit are counted as dropped, and the proxy stays ready.
#[tokio::test]
async fn a_stderr_nobody_reads_drops_lines_and_never_stalls_requests() {
    let (port, _held) = reserved_port();
    let (admin, _admin_held) = reserved_port();
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:{port}" }}]
upstreams: [{{ name: gone, endpoints: ["http://127.0.0.1:{}"] }}]
routes: [{{ name: refused, match: {{ path: /refused }}, upstream: gone }}]
"#,
            closed_port()
        ),
        &[],
    );
    let args = ["serve", "--policies", &dir.path().display().to_string()].map(str::to_owned);
    let proxy = Stuck::launch(&args, dir, admin).await;
    let url = format!("http://127.0.0.1:{port}/refused");
    let senders: Vec<_> = (0..8)
        .map(|t| {
            let url = url.clone();
            tokio::spawn(async move {
                for i in 0..1_500 {
                    let asked = client::get(&url);
                    let answer = tokio::time::timeout(Duration::from_secs(10), asked)
                        .await
                        .unwrap_or_else(|_| {
                            panic!("request {t}/{i} never answered: a worker stalled")
                        });
                    assert_eq!(answer.status, 502, "request {t}/{i}");
                }
            })
        })
        .collect();
    for s in senders {
        s.await.unwrap();
    }
    let (ready, dropped) = proxy.ready_and_dropped().await;
    assert!(ready, "a proxy that serves is ready");
    assert!(
        dropped > 0,
        "12,000 warnings cannot all wait for a pipe nobody reads"
    );
}

/// The tunnel server, with garbage on its tunnel port (12,000 connections,
/// each refused with a warning): its public side still answers.
#[tokio::test]
async fn a_tunnel_server_with_a_stderr_nobody_reads_keeps_serving() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (public, _p) = reserved_port();
    let (tunnel, _t) = reserved_port();
    let (admin, _a) = reserved_port();
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens.yaml");
    std::fs::write(&tokens, "").unwrap();
    let args = [
        "tunnel-server",
        "--public",
        &format!("127.0.0.1:{public}"),
        "--tunnel-listen",
        &format!("127.0.0.1:{tunnel}"),
        "--domain",
        "tunnel.test",
        "--tokens",
        &tokens.display().to_string(),
    ]
    .map(str::to_owned);
    let server = Stuck::launch(&args, dir, admin).await;
    let garbage: Vec<_> = (0..8)
        .map(|_| {
            tokio::spawn(async move {
                for i in 0..1_500 {
                    let refused = async {
                        let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", tunnel))
                            .await
                            .unwrap();
                        let garbage = b"garbage, not a tunnel handshake\r\n\r\n";
                        let _ = conn.write_all(garbage).await;
                        let mut rest = Vec::new();
                        let _ = conn.read_to_end(&mut rest).await;
                    };
                    tokio::time::timeout(Duration::from_secs(10), refused)
                        .await
                        .unwrap_or_else(|_| panic!("garbage {i} never refused: a worker stalled"));
                }
            })
        })
        .collect();
    for g in garbage {
        g.await.unwrap();
    }
    for i in 0..200 {
        let req = Request::get(format!("http://127.0.0.1:{public}/"))
            .header("host", "nobody.tunnel.test")
            .body(body(Bytes::new()))
            .unwrap();
        let answer =
            tokio::time::timeout(Duration::from_secs(10), client::send(&client::http1(), req))
                .await
                .unwrap_or_else(|_| panic!("public request {i} was never answered"));
        assert_eq!(answer.status, 502, "public request {i}: {:?}", answer.body);
        assert_eq!(answer.json()["error"], "unknown runtime");
    }
    let (ready, dropped) = server.ready_and_dropped().await;
    assert!(ready);
    assert!(dropped > 0);
}

/// A worker that something blocks (here a task that sleeps on its thread)
/// stops beating: `/readyz` turns 503 within seconds, and 200 again once
/// the worker is free.
#[tokio::test]
async fn a_blocked_worker_is_not_ready() {
    let config = portcullis::config::load_sources(
        &[portcullis::config::Source {
            name: "policy.yaml".into(),
            text: r#"listeners: [{ name: http, bind: "127.0.0.1:0" }]
routes: [{ name: ok, match: { path: /ok }, respond: { status: 200 } }]"#
                .into(),
        }],
        &|_| None,
    )
    .unwrap();
    let server = portcullis::server::Server::bind(config, 2).await.unwrap();
    let control = server.control().clone();
    let shared = server.shared().clone();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(server.run(
        async {
            let _ = stopped.await;
        },
        portcullis::server::Drain {
            delay: Duration::ZERO,
            grace: Duration::from_secs(1),
        },
    ));
    eventually("ready", Duration::from_secs(10), || async {
        shared.is_ready()
    })
    .await;
    control.spawn_on_worker(1, |_| {
        Box::pin(async {
            // Blocks the worker's thread, as a write to a full pipe would.
            std::thread::sleep(Duration::from_secs(8));
        })
    });
    eventually(
        "the blocked worker shows",
        Duration::from_secs(15),
        || async { !shared.is_ready() },
    )
    .await;
    assert_eq!(shared.heartbeats.stalled(), [1]);
    eventually(
        "ready again once the worker is free",
        Duration::from_secs(15),
        || async { shared.is_ready() },
    )
    .await;
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(10), running).await;
}
