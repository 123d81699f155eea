//! A route's `max_request_body`: a declared length over it is answered
//! 413 before anything goes upstream, a streamed body that grows over it
//! is cut with 413, and an HTTP/1 client still writing its body reads the
//! answer instead of a reset (lingering close).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::{Request, Response};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::support::client::{self, body};
use crate::support::upstream::{self, Upstream};
use crate::support::{Proxy, assert_check_errors};

const LIMIT: usize = 64 * 1024;

type Client = hyper_util::client::legacy::Client<
    hyper_util::client::legacy::connect::HttpConnector,
    client::ReqBody,
>;

/// What the upstream made of a request body: its length when read to its
/// end, `None` when it broke off.
type Bodies = UnboundedReceiver<Option<usize>>;

/// An upstream that reads each request body and reports it (answering
/// with its length).
async fn body_reader() -> (Upstream, Bodies) {
    let (tx, rx) = unbounded_channel();
    let server = upstream::serve(move |req: Request<hyper::body::Incoming>| {
        let tx = tx.clone();
        async move {
            let read = req.into_body().collect().await.ok();
            let len = read.map(|b| b.to_bytes().len());
            let _ = tx.send(len);
            Response::new(upstream::full(len.map_or("cut".into(), |n| n.to_string())))
        }
    })
    .await;
    (server, rx)
}

/// The reports the upstream has made so far.
fn reports(bodies: &mut Bodies) -> Vec<Option<usize>> {
    std::iter::from_fn(|| bodies.try_recv().ok()).collect()
}

async fn start(app: &Upstream) -> Proxy {
    Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: app, endpoints: ["{0}"] }}
  - {{ name: app-h2, endpoints: ["{0}"], http2: true }}
routes:
  - {{ name: small, match: {{ path: /small }}, upstream: app, max_request_body: 64KiB }}
  - {{ name: small-h2, match: {{ path: /small-h2 }}, upstream: app-h2, max_request_body: 64KiB }}
  - {{ name: free, match: {{ path: /free }}, upstream: app }}
"#,
        app.url()
    ))
    .await
}

fn assert_too_large(answer: &client::Answer, route: &str) {
    assert_eq!(answer.status, 413, "{:?}", answer.body);
    let json = answer.json();
    assert_eq!(json["error"], "request body too large", "{json:#}");
    assert_eq!(json["route"], route, "{json:#}");
}

async fn post(client: &Client, url: String, data: Vec<u8>) -> client::Answer {
    client::send(client, Request::post(url).body(body(data)).unwrap()).await
}

#[tokio::test]
async fn a_declared_length_over_the_limit_is_413_and_never_sent_upstream() {
    let (app, mut bodies) = body_reader().await;
    let proxy = start(&app).await;
    let h1 = client::http1();

    // Exactly the limit passes.
    let answer = post(&h1, proxy.url("/small"), vec![b'a'; LIMIT]).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.body, LIMIT.to_string());

    // One byte more does not, and the connection is closed after it.
    let answer = post(&h1, proxy.url("/small"), vec![b'a'; LIMIT + 1]).await;
    assert_too_large(&answer, "small");
    assert_eq!(answer.header("connection"), Some("close"));
    // A route without a limit takes it.
    let answer = post(&h1, proxy.url("/free"), vec![b'a'; 4 * LIMIT]).await;
    assert_eq!(answer.body, (4 * LIMIT).to_string());

    // Over HTTP/2 the stream is refused, not the connection: no
    // connection header, and the next request on it goes through.
    let h2 = client::h2c();
    let answer = post(&h2, proxy.url("/small"), vec![b'a'; LIMIT + 1]).await;
    assert_too_large(&answer, "small");
    assert_eq!(answer.header("connection"), None);
    let answer = post(&h2, proxy.url("/small"), vec![b'a'; 10]).await;
    assert_eq!(answer.body, "10");

    // Only the bodies that passed went upstream, each whole.
    assert_eq!(
        reports(&mut bodies),
        [Some(LIMIT), Some(4 * LIMIT), Some(10)]
    );
    proxy.stop().await;
}

#[tokio::test]
async fn a_client_still_writing_its_body_reads_the_413_not_a_reset() {
    let (app, mut bodies) = body_reader().await;
    let proxy = start(&app).await;
    // No `Expect: 100-continue`: the client sends all of its 8 MiB at
    // once, as many do, and reads only then. Closed with that data
    // unread, the socket would reset and these writes fail.
    let text = client::post_all_then_read(proxy.addr, "x", "/small", 8 << 20).await;
    assert!(text.starts_with("HTTP/1.1 413 "), "{text}");
    assert!(text.contains("\"request body too large\""), "{text}");
    assert_eq!(reports(&mut bodies), []);
    proxy.stop().await;
}

