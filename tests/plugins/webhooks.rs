//! The webhook-signature plugin on the default policies: GitHub signatures, GitLab tokens, large webhooks.

use super::*;

/// The shipped default policies, with the webhook plugin beside them.
pub(super) fn default_policies_with_plugin() -> tempfile::TempDir {
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
pub(super) async fn default_webhook_proxy(events: &Upstream, secret: Option<&str>) -> Proxy {
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
pub(super) async fn github_webhooks_are_verified_and_forwarded_byte_for_byte() {
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
pub(super) async fn the_default_webhook_route_takes_a_webhook_as_large_as_github_sends() {
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
pub(super) async fn without_a_webhook_secret_unsigned_webhooks_pass_as_before() {
    let (events, hits) = upstream::counted_echo("counted").await;
    let proxy = default_webhook_proxy(&events, None).await;
    let req = Request::post(proxy.url("/webhooks/ns/github/push"))
        .body(body("{}"))
        .unwrap();
    assert_eq!(client::send(&client::http1(), req).await.status, 200);
    assert_eq!(hits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
pub(super) async fn gitlab_tokens_and_oversized_bodies() {
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
