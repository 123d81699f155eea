//! A route's `mirror`: a share of its requests also goes to another
//! upstream, whose answers nobody waits for.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::{Request, Response};
use tokio::sync::Notify;
use tokio::sync::mpsc::unbounded_channel;

use crate::support::assert_check_errors;
use crate::support::client::{self, body};
use crate::support::process::ProxyProcess;
use crate::support::upstream::{self, full};

/// What the mirror saw of a request.
#[derive(Debug, PartialEq)]
struct Copy {
    method: String,
    path: String,
    body: Bytes,
    forwarded_for: bool,
}

/// The proxy with route `all` mirroring every request from `app` to
/// `shadow`, and route `half` half of them.
async fn start_mirroring(app: &str, shadow: &str, args: &[&str]) -> ProxyProcess {
    let yaml = format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: app, endpoints: ["{app}"] }}
  - {{ name: shadow, endpoints: ["{shadow}"] }}
routes:
  - {{ name: all, match: {{ path_prefix: /all }}, upstream: app, mirror: {{ upstream: shadow }} }}
  - {{ name: half, match: {{ path_prefix: /half }}, upstream: app, mirror: {{ upstream: shadow, percent: 50 }} }}
"#
    );
    ProxyProcess::start(&yaml, args).await
}

#[tokio::test]
async fn a_share_of_the_requests_is_mirrored_without_waiting_for_it() {
    let app = upstream::echo("app").await;
    // The mirror notes each copy, then holds it until the test ends.
    let (tx, mut copies) = unbounded_channel();
    let release = Arc::new(Notify::new());
    let held = release.clone();
    let shadow = upstream::serve(move |req: Request<hyper::body::Incoming>| {
        let (tx, held) = (tx.clone(), held.clone());
        async move {
            let method = req.method().to_string();
            let path = req.uri().to_string();
            let forwarded_for = req.headers().contains_key("x-forwarded-for");
            let body = req.into_body().collect().await.unwrap().to_bytes();
            let _ = tx.send(Copy {
                method,
                path,
                body,
                forwarded_for,
            });
            held.notified().await;
            Response::new(full("shadow"))
        }
    })
    .await;
    let proxy = start_mirroring(&app.url(), &shadow.url(), &["--workers", "2"]).await;
    let mut next_copy = async || {
        tokio::time::timeout(Duration::from_secs(10), copies.recv())
            .await
            .expect("a copy reached the mirror")
            .unwrap()
    };

    // The client has the upstream's answer while the mirror still holds
    // its copy, which came with the same method, path, body and headers.
    let req = Request::post(proxy.url("/all/x?q=1"))
        .body(body("payload"))
        .unwrap();
    let a = client::send(&client::http1(), req).await;
    assert_eq!(
        (a.status.as_u16(), a.json()["upstream"].as_str()),
        (200, Some("app"))
    );
    assert_eq!(a.json()["body_len"], 7);
    let copy = next_copy().await;
    assert_eq!(
        copy,
        Copy {
            method: "POST".into(),
            path: "/all/x?q=1".into(),
            body: Bytes::from_static(b"payload"),
            forwarded_for: true,
        }
    );

    // Half the route's requests, evenly, whichever worker takes them.
    for _ in 0..4 {
        assert_eq!(client::get(&proxy.url("/half")).await.status, 200);
    }
    for _ in 0..2 {
        assert_eq!(next_copy().await.path, "/half");
    }

    // A streamed body is copied to the mirror as the upstream reads it.
    let streamed = Request::post(proxy.url("/all/stream"))
        .body(BodyExt::boxed(StreamBody::new(upstream::chunks(
            192 * 1024,
        ))))
        .unwrap();
    let a = client::send(&client::http1(), streamed).await;
    assert_eq!(a.json()["body_len"], 192 * 1024);
    let copy = next_copy().await;
    assert_eq!(
        (copy.method.as_str(), copy.path.as_str()),
        ("POST", "/all/stream")
    );
    assert_eq!(copy.body.len(), 192 * 1024);
    assert!(copy.body.iter().all(|&b| b == 0x5a), "the bytes sent");
    proxy
        .metrics_showing(&[
            r#"portcullis_route_mirrored_total{route="all",outcome="sent"} 2"#.into(),
            r#"portcullis_route_mirrored_total{route="all",outcome="skipped"} 0"#.into(),
            r#"portcullis_route_mirrored_total{route="all",outcome="cut"} 0"#.into(),
            r#"portcullis_route_mirrored_total{route="half",outcome="sent"} 2"#.into(),
        ])
        .await;
    assert!(copies.try_recv().is_err(), "no other copy was sent");
    release.notify_waiters();
}

