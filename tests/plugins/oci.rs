//! Plugins pulled from a real OCI registry (Debian's `docker-registry`):
//! both forms Istio accepts, a digest verified and pulled once, TLS with
//! the registry's CA and basic auth from a Docker config, a restart with
//! the registry down served from the pull cache, and a failed pull on a
//! reload leaving the old policy serving.

use super::*;
use crate::support::registry::{PASSWORD, Registry};

/// A policy guarding `/r` (answering 204) with the SDK example pulled
/// from `path`, with `extra` settings on the plugin.
fn policy(path: &str, extra: &str) -> String {
    format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
plugins: [{{ name: gate, path: "{path}"{extra} }}]
routes:
  - {{ name: r, match: {{ path: /r }}, respond: {{ status: 204 }}, plugins: [{{ use: gate, config: {{ header: x-api-key }} }}] }}
"#
    )
}

/// `portcullis check` on `dir` with the pull cache under `cache`.
fn check(dir: &std::path::Path, cache: &std::path::Path) -> (bool, String) {
    let out = std::process::Command::new(crate::support::binary())
        .args(["check", "--policies"])
        .arg(dir)
        .env("XDG_CACHE_HOME", cache)
        .output()
        .expect("run check");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn serve(dir: &std::path::Path, cache: &std::path::Path) -> ProxyProcess {
    let args = ["serve", "--policies", &dir.display().to_string()].map(String::from);
    ProxyProcess::launch(
        &args,
        &[("XDG_CACHE_HOME", cache.display().to_string())],
        "listening",
    )
    .await
}

/// `/r` answers 403 without the key and 204 with it: the pulled plugin runs.
async fn guarded(proxy: &ProxyProcess) {
    let url = proxy.url("/r");
    assert_eq!(client::get(&url).await.status, 403);
    let keyed = Request::get(&url)
        .header("x-api-key", "k")
        .body(body(Bytes::new()))
        .unwrap();
    assert_eq!(client::send(&client::http1(), keyed).await.status, 204);
}

fn module() -> Vec<u8> {
    std::fs::read(plugin_file("example-require-header")).unwrap()
}

/// An artifact pinned by digest: `check` pulls and verifies it, `serve`
/// runs it, and once pulled it is never pulled again: with the registry
/// gone, a restart starts from the cache. A pin the registry does not
/// hold is refused by name.
#[tokio::test]
pub(super) async fn a_pinned_artifact_is_pulled_once_and_restarts_from_the_cache() {
    let mut registry = Registry::start().await;
    let digest = registry.push_artifact("team/gate", "v1", &module()).await;
    let cache = tempfile::tempdir().unwrap();
    let reference = format!("oci://{}/team/gate:v1@{digest}", registry.host());
    let dir = policy_dir(&policy(&reference, ""), &[]);
    let (ok, stderr) = check(dir.path(), cache.path());
    assert!(ok, "{stderr}");
    let proxy = serve(dir.path(), cache.path()).await;
    guarded(&proxy).await;
    drop(proxy);
    // A cache that cannot be made is a warning (in serve's log); the
    // pull goes on.
    let unwritable = cache.path().join("a-file");
    std::fs::write(&unwritable, "").unwrap();
    let (ok, stderr) = check(dir.path(), &unwritable);
    assert!(ok, "{stderr}");

    registry.kill().await;
    let proxy = serve(dir.path(), cache.path()).await;
    guarded(&proxy).await;
    drop(proxy);

    // Another digest for the same tag: not in the cache, and the
    // registry (back up) has no such manifest.
    registry.restart().await;
    let other = format!("sha256:{}", "0".repeat(64));
    let reference = format!("oci://{}/team/gate:v1@{other}", registry.host());
    let dir = policy_dir(&policy(&reference, ""), &[]);
    let (ok, stderr) = check(dir.path(), cache.path());
    assert!(!ok);
    assert!(
        stderr.contains(&format!(
            "cannot pull {reference}: the registry {} answered 404",
            registry.host()
        )) && stderr.contains("policy.yaml:3:"),
        "{stderr}"
    );
}

/// An image whose one layer holds `plugin.wasm`, from a registry with
/// TLS and basic auth: pulled with the Docker config named by
/// `pull_secret` and the CA named by `registry_ca`. A wrong password
/// says 401 and which setting to look at; without the CA, the
/// certificate is refused; a pin of the module's own sha256 is checked
/// too.
#[tokio::test]
pub(super) async fn an_image_from_a_registry_with_tls_and_auth_is_pulled_with_the_secret() {
    let registry = Registry::start_secure().await;
    registry
        .push_image("team/gate-image", "1.0", &module())
        .await;
    let cache = tempfile::tempdir().unwrap();
    let reference = format!("oci://{}/team/gate-image:1.0", registry.host());
    let files = |password: &str| {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ca.pem"), registry.ca_pem.as_ref().unwrap()).unwrap();
        std::fs::write(
            dir.path().join("docker.json"),
            registry.docker_config(password),
        )
        .unwrap();
        dir
    };
    let secure = ", pull_secret: docker.json, registry_ca: ca.pem";

    let wrong = files("not-it");
    std::fs::write(wrong.path().join("policy.yaml"), policy(&reference, secure)).unwrap();
    let (ok, stderr) = check(wrong.path(), cache.path());
    assert!(!ok);
    assert!(
        stderr.contains("answered 401") && stderr.contains("pull_secret"),
        "{stderr}"
    );

    let no_ca = files(PASSWORD);
    let insecure = ", pull_secret: docker.json";
    std::fs::write(
        no_ca.path().join("policy.yaml"),
        policy(&reference, insecure),
    )
    .unwrap();
    let (ok, stderr) = check(no_ca.path(), cache.path());
    assert!(!ok);
    assert!(stderr.contains("UnknownIssuer"), "{stderr}");

    let good = files(PASSWORD);
    let sha = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(module()))
    };
    let pinned = format!("{secure}, sha256: \"{sha}\"");
    std::fs::write(good.path().join("policy.yaml"), policy(&reference, &pinned)).unwrap();
    let (ok, stderr) = check(good.path(), cache.path());
    assert!(ok, "{stderr}");
    let proxy = serve(good.path(), cache.path()).await;
    guarded(&proxy).await;
    drop(proxy);
}

