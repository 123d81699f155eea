//! Route matching and route actions beyond the default policies.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::{Request, Response};
use tokio::sync::{Notify, mpsc};

use crate::support::client::{self, Answer, body};
use crate::support::process::ProxyProcess;
use crate::support::upstream::{self, full};
use crate::support::{Proxy, closed_port};

/// A proxy whose one route sends every request to `up`.
async fn forwarding_all_to(up: &upstream::Upstream) -> Proxy {
    Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: e, endpoints: ["{}"] }}]
routes: [{{ name: all, match: {{ path_prefix: / }}, upstream: e }}]
"#,
        up.url()
    ))
    .await
}

async fn send(
    proxy: &Proxy,
    method: &str,
    host: &str,
    path: &str,
    headers: &[(&str, &str)],
) -> Answer {
    let mut req = Request::builder()
        .method(method)
        .uri(proxy.url(path))
        .header("host", host);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    client::send(&client::http1(), req.body(body(Bytes::new())).unwrap()).await
}

#[tokio::test]
async fn host_method_and_header_conditions_pick_the_route() {
    let a = upstream::echo("a").await;
    let b = upstream::echo("b").await;
    let c = upstream::echo("c").await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: a, endpoints: ["{}"] }}
  - {{ name: b, endpoints: ["{}"] }}
  - {{ name: c, endpoints: ["{}"] }}
routes:
  - {{ name: exact-host, match: {{ host: api.example.com, path_prefix: / }}, upstream: a }}
  - {{ name: wildcard, match: {{ host: "*.example.com", path_prefix: / }}, upstream: b }}
  - {{ name: deeper-wildcard, match: {{ host: "*.eu.example.com", path_prefix: / }}, upstream: c }}
  - {{ name: any-get, match: {{ path: "/items/{{id}}", methods: [GET] }}, upstream: a }}
  - {{ name: any-post, match: {{ path: "/items/{{id}}", methods: [post] }}, upstream: b }}
  - {{ name: canary, match: {{ path: "/items/{{id}}", methods: [GET], headers: {{ x-canary: "yes" }} }}, upstream: c }}
"#,
        a.url(),
        b.url(),
        c.url()
    ))
    .await;
    let pick = |ans: Answer| ans.json()["upstream"].as_str().unwrap().to_owned();
    assert_eq!(
        pick(send(&proxy, "GET", "API.example.com:8080", "/x", &[]).await),
        "a"
    );
    assert_eq!(
        pick(send(&proxy, "GET", "web.example.com", "/x", &[]).await),
        "b"
    );
    // A fully qualified name, with its trailing dot, is the same host.
    assert_eq!(
        pick(send(&proxy, "GET", "api.example.com.", "/x", &[]).await),
        "a"
    );
    assert_eq!(
        pick(send(&proxy, "GET", "Web.Example.com.:80", "/x", &[]).await),
        "b"
    );
    assert_eq!(
        pick(send(&proxy, "GET", "a.eu.example.com", "/x", &[]).await),
        "c"
    );
    // The bare domain is not a subdomain of itself.
    assert_eq!(
        send(&proxy, "GET", "example.com", "/x", &[]).await.status,
        404
    );
    assert_eq!(
        pick(send(&proxy, "GET", "other.test", "/items/1", &[]).await),
        "a"
    );
    assert_eq!(
        pick(send(&proxy, "POST", "other.test", "/items/1", &[]).await),
        "b"
    );
    assert_eq!(
        pick(
            send(
                &proxy,
                "GET",
                "other.test",
                "/items/1",
                &[("x-canary", "yes")]
            )
            .await
        ),
        "c"
    );
    assert_eq!(
        send(&proxy, "DELETE", "other.test", "/items/1", &[])
            .await
            .status,
        404
    );
}

#[tokio::test]
async fn rewrites_header_edits_and_local_answers() {
    let e = upstream::echo("e").await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: e, endpoints: ["{}/base/"] }}]
routes:
  - name: rewrite
    match: {{ path: "/v1/users/{{id}}/{{*rest}}" }}
    upstream: e
    rewrite: "/users/{{id}}/v1/{{rest}}"
    request_headers:
      add: {{ x-added: "1" }}
      set: {{ user-agent: portcullis-test }}
      remove: [x-secret]
    response_headers:
      set: {{ x-frame-options: DENY }}
      remove: [content-type]
  - name: teapot
    match: {{ path: /teapot }}
    respond: {{ status: 418, body: "short and stout", headers: {{ content-type: text/plain }} }}
