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
  - name: slow
    match: {{ path_prefix: / }}
    upstream: slow
    timeout: 300ms
"#,
        slow.url()
    ))
    .await;
    let started = Instant::now();
    let a = client::get(&proxy.url("/x")).await;
    let took = started.elapsed();
    release.notify_waiters();
    assert_eq!(a.status, 504);
    assert_eq!(a.json()["error"], "upstream timeout");
    assert_eq!(a.json()["route"], "slow");
    assert!(
        took >= Duration::from_millis(300),
        "answered before the timeout: {took:?}"
    );
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
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
routes:
  - name: by-host
    match: {{ path: "/to/{{host}}/{{*rest}}" }}
    url: "http://{{host}}:{port}"
"#
    ))
    .await;
    let ok = client::get(&proxy.url("/to/127.0.0.1/a/b")).await;
    assert_eq!(ok.status, 200);
    assert_eq!(ok.json()["path"], "/to/127.0.0.1/a/b");
    let bad = client::get(&proxy.url("/to/evil.com%2f@127.0.0.1/a")).await;
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["error"], "invalid path parameter");
}

#[tokio::test]
async fn malformed_http_gets_400_and_the_proxy_keeps_serving() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let proxy = Proxy::start_default(&[]).await;
    let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    conn.write_all(b"GARBAGE \x00\x01 NOT-HTTP\r\n\r\n")
        .await
        .unwrap();
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut buf))
        .await
        .expect("closed");
    let text = String::from_utf8_lossy(&buf);
    assert!(text.starts_with("HTTP/1.1 400"), "got {text:?}");
    assert_eq!(client::get(&proxy.url("/healthz")).await.status, 200);
}
