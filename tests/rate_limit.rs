//! A route's `rate_limit`: a burst, then 429 with `Retry-After` and the
//! proxy's JSON error, counted per client, per header value or per route.

use bytes::Bytes;
use hyper::Request;

use crate::support::client::{self, body};
use crate::support::{Proxy, upstream};

/// GET `path` on `proxy` with `headers`: the status and `Retry-After`.
async fn get(proxy: &Proxy, path: &str, headers: &[(&str, &str)]) -> (u16, Option<u64>) {
    let mut req = Request::get(proxy.url(path));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let answer = client::send(&client::http1(), req.body(body(Bytes::new())).unwrap()).await;
    if answer.status == 429 {
        let json = answer.json();
        assert_eq!(json["error"], "rate limit exceeded", "{json:#}");
        assert_eq!(json["status"], 429, "{json:#}");
        assert!(json["route"].is_string(), "{json:#}");
    }
    let retry = answer
        .headers
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok());
    (answer.status.as_u16(), retry)
}

/// How many of `n` requests passed before the first 429, and that 429's
/// `Retry-After`; every request after the first 429 must be one too.
async fn passed(proxy: &Proxy, path: &str, headers: &[(&str, &str)], n: usize) -> (usize, u64) {
    let mut ok = 0;
    let mut retry = None;
    for _ in 0..n {
        match get(proxy, path, headers).await {
            (200, _) if retry.is_none() => ok += 1,
            (429, Some(after)) => {
                retry.get_or_insert(after);
            }
            other => panic!("{path} {headers:?}: {other:?} after {ok} passed"),
        }
    }
    (ok, retry.expect("no request was limited"))
}

#[tokio::test]
async fn a_burst_passes_then_429_says_when_to_come_back() {
    let app = upstream::echo("app").await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
routes:
  - {{ name: limited, match: {{ path: /limited }}, upstream: app, rate_limit: {{ rate: 60/h, burst: 2 }} }}
  - {{ name: by-key, match: {{ path: /by-key }}, upstream: app, rate_limit: {{ rate: 1/h, burst: 1, key: "header:X-Api-Key" }} }}
  - {{ name: shared, match: {{ path: /shared }}, upstream: app, rate_limit: {{ rate: 1/h, burst: 1, key: route }} }}
  - {{ name: free, match: {{ path: /free }}, upstream: app }}
"#,
        app.url()
    ))
    .await;

    // 60 an hour with 2 more at once: 3 pass (as nginx's burst=2
    // nodelay), then one a minute; Retry-After rounds up to that minute.
    let (ok, retry) = passed(&proxy, "/limited", &[], 6).await;
    assert_eq!(ok, 3);
    assert!((59..=60).contains(&retry), "Retry-After {retry}");
    // Other routes are not touched by it.
    for _ in 0..5 {
        assert_eq!(get(&proxy, "/free", &[]).await.0, 200);
    }

    // Per header value: each key its own allowance; no header is one key.
    let (ok, retry) = passed(&proxy, "/by-key", &[("x-api-key", "a")], 4).await;
    assert_eq!(ok, 2);
    assert!((3590..=3600).contains(&retry), "Retry-After {retry}");
    assert_eq!(
        passed(&proxy, "/by-key", &[("x-api-key", "b")], 3).await.0,
        2
    );
    assert_eq!(passed(&proxy, "/by-key", &[], 3).await.0, 2);

    // Per route: whoever asks, two in all.
    assert_eq!(get(&proxy, "/shared", &[("x-api-key", "a")]).await.0, 200);
    assert_eq!(get(&proxy, "/shared", &[("x-api-key", "b")]).await.0, 200);
    assert_eq!(get(&proxy, "/shared", &[("x-api-key", "c")]).await.0, 429);
}

/// Behind a proxy the listener trusts, the client is the last
/// `X-Forwarded-For` entry, the one that proxy appended: clients behind
/// it are counted apart, and one that makes up earlier entries gains
/// nothing. Without that trust, a client's own header changes nothing.
#[tokio::test]
async fn behind_a_trusted_proxy_each_forwarded_client_is_counted_apart() {
    let app = upstream::echo("app").await;
    let yaml = |trust: bool| {
        format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0", trust_forwarded_headers: {trust} }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
routes:
  - {{ name: hooks, match: {{ path: /hooks }}, upstream: app, rate_limit: {{ rate: 1/h, burst: 1 }} }}
"#,
            app.url()
        )
    };
    let trusted = Proxy::start_yaml(&yaml(true)).await;
    let from = |client: &'static str| [("x-forwarded-for", client)];
    assert_eq!(
        passed(&trusted, "/hooks", &from("203.0.113.7"), 3).await.0,
        2
    );
    // The same client, forging an entry before the real one.
    assert_eq!(
        get(&trusted, "/hooks", &from("9.9.9.9, 203.0.113.7"))
            .await
            .0,
        429
    );
    // Another client behind the same proxy.
    assert_eq!(
        passed(&trusted, "/hooks", &from("198.51.100.1"), 3).await.0,
        2
    );

    let untrusted = Proxy::start_yaml(&yaml(false)).await;
    assert_eq!(
        passed(&untrusted, "/hooks", &from("203.0.113.7"), 3)
            .await
            .0,
        2
    );
    assert_eq!(
        get(&untrusted, "/hooks", &from("198.51.100.1")).await.0,
        429
    );
}

