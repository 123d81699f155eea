//! A route's `auth_request`: an auth service (here one that answers as
//! oauth2-proxy's `/oauth2/auth` does) decides each request before it is
//! forwarded, and says who the user is.

use std::sync::atomic::Ordering;

use bytes::Bytes;
use hyper::{Request, Response};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::support::client::{self, body};
use crate::support::configmap::ConfigMap;
use crate::support::process::ProxyProcess;
use crate::support::upstream::{self, Upstream};
use crate::support::{Proxy, assert_check_errors, closed_port};

/// What the auth service saw of one subrequest.
#[derive(Debug)]
struct Seen {
    method: String,
    path: String,
    original_uri: String,
    original_method: String,
    cookie: String,
    content_length: bool,
    body_len: usize,
}

/// An auth service: `session=good` passes (202, naming the user),
/// `session=chatty` too but with a 100 KiB body, `session=forbidden`
/// gets 403, anything else 401.
async fn auth_service() -> (Upstream, UnboundedReceiver<Seen>) {
    let (tx, rx) = unbounded_channel();
    let server = upstream::serve(move |req: Request<hyper::body::Incoming>| {
        let tx = tx.clone();
        async move {
            let text = |name: &str| {
                req.headers()
                    .get(name)
                    .map(|v| v.to_str().unwrap().to_owned())
                    .unwrap_or_default()
            };
            let cookie = text("cookie");
            let mut seen = Seen {
                method: req.method().to_string(),
                path: req.uri().to_string(),
                original_uri: text("x-original-uri"),
                original_method: text("x-original-method"),
                cookie: cookie.clone(),
                content_length: req.headers().contains_key("content-length"),
                body_len: 0,
            };
            seen.body_len = http_body_util::BodyExt::collect(req.into_body())
                .await
                .unwrap()
                .to_bytes()
                .len();
            let _ = tx.send(seen);
            let answer = Response::builder();
            if cookie.contains("session=chatty") {
                let page = "x".repeat(100 * 1024);
                let allowed = answer.status(200).header("x-auth-request-user", "bob");
                return allowed.body(upstream::full(page)).unwrap();
            }
            let answer = if cookie.contains("session=good") {
                answer
                    .status(202)
                    .header("x-auth-request-user", "alice")
                    .header("x-auth-request-email", "alice@example.com")
            } else if cookie.contains("session=forbidden") {
                answer.status(403).header("content-type", "text/plain")
            } else {
                answer
                    .status(401)
                    .header("www-authenticate", "Bearer realm=\"test\"")
            };
            let text = if cookie.contains("session=forbidden") {
                "not in the team"
            } else {
                ""
            };
            answer.body(upstream::full(text)).unwrap()
        }
    })
    .await;
    (server, rx)
}

