//! Policy plugins in the real proxy: the built components from
//! plugins/dist, against real upstreams.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::header::HeaderValue;
use hyper::{Request, Response};

use crate::support::client::{self, Answer, body};
use crate::support::process::{Confine, ProxyProcess};
use crate::support::upstream::{self, Upstream};
use crate::support::{Proxy, plugin_file, policy_dir};

pub(crate) fn hmac_sha256_hex(secret: &[u8], body: &[u8]) -> String {
    use hmac::{Hmac, Mac};
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(secret).unwrap();
    mac.update(body);
    hex::encode(mac.finalize().into_bytes())
}

/// The shipped default policies, with the webhook plugin beside them.
fn default_policies_with_plugin() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies/routing.yaml");
    std::fs::copy(repo, dir.path().join("routing.yaml")).unwrap();
    std::fs::copy(
        plugin_file("webhook-signature"),
        dir.path().join("webhook-signature.wasm"),
    )
    .unwrap();
    dir
}

/// The default policies in-process, webhooks to `events`, with
/// `WEBHOOK_SECRET` set to `secret` when given.
async fn default_webhook_proxy(events: &Upstream, secret: Option<&str>) -> Proxy {
    let mut env = vec![
        ("PORTCULLIS_LISTEN", "127.0.0.1:0".to_owned()),
        ("EVENTSOURCE_URL", events.url()),
    ];
    if let Some(secret) = secret {
        env.push(("WEBHOOK_SECRET", secret.to_owned()));
    }
    Proxy::start_dir(default_policies_with_plugin(), &env).await
}

#[tokio::test]
async fn github_webhooks_are_verified_and_forwarded_byte_for_byte() {
    let (events, hits) = upstream::counted_echo("counted").await;
    let secret = "It's a Secret to Everybody";
    let proxy = default_webhook_proxy(&events, Some(secret)).await;
    let payload = Bytes::from(format!(
        "{{\"ref\":\"refs/heads/main\",\"pad\":\"{}\"}}",
        "x".repeat(100_000)
    ));
    let signature = format!("sha256={}", hmac_sha256_hex(secret.as_bytes(), &payload));
    let url = proxy.url("/webhooks/argo-events/github/push");

    let signed = Request::post(&url)
        .header("x-hub-signature-256", &signature)
        .body(body(payload.clone()))
        .unwrap();
    let a = client::send(&client::http1(), signed).await;
    assert_eq!(a.status, 200, "{:?}", String::from_utf8_lossy(&a.body));
    let j = a.json();
    assert_eq!(j["path"], "/webhooks/argo-events/github/push");
    assert_eq!(j["body_len"], payload.len());
    assert_eq!(j["body_fnv"], upstream::fnv(&payload));
    assert_eq!(hits.load(Ordering::SeqCst), 1);

    let mut tampered = payload.to_vec();
    tampered[10] ^= 1;
    let bad = Request::post(&url)
        .header("x-hub-signature-256", &signature)
        .body(body(tampered))
        .unwrap();
    let a = client::send(&client::http1(), bad).await;
    assert_eq!(a.status, 401);
    assert_eq!(a.json()["error"], "invalid webhook signature");

    let unsigned = Request::post(&url).body(body(payload.clone())).unwrap();
    assert_eq!(client::send(&client::http1(), unsigned).await.status, 401);
    assert_eq!(
        hits.load(Ordering::SeqCst),
        1,
        "rejected webhooks must never reach the event source"
    );
}

#[tokio::test]
async fn the_default_webhook_route_takes_a_webhook_as_large_as_github_sends() {
    // GitHub caps payloads at 25 MB; a push of a big monorepo gets close.
    let events = upstream::echo("events").await;
    let secret = "big-secret";
    let proxy = default_webhook_proxy(&events, Some(secret)).await;
    let payload = Bytes::from(vec![b'x'; 24 << 20]);
    let signature = format!("sha256={}", hmac_sha256_hex(secret.as_bytes(), &payload));
    let req = Request::post(proxy.url("/webhooks/argo-events/github/push"))
        .header("x-hub-signature-256", &signature)
        .body(body(payload.clone()))
        .unwrap();
    let a = client::send(&client::http1(), req).await;
    assert_eq!(a.status, 200, "{:?}", String::from_utf8_lossy(&a.body));
    assert_eq!(a.json()["body_len"], payload.len());
    assert_eq!(a.json()["body_fnv"], upstream::fnv(&payload));
}

#[tokio::test]
async fn without_a_webhook_secret_unsigned_webhooks_pass_as_before() {
    let (events, hits) = upstream::counted_echo("counted").await;
    let proxy = default_webhook_proxy(&events, None).await;
    let req = Request::post(proxy.url("/webhooks/ns/github/push"))
        .body(body("{}"))
        .unwrap();
    assert_eq!(client::send(&client::http1(), req).await.status, 200);
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn gitlab_tokens_and_oversized_bodies() {
    let (events, hits) = upstream::counted_echo("counted").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: events, endpoints: ["{}"] }}]
plugins: [{{ name: sig, path: webhook-signature.wasm }}]
routes:
  - name: gitlab
    match: {{ path: /gitlab }}
    upstream: events
    plugins: [{{ use: sig, config: {{ provider: gitlab, secret: t0ken }} }}]
  - name: small
    match: {{ path: /small }}
    upstream: events
    plugins: [{{ use: sig, config: {{ provider: github, secret: s, max_body: 1024 }} }}]
  - name: capped
    match: {{ path: /capped }}
    upstream: events
    max_request_body: 2KiB
    plugins: [{{ use: sig, config: {{ provider: github, secret: s }} }}]
"#,
            events.url()
        ),
        &["webhook-signature"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;
    let ok = Request::post(proxy.url("/gitlab"))
        .header("x-gitlab-token", "t0ken")
        .body(body("{}"))
        .unwrap();
    assert_eq!(client::send(&client::http1(), ok).await.status, 200);
    let bad = Request::post(proxy.url("/gitlab"))
        .header("x-gitlab-token", "t0keN")
        .body(body("{}"))
        .unwrap();
    assert_eq!(client::send(&client::http1(), bad).await.status, 401);
    let big = Request::post(proxy.url("/small"))
        .header("x-hub-signature-256", "sha256=00")
        .body(body(vec![b'a'; 4096]))
        .unwrap();
    let a = client::send(&client::http1(), big).await;
    assert_eq!(a.status, 413);
    assert_eq!(a.json()["plugin"], "sig");
    // The client may still be sending: its connection closes after this.
    assert_eq!(a.header("connection"), Some("close"));
    // The route's own limit, below the plugin's bound, holds for the body
    // the plugin reads too (chunked: no length to refuse it by first).
    let (tx, sent) = client::streamed_post_with(
        proxy.url("/capped"),
        &[("x-hub-signature-256", "sha256=00")],
    );
    for _ in 0..4 {
        if tx.send(Bytes::from(vec![b'a'; 1024])).await.is_err() {
            break;
        }
    }
    drop(tx);
    let a = sent.await.unwrap();
    assert_eq!(a.status, 413);
    assert_eq!(a.json()["error"], "request body too large");
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn header_rules_edit_responses_and_answer_cors_preflights() {
    let (app, hits) = upstream::counted_echo("counted").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: headers, path: header-rules.wasm }}]
routes:
  - name: app
    match: {{ path_prefix: /api }}
    upstream: app
    plugins:
      - use: headers
        config:
          request: {{ set: {{ x-tenant: blue }}, remove: [cookie] }}
          response: {{ set: {{ strict-transport-security: "max-age=63072000" }}, remove: [x-powered-by] }}
          cors: {{ allow_origins: ["https://ui.example.com"], allow_credentials: true, allow_headers: [authorization] }}
"#,
            app.url()
        ),
        &["header-rules"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;

    let req = Request::get(proxy.url("/api/x"))
        .header("origin", "https://ui.example.com")
        .header("cookie", "session=1")
        .body(body(Bytes::new()))
        .unwrap();
    let a = client::send(&client::http1(), req).await;
    assert_eq!(a.status, 200);
    assert_eq!(
        a.header("strict-transport-security"),
        Some("max-age=63072000")
    );
    assert_eq!(
        a.header("access-control-allow-origin"),
        Some("https://ui.example.com")
    );
    assert_eq!(a.header("access-control-allow-credentials"), Some("true"));
    let seen = a.json();
    assert_eq!(seen["headers"]["x-tenant"], "blue");
    assert!(seen["headers"].get("cookie").is_none());
    assert_eq!(hits.load(Ordering::SeqCst), 1);

    let preflight = Request::options(proxy.url("/api/x"))
        .header("origin", "https://ui.example.com")
        .header("access-control-request-method", "POST")
        .body(body(Bytes::new()))
        .unwrap();
    let a = client::send(&client::http1(), preflight).await;
    assert_eq!(a.status, 204);
    assert_eq!(
        a.header("access-control-allow-origin"),
        Some("https://ui.example.com")
    );
    assert_eq!(
        a.header("access-control-allow-headers"),
        Some("authorization")
    );
    assert!(
        a.header("access-control-allow-methods")
            .unwrap()
            .contains("POST")
    );
    assert_eq!(
        hits.load(Ordering::SeqCst),
        1,
        "a preflight is answered by the plugin"
    );

    let foreign = Request::options(proxy.url("/api/x"))
        .header("origin", "https://evil.example.com")
        .header("access-control-request-method", "POST")
        .body(body(Bytes::new()))
        .unwrap();
    assert_eq!(client::send(&client::http1(), foreign).await.status, 403);
}

#[tokio::test]
async fn cors_responses_keep_the_upstreams_vary_and_are_safe_to_cache() {
    let app = upstream::serve(|_req| async {
        Response::builder()
            .header("vary", "Accept-Encoding")
            .body(upstream::full("ok"))
            .unwrap()
    })
    .await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: headers, path: header-rules.wasm }}]