"#,
        e.url()
    ))
    .await;
    let a = send(
        &proxy,
        "GET",
        "h",
        "/v1/users/42/repos/x?page=2",
        &[("x-secret", "s"), ("user-agent", "curl")],
    )
    .await;
    assert_eq!(a.status, 200);
    assert_eq!(a.header("x-frame-options"), Some("DENY"));
    assert_eq!(a.header("content-type"), None);
    let j: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
    // The endpoint's base path goes in front of the rewritten path.
    assert_eq!(j["path"], "/base/users/42/v1/repos/x?page=2");
    assert_eq!(j["headers"]["x-added"], "1");
    assert_eq!(j["headers"]["user-agent"], "portcullis-test");
    assert!(j["headers"].get("x-secret").is_none());
    let t = send(&proxy, "GET", "h", "/teapot", &[]).await;
    assert_eq!(t.status, 418);
    assert_eq!(&t.body[..], b"short and stout");
}

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

#[tokio::test]
async fn upstream_connections_are_kept_alive_and_reused() {
    let e = upstream::echo("e").await;
    let proxy = forwarding_all_to(&e).await;
    // One keep-alive client connection lands on one worker, whose pool
    // should serve every request on one upstream connection.
    let mut c = client::Connection::open(proxy.addr).await;
    let mut peers = std::collections::HashSet::new();
    for i in 0..30 {
        let req = Request::get(proxy.url(&format!("/r{i}")))
            .body(body(Bytes::new()))
            .unwrap();
        let a = c.send(req).await;
        assert_eq!(a.status, 200);
        peers.insert(a.json()["peer"].as_str().unwrap().to_owned());
    }
    assert_eq!(peers.len(), 1, "upstream connections used: {peers:?}");
}

#[tokio::test]
async fn http1_upstreams_get_the_origin_form_request_target() {
    // Some origin servers (Python's http.server among them) take
    // `GET http://host/path` as a file name; the proxy must send `GET /path`.
    let e = upstream::echo("e").await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: e, endpoints: ["{}/base"] }}]
routes: [{{ name: all, match: {{ path_prefix: / }}, upstream: e }}]
"#,
        e.url()
    ))
    .await;
    // Through HTTP/1.1 and through HTTP/2 (whose requests carry a full URI).
    let a = client::get(&proxy.url("/x?y=1")).await;
    assert_eq!(a.json()["target"], "/base/x?y=1");
    let req = Request::get(proxy.url("/x?y=2"))
        .body(body(Bytes::new()))
        .unwrap();
    let a = client::send(&client::h2c(), req).await;
    assert_eq!(a.json()["target"], "/base/x?y=2");
}

#[tokio::test]
async fn cookie_fields_reach_an_http1_upstream_as_one_header() {
    let echo = upstream::echo("e").await;
    let proxy = forwarding_all_to(&echo).await;
    // Browsers over HTTP/2 send each cookie as a field of its own; over
    // HTTP/1.1 they must be one line joined by "; " (RFC 9113 8.2.3). An
    // HTTP/1.1 client sending two lines gets the same. (The echo would
    // show two lines joined by ", ".)
    let two = || {
        Request::get(proxy.url("/x"))
            .header("cookie", "a=1")
            .header("cookie", "b=2")
            .body(body(Bytes::new()))
            .unwrap()
    };
    for (version, client) in [("HTTP/2", client::h2c()), ("HTTP/1.1", client::http1())] {
        let a = client::send(&client, two()).await;
        assert_eq!(a.status, 200, "{version}");
        assert_eq!(a.json()["headers"]["cookie"], "a=1; b=2", "{version}");
    }
}

