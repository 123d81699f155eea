//! Route matching and route actions beyond the default policies.

use std::time::Duration;

use bytes::Bytes;
use hyper::Request;

use crate::support::Proxy;
use crate::support::client::{self, Answer, body};
use crate::support::process::ProxyProcess;
use crate::support::upstream;

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

/// One `Host` reaches the upstream: the endpoint's, the client's when the
/// upstream preserves it, or the route's own when its header edits give
/// one (never two, which an upstream would take as a smuggling attempt).
#[tokio::test]
async fn the_upstream_gets_one_host_the_endpoints_the_clients_or_the_routes() {
    let e = upstream::echo("e").await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: e, endpoints: ["{url}"] }}
  - {{ name: kept, endpoints: ["{url}"], preserve_host: true }}
routes:
  - {{ name: plain, match: {{ path: /plain }}, upstream: e }}
  - {{ name: kept, match: {{ path: /kept }}, upstream: kept }}
  - name: own
    match: {{ path: /own }}
    upstream: e
    request_headers: {{ set: {{ host: api.internal }} }}
  - name: added
    match: {{ path: /added }}
    upstream: kept
    request_headers: {{ add: {{ host: api.internal }} }}
"#,
        url = e.url()
    ))
    .await;
    let endpoint = e.url().trim_start_matches("http://").to_owned();
    for (path, want) in [
        ("/plain", endpoint.as_str()),
        ("/kept", "public.example"),
        ("/own", "api.internal"),
        ("/added", "api.internal"),
    ] {
        let a = send(&proxy, "GET", "public.example", path, &[]).await;
        assert_eq!(a.status, 200, "{path}");
        let j: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
        // Repeated fields reach the echo joined with ", ".
        assert_eq!(j["headers"]["host"], want, "{path}");
    }
}

/// The forwarding fields reach the upstream once each whichever way the
/// request goes: by the own HTTP/1.1 exchange (which writes them after
/// the request's fields), through hyper with a streamed body, and past a
/// route's edits, which see them as set.
#[tokio::test]
async fn the_upstream_gets_each_forwarding_field_once_whichever_way_it_goes() {
    let e = upstream::echo("e").await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: e, endpoints: ["{}"] }}]
routes:
  - name: edited
    match: {{ path: /edited }}
    upstream: e
    request_headers: {{ set: {{ x-forwarded-proto: https }}, remove: [x-forwarded-host] }}
  - {{ name: plain, match: {{ path_prefix: / }}, upstream: e }}
"#,
        e.url()
    ))
    .await;
    let fields = |a: &Answer| {
        assert_eq!(a.status, 200, "{a:?}");
        let j: serde_json::Value = serde_json::from_slice(&a.body).unwrap();
        // Repeated fields reach the echo joined with ", ".
        ["x-forwarded-for", "x-forwarded-proto", "x-forwarded-host"]
            .map(|name| j["headers"][name].as_str().map(str::to_owned))
    };
    let want = |proto: &str, host: Option<&str>| {
        [Some("127.0.0.1"), Some(proto), host].map(|v| v.map(str::to_owned))
    };
    let a = send(&proxy, "GET", "public.example", "/plain", &[]).await;
    assert_eq!(fields(&a), want("http", Some("public.example")));
    let a = send(&proxy, "GET", "public.example", "/edited", &[]).await;
    assert_eq!(fields(&a), want("https", None));
    // A body that streams goes by hyper's client.
    let (tx, sent) = client::streamed_post_with(proxy.url("/streamed"), &[("host", "b.example")]);
    tx.send(Bytes::from_static(b"piece")).await.unwrap();
    drop(tx);
    let a = sent.await.unwrap();
    assert_eq!(fields(&a), want("http", Some("b.example")));
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