/// A registry with token auth (Docker Hub's, GHCR's, Harbor's way): the
/// registry's 401 names its token service, which gives a token for the
/// pull's scope to the credentials of the Docker config; the pull goes on
/// with it. Wrong credentials: the token service's 401, named.
// Threads of its own: `check` blocks its caller while the token service
// answers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
pub(super) async fn a_registry_with_token_auth_is_pulled_with_a_bearer_token() {
    let tokens = crate::support::token_service::TokenService::start().await;
    let registry = Registry::start_with_tokens(&tokens).await;
    registry
        .push_artifact("team/gate-token", "1.0", &module())
        .await;
    let cache = tempfile::tempdir().unwrap();
    let reference = format!("oci://{}/team/gate-token:1.0", registry.host());
    let files = |password: &str| {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("docker.json"),
            registry.docker_config(password),
        )
        .unwrap();
        std::fs::write(
            dir.path().join("policy.yaml"),
            policy(&reference, ", pull_secret: docker.json"),
        )
        .unwrap();
        dir
    };
    let wrong = files("not-it");
    let (ok, stderr) = check(wrong.path(), cache.path());
    assert!(!ok);
    assert!(
        stderr.contains(&format!("token service {} answered 401", tokens.realm())),
        "{stderr}"
    );
    let good = files(PASSWORD);
    let (ok, stderr) = check(good.path(), cache.path());
    assert!(ok, "{stderr}");
    assert!(
        tokens
            .asked
            .lock()
            .unwrap()
            .iter()
            .any(|s| s == "repository:team/gate-token:pull"),
        "{:?}",
        tokens.asked.lock().unwrap()
    );
    let proxy = serve(good.path(), cache.path()).await;
    guarded(&proxy).await;
}

/// A reload naming a tag the registry does not have is rejected with the
/// registry's answer in `/status`; the policy before it serves on.
#[tokio::test]
pub(super) async fn a_failed_pull_on_a_reload_keeps_the_old_policy_serving() {
    let registry = Registry::start().await;
    registry.push_artifact("team/gate", "v1", &module()).await;
    let cache = tempfile::tempdir().unwrap();
    let good = policy(&format!("oci://{}/team/gate:v1", registry.host()), "");
    let mut map = crate::support::configmap::ConfigMap::new(&[("routing.yaml", good.as_bytes())]);
    let mut proxy = serve(map.path(), cache.path()).await;
    guarded(&proxy).await;
    let missing = policy(&format!("oci://{}/team/gate:v9", registry.host()), "");
    map.update(&[("routing.yaml", missing.as_bytes())]);
    proxy.wait_for_log("reload rejected").await;
    let status = proxy.status().await;
    let error = status["last_error"]["message"].as_str().unwrap_or_default();
    assert!(
        error.contains(&format!(
            "cannot pull oci://{}/team/gate:v9",
            registry.host()
        )) && error.contains("answered 404"),
        "{status:#}"
    );
    guarded(&proxy).await;
    drop(proxy);
}

