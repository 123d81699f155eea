//! Process lifecycle: SIGTERM drain, readiness, slow clients, connection cap.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hyper::{Request, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{Notify, mpsc};

use crate::support::Proxy;
use crate::support::client::{self, body};
use crate::support::process::ProxyProcess;
use crate::support::upstream::{self, full};

fn policy(upstream: &str) -> String {
    format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: slow, endpoints: ["{upstream}"] }}]
routes:
  - {{ name: readyz, match: {{ path: /readyz }}, health: ready }}
  - {{ name: slow, match: {{ path: /slow }}, upstream: slow }}
"#
    )
}

#[tokio::test]
async fn sigterm_drains_a_slow_in_flight_request_then_exits_zero() {
    let (arrived_tx, mut arrived) = mpsc::unbounded_channel();
    let release = Arc::new(Notify::new());
    let held = release.clone();
    let slow = upstream::serve(move |_req| {
        let (arrived_tx, held) = (arrived_tx.clone(), held.clone());
        async move {
            let _ = arrived_tx.send(());
            held.notified().await;
            Response::new(full("finished"))
        }
    })
    .await;
    let mut proxy = ProxyProcess::start(
        &policy(&slow.url()),
        &["--shutdown-delay", "1s", "--grace-period", "20s"],
    )
    .await;
    assert_eq!(client::get(&proxy.url("/readyz")).await.status, 200);

    let url = proxy.url("/slow");
    let in_flight = tokio::spawn(async move { client::get(&url).await });
    tokio::time::timeout(Duration::from_secs(10), arrived.recv())
        .await
        .expect("request reached upstream");

    proxy.signal("TERM");
    proxy.wait_for_log("readyz is 503").await;
    let ready = client::get(&proxy.url("/readyz")).await;
    assert_eq!(ready.status, 503, "readyz must fail while draining");

    // Wait until the listeners have closed, then let the request finish.
    proxy.wait_for_log("closed listeners").await;
    release.notify_one();
    let answer = in_flight.await.unwrap();
    assert_eq!(answer.status, 200);
    assert_eq!(&answer.body[..], b"finished");
    let status = proxy.wait_exit(Duration::from_secs(20)).await;
    assert!(status.success(), "exit status {status:?}");

    // One access-log line per request, with route, upstream and status.
    let logs = proxy.logs.lock().unwrap().clone();
    let access: Vec<serde_json::Value> = logs
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"] == "access" && v["path"] == "/slow")
        .collect();
    assert_eq!(access.len(), 1, "{logs:#?}");
    assert_eq!(access[0]["status"], 200);
    assert_eq!(access[0]["route"], "slow");
    assert_eq!(access[0]["upstream"], "slow");
    assert_eq!(access[0]["endpoint"], slow.addr.to_string());
    assert_eq!(access[0]["method"], "GET");
    // The upstream held its answer until the drain had begun: its share
    // is most of the request's time, and never more.
    let (upstream_ms, total_ms) = (
        access[0]["upstream_header_ms"].as_f64().unwrap(),
        access[0]["duration_ms"].as_f64().unwrap(),
    );
    assert!(
        upstream_ms > 0.0 && upstream_ms <= total_ms,
        "{:#}",
        access[0]
    );
    // Cleartext: no TLS fields at all.
    assert!(access[0].get("tls").is_none(), "{:#}", access[0]);
    assert!(access[0].get("client_cert").is_none(), "{:#}", access[0]);
    // Milliseconds to the microsecond: no float noise in the log line.
    let ms = &access[0]["duration_ms"];
    assert!(ms.as_f64().is_some_and(|ms| ms > 0.0), "{ms}");
    let decimals = ms.to_string().split('.').nth(1).map_or(0, str::len);
    assert!(decimals <= 3, "duration_ms {ms}");
}

/// A policy directory with two plugins, each on a route: their
/// compilation makes the start take a while, as in production.
fn plugin_policies() -> tempfile::TempDir {
    let yaml = policy("http://127.0.0.1:9").replace(
        "routes:\n",
        "plugins: [{ name: gate, path: gate.wasm }, { name: rules, path: rules.wasm }]\nroutes:\n  \
         - { name: api, match: { path_prefix: /api }, upstream: slow, plugins: [{ use: gate, config: { header: x-key } }] }\n  \
         - { name: edit, match: { path_prefix: /edit }, upstream: slow, plugins: [{ use: rules, config: { request: { set: { x-a: b } } } }] }\n",
    );
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("p.yaml"), yaml).expect("write");
    for (file, plugin) in [
        ("gate.wasm", "example-require-header"),
        ("rules.wasm", "header-rules"),
    ] {
        let code = std::fs::read(crate::support::plugin_file(plugin)).expect("plugin");
        std::fs::write(dir.path().join(file), code).expect("write");
    }
    dir
}

