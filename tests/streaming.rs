//! Bodies stream through the proxy: SSE event by event, large uploads and
//! downloads with bounded memory, WebSocket frames both ways.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper::{Request, Response};
use tokio::sync::Notify;

use crate::support::Proxy;
use crate::support::client::{self, body};
use crate::support::process::ProxyProcess;
use crate::support::upstream::{self, RespBody};

/// An SSE upstream that sends one event, then waits for `release` before
/// sending the second and ending the stream.
async fn sse_upstream(release: Arc<Notify>) -> upstream::Upstream {
    upstream::serve(move |_req| {
        let release = release.clone();
        async move {
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(4);
            tokio::spawn(async move {
                let _ = tx
                    .send(Ok(Frame::data(Bytes::from_static(
                        b"event: status\ndata: one\n\n",
                    ))))
                    .await;
                release.notified().await;
                let _ = tx
                    .send(Ok(Frame::data(Bytes::from_static(
                        b"event: status\ndata: two\n\n",
                    ))))
                    .await;
            });
            let stream = tokio_stream_from(rx);
            Response::builder()
                .header("content-type", "text/event-stream")
                .header("cache-control", "no-cache")
                .body(BodyExt::boxed(StreamBody::new(stream)) as RespBody)
                .expect("response")
        }
    })
    .await
}

fn tokio_stream_from<T: Send + 'static>(
    mut rx: tokio::sync::mpsc::Receiver<T>,
) -> impl futures_util::Stream<Item = T> + Send + 'static {
    futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx))
}

/// GETs the event stream at `url` through the proxy, checks that its
/// first event (from [`sse_upstream`]) arrives, and returns the rest.
async fn first_event(url: &str) -> hyper::body::Incoming {
    let req = Request::get(url)
        .header("accept", "text/event-stream")
        .body(body(Bytes::new()))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), client::http1().request(req))
        .await
        .expect("head in time")
        .expect("response");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let mut body = resp.into_body();
    let first = tokio::time::timeout(Duration::from_secs(10), body.frame())
        .await
        .expect("first event in time")
        .expect("frame")
        .expect("ok");
    assert_eq!(
        first.data_ref().map(|d| &d[..]),
        Some(&b"event: status\ndata: one\n\n"[..])
    );
    body
}

#[tokio::test]
async fn sse_events_arrive_one_by_one_before_the_upstream_finishes() {
    let release = Arc::new(Notify::new());
    let argo = sse_upstream(release.clone()).await;
    let proxy = Proxy::start_default(&[("ARGO_SERVER_URL", argo.url())]).await;
    // The first event must arrive while the upstream is still holding the
    // second one back: a buffering proxy would wait for the end and time out.
    let body = first_event(&proxy.url("/workflows/api/v1/workflow-events/argo")).await;
    release.notify_one();
    let rest = tokio::time::timeout(Duration::from_secs(10), body.collect())
        .await
        .expect("rest")
        .expect("ok")
        .to_bytes();
    assert_eq!(&rest[..], b"event: status\ndata: two\n\n");
}

/// The access line says whether the client got the whole response:
/// `aborted` when an HTTP/2 client resets its stream mid-response (as when
/// an HTTP/1 client leaves, or the upstream's body breaks), not for a
/// response that ended, nor for a HEAD answer, whose body is never sent.
#[tokio::test]
async fn a_response_its_http2_client_resets_midway_is_logged_aborted() {
    // Never released: the stream stays open after its first event.
    let held = Arc::new(Notify::new());
    let events = sse_upstream(held.clone()).await;
    let echo = upstream::echo("whole").await;
    let mut proxy = ProxyProcess::start(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: events, endpoints: ["{}"] }}
  - {{ name: echo, endpoints: ["{}"] }}
routes:
  - {{ name: events, match: {{ path: /events }}, upstream: events }}
  - {{ name: whole, match: {{ path: /whole }}, upstream: echo }}
  - {{ name: local, match: {{ path: /local }}, respond: {{ status: 200, body: hello }} }}
