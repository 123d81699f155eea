//! The proxy's own error answers: status, JSON body, and CORS where asked.

use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::Request;
use tokio::sync::Notify;

use crate::support::client::{self, body};
use crate::support::upstream::{self, full};
use crate::support::{Proxy, closed_port};

#[tokio::test]
async fn no_route_is_404_with_json() {
    let proxy = Proxy::start_default(&[]).await;
    let a = client::get(&proxy.url("/nothing/here")).await;
    assert_eq!(a.status, 404);
    assert_eq!(a.header("content-type"), Some("application/json"));
    let j = a.json();
    assert_eq!(j["error"], "no route");
    assert_eq!(j["status"], 404);
}

#[tokio::test]
async fn app_proxy_down_is_502_with_cors_for_the_ui() {
    let dead = format!("http://127.0.0.1:{}", closed_port());
    let proxy = Proxy::start_default(&[("APP_PROXY_URL", dead)]).await;
    let req = Request::get(proxy.url("/app-proxy/api/graphql"))
        .header("origin", "https://g.codefresh.io")
        .body(body(Bytes::new()))
        .unwrap();
    let a = client::send(&client::http1(), req).await;
    assert_eq!(a.status, 502);
    let j = a.json();
    assert_eq!(j["error"], "upstream unreachable");
    assert_eq!(j["route"], "app-proxy");
    // Credentials are allowed, so the origin is echoed rather than `*`.
    assert_eq!(
        a.header("access-control-allow-origin"),
        Some("https://g.codefresh.io")
    );
    assert_eq!(a.header("access-control-allow-credentials"), Some("true"));
}

#[tokio::test]
async fn cors_origins_come_from_the_environment() {
    let dead = format!("http://127.0.0.1:{}", closed_port());
    let proxy = Proxy::start_default(&[
        ("APP_PROXY_URL", dead),
        (
            "APP_PROXY_CORS_ORIGINS",
            "https://a.example, https://b.example".into(),
        ),
    ])
    .await;
    for (origin, allowed) in [("https://b.example", true), ("https://evil.example", false)] {
        let req = Request::get(proxy.url("/app-proxy"))
            .header("origin", origin)
            .body(body(Bytes::new()))
            .unwrap();
        let a = client::send(&client::http1(), req).await;
        assert_eq!(a.status, 502);
        assert_eq!(
            a.header("access-control-allow-origin").is_some(),
            allowed,
            "origin {origin}"
        );
    }
}

#[tokio::test]
async fn slow_upstream_is_504_after_the_route_timeout() {
    let release = std::sync::Arc::new(Notify::new());
    let held = release.clone();
    let slow = upstream::serve(move |_req| {
        let held = held.clone();
        async move {
            held.notified().await;
            hyper::Response::new(full("late"))
        }
    })
    .await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: slow, endpoints: ["{}"] }}]
routes:
  - name: long
    match: {{ path_prefix: /long }}
    upstream: slow
    timeout: 11s
  - name: slow
    match: {{ path_prefix: / }}
    upstream: slow
    timeout: 300ms
"#,
        slow.url()
    ))
    .await;
    // A short timeout is tokio's timer; one of 10 s or more is kept by
    // the worker's list and woken by its anchor tick (`coarse_deadline`).
    // Over HTTP/2 for that: an HTTP/2 stream is a task of its own, which
    // nothing else wakes (an HTTP/1 connection's idle check does, every
    // half second).
    for (path, route, timeout) in [("/x", "slow", 300), ("/long", "long", 11_000)] {
        let started = Instant::now();
        let req = Request::get(proxy.url(path))
            .body(body(Bytes::new()))
            .unwrap();
        let a = client::send(&client::h2c(), req).await;
        let took = started.elapsed();
        release.notify_waiters();
        assert_eq!(a.status, 504, "{path}");
        assert_eq!(a.json()["error"], "upstream timeout");
        assert_eq!(a.json()["route"], route);
        assert!(
            took >= Duration::from_millis(timeout),
            "answered before the timeout: {took:?}"
        );
    }
}

/// A proxy forwarding everything to `echo` (an echo upstream reads the
/// whole body before it answers) with a request timeout of `timeout`.
async fn echo_with_timeout(echo: &upstream::Upstream, timeout: &str) -> Proxy {
    Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: echo, endpoints: ["{}"], timeouts: {{ request: {timeout} }} }}]
routes: [{{ name: upload, match: {{ path_prefix: / }}, upstream: echo }}]
"#,
        echo.url()
    ))
    .await
}