/// `portcullis serve` spawned here rather than through ProxyProcess,
/// whose log reader adds enough delay to miss the windows at start. Its
/// log lines come from a thread, so a wait can give up.
struct Starting {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    seen: String,
}

impl Starting {
    fn serve(policies: &std::path::Path) -> Self {
        let mut child = std::process::Command::new(crate::support::binary())
            .args(["serve", "--admin", "off", "--policies"])
            .arg(policies)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn portcullis");
        let log = std::io::BufReader::new(child.stderr.take().expect("stderr"));
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufRead::lines(log) {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Starting {
            child,
            lines,
            seen: String::new(),
        }
    }

    /// Reads the log up to a line holding `text`, and returns it; fails if
    /// the process ends first or 20 s pass.
    fn read_until(&mut self, text: &str) -> String {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let line = match self.lines.recv_timeout(left) {
                Ok(line) => line,
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                    let _ = self.child.kill();
                    panic!("no {text:?} logged within 20 s: {}", self.seen)
                }
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    panic!("exited before logging {text:?}: {}", self.seen)
                }
            };
            self.seen.push_str(&line);
            self.seen.push('\n');
            if line.contains(text) {
                return line;
            }
        }
    }

    fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child's pid.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, signal) }, 0);
    }

    /// Waits (20 s at most) for the exit, with the rest of the log.
    fn finish(mut self) -> (std::process::ExitStatus, String) {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while let Ok(line) = self
            .lines
            .recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
        {
            self.seen.push_str(&line);
            self.seen.push('\n');
        }
        if std::time::Instant::now() >= deadline {
            let _ = self.child.kill();
        }
        let status = self.child.wait().expect("wait");
        (status, self.seen)
    }
}

/// A pod deleted as it starts: SIGTERM the moment the listeners are
/// announced still drains and exits 0 (the handlers are in place before
/// the policies load), not the kill of an unhandled signal.
#[test]
fn sigterm_right_after_start_is_a_clean_shutdown() {
    // With a plugin: its engine start made the window wide enough to hit
    // every time.
    let dir = plugin_policies();
    for attempt in 0..5 {
        let mut proxy = Starting::serve(dir.path());
        proxy.read_until("listening");
        proxy.signal(libc::SIGTERM);
        let (status, log) = proxy.finish();
        assert!(status.success(), "attempt {attempt}: {status:?}\n{log}");
        assert!(log.contains("SIGTERM received"), "attempt {attempt}: {log}");
    }
}

/// A config reloader (or an operator) sending SIGHUP while the proxy
/// still compiles its plugins: the signal is kept and reloads once the
/// proxy serves, rather than ending the process (SIGHUP's default).
#[test]
fn sighup_while_the_plugins_compile_reloads_once_serving() {
    let dir = plugin_policies();
    let mut proxy = Starting::serve(dir.path());
    // Sent when the first plugin is compiled, while the second compiles.
    proxy.read_until("plugin compiled");
    proxy.signal(libc::SIGHUP);
    proxy.read_until("listening");
    // The policies did not change: the reload finds them as they were.
    let reload = proxy.read_until("reload: policies unchanged");
    assert!(reload.contains("signal"), "{reload}");
    proxy.signal(libc::SIGTERM);
    let (status, log) = proxy.finish();
    assert!(status.success(), "{status:?}\n{log}");
    assert_eq!(log.matches("plugin compiled").count(), 2, "{log}");
}

#[tokio::test]
async fn slow_header_senders_are_cut_off() {
    let proxy = Proxy::start_yaml(
        r#"
listeners: [{ name: http, bind: "127.0.0.1:0", header_read_timeout: 300ms }]
routes: [{ name: ok, match: { path: /ok }, respond: { status: 200, body: ok } }]
"#,
    )
    .await;
    let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    conn.write_all(b"GET /ok HTTP/1.1\r\nHost: a\r\n")
        .await
        .unwrap();
    // Never finish the head: the proxy must close the connection itself.
    let mut buf = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut buf)).await;
    assert!(
        closed.is_ok(),
        "connection with an unfinished head was not closed"
    );
    assert_eq!(client::get(&proxy.url("/ok")).await.status, 200);
}

