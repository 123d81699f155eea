//! Updates the proxy refuses (bad YAML, an unknown upstream, a plugin
//! that does not compile or refuses its config, a half-written file):
//! each logged, and the config before it serving on.

use super::*;

/// Starts on a good configuration, applies `bad`, and checks that the old
/// configuration still serves, the error names `expect_in_error`, and the
/// metrics count it; then a good update applies normally.
async fn rejected_update(bad: &[(&str, &[u8])], expect_in_error: &[&str]) {
    let mut map = ConfigMap::new(&[("routing.yaml", answering("good").as_bytes())]);
    let mut proxy = ProxyProcess::start_on(map.path(), &[]).await;
    map.update(bad);
    proxy.wait_for_log("reload rejected").await;
    assert_eq!(client::get(&proxy.url("/v")).await.body, "good");
    let status = proxy.status().await;
    let error = status["last_error"]["message"].as_str().unwrap_or_default();
    for expected in expect_in_error {
        assert!(
            error.contains(expected),
            "error {error:?} lacks {expected:?}"
        );
    }
    assert_eq!(status["files_match_active"], false, "{status:#}");
    assert_eq!(status["config"]["generation"], 1, "{status:#}");
    let metrics = client::get(&proxy.admin_url("/metrics")).await;
    let metrics = String::from_utf8_lossy(&metrics.body);
    assert!(
        metrics.contains("portcullis_config_reloads_total{result=\"rejected\"} 1"),
        "{metrics}"
    );
    map.update(&[("routing.yaml", answering("better").as_bytes())]);
    served_within(&proxy.url("/v"), "better", Duration::from_secs(1)).await;
    let status = proxy.status().await;
    assert_eq!(status["files_match_active"], true, "{status:#}");
    assert_eq!(status["config"]["generation"], 2, "{status:#}");
    // The error was the files'; they are good again (operations.md).
    assert!(status["last_error"].is_null(), "{status:#}");
    // Only a tunnel client lists tunnels.
    assert!(status.get("tunnels").is_none(), "{status:#}");
}

#[tokio::test]
async fn invalid_yaml_is_rejected_and_the_old_config_serves() {
    let broken = "listeners: [ { name: main, bind: 127.0.0.1:0 }\nroutes: - nope\n";
    rejected_update(&[("routing.yaml", broken.as_bytes())], &["routing.yaml:2:"]).await;
}

#[tokio::test]
async fn unknown_upstream_is_rejected_and_the_old_config_serves() {
    let yaml = r#"
listeners: [{ name: main, bind: "127.0.0.1:0" }]
routes:
  - { name: v, match: { path: /v }, upstream: missing }
"#;
    rejected_update(
        &[("routing.yaml", yaml.as_bytes())],
        &[
            "routing.yaml:4:",
            "unknown upstream `missing`; no upstream is defined",
        ],
    )
    .await;
}

#[tokio::test]
async fn plugin_that_does_not_compile_is_rejected_and_the_old_config_serves() {
    let yaml = r#"
listeners: [{ name: main, bind: "127.0.0.1:0" }]
plugins: [{ name: junk, path: junk.wasm }]
routes:
  - name: v
    match: { path: /v }
    respond: { status: 200, body: "with junk" }
    plugins: [{ use: junk }]
"#;
    rejected_update(
        &[
            ("routing.yaml", yaml.as_bytes()),
            ("junk.wasm", b"\0asm but not a component"),
        ],
        &[
            "routing.yaml:3:",
            "junk.wasm: not a component of a format this proxy reads",
        ],
    )
    .await;
}

#[tokio::test]
async fn plugin_config_the_plugin_refuses_is_rejected_and_the_old_config_serves() {
    let yaml = r#"
listeners: [{ name: main, bind: "127.0.0.1:0" }]
plugins: [{ name: sig, path: sig.wasm }]
routes:
  - name: v
    match: { path: /v }
    respond: { status: 200, body: "signed" }
    plugins: [{ use: sig, config: { provider: github, secret: "" } }]
"#;
    let sig = std::fs::read(plugin_file("webhook-signature")).unwrap();
    rejected_update(
        &[("routing.yaml", yaml.as_bytes()), ("sig.wasm", &sig)],
        &["routing.yaml:8:", "`secret` is empty"],
    )
    .await;
}