/// The request timeout is for the upstream's answer: an upload that takes
/// longer than it, while it keeps coming, is not cut (as nginx's
/// proxy_read_timeout starts once the request is sent).
#[tokio::test]
async fn an_upload_longer_than_the_request_timeout_goes_through() {
    let echo = upstream::echo("up").await;
    let proxy = echo_with_timeout(&echo, "1s").await;
    let (chunks, sent) = client::streamed_post(proxy.url("/upload"));
    // 15 chunks, 100 ms apart: 1.5 s of upload, never 1 s without a byte.
    for _ in 0..15 {
        chunks.send(Bytes::from(vec![b'u'; 4096])).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(chunks);
    let a = sent.await.unwrap();
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(a.json()["body_len"], 15 * 4096);
}

/// A client that stops sending its body gets 408 once it has sent nothing
/// for the request timeout (nginx's client_body_timeout), not a 504
/// blaming the upstream.
#[tokio::test]
async fn a_client_that_stops_sending_its_body_gets_408() {
    let echo = upstream::echo("up").await;
    let proxy = echo_with_timeout(&echo, "300ms").await;
    let (chunks, sent) = client::streamed_post(proxy.url("/upload"));
    chunks.send(Bytes::from(vec![b'u'; 4096])).await.unwrap();
    let a = sent.await.unwrap();
    drop(chunks);
    assert_eq!(a.status, 408, "{:?}", a.body);
    assert_eq!(a.json()["error"], "request body timeout");
    assert_eq!(a.json()["route"], "upload");
}

/// An upstream that stops reading the request body (and never answers)
/// is the upstream's timeout, 504, even though the body stops moving.
#[tokio::test]
async fn an_upstream_that_stops_reading_the_body_gets_a_504() {
    let never = std::sync::Arc::new(Notify::new());
    let held = never.clone();
    let deaf = upstream::serve(move |_req| {
        let held = held.clone();
        // Holds the request without reading its body: the body backs up
        // into the proxy once the socket buffers are full.
        async move {
            held.notified().await;
            hyper::Response::new(full("never"))
        }
    })
    .await;
    let proxy = echo_with_timeout(&deaf, "300ms").await;
    let (chunks, sent) = client::streamed_post(proxy.url("/upload"));
    // Fed until the proxy stops taking it (at most 256 MiB).
    let feeding = tokio::spawn(async move {
        for _ in 0..4096 {
            if chunks
                .send(Bytes::from(vec![b'u'; 64 << 10]))
                .await
                .is_err()
            {
                return;
            }
        }
    });
    let a = sent.await.unwrap();
    feeding.abort();
    assert_eq!(a.status, 504, "{:?}", a.body);
    assert_eq!(a.json()["error"], "upstream timeout");
}

#[tokio::test]
async fn oversized_request_head_is_431_with_json() {
    let proxy = Proxy::start_default(&[]).await;
    let big = "x".repeat(40 * 1024);
    let req = Request::get(proxy.url("/healthz"))
        .header("x-big", big)
        .body(body(Bytes::new()))
        .unwrap();
    let a = client::send(&client::http1(), req).await;
    assert_eq!(a.status, 431);
    assert_eq!(a.json()["error"], "request header too large");
    // A normal request on a fresh connection is still served.
    assert_eq!(client::get(&proxy.url("/healthz")).await.status, 200);
}

#[tokio::test]
async fn a_path_parameter_cannot_redirect_the_upstream_host() {
    let echo = upstream::echo("svc").await;
    let port = echo.addr.port();
    let mut proxy = crate::support::process::ProxyProcess::start(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
routes:
  - name: by-host
    match: {{ path: "/to/{{host}}/{{*rest}}" }}
    url: "http://{{host}}:{port}"
"#
        ),
        &[],
    )
    .await;
    let ok = client::get(&proxy.url("/to/127.0.0.1/a/b")).await;
    assert_eq!(ok.status, 200);
    assert_eq!(ok.json()["path"], "/to/127.0.0.1/a/b");
    // The access line names the host the template rendered.
    let line = proxy.wait_for_log(r#""path":"/to/127.0.0.1/a/b""#).await;
    let line: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(line["endpoint"], format!("127.0.0.1:{port}"), "{line}");
    let bad = client::get(&proxy.url("/to/evil.com%2f@127.0.0.1/a")).await;
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["error"], "invalid path parameter");
}