routes:
  - name: listed
    match: {{ path_prefix: /listed }}
    upstream: app
    plugins: [{{ use: headers, config: {{ cors: {{ allow_origins: ["https://ui.example.com"] }} }} }}]
  - name: any
    match: {{ path_prefix: /any }}
    upstream: app
    plugins: [{{ use: headers, config: {{ cors: {{ allow_origins: ["*"] }} }} }}]
"#,
            app.url()
        ),
        &["header-rules"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;
    let http = client::http1();
    let get = |path: &str, origin: Option<&str>| {
        let mut req = Request::get(proxy.url(path));
        if let Some(o) = origin {
            req = req.header("origin", o);
        }
        client::send(&http, req.body(body(Bytes::new())).unwrap())
    };
    let vary = |a: &Answer| -> Vec<String> {
        a.headers
            .get_all("vary")
            .iter()
            .flat_map(|v| v.to_str().unwrap().split(','))
            .map(|t| t.trim().to_ascii_lowercase())
            .collect()
    };
    // The answer depends on Origin: every response says so, the one to a
    // request without Origin too, and the upstream's Vary stays.
    for origin in [Some("https://ui.example.com"), None] {
        let a = get("/listed", origin).await;
        assert_eq!(a.status, 200);
        assert_eq!(vary(&a), ["accept-encoding", "origin"], "origin {origin:?}");
        assert_eq!(
            a.header("access-control-allow-origin"),
            origin,
            "origin {origin:?}"
        );
    }
    // A plain `*` does not vary: it is on every response.
    let a = get("/any", None).await;
    assert_eq!(a.header("access-control-allow-origin"), Some("*"));
    assert_eq!(vary(&a), ["accept-encoding"]);
}

#[tokio::test]
async fn misbehaving_plugins_fail_only_their_own_requests() {
    let good = upstream::echo("good").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: good, endpoints: ["{}"] }}]
plugins:
  - {{ name: loop, path: fixture-loop-forever.wasm }}
  - {{ name: trap, path: fixture-trap.wasm }}
  - {{ name: hog, path: fixture-grow-memory.wasm }}
  - {{ name: sleep, path: fixture-sleep.wasm }}
routes:
  - {{ name: good, match: {{ path: /good }}, upstream: good }}
  - {{ name: loop, match: {{ path: /loop }}, upstream: good, plugins: [{{ use: loop }}] }}
  # Trap and hog get a roomy deadline so that only their own failure
  # decides the answer even on a loaded machine; the loop keeps 10 ms.
  - {{ name: trap, match: {{ path: /trap }}, upstream: good, plugins: [{{ use: trap, timeout: 2s }}] }}
  # Reads past the end of its memory: trapped by a guard page, not a check.
  - {{ name: oob, match: {{ path: /oob }}, upstream: good, plugins: [{{ use: trap, timeout: 2s, config: {{ how: out-of-bounds }} }}] }}
  - {{ name: hog, match: {{ path: /hog }}, upstream: good, plugins: [{{ use: hog, memory: 8MiB, timeout: 2s }}] }}
  - {{ name: open, match: {{ path: /open }}, upstream: good, plugins: [{{ use: loop, fail: open }}] }}
  # Sleeps 5 s: a plugin may not block its worker, so the call traps at once.
  - {{ name: sleep, match: {{ path: /sleep }}, upstream: good, plugins: [{{ use: sleep, timeout: 2s }}] }}
"#,
            good.url()
        ),
        &[
            "fixture-loop-forever",
            "fixture-trap",
            "fixture-grow-memory",
            "fixture-sleep",
        ],
    );
    let proxy = Arc::new(Proxy::start_dir(dir, &[]).await);

    // A steady stream on the good route runs throughout.
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let steady = {
        let (proxy, stop) = (proxy.clone(), stop.clone());
        tokio::spawn(async move {
            let c = client::http1();
            let mut n = 0;
            while !stop.load(Ordering::SeqCst) {
                let req = Request::get(proxy.url("/good"))
                    .body(body(Bytes::new()))
                    .unwrap();
                let a = client::send(&c, req).await;
                assert_eq!(
                    a.status, 200,
                    "the good route failed while plugins misbehaved"
                );
                n += 1;
            }
            n
        })
    };

    for round in 0..3 {
        for (path, status, error) in [
            ("/loop", 503, "plugin timed out"),
            ("/trap", 500, "plugin failed"),
            ("/oob", 500, "plugin failed"),
            ("/hog", 500, "plugin ran out of memory"),
            ("/sleep", 500, "plugin failed"),
        ] {
            let started = Instant::now();
            let a = client::get(&proxy.url(path)).await;
            let took = started.elapsed();
            assert_eq!(
                a.status,
                status,
                "{path} round {round}: {:?}",
                String::from_utf8_lossy(&a.body)
            );
            assert_eq!(a.json()["error"], error, "{path}");
            // Deadlines are 10 ms (loop) and 2 s; the margin covers a
            // debug build. Without the deadline the loop never returns.
            let limit = Duration::from_secs(if path == "/loop" || path == "/sleep" {
                1
            } else {
                3
            });
            assert!(took < limit, "{path} took {took:?}");
        }
    }
    // fail: open lets the request through after the same timeout.
    assert_eq!(client::get(&proxy.url("/open")).await.status, 200);

    stop.store(true, Ordering::SeqCst);
    let served = steady.await.unwrap();
    assert!(served > 0);
}

#[tokio::test]
async fn a_panicking_or_blocking_plugin_is_logged_with_its_name_and_cause() {
    let good = upstream::echo("good").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: good, endpoints: ["{}"] }}]
plugins:
  - {{ name: crashy, path: fixture-trap.wasm }}
  - {{ name: sleepy, path: fixture-sleep.wasm }}
  - {{ name: hoarder, path: fixture-hoard.wasm }}
routes:
  - {{ name: trap, match: {{ path: /trap }}, upstream: good, plugins: [{{ use: crashy, timeout: 2s }}] }}
  - {{ name: hoard, match: {{ path: /hoard }}, upstream: good, plugins: [{{ use: hoarder, timeout: 2s }}] }}
  - {{ name: sleep, match: {{ path: /sleep }}, upstream: good, plugins: [{{ use: sleepy, timeout: 2s }}] }}
  - {{ name: oob, match: {{ path: /oob }}, upstream: good, plugins: [{{ use: crashy, config: {{ how: out-of-bounds }} }}] }}
  - {{ name: good, match: {{ path: /good }}, upstream: good }}
"#,
            good.url()
        ),
        &["fixture-trap", "fixture-sleep", "fixture-hoard"],
    );
    let mut proxy = crate::support::process::ProxyProcess::start_on(dir.path(), &[]).await;
    let a = client::get(&proxy.url("/trap")).await;
    assert_eq!(a.status, 500);
    // The standard library prints the panic to stderr before trapping; the
    // host logs it, tagged with the plugin and the stream.
    let line = proxy.wait_for_log("this plugin always fails").await;
    assert!(line.contains("crashy") && line.contains("stderr"), "{line}");
    // The failure itself names what the trap was, not only that one happened.
    let failed = proxy.wait_for_log("plugin failed; request refused").await;
    assert!(failed.contains("unreachable"), "{failed}");
    // Unconfined, the pool reserves a full 32-bit range per memory and
    // plugin code has no bounds checks: a read past the end is caught by
    // the unmapped pages, and named as such.
    let pooled = !proxy
        .logs
        .lock()
        .unwrap()
        .iter()
        .any(|l| l.contains("allocating plugin instances on demand"));
    assert!(pooled, "the instance pool was not reserved");
    assert_eq!(client::get(&proxy.url("/oob")).await.status, 500);
    let oob = proxy.wait_for_log("out of bounds memory access").await;
    assert!(oob.contains("crashy"), "{oob}");
    // A plugin that tries to wait (here: sleep) is stopped at once, and the
    // log says which call would have blocked.
    assert_eq!(client::get(&proxy.url("/sleep")).await.status, 500);
    let blocked = proxy.wait_for_log("plugins may not block").await;
    assert!(
        blocked.contains("sleepy") && blocked.contains("pollable"),
        "{blocked}"
    );
    // A plugin that takes host handles and never gives them back is
    // stopped at the table's cap (host memory its memory cap does not
    // count), not after 50,000 of them.
    assert_eq!(client::get(&proxy.url("/hoard")).await.status, 500);
    let full = proxy.wait_for_log("hoarder").await;
    assert!(full.contains("resource table has no free keys"), "{full}");
    assert_eq!(client::get(&proxy.url("/good")).await.status, 200);
}

/// The filesystem and the network are linked (interpreters' standard
/// libraries import them) with nothing behind them: a plugin that tries
/// to read a file, list a directory, connect or look a name up is
/// refused each time, and no connection arrives.
#[tokio::test]
async fn a_plugin_cannot_reach_files_or_the_network() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
plugins: [{{ name: escape, path: fixture-escape.wasm }}]
routes:
  - name: r
    match: {{ path: /r }}
    respond: {{ status: 204 }}
    plugins: [{{ use: escape, config: {{ connect: "{}" }} }}]
"#,
            listener.local_addr().unwrap()
        ),
        &["fixture-escape"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;
    let answer = client::get(&proxy.url("/r")).await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let report = answer.json();
    for attempt in ["file", "directory", "connect", "lookup"] {
        let outcome = report[attempt]
            .as_str()
            .unwrap_or_else(|| panic!("{report}"));
        assert!(outcome.starts_with("refused: "), "{attempt}: {report}");
    }
    // The attempts were over before the answer: a connection made would
    // be waiting to be accepted.
    let accepted = listener.accept();
    assert!(
        accepted
            .as_ref()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock),
        "{accepted:?}"
    );
}