"#,
            events.url(),
            echo.url()
        ),
        &[],
    )
    .await;
    let h2 = client::h2c();
    let base = proxy.url("");
    let req = |method: &str, path: &str| {
        Request::builder()
            .method(method)
            .uri(format!("{base}{path}"))
            .body(body(Bytes::new()))
            .unwrap()
    };
    let access = async |proxy: &mut ProxyProcess, path: &str| {
        let line = proxy.wait_for_log(&format!("\"path\":\"{path}\"")).await;
        let v: serde_json::Value = serde_json::from_str(&line).expect("a JSON log line");
        (v["status"].as_u64(), v["aborted"].as_bool())
    };

    let resp = h2.request(req("GET", "/events")).await.unwrap();
    let mut events = resp.into_body();
    let first = tokio::time::timeout(Duration::from_secs(10), events.frame())
        .await
        .expect("first event in time");
    assert!(first.is_some_and(|f| f.is_ok()));
    // Dropping the body resets the stream.
    drop(events);
    assert_eq!(access(&mut proxy, "/events").await, (Some(200), Some(true)));

    assert_eq!(client::send(&h2, req("GET", "/whole")).await.status, 200);
    assert_eq!(access(&mut proxy, "/whole").await, (Some(200), Some(false)));
    assert_eq!(client::send(&h2, req("HEAD", "/local")).await.status, 200);
    assert_eq!(access(&mut proxy, "/local").await, (Some(200), Some(false)));
    drop(held);
}

/// An upstream that starts a response and then sends nothing is cut at its
/// read timeout (nginx's `proxy_read_timeout`), rather than holding the
/// client and the upstream connection forever.
#[tokio::test]
async fn a_response_the_upstream_stops_sending_is_cut_at_the_read_timeout() {
    // Never released: the stream stays open after its first event.
    let held = Arc::new(Notify::new());
    let stuck = sse_upstream(held.clone()).await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: stuck, endpoints: ["{}"], timeouts: {{ read: 300ms }} }}]
routes: [{{ name: events, match: {{ path: /events }}, upstream: stuck }}]
"#,
        stuck.url()
    ))
    .await;
    let body = first_event(&proxy.url("/events")).await;
    // The chunked body ends without its last chunk: the client sees an
    // error, not a clean end.
    let rest = tokio::time::timeout(Duration::from_secs(10), body.collect())
        .await
        .expect("the body is cut, not left hanging");
    assert!(rest.is_err(), "the stalled body ended cleanly");
    drop(held);
}

#[tokio::test]
async fn websocket_echo_through_app_proxy() {
    let ws = upstream::websocket_echo().await;
    let proxy = Proxy::start_default(&[("APP_PROXY_URL", ws.url())]).await;
    let url = format!("ws://{}/app-proxy/ws", proxy.addr);
    crate::support::client::websocket_echo(url).await;
}