/// Heads hyper cannot parse get the proxy's JSON answer, not hyper's
/// empty one, and an access line naming hyper's reason; the proxy keeps
/// serving, and ordinary answers around them are untouched.
#[tokio::test]
async fn malformed_heads_get_a_json_400_and_an_access_line() {
    let mut proxy = crate::support::process::ProxyProcess::start(
        r#"
listeners: [{ name: edge, bind: "127.0.0.1:0" }]
routes: [{ name: v, match: { path: /v }, respond: { status: 400, body: "" } }]
"#,
        &[],
    )
    .await;
    let cases: [(&[u8], &str, &str); 4] = [
        (
            b"GARBAGE \x00\x01 NOT-HTTP\r\n\r\n",
            "malformed request head",
            "invalid URI",
        ),
        (
            b"GET /v HTTP/1.1\r\nhost: a\r\nno colon here\r\n\r\n",
            "malformed request head",
            "invalid HTTP header parsed",
        ),
        (
            b"GET /v HTTP/1.1\r\nhost: a\r\ncontent-length: abc\r\n\r\n",
            "malformed request head",
            "invalid content-length parsed",
        ),
        (
            b"GET /v HTTP/9\r\nhost: a\r\n\r\n",
            "malformed request head",
            "invalid HTTP version parsed",
        ),
    ];
    for (bytes, error, reason) in cases {
        let answer = client::raw(proxy.addr, bytes).await;
        let (status, json) = status_and_json(&answer);
        assert_eq!(status, 400, "{answer:?}");
        assert_eq!(json["error"], error, "{answer:?}");
        assert!(
            answer.contains("\r\ncontent-type: application/json\r\n"),
            "{answer:?}"
        );
        let line = proxy.wait_for_log(&format!("\"error\":\"{reason}\"")).await;
        let line: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(line["target"], "access", "{line}");
        assert_eq!(line["status"], 400, "{line}");
        assert_eq!(line["listener"], "edge", "{line}");
    }

    // After a kept-alive request, and pipelined behind one: the route's own
    // empty 400 stays as it is, and the garbage after it gets the JSON.
    for parts in [
        &[
            &b"GET /v HTTP/1.1\r\nhost: a\r\n\r\n"[..],
            b"BAD\x7f\r\n\r\n",
        ][..],
        &[&b"GET /v HTTP/1.1\r\nhost: a\r\n\r\nBAD\x7f\r\n\r\n"[..]][..],
    ] {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
        let mut buf = Vec::new();
        for part in parts {
            conn.write_all(part).await.unwrap();
            if parts.len() > 1 && buf.is_empty() {
                // The first answer is read before the garbage is sent.
                let mut chunk = [0u8; 1024];
                let n = conn.read(&mut chunk).await.unwrap();
                buf.extend_from_slice(&chunk[..n]);
            }
        }
        let _ = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut buf))
            .await
            .expect("closed");
        let text = String::from_utf8_lossy(&buf);
        let (first, second) = text.split_at(text.find("\r\n\r\n").unwrap() + 4);
        assert!(
            first.starts_with("HTTP/1.1 400 Bad Request\r\n"),
            "{text:?}"
        );
        assert!(first.contains("content-length: 0\r\n"), "{text:?}");
        assert!(!first.contains("application/json"), "{text:?}");
        let (status, json) = status_and_json(second);
        assert_eq!(
            (status, &json["error"]),
            (400, &"malformed request head".into()),
            "{text:?}"
        );
    }
    assert_eq!(client::get(&proxy.url("/v")).await.status, 400);
}

/// A head past hyper's own buffer (twice the listener's limit) is refused
/// by hyper before the proxy sees it: it gets the proxy's JSON 431 too.
#[tokio::test]
async fn a_head_past_hypers_buffer_gets_a_json_431() {
    let proxy = Proxy::start_default(&[]).await;
    let mut bytes = b"GET /healthz HTTP/1.1\r\nhost: a\r\nx-big: ".to_vec();
    bytes.extend(std::iter::repeat_n(b'x', 256 * 1024));
    bytes.extend_from_slice(b"\r\n\r\n");
    let answer = client::raw(proxy.addr, &bytes).await;
    let (status, json) = status_and_json(&answer);
    assert_eq!(status, 431, "{answer:?}");
    assert_eq!(json["error"], "request head too large");
    assert_eq!(client::get(&proxy.url("/healthz")).await.status, 200);

    // A client still writing a head of megabytes reads the 431 too, not
    // a reset: the proxy reads on and drops the rest before closing.
    let mut bytes = b"GET /healthz HTTP/1.1\r\nhost: a\r\nx-big: ".to_vec();
    bytes.resize(bytes.len() + (8 << 20), b'x');
    let answer = client::raw_written_whole(proxy.addr, &bytes).await;
    assert_eq!(status_and_json(&answer).0, 431, "{answer:?}");
}