/// The contract is the WIT, not the Rust SDK: the Python example (built
/// by componentize-py, CPython inside) and the JavaScript one (built by
/// componentize-js, SpiderMonkey inside) check their config for `check`,
/// refuse and forward, and count, as a Rust plugin does.
#[tokio::test]
async fn plugins_written_in_python_and_javascript_run_as_rust_ones_do() {
    let app = upstream::echo("app").await;
    for (name, file) in [
        ("py", "example-require-header-py"),
        ("js", "example-require-header-js"),
    ] {
        let yaml = |config: &str| {
            format!(
                r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: {name}, path: {file}.wasm }}]
routes:
  - {{ name: api, match: {{ path_prefix: /api }}, upstream: app, plugins: [{{ use: {name}, config: {config}, timeout: 100ms }}] }}
"#,
                app.url()
            )
        };
        let bad = policy_dir(&yaml("{ head: x-api-key }"), &[file]);
        let (ok, _, stderr) = crate::support::check(bad.path());
        assert!(!ok, "{file}: {stderr}");
        assert!(
            stderr.contains(&format!("plugin `{name}` on route `api`: config refused: `header`: the name of the header to require")),
            "{file}: {stderr}"
        );
        // YAML's types reach the plugin: a header name YAML read as a
        // number is named, with the way out.
        let number = policy_dir(&yaml("{ header: 123 }"), &[file]);
        let (ok, _, stderr) = crate::support::check(number.path());
        assert!(!ok, "{file}: {stderr}");
        assert!(
            stderr.contains("config refused: `header`: expected text, found 123 (YAML reads an unquoted number or true/false as such: quote the value)"),
            "{file}: {stderr}"
        );

        let good = policy_dir(&yaml("{ header: x-api-key }"), &[file]);
        let proxy = crate::support::process::ProxyProcess::start_on(good.path(), &[]).await;
        let refused = client::get(&proxy.url("/api/a")).await;
        assert_eq!(refused.status, 403, "{file}");
        assert_eq!(refused.json()["error"], "missing header", "{file}");
        let req = Request::get(proxy.url("/api/b"))
            .header("x-api-key", "k")
            .body(body(""))
            .unwrap();
        let passed = client::send(&client::http1(), req).await;
        assert_eq!(passed.status, 200, "{file}: {:?}", passed.body);
        assert_eq!(passed.json()["path"], "/api/b", "{file}");
        proxy
            .metrics_showing(&[format!(
                r#"portcullis_plugin_counter_total{{plugin="{name}",name="refused"}} 1"#
            )])
            .await;
        // Instances are reused: a few hundred calls replace none (an
        // image near the cap is no reason; growing toward it is).
        let statuses = pipelined_to(proxy.addr, "/api/c", 500).await;
        assert_eq!(
            statuses.keys().collect::<Vec<_>>(),
            ["200"],
            "{file}: {statuses:?}"
        );
        assert_eq!(recycled(&proxy, name).await, 0, "{file}");
    }
}

/// Sends `n` bodiless GETs of `/r` with an `x-api-key` on one
/// connection, 50 in flight at a time, and counts the answers' statuses.
async fn pipelined(
    addr: std::net::SocketAddr,
    n: usize,
) -> std::collections::BTreeMap<String, usize> {
    pipelined_to(addr, "/r", n).await
}

/// [`pipelined`], to `path`.
async fn pipelined_to(
    addr: std::net::SocketAddr,
    path: &str,
    n: usize,
) -> std::collections::BTreeMap<String, usize> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const BATCH: usize = 50;
    let one = format!("GET {path} HTTP/1.1\r\nhost: t\r\nx-api-key: k\r\n\r\n");
    let batch = one.repeat(BATCH).into_bytes();
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let mut statuses = std::collections::BTreeMap::new();
    let mut buf = Vec::new();
    let mut chunk = vec![0; 64 * 1024];
    for _ in 0..n / BATCH {
        conn.write_all(&batch).await.unwrap();
        let mut answered = 0;
        while answered < BATCH {
            // Answers here have no body (204) or a short one with its
            // length; a head ends at the blank line.
            match buf.windows(4).position(|w| w == b"\r\n\r\n") {
                Some(end) => {
                    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                    let length: usize = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length: "))
                        .map_or(0, |v| v.trim().parse().unwrap());
                    if buf.len() < end + 4 + length {
                        let got = conn.read(&mut chunk).await.unwrap();
                        assert!(got > 0, "the proxy closed the connection");
                        buf.extend_from_slice(&chunk[..got]);
                        continue;
                    }
                    let status = head.split(' ').nth(1).unwrap_or("?").to_owned();
                    *statuses.entry(status).or_insert(0) += 1;
                    buf.drain(..end + 4 + length);
                    answered += 1;
                }
                None => {
                    let got = conn.read(&mut chunk).await.unwrap();
                    assert!(got > 0, "the proxy closed the connection");
                    buf.extend_from_slice(&chunk[..got]);
                }
            }
        }
    }
    statuses
}

/// SpiderMonkey (the JavaScript example's engine) grows its heap call
/// after call, 2 MiB at a time from a 9.5 MB image, and collects late:
/// under a 13 MiB cap a reused instance ran out in the middle of a
/// request every ~7,000 calls (3 of 40,000 refused with the recycling
/// off). An instance with less room left than two of its growths is not
/// reused, so none does. (100 ms deadlines here: a fresh instance's first
/// call, instantiation and `configure` included, takes ~1 ms in a release
/// build and more in a debug one on busy cores; the 10 ms default once
/// refused one in CI.)
#[tokio::test]
async fn an_instance_near_its_memory_cap_is_replaced_before_it_runs_out() {
    let dir = policy_dir(
        r#"
listeners: [{ name: http, bind: "127.0.0.1:0", max_requests_per_connection: 0 }]
plugins: [{ name: js, path: example-require-header-js.wasm }]
routes:
  - { name: r, match: { path: /r }, respond: { status: 204 }, plugins: [{ use: js, config: { header: x-api-key }, memory: 13MiB, timeout: 100ms }] }
"#,
        &["example-require-header-js"],
    );
    let proxy = crate::support::process::ProxyProcess::start_on(dir.path(), &[]).await;
    // Two connections (one per worker), requests pipelined 50 at a time:
    // tens of thousands of calls in seconds, where the growth to the cap
    // takes a few thousand per instance.
    let tasks: Vec<_> = (0..2)
        .map(|_| tokio::spawn(pipelined(proxy.addr, 20_000)))
        .collect();
    for task in tasks {
        let statuses = task.await.unwrap();
        assert_eq!(statuses.keys().collect::<Vec<_>>(), ["204"], "{statuses:?}");
    }
    assert_eq!(proxy.count_logs("ran out of memory"), 0);
    // Replaced, and counted, now and then, not on every call.
    let recycled = recycled(&proxy, "js").await;
    assert!((1..1000).contains(&recycled), "recycled {recycled} times");
}

/// The `/metrics` value of `name{labels}`, if the line is there.
async fn metric_value(
    proxy: &crate::support::process::ProxyProcess,
    name: &str,
    labels: &str,
) -> Option<f64> {
    let text = client::get(&proxy.admin_url("/metrics")).await.body;
    let line = format!("{name}{{{labels}}} ");
    let text = String::from_utf8_lossy(&text);
    let found: Vec<f64> = text
        .lines()
        .filter_map(|l| l.strip_prefix(&line))
        .map(|n| n.parse().unwrap())
        .collect();
    assert!(found.len() <= 1, "{name}{{{labels}}} twice:\n{text}");
    found.first().copied()
}

