//! The default policy set, route by route, against real upstreams.

use bytes::Bytes;
use hyper::Request;

use crate::support::Proxy;
use crate::support::client::{self, body};
use crate::support::upstream::{self, Upstream};

struct Stack {
    proxy: Proxy,
    _upstreams: Vec<Upstream>,
}

/// The default policies with app-proxy, event sources and argo-server
/// pointed at echo servers.
async fn default_stack() -> Stack {
    let app = upstream::echo("app-proxy").await;
    let events = upstream::echo("eventsource").await;
    let argo = upstream::echo("argo-server").await;
    let proxy = Proxy::start_default(&[
        ("APP_PROXY_URL", app.url()),
        ("EVENTSOURCE_URL", events.url()),
        ("ARGO_SERVER_URL", argo.url()),
    ])
    .await;
    Stack {
        proxy,
        _upstreams: vec![app, events, argo],
    }
}

#[tokio::test]
async fn webhooks_keep_the_full_path_and_body() {
    let s = default_stack().await;
    let payload = Bytes::from(r#"{"ref":"refs/heads/main","commits":[]}"#);
    let req = Request::post(s.proxy.url("/webhooks/argo-events/github/push?delivery=7"))
        .header("x-github-event", "push")
        .body(body(payload.clone()))
        .unwrap();
    let a = client::send(&client::http1(), req).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    let j = a.json();
    assert_eq!(j["upstream"], "eventsource");
    assert_eq!(j["method"], "POST");
    assert_eq!(j["path"], "/webhooks/argo-events/github/push?delivery=7");
    assert_eq!(j["headers"]["x-github-event"], "push");
    assert_eq!(j["body_len"], payload.len());
    assert_eq!(j["body_fnv"], upstream::fnv(&payload));
}

#[tokio::test]
async fn webhook_bodies_over_webhook_max_body_get_413() {
    let events = upstream::echo("eventsource").await;
    let proxy = Proxy::start_default(&[
        ("EVENTSOURCE_URL", events.url()),
        ("WEBHOOK_MAX_BODY", "1KiB".into()),
    ])
    .await;
    let url = proxy.url("/webhooks/argo-events/github/push");
    let post = |n: usize| Request::post(&url).body(body(vec![b'{'; n])).unwrap();
    assert_eq!(client::send(&client::http1(), post(1024)).await.status, 200);
    let a = client::send(&client::http1(), post(1025)).await;
    assert_eq!(a.status, 413, "{:?}", a.body);
    assert_eq!(a.json()["route"], "webhooks");
}

#[tokio::test]
async fn workflows_strip_the_prefix() {
    let s = default_stack().await;
    let a = client::get(
        &s.proxy
            .url("/workflows/api/v1/workflows/argo?listOptions.limit=5"),
    )
    .await;
    assert_eq!(a.status, 200);
    let j = a.json();
    assert_eq!(j["upstream"], "argo-server");
    assert_eq!(j["path"], "/api/v1/workflows/argo?listOptions.limit=5");
    let a = client::get(&s.proxy.url("/workflows")).await;
    assert_eq!(a.json()["path"], "/");
}

#[tokio::test]
async fn app_proxy_keeps_the_path_and_sets_forwarded_headers() {
    let s = default_stack().await;
    let req = Request::get(s.proxy.url("/app-proxy/api/graphql"))
        .header("host", "runtime.example.com")
        .header("connection", "keep-alive, x-drop-me")
        .header("x-drop-me", "1")
        .header("x-forwarded-for", "203.0.113.7")
        .body(body(Bytes::new()))
        .unwrap();
    let a = client::send(&client::http1(), req).await;
    assert_eq!(a.status, 200);
    let j = a.json();
    assert_eq!(j["upstream"], "app-proxy");
    assert_eq!(j["path"], "/app-proxy/api/graphql");
    let h = &j["headers"];
    assert_eq!(h["x-forwarded-for"], "203.0.113.7, 127.0.0.1");
    assert_eq!(h["x-forwarded-proto"], "http");
    assert_eq!(h["x-forwarded-host"], "runtime.example.com");
    assert!(
        h.get("x-drop-me").is_none(),
        "a header named in Connection must not be forwarded: {h}"
    );
    assert!(h.get("keep-alive").is_none());
    // No trace context without OTEL_EXPORTER_OTLP_ENDPOINT.
    assert!(h.get("traceparent").is_none(), "{h}");
    // The upstream sees its own host, as with nginx's default proxy_set_header.
    assert_eq!(
        h["host"].as_str().unwrap(),
        s._upstreams[0].addr.to_string()
    );
    // /app-proxy itself and its directory form route the same way.
    assert_eq!(
        client::get(&s.proxy.url("/app-proxy")).await.json()["path"],
        "/app-proxy"
    );
    assert_eq!(
        client::get(&s.proxy.url("/app-proxy/")).await.json()["path"],
        "/app-proxy/"
    );
}

#[tokio::test]
async fn health_probes_are_answered_by_the_proxy() {
    let s = default_stack().await;
    let live = client::get(&s.proxy.url("/healthz")).await;
    assert_eq!(live.status, 200);
    let ready = client::get(&s.proxy.url("/readyz")).await;
    assert_eq!(ready.status, 200);
    assert_eq!(&ready.body[..], b"ok\n");
}

#[tokio::test]
async fn http2_cleartext_is_served_on_the_same_port() {
    let s = default_stack().await;
    let req = Request::get(s.proxy.url("/workflows/api/v1/info"))
        .body(body(Bytes::new()))
        .unwrap();
    let a = client::send(&client::h2c(), req).await;
    assert_eq!(a.status, 200);
    let j = a.json();
    assert_eq!(j["path"], "/api/v1/info");
    assert_eq!(j["headers"]["x-forwarded-host"], s.proxy.addr.to_string());
}

#[tokio::test]
async fn paths_with_dot_segments_are_routed_after_normalising() {
    let s = default_stack().await;
    // Without normalisation this would ride the webhook route to an event source.
    let a = client::get(&s.proxy.url("/webhooks/x/y/../../../app-proxy/api")).await;
    assert_eq!(a.json()["upstream"], "app-proxy");
    assert_eq!(a.json()["path"], "/app-proxy/api");
}

/// app-proxy's and argo-server's JSON is compressed for clients that take
/// it, as the replaced nginx gzipped it (`gzip on`); webhook answers are
/// not.
#[tokio::test]
async fn ui_and_workflow_answers_are_compressed_for_clients_that_take_it() {
    use std::io::Read;
    let s = default_stack().await;
    // The echo's JSON repeats the headers: this one makes it long enough.
    let pad = "p".repeat(4000);
    for (path, upstream, compressed) in [
        ("/app-proxy/api/graphql", "app-proxy", true),
        ("/workflows/api/v1/workflows/argo", "argo-server", true),
        ("/webhooks/argo-events/github/push", "eventsource", false),
    ] {
        let req = Request::get(s.proxy.url(path))
            .header("accept-encoding", "gzip, deflate, br")
            .header("x-pad", &pad)
            .body(body(Bytes::new()))
            .unwrap();
        let a = client::send(&client::http1(), req).await;
        assert_eq!(a.status, 200, "{path}");
        let json = if compressed {
            // A browser's Accept-Encoding: brotli, weighed as gzip is.
            assert_eq!(a.header("content-encoding"), Some("br"), "{path}");
            assert!(
                a.body.len() < pad.len() / 4,
                "{path}: {} bytes",
                a.body.len()
            );
            let mut out = Vec::new();
            brotli::Decompressor::new(&a.body[..], 4096)
                .read_to_end(&mut out)
                .unwrap();
            serde_json::from_slice::<serde_json::Value>(&out).unwrap()
        } else {
            assert_eq!(a.header("content-encoding"), None, "{path}");
            a.json()
        };
        assert_eq!(json["upstream"], upstream, "{path}");
        assert_eq!(json["headers"]["x-pad"], pad.as_str(), "{path}");
    }
}