/// A head still arriving is refused as soon as it passes the bound (twice
/// the listener's limit), not left to grow in hyper's read buffer, which
/// is sized for bodies (256 KiB), until the header-read timeout.
#[tokio::test]
async fn a_head_that_stalls_past_the_bound_is_refused_without_waiting() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Far beyond the wait below: only the bound can answer in time.
    let proxy = Proxy::start_yaml(
        r#"
listeners:
  - { name: http, bind: "127.0.0.1:0", header_read_timeout: 10m, max_request_header_size: 16KiB }
routes: [{ name: health, match: { path: /healthz }, health: live }]
"#,
    )
    .await;
    let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let mut head = b"GET /healthz HTTP/1.1\r\nhost: a\r\nx-big: ".to_vec();
    // Past the 32 KiB bound, well within the read buffer, and unfinished:
    // the writing side stays open.
    head.resize(100 * 1024, b'x');
    conn.write_all(&head).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), conn.read_to_end(&mut answer))
        .await
        .expect("no answer: the head was left to grow")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    let (status, json) = status_and_json(&answer);
    assert_eq!(status, 431, "{answer:?}");
    assert_eq!(json["error"], "request head too large");
    // Just under the bound is the listener's own limit's to refuse, with
    // the proxy's 431 (the head reaches the service).
    let mut head = b"GET /healthz HTTP/1.1\r\nhost: a\r\nconnection: close\r\nx-big: ".to_vec();
    head.resize(30 * 1024, b'x');
    head.extend_from_slice(b"\r\n\r\n");
    let answer = client::raw(proxy.addr, &head).await;
    let (status, json) = status_and_json(&answer);
    assert_eq!(status, 431, "{answer:?}");
    assert_eq!(json["error"], "request header too large");
}

/// The status code and JSON body of a raw HTTP/1.1 answer.
fn status_and_json(answer: &str) -> (u16, serde_json::Value) {
    let (status, body) = client::status_and_body(answer);
    (status, serde_json::from_str(body).unwrap_or_default())
}

/// A proxy that sends every path to `upstream`.
async fn proxy_to(upstream: &upstream::Upstream) -> Proxy {
    Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: svc, endpoints: ["{}"] }}]
routes: [{{ name: any, match: {{ path_prefix: / }}, upstream: svc }}]
"#,
        upstream.url()
    ))
    .await
}

#[tokio::test]
async fn an_http11_request_needs_exactly_one_host_header() {
    let (echo, hits) = upstream::counted_echo("svc").await;
    let proxy = proxy_to(&echo).await;
    for (raw, error) in [
        (
            &b"GET /a HTTP/1.1\r\nConnection: close\r\n\r\n"[..],
            "missing host header",
        ),
        (
            b"GET http://a.example/a HTTP/1.1\r\nConnection: close\r\n\r\n",
            "missing host header",
        ),
        (
            b"GET /a HTTP/1.1\r\nHost: a.example\r\nHost: b.example\r\nConnection: close\r\n\r\n",
            "more than one host header",
        ),
        (
            b"GET /a HTTP/1.1\r\nHost: a\xffb\r\nConnection: close\r\n\r\n",
            "invalid host header",
        ),
    ] {
        let (status, json) = status_and_json(&client::raw(proxy.addr, raw).await);
        assert_eq!((status, json["error"].as_str()), (400, Some(error)));
    }
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 0);
    // HTTP/1.0 may leave Host out; one Host is the usual case.
    for raw in [
        &b"GET /a HTTP/1.0\r\n\r\n"[..],
        b"GET /a HTTP/1.1\r\nHost: a.example\r\nConnection: close\r\n\r\n",
    ] {
        let (status, json) = status_and_json(&client::raw(proxy.addr, raw).await);
        assert_eq!((status, json["path"].as_str()), (200, Some("/a")));
    }
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 2);
}