#[tokio::test]
async fn metrics_show_how_near_each_plugin_is_to_its_memory_cap() {
    // Three uses, capped at 8, 6 and 4 MiB; the hog grows until refused.
    const POLICY: &str = r#"
listeners: [{ name: http, bind: "127.0.0.1:0" }]
upstreams: [{ name: app, endpoints: ["APP"] }]
plugins:
  - { name: gate, path: example-require-header.wasm }
  - { name: hog, path: fixture-grow-memory.wasm }
  - { name: rules, path: header-rules.wasm }
global_plugins: [{ use: rules, config: { response: { set: { x-seen: "1" } } }, memory: 4MiB }]
routes:
  - { name: api, match: { path: /api }, upstream: app, plugins: [{ use: gate, config: { header: x-key }, memory: 8MiB }] }
  - { name: hog, match: { path: /hog }, upstream: app, plugins: [{ use: hog, memory: 6MiB, timeout: 2s }] }
"#;
    let app = upstream::echo("app").await;
    let dir = policy_dir(
        &POLICY.replace("APP", &app.url()),
        &[
            "example-require-header",
            "fixture-grow-memory",
            "header-rules",
        ],
    );
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let peak =
        |labels: &'static str| metric_value(&proxy, "portcullis_plugin_memory_peak_bytes", labels);
    let limit =
        |labels: &'static str| metric_value(&proxy, "portcullis_plugin_memory_limit_bytes", labels);
    const MIB: f64 = 1024.0 * 1024.0;

    // Each use once, the global one under route "", with its cap; the
    // instance each use made when the policies loaded already counts.
    for (labels, cap) in [
        (r#"plugin="gate",route="api""#, 8.0),
        (r#"plugin="hog",route="hog""#, 6.0),
        (r#"plugin="rules",route="""#, 4.0),
    ] {
        assert_eq!(limit(labels).await, Some(cap * MIB), "{labels}");
        let at_load = peak(labels).await.expect(labels);
        assert!(at_load > 0.0 && at_load < cap * MIB, "{labels}: {at_load}");
    }
    let hog_at_load = peak(r#"plugin="hog",route="hog""#).await.unwrap();

    // The hog grows to its cap and is refused: its peak is near the cap,
    // never past it; the others stay where they were.
    let gate_before = peak(r#"plugin="gate",route="api""#).await.unwrap();
    assert_eq!(client::get(&proxy.url("/hog")).await.status, 500);
    let hog = peak(r#"plugin="hog",route="hog""#).await.unwrap();
    assert!(
        hog > hog_at_load && hog > 4.0 * MIB && hog <= 6.0 * MIB,
        "hog peaked at {hog} (at load {hog_at_load})"
    );
    assert_eq!(client::get(&proxy.url("/api")).await.status, 403);
    assert_eq!(
        peak(r#"plugin="gate",route="api""#).await.unwrap(),
        gate_before
    );
}

/// How many instances of `plugin` were put aside near their memory cap.
async fn recycled(proxy: &crate::support::process::ProxyProcess, plugin: &str) -> u64 {
    let text = client::get(&proxy.admin_url("/metrics")).await.body;
    let line = format!(r#"portcullis_plugin_counter_total{{plugin="{plugin}",name="recycled"}} "#);
    String::from_utf8_lossy(&text)
        .lines()
        .find_map(|l| l.strip_prefix(&line))
        .map_or(0, |n| n.parse().unwrap())
}

/// A plugin's config is YAML data, so an unquoted `0123` is a number;
/// the plugin's refusal says to quote it.
#[test]
fn a_number_where_a_plugin_wants_text_gets_a_hint() {
    let dir = policy_dir(
        r#"
plugins: [{ name: sig, path: webhook-signature.wasm }]
routes: [{ name: r, match: { path: /r }, respond: { status: 204 }, plugins: [{ use: sig, config: { provider: gitlab, secret: 0123 } }] }]
"#,
        &["webhook-signature"],
    );
    let (ok, _, stderr) = crate::support::check(dir.path());
    assert!(!ok);
    assert!(
        stderr.contains("invalid config at `secret`: invalid type:")
            && stderr.contains("expected a string (YAML reads an unquoted number or true/false as such: quote the value)"),
        "{stderr}"
    );
}

#[test]
fn a_plugin_pin_is_checked_against_the_file() {
    let actual = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(
            std::fs::read(plugin_file("example-require-header")).unwrap(),
        ))
    };
    let policy = |pin: &str| {
        format!(
            r#"
plugins: [{{ name: gate, path: example-require-header.wasm, sha256: "{pin}" }}]
routes: [{{ name: r, match: {{ path: /r }}, respond: {{ status: 204 }}, plugins: [{{ use: gate, config: {{ header: x }} }}] }}]
"#
        )
    };
    // The file's own digest, in either case, passes.
    for pin in [actual.clone(), actual.to_uppercase()] {
        let dir = policy_dir(&policy(&pin), &["example-require-header"]);
        let (ok, _, stderr) = crate::support::check(dir.path());
        assert!(ok, "{stderr}");
    }
    // Another file's digest: both named.
    let other = "ab".repeat(32);
    let dir = policy_dir(&policy(&other), &["example-require-header"]);
    let (ok, _, stderr) = crate::support::check(dir.path());
    assert!(!ok);
    assert!(
        stderr.contains(&format!("has sha256 {actual}, but the policy pins {other}")),
        "{stderr}"
    );
}

#[test]
fn check_reports_plugin_problems_with_route_and_place() {
    let dir = policy_dir(
        r#"
listeners: [{ name: http, bind: "127.0.0.1:0" }]
upstreams: [{ name: u, endpoints: ["http://127.0.0.1:1"] }]
plugins:
  - { name: sig, path: webhook-signature.wasm }
  - { name: pinned, path: webhook-signature.wasm, sha256: "00" }
  - { name: junk, path: junk.wasm }
  - { name: absent, path: nowhere.wasm }
routes:
  - name: empty-secret
    match: { path: /a }
    upstream: u
    plugins: [{ use: sig, config: { provider: github, secret: "" } }]
  - name: unknown-key
    match: { path: /b }
    upstream: u
    plugins: [{ use: sig, config: { provider: github, secret: s, colour: red } }]
  - { name: pin, match: { path: /c }, upstream: u, plugins: [{ use: pinned, config: { provider: gitlab, secret: s } }] }
  - { name: junk, match: { path: /d }, upstream: u, plugins: [{ use: junk }] }
  - { name: absent, match: { path: /e }, upstream: u, plugins: [{ use: absent }] }
  - { name: typo, match: { path: /f }, upstream: u, plugins: [{ use: sgi }] }
"#,
        &["webhook-signature"],
    );
    std::fs::write(dir.path().join("junk.wasm"), b"\0asm not really").unwrap();
    let (ok, _, stderr) = crate::support::check(dir.path());
    assert!(!ok);
    let file = dir.path().join("policy.yaml").display().to_string();
    let dir = dir.path().display();
    // One run lists everything: the loading errors (a bad pin, an absent
    // file, an unknown plugin) and what the plugins that do load say of
    // their configs, each with file:line:column, in reading order.
    let needles = [
        format!("{file}:6:59: the pin `00` for plugin "),
        "is not a sha256 (64 hex digits, as `sha256sum` prints them); the file's is ".to_string(),
        format!("{file}:7:5: plugin {dir}/junk.wasm: not a component of a format this proxy reads"),
        format!("{file}:8:27: cannot read plugin"),
        format!("{file}:13:15: plugin `sig` on route `empty-secret`"),
        "`secret` is empty".to_string(),
        format!("{file}:17:15: plugin `sig` on route `unknown-key`"),
        "invalid config at `colour`: unknown field `colour`".to_string(),
        format!("{file}:21:70: unknown plugin `sgi`"),
    ];
    let mut at = 0;
    for needle in &needles {
        let found = stderr[at..].find(needle.as_str());
        assert!(
            found.is_some(),
            "missing `{needle}` after byte {at} in:\n{stderr}"
        );
        at += found.unwrap();
    }
    assert!(stderr.contains("6 error(s)"), "{stderr}");
    // A position in the JSON the proxy made of the YAML would mislead.
    assert!(!stderr.contains("at line 1 column"), "{stderr}");
}

fn jwt(
    header: serde_json::Value,
    claims: serde_json::Value,
    sign: impl Fn(&[u8]) -> Vec<u8>,
) -> String {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let signed = format!(
        "{}.{}",
        b64.encode(header.to_string()),
        b64.encode(claims.to_string())
    );
    format!("{signed}.{}", b64.encode(sign(signed.as_bytes())))
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

#[tokio::test]
async fn jwt_auth_checks_signature_expiry_and_audience() {
    use base64::Engine as _;
    use p256::ecdsa::signature::Signer;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let ec_key = p256::ecdsa::SigningKey::random(&mut rand_core::OsRng);
    let point = ec_key.verifying_key().to_encoded_point(false);
    let jwks = serde_json::json!({ "keys": [
        { "kty": "EC", "kid": "k1", "crv": "P-256", "x": b64.encode(point.x().unwrap()), "y": b64.encode(point.y().unwrap()) }
    ]});
    let (api, hits) = upstream::counted_echo("counted").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: api, endpoints: ["{}"] }}]
plugins: [{{ name: jwt, path: jwt-auth.wasm }}]
routes:
  - name: api
    match: {{ path_prefix: /api }}
    upstream: api
    plugins:
      - use: jwt
        config:
          hs256_secret: "${{JWT_SECRET}}"
          jwks: {jwks}
          issuer: https://issuer.example
          audiences: [runtime-api]
          claims_to_headers: {{ sub: x-user, tenant: x-tenant }}
  - name: open
    match: {{ path_prefix: /open }}
    upstream: api
    plugins:
      - use: jwt
        config:
          hs256_secret: "${{JWT_SECRET}}"
          required: false
          claims_to_headers: {{ sub: x-user }}
"#,
            api.url()
        ),
        &["jwt-auth"],
    );
    let proxy = Proxy::start_dir(dir, &[("JWT_SECRET", "hs-secret".into())]).await;
    let claims = |exp: u64, aud: &str| serde_json::json!({ "sub": "alice", "tenant": "blue", "iss": "https://issuer.example", "aud": aud, "exp": exp });
    let es256 = |c: serde_json::Value| {
        jwt(serde_json::json!({ "alg": "ES256", "kid": "k1" }), c, |m| {
            let sig: p256::ecdsa::Signature = ec_key.sign(m);
            sig.to_bytes().to_vec()
        })
    };
    let hs256 = |c: serde_json::Value| {
        jwt(serde_json::json!({ "alg": "HS256" }), c, |m| {
            use hmac::Mac;
            let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(b"hs-secret").unwrap();
            mac.update(m);
            mac.finalize().into_bytes().to_vec()
        })
    };
    let call = |token: Option<String>| {
        let url = proxy.url("/api/me");
        async move {
            let mut req = Request::get(url).header("x-user", "mallory");
            if let Some(t) = token {
                req = req.header("authorization", format!("Bearer {t}"));
            }
            client::send(&client::http1(), req.body(body(Bytes::new())).unwrap()).await
        }
    };
    let later = now_secs() + 600;

    let token = es256(claims(later, "runtime-api"));
    let a = call(Some(token.clone())).await;
    assert_eq!(a.status, 200, "{:?}", String::from_utf8_lossy(&a.body));
    assert_eq!(
        a.json()["headers"]["x-user"],
        "alice",
        "the claim replaces a client-sent header"
    );
    assert_eq!(a.json()["headers"]["x-tenant"], "blue");
    // Again: the plugin remembers the token, and the claims still go on.
    let again = call(Some(token.clone())).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.json()["headers"]["x-user"], "alice");
    // The remembered token with its signature changed is not it.
    let mut tampered = token.clone();
    tampered.replace_range(tampered.len() - 4.., "AAAA");
    assert_eq!(call(Some(tampered)).await.status, 401);
    assert_eq!(
        call(Some(hs256(claims(later, "runtime-api")))).await.status,
        200
    );

    let expired = call(Some(es256(claims(now_secs() - 3600, "runtime-api")))).await;
    assert_eq!(expired.status, 401);
    assert_eq!(expired.header("www-authenticate"), Some("Bearer"));
    assert_eq!(
        call(Some(es256(claims(later, "other-api")))).await.status,
        401
    );
    assert_eq!(call(None).await.status, 401);
    assert_eq!(call(Some("not.a.jwt".into())).await.status, 401);
    assert_eq!(
        hits.load(Ordering::SeqCst),
        3,
        "refused requests never reach the upstream"
    );

    // Where a token is optional, a request without one passes, but not a
    // claim header the client wrote itself.
    let req = Request::get(proxy.url("/open/me"))
        .header("x-user", "mallory")
        .body(body(Bytes::new()))
        .unwrap();
    let a = client::send(&client::http1(), req).await;
    assert_eq!(a.status, 200);
    assert!(a.json()["headers"].get("x-user").is_none(), "{}", a.json());
}

#[tokio::test]
async fn canary_route_by_header_cookie_and_share() {
    let stable = upstream::echo("stable").await;
    let canary = upstream::echo("canary").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: stable, endpoints: ["{}"] }}
  - {{ name: canary, endpoints: ["{}"] }}
