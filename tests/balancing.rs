//! Balancing an upstream's endpoints: retries past a dead one and its
//! ejection, hash keys and the hash cookie, weights, least requests.

use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, StreamBody};
use hyper::{Request, Response};
use tokio::sync::{Notify, mpsc};

use crate::support::client::{self, body};
use crate::support::process::ProxyProcess;
use crate::support::upstream::{self, full};
use crate::support::{Proxy, closed_port};

#[tokio::test]
async fn a_dead_endpoint_is_retried_past_then_left_out_of_the_rotation() {
    let live = upstream::echo("live").await;
    let dead = format!("http://127.0.0.1:{}", closed_port());
    let proxy = ProxyProcess::start(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: pair, endpoints: ["{dead}", "{live}"] }}
  - {{ name: plain, endpoints: ["{dead}", "{live}"], retries: 0, eject_for: 0s }}
routes:
  - {{ name: pair, match: {{ path_prefix: /pair }}, upstream: pair }}
  - {{ name: plain, match: {{ path_prefix: /plain }}, upstream: plain }}
"#,
            live = live.url()
        ),
        &["--workers", "2"],
    )
    .await;
    let http = client::http1();
    // A connect that fails sends nothing, so every request goes again on
    // the live endpoint: GETs, POSTs with a body, streamed uploads.
    for i in 0..6 {
        let a = client::send(
            &http,
            Request::get(proxy.url("/pair")).body(body("")).unwrap(),
        )
        .await;
        assert_eq!(a.status, 200, "GET {i}: {:?}", a.body);
        let a = client::send(
            &http,
            Request::post(proxy.url("/pair"))
                .body(body("payload"))
                .unwrap(),
        )
        .await;
        assert_eq!(a.status, 200, "POST {i}: {:?}", a.body);
        assert_eq!(a.json()["body_len"], 7);
        let streamed = Request::post(proxy.url("/pair"))
            .body(BodyExt::boxed(StreamBody::new(upstream::chunks(
                256 * 1024,
            ))))
            .unwrap();
        let a = client::send(&http, streamed).await;
        assert_eq!(a.status, 200, "streamed POST {i}: {:?}", a.body);
        assert_eq!(a.json()["body_len"], 256 * 1024);
    }
    // The first failed connect took the dead endpoint out, for every
    // worker: the requests after it never tried it.
    let ejected: Vec<_> = proxy
        .logs
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains("endpoint out of the rotation after a failed connect"))
        .cloned()
        .collect();
    assert_eq!(ejected.len(), 1, "{ejected:#?}");
    assert!(ejected[0].contains(&dead[7..]), "{}", ejected[0]);
    // Operators see it on the admin endpoint.
    let status = proxy.status().await;
    let out = &status["config"]["ejected_endpoints"];
    assert_eq!(out.as_array().map(Vec::len), Some(1), "{out}");
    assert_eq!(out[0]["upstream"], "pair");
    assert_eq!(out[0]["endpoint"], &dead[7..]);
    assert!(
        out[0]["for_ms"].as_u64().is_some_and(|ms| ms <= 10_000),
        "{out}"
    );
    proxy
        .metrics_showing(&[
            r#"portcullis_upstream_endpoints_ejected{upstream="pair"} 1"#.into(),
            r#"portcullis_upstream_endpoints_ejected{upstream="plain"} 0"#.into(),
        ])
        .await;

    // Without retries or ejection, round robin keeps sending half the
    // requests to the dead endpoint.
    let mut failures = 0;
    for _ in 0..20 {
        let a = client::send(
            &http,
            Request::post(proxy.url("/plain")).body(body("x")).unwrap(),
        )
        .await;
        if a.status == 502 {
            failures += 1;
        }
    }
    assert!(
        (8..=12).contains(&failures),
        "{failures} of 20 POSTs failed"
    );
}

