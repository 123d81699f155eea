//! Plugin uses in shadow mode (`mode: shadow`): run on real requests,
//! nothing they decide enforced, what they would have done counted,
//! logged and shown.

use super::*;

/// The access lines (JSON) so far whose path is `path`.
fn access_lines(proxy: &ProxyProcess, path: &str) -> Vec<serde_json::Value> {
    proxy
        .logs
        .lock()
        .unwrap()
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"] == "access" && v["path"] == path)
        .collect()
}

/// Waits (10 s at most) until `n` access lines of `path` are written.
async fn wait_access(proxy: &ProxyProcess, path: &str, n: usize) -> Vec<serde_json::Value> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let lines = access_lines(proxy, path);
        if lines.len() >= n {
            return lines;
        }
        assert!(
            Instant::now() < deadline,
            "{} access lines of {path}, not {n}",
            lines.len()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A component and a proxy-wasm filter that deny every request without
/// `x-api-key` (401, 403), and a plugin that sets a request header, all
/// in shadow: every request reaches the upstream unchanged, and each
/// would-be answer is counted by status, on `/metrics` and `/status`,
/// and written in the request's access line.
#[tokio::test]
pub(super) async fn a_shadow_deny_lets_every_request_through_and_is_counted() {
    let (app, hits) = upstream::counted_echo("app").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins:
  - {{ name: gate, path: example-require-header.wasm }}
  - {{ name: pw-gate, path: proxy-wasm-require.wasm }}
  - {{ name: headers, path: header-rules.wasm }}
routes:
  - name: shadowed
    match: {{ path: /s }}
    upstream: app
    plugins:
      - {{ use: gate, mode: shadow, config: {{ header: x-api-key }} }}
      - {{ use: pw-gate, mode: shadow, config: x-api-key }}
      - {{ use: headers, mode: shadow, config: {{ request: {{ set: {{ x-tenant: blue }} }} }} }}
  - name: enforced
    match: {{ path: /e }}
    upstream: app
    plugins: [{{ use: gate, config: {{ header: x-api-key }} }}]
  - name: both
    match: {{ path: /both }}
    upstream: app
    plugins: [{{ use: pw-gate, mode: shadow, config: x-api-key }}, {{ use: gate, config: {{ header: x-api-key }} }}]
"#,
            app.url()
        ),
        &[
            "example-require-header",
            "proxy-wasm-require",
            "header-rules",
        ],
    );
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;

    // Enforced, the same plugin and config deny: what shadow mode hides.
    let denied = client::get(&proxy.url("/e")).await;
    assert_eq!(denied.status, 403, "{:?}", denied.body);
    // Denied by the enforced plugin after the shadow one: the answer's
    // access line still says what the shadow would have done.
    let denied = client::get(&proxy.url("/both")).await;
    assert_eq!(denied.status, 403, "{:?}", denied.body);
    assert_eq!(hits.load(Ordering::SeqCst), 0);
    let both = &wait_access(&proxy, "/both", 1).await[0];
    assert_eq!(
        (&both["status"], &both["shadow"]),
        (&serde_json::json!(403), &serde_json::json!("pw-gate:401")),
        "{both:#}"
    );

    for _ in 0..10 {
        let a = client::get(&proxy.url("/s")).await;
        assert_eq!(a.status, 200, "{:?}", a.body);
        let seen: serde_json::Value = a.json();
        assert_eq!(seen["upstream"], "app");
        // The shadow header edit went nowhere.
        assert!(seen["headers"].get("x-tenant").is_none(), "{seen}");
    }
    // A request the plugins let on: nothing noted.
    let req = Request::get(proxy.url("/s"))
        .header("x-api-key", "k")
        .body(body(Bytes::new()))
        .unwrap();
    let a = client::send(&client::http1(), req).await;
    assert_eq!(a.status, 200);
    assert_eq!(hits.load(Ordering::SeqCst), 11);

    let lines = wait_access(&proxy, "/s", 11).await;
    let noted: Vec<_> = lines.iter().map(|l| l["shadow"].as_str()).collect();
    assert_eq!(
        noted
            .iter()
            .filter(|n| **n == Some("gate:403,pw-gate:401"))
            .count(),
        10,
        "{lines:#?}"
    );
    assert_eq!(
        noted.iter().filter(|n| n.is_none()).count(),
        1,
        "{lines:#?}"
    );

    let metric = |name: &str, plugin: &str, label: &str, n: u32| {
        format!(
            "portcullis_plugin_shadow_{name}{{plugin=\"{plugin}\",route=\"shadowed\",{label}}} {n}"
        )
    };
    proxy
        .metrics_showing(&[
            metric("would_answer_total", "gate", "status=\"403\"", 10),
            metric("would_answer_total", "pw-gate", "status=\"401\"", 10),
            metric("requests_total", "gate", "outcome=\"ran\"", 11),
            metric("requests_total", "headers", "outcome=\"ran\"", 11),
            metric("requests_total", "gate", "outcome=\"failed\"", 0),
        ])
        .await;
    let status = proxy.status().await;
    let uses = status["config"]["plugin_uses"].as_array().unwrap().clone();
    let gate = uses
        .iter()
        .find(|u| u["plugin"] == "gate" && u["route"] == "shadowed")
        .unwrap_or_else(|| panic!("{uses:#?}"));
    assert_eq!(gate["shadow"]["ran"], 11, "{gate}");
    assert_eq!(gate["shadow"]["percent"], 100, "{gate}");
    assert_eq!(
        gate["shadow"]["would_answer"],
        serde_json::json!([{ "status": 403, "requests": 10 }])
    );
    let enforced = uses
        .iter()
        .find(|u| u["plugin"] == "gate" && u["route"] == "enforced")
        .unwrap();
    assert!(enforced["shadow"].is_null(), "{enforced}");
}

