//! Retries beyond failed connects: `retry_on` (statuses and resets),
//! each try's `per_try_timeout`, and the `retry_budget` that bounds them;
//! and endpoints taken out after failed answers (`eject_after_5xx`).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::{Request, Response};

use crate::support::Proxy;
use crate::support::client::{self, body};
use crate::support::process::ProxyProcess;
use crate::support::upstream::{self, full};

/// An upstream that fails at times, by path: `/always` answers 503,
/// `/once` 503 if it is the upstream's first request, `/down-only` 503 if
/// it is named `down`; `/slow`, `/slow-once` (first request) and
/// `/stuck-only` (named `stuck`) wait longer than any test runs before
/// answering (they end by themselves); anything else is answered at once,
/// 200 with its name. It counts the requests it gets.
async fn failing_at_times(name: &'static str) -> (upstream::Upstream, Arc<AtomicUsize>) {
    use std::sync::atomic::AtomicBool;
    let hits = Arc::new(AtomicUsize::new(0));
    let once = Arc::new(AtomicBool::new(false));
    let counted = hits.clone();
    let up = upstream::serve(move |req: Request<hyper::body::Incoming>| {
        counted.fetch_add(1, Ordering::SeqCst);
        let first = !once.swap(true, Ordering::SeqCst);
        async move {
            let (unavailable, slow) = match req.uri().path() {
                "/always" => (true, false),
                "/once" => (first, false),
                "/down-only" => (name == "down", false),
                "/slow" => (false, true),
                "/slow-once" => (false, first),
                "/stuck-only" => (false, name == "stuck"),
                _ => (false, false),
            };
            if slow {
                tokio::time::sleep(Duration::from_secs(60)).await;
            }
            let _ = http_body_util::BodyExt::collect(req.into_body()).await;
            Response::builder()
                .status(if unavailable { 503 } else { 200 })
                .body(full(name))
                .unwrap()
        }
    })
    .await;
    (up, hits)
}

#[tokio::test]
async fn idempotent_requests_in_hand_are_retried_after_a_listed_status() {
    let (one, one_hits) = failing_at_times("one").await;
    let (down, down_hits) = failing_at_times("down").await;
    let (up, up_hits) = failing_at_times("up").await;
    let (plain, plain_hits) = failing_at_times("plain").await;
    let (h2, h2_hits) = failing_at_times("h2").await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: one, endpoints: ["{}"], retry_on: [503], retries: 2 }}
  - {{ name: pair, endpoints: ["{}", "{}"], retry_on: [502, 503, 504] }}
  - {{ name: plain, endpoints: ["{}"] }}
  - {{ name: h2, endpoints: ["{}"], retry_on: [503], http2: true }}
routes:
  - {{ name: h2, match: {{ path_prefix: /h2 }}, upstream: h2, strip_prefix: /h2 }}
  - {{ name: one, match: {{ path_prefix: /one }}, upstream: one, strip_prefix: /one }}
  - {{ name: pair, match: {{ path_prefix: /pair }}, upstream: pair, strip_prefix: /pair }}
  - {{ name: plain, match: {{ path_prefix: /plain }}, upstream: plain, strip_prefix: /plain }}
"#,
        one.url(),
        down.url(),
        up.url(),
        plain.url(),
        h2.url()
    ))
    .await;
    let http = client::http1();
    let call = |method: &str, path: &str, payload: ReqBodyKind| {
        let req = Request::builder().method(method).uri(proxy.url(path));
        let req = match payload {
            ReqBodyKind::InHand => req.body(body("in hand")),
            // Small: a fast upload of 128 KiB would close the connection
            // after it (see `HeadClock::grown`), and the next requests'
            // round robin would start on another worker's count.
            ReqBodyKind::Streamed => {
                req.body(BodyExt::boxed(StreamBody::new(upstream::chunks(16 * 1024))))
            }
        };
        client::send(&http, req.unwrap())
    };

    // One endpoint (a Service): the 503 is retried there, and the second
    // answer is the client's.
    let a = call("GET", "/one/once", ReqBodyKind::InHand).await;
    assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"one"[..]));
    assert_eq!(one_hits.load(Ordering::SeqCst), 2);
    // `retries` bounds it: three answers, the last one passed on.
    let a = call("GET", "/one/always", ReqBodyKind::InHand).await;
    assert_eq!(a.status, 503);
    assert_eq!(one_hits.load(Ordering::SeqCst), 5);
    // Not for a POST (it may have been acted on), nor a body that
    // streamed (no copy to send again).
    assert_eq!(
        call("POST", "/one/always", ReqBodyKind::InHand)
            .await
            .status,
        503
    );
    assert_eq!(
        call("PUT", "/one/always", ReqBodyKind::Streamed)
            .await
            .status,
        503
    );
    assert_eq!(one_hits.load(Ordering::SeqCst), 7);

    // Two endpoints: the retry goes to the other, so every PUT in hand
    // gets the live endpoint's answer.
    for _ in 0..4 {
        let a = call("PUT", "/pair/down-only", ReqBodyKind::InHand).await;
        assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"up"[..]));
    }
    // Round robin started on each twice.
    assert_eq!(down_hits.load(Ordering::SeqCst), 2);
    assert_eq!(up_hits.load(Ordering::SeqCst), 4);

    // Over HTTP/2 to the upstream (hyper's client rather than the in-task
    // exchange) alike.
    let a = call("GET", "/h2/once", ReqBodyKind::InHand).await;
    assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"h2"[..]));
    assert_eq!(h2_hits.load(Ordering::SeqCst), 2);

    // Without retry_on, a 503 is passed on as it came.
    assert_eq!(
        call("GET", "/plain/once", ReqBodyKind::InHand).await.status,
        503
    );
    assert_eq!(plain_hits.load(Ordering::SeqCst), 1);
}