#[test]
fn check_names_a_bad_rate_limit_at_its_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("policy.yaml"),
        r#"listeners: [{ name: http, bind: "127.0.0.1:0" }]
routes:
  - name: a
    match: { path: /a }
    respond: { status: 200 }
    rate_limit: { rate: 10/fortnight }
  - name: b
    match: { path: /b }
    respond: { status: 200 }
    rate_limit: { rate: 10/s, burst: -1, key: "header:bad header" }
"#,
    )
    .unwrap();
    // An unknown key stops its file's parse, so it gets a file of its own.
    std::fs::write(
        dir.path().join("other.yaml"),
        r#"routes:
  - name: c
    match: { path: /c }
    respond: { status: 200 }
    rate_limit: { rate: 10/s, per: client }
"#,
    )
    .unwrap();
    let (ok, _, err) = crate::support::check(dir.path());
    assert!(!ok);
    assert!(
        err.contains("policy.yaml:6:") && err.contains("COUNT/s"),
        "{err}"
    );
    assert!(
        err.contains("policy.yaml:10:") && err.contains("burst `-1`"),
        "{err}"
    );
    assert!(err.contains("`bad header` is not a header name"), "{err}");
    assert!(
        err.contains("other.yaml:5:") && err.contains("unknown field `per`"),
        "{err}"
    );
}

/// Two routing-core replicas with `--state` sharing a route's limit
/// (`shared: true`): a load spread over both admits the limit once, not
/// once per replica; another route's unshared limit stays each
/// replica's. With the store gone each replica keeps serving under its
/// own limit, and says so.
#[tokio::test]
async fn replicas_share_a_limit_through_the_state_store_and_fall_back_to_their_own() {
    use crate::support::process::ProxyProcess;
    use crate::support::redis::Redis;
    let app = upstream::echo("app").await;
    let mut redis = Redis::start().await;
    // A burst of 20 and then one request every 6 minutes: any short run
    // admits exactly 20 per counter.
    let policy = format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
routes:
  - {{ name: login, match: {{ path: /login }}, upstream: app, rate_limit: {{ rate: 10/h, burst: 19, shared: true }} }}
  - {{ name: own, match: {{ path: /own }}, upstream: app, rate_limit: {{ rate: 10/h, burst: 19 }} }}
"#,
        app.url()
    );
    let replicas = [
        ProxyProcess::start(&policy, &["--state", &redis.url]).await,
        ProxyProcess::start(&policy, &["--state", &redis.url]).await,
    ];
    for r in &replicas {
        r.wait_status("the state store up", |s| s["state"]["state"] == "up")
            .await;
    }
    // 30 requests to each, at once: 20 pass in all.
    let admitted = |path: &'static str, replicas: &[&ProxyProcess]| {
        let urls: Vec<String> = replicas.iter().map(|r| r.url(path)).collect();
        async move {
            let each = urls.into_iter().map(|url| {
                tokio::spawn(async move {
                    let mut passed = 0;
                    for _ in 0..30 {
                        let answer = client::get(&url).await;
                        match answer.status.as_u16() {
                            200 => passed += 1,
                            429 => assert!(answer.headers.contains_key("retry-after")),
                            other => panic!("{url}: {other}"),
                        }
                    }
                    passed
                })
            });
            let mut total = 0;
            for passed in futures_util::future::join_all(each).await {
                total += passed.unwrap();
            }
            total
        }
    };
    let both = [&replicas[0], &replicas[1]];
    let shared = admitted("/login", &both).await;
    // A request whose script Redis did not answer within `WAIT` (a busy
    // machine) was counted locally instead: admitted by that replica's
    // own bucket, it took one of its tokens.
    let mut local_before = Vec::new();
    for r in &replicas {
        let state = r.status().await["state"].clone();
        let (counted, local) = (state["counted"].as_u64(), state["counted_locally"].as_u64());
        assert_eq!(
            counted.zip(local).map(|(c, l)| c + l),
            Some(30),
            "{state:#}"
        );
        local_before.push(local.unwrap());
    }
    let local: u64 = local_before.iter().sum();
    // Redis admits 20 of what reaches it; one it admitted but answered
    // late was also admitted locally, so counts once, not twice.
    let reached_redis = 60 - local;
    assert!(
        (20.min(reached_redis)..=20 + local).contains(&shared),
        "shared: {shared} passed, {local} of them counted locally"
    );
    assert_eq!(
        admitted("/own", &both).await,
        40,
        "an unshared limit is each replica's"
    );
    replicas[0]
        .metrics_showing(&["portcullis_state_store_up 1".to_owned()])
        .await;

    // The store gone: each replica counts for itself again.
    redis.kill().await;
    for r in &replicas {
        r.wait_status("the state store down", |s| s["state"]["state"] == "down")
            .await;
        r.metrics_showing(&["portcullis_state_store_up 0".to_owned()])
            .await;
    }
    for (i, r) in replicas.iter().enumerate() {
        let alone = admitted("/login", &[r]).await;
        let own = 20u64.saturating_sub(local_before[i]);
        assert_eq!(alone, own, "replica {i}'s own limit");
    }
    let status = replicas[1].status().await;
    assert!(
        status["state"]["counted_locally"].as_u64() >= Some(30),
        "{status:#}"
    );
}