#[tokio::test]
async fn a_mirror_that_falls_behind_a_streamed_body_is_cut_not_waited_for() {
    let app = upstream::echo("app").await;
    // Takes connections and never reads from them: the copy backs up.
    let stalled = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let stalled_addr = stalled.local_addr().unwrap();
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = stalled.accept().await {
            held.push(socket);
        }
    });
    let proxy = start_mirroring(&app.url(), &format!("http://{stalled_addr}"), &[]).await;
    // Far more than the sockets between here and the mirror hold.
    let total = 32 * 1024 * 1024;
    let streamed = Request::post(proxy.url("/all/upload"))
        .body(BodyExt::boxed(StreamBody::new(upstream::chunks(total))))
        .unwrap();
    let a = client::send(&client::http1(), streamed).await;
    assert_eq!(
        (a.status.as_u16(), a.json()["body_len"].as_u64()),
        (200, Some(total))
    );
    proxy
        .metrics_showing(&[
            r#"portcullis_route_mirrored_total{route="all",outcome="sent"} 1"#.into(),
            r#"portcullis_route_mirrored_total{route="all",outcome="cut"} 1"#.into(),
        ])
        .await;
    holder.abort();
}

#[tokio::test]
async fn a_body_a_plugin_read_whole_is_mirrored_whatever_its_size() {
    let app = upstream::echo("app").await;
    let (tx, mut copies) = unbounded_channel();
    let shadow = upstream::serve(move |req: Request<hyper::body::Incoming>| {
        let tx = tx.clone();
        async move {
            let body = req.into_body().collect().await.unwrap().to_bytes();
            let _ = tx.send(body);
            Response::new(full("shadow"))
        }
    })
    .await;
    // GitHub's signature is checked over the whole body: the plugin reads
    // it into memory before the request goes on.
    let dir = crate::support::policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: app, endpoints: ["{}"] }}
  - {{ name: shadow, endpoints: ["{}"] }}
plugins: [{{ name: sig, path: webhook-signature.wasm }}]
routes:
  - name: hook
    match: {{ path: /hook }}
    upstream: app
    mirror: {{ upstream: shadow }}
    plugins: [{{ use: sig, config: {{ provider: github, secret: s3cret }} }}]
"#,
            app.url(),
            shadow.url()
        ),
        &["webhook-signature"],
    );
    let proxy = crate::support::Proxy::start_dir(dir, &[]).await;
    let payload: Vec<u8> = (0..300 * 1024).map(|i| (i % 251) as u8).collect();
    let signature = crate::plugins::hmac_sha256_hex(b"s3cret", &payload);
    let req = Request::post(proxy.url("/hook"))
        .header("x-hub-signature-256", format!("sha256={signature}"))
        .body(body(payload.clone()))
        .unwrap();
    let a = client::send(&client::http1(), req).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(a.json()["body_fnv"], upstream::fnv(&payload));
    let copy = tokio::time::timeout(Duration::from_secs(10), copies.recv())
        .await
        .expect("a copy reached the mirror")
        .unwrap();
    assert!(
        copy == payload,
        "the mirror got {} bytes, not the payload",
        copy.len()
    );
}

#[test]
fn check_names_bad_mirrors() {
    assert_check_errors(
        r#"
upstreams:
  - { name: app, endpoints: ["http://127.0.0.1:9"] }
  - { name: per-host, url: "http://{h}.svc" }
routes:
  - { name: a, match: { path: /a }, upstream: app, mirror: { upstream: nowhere } }
  - { name: b, match: { path: /b }, upstream: app, mirror: { upstream: per-host } }
  - { name: c, match: { path: /c }, upstream: app, mirror: { upstream: app, percent: 0 } }
"#,
        &[
            (6, "unknown upstream `nowhere`"),
            (7, "mirror needs an upstream with `endpoints`"),
            (8, "mirror percent `0` is not a share from 1 to 100"),
        ],
    );
}