#[tokio::test]
async fn redirect_routes_fill_the_location_and_keep_the_query() {
    let proxy = Proxy::start_yaml(
        r#"
listeners: [{ name: http, bind: "127.0.0.1:0" }]
routes:
  - { name: docs, match: { path: "/old/{*rest}" }, redirect: { to: "https://docs.example.com/v2/{rest}" } }
  - { name: moved, match: { path: /moved }, redirect: { to: /new, status: 308, strip_query: true } }
  - { name: local, match: { path: "/r/{*rest}" }, redirect: { to: "/{rest}", status: 302 } }
  - { name: tenant, match: { path: "/t/{tenant}" }, redirect: { to: "https://{tenant}.example.com/", status: 307 } }
"#,
    )
    .await;
    let location = |a: &Answer| a.header("location").map(str::to_owned);

    let a = send(&proxy, "GET", "h", "/old/guide/intro?lang=en", &[]).await;
    assert_eq!(a.status, 301);
    assert_eq!(
        location(&a).as_deref(),
        Some("https://docs.example.com/v2/guide/intro?lang=en")
    );
    // 308 keeps the method and body; the query is dropped when asked.
    let a = send(&proxy, "POST", "h", "/moved?x=1", &[]).await;
    assert_eq!(a.status, 308);
    assert_eq!(location(&a).as_deref(), Some("/new"));
    let a = send(&proxy, "GET", "h", "/r/a/b", &[]).await;
    assert_eq!(
        (a.status.as_u16(), location(&a).as_deref()),
        (302, Some("/a/b"))
    );
    // A parameter cannot make the path another host (`//evil.example`).
    let a = send(&proxy, "GET", "h", "/r//evil.example/x", &[]).await;
    assert_eq!(location(&a).as_deref(), Some("/evil.example/x"));
    let a = send(&proxy, "GET", "h", "/t/blue", &[]).await;
    assert_eq!(
        (a.status.as_u16(), location(&a).as_deref()),
        (307, Some("https://blue.example.com/"))
    );
    // Nor name a host of its choosing.
    let a = send(&proxy, "GET", "h", "/t/evil.example%2f", &[]).await;
    assert_eq!(a.status, 400, "{:?}", a.body);
    assert_eq!(location(&a), None);
}

#[tokio::test]
async fn an_upstream_at_its_max_requests_answers_503_until_one_ends() {
    let (up, mut arrived, release) = upstream::holding().await;
    let other = upstream::echo("other").await;
    let proxy = ProxyProcess::start(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: capped, endpoints: ["{}"], max_requests: 2 }}
  - {{ name: other, endpoints: ["{}"] }}
routes:
  - {{ name: capped, match: {{ path_prefix: / }}, upstream: capped }}
  - {{ name: other, match: {{ path: /other }}, upstream: other }}