enum ReqBodyKind {
    InHand,
    Streamed,
}

/// A raw HTTP/1.1 upstream that closes its first connection once it has
/// read a request (a pod killed mid-request), and answers `ok` on every
/// later one; it counts the connections it accepts.
async fn closing_first_connection() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counted = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            let first = counted.fetch_add(1, Ordering::SeqCst) == 0;
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    let Ok(n) = conn.read(&mut chunk).await else {
                        return;
                    };
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        buf.drain(..end + 4);
                        if first {
                            return;
                        }
                        let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if conn.write_all(answer).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, accepted)
}

#[tokio::test]
async fn a_connection_lost_before_the_answer_is_retried_with_reset() {
    let (with_reset, with_accepted) = closing_first_connection().await;
    let (without, without_accepted) = closing_first_connection().await;
    let (posted, posted_accepted) = closing_first_connection().await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: reset, endpoints: ["http://{with_reset}"], retry_on: [reset] }}
  - {{ name: plain, endpoints: ["http://{without}"] }}
  - {{ name: posted, endpoints: ["http://{posted}"], retry_on: [reset] }}
routes:
  - {{ name: reset, match: {{ path: /reset }}, upstream: reset }}
  - {{ name: posted, match: {{ path: /posted }}, upstream: posted }}
  - {{ name: plain, match: {{ path: /plain }}, upstream: plain }}
"#
    ))
    .await;
    // The first connection is lost after the request went out: sent again
    // on a new one, the GET gets its answer.
    let a = client::call("GET", &proxy.url("/reset")).await;
    assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"ok"[..]));
    assert_eq!(with_accepted.load(Ordering::SeqCst), 2);
    // Without `reset`, the client gets the 502.
    let a = client::call("GET", &proxy.url("/plain")).await;
    assert_eq!(a.status, 502);
    assert_eq!(without_accepted.load(Ordering::SeqCst), 1);
    // Nor is a POST sent twice: the upstream may have acted on it.
    let a = client::call("POST", &proxy.url("/posted")).await;
    assert_eq!(a.status, 502);
    assert_eq!(posted_accepted.load(Ordering::SeqCst), 1);
}

/// A raw HTTP/2 upstream that refuses its first stream (REFUSED_STREAM,
/// as a server going away does) and answers `ok` on every later one,
/// counting the streams it gets.
async fn refusing_first_stream() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let streams = Arc::new(AtomicUsize::new(0));
    let counted = streams.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let counted = counted.clone();
            tokio::spawn(async move {
                let Ok(mut conn) = h2::server::handshake(tcp).await else {
                    return;
                };
                while let Some(Ok((_req, mut respond))) = conn.accept().await {
                    if counted.fetch_add(1, Ordering::SeqCst) == 0 {
                        respond.send_reset(h2::Reason::REFUSED_STREAM);
                        continue;
                    }
                    let Ok(mut body) = respond.send_response(http::Response::new(()), false) else {
                        return;
                    };
                    let _ = body.send_data(Bytes::from_static(b"ok"), true);
                }
            });
        }
    });
    (addr, streams)
}

#[tokio::test]
async fn an_http2_stream_refused_before_the_answer_is_retried_with_reset() {
    let (with_reset, with_streams) = refusing_first_stream().await;
    let (without, without_streams) = refusing_first_stream().await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: reset, endpoints: ["http://{with_reset}"], http2: true, retry_on: [reset] }}
  - {{ name: plain, endpoints: ["http://{without}"], http2: true }}