#[tokio::test]
async fn the_auth_service_decides_and_names_the_user() {
    let (auth, mut seen) = auth_service().await;
    let (app, hits) = upstream::counted_echo("app").await;
    let dead = format!("http://127.0.0.1:{}", closed_port());
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0", trust_forwarded_headers: true }}]
upstreams:
  - {{ name: app, endpoints: ["{app}"] }}
  - {{ name: auth, endpoints: ["{auth}"] }}
  - {{ name: dead, endpoints: ["{dead}"] }}
routes:
  - name: app
    match: {{ path: /app }}
    upstream: app
    auth_request: {{ upstream: auth, path: /oauth2/auth, copy_headers: [x-auth-request-user] }}
  - name: signin-app
    match: {{ path: /signin-app }}
    upstream: app
    auth_request: {{ upstream: auth, path: /oauth2/auth, signin: "https://auth.example/start?rd={{url}}" }}
  - name: broken
    match: {{ path: /broken }}
    upstream: app
    auth_request: {{ upstream: dead, path: /auth }}
  - {{ name: open, match: {{ path: /open }}, upstream: app }}
"#,
        app = app.url(),
        auth = auth.url(),
    ))
    .await;
    let http = client::http1();
    let send = |method: &str, path: &str, cookie: &str, payload: &'static [u8]| {
        let mut req = Request::builder().method(method).uri(proxy.url(path));
        if !cookie.is_empty() {
            req = req.header("cookie", cookie);
        }
        // A client claiming to be someone: never believed.
        req = req.header("x-auth-request-user", "mallory");
        client::send(&http, req.body(body(Bytes::from_static(payload))).unwrap())
    };

    // Signed in: forwarded, as the user the service named.
    let a = send("GET", "/app?x=1", "session=good", b"").await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    let j = a.json();
    assert_eq!(j["headers"]["x-auth-request-user"], "alice", "{j}");
    assert!(j["headers"].get("x-auth-request-email").is_none(), "{j}");
    let s = seen.try_recv().expect("the auth service was asked");
    assert_eq!(
        (s.method.as_str(), s.path.as_str()),
        ("GET", "/oauth2/auth")
    );
    assert_eq!(s.original_uri, "/app?x=1");
    assert_eq!(s.original_method, "GET");
    assert_eq!(s.cookie, "session=good");

    // A POST's body goes to the upstream whole, never to the service.
    let a = send("POST", "/app", "session=good", &[b'p'; 1000]).await;
    assert_eq!(a.json()["body_len"], 1000);
    let s = seen.try_recv().expect("the auth service was asked");
    assert_eq!(
        (s.method.as_str(), s.original_method.as_str()),
        ("GET", "POST")
    );
    assert!(!s.content_length && s.body_len == 0, "{s:?}");
    assert_eq!(hits.load(Ordering::SeqCst), 2);

    // An HTTP/2 client's cookies, sent as fields of their own, reach the
    // service as one Cookie line.
    let req = Request::get(proxy.url("/app"))
        .header("cookie", "theme=dark")
        .header("cookie", "session=good")
        .body(body(Bytes::new()))
        .unwrap();
    let a = client::send(&client::h2c(), req).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    let s = seen.try_recv().expect("the auth service was asked");
    assert_eq!(s.cookie, "theme=dark; session=good");
    assert_eq!(hits.load(Ordering::SeqCst), 3);

    // The status decides: an allowing answer with a body past what is
    // read of it still allows.
    let a = send("GET", "/app", "session=chatty", b"").await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(a.json()["headers"]["x-auth-request-user"], "bob");
    seen.try_recv().expect("the auth service was asked");
    assert_eq!(hits.load(Ordering::SeqCst), 4);

    // Refusals come back as the service gave them, and go no further.
    let a = send("GET", "/app", "", b"").await;
    assert_eq!(a.status, 401);
    assert_eq!(a.header("www-authenticate"), Some("Bearer realm=\"test\""));
    let a = send("POST", "/app", "session=forbidden", &[b'p'; 1000]).await;
    assert_eq!(a.status, 403);
    assert_eq!(a.body, "not in the team");
    // The body was never read: the connection closes after the answer.
    assert_eq!(a.header("connection"), Some("close"));
    assert_eq!(hits.load(Ordering::SeqCst), 4);

    // With `signin`, a 401 is a redirect to the sign-in page.
    let a = send("GET", "/signin-app?q=1", "", b"").await;
    assert_eq!(a.status, 302);
    let back = format!(
        "http%3A%2F%2F127.0.0.1%3A{}%2Fsignin-app%3Fq%3D1",
        proxy.addr.port()
    );
    let location = format!("https://auth.example/start?rd={back}");
    assert_eq!(a.header("location"), Some(location.as_str()));
    // Behind a trusted balancer, the URL the balancer was asked for.
    let req = Request::get(proxy.url("/signin-app"))
        .header("x-forwarded-proto", "https")
        .header("x-forwarded-host", "app.example.com")
        .body(body(Bytes::new()))
        .unwrap();
    let a = client::send(&http, req).await;
    assert_eq!(
        a.header("location"),
        Some("https://auth.example/start?rd=https%3A%2F%2Fapp.example.com%2Fsignin-app")
    );

    // An auth service that cannot be asked lets nothing through.
    let a = send("GET", "/broken", "session=good", b"").await;
    assert_eq!(a.status, 503);
    assert_eq!(a.json()["error"], "auth service unavailable");
    assert_eq!(a.json()["route"], "broken");

    // Routes without it never ask.
    assert_eq!(send("GET", "/open", "", b"").await.status, 200);
    assert_eq!(hits.load(Ordering::SeqCst), 5);
    let asked = std::iter::from_fn(|| seen.try_recv().ok()).count();
    assert_eq!(asked, 4, "the two refusals and the sign-ins");
}

