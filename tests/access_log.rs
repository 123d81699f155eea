//! The access log as a deployment runs it: lines batched per worker and
//! written by one thread, none lost across SIGTERM, none broken under
//! concurrency, and a log destination that blocks never stalls requests.

use std::collections::HashSet;
use std::process::Stdio;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::Request;

use crate::support::process::ProxyProcess;
use crate::support::{binary, client, reserved_port};

const POLICY: &str = r#"
listeners: [{ name: http, bind: "127.0.0.1:0" }]
routes: [{ name: ok, match: { path_prefix: /ok }, respond: { status: 200, body: ok } }]
"#;

/// The deployment's flush interval, not the test harness's.
fn deployed() -> Vec<(&'static str, String)> {
    vec![("PORTCULLIS_ACCESS_LOG_FLUSH", "1s".to_owned())]
}

/// Sends requests to `addr` on one keep-alive connection after another,
/// paths `/ok/<task>/<n><pad>`, until the proxy stops taking them (or
/// `limit` are answered); every path answered 200 goes into `answered`.
async fn keep_asking(
    addr: std::net::SocketAddr,
    task: usize,
    pad: Arc<str>,
    limit: usize,
    answered: Arc<Mutex<HashSet<String>>>,
    count: Arc<AtomicUsize>,
) {
    let mut n = 0;
    'connections: while n < limit {
        let Ok(tcp) = tokio::net::TcpStream::connect(addr).await else {
            return;
        };
        let Ok((mut send, conn)) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp)).await
        else {
            return;
        };
        tokio::spawn(conn);
        while n < limit {
            let path = format!("/ok/{task}/{n}{}", &*pad);
            n += 1;
            let req = Request::get(&path)
                .header("host", "test")
                .body(Empty::<Bytes>::new())
                .expect("request");
            if send.ready().await.is_err() {
                continue 'connections;
            }
            let Ok(resp) = send.send_request(req).await else {
                continue 'connections;
            };
            let ok = resp.status() == 200;
            let Ok(body) = resp.into_body().collect().await else {
                continue 'connections;
            };
            if ok && body.to_bytes() == "ok" {
                answered.lock().unwrap().insert(path);
                count.fetch_add(1, Ordering::SeqCst);
            }
        }
    }
}

/// Eight clients of [`keep_asking`] at once, and what they count.
struct Load {
    answered: Arc<Mutex<HashSet<String>>>,
    count: Arc<AtomicUsize>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

fn load(addr: std::net::SocketAddr, pad: Arc<str>, limit: usize) -> Load {
    let answered = Arc::new(Mutex::new(HashSet::new()));
    let count = Arc::new(AtomicUsize::new(0));
    let tasks = (0..8)
        .map(|task| {
            let (answered, count) = (answered.clone(), count.clone());
            tokio::spawn(keep_asking(addr, task, pad.clone(), limit, answered, count))
        })
        .collect();
    Load {
        answered,
        count,
        tasks,
    }
}

/// The paths of access lines in `text`, each line parsed as JSON (a
/// line that does not parse fails the test).
fn logged_paths<'a>(lines: impl Iterator<Item = &'a str>) -> Vec<String> {
    lines
        .filter(|l| !l.is_empty())
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .unwrap_or_else(|e| panic!("a broken log line ({e}): {l:?}"))
        })
        .filter(|v| v["target"] == "access")
        .map(|v| v["path"].as_str().expect("path").to_owned())
        .collect()
}