#[tokio::test]
async fn hash_balancing_keeps_each_key_on_one_endpoint() {
    let (a, b, c) = (
        upstream::echo("a").await,
        upstream::echo("b").await,
        upstream::echo("c").await,
    );
    let dead = format!("http://127.0.0.1:{}", closed_port());
    // Two workers, and a fresh connection per request: whichever worker
    // takes it, a key goes to the same endpoint. One endpoint is dead:
    // its keys move to their next choice, and stay there.
    let proxy = ProxyProcess::start(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - name: by-cookie
    endpoints: ["{a}", "{dead}", "{b}", "{c}"]
    balance: hash
    hash_on: "cookie:session"
  - {{ name: by-header, endpoints: ["{a}", "{b}", "{c}"], balance: hash, hash_on: "header:x-user" }}
  - {{ name: by-client, endpoints: ["{a}", "{b}", "{c}"], balance: hash }}
routes:
  - {{ name: cookie, match: {{ path: /cookie }}, upstream: by-cookie }}
  - {{ name: header, match: {{ path: /header }}, upstream: by-header }}
  - {{ name: client, match: {{ path: /client }}, upstream: by-client }}
"#,
            a = a.url(),
            b = b.url(),
            c = c.url(),
        ),
        &["--workers", "2"],
    )
    .await;
    let upstream_of = |path: &str, header: Option<(&str, String)>| {
        let mut req = Request::get(proxy.url(path));
        if let Some((name, value)) = header {
            req = req.header(name, value);
        }
        let req = req.body(body("")).unwrap();
        async move {
            let a = client::send(&client::http1(), req).await;
            assert_eq!(a.status, 200, "{:?}", a.body);
            a.json()["upstream"].as_str().unwrap().to_owned()
        }
    };
    // Where each session belongs: its first choice, or its second when
    // that is the dead one (the failed connect's retry goes there, not
    // round robin).
    let authorities: Vec<String> = [a.url(), dead.clone(), b.url(), c.url()]
        .iter()
        .map(|u| u.trim_start_matches("http://").to_owned())
        .collect();
    let authorities: Vec<&str> = authorities.iter().map(String::as_str).collect();
    let names = ["a", "dead", "b", "c"];
    // Twelve sessions, three of them first drawn to the dead endpoint
    // and then to one other than the next in the list, where a retry
    // that walked the list would go (the ports differ each run: the keys
    // are chosen for them).
    // The other nine are three for each live endpoint.
    let mut sessions = Vec::new();
    let mut moved = 0;
    let mut stayed = std::collections::HashMap::new();
    for user in 0.. {
        if sessions.len() == 12 {
            break;
        }
        let order = portcullis::forward::preference(format!("s-{user}").as_bytes(), &authorities);
        match (names[order[0]], names[order[1]]) {
            ("dead", "b") => {}
            ("dead", next) if moved < 3 => {
                moved += 1;
                sessions.push((user, next));
            }
            ("dead", _) => {}
            (first, _) => {
                let n = stayed.entry(first).or_insert(0);
                if *n < 3 {
                    *n += 1;
                    sessions.push((user, first));
                }
            }
        }
    }
    let mut used = std::collections::HashSet::new();
    for (user, home) in sessions {
        let (mut by_cookie, mut by_header) = (Vec::new(), Vec::new());
        for _ in 0..3 {
            let cookie = format!("theme=dark; session=s-{user}");
            by_cookie.push(upstream_of("/cookie", Some(("cookie", cookie))).await);
            by_header.push(upstream_of("/header", Some(("x-user", format!("u-{user}")))).await);
        }
        assert!(
            by_cookie.iter().all(|u| u == home),
            "user {user}: {by_cookie:?}, not {home}"
        );
        assert!(
            by_header.iter().all(|u| *u == by_header[0]),
            "user {user}: {by_header:?}"
        );
        used.extend(by_cookie);
    }
    assert_eq!(
        used.len(),
        3,
        "twelve keys spread over the endpoints: {used:?}"
    );
    // Every request from this host is one client.
    let mut got = std::collections::HashSet::new();
    for _ in 0..6 {
        got.insert(upstream_of("/client", None).await);
    }
    assert_eq!(got.len(), 1, "{got:?}");
    // A request without its key is balanced round robin.
    let mut got = std::collections::HashSet::new();
    for _ in 0..6 {
        got.insert(upstream_of("/header", None).await);
    }
    assert!(got.len() >= 2, "{got:?}");
}

#[tokio::test]
async fn a_hash_cookie_is_given_to_clients_without_one_and_keeps_them_put() {
    let (a, b, c) = (
        upstream::echo("a").await,
        upstream::echo("b").await,
        upstream::echo("c").await,
    );
    let proxy = ProxyProcess::start(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - name: sticky
    endpoints: ["{}", "{}", "{}"]
    balance: hash
    hash_on: "cookie:route"
    hash_cookie_ttl: 1h
routes: [{{ name: all, match: {{ path_prefix: / }}, upstream: sticky }}]
"#,
            a.url(),
            b.url(),
            c.url()
        ),
        &["--workers", "2"],
    )
    .await;
    let get = |cookie: Option<String>| {
        let mut req = Request::get(proxy.url("/"));
        if let Some(cookie) = cookie {
            req = req.header("cookie", cookie);
        }
        // A fresh connection each: either worker.
        let req = req.body(body("")).unwrap();
        async move { client::send(&client::http1(), req).await }
    };
    let mut first_endpoints = std::collections::HashSet::new();
    for client in 0..8 {
        // The first request, without the cookie, is given one...
        let first = get(None).await;
        let set = first.header("set-cookie").expect("a cookie").to_owned();
        let value = set
            .strip_prefix("route=")
            .and_then(|rest| rest.split(';').next())
            .expect("route=VALUE")
            .to_owned();
        assert_eq!(value.len(), 32, "{set}");
        assert!(set.ends_with("; Path=/; Max-Age=3600; HttpOnly"), "{set}");
        let endpoint = first.json()["upstream"].as_str().unwrap().to_owned();
        // ...and its later requests, bringing it, go where it went.
        for _ in 0..3 {
            let later = get(Some(format!("route={value}"))).await;
            assert_eq!(
                later.json()["upstream"],
                endpoint.as_str(),
                "client {client}"
            );
            assert!(later.header("set-cookie").is_none());
        }
        first_endpoints.insert(endpoint);
    }
    assert!(first_endpoints.len() >= 2, "{first_endpoints:?}");
}