#[tokio::test]
async fn half_written_file_is_rejected_then_applied_when_complete() {
    // Not a ConfigMap: a plain directory someone edits in place, caught
    // between two writes.
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("routing.yaml");
    std::fs::write(&file, answering("good")).unwrap();
    let mut proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let complete = answering("complete");
    let cut = complete.find("respond:").unwrap() + 12;
    std::fs::write(&file, &complete[..cut]).unwrap();
    proxy.wait_for_log("reload rejected").await;
    assert_eq!(client::get(&proxy.url("/v")).await.body, "good");
    let status = proxy.status().await;
    assert!(
        status["last_error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("routing.yaml:")),
        "{status:#}"
    );
    std::fs::write(&file, &complete).unwrap();
    served_within(&proxy.url("/v"), "complete", Duration::from_secs(1)).await;
}

/// A policy naming a device, a FIFO or a kernel file (`/proc/self/pagemap`
/// says it is a regular file, empty, and reads without end), as a plugin
/// or a secret: refused at once, before any read (not read until memory
/// runs out, not waited on for a writer), and the next good update
/// applies as usual.
#[tokio::test]
async fn a_plugin_or_secret_naming_a_device_or_a_fifo_is_refused_at_once() {
    let fifos = tempfile::tempdir().unwrap();
    let fifo = fifos.path().join("secret");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .expect("mkfifo");
    assert!(made.success());
    let fifo = fifo.display().to_string();
    let cases = [
        (
            "plugins: [{ name: z, path: /dev/zero }]\n".to_owned(),
            "[{ use: z }]".to_owned(),
            "/dev/zero: under /dev, the kernel's files: not read",
        ),
        (
            "plugins: [{ name: s, path: \"builtin:webhook-signature\" }]\n".to_owned(),
            format!(
                "[{{ use: s, config: {{ provider: github, secret: {{ from_file: {fifo} }} }} }}]"
            ),
            "a FIFO, not a regular file",
        ),
        (
            "plugins: [{ name: s, path: \"builtin:webhook-signature\" }]\n".to_owned(),
            "[{ use: s, config: { provider: github, secret: { from_file: /dev/zero } } }]"
                .to_owned(),
            "/dev/zero: under /dev, the kernel's files: not read",
        ),
        (
            "plugins: [{ name: p, path: /proc/self/pagemap }]\n".to_owned(),
            "[{ use: p }]".to_owned(),
            "/proc/self/pagemap: under /proc, the kernel's files: not read",
        ),
    ];
    for (plugins, uses, expected) in cases {
        let yaml = format!(
            r#"
listeners: [{{ name: main, bind: "127.0.0.1:0" }}]
{plugins}routes:
  - name: v
    match: {{ path: /v }}
    respond: {{ status: 200, body: "bad" }}
    plugins: {uses}
"#
        );
        // Before the fix a FIFO held the reload (and every later one)
        // for good: a hang, not a slow answer, is what this bounds.
        let files = [("routing.yaml", yaml.as_bytes())];
        let wanted = ["routing.yaml:", expected];
        let checked = rejected_update(&files, &wanted);
        tokio::time::timeout(Duration::from_secs(60), checked)
            .await
            .unwrap_or_else(|_| panic!("a reload naming {expected:?} hung"));
    }
}

/// A secret from the environment in a rejected update is named by its
/// variable in `/status` and the log, never shown.
#[tokio::test]
async fn a_rejected_secret_is_named_never_shown_in_status_or_log() {
    let secret = "Sup3r-S3cret-Value-0451";
    let mut map = ConfigMap::new(&[("routing.yaml", answering("good").as_bytes())]);
    let args: Vec<String> = ["serve", "--policies", &map.path().display().to_string()]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut proxy =
        ProxyProcess::launch(&args, &[("WEBHOOK_SECRET", secret.into())], "listening").await;
    let bad = r#"
listeners: [{ name: main, bind: "127.0.0.1:0" }]
routes:
  - name: v
    match: { path: /v }
    respond: { status: 200, body: "bad" }
    max_request_body: "${WEBHOOK_SECRET}"
"#;
    map.update(&[("routing.yaml", bad.as_bytes())]);
    proxy.wait_for_log("reload rejected").await;
    let status = proxy.status().await.to_string();
    assert!(status.contains("WEBHOOK_SECRET"), "{status}");
    assert!(!status.contains(secret), "{status}");
    let logs = proxy.logs.lock().unwrap().join("\n");
    assert!(logs.contains("WEBHOOK_SECRET"), "{logs}");
    assert!(!logs.contains(secret), "{logs}");
}