plugins: [{{ name: canary, path: canary-route.wasm }}]
routes:
  - name: app
    match: {{ path_prefix: / }}
    upstream: stable
    plugins:
      - use: canary
        config: {{ upstream: canary, percent: 25, header: {{ name: x-canary, value: always }}, cookie: {{ name: canary }} }}
"#,
            stable.url(),
            canary.url()
        ),
        &["canary-route"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;
    let c = client::http1();
    let which = |req: Request<_>| {
        let c = c.clone();
        async move {
            client::send(&c, req).await.json()["upstream"]
                .as_str()
                .unwrap()
                .to_owned()
        }
    };
    let header = Request::get(proxy.url("/x"))
        .header("x-canary", "always")
        .body(body(Bytes::new()))
        .unwrap();
    assert_eq!(which(header).await, "canary");
    let cookie = Request::get(proxy.url("/x"))
        .header("cookie", "a=1; canary=1")
        .body(body(Bytes::new()))
        .unwrap();
    assert_eq!(which(cookie).await, "canary");
    // Browsers over HTTP/2 send each cookie as a field of its own.
    let crumbs = Request::get(proxy.url("/x"))
        .header("cookie", "a=1")
        .header("cookie", "canary=1")
        .body(body(Bytes::new()))
        .unwrap();
    let a = client::send(&client::h2c(), crumbs).await;
    assert_eq!(a.json()["upstream"], "canary");
    let mut to_canary = 0;
    for _ in 0..100 {
        if which(
            Request::get(proxy.url("/x"))
                .body(body(Bytes::new()))
                .unwrap(),
        )
        .await
            == "canary"
        {
            to_canary += 1;
        }
    }
    // Each plugin instance spreads exactly 25 in 100; requests served by
    // more than one instance land close to that.
    assert!(
        (15..=35).contains(&to_canary),
        "{to_canary} of 100 went to the canary"
    );
}

#[tokio::test]
async fn each_field_of_a_forward_decision_is_applied() {
    // The host lifts a `forward` with nothing in it by a shortcut; each
    // field set alone must still take effect (and nothing set must change
    // nothing).
    let main = upstream::echo("main").await;
    let other = upstream::echo("other").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: main, endpoints: ["{}"] }}
  - {{ name: other, endpoints: ["{}"] }}
plugins: [{{ name: fwd, path: fixture-forward.wasm }}, {{ name: rules, path: header-rules.wasm }}]
routes:
  - {{ name: same, match: {{ path: /same }}, upstream: main, plugins: [{{ use: fwd }}] }}
  - {{ name: path, match: {{ path: /path }}, upstream: main, plugins: [{{ use: fwd, config: {{ path: "/elsewhere?x=1" }} }}] }}
  - {{ name: upstream, match: {{ path: /upstream }}, upstream: main, plugins: [{{ use: fwd, config: {{ upstream: other }} }}] }}
  - {{ name: remove, match: {{ path: /remove }}, upstream: main, plugins: [{{ use: rules, config: {{ request: {{ remove: [x-drop] }} }} }}] }}
  - {{ name: set, match: {{ path: /set }}, upstream: main, plugins: [{{ use: rules, config: {{ request: {{ set: {{ x-set: "1" }} }} }} }}] }}
  - {{ name: add, match: {{ path: /add }}, upstream: main, plugins: [{{ use: rules, config: {{ request: {{ add: {{ x-add: "1" }} }} }} }}] }}
"#,
            main.url(),
            other.url()
        ),
        &["fixture-forward", "header-rules"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;
    let c = client::http1();
    let seen = |path: &'static str| {
        let req = Request::get(proxy.url(path))
            .header("x-drop", "d")
            .body(body(Bytes::new()))
            .unwrap();
        let c = c.clone();
        async move {
            let a = client::send(&c, req).await;
            assert_eq!(a.status, 200, "{path}");
            a.json()
        }
    };
    let same = seen("/same").await;
    assert_eq!(
        (same["upstream"].as_str(), same["path"].as_str()),
        (Some("main"), Some("/same"))
    );
    assert_eq!(same["headers"]["x-drop"], "d");
    assert_eq!(seen("/path").await["path"], "/elsewhere?x=1");
    assert_eq!(seen("/upstream").await["upstream"], "other");
    assert!(seen("/remove").await["headers"].get("x-drop").is_none());
    assert_eq!(seen("/set").await["headers"]["x-set"], "1");
    assert_eq!(seen("/add").await["headers"]["x-add"], "1");
}

#[tokio::test]
async fn a_plugin_reads_every_byte_of_the_header_it_asks_for() {
    // The header calls lift short ASCII names onto the stack and write the
    // value straight into the plugin; long and non-ASCII names take
    // wasmtime's own lift. The fixture echoes what it got, in hex.
    let app = upstream::echo("app").await;
    let long = format!("x-{}", "long".repeat(20));
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: echo, path: fixture-forward.wasm }}]
routes:
  - {{ name: token, match: {{ path: /token }}, upstream: app, plugins: [{{ use: echo, config: {{ echo: X-Token }} }}] }}
  - {{ name: long, match: {{ path: /long }}, upstream: app, plugins: [{{ use: echo, config: {{ echo: "{long}" }} }}] }}
  - {{ name: empty, match: {{ path: /empty }}, upstream: app, plugins: [{{ use: echo, config: {{ echo: x-empty }} }}] }}
  - {{ name: missing, match: {{ path: /missing }}, upstream: app, plugins: [{{ use: echo, config: {{ echo: x-missing }} }}] }}
  - {{ name: unicode, match: {{ path: /unicode }}, upstream: app, plugins: [{{ use: echo, config: {{ echo: "x-tökén" }} }}] }}
  - {{ name: response, match: {{ path: /response }}, upstream: app, plugins: [{{ use: echo, config: {{ echo_response: Content-Type }} }}] }}
"#,
            app.url()
        ),
        &["fixture-forward"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;
    let c = client::http1();
    let send = |path: &'static str| {
        let req = Request::get(proxy.url(path))
            .header("x-token", HeaderValue::from_bytes(b"a\xffb c").unwrap())
            .header("x-token", "second")
            .header(long.as_str(), "far")
            .header("x-empty", "")
            .body(body(Bytes::new()))
            .unwrap();
        let c = c.clone();
        async move {
            let a = client::send(&c, req).await;
            assert_eq!(a.status, 200, "{path}");
            a
        }
    };
    let echoed = |a: Answer| a.json()["headers"]["x-echo"].as_str().map(str::to_owned);
    // The first value, every byte of it, whatever the name's case.
    assert_eq!(echoed(send("/token").await).as_deref(), Some("61ff622063"));
    assert_eq!(echoed(send("/long").await).as_deref(), Some("666172"));
    assert_eq!(echoed(send("/empty").await).as_deref(), Some(""));
    assert_eq!(echoed(send("/missing").await).as_deref(), Some("absent"));
    assert_eq!(echoed(send("/unicode").await).as_deref(), Some("absent"));
    let response = send("/response").await;
    assert_eq!(
        response.headers["x-echo"],
        "application/json"
            .bytes()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    );
}

#[tokio::test]
async fn ip_allow_trusts_only_the_configured_hops() {
    let app = upstream::echo("app").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: ips, path: ip-allow.wasm }}]
routes:
  - {{ name: local, match: {{ path: /local }}, upstream: app, plugins: [{{ use: ips, config: {{ allow: [127.0.0.0/8] }} }}] }}
  - {{ name: office, match: {{ path: /office }}, upstream: app, plugins: [{{ use: ips, config: {{ allow: [203.0.113.0/24], deny: [203.0.113.66], trusted_hops: 1 }} }}] }}
"#,
            app.url()
        ),
        &["ip-allow"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;
    let get = |path: &str, xff: Option<&str>| {
        let mut req = Request::get(proxy.url(path));
        if let Some(x) = xff {
            req = req.header("x-forwarded-for", x);
        }
        let req = req.body(body(Bytes::new())).unwrap();
        async move { client::send(&client::http1(), req).await.status }
    };
    assert_eq!(get("/local", None).await, 200);
    // A client cannot talk its way in with its own X-Forwarded-For: only
    // the entry the trusted hop appended counts.
    assert_eq!(get("/local", Some("127.0.0.1")).await, 200);
    assert_eq!(get("/office", Some("203.0.113.10")).await, 200);
    assert_eq!(
        get("/office", Some("203.0.113.10, 198.51.100.7")).await,
        403
    );
    assert_eq!(get("/office", Some("203.0.113.66")).await, 403);
    assert_eq!(get("/office", None).await, 403);
    // A trusted proxy that adds a line of its own (HAProxy) instead of
    // appending: the client's line, first, does not decide.
    let req = Request::get(proxy.url("/office"))
        .header("x-forwarded-for", "203.0.113.10")
        .header("x-forwarded-for", "198.51.100.7")
        .body(body(Bytes::new()))
        .unwrap();
    assert_eq!(client::send(&client::http1(), req).await.status, 403);
}