/// RFC 9112 §3.2: a `Host` that is not `host[:port]` is a 400, on
/// HTTP/1.1 and HTTP/2 alike, and never reaches the upstream (where it
/// would arrive as X-Forwarded-Host).
#[tokio::test]
async fn an_invalid_host_is_400_on_http1_and_http2() {
    let (echo, hits) = upstream::counted_echo("svc").await;
    let proxy = proxy_to(&echo).await;
    let bad = ["a b@evil", "evil/path", "a,b", "a.example:80:80"];
    for host in bad {
        let raw = format!("GET /a HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n");
        let (status, json) = status_and_json(&client::raw(proxy.addr, raw.as_bytes()).await);
        assert_eq!(
            (status, json["error"].as_str()),
            (400, Some("invalid host header")),
            "{host:?}"
        );
    }
    // HTTP/2 with the host in `Host` (no :authority), as RFC 9113 §8.3.1
    // allows: the same check.
    let tcp = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .expect("h2c handshake");
    tokio::spawn(conn);
    for host in bad.iter().chain(&["a.example"]) {
        let req = hyper::Request::get("/a")
            .header("host", *host)
            .body(client::body(""))
            .unwrap();
        let resp = send.send_request(req).await.expect("an answer");
        let want = if *host == "a.example" { 200 } else { 400 };
        assert_eq!(resp.status(), want, "{host:?}");
    }
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_transfer_coding_other_than_chunked_is_501_and_never_forwarded() {
    let (echo, hits) = upstream::counted_echo("svc").await;
    let proxy = proxy_to(&echo).await;
    // hyper reads this body by its final chunked coding; forwarded, it
    // would reach the upstream with the gzip coding dropped.
    let gzipped = b"POST /a HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\
        Connection: close\r\n\r\n3\r\nabc\r\n0\r\n\r\n";
    let (status, json) = status_and_json(&client::raw(proxy.addr, gzipped).await);
    assert_eq!(status, 501);
    assert_eq!(json["error"], "unsupported transfer-encoding");
    assert_eq!(hits.load(std::sync::atomic::Ordering::SeqCst), 0);
    // Chunked alone (any case) is streamed through.
    let chunked = b"POST /a HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: Chunked\r\n\
        Connection: close\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
    let (status, json) = status_and_json(&client::raw(proxy.addr, chunked).await);
    assert_eq!(status, 200);
    assert_eq!(json["body_len"], 5);
    assert_eq!(json["body_fnv"], upstream::fnv(b"abcde"));
}

#[tokio::test]
async fn grpc_clients_get_the_proxys_errors_as_grpc_statuses() {
    let app = upstream::echo("app").await;
    let dead = format!("http://127.0.0.1:{}", closed_port());
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: app, endpoints: ["{app}"] }}
  - {{ name: dead, endpoints: ["{dead}"] }}
routes:
  - {{ name: app, match: {{ path_prefix: /app.Service }}, upstream: app }}
  - {{ name: dead, match: {{ path_prefix: /dead.Service }}, upstream: dead }}
  - name: limited
    match: {{ path_prefix: /limited.Service }}
    upstream: app
    rate_limit: {{ rate: 1/h, key: route }}
"#,
        app = app.url()
    ))
    .await;
    let h2 = client::h2c();
    let call = |path: &str, content_type: &str| {
        let req = Request::post(proxy.url(path))
            .header("content-type", content_type)
            .header("te", "trailers")
            .body(body(Bytes::from_static(b"\0\0\0\0\0")))
            .unwrap();
        client::send(&h2, req)
    };
    // Trailers-only answers: 200, the status and message in the head.
    for (path, code, message) in [
        ("/nowhere.Service/Call", "12", "no route"),
        ("/dead.Service/Call", "14", "upstream unreachable"),
    ] {
        let a = call(path, "application/grpc").await;
        assert_eq!(a.status, 200, "{path}: {:?}", a.body);
        assert_eq!(a.header("grpc-status"), Some(code), "{path}");
        assert_eq!(a.header("grpc-message"), Some(message), "{path}");
        assert_eq!(a.header("content-type"), Some("application/grpc"));
        assert!(a.body.is_empty(), "{path}: {:?}", a.body);
    }
    // The request's own gRPC content type is kept; other headers too.
    assert_eq!(
        call("/limited.Service/Call", "application/grpc-web+proto")
            .await
            .status,
        200
    );
    let a = call("/limited.Service/Call", "application/grpc-web+proto").await;
    assert_eq!(a.header("grpc-status"), Some("14"));
    assert_eq!(a.header("content-type"), Some("application/grpc-web+proto"));
    assert!(a.header("retry-after").is_some());
    // An upstream's answer passes as it is.
    let a = call("/app.Service/Call", "application/grpc").await;
    assert_eq!(a.json()["upstream"], "app");
    assert!(a.header("grpc-status").is_none());
    // Other clients keep the JSON.
    let a = call("/nowhere.Service/Call", "application/json").await;
    assert_eq!(
        (a.status.as_u16(), a.json()["error"].as_str()),
        (404, Some("no route"))
    );
}