/// After a 101 the connection carries the upstream's bytes as they are,
/// even bytes that look like hyper's own answer to a bad head (which the
/// proxy replaces with its JSON one between requests).
#[tokio::test]
async fn upgraded_bytes_pass_untouched_even_when_they_look_like_an_http_answer() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const LOOKALIKE: &[u8] = b"HTTP/1.1 400 Bad Request\r\nconnection: close\r\ncontent-length: 0\r\ndate: Mon, 23 Nov 2026 21:15:38 GMT\r\n\r\n";
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let upstream = tokio::spawn(async move {
        let (mut conn, _) = listener.accept().await.unwrap();
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            let mut byte = [0u8; 1];
            conn.read_exact(&mut byte).await.unwrap();
            head.push(byte[0]);
        }
        conn.write_all(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\nsec-websocket-accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n\r\n")
            .await
            .unwrap();
        // Waits for the client's first bytes, so its side has seen the 101
        // flushed before the lookalike goes out.
        let mut first = [0u8; 4];
        conn.read_exact(&mut first).await.unwrap();
        conn.write_all(LOOKALIKE).await.unwrap();
        conn.shutdown().await.unwrap();
    });
    let proxy = Proxy::start_default(&[("APP_PROXY_URL", format!("http://{addr}"))]).await;
    let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    conn.write_all(b"GET /app-proxy/ws HTTP/1.1\r\nhost: a\r\nconnection: upgrade\r\nupgrade: websocket\r\nsec-websocket-version: 13\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
        .await
        .unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8; 1];
        conn.read_exact(&mut byte).await.unwrap();
        head.push(byte[0]);
    }
    assert!(
        head.starts_with(b"HTTP/1.1 101"),
        "{:?}",
        String::from_utf8_lossy(&head)
    );
    conn.write_all(b"ping").await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut rest))
        .await
        .expect("the upstream's close reaches the client")
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&rest),
        String::from_utf8_lossy(LOOKALIKE)
    );
    upstream.await.unwrap();
}

#[tokio::test]
async fn websocket_upgrade_is_refused_on_routes_that_do_not_allow_it() {
    let ws = upstream::websocket_echo().await;
    let proxy = Proxy::start_default(&[("ARGO_SERVER_URL", ws.url())]).await;
    let url = format!("ws://{}/workflows/ws", proxy.addr);
    let result = tokio::time::timeout(
        Duration::from_secs(10),
        tokio_tungstenite::connect_async(url),
    )
    .await
    .expect("answer in time");
    assert!(
        result.is_err(),
        "the workflows route does not allow upgrades"
    );
}

#[tokio::test]
async fn an_upgrade_to_anything_but_websocket_goes_as_a_plain_request() {
    // curl --http2 asks for h2c this way; the route allows WebSocket only.
    let echo = upstream::echo("app-proxy").await;
    let proxy = Proxy::start_default(&[("APP_PROXY_URL", echo.url())]).await;
    let req = Request::get(proxy.url("/app-proxy/x"))
        .header("host", "a.example")
        .header("connection", "Upgrade, HTTP2-Settings")
        .header("upgrade", "h2c")
        .header("http2-settings", "AAMAAABkAAQCAAAAAAIAAAAA")
        .body(body(Bytes::new()))
        .unwrap();
    let answer = client::send(&client::http1(), req).await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let seen = &answer.json()["headers"];
    for hop in ["upgrade", "http2-settings"] {
        assert!(
            seen.get(hop).is_none(),
            "{hop} reached the upstream: {seen}"
        );
    }
    assert_ne!(seen["connection"], "upgrade", "{seen}");
}

const FIFTY_MB: u64 = 50 * 1024 * 1024;

#[tokio::test]
async fn fifty_megabytes_up_and_down_with_bounded_proxy_memory() {
    let echo = upstream::echo("sink").await;
    let source = upstream::serve(|_req| async {
        Response::new(BodyExt::boxed(StreamBody::new(upstream::chunks(FIFTY_MB))) as RespBody)
    })
    .await;
    let proxy = ProxyProcess::start(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: sink, endpoints: ["{}"] }}
  - {{ name: source, endpoints: ["{}"] }}
routes:
  - {{ name: up, match: {{ path: /upload }}, upstream: sink }}
  - {{ name: down, match: {{ path: /download }}, upstream: source }}