#[tokio::test]
async fn allowing_answers_are_kept_per_session_with_a_cache() {
    let (auth, mut seen) = auth_service().await;
    let app = upstream::echo("app").await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: app, endpoints: ["{app}"] }}
  - {{ name: auth, endpoints: ["{auth}"] }}
routes:
  - name: cached
    match: {{ path: /cached }}
    upstream: app
    auth_request:
      upstream: auth
      path: /oauth2/auth
      copy_headers: [x-auth-request-user]
      cache: {{ ttl: 60s }}
  - name: per-uri
    match: {{ path_prefix: /per-uri }}
    upstream: app
    auth_request: {{ upstream: auth, path: /oauth2/auth, cache: {{ ttl: 60s, per_uri: true }} }}
  - name: uncached
    match: {{ path: /uncached }}
    upstream: app
    auth_request: {{ upstream: auth, path: /oauth2/auth }}
"#,
        app = app.url(),
        auth = auth.url(),
    ))
    .await;
    let http = client::http1();
    let get = |path: &str, cookie: &str| {
        let mut req = Request::get(proxy.url(path)).header("x-auth-request-user", "mallory");
        if !cookie.is_empty() {
            req = req.header("cookie", cookie);
        }
        client::send(&http, req.body(body(Bytes::new())).unwrap())
    };
    let mut asked = || std::iter::from_fn(|| seen.try_recv().ok()).count();

    // The first request of a session asks; the next ones are let through
    // as the service named the user, without asking.
    for _ in 0..3 {
        let a = get("/cached", "session=good").await;
        assert_eq!(a.status, 200, "{:?}", a.body);
        assert_eq!(a.json()["headers"]["x-auth-request-user"], "alice");
    }
    assert_eq!(asked(), 1);
    // Another session (another cookie) is asked about.
    let a = get("/cached", "session=good; theme=dark").await;
    assert_eq!(a.status, 200);
    assert_eq!(asked(), 1);
    // Refusals are asked again every time, and requests without the
    // session's headers are never taken from the cache.
    for _ in 0..2 {
        assert_eq!(get("/cached", "session=bad").await.status, 401);
        assert_eq!(get("/cached", "").await.status, 401);
    }
    assert_eq!(asked(), 4);
    // Per URI: each path and query is its own entry.
    for path in ["/per-uri/a", "/per-uri/a", "/per-uri/b"] {
        assert_eq!(get(path, "session=good").await.status, 200);
    }
    assert_eq!(asked(), 2);
    // Without a cache, every request asks.
    for _ in 0..2 {
        assert_eq!(get("/uncached", "session=good").await.status, 200);
    }
    assert_eq!(asked(), 2);
}

/// A reload keeps a route's live state while the route states the feature
/// as before: an edit elsewhere in the ConfigMap makes no session ask the
/// auth service again and resets no mirror totals. A changed auth request
/// starts its cache afresh.
#[tokio::test]
async fn a_reload_keeps_the_auth_cache_and_mirror_counts_of_unchanged_routes() {
    let (auth, mut seen) = auth_service().await;
    let app = upstream::echo("app").await;
    let shadow = upstream::echo("shadow").await;
    let policy = |other: &str, ttl: &str| {
        format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: app, endpoints: ["{app}"] }}
  - {{ name: auth, endpoints: ["{auth}"] }}
  - {{ name: shadow, endpoints: ["{shadow}"] }}