/// `check` says plainly when it cannot reach a registry, and refuses
/// pull settings on a plugin that is a file rather than ignoring them.
#[test]
pub(super) fn check_names_an_unreachable_registry_and_misplaced_pull_settings() {
    let cache = tempfile::tempdir().unwrap();
    let port = crate::support::closed_port();
    let reference = format!("oci://127.0.0.1:{port}/team/gate:v1");
    let dir = policy_dir(&policy(&reference, ""), &[]);
    let (ok, stderr) = check(dir.path(), cache.path());
    assert!(!ok);
    assert!(
        stderr.contains(&format!(
            "cannot pull {reference}: connect to 127.0.0.1:{port}"
        )),
        "{stderr}"
    );
    let dir = policy_dir(
        &policy("example-require-header.wasm", ", pull_policy: Always"),
        &["example-require-header"],
    );
    let (ok, stderr) = check(dir.path(), cache.path());
    assert!(!ok);
    assert!(
        stderr.contains("`pull_policy` applies to a plugin pulled from a registry (`path: oci://…`), not to a file"),
        "{stderr}"
    );
}

/// A ConfigMap edit from one pinned digest to another swaps the plugin
/// while clients keep asking: the new module is pulled before the new
/// policy takes traffic, and every request is answered, by one version
/// or the other.
#[tokio::test]
pub(super) async fn a_configmap_edit_to_a_new_digest_swaps_the_plugin_with_no_request_dropped() {
    use std::sync::atomic::{AtomicBool, AtomicU64};
    let registry = Registry::start().await;
    let v1 = registry.push_artifact("team/gate", "v1", &module()).await;
    let rules = std::fs::read(plugin_file("header-rules")).unwrap();
    let v2 = registry.push_artifact("team/gate", "v2", &rules).await;
    let cache = tempfile::tempdir().unwrap();
    let app = upstream::echo("app").await;
    let pinned = |tag: &str, digest: &str, config: &str| {
        format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: gate, path: "oci://{}/team/gate:{tag}@{digest}" }}]
routes:
  - {{ name: r, match: {{ path: /r }}, upstream: app, plugins: [{{ use: gate, config: {config} }}] }}
"#,
            app.url(),
            registry.host()
        )
    };
    let first = pinned("v1", &v1, "{ header: x-api-key }");
    let second = pinned("v2", &v2, "{ response: { set: { x-version: \"2\" } } }");
    let mut map = crate::support::configmap::ConfigMap::new(&[("routing.yaml", first.as_bytes())]);
    let mut proxy = serve(map.path(), cache.path()).await;
    let (stop, answered, failed) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicU64::new(0)),
        Arc::new(std::sync::Mutex::new(Vec::new())),
    );
    let mut clients = Vec::new();
    for _ in 0..3 {
        let (url, stop, answered, failed) = (
            proxy.url("/r"),
            stop.clone(),
            answered.clone(),
            failed.clone(),
        );
        clients.push(tokio::spawn(async move {
            let c = client::http1();
            while !stop.load(Ordering::Relaxed) {
                let req = Request::get(&url)
                    .header("x-api-key", "k")
                    .body(body(Bytes::new()))
                    .unwrap();
                match client::send(&c, req).await.status.as_u16() {
                    200 => answered.fetch_add(1, Ordering::Relaxed),
                    other => {
                        failed.lock().unwrap().push(other);
                        0
                    }
                };
            }
        }));
    }
    map.update(&[("routing.yaml", second.as_bytes())]);
    let line = proxy.wait_for_log("configuration applied").await;
    assert!(line.contains("\"generation\":2"), "{line}");
    // The new version answers: its header is set, and no key is asked for.
    let a = client::get(&proxy.url("/r")).await;
    assert_eq!(
        (
            a.status.as_u16(),
            a.headers.get("x-version").map(|v| v.as_bytes().to_vec())
        ),
        (200, Some(b"2".to_vec()))
    );
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    assert!(answered.load(Ordering::Relaxed) > 0);
    assert!(
        failed.lock().unwrap().is_empty(),
        "{:?}",
        failed.lock().unwrap()
    );
}