#[tokio::test]
async fn basic_auth_asks_for_credentials_and_passes_the_user_on() {
    use base64::Engine as _;
    let (app, hits) = upstream::counted_echo("app").await;
    // `htpasswd -nbB alice s3cret` (cost 5) and `htpasswd -nbs bob hunter2`.
    let users = "alice:$2y$05$PmaEhzIC7gk0i.vApT2PWO72KTz5zXcNK5vlbQ/Omzn0iGCuUWXgS\nbob:{SHA}87u9ZqY9S/F0eUBXjsPQEDUw4h0=\n";
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: basic, path: basic-auth.wasm }}]
routes:
  - name: ui
    match: {{ path_prefix: /ui }}
    upstream: app
    plugins:
      - use: basic
        timeout: 200ms
        config: {{ htpasswd: {{ from_file: htpasswd }}, realm: Argo, user_header: x-remote-user }}
"#,
            app.url()
        ),
        &["basic-auth"],
    );
    std::fs::write(dir.path().join("htpasswd"), users).unwrap();
    let proxy = Proxy::start_dir(dir, &[]).await;
    let get = |credentials: Option<&str>| {
        let mut req = Request::get(proxy.url("/ui/x")).header("x-remote-user", "admin");
        if let Some(c) = credentials {
            let encoded = base64::engine::general_purpose::STANDARD.encode(c);
            req = req.header("authorization", format!("Basic {encoded}"));
        }
        let req = req.body(body(Bytes::new())).unwrap();
        async move { client::send(&client::http1(), req).await }
    };
    for refused in [
        None,
        Some("alice:wrong"),
        Some("mallory:s3cret"),
        Some("bob:s3cret"),
    ] {
        let answer = get(refused).await;
        assert_eq!(answer.status, 401, "{refused:?}");
        assert_eq!(
            answer.header("www-authenticate"),
            Some(r#"Basic realm="Argo", charset="UTF-8""#)
        );
    }
    assert_eq!(
        hits.load(Ordering::SeqCst),
        0,
        "a refusal reached the upstream"
    );
    // Twice each: the second from what the instance remembers.
    for (credentials, user) in [("alice:s3cret", "alice"), ("bob:hunter2", "bob")].repeat(2) {
        let answer = get(Some(credentials)).await;
        assert_eq!(answer.status, 200, "{credentials}");
        let seen = answer.json();
        // The client's own claim replaced, the password kept back.
        assert_eq!(seen["headers"]["x-remote-user"], user);
        assert!(seen["headers"].get("authorization").is_none(), "{seen}");
    }
    assert_eq!(hits.load(Ordering::SeqCst), 4);
}

#[test]
fn check_refuses_htpasswd_lines_basic_auth_cannot_use() {
    let dir = policy_dir(
        r#"
upstreams: [{ name: app, endpoints: ["http://127.0.0.1:9"] }]
plugins: [{ name: basic, path: basic-auth.wasm }]
routes:
  - name: ui
    match: { path_prefix: /ui }
    upstream: app
    plugins: [{ use: basic, config: { htpasswd: "carol:$apr1$x1y2z3$0123456789abcdefghijk." } }]
"#,
        &["basic-auth"],
    );
    let (ok, _, stderr) = crate::support::check(dir.path());
    assert!(!ok, "{stderr}");
    assert!(
        stderr.contains("htpasswd line 1: MD5 hashes are not supported"),
        "{stderr}"
    );
    assert!(stderr.contains("htpasswd -nB USER"), "{stderr}");
}

/// Behind a TCP balancer (an AWS NLB) a listener with `proxy_protocol`
/// takes the client's address from the PROXY header the balancer sends:
/// `ip-allow` judges that address, the upstream sees it in
/// `X-Forwarded-For`. The balancer's own health checks (version 2 LOCAL)
/// keep the connection's address; a connection without a header is
/// closed and counted, and the listener goes on serving.
#[tokio::test]
async fn a_proxy_protocol_listener_sees_the_client_behind_the_balancer() {
    let app = upstream::echo("app").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: nlb, bind: "127.0.0.1:0", proxy_protocol: true, header_read_timeout: 500ms }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: ips, path: ip-allow.wasm }}]
routes:
  - {{ name: office, match: {{ path: /office }}, upstream: app, plugins: [{{ use: ips, config: {{ allow: [203.0.113.0/24] }} }}] }}
  - {{ name: open, match: {{ path: /open }}, upstream: app }}
"#,
            app.url()
        ),
        &["ip-allow"],
    );
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let request = |header: &[u8], path: &str| {
        let mut raw = header.to_vec();
        raw.extend_from_slice(
            format!("GET {path} HTTP/1.1\r\nhost: app\r\nconnection: close\r\n\r\n").as_bytes(),
        );
        let addr = proxy.addr;
        async move { client::raw(addr, &raw).await }
    };
    let v1 = |source: &str| format!("PROXY TCP4 {source} 10.0.0.1 40000 8080\r\n").into_bytes();
    let office = request(&v1("203.0.113.10"), "/office").await;
    assert!(office.starts_with("HTTP/1.1 200 "), "{office}");
    assert!(
        office.contains(r#""x-forwarded-for":"203.0.113.10""#),
        "{office}"
    );
    let outside = request(&v1("198.51.100.7"), "/office").await;
    assert!(outside.starts_with("HTTP/1.1 403 "), "{outside}");

    // Version 2, IPv6 source, with a TLV as AWS adds one.
    let mut v2 = b"\r\n\r\n\0\r\nQUIT\n\x21\x21\x00\x2b".to_vec();
    v2.extend_from_slice(&[0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7]);
    v2.extend_from_slice(&[0; 16]);
    v2.extend_from_slice(&[
        0x9c, 0x40, 0x1f, 0x90, 0xea, 0x00, 0x04, b'v', b'p', b'c', b'e',
    ]);
    let open = request(&v2, "/open").await;
    assert!(
        open.contains(r#""x-forwarded-for":"2001:db8::7""#),
        "{open}"
    );
    // A health check from the balancer itself: the connection's address.
    let local = b"\r\n\r\n\0\r\nQUIT\n\x20\x00\x00\x00";
    let check = request(local, "/open").await;
    assert!(
        check.contains(r#""x-forwarded-for":"127.0.0.1""#),
        "{check}"
    );
    assert!(request(local, "/office").await.starts_with("HTTP/1.1 403 "));

    // A client that reaches the listener without the balancer is closed
    // unanswered (reset, as its request is left unread).
    let answer =
        client::raw_until_closed(proxy.addr, b"GET /open HTTP/1.1\r\nhost: a\r\n\r\n").await;
    assert_eq!(answer, "");
    proxy
        .metrics_showing(&[crate::support::process::connection_errors(
            "nlb",
            "proxy_protocol",
            1,
        )])
        .await;
    // One that starts a header and stalls is closed at the header-read
    // timeout, and counted as a slow head.
    let mut stalled = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut stalled, b"PROXY TCP4 203.0")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let closed = tokio::io::AsyncReadExt::read_to_end(&mut stalled, &mut answer);
    tokio::time::timeout(Duration::from_secs(10), closed)
        .await
        .expect("a stalled header was not cut")
        .expect("closed cleanly");
    proxy
        .metrics_showing(&[crate::support::process::connection_errors(
            "nlb",
            "header_timeout",
            1,
        )])
        .await;
    let again = request(&v1("203.0.113.11"), "/office").await;
    assert!(again.starts_with("HTTP/1.1 200 "), "{again}");
}

#[tokio::test]
async fn the_sdk_example_plugin_works_as_documented() {
    let api = upstream::echo("api").await;
    let proxy = Proxy::start_dir(require_header_policies(&api), &[]).await;
    assert_api_needs_the_key(&proxy.url("/api/x")).await;
    // Plugins guard local answers too, not only forwarded requests.
    assert_eq!(client::get(&proxy.url("/teapot")).await.status, 403);
    let keyed = Request::get(proxy.url("/teapot"))
        .header("x-api-key", "k")
        .body(body(Bytes::new()))
        .unwrap();
    assert_eq!(client::send(&client::http1(), keyed).await.status, 418);
}

#[tokio::test]
async fn plugins_run_where_the_instance_pool_cannot_be_reserved() {
    // 16 GiB of address space: plenty for the proxy, far less than the
    // instance pool reserves up front.
    const ADDRESS_SPACE: u64 = 16 << 30;
    let api = upstream::echo("api").await;
    let dir = require_header_policies(&api);
    // A read past the end of memory, where the code checks bounds.
    std::fs::copy(
        plugin_file("fixture-trap"),
        dir.path().join("fixture-trap.wasm"),
    )
    .unwrap();
    std::fs::write(
        dir.path().join("oob.yaml"),
        r#"
plugins: [{ name: trap, path: fixture-trap.wasm }]
routes:
  - name: oob
    match: { path: /oob }
    upstream: api
    plugins: [{ use: trap, config: { how: out-of-bounds } }]
"#,
    )
    .unwrap();
    let args = [
        "serve".to_owned(),
        "--policies".to_owned(),
        dir.path().display().to_string(),
    ];
    let proxy = ProxyProcess::launch_confined(
        &args,
        &[],
        "listening",
        Confine {
            address_space: Some(ADDRESS_SPACE),
            ..Confine::default()
        },
    )
    .await;
    assert_api_needs_the_key(&proxy.url("/api/x")).await;
    let warning = proxy.find_log("allocating plugin instances on demand");
    assert!(
        warning.contains("mmap") && warning.contains(r#""bounds_checked":true"#),
        "{warning}"
    );
    let oob = client::get(&proxy.url("/oob")).await;
    assert_eq!(oob.status, 500, "{:?}", String::from_utf8_lossy(&oob.body));
    assert_api_needs_the_key(&proxy.url("/api/x")).await;
}

/// Threads spinning on one CPU until dropped: a neighbour that takes the
/// core from whatever else runs there.
struct CpuHogs {
    stop: Arc<std::sync::atomic::AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl CpuHogs {
    fn on(cpu: usize, count: usize) -> CpuHogs {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let threads = (0..count)
            .map(|_| {
                let stop = stop.clone();
                std::thread::spawn(move || {
                    crate::support::process::pin_to_cpu(cpu).expect("pin a hog thread");
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                })
            })
            .collect();
        CpuHogs { stop, threads }
    }
}

impl Drop for CpuHogs {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// The lowest CPU this process may run on.
fn first_allowed_cpu() -> usize {
    // SAFETY: a zeroed cpu_set_t is valid; sched_getaffinity fills it and
    // CPU_ISSET reads it in bounds.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        assert_eq!(
            libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set),
            0
        );
        (0..libc::CPU_SETSIZE as usize)
            .find(|&c| libc::CPU_ISSET(c, &set))
            .expect("an allowed CPU")
    }
}

/// A plugin's deadline is CPU time its call used, not time on the clock:
/// on a core shared with six spinning threads, a call needing ~2.5 ms of
/// CPU is descheduled mid-call now and then for longer than its 10 ms
/// deadline (a wall-clock deadline refused 5-19 in 100 of those with 503),
/// and must still pass; a plugin that loops is still stopped there.
#[tokio::test]
async fn a_plugin_call_descheduled_past_its_deadline_is_not_timed_out() {
    let up = upstream::echo("up").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: up, endpoints: ["{}"] }}]