#[tokio::test]
async fn connections_beyond_the_limit_wait_for_a_free_slot() {
    let proxy = Proxy::start_yaml(
        r#"
listeners: [{ name: http, bind: "127.0.0.1:0", max_connections: 1 }]
routes: [{ name: ok, match: { path: /ok }, respond: { status: 200, body: ok } }]
"#,
    )
    .await;
    // The first connection holds the only slot (keep-alive, idle).
    let mut first = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    first
        .write_all(b"GET /ok HTTP/1.1\r\nHost: a\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 256];
    let n = first.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));

    let url = proxy.url("/ok");
    let mut second = tokio::spawn(async move { client::get(&url).await });
    let waited = tokio::time::timeout(Duration::from_millis(300), &mut second).await;
    assert!(
        waited.is_err(),
        "second connection was served while the first held the only slot"
    );
    drop(first);
    let answer = tokio::time::timeout(Duration::from_secs(10), second)
        .await
        .expect("served after slot freed")
        .unwrap();
    assert_eq!(answer.status, 200);
}

#[tokio::test]
async fn keep_alive_connections_serve_many_requests() {
    let echo = upstream::echo("e").await;
    let proxy = Proxy::start_default(&[("APP_PROXY_URL", echo.url())]).await;
    let c = client::http1();
    for i in 0..50 {
        let req = Request::get(proxy.url(&format!("/app-proxy/{i}")))
            .body(body(Bytes::new()))
            .unwrap();
        let a = client::send(&c, req).await;
        assert_eq!(a.json()["path"], format!("/app-proxy/{i}"));
    }
}

#[tokio::test]
async fn long_lived_connections_are_spread_evenly_over_the_workers() {
    // The kernel hashes each connection to one worker's socket; 16 spread
    // that way land 4/4/4/4 on four workers only 1.5% of the time.
    let mut proxy = ProxyProcess::start(
        r#"
listeners: [{ name: http, bind: "127.0.0.1:0" }]
routes: [{ name: who, match: { path_prefix: /who }, respond: { status: 200, body: here } }]
"#,
        &["--workers", "4"],
    )
    .await;
    let addr = proxy
        .url("/")
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_owned();
    // Opened one after another and all kept open, as a client's pool.
    let mut conns = Vec::new();
    for i in 0..16 {
        let mut conn = tokio::net::TcpStream::connect(&addr).await.unwrap();
        client::get_on(&mut conn, "a", &format!("/who?c={i:02}"), "here").await;
        proxy.wait_for_log(&format!("c={i:02}\"")).await;
        conns.push(conn);
    }
    // Connections handed to another worker keep serving.
    for (i, conn) in conns.iter_mut().enumerate() {
        client::get_on(conn, "a", &format!("/who?again={i:02}"), "here").await;
    }
    assert_eq!(
        proxy.access_per_worker("c=", 4),
        [4, 4, 4, 4],
        "connections per worker"
    );
}

#[tokio::test]
async fn routes_choose_which_requests_get_an_access_line() {
    let mut proxy = ProxyProcess::start(
        r#"
listeners: [{ name: http, bind: "127.0.0.1:0" }]
routes:
  - { name: quiet, match: { path: /quiet }, respond: { status: 200 }, access_log: false }
  - { name: probe, match: { path: /probe }, respond: { status: 200 }, access_log: errors }
  - { name: failing, match: { path: /failing }, respond: { status: 503 }, access_log: errors }
  - { name: loud, match: { path: /loud }, respond: { status: 200 } }
"#,
        &["--workers", "1"],
    )
    .await;
    // One connection: each request's line is written (or not) before the
    // next request is read, so the last line says the others are out.
    let http = client::http1();
    for path in ["/quiet", "/probe", "/failing", "/quiet", "/loud"] {
        let req = hyper::Request::get(proxy.url(path))
            .body(client::body(""))
            .unwrap();
        client::send(&http, req).await;
    }
    proxy.wait_for_log(r#""path":"/loud""#).await;
    let logs = proxy.logs.lock().unwrap().clone();
    let lines_for = |path: &str| {
        logs.iter()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["target"] == "access" && v["path"] == path)
            .count()
    };
    assert_eq!(lines_for("/quiet"), 0, "{logs:#?}");
    assert_eq!(lines_for("/probe"), 0, "a probe that passes: {logs:#?}");
    assert_eq!(lines_for("/failing"), 1, "a probe that fails: {logs:#?}");
    assert_eq!(lines_for("/loud"), 1, "{logs:#?}");
}