"#,
            echo.url(),
            source.url()
        ),
        // One worker: each worker thread has its own allocator arenas, and
        // which of them serve the two transfers would change the figure.
        &["--workers", "1"],
    )
    .await;
    // Warm up (pools, allocator arenas) before taking the baseline.
    assert_eq!(client::get(&proxy.url("/upload")).await.status, 200);
    let baseline = proxy.peak_rss_kib();

    let req = Request::post(proxy.url("/upload"))
        .body(BodyExt::boxed(StreamBody::new(upstream::chunks(FIFTY_MB))))
        .unwrap();
    let a = client::send(&client::http1(), req).await;
    assert_eq!(a.status, 200);
    assert_eq!(a.json()["body_len"], FIFTY_MB);

    let resp = client::http1()
        .request(
            Request::get(proxy.url("/download"))
                .body(body(Bytes::new()))
                .unwrap(),
        )
        .await
        .unwrap();
    let mut body = resp.into_body();
    let mut received = 0u64;
    while let Some(frame) = tokio::time::timeout(Duration::from_secs(20), body.frame())
        .await
        .expect("progress")
    {
        received += frame.unwrap().data_ref().map_or(0, |d| d.len() as u64);
    }
    assert_eq!(received, FIFTY_MB);

    let growth_kib = proxy.peak_rss_kib().saturating_sub(baseline);
    eprintln!("proxy peak RSS: baseline {baseline} KiB, growth {growth_kib} KiB over 2 x 50 MiB");
    assert!(
        growth_kib < 16 * 1024,
        "proxy memory grew by {growth_kib} KiB: bodies are being buffered"
    );
}

/// Reads one answer off `conn`: its head (lower-cased) and its body, by
/// its `Content-Length`.
async fn read_answer(conn: &mut tokio::net::TcpStream) -> (String, Vec<u8>) {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    let end = loop {
        if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = tokio::time::timeout(Duration::from_secs(20), conn.read(&mut chunk))
            .await
            .expect("an answer")
            .unwrap();
        assert!(n > 0, "closed before an answer: {got:?}");
        got.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&got[..end]).to_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .and_then(|v| v.trim().parse().ok())
        .expect("a content-length");
    let mut body = got[end..].to_vec();
    while body.len() < length {
        let n = conn.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed within the body");
        body.extend_from_slice(&chunk[..n]);
    }
    (head, body)
}

/// hyper keeps the read buffer a fast upload grew (to 256 KiB) for the
/// connection's life: a connection that carried one closes after its
/// answer, so an idle client does not hold it. Small requests keep theirs.
#[tokio::test]
async fn a_connection_that_carried_a_large_upload_closes_after_its_answer() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let echo = upstream::echo("sink").await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: sink, endpoints: ["{}"] }}]
routes: [{{ name: all, match: {{ path_prefix: / }}, upstream: sink }}]
"#,
        echo.url()
    ))
    .await;
    let small = |n: usize| {
        let mut raw =
            format!("POST /s HTTP/1.1\r\nhost: a\r\ncontent-length: {n}\r\n\r\n").into_bytes();
        raw.resize(raw.len() + n, b's');
        raw
    };
    let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    for _ in 0..3 {
        conn.write_all(&small(4096)).await.unwrap();
        let (head, body) = read_answer(&mut conn).await;
        assert!(head.starts_with("http/1.1 200"), "{head}");
        assert!(!head.contains("connection: close"), "{head}");
        assert!(String::from_utf8_lossy(&body).contains("\"body_len\":4096"));
    }

    // 32 MiB written at once: the proxy's reads fill its buffer, which
    // doubles each time up to its size.
    const BIG: usize = 32 << 20;
    let mut raw =
        format!("PUT /b HTTP/1.1\r\nhost: a\r\ncontent-length: {BIG}\r\n\r\n").into_bytes();
    raw.resize(raw.len() + BIG, b'b');
    let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    conn.write_all(&raw).await.unwrap();
    let (head, body) = read_answer(&mut conn).await;
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(String::from_utf8_lossy(&body).contains(&format!("\"body_len\":{BIG}")));
    assert!(head.contains("connection: close"), "{head}");
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(20), conn.read_to_end(&mut rest)).await;
    assert!(matches!(closed, Ok(Ok(0))), "{closed:?} {rest:?}");
}