routes:
  - {{ name: v, match: {{ path: /v }}, respond: {{ status: 200, body: "{other}" }} }}
  - name: cached
    match: {{ path: /cached }}
    upstream: app
    mirror: {{ upstream: shadow }}
    auth_request: {{ upstream: auth, path: /oauth2/auth, cache: {{ ttl: {ttl} }} }}
"#,
            app = app.url(),
            auth = auth.url(),
            shadow = shadow.url(),
        )
    };
    let mut map = ConfigMap::new(&[("routing.yaml", policy("one", "60s").as_bytes())]);
    let proxy = ProxyProcess::start_on(map.path(), &[]).await;
    let http = client::http1();
    let get = || {
        let req = Request::get(proxy.url("/cached")).header("cookie", "session=good");
        client::send(&http, req.body(body(Bytes::new())).unwrap())
    };
    let mut asked = || std::iter::from_fn(|| seen.try_recv().ok()).count();
    let mirrored = |n: u32| {
        vec![format!(
            r#"portcullis_route_mirrored_total{{route="cached",outcome="sent"}} {n}"#
        )]
    };
    let reload = |generation: u64| {
        proxy.wait_status("the reload applied", move |s| {
            s["config"]["generation"] == generation
        })
    };

    assert_eq!(get().await.status, 200);
    assert_eq!(asked(), 1);
    proxy.metrics_showing(&mirrored(1)).await;

    map.update(&[("routing.yaml", policy("two", "60s").as_bytes())]);
    reload(2).await;
    assert_eq!(get().await.status, 200);
    assert_eq!(asked(), 0, "the reload emptied an unchanged auth cache");
    proxy.metrics_showing(&mirrored(2)).await;

    map.update(&[("routing.yaml", policy("three", "30s").as_bytes())]);
    reload(3).await;
    assert_eq!(get().await.status, 200);
    assert_eq!(asked(), 1, "a changed auth request kept the old answers");
    proxy.metrics_showing(&mirrored(3)).await;
}

#[test]
fn check_names_bad_auth_caches() {
    assert_check_errors(
        r#"
upstreams:
  - { name: app, endpoints: ["http://127.0.0.1:9"] }
routes:
  - { name: a, match: { path: /a }, upstream: app, auth_request: { upstream: app, path: /auth, cache: { ttl: 0s } } }
  - { name: b, match: { path: /b }, upstream: app, auth_request: { upstream: app, path: /auth, cache: { ttl: 5s, key: [bad name] } } }
"#,
        &[
            (5, "cache ttl 0s: leave `cache` out instead"),
            (6, "cache key `bad name` is not a header name"),
        ],
    );
    assert_check_errors(
        r#"
upstreams: [{ name: app, endpoints: ["http://127.0.0.1:9"] }]
routes:
  - { name: c, match: { path: /c }, upstream: app, auth_request: { upstream: app, path: /auth, cache: { for: 5s } } }
"#,
        &[(4, "unknown field `for`")],
    );
}

#[test]
fn check_names_bad_auth_requests() {
    assert_check_errors(
        r#"
upstreams:
  - { name: app, endpoints: ["http://127.0.0.1:9"] }
  - { name: per-host, url: "http://{h}.svc" }
routes:
  - { name: a, match: { path: /a }, upstream: app, auth_request: { upstream: nowhere, path: /auth } }
  - { name: b, match: { path: /b }, upstream: app, auth_request: { upstream: app, path: auth } }
  - { name: c, match: { path: /c }, upstream: app, auth_request: { upstream: per-host, path: /auth } }
  - { name: d, match: { path: /d }, upstream: app, auth_request: { upstream: app, path: /auth, signin: "/start" } }
"#,
        &[
            (6, "unknown upstream `nowhere`"),
            (7, "`auth` must be a path starting with `/`"),
            (8, "needs an upstream with `endpoints`"),
            (9, "signin `/start` must be an http(s) URL"),
        ],
    );
}
