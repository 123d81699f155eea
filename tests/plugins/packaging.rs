//! Plugin answers in the proxy's error shape, the built-in plugins, the template outside the checkout, the SDK's copy of the contract.

use super::*;

/// A plugin's error answer takes the shape of the proxy's own errors when
/// it gives no body, or the SDK's `{"error": ...}` alone (the webhook
/// plugin's 401): `error`, `status`, `route`, `plugin`, and the request
/// id the listener makes, as a 404 of the proxy's own has. A body of the
/// plugin's own, and a bodiless success, go as they are.
#[tokio::test]
pub(super) async fn a_plugins_error_answer_has_the_shape_of_the_proxys_errors() {
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
pub(super) async fn the_default_policies_verify_webhooks_with_the_built_in_plugin() {
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
pub(super) fn a_policy_names_standard_plugins_as_built_in() {
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
        stderr.contains("no built-in plugin `nope`; the built-in plugins are webhook-signature, header-rules, jwt-auth, ip-allow, basic-auth, client-cert-allow, canary-route, token-introspection"),
        "{stderr}"
    );
}

/// `portcullis new-plugin` writes a crate that builds outside this
/// repository as it is written: to a directory of its own, the SDK beside
/// it (the contract inside the SDK), it builds for wasm32-wasip2 with one
/// cargo command, passes `portcullis check` with its policy, and serves.
#[tokio::test]
pub(super) async fn a_new_plugin_builds_outside_the_checkout_and_serves() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .canonicalize()
        .unwrap();
    let parent = tempfile::tempdir().unwrap();
    assert!(
        !parent.path().starts_with(&repo),
        "the copy must be outside"
    );
    let dir = parent.path().join("edge-check");
    let made = std::process::Command::new(crate::support::binary())
        .arg("new-plugin")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(made.status.success(), "{made:?}");
    // A second time it refuses: nothing of the user's is overwritten.
    let again = std::process::Command::new(crate::support::binary())
        .arg("new-plugin")
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!again.status.success());
    assert!(
        String::from_utf8_lossy(&again.stderr).contains("is not empty"),
        "{again:?}"
    );
    // Kept between runs (its dependencies build once), apart from the
    // test build's own target directory, which cargo holds locked.
    let target = format!(
        "{}-template",
        std::env::var("CARGO_TARGET_DIR").unwrap_or_else(|_| "/tmp/portcullis-target".into())
    );
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let built = tokio::process::Command::new(cargo)
        .args(["build", "--release", "--target", "wasm32-wasip2"])
        .current_dir(&dir)
        .env("CARGO_TARGET_DIR", &target)
        .output()
        .await
        .expect("run cargo");
    assert!(
        built.status.success(),
        "{}",
        String::from_utf8_lossy(&built.stderr)
    );
    let wasm = "target/wasm32-wasip2/release/edge_check.wasm";
    std::fs::create_dir_all(dir.join(wasm).parent().unwrap()).unwrap();
    std::fs::copy(
        std::path::Path::new(&target).join("wasm32-wasip2/release/edge_check.wasm"),
        dir.join(wasm),
    )
    .unwrap();
    let (ok, _, stderr) = crate::support::check(&dir);
    assert!(ok, "{stderr}");

    let echo = upstream::echo("app").await;
    let policy = std::fs::read_to_string(dir.join("policy.yaml"))
        .unwrap()
        .replace("127.0.0.1:8080", "127.0.0.1:0")
        .replace("http://127.0.0.1:3000", &echo.url());
    std::fs::write(dir.join("policy.yaml"), policy).unwrap();
    let proxy = ProxyProcess::start_on(&dir, &[]).await;
    let passed = client::get(&proxy.url("/items")).await;
    assert_eq!(passed.status, 200, "{:?}", passed.body);
    assert_eq!(passed.json()["headers"]["x-checked-by"], "edge-check");
    let denied = client::get(&proxy.url("/admin/users")).await;
    assert_eq!(denied.status, 403);
    assert_eq!(denied.json()["plugin"], "edge-check");
    assert_eq!(denied.json()["error"], "denied by edge-check");
}

/// `new-plugin` carries every file of the SDK (a file added to it and
/// not to the list would leave new plugins unbuildable).
#[test]
pub(super) fn new_plugin_carries_the_whole_sdk() {
    let sdk = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../plugins/sdk");
    let mut on_disk = Vec::new();
    for sub in ["", "src", "wit"] {
        for entry in std::fs::read_dir(sdk.join(sub)).unwrap() {
            let entry = entry.unwrap();
            if entry.file_type().unwrap().is_file() {
                let name = entry.file_name().into_string().unwrap();
                on_disk.push(if sub.is_empty() {
                    name
                } else {
                    format!("{sub}/{name}")
                });
            }
        }
    }
    on_disk.sort();
    let mut carried: Vec<String> = portcullis::new_plugin::SDK
        .iter()
        .map(|(path, _)| path.to_string())
        .collect();
    carried.sort();
    assert_eq!(carried, on_disk);
}

/// The SDK carries the plugin contract with it (so a plugin outside this
/// repository builds); `wit/` stays the one source it is copied from.
#[test]
pub(super) fn the_sdks_copy_of_the_contract_is_the_contract() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let source = std::fs::read_to_string(repo.join("wit/policy.wit")).unwrap();
    let copy = std::fs::read_to_string(repo.join("plugins/sdk/wit/policy.wit")).unwrap();
    assert!(
        source == copy,
        "plugins/sdk/wit/policy.wit differs from wit/policy.wit: cp wit/policy.wit plugins/sdk/wit/"
    );
}
