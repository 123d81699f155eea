//! Policy plugins in the real proxy: the built components from
//! plugins/dist, against real upstreams.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::Request;

use crate::support::client::{self, body};
use crate::support::upstream::{self, Upstream};
use crate::support::{Proxy, plugin_file, policy_dir};

/// An echo upstream that counts the requests reaching it.
async fn counted_echo() -> (Upstream, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let echo = upstream::echo("counted").await;
    let counter = hits.clone();
    let target = echo.url();
    let front = upstream::serve(move |req: Request<hyper::body::Incoming>| {
        counter.fetch_add(1, Ordering::SeqCst);
        let target = target.clone();
        async move {
            // Relay to the echo server so the test sees what arrived.
            let (parts, incoming) = req.into_parts();
            let uri = format!(
                "{target}{}",
                parts.uri.path_and_query().map_or("/", |p| p.as_str())
            );
            let mut out = Request::builder().method(parts.method).uri(uri);
            for (k, v) in &parts.headers {
                if k != "host" {
                    out = out.header(k, v);
                }
            }
            let collected = http_body_util::BodyExt::collect(incoming)
                .await
                .map(|c| c.to_bytes())
                .unwrap_or_default();
            let a = client::send(&client::http1(), out.body(body(collected)).unwrap()).await;
            let mut resp = hyper::Response::new(upstream::full(a.body));
            *resp.status_mut() = a.status;
            resp
        }
    })
    .await;
    // Keep the echo server alive as long as the front.
    std::mem::forget(echo);
    (front, hits)
}

fn hmac_sha256_hex(secret: &[u8], body: &[u8]) -> String {
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

#[tokio::test]
async fn github_webhooks_are_verified_and_forwarded_byte_for_byte() {
    let (events, hits) = counted_echo().await;
    let secret = "It's a Secret to Everybody";
    let proxy = Proxy::start_dir(
        default_policies_with_plugin(),
        &[
            ("PORTCULLIS_LISTEN", "127.0.0.1:0".into()),
            ("EVENTSOURCE_URL", events.url()),
            ("WEBHOOK_SECRET", secret.into()),
        ],
    )
    .await;
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
async fn without_a_webhook_secret_unsigned_webhooks_pass_as_before() {
    let (events, hits) = counted_echo().await;
    let proxy = Proxy::start_dir(
        default_policies_with_plugin(),
        &[
            ("PORTCULLIS_LISTEN", "127.0.0.1:0".into()),
            ("EVENTSOURCE_URL", events.url()),
        ],
    )
    .await;
    let req = Request::post(proxy.url("/webhooks/ns/github/push"))
        .body(body("{}"))
        .unwrap();
    assert_eq!(client::send(&client::http1(), req).await.status, 200);
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn gitlab_tokens_and_oversized_bodies() {
    let (events, hits) = counted_echo().await;
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
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn header_rules_edit_responses_and_answer_cors_preflights() {
    let (app, hits) = counted_echo().await;
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
routes:
  - {{ name: good, match: {{ path: /good }}, upstream: good }}
  - {{ name: loop, match: {{ path: /loop }}, upstream: good, plugins: [{{ use: loop }}] }}
  - {{ name: trap, match: {{ path: /trap }}, upstream: good, plugins: [{{ use: trap }}] }}
  - {{ name: hog, match: {{ path: /hog }}, upstream: good, plugins: [{{ use: hog, memory: 8MiB }}] }}
  - {{ name: open, match: {{ path: /open }}, upstream: good, plugins: [{{ use: loop, fail: open }}] }}
"#,
            good.url()
        ),
        &[
            "fixture-loop-forever",
            "fixture-trap",
            "fixture-grow-memory",
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
            ("/hog", 500, "plugin ran out of memory"),
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
            // The deadline is 10 ms; a second covers instantiation in a
            // debug build. Without the deadline the loop never returns.
            assert!(took < Duration::from_secs(1), "{path} took {took:?}");
        }
    }
    // fail: open lets the request through after the same timeout.
    assert_eq!(client::get(&proxy.url("/open")).await.status, 200);

    stop.store(true, Ordering::SeqCst);
    let served = steady.await.unwrap();
    assert!(served > 0);
}

#[test]
fn check_reports_plugin_problems_with_route_and_place() {
    use std::process::Command;
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
    let out = Command::new(crate::support::binary())
        .arg("check")
        .arg("--policies")
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    let file = dir.path().join("policy.yaml").display().to_string();
    // Loading errors come first: each names file:line:column.
    for needle in [
        format!("{file}:6:59: plugin "),
        "but the policy pins 00".to_string(),
        format!("{file}:8:27: cannot read plugin"),
        format!("{file}:21:70: unknown plugin `sgi`"),
    ] {
        assert!(stderr.contains(&needle), "missing `{needle}` in:\n{stderr}");
    }

    // With the loading errors fixed, the plugins themselves are checked.
    let yaml = std::fs::read_to_string(dir.path().join("policy.yaml")).unwrap();
    let fixed: String = yaml
        .lines()
        .filter(|l| !l.contains("pinned") && !l.contains("absent") && !l.contains("sgi"))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(dir.path().join("policy.yaml"), fixed).unwrap();
    let out = Command::new(crate::support::binary())
        .arg("check")
        .arg("--policies")
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    for needle in [
        "is not a valid plugin component",
        "plugin `sig` on route `empty-secret`",
        "`secret` is empty",
        "plugin `sig` on route `unknown-key`",
        "unknown field `colour`",
    ] {
        assert!(stderr.contains(needle), "missing `{needle}` in:\n{stderr}");
    }
}