plugins:
  - {{ name: busy, path: fixture-busy.wasm }}
  - {{ name: loop, path: fixture-loop-forever.wasm }}
routes:
  - name: busy
    match: {{ path: /busy }}
    upstream: up
    plugins: [{{ use: busy, timeout: 10ms, config: {{ iterations: 1000000 }} }}]
  - {{ name: loop, match: {{ path: /loop }}, upstream: up, plugins: [{{ use: loop, timeout: 5ms }}] }}
"#,
            up.url()
        ),
        &["fixture-busy", "fixture-loop-forever"],
    );
    let cpu = first_allowed_cpu();
    let args = [
        "serve".to_owned(),
        "--policies".to_owned(),
        dir.path().display().to_string(),
        "--workers".to_owned(),
        "1".to_owned(),
    ];
    let proxy = ProxyProcess::launch_confined(
        &args,
        &[],
        "listening",
        Confine {
            cpu: Some(cpu),
            ..Confine::default()
        },
    )
    .await;
    let url = proxy.url("/busy");
    // The first call instantiates the plugin; the rest reuse the instance.
    assert_eq!(client::get(&url).await.status, 200);

    let hogs = CpuHogs::on(cpu, 6);
    let c = client::http1();
    let mut refused = Vec::new();
    for i in 0..100 {
        let a = client::send(&c, Request::get(&url).body(body(Bytes::new())).unwrap()).await;
        if a.status != 200 {
            refused.push((i, a.status, String::from_utf8_lossy(&a.body).into_owned()));
        }
    }
    let looped = client::get(&proxy.url("/loop")).await;
    drop(hogs);
    assert!(refused.is_empty(), "refused under contention: {refused:?}");
    assert_eq!(looped.status, 503);
    assert_eq!(looped.json()["error"], "plugin timed out");
}

/// A plugin call given a large body (a big webhook being hashed) runs off
/// the worker: with one worker, other requests are answered while it runs,
/// and the call still stops at its deadline.
#[tokio::test]
async fn a_plugin_working_on_a_large_body_leaves_its_worker_serving() {
    let up = upstream::echo("up").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: up, endpoints: ["{}"] }}]
plugins: [{{ name: busy, path: fixture-busy.wasm }}]
routes:
  - name: long
    match: {{ path: /long }}
    upstream: up
    plugins: [{{ use: busy, timeout: 10s, config: {{ iterations: 1000000000000, read_body: 1048576 }} }}]
  - name: short
    match: {{ path: /short }}
    upstream: up
    plugins: [{{ use: busy, timeout: 50ms, config: {{ iterations: 1000000000000, read_body: 1048576 }} }}]
  - {{ name: plain, match: {{ path: /plain }}, upstream: up }}
"#,
            up.url()
        ),
        &["fixture-busy"],
    );
    let mut proxy = ProxyProcess::start_on(dir.path(), &["--workers", "1"]).await;
    let webhook = Request::post(proxy.url("/long"))
        .body(body(vec![b'x'; 256 << 10]))
        .unwrap();
    let long = tokio::spawn(async move { client::send(&client::http1(), webhook).await });
    proxy.wait_for_log("busy with the body").await;

    let plain = client::get(&proxy.url("/plain")).await;
    assert_eq!(plain.status, 200);
    // Had the call held the worker, `/long` would have been answered (at
    // its deadline) before the worker read `/plain`: its access line would
    // come first.
    let logs = proxy.logs.lock().unwrap().clone();
    let access = |path: &str| {
        logs.iter().position(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .is_ok_and(|v| v["target"] == "access" && v["path"] == path)
        })
    };
    assert!(access("/plain").is_some(), "no access line for /plain");
    assert_eq!(access("/long"), None, "/long ended first: {logs:#?}");
    assert!(!long.is_finished());
    long.abort();

    // An offloaded call is stopped at its deadline like any other.
    let short = client::send(
        &client::http1(),
        Request::post(proxy.url("/short"))
            .body(body(vec![b'x'; 256 << 10]))
            .unwrap(),
    )
    .await;
    assert_eq!(short.status, 503);
    assert_eq!(short.json()["error"], "plugin timed out");
}

/// A client that stops sending a body a plugin is reading (a webhook
/// trickled in) gets 408 once it has sent nothing for the route's request
/// timeout, instead of holding its connection for ever.
#[tokio::test]
async fn a_body_a_plugin_reads_that_stops_coming_gets_408() {
    let (up, hits) = upstream::counted_echo("up").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: up, endpoints: ["{}"], timeouts: {{ request: 300ms }} }}]
plugins: [{{ name: busy, path: fixture-busy.wasm }}]
routes:
  - name: hook
    match: {{ path: /hook }}
    upstream: up
    plugins: [{{ use: busy, config: {{ iterations: 1, read_body: 1048576 }} }}]
"#,
            up.url()
        ),
        &["fixture-busy"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;
    let (chunks, sent) = client::streamed_post(proxy.url("/hook"));
    chunks
        .send(Bytes::from_static(b"{\"partial\":"))
        .await
        .unwrap();
    let a = sent.await.unwrap();
    drop(chunks);
    assert_eq!(a.status, 408, "{:?}", a.body);
    assert_eq!(a.json()["error"], "request body timeout");
    assert_eq!(a.json()["plugin"], "busy");
    assert_eq!(hits.load(Ordering::SeqCst), 0);
}

/// The SDK example guarding `/api` (to `api`) and a local answer.
fn require_header_policies(api: &Upstream) -> tempfile::TempDir {
    policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: api, endpoints: ["{}"] }}]
plugins: [{{ name: require-header, path: example-require-header.wasm }}]
routes:
  - name: api
    match: {{ path_prefix: /api }}
    upstream: api
    plugins: [{{ use: require-header, config: {{ header: x-api-key }} }}]
  - name: teapot
    match: {{ path: /teapot }}
    respond: {{ status: 418, body: tea }}
    plugins: [{{ use: require-header, config: {{ header: x-api-key }} }}]
"#,
            api.url()
        ),
        &["example-require-header"],
    )
}

/// `url` answers 403 without an `x-api-key` header and 200 with one.
async fn assert_api_needs_the_key(url: &str) {
    assert_eq!(client::get(url).await.status, 403);
    let keyed = Request::get(url)
        .header("x-api-key", "k")
        .body(body(Bytes::new()))
        .unwrap();
    assert_eq!(client::send(&client::http1(), keyed).await.status, 200);
}

/// Users' plugins are built against the contract of their day: one built
/// against `portcullis:policy@0.2.0` (before `client-certificate`) loads
/// on this 0.2.1 host and its host calls (the head, a header through the
/// linker's shortcut) answer as before.
#[tokio::test]
async fn a_plugin_built_against_the_previous_contract_still_runs() {
    let app = upstream::echo("app").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: old, path: fixture-contract-0-2-0.wasm }}]
routes: [{{ name: any, match: {{ path_prefix: / }}, upstream: app, plugins: [{{ use: old }}] }}]
"#,
            app.url()
        ),
        &["fixture-contract-0-2-0"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;
    let req = Request::get(proxy.url("/some/path"))
        .header("x-probe", "here")
        .body(body(Bytes::new()))
        .unwrap();
    let answer = client::send(&client::http1(), req).await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    assert_eq!(
        answer.json()["headers"]["x-contract"],
        "0.2.0 /some/path here"
    );
}