/// A proxy whose listener has `limits` and a route answering `done`.
async fn limited(limits: &str) -> Proxy {
    Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0", {limits} }}]
routes: [{{ name: here, match: {{ path: /x }}, respond: {{ status: 200, body: done }} }}]
"#
    ))
    .await
}

/// One GET on `conn`: the answer's head, read whole with its 4-byte body.
async fn answer_head(conn: &mut tokio::net::TcpStream) -> String {
    conn.write_all(b"GET /x HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let mut buf = [0u8; 1024];
    while !answer.ends_with(b"done") {
        let n = conn.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "closed before the answer: {:?}",
            String::from_utf8_lossy(&answer)
        );
        answer.extend_from_slice(&buf[..n]);
    }
    String::from_utf8_lossy(&answer).to_ascii_lowercase()
}

/// Whether the proxy closes `conn` (5 s at most).
async fn closed(conn: &mut tokio::net::TcpStream) -> bool {
    let mut buf = [0u8; 16];
    matches!(
        tokio::time::timeout(Duration::from_secs(5), conn.read(&mut buf)).await,
        Ok(Ok(0) | Err(_))
    )
}

#[tokio::test]
async fn a_client_connection_closes_after_its_max_requests() {
    let proxy = limited("max_requests_per_connection: 3").await;
    let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    for _ in 0..2 {
        let head = answer_head(&mut conn).await;
        assert!(!head.contains("connection: close"), "{head}");
    }
    // The third answer says it is the last, and the connection ends.
    let head = answer_head(&mut conn).await;
    assert!(head.contains("connection: close"), "{head}");
    assert!(closed(&mut conn).await);
}

#[tokio::test]
async fn a_client_connection_closes_at_the_first_answer_after_its_lifetime() {
    let proxy = limited("connection_lifetime: 200ms").await;
    let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let head = answer_head(&mut conn).await;
    assert!(!head.contains("connection: close"), "{head}");
    // Letting the connection age is the behaviour under test.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let head = answer_head(&mut conn).await;
    assert!(head.contains("connection: close"), "{head}");
    assert!(closed(&mut conn).await);
}

#[tokio::test]
async fn an_http2_client_gets_a_goaway_after_its_max_requests() {
    let proxy = limited("max_requests_per_connection: 2").await;
    let tcp = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let (mut h2, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    let ended = tokio::spawn(conn);
    for _ in 0..2 {
        let req = Request::get(proxy.url("/x"))
            .body(body(Bytes::new()))
            .unwrap();
        let resp = h2.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
    }
    // The proxy sends GOAWAY after the second answer: the client's
    // connection ends by itself.
    let end = tokio::time::timeout(Duration::from_secs(5), ended).await;
    assert!(matches!(end, Ok(Ok(Ok(())))), "{end:?}");
    assert!(h2.is_closed());
}

/// An ingress that speaks HTTP/2 to its backends carries many users'
/// requests on one connection and resets a stream for each user who
/// leaves. When a burst of openings and their resets reaches the proxy in
/// one read (users leaving together, a balancer's timeouts, a load test
/// ending), h2's guard against rapid-reset attacks, 20 such streams by
/// default, ended the connection and every request on it. The bytes are
/// written by hand so the burst arrives in one write, as it does then.
#[tokio::test]
async fn an_http2_ingress_that_cancels_a_burst_keeps_its_connection() {
    // An HTTP/2 upstream (a gRPC service) shares one connection among the
    // requests too, and bears h2's default of 20 itself.
    for http2 in [false, true] {
        cancel_a_burst(http2).await;
    }
}

async fn cancel_a_burst(http2: bool) {
    let (up, mut arrived, release) = upstream::holding().await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: up, endpoints: ["{}"], http2: {http2} }}]
routes: [{{ name: all, match: {{ path_prefix: / }}, upstream: up }}]
"#,
        up.url()
    ))
    .await;
    let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend(h2_frame(4, 0, 0, &[]));
    hello.extend(h2_get(1, "/slow"));
    conn.write_all(&hello).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), arrived.recv())
        .await
        .expect("the held request reached the upstream");

    const LEAVING: u32 = 100;
    let mut burst = Vec::new();
    for n in 0..LEAVING {
        let stream = 3 + 2 * n;
        burst.extend(h2_get(stream, "/gone"));
        // RST_STREAM, CANCEL.
        burst.extend(h2_frame(3, 0, stream, &8u32.to_be_bytes()));
    }
    let after = 3 + 2 * LEAVING;
    burst.extend(h2_get(after, "/after"));
    conn.write_all(&burst).await.unwrap();
    assert_eq!(
        h2_answer(&mut conn, after).await,
        (200, b"done /after".to_vec())
    );

    // The request held all along is still answered on that connection.
    release.notify_one();
    assert_eq!(h2_answer(&mut conn, 1).await, (200, b"done /slow".to_vec()));
}