#[tokio::test]
async fn sigterm_under_load_loses_no_access_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policy.yaml"), POLICY).unwrap();
    let file = dir.path().join("access.log");
    let args: Vec<String> = [
        "serve",
        "--policies",
        &dir.path().display().to_string(),
        "--access-log",
        &file.display().to_string(),
    ]
    .map(String::from)
    .to_vec();
    let mut proxy = ProxyProcess::launch(&args, &deployed(), "listening").await;

    let Load {
        answered,
        count,
        tasks,
    } = load(proxy.addr, "".into(), usize::MAX);
    // Well into the load, with lines in every worker's buffer.
    tokio::time::timeout(Duration::from_secs(60), async {
        while count.load(Ordering::SeqCst) < 600 {
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("600 requests answered within 60 s");
    proxy.signal("TERM");
    for task in tasks {
        tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("the load ends once the proxy stops")
            .unwrap();
    }
    let status = proxy.wait_exit(Duration::from_secs(30)).await;
    assert!(status.success(), "{status:?}");

    let text = std::fs::read_to_string(&file).expect("the access log");
    let logged: HashSet<String> = logged_paths(text.lines()).into_iter().collect();
    let answered = answered.lock().unwrap();
    let missing: Vec<_> = answered.difference(&logged).collect();
    assert!(
        missing.is_empty(),
        "{} of {} answered requests have no access line: {:?}",
        missing.len(),
        answered.len(),
        &missing[..missing.len().min(5)]
    );
    assert!(answered.len() >= 600);
}

#[tokio::test]
async fn lines_stay_whole_when_every_worker_writes_at_once() {
    // Small buffers, long lines: batches go to stderr all the time, from
    // every worker, beside the event log's lines.
    let mut proxy = ProxyProcess::start(POLICY, &["--access-log-buffer", "4KiB"]).await;
    let pad = format!("?{}", "x".repeat(1500));
    let Load { count, tasks, .. } = load(proxy.addr, pad.as_str().into(), 100);
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(count.load(Ordering::SeqCst), 800);
    // The last line, once it is out, says they all are (one writer, in
    // order per worker; the flush interval takes the rest).
    tokio::time::timeout(Duration::from_secs(20), async {
        while proxy.count_logs("\"target\":\"access\"") < 800 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("800 access lines within 20 s");
    proxy.signal("TERM");
    proxy.wait_for_log("drained").await;
    let logs = proxy.logs.lock().unwrap().clone();
    let logged = logged_paths(logs.iter().map(String::as_str));
    assert_eq!(logged.len(), 800, "one line per request");
    let unique: HashSet<&String> = logged.iter().collect();
    assert_eq!(unique.len(), 800, "no line twice");
    assert!(logged.iter().all(|p| p.ends_with(&pad)), "whole paths");
}

#[tokio::test]
async fn a_log_pipe_nobody_reads_drops_lines_and_never_stalls_requests() {
    let dir = tempfile::tempdir().unwrap();
    let (port, _guard) = reserved_port();
    let (admin_port, _admin_guard) = reserved_port();
    let policy = POLICY.replace("127.0.0.1:0", &format!("127.0.0.1:{port}"));
    std::fs::write(dir.path().join("policy.yaml"), policy).unwrap();
    // Stderr is a pipe this test never reads: once its 64 KiB fill, the
    // writer blocks in write(2) for good.
    let mut child = tokio::process::Command::new(binary())
        .args(["serve", "--policies"])
        .arg(dir.path())
        .args(["--admin", &format!("127.0.0.1:{admin_port}")])
        .env("PORTCULLIS_LOG_FORMAT", "json")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn portcullis");
    let _unread = child.stderr.take();
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let readyz = format!("http://127.0.0.1:{admin_port}/readyz");
    // The log says nothing here: the answering port is the signal.
    tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            if let Ok(Ok(resp)) = tokio::time::timeout(
                Duration::from_secs(1),
                client::http1().get(readyz.parse().unwrap()),
            )
            .await
                && resp.status() == 200
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the proxy gets ready");

    // About 4 MB of lines, far more than the pipe, the writer's batch
    // and every worker's backlog hold.
    let pad = format!("?{}", "x".repeat(1000));
    let Load { count, tasks, .. } = load(addr, pad.as_str().into(), 400);
    tokio::time::timeout(Duration::from_secs(120), async {
        for task in tasks {
            task.await.unwrap();
        }
    })
    .await
    .expect("requests go on while the log is blocked");
    assert_eq!(count.load(Ordering::SeqCst), 3200, "every request answered");

    let metrics = client::get(&format!("http://127.0.0.1:{admin_port}/metrics")).await;
    let text = String::from_utf8_lossy(&metrics.body);
    let dropped: u64 = text
        .lines()
        .find_map(|l| l.strip_prefix("portcullis_access_log_dropped_total "))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no dropped count in {text}"));
    assert!(dropped > 0, "lines dropped and counted");
    assert!(dropped < 3200, "not every line: the pipe took some");
    // Still serving.
    let again = client::get(&format!("http://{addr}/ok/after")).await;
    assert_eq!(again.status, 200);
}

#[tokio::test]
async fn a_rotated_access_log_file_is_opened_again() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("access.log");
    let proxy = ProxyProcess::start(
        POLICY,
        &[
            "--access-log",
            &file.display().to_string(),
            "--access-log-flush",
            "20ms",
        ],
    )
    .await;
    let lines_in = |path: &std::path::Path, want: &str| {
        std::fs::read_to_string(path).is_ok_and(|t| t.contains(want))
    };
    async fn until(what: &str, done: impl Fn() -> bool) {
        tokio::time::timeout(Duration::from_secs(20), async {
            while !done() {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{what} within 20 s"));
    }
    assert_eq!(client::get(&proxy.url("/ok/before")).await.status, 200);
    until("the first line", || lines_in(&file, "/ok/before")).await;
    // logrotate's default: move the file away; the proxy makes a new one.
    let rotated = dir.path().join("access.log.1");
    std::fs::rename(&file, &rotated).unwrap();
    until("a new file", || file.exists()).await;
    assert_eq!(client::get(&proxy.url("/ok/after")).await.status, 200);
    until("the line in a new file", || lines_in(&file, "/ok/after")).await;
    assert!(!lines_in(&file, "/ok/before"));
    assert!(!lines_in(&rotated, "/ok/after"));
}

#[test]
fn an_access_log_that_cannot_be_opened_is_refused_by_name() {
    let out = std::process::Command::new(binary())
        .args([
            "serve",
            "--admin",
            "off",
            "--access-log",
            "/nonexistent-dir/access.log",
        ])
        .output()
        .expect("run serve");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("access log /nonexistent-dir/access.log: No such file"),
        "{stderr}"
    );
}
