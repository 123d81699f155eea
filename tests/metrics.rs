//! Request metrics on the admin listener: responses by route and status,
//! and latency histograms, from the real binary serving real upstreams.

use std::time::Duration;

use hyper::Response;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::client;
use crate::support::closed_port;
use crate::support::configmap::ConfigMap;
use crate::support::process::ProxyProcess;
use crate::support::upstream::{self, full};

fn policy(app: &str, version: &str) -> String {
    format!(
        r#"
listeners: [{{ name: main, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: app, endpoints: ["{app}"] }}
  - {{ name: down, endpoints: ["http://127.0.0.1:{down}"] }}
routes:
  - {{ name: app, match: {{ path_prefix: /app }}, upstream: app }}
  - {{ name: down, match: {{ path: /down }}, upstream: down }}
  - {{ name: version, match: {{ path: /version }}, respond: {{ status: 200, body: "{version}" }} }}
"#,
        down = closed_port()
    )
}

#[tokio::test]
async fn requests_are_counted_by_route_and_status_with_their_latency() {
    let up = upstream::serve(|req| async move {
        if req.uri().path() == "/app/slow" {
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        Response::new(full("ok"))
    })
    .await;
    let proxy = ProxyProcess::start(&policy(&up.url(), "v1"), &[]).await;
    for _ in 0..3 {
        assert_eq!(client::get(&proxy.url("/app/fast")).await.status, 200);
    }
    assert_eq!(client::get(&proxy.url("/app/slow")).await.status, 200);
    assert_eq!(client::get(&proxy.url("/down")).await.status, 502);
    for _ in 0..2 {
        assert_eq!(client::get(&proxy.url("/nowhere")).await.status, 404);
    }
    let text = proxy
        .metrics_showing(&[
            r#"portcullis_requests_total{route="app",code="200"} 4"#.into(),
            r#"portcullis_requests_total{route="down",code="502"} 1"#.into(),
            r#"portcullis_requests_total{route="",code="404"} 2"#.into(),
            r#"portcullis_request_duration_seconds_count{route="app"} 4"#.into(),
            r#"portcullis_request_duration_seconds_bucket{route="app",le="+Inf"} 4"#.into(),
            r#"portcullis_request_duration_seconds_count{route="down"} 1"#.into(),
        ])
        .await;
    // The slow request took at least 30 ms, so at most the three fast ones
    // can be in the buckets up to 25 ms, and the sum is at least 30 ms.
    let bucket = |le: &str| -> u64 {
        let prefix =
            format!(r#"portcullis_request_duration_seconds_bucket{{route="app",le="{le}"}} "#);
        let line = text.lines().find(|l| l.starts_with(&prefix));
        line.and_then(|l| l[prefix.len()..].parse().ok())
            .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
    };
    assert!(bucket("0.025") <= 3, "{text}");
    let sum: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix(r#"portcullis_request_duration_seconds_sum{route="app"} "#))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no sum in\n{text}"));
    assert!(sum >= 0.030, "sum {sum} in\n{text}");
    assert!(text.contains("# TYPE portcullis_request_duration_seconds histogram"));
    // A route that served nothing shows no series.
    assert!(!text.contains(r#"route="version""#), "{text}");
}

#[tokio::test]
async fn a_reload_keeps_counting_into_the_same_counters() {
    let up = upstream::serve(|_req| async { Response::new(full("ok")) }).await;
    let mut map = ConfigMap::new(&[("routing.yaml", policy(&up.url(), "v1").as_bytes())]);
    let proxy = ProxyProcess::start_on(map.path(), &[]).await;
    for _ in 0..2 {
        assert_eq!(client::get(&proxy.url("/app")).await.status, 200);
    }
    proxy
        .metrics_showing(&[r#"portcullis_requests_total{route="app",code="200"} 2"#.into()])
        .await;
    map.update(&[("routing.yaml", policy(&up.url(), "v2").as_bytes())]);
    proxy
        .wait_status("generation 2", |s| s["config"]["generation"] == 2)
        .await;
    assert_eq!(client::get(&proxy.url("/version")).await.body, "v2");
    assert_eq!(client::get(&proxy.url("/app")).await.status, 200);
    proxy
        .metrics_showing(&[
            r#"portcullis_requests_total{route="app",code="200"} 3"#.into(),
            r#"portcullis_requests_total{route="version",code="200"} 1"#.into(),
        ])
        .await;
}

#[tokio::test]
async fn body_bytes_count_by_route_and_forwarding_by_upstream() {
    // Echoes the request body; `/app/slow` answers after the route's
    // timeout.
    let up = upstream::serve(|req| async move {
        if req.uri().path() == "/app/slow" {
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
        let status = if req.uri().path() == "/app/missing" {
            404
        } else {
            200
        };
        let body = http_body_util::BodyExt::collect(req.into_body())
            .await
            .unwrap();
        let mut resp = Response::new(full(body.to_bytes()));
        *resp.status_mut() = hyper::StatusCode::from_u16(status).unwrap();
        resp
    })
    .await;
    // Lets in requests that carry a cookie.
    let auth = upstream::serve(|req| async move {
        let mut resp = Response::new(full(""));
        if !req.headers().contains_key("cookie") {
            *resp.status_mut() = hyper::StatusCode::UNAUTHORIZED;
        }
        resp
    })
    .await;
    let policy = format!(
        r#"
listeners: [{{ name: main, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: app, endpoints: ["{app}"] }}
  - {{ name: down, endpoints: ["http://127.0.0.1:{down}"] }}
  - {{ name: auth, endpoints: ["{auth}"] }}
routes:
  - {{ name: slow, match: {{ path: /app/slow }}, upstream: app, timeout: 200ms }}
  - {{ name: app, match: {{ path_prefix: /app }}, upstream: app }}
  - {{ name: down, match: {{ path: /down }}, upstream: down }}
  - name: guarded
    match: {{ path: /guarded }}
    upstream: app
    auth_request: {{ upstream: auth, path: /check }}
  - name: unguardable
    match: {{ path: /unguardable }}
    upstream: app
    auth_request: {{ upstream: down, path: /check }}
"#,
        app = up.url(),
        auth = auth.url(),
        down = closed_port()
    );
    let proxy = ProxyProcess::start(&policy, &[]).await;
    let http = client::http1();
    // A small body (read whole before it goes), and a streamed one of
    // unknown length, larger than the proxy reads ahead.
    let small = hyper::Request::post(proxy.url("/app/echo"))
        .body(client::body(vec![b'a'; 1000]))
        .unwrap();
    let answer = client::send(&http, small).await;
    assert_eq!((answer.status.as_u16(), answer.body.len()), (200, 1000));
    let (tx, sent) = client::streamed_post(proxy.url("/app/echo"));
    for _ in 0..10 {
        tx.send(bytes::Bytes::from(vec![b'b'; 10_000]))
            .await
            .unwrap();
    }
    drop(tx);
    let answer = sent.await.unwrap();
    assert_eq!((answer.status.as_u16(), answer.body.len()), (200, 100_000));
    assert_eq!(client::get(&proxy.url("/app/missing")).await.status, 404);
    assert_eq!(client::get(&proxy.url("/app/slow")).await.status, 504);
    for _ in 0..2 {
        assert_eq!(client::get(&proxy.url("/down")).await.status, 502);
    }
    // Auth subrequests count under the auth service's upstream.
    assert_eq!(client::get(&proxy.url("/guarded")).await.status, 401);
    let signed_in = hyper::Request::get(proxy.url("/guarded"))
        .header("cookie", "session=1")
        .body(client::body(""))
        .unwrap();
    assert_eq!(client::send(&http, signed_in).await.status, 200);
    assert_eq!(client::get(&proxy.url("/unguardable")).await.status, 503);
    let text = proxy
        .metrics_showing(&[
            r#"portcullis_request_bytes_total{route="app"} 101000"#.into(),
            r#"portcullis_upstream_responses_total{upstream="app",code="200"} 3"#.into(),
            r#"portcullis_upstream_responses_total{upstream="auth",code="200"} 1"#.into(),
            r#"portcullis_upstream_responses_total{upstream="auth",code="401"} 1"#.into(),
            r#"portcullis_upstream_responses_total{upstream="app",code="404"} 1"#.into(),
            r#"portcullis_upstream_errors_total{upstream="app",reason="timeout"} 1"#.into(),
            r#"portcullis_upstream_errors_total{upstream="down",reason="connect"} 3"#.into(),
            r#"portcullis_upstream_header_duration_seconds_count{upstream="app"} 4"#.into(),
            r#"portcullis_upstream_header_duration_seconds_count{upstream="auth"} 2"#.into(),
        ])
        .await;
    // The response bytes are the bodies the client got: the two echoes,
    // the 404's empty body; the proxy's own error bodies for the rest.
    let value = |prefix: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {prefix} in\n{text}"))
    };
    assert_eq!(
        value(r#"portcullis_response_bytes_total{route="app"} "#),
        101_000
    );
    assert!(value(r#"portcullis_response_bytes_total{route="down"} "#) > 0);
    assert_eq!(value(r#"portcullis_request_bytes_total{route="down"} "#), 0);
    // Failures are not timed, and no upstream was answered `down`.
    assert!(
        !text.contains(r#"portcullis_upstream_header_duration_seconds_count{upstream="down"}"#),
        "{text}"
    );
    assert!(
        !text.contains(r#"portcullis_upstream_responses_total{upstream="down""#),
        "{text}"
    );
}

/// A listener with short client timeouts, and a local answer.
const EDGE: &str = r#"
listeners: [{ name: edge, bind: "127.0.0.1:0", header_read_timeout: 300ms, keepalive_timeout: 1s }]
routes: [{ name: v, match: { path: /v }, respond: { status: 200, body: "v" } }]
"#;

#[tokio::test]
async fn connections_that_end_in_an_error_count_by_listener_and_reason() {
    let proxy = ProxyProcess::start(EDGE, &[]).await;
    // Garbage: hyper answers 400 and closes.
    let mut sock = TcpStream::connect(proxy.addr).await.unwrap();
    sock.write_all(b"NOT HTTP AT ALL\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    sock.read_to_end(&mut answer).await.unwrap();
    assert!(answer.starts_with(b"HTTP/1.1 400"), "{answer:?}");
    // Half a head, then the client goes away.
    let mut sock = TcpStream::connect(proxy.addr).await.unwrap();
    sock.write_all(b"GET /v HTTP/1.1\r\nhost: a\r\n")
        .await
        .unwrap();
    drop(sock);
    // Half a head, then nothing: closed at the header-read timeout.
    let mut sock = TcpStream::connect(proxy.addr).await.unwrap();
    sock.write_all(b"GET /v HTTP/1.1\r\n").await.unwrap();
    let mut rest = Vec::new();
    let _ = sock.read_to_end(&mut rest).await;
    proxy
        .metrics_showing(&[
            crate::support::process::connection_errors("edge", "malformed", 1),
            crate::support::process::connection_errors("edge", "incomplete", 1),
            crate::support::process::connection_errors("edge", "header_timeout", 1),
        ])
        .await;
}

#[tokio::test]
async fn keep_alive_connections_outlive_the_header_read_timeout() {
    let proxy = ProxyProcess::start(EDGE, &[]).await;
    let mut sock = TcpStream::connect(proxy.addr).await.unwrap();
    let request = b"GET /v HTTP/1.1\r\nhost: a\r\n\r\n";
    sock.write_all(request).await.unwrap();
    let first = read_response(&mut sock).await;
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    // Idle for longer than the header-read timeout, which bounds only a
    // new connection's first head: a balancer in front may reuse the
    // connection until the keep-alive timeout.
    tokio::time::sleep(Duration::from_millis(600)).await;
    sock.write_all(request).await.unwrap();
    let second = read_response(&mut sock).await;
    assert!(second.starts_with("HTTP/1.1 200"), "{second}");
    // Then idle past the keep-alive timeout: the proxy closes it.
    let start = tokio::time::Instant::now();
    assert_closed_soon(&mut sock, "an idle keep-alive connection was never closed").await;
    assert!(
        start.elapsed() >= Duration::from_millis(900),
        "{:?}",
        start.elapsed()
    );
    proxy
        .metrics_showing(&[
            r#"portcullis_requests_total{route="v",code="200"} 2"#.into(),
            crate::support::process::connection_errors("edge", "keepalive_timeout", 1),
        ])
        .await;
}

#[tokio::test]
async fn a_stalled_head_on_a_kept_alive_connection_has_the_header_read_timeout() {
    // A keep-alive timeout far beyond the test's wait: only the head
    // deadline can close the connection in time.
    let proxy = ProxyProcess::start(
        r#"
listeners: [{ name: edge, bind: "127.0.0.1:0", header_read_timeout: 300ms, keepalive_timeout: 60s }]
routes: [{ name: v, match: { path: /v }, respond: { status: 200, body: "v" } }]
"#,
        &[],
    )
    .await;
    let mut sock = TcpStream::connect(proxy.addr).await.unwrap();
    sock.write_all(b"GET /v HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let first = read_response(&mut sock).await;
    assert!(first.starts_with("HTTP/1.1 200"), "{first}");
    // Idle past the header-read timeout: still open, as above.
    tokio::time::sleep(Duration::from_millis(600)).await;
    // Then half a head, and nothing more (a slowloris that first behaved).
    sock.write_all(b"GET /v HTTP/1.1\r\n").await.unwrap();
    assert_closed_soon(
        &mut sock,
        "a stalled head on a kept-alive connection waited for the keep-alive timeout",
    )
    .await;
    proxy
        .metrics_showing(&[
            r#"portcullis_requests_total{route="v",code="200"} 1"#.into(),
            crate::support::process::connection_errors("edge", "header_timeout", 1),
        ])
        .await;
}

/// Waits (10 s at most) for the proxy to close `sock`, failing with `why`.
async fn assert_closed_soon(sock: &mut TcpStream, why: &str) {
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(10), sock.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "{why}");
}

/// Reads one small response (head and a body that arrives with it).
async fn read_response(sock: &mut TcpStream) -> String {
    let mut buf = [0u8; 1024];
    let n = sock.read(&mut buf).await.unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// A client that leaves before its answer counts as nginx's 499 ("client
/// closed request") in the access log and the metrics, whether it closes
/// an HTTP/1.1 connection or resets an HTTP/2 stream, and is no upstream
/// failure.
#[tokio::test]
async fn a_client_that_leaves_before_its_answer_counts_as_499() {
    let (up, mut arrived, _release) = upstream::holding().await;
    let mut proxy = ProxyProcess::start(
        &format!(
            r#"
listeners: [{{ name: main, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: held, endpoints: ["{}"] }}]
routes: [{{ name: held, match: {{ path: /slow }}, upstream: held }}]
"#,
            up.url()
        ),
        &[],
    )
    .await;
    let addr = proxy.addr;
    let arrival = async |arrived: &mut tokio::sync::mpsc::UnboundedReceiver<()>| {
        tokio::time::timeout(Duration::from_secs(10), arrived.recv())
            .await
            .expect("the request reached the upstream")
    };

    // HTTP/2: the request's future dropped, its stream reset.
    let tcp = TcpStream::connect(addr).await.unwrap();
    let (mut h2, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let req = hyper::Request::get(format!("http://{addr}/slow"))
        .body(client::body(bytes::Bytes::new()))
        .unwrap();
    let waiting = tokio::spawn(h2.send_request(req));
    arrival(&mut arrived).await;
    waiting.abort();
    let line = proxy.wait_for_log("\"/slow\"").await;
    assert!(line.contains("\"status\":499"), "{line}");

    // HTTP/1.1: the connection closed.
    let mut http1 = TcpStream::connect(addr).await.unwrap();
    http1
        .write_all(b"GET /slow HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    arrival(&mut arrived).await;
    drop(http1);
    let line = proxy.wait_for_log("\"/slow\"").await;
    assert!(line.contains("\"status\":499"), "{line}");
    // Nothing failed upstream; no warning says so.
    assert_eq!(proxy.count_logs("upstream request failed"), 0);

    proxy
        .metrics_showing(&[r#"portcullis_requests_total{route="held",code="499"} 2"#.into()])
        .await;
}

/// `/metrics` carries the process's own families under the names every
/// Prometheus exporter uses, with this process's values: its resident
/// memory, open descriptors and start time.
#[tokio::test]
async fn the_process_families_describe_the_running_proxy() {
    let proxy = ProxyProcess::start(
        r#"
listeners: [{ name: http, bind: "127.0.0.1:0" }]
routes: [{ name: ok, match: { path: /ok }, respond: { status: 200 } }]
"#,
        &[],
    )
    .await;
    let text = client::get(&proxy.admin_url("/metrics")).await;
    let text = String::from_utf8_lossy(&text.body).into_owned();
    let value = |name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{name} "))?.parse().ok())
            .unwrap_or_else(|| panic!("no {name}:\n{text}"))
    };
    let rss_kib = value("process_resident_memory_bytes") / 1024.0;
    let measured = proxy.rss_kib() as f64;
    // The same figure the kernel gives for the process, within what a
    // scrape allocates in between.
    assert!(
        (rss_kib - measured).abs() < measured * 0.5,
        "{rss_kib} KiB vs {measured} KiB"
    );
    assert!(value("process_open_fds") >= 4.0, "listeners, admin, stdio");
    assert!(value("process_max_fds") >= value("process_open_fds"));
    assert!(text.contains("# TYPE process_cpu_seconds_total counter"));
}