"#,
            up.url(),
            other.url()
        ),
        &["--workers", "2"],
    )
    .await;
    let held: Vec<_> = (0..2)
        .map(|_| tokio::spawn(client::get_owned(proxy.url("/slow"))))
        .collect();
    for _ in 0..2 {
        tokio::time::timeout(Duration::from_secs(10), arrived.recv())
            .await
            .expect("a held request reached the upstream");
    }
    // Two in flight: a third is refused at once, without reaching it.
    let a = client::get(&proxy.url("/fast")).await;
    assert_eq!(a.status, 503, "{:?}", a.body);
    assert_eq!(a.json()["error"], "upstream overloaded");
    assert_eq!(a.json()["route"], "capped");
    // Operators see the count (one for all the workers).
    let status = proxy.status().await;
    let counted = &status["config"]["upstream_requests"];
    assert_eq!(
        counted,
        &serde_json::json!([{ "upstream": "capped", "in_flight": 2, "max_requests": 2 }])
    );
    proxy
        .metrics_showing(&[r#"portcullis_upstream_requests_in_flight{upstream="capped"} 2"#.into()])
        .await;
    // Other upstreams are not touched by it.
    assert_eq!(client::get(&proxy.url("/other")).await.status, 200);
    // One ends (whichever the upstream lets go): one more fits.
    release.notify_one();
    let (first, _, rest) = futures_util::future::select_all(held).await;
    assert_eq!(first.unwrap().body, "done /slow");
    let a = client::get(&proxy.url("/fast")).await;
    assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"done /fast"[..]));
    release.notify_one();
    assert_eq!(rest.into_iter().next().unwrap().await.unwrap().status, 200);
    // Each request counted until its response ended, and no longer.
    proxy
        .metrics_showing(&[r#"portcullis_upstream_requests_in_flight{upstream="capped"} 0"#.into()])
        .await;
}

/// Values are used as written: YAML would read `0777` as the number 777
/// and `1.10` as 1.1, and a header or body made from the number would
/// silently differ from the policy file.
#[tokio::test]
async fn values_that_look_like_numbers_keep_their_text() {
    const POLICY: &str = r#"
listeners: [{ name: http, bind: "127.0.0.1:0" }]
upstreams: [{ name: app, endpoints: ["APP"] }]
routes:
  - { name: mode, match: { path: /mode }, respond: { status: 200, body: 0777, headers: { x-version: 1.10 } } }
  - name: app
    match: { path: /app }
    upstream: app
    request_headers: { add: { x-version: 1.10, x-id: 0x1F, x-flag: yes, x-big: 12345678901234567890123 } }
"#;
    let app = upstream::echo("app").await;
    let proxy = Proxy::start_yaml(&POLICY.replace("APP", &app.url())).await;
    let mode = client::get(&proxy.url("/mode")).await;
    assert_eq!(mode.body, "0777");
    assert_eq!(mode.header("x-version"), Some("1.10"));
    let seen = client::get(&proxy.url("/app")).await.json();
    let headers = &seen["headers"];
    assert_eq!(headers["x-version"], "1.10", "{seen:#}");
    assert_eq!(headers["x-id"], "0x1F", "{seen:#}");
    assert_eq!(headers["x-flag"], "yes", "{seen:#}");
    assert_eq!(headers["x-big"], "12345678901234567890123", "{seen:#}");
}

/// A HEAD request gets the head a GET gets, its length included, and no
/// body, over HTTP/2 as over HTTP/1.1, for the proxy's own answers too: a
/// body sent with an HTTP/2 HEAD answer is a protocol error the client
/// turns into a reset (hyper drops it only over HTTP/1.1).
#[tokio::test]
async fn head_requests_get_the_get_head_without_a_body_over_both_versions() {
    let up = upstream::echo("up").await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: up, endpoints: ["{}"] }}]
routes:
  - {{ name: local, match: {{ path: /local }}, respond: {{ status: 200, body: hello }} }}
  - {{ name: live, match: {{ path: /healthz }}, health: live }}
  - {{ name: up, match: {{ path: /up }}, upstream: up }}
"#,
        up.url()
    ))
    .await;
    for (version, client) in [("HTTP/1.1", client::http1()), ("HTTP/2", client::h2c())] {
        for path in ["/local", "/healthz", "/nope", "/up"] {
            let req = |method: &str| {
                Request::builder()
                    .method(method)
                    .uri(proxy.url(path))
                    .body(body(Bytes::new()))
                    .unwrap()
            };
            let get = client::send(&client, req("GET")).await;
            let head = client::send(&client, req("HEAD")).await;
            let what = format!("HEAD {path} over {version}");
            assert_eq!(head.status, get.status, "{what}");
            assert!(head.body.is_empty(), "{what}: {:?}", head.body);
            if path != "/up" {
                // The echo's body names the method; its length differs.
                assert_eq!(
                    head.header("content-length"),
                    Some(get.body.len().to_string().as_str()),
                    "{what}"
                );
            }
        }
    }
}

/// A 204 or 304 the proxy answers itself goes out without a body even
/// when the policy gives it one, over HTTP/2 as over HTTP/1.1: DATA on
/// such an answer is a protocol error the client turns into a reset.
#[tokio::test]
async fn a_local_204_or_304_goes_out_without_its_body_over_both_versions() {
    let proxy = Proxy::start_yaml(
        r#"
listeners: [{ name: http, bind: "127.0.0.1:0" }]
routes:
  - { name: none, match: { path: /none }, respond: { status: 204, body: hello } }
  - { name: same, match: { path: /same }, respond: { status: 304, body: hello } }
"#,
    )
    .await;
    for (version, client) in [("HTTP/1.1", client::http1()), ("HTTP/2", client::h2c())] {
        for (path, status) in [("/none", 204), ("/same", 304)] {
            let req = Request::get(proxy.url(path))
                .body(body(Bytes::new()))
                .unwrap();
            let answer = client::send(&client, req).await;
            let what = format!("GET {path} over {version}");
            assert_eq!(answer.status, status, "{what}");
            assert!(answer.body.is_empty(), "{what}: {:?}", answer.body);
        }
    }
}