#[tokio::test]
async fn a_streamed_body_growing_over_the_limit_is_cut_with_413() {
    let (app, mut bodies) = body_reader().await;
    let proxy = start(&app).await;
    for path in ["/small", "/small-h2"] {
        // Chunked, so no length to check first: counted as it streams.
        let (tx, sent) = client::streamed_post(proxy.url(path));
        for _ in 0..8 {
            if tx.send(Bytes::from(vec![b'a'; 16 * 1024])).await.is_err() {
                break;
            }
        }
        drop(tx);
        let answer = sent.await.unwrap();
        assert_too_large(&answer, &path[1..]);
        // The upstream got the start of the body, then the cut.
        let report = tokio::time::timeout(Duration::from_secs(10), bodies.recv()).await;
        assert_eq!(
            report.expect("upstream report in 10 s"),
            Some(None),
            "{path}"
        );

        // Up to the limit, streamed, it passes whole.
        let (tx, sent) = client::streamed_post(proxy.url(path));
        for _ in 0..4 {
            tx.send(Bytes::from(vec![b'a'; 16 * 1024])).await.unwrap();
        }
        drop(tx);
        assert_eq!(sent.await.unwrap().body, LIMIT.to_string(), "{path}");
        assert_eq!(reports(&mut bodies), [Some(LIMIT)], "{path}");
    }
    proxy.stop().await;
}

#[test]
fn check_names_a_bad_limit() {
    assert_check_errors(
        r#"
listeners: [{ name: http, bind: "127.0.0.1:0" }]
upstreams: [{ name: app, endpoints: ["http://127.0.0.1:9"] }]
routes:
  - { name: zero, match: { path: /a }, upstream: app, max_request_body: 0 }
  - { name: words, match: { path: /b }, upstream: app, max_request_body: lots }
"#,
        &[
            (5, "must be above 0 (leave it out for no limit)"),
            (6, "`lots` is not a size"),
        ],
    );
}

/// What an upstream saw of a request: its head arriving, then its body
/// read to the end (`Some(len)`) or cut (`None`).
#[derive(Debug, PartialEq)]
enum Seen {
    Arrived,
    Body(Option<usize>),
}

/// An upstream that reports each request's arrival and how its body
/// ended, on one channel whichever endpoint it is.
async fn reporting_upstream(tx: tokio::sync::mpsc::UnboundedSender<Seen>) -> Upstream {
    upstream::serve(move |req: Request<hyper::body::Incoming>| {
        let tx = tx.clone();
        async move {
            let _ = tx.send(Seen::Arrived);
            let read = req.into_body().collect().await.ok();
            let len = read.map(|b| b.to_bytes().len());
            let _ = tx.send(Seen::Body(len));
            Response::new(upstream::full(len.map_or("cut".into(), |n| n.to_string())))
        }
    })
    .await
}

/// A client whose chunked body breaks its framing (a chunk size line
/// `zz`, a chunk longer than it said) sent the bad bytes: it gets a 400,
/// the upstream, which had the head and the start of the body, sees the
/// request cut rather than completed, and nothing counts against the
/// upstream: no 502 for the route, no failed answer for the endpoint
/// (one failure would eject it here).
#[tokio::test]
async fn a_malformed_chunked_body_is_the_clients_400_not_the_upstreams_failure() {
    let (tx, mut seen) = unbounded_channel();
    let (a, b) = (
        reporting_upstream(tx.clone()).await,
        reporting_upstream(tx).await,
    );
    let proxy = crate::support::process::ProxyProcess::start(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: app, endpoints: ["{0}", "{1}"], eject_after_5xx: 1, eject_for: 60s }}
  - {{ name: app-h2, endpoints: ["{0}", "{1}"], http2: true, eject_after_5xx: 1, eject_for: 60s }}
routes:
  - {{ name: up, match: {{ path: /up }}, upstream: app }}
  - {{ name: up-h2, match: {{ path: /up-h2 }}, upstream: app-h2 }}
"#,
            a.url(),
            b.url()
        ),
        &["--workers", "1"],
    )
    .await;
    let cases: [(&str, &[u8]); 3] = [
        ("/up", b"zz\r\n"),
        ("/up", b"3\r\nabcdef\r\n0\r\n\r\n"),
        ("/up-h2", b"zz\r\n"),
    ];
    for (path, bad) in cases {
        let arrived = async { assert_eq!(seen.recv().await, Some(Seen::Arrived)) };
        let answer =
            crate::support::client::broken_chunked_post(proxy.addr, ("t", path), bad, arrived)
                .await;
        assert!(
            crate::support::client::is_unreadable_body_400(&answer),
            "{path} {bad:?}: {answer}"
        );
        let ended = tokio::time::timeout(Duration::from_secs(10), seen.recv()).await;
        assert_eq!(
            ended.expect("the upstream's read ended"),
            Some(Seen::Body(None)),
            "{path} {bad:?}: the upstream's request was not cut"
        );
    }
    // Both endpoints of both upstreams still in the rotation, and the
    // answers counted as the client's.
    let status = proxy.status().await;
    let out = &status["config"]["ejected_endpoints"];
    assert_eq!(out.as_array().map(Vec::len), Some(0), "{out}");
    let metrics = proxy
        .metrics_showing(&[
            r#"portcullis_requests_total{route="up",code="400"} 2"#.into(),
            r#"portcullis_requests_total{route="up-h2",code="400"} 1"#.into(),
        ])
        .await;
    assert!(!metrics.contains(r#"code="502""#), "{metrics}");
    for _ in 0..4 {
        let ok = client::call("POST", &proxy.url("/up")).await;
        assert_eq!(ok.status, 200);
    }
}