routes:
  - {{ name: reset, match: {{ path: /reset }}, upstream: reset }}
  - {{ name: plain, match: {{ path: /plain }}, upstream: plain }}
"#
    ))
    .await;
    let a = client::call("GET", &proxy.url("/reset")).await;
    assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"ok"[..]));
    assert_eq!(with_streams.load(Ordering::SeqCst), 2);
    let a = client::call("GET", &proxy.url("/plain")).await;
    assert_eq!(a.status, 502);
    assert_eq!(without_streams.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_try_past_its_per_try_timeout_makes_way_for_the_next() {
    let (one, one_hits) = failing_at_times("one").await;
    let (posted, posted_hits) = failing_at_times("posted").await;
    let (stuck, stuck_hits) = failing_at_times("stuck").await;
    let (quick, quick_hits) = failing_at_times("quick").await;
    let (h2, h2_hits) = failing_at_times("h2").await;
    // Request timeouts far above the per-try ones: a try that waited for
    // them would run into the test client's 20 s.
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - name: one
    endpoints: ["{}"]
    retry_on: [504]
    per_try_timeout: 300ms
    timeouts: {{ request: 60s }}
  - name: posted
    endpoints: ["{}"]
    retry_on: [504]
    per_try_timeout: 300ms
    timeouts: {{ request: 1s }}
  - name: pair
    endpoints: ["{}", "{}"]
    retry_on: [504]
    per_try_timeout: 300ms
    timeouts: {{ request: 60s }}
  - name: h2
    endpoints: ["{}"]
    http2: true
    retry_on: [504]
    per_try_timeout: 300ms
    timeouts: {{ request: 60s }}
routes:
  - {{ name: one, match: {{ path_prefix: /one }}, upstream: one, strip_prefix: /one }}
  - {{ name: posted, match: {{ path_prefix: /posted }}, upstream: posted, strip_prefix: /posted }}
  - {{ name: pair, match: {{ path_prefix: /pair }}, upstream: pair, strip_prefix: /pair }}
  - {{ name: h2, match: {{ path_prefix: /h2 }}, upstream: h2, strip_prefix: /h2 }}
"#,
        one.url(),
        posted.url(),
        stuck.url(),
        quick.url(),
        h2.url(),
    ))
    .await;

    // The first try waits past its deadline; the second is answered.
    let a = client::call("GET", &proxy.url("/one/slow-once")).await;
    assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"one"[..]));
    assert_eq!(one_hits.load(Ordering::SeqCst), 2);
    // Every try runs out: the client gets the gateway timeout, long
    // before the request timeout.
    let a = client::call("GET", &proxy.url("/one/slow")).await;
    assert_eq!(a.status, 504);
    assert_eq!(a.json()["error"], "upstream timeout");
    assert_eq!(one_hits.load(Ordering::SeqCst), 4);

    // A POST is neither retried nor cut short: it waits for the request
    // timeout, on one try.
    let a = client::call("POST", &proxy.url("/posted/slow-once")).await;
    assert_eq!(a.status, 504);
    assert_eq!(posted_hits.load(Ordering::SeqCst), 1);

    // Two endpoints, one stuck: every GET gets the other's answer. (One
    // connection: one worker's round robin.)
    let mut http = client::Connection::open(proxy.addr).await;
    for _ in 0..4 {
        let req = Request::get(proxy.url("/pair/stuck-only"));
        let a = http.send(req.body(body("")).unwrap()).await;
        assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"quick"[..]));
    }
    assert_eq!(stuck_hits.load(Ordering::SeqCst), 2);
    assert_eq!(quick_hits.load(Ordering::SeqCst), 4);

    // Over HTTP/2 (hyper's client rather than the in-task exchange).
    let a = client::call("GET", &proxy.url("/h2/slow-once")).await;
    assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"h2"[..]));
    assert_eq!(h2_hits.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn the_retry_budget_passes_the_answer_on_once_spent() {
    // Each path's first request gets 503; the second is answered, except
    // under /hold, where it waits for `release`.
    let (arrived_tx, mut arrived) = tokio::sync::mpsc::unbounded_channel();
    let release = Arc::new(tokio::sync::Notify::new());
    let held = release.clone();
    let hits = Arc::new(std::sync::Mutex::new(std::collections::HashMap::new()));
    let counted = hits.clone();
    let up = upstream::serve(move |req: Request<hyper::body::Incoming>| {
        let path = req.uri().path().to_owned();
        let n = {
            let mut hits = counted.lock().unwrap();
            let n = hits.entry(path.clone()).or_insert(0);
            *n += 1;
            *n
        };
        let (arrived_tx, held) = (arrived_tx.clone(), held.clone());
        async move {
            if n == 1 {
                return Response::builder().status(503).body(full("busy")).unwrap();
            }
            if path.starts_with("/hold") {
                let _ = arrived_tx.send(());
                held.notified().await;
            }
            Response::new(full("done"))
        }
    })
    .await;
    let hits_of = |path: &str| hits.lock().unwrap().get(path).copied().unwrap_or(0);
    // Two workers: the budget is the upstream's, whichever worker retries.
    let proxy = ProxyProcess::start(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - name: app
    endpoints: ["{}"]
    retry_on: [503]
    retry_budget: {{ percent: 1, min_concurrent: 1 }}
routes: [{{ name: all, match: {{ path_prefix: / }}, upstream: app }}]
"#,
            up.url()
        ),
        &["--workers", "2"],
    )
    .await;

    // One retry under way (the upstream holds it)...
    let first = tokio::spawn(client::call_owned("GET", proxy.url("/hold")));
    tokio::time::timeout(Duration::from_secs(10), arrived.recv())
        .await
        .expect("the retry reached the upstream");
    // ...spends the budget: the next request's 503 is passed on, unretried.
    let a = client::call("GET", &proxy.url("/b")).await;
    assert_eq!((a.status.as_u16(), &a.body[..]), (503, &b"busy"[..]));
    assert_eq!(hits_of("/b"), 1);
    proxy
        .metrics_showing(&[
            r#"portcullis_upstream_retries_total{upstream="app",outcome="retried"} 1"#.into(),
            r#"portcullis_upstream_retries_total{upstream="app",outcome="budget_exhausted"} 1"#
                .into(),
        ])
        .await;
    // Once that retry has its answer, retries fit again.
    release.notify_one();
    let a = first.await.unwrap();
    assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"done"[..]));
    let a = client::call("GET", &proxy.url("/c")).await;
    assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"done"[..]));
    assert_eq!(hits_of("/c"), 2);
    proxy
        .metrics_showing(&[
            r#"portcullis_upstream_retries_total{upstream="app",outcome="retried"} 2"#.into(),
        ])
        .await;
}