/// An HTTP/2 frame of `kind` with `flags` on `stream`.
fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut frame = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    frame.extend([kind, flags]);
    frame.extend(stream.to_be_bytes());
    frame.extend(payload);
    frame
}

/// A GET for `path` on `stream`, whole in one HEADERS frame: HPACK's
/// static entries for `:method GET` and `:scheme http`, then `:path` and
/// `:authority` as literals with indexed names.
fn h2_get(stream: u32, path: &str) -> Vec<u8> {
    let mut block = vec![0x82, 0x86];
    for (name, value) in [(4u8, path), (1, "a")] {
        block.extend([name, value.len() as u8]);
        block.extend(value.as_bytes());
    }
    // END_STREAM | END_HEADERS.
    h2_frame(1, 0x5, stream, &block)
}

/// Reads frames until `stream`'s answer has ended: its status (200 when
/// the head starts with HPACK's static `:status 200`) and body. Panics on
/// GOAWAY or a reset of the stream. The server's SETTINGS are acknowledged.
async fn h2_answer(conn: &mut tokio::net::TcpStream, stream: u32) -> (u16, Vec<u8>) {
    let (mut status, mut body) = (0, Vec::new());
    loop {
        let mut head = [0u8; 9];
        tokio::time::timeout(Duration::from_secs(10), conn.read_exact(&mut head))
            .await
            .expect("a frame within 10s")
            .expect("the connection stays open");
        let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
        let (kind, flags) = (head[3], head[4]);
        let on = u32::from_be_bytes(head[5..9].try_into().unwrap()) & 0x7fff_ffff;
        let mut payload = vec![0u8; len];
        conn.read_exact(&mut payload).await.unwrap();
        match kind {
            7 => panic!(
                "GOAWAY, error code {}",
                u32::from_be_bytes(payload[4..8].try_into().unwrap())
            ),
            3 if on == stream => panic!("stream {stream} reset"),
            4 if flags & 1 == 0 => conn.write_all(&h2_frame(4, 1, 0, &[])).await.unwrap(),
            1 if on == stream => {
                status = if payload.first() == Some(&0x88) {
                    200
                } else {
                    0
                };
            }
            0 if on == stream => body.extend(&payload),
            _ => {}
        }
        // END_STREAM on HEADERS or DATA.
        if on == stream && matches!(kind, 0 | 1) && flags & 1 != 0 {
            return (status, body);
        }
    }
}

/// A second `serve` on an address the first one holds refuses to start,
/// naming it (its sockets could otherwise join the first's and take half
/// the traffic unseen); once the first has exited, a restart binds the
/// same address at once, its connections in TIME_WAIT notwithstanding.
#[tokio::test]
async fn a_second_serve_on_a_held_address_refuses_to_start() {
    let up = upstream::echo("first").await;
    let mut first = ProxyProcess::start(&policy(&up.url()), &[]).await;
    let held = first.addr;
    // A served request leaves connections to close (TIME_WAIT) behind.
    assert_eq!(client::get(&first.url("/readyz")).await.status, 200);
    let on_held = policy(&up.url()).replace("127.0.0.1:0", &held.to_string());
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("policy.yaml"), &on_held).expect("write policy");
    let second = tokio::process::Command::new(crate::support::binary())
        .args(["serve", "--admin", "off", "--policies"])
        .arg(dir.path())
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .output();
    let second = tokio::time::timeout(Duration::from_secs(60), second)
        .await
        .expect("the second serve exits")
        .expect("run portcullis");
    let stderr = String::from_utf8_lossy(&second.stderr);
    assert!(!second.status.success(), "it started: {stderr}");
    assert!(stderr.contains(&held.to_string()), "{stderr}");
    assert!(stderr.contains("another process is listening"), "{stderr}");
    // The first still has all of the traffic.
    assert_eq!(client::get(&first.url("/readyz")).await.status, 200);

    first.signal("TERM");
    assert!(first.wait_exit(Duration::from_secs(20)).await.success());
    let restarted = ProxyProcess::start_on(dir.path(), &[]).await;
    assert_eq!(restarted.addr, held);
    assert_eq!(client::get(&restarted.url("/readyz")).await.status, 200);
}