#[tokio::test]
async fn endpoint_weights_share_the_requests() {
    let (heavy, heavy_hits) = upstream::counted_echo("heavy").await;
    let (light, light_hits) = upstream::counted_echo("light").await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: e, endpoints: ["{} weight=3", "{}"] }}]
routes: [{{ name: all, match: {{ path_prefix: / }}, upstream: e }}]
"#,
        heavy.url(),
        light.url()
    ))
    .await;
    // One connection: one worker's round robin, whose cycle of four sends
    // three to the heavy endpoint and one to the light.
    let mut http = client::Connection::open(proxy.addr).await;
    for _ in 0..40 {
        let req = Request::get(proxy.url("/")).body(body("")).unwrap();
        assert_eq!(http.send(req).await.status, 200);
    }
    use std::sync::atomic::Ordering;
    assert_eq!(
        (
            heavy_hits.load(Ordering::SeqCst),
            light_hits.load(Ordering::SeqCst)
        ),
        (30, 10)
    );
}

#[tokio::test]
async fn least_requests_avoids_the_busy_endpoint() {
    let (arrived_tx, mut arrived) = mpsc::unbounded_channel();
    let release = Arc::new(Notify::new());
    let held = release.clone();
    let busy = upstream::serve(move |req: Request<hyper::body::Incoming>| {
        let (arrived_tx, held) = (arrived_tx.clone(), held.clone());
        async move {
            if req.uri().path() == "/hold" {
                let _ = arrived_tx.send(());
                held.notified().await;
            }
            Response::new(full("busy"))
        }
    })
    .await;
    let idle = upstream::serve(|_req| async { Response::new(full("idle")) }).await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: pair, endpoints: ["{}", "{}"], balance: least_requests }}]
routes: [{{ name: all, match: {{ path_prefix: / }}, upstream: pair }}]
"#,
        busy.url(),
        idle.url()
    ))
    .await;
    // First request goes to the first endpoint and stays there.
    let url = proxy.url("/hold");
    let held_req = tokio::spawn(async move { client::get(&url).await });
    tokio::time::timeout(Duration::from_secs(10), arrived.recv())
        .await
        .expect("held request arrived");
    // Round robin would alternate; least-requests keeps choosing the idle one.
    for _ in 0..4 {
        assert_eq!(&client::get(&proxy.url("/quick")).await.body[..], b"idle");
    }
    release.notify_one();
    assert_eq!(&held_req.await.unwrap().body[..], b"busy");
}

#[tokio::test]
async fn least_requests_counts_requests_per_unit_of_weight() {
    // Two endpoints that hold every request, saying which got it.
    let (arrived_tx, mut arrived) = mpsc::unbounded_channel();
    let release = Arc::new(Notify::new());
    let mut endpoints = Vec::new();
    for name in ["heavy", "light"] {
        let (arrived_tx, held) = (arrived_tx.clone(), release.clone());
        endpoints.push(
            upstream::serve(move |_req: Request<hyper::body::Incoming>| {
                let (arrived_tx, held) = (arrived_tx.clone(), held.clone());
                async move {
                    // Waiting before it says so: the release may come
                    // right after.
                    let notified = held.notified();
                    tokio::pin!(notified);
                    notified.as_mut().enable();
                    let _ = arrived_tx.send(name);
                    notified.await;
                    Response::new(full(name))
                }
            })
            .await,
        );
    }
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: pair, endpoints: ["{} weight=3", "{}"], balance: least_requests }}]
routes: [{{ name: all, match: {{ path_prefix: / }}, upstream: pair }}]
"#,
        endpoints[0].url(),
        endpoints[1].url()
    ))
    .await;
    // Four requests held one after another: whichever the first tie goes
    // to, the loads (held / weight) send three to the heavy endpoint.
    let mut held = Vec::new();
    let mut got = Vec::new();
    for _ in 0..4 {
        held.push(tokio::spawn(client::get_owned(proxy.url("/hold"))));
        let name = tokio::time::timeout(Duration::from_secs(10), arrived.recv())
            .await
            .expect("a held request arrived")
            .unwrap();
        got.push(name);
    }
    got.sort_unstable();
    assert_eq!(got, ["heavy", "heavy", "heavy", "light"]);
    release.notify_waiters();
    for h in held {
        assert_eq!(h.await.unwrap().status, 200);
    }
}