#[tokio::test]
async fn an_endpoint_failing_answer_after_answer_leaves_the_rotation() {
    let (down, down_hits) = failing_at_times("down").await;
    let (up, _) = failing_at_times("up").await;
    let (retried_down, retried_down_hits) = failing_at_times("down").await;
    let (retried_up, _) = failing_at_times("up").await;
    // Two workers: the count is the endpoint's, whichever worker sees the
    // answers.
    let mut proxy = ProxyProcess::start(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: counted, endpoints: ["{}", "{}"], eject_after_5xx: 3, eject_for: 60s }}
  - {{ name: retried, endpoints: ["{}", "{}"], eject_after_5xx: 1, retry_on: [503] }}
routes:
  - {{ name: counted, match: {{ path_prefix: /counted }}, upstream: counted, strip_prefix: /counted }}
  - {{ name: retried, match: {{ path_prefix: /retried }}, upstream: retried, strip_prefix: /retried }}
"#,
            down.url(),
            up.url(),
            retried_down.url(),
            retried_up.url()
        ),
        &["--workers", "2"],
    )
    .await;
    // Round robin sends the failing endpoint every other request of each
    // worker, until its third 503 in a row: from then on, none.
    let mut failed = 0;
    for _ in 0..20 {
        let a = client::call("GET", &proxy.url("/counted/down-only")).await;
        match a.status.as_u16() {
            503 => failed += 1,
            200 => assert_eq!(&a.body[..], b"up"),
            s => panic!("status {s}"),
        }
    }
    assert_eq!((failed, down_hits.load(Ordering::SeqCst)), (3, 3));
    let status = proxy.status().await;
    let out = &status["config"]["ejected_endpoints"];
    assert_eq!(out.as_array().map(Vec::len), Some(1), "{out}");
    assert_eq!(out[0]["upstream"], "counted");
    assert_eq!(out[0]["endpoint"], &down.url()[7..]);
    let warning = "after failed answers in a row";
    proxy.wait_for_log(warning).await;
    assert_eq!(proxy.count_logs(warning), 1, "one warning for the change");

    // With retry_on, the client never sees the one failed answer that
    // took the endpoint out.
    for _ in 0..6 {
        let a = client::call("GET", &proxy.url("/retried/down-only")).await;
        assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"up"[..]));
    }
    assert_eq!(retried_down_hits.load(Ordering::SeqCst), 1);
}