/// A plugin's error answer takes the shape of the proxy's own errors when
/// it gives no body, or the SDK's `{"error": ...}` alone (the webhook
/// plugin's 401): `error`, `status`, `route`, `plugin`, and the request
/// id the listener makes, as a 404 of the proxy's own has. A body of the
/// plugin's own, and a bodiless success, go as they are.
#[tokio::test]
async fn a_plugins_error_answer_has_the_shape_of_the_proxys_errors() {
    let dir = policy_dir(
        r#"
listeners: [{ name: http, bind: "127.0.0.1:0", request_id: make }]
plugins:
  - { name: fixed, path: fixture-forward.wasm }
  - { name: sig, path: webhook-signature.wasm }
routes:
  - { name: bodiless, match: { path: /bodiless }, respond: { status: 200 }, plugins: [{ use: fixed, config: { respond: { status: 403 } } }] }
  - name: sdk
    match: { path: /sdk }
    respond: { status: 200 }
    plugins: [{ use: fixed, config: { respond: { status: 401, body: '{"error":"nope"}', content_type: application/json } } }]
  - { name: own, match: { path: /own }, respond: { status: 200 }, plugins: [{ use: fixed, config: { respond: { status: 418, body: "short and stout", content_type: text/plain } } }] }
  - { name: empty-ok, match: { path: /empty-ok }, respond: { status: 200 }, plugins: [{ use: fixed, config: { respond: { status: 204 } } }] }
  - { name: hooks, match: { path: /hooks }, respond: { status: 200 }, plugins: [{ use: sig, config: { provider: gitlab, secret: s } }] }
"#,
        &["fixture-forward", "webhook-signature"],
    );
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let ours = client::get(&proxy.url("/nowhere")).await;
    assert_eq!(ours.status, 404);
    assert!(ours.header("x-request-id").is_some());
    let shape = |a: &Answer, status: u16, route: &str, plugin: &str, error: &str| {
        assert_eq!(a.status, status, "{route}: {:?}", a.body);
        assert_eq!(
            a.header("content-type"),
            Some("application/json"),
            "{route}"
        );
        assert_eq!(
            a.json(),
            serde_json::json!({ "error": error, "status": status, "route": route, "plugin": plugin }),
            "{route}"
        );
        assert!(a.header("x-request-id").is_some(), "{route}: no request id");
        assert_eq!(
            a.headers.get_all("content-type").iter().count(),
            1,
            "{route}"
        );
    };
    shape(
        &client::get(&proxy.url("/bodiless")).await,
        403,
        "bodiless",
        "fixed",
        "forbidden",
    );
    shape(
        &client::get(&proxy.url("/sdk")).await,
        401,
        "sdk",
        "fixed",
        "nope",
    );
    shape(
        &client::call("POST", &proxy.url("/hooks")).await,
        401,
        "hooks",
        "sig",
        "invalid webhook signature",
    );
    let own = client::get(&proxy.url("/own")).await;
    assert_eq!(own.status, 418);
    assert_eq!(&own.body[..], b"short and stout");
    assert_eq!(own.header("content-type"), Some("text/plain"));
    let empty = client::get(&proxy.url("/empty-ok")).await;
    assert_eq!(empty.status, 204);
    assert!(empty.body.is_empty());
}

/// The standard plugins are built into the binary: `serve` on nothing but
/// the default policy YAML (no plugin file anywhere), with
/// `WEBHOOK_SECRET` set, verifies GitHub webhooks: a signed push reaches
/// the event source byte for byte, an unsigned or tampered one gets 401.
#[tokio::test]
async fn the_default_policies_verify_webhooks_with_the_built_in_plugin() {
    let (events, hits) = upstream::counted_echo("events").await;
    let dir = tempfile::tempdir().unwrap();
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies/routing.yaml");
    std::fs::copy(repo, dir.path().join("routing.yaml")).unwrap();
    let args = ["serve", "--policies", &dir.path().display().to_string()].map(String::from);
    let secret = "s";
    let env = [
        ("WEBHOOK_SECRET", secret.to_owned()),
        ("PORTCULLIS_LISTEN", "127.0.0.1:0".to_owned()),
        ("EVENTSOURCE_URL", events.url()),
    ];
    let proxy = ProxyProcess::launch(&args, &env, "listening").await;
    let payload = Bytes::from_static(br#"{"ref":"refs/heads/main","commits":[]}"#);
    let url = proxy.url("/webhooks/argo-events/github/push");
    let post = |body_bytes: Bytes, signature: Option<String>| {
        let mut req = Request::post(&url);
        if let Some(s) = signature {
            req = req.header("x-hub-signature-256", s);
        }
        let req = req.body(body(body_bytes)).unwrap();
        async move { client::send(&client::http1(), req).await }
    };
    let signature = format!("sha256={}", hmac_sha256_hex(secret.as_bytes(), &payload));
    let a = post(payload.clone(), Some(signature.clone())).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(a.json()["body_fnv"], upstream::fnv(&payload));
    assert_eq!(a.json()["body_len"], payload.len());
    let mut tampered = payload.to_vec();
    tampered[3] ^= 1;
    assert_eq!(post(tampered.into(), Some(signature)).await.status, 401);
    assert_eq!(post(payload, None).await.status, 401);
    assert_eq!(
        hits.load(Ordering::SeqCst),
        1,
        "only the signed push got through"
    );
}

/// `builtin:NAME` names a standard plugin without a file; an unknown name
/// is an error that lists the ones there are.
#[test]
fn a_policy_names_standard_plugins_as_built_in() {
    let yaml = |name: &str| {
        format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
plugins: [{{ name: p, path: "builtin:{name}" }}]
routes:
  - {{ name: api, match: {{ path: /api }}, respond: {{ status: 200 }}, plugins: [{{ use: p, config: {{ allow: ["10.0.0.0/8"] }} }}] }}
"#
        )
    };
    let good = policy_dir(&yaml("ip-allow"), &[]);
    let (ok, _, stderr) = crate::support::check(good.path());
    assert!(ok, "{stderr}");
    let bad = policy_dir(&yaml("nope"), &[]);
    let (ok, _, stderr) = crate::support::check(bad.path());
    assert!(!ok);
    assert!(
        stderr.contains("no built-in plugin `nope`; the built-in plugins are webhook-signature, header-rules, jwt-auth, ip-allow, basic-auth, client-cert-allow, canary-route"),
        "{stderr}"
    );
}

/// The plugin template is a crate that builds outside this repository:
/// copied to a directory of its own, with the SDK named by path (the
/// contract inside the SDK), it builds for wasm32-wasip2 with one cargo
/// command, passes `portcullis check` with its policy, and serves.
#[tokio::test]
async fn the_plugin_template_builds_outside_the_checkout_and_serves() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    assert!(!dir.path().starts_with(&repo), "the copy must be outside");
    let template = repo.join("plugins/template");
    std::fs::create_dir(dir.path().join("src")).unwrap();
    for file in ["src/lib.rs", "policy.yaml"] {
        std::fs::copy(template.join(file), dir.path().join(file)).unwrap();
    }
    let manifest = std::fs::read_to_string(template.join("Cargo.toml")).unwrap();
    let sdk = repo.join("plugins/sdk");
    let manifest = manifest.replace(
        r#"path = "../sdk""#,
        &format!("path = {:?}", sdk.display().to_string()),
    );
    assert!(manifest.contains(&sdk.display().to_string()));
    std::fs::write(dir.path().join("Cargo.toml"), manifest).unwrap();
    // The plugins' locked versions: nothing new to fetch or build.
    std::fs::copy(
        repo.join("plugins/Cargo.lock"),
        dir.path().join("Cargo.lock"),
    )
    .unwrap();
    // Kept between runs (its dependencies build once), apart from the
    // test build's own target directory, which cargo holds locked.
    let target = format!(
        "{}-template",
        std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "/tmp/portcullis-target".into())
    );
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let built = tokio::process::Command::new(cargo)
        .args(["build", "--release", "--target", "wasm32-wasip2"])
        .current_dir(dir.path())
        .env("CARGO_TARGET_DIR", &target)
        .output()
        .await
        .expect("run cargo");
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let wasm = "target/wasm32-wasip2/release/my_plugin.wasm";
    std::fs::create_dir_all(dir.path().join(wasm).parent().unwrap()).unwrap();
    std::fs::copy(
        std::path::Path::new(&target).join("wasm32-wasip2/release/my_plugin.wasm"),
        dir.path().join(wasm),
    )
    .unwrap();
    let (ok, _, stderr) = crate::support::check(dir.path());
    assert!(ok, "{stderr}");

    let echo = upstream::echo("app").await;
    let policy = std::fs::read_to_string(dir.path().join("policy.yaml"))
        .unwrap()
        .replace("127.0.0.1:8080", "127.0.0.1:0")
        .replace("http://127.0.0.1:3000", &echo.url());
    std::fs::write(dir.path().join("policy.yaml"), policy).unwrap();
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let passed = client::get(&proxy.url("/items")).await;
    assert_eq!(passed.status, 200, "{:?}", passed.body);
    assert_eq!(passed.json()["headers"]["x-checked-by"], "my-plugin");
    let denied = client::get(&proxy.url("/admin/users")).await;
    assert_eq!(denied.status, 403);
    assert_eq!(denied.json()["plugin"], "my-plugin");
    assert_eq!(denied.json()["error"], "denied by my-plugin");
}

/// The SDK carries the plugin contract with it (so a plugin outside this
/// repository builds); `wit/` stays the one source it is copied from.
#[test]
fn the_sdks_copy_of_the_contract_is_the_contract() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let source = std::fs::read_to_string(repo.join("wit/policy.wit")).unwrap();
    let copy = std::fs::read_to_string(repo.join("plugins/sdk/wit/policy.wit")).unwrap();
    assert!(
        source == copy,
        "plugins/sdk/wit/policy.wit differs from wit/policy.wit: cp wit/policy.wit plugins/sdk/wit/"
    );
}