/// A shadow use's failures never fail its request, even with `fail:
/// closed` (the default): a trap is counted and noted instead. With
/// `shadow_percent`, it runs on that share of requests, spread evenly.
#[tokio::test]
pub(super) async fn a_failing_shadow_plugin_never_fails_a_request_and_runs_on_its_share() {
    let app = upstream::echo("app").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins:
  - {{ name: trap, path: fixture-trap.wasm }}
routes:
  - {{ name: t, match: {{ path: /t }}, upstream: app, plugins: [{{ use: trap, mode: shadow, timeout: 2s }}] }}
  - {{ name: fifth, match: {{ path: /fifth }}, upstream: app, plugins: [{{ use: trap, mode: shadow, shadow_percent: 20, timeout: 2s }}] }}
"#,
            app.url()
        ),
        &["fixture-trap"],
    );
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    for _ in 0..4 {
        let a = client::get(&proxy.url("/t")).await;
        assert_eq!(a.status, 200, "{:?}", a.body);
    }
    for _ in 0..10 {
        let a = client::get(&proxy.url("/fifth")).await;
        assert_eq!(a.status, 200, "{:?}", a.body);
    }
    let lines = wait_access(&proxy, "/t", 4).await;
    assert!(
        lines.iter().all(|l| l["shadow"] == "trap:failed"),
        "{lines:#?}"
    );
    let fifth = wait_access(&proxy, "/fifth", 10).await;
    assert_eq!(
        fifth
            .iter()
            .filter(|l| l["shadow"] == "trap:failed")
            .count(),
        2,
        "{fifth:#?}"
    );
    let metric = |route: &str, outcome: &str, n: u32| {
        format!(
            "portcullis_plugin_shadow_requests_total{{plugin=\"trap\",route=\"{route}\",outcome=\"{outcome}\"}} {n}"
        )
    };
    proxy
        .metrics_showing(&[
            metric("t", "ran", 4),
            metric("t", "failed", 4),
            metric("fifth", "ran", 2),
            metric("fifth", "failed", 2),
        ])
        .await;
    proxy
        .find_log("shadow plugin failed; request let through (mode: shadow)")
        .await;
}

/// A shadow plugin that checks the body (webhook-signature) is given a
/// body of known length whole, and the upstream gets it byte for byte;
/// a body of unknown length (chunked) is not held back for it: the
/// request is left alone and counted as skipped.
#[tokio::test]
pub(super) async fn a_shadow_body_check_sees_bodies_of_known_length_and_holds_no_stream() {
    use http_body_util::{BodyExt, StreamBody};
    let app = upstream::echo("app").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: sig, path: webhook-signature.wasm }}]
routes:
  - {{ name: hook, match: {{ path: /hook }}, upstream: app, plugins: [{{ use: sig, mode: shadow, config: {{ provider: github, secret: s }} }}] }}
"#,
            app.url()
        ),
        &["webhook-signature"],
    );
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let payload = Bytes::from(vec![b'x'; 100_000]);
    let signed = format!("sha256={}", hmac_sha256_hex(b"s", &payload));
    for (path, signature) in [
        ("/hook?signed", signed.as_str()),
        ("/hook?unsigned", "sha256=00"),
    ] {
        let req = Request::post(proxy.url(path))
            .header("x-hub-signature-256", signature)
            .body(body(payload.clone()))
            .unwrap();
        let a = client::send(&client::http1(), req).await;
        assert_eq!(a.status, 200, "{:?}", a.body);
        assert_eq!(a.json()["body_fnv"], upstream::fnv(&payload));
    }
    let streamed = Request::post(proxy.url("/hook?streamed"))
        .header("x-hub-signature-256", "sha256=00")
        .body(BodyExt::boxed(StreamBody::new(upstream::chunks(
            192 * 1024,
        ))))
        .unwrap();
    let a = client::send(&client::http1(), streamed).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(a.json()["body_len"], 192 * 1024);

    // Lines of different workers may come in any order.
    for (path, noted) in [
        ("signed", None),
        ("unsigned", Some("sig:401")),
        ("streamed", None),
    ] {
        let line = &wait_access(&proxy, &format!("/hook?{path}"), 1).await[0];
        assert_eq!(line["shadow"].as_str(), noted, "{line:#}");
    }
    let metric = |outcome: &str, n: u32| {
        format!(
            "portcullis_plugin_shadow_requests_total{{plugin=\"sig\",route=\"hook\",outcome=\"{outcome}\"}} {n}"
        )
    };
    proxy
        .metrics_showing(&[metric("ran", 3), metric("skipped", 1)])
        .await;
}

/// `mode` takes enforce or shadow, and `shadow_percent` only goes with
/// shadow: both named at their lines by `check`.
#[test]
pub(super) fn check_names_a_wrong_mode_and_a_share_without_shadow() {
    let yaml = r#"
upstreams: [{ name: app, endpoints: ["http://127.0.0.1:1"] }]
plugins: [{ name: gate, path: "builtin:header-rules" }]
routes:
  - { name: a, match: { path: /a }, upstream: app, plugins: [{ use: gate, mode: shadw }] }
  - { name: b, match: { path: /b }, upstream: app, plugins: [{ use: gate, shadow_percent: 5 }] }
  - { name: c, match: { path: /c }, upstream: app, plugins: [{ use: gate, mode: shadow, shadow_percent: 0 }] }
"#;
    crate::support::assert_check_errors(
        yaml,
        &[
            (5, "`shadw` is not a plugin mode; use enforce or shadow"),
            (6, "`shadow_percent` is for a use with `mode: shadow`"),
            (7, "shadow_percent `0` is not a share from 1 to 100"),
        ],
    );
}
