//! `--plugin-cache`: compiled plugins kept on disk across restarts, files
//! that cannot be trusted refused, files no policy uses removed.

use std::path::{Path, PathBuf};

use crate::support::client;
use crate::support::configmap::ConfigMap;
use crate::support::plugin_file;
use crate::support::process::ProxyProcess;
use crate::support::upstream;

/// Policies with one route whose plugin (`gate.wasm`) requires `x-key`.
fn policy(app: &str) -> String {
    format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{app}"] }}]
plugins: [{{ name: gate, path: gate.wasm }}]
routes:
  - {{ name: api, match: {{ path_prefix: /api }}, upstream: app, plugins: [{{ use: gate, config: {{ header: x-key }} }}] }}
"#
    )
}

/// An upstream, and a ConfigMap with [`policy`] for it and
/// `example-require-header` as `gate.wasm`.
async fn gated() -> (upstream::Upstream, ConfigMap) {
    let app = upstream::echo("app").await;
    let yaml = policy(&app.url());
    let gate = std::fs::read(plugin_file("example-require-header")).expect("plugin");
    let map = ConfigMap::new(&[("policy.yaml", yaml.as_bytes()), ("gate.wasm", &gate)]);
    (app, map)
}

/// The `*.cwasm` files in `dir`.
fn cached_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.extension().is_some_and(|x| x == "cwasm"))
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

/// The `/metrics` lines for the plugin cache's outcomes since start.
fn outcomes(loaded: u64, compiled: u64, refused: u64) -> Vec<String> {
    [
        ("loaded", loaded),
        ("compiled", compiled),
        ("refused", refused),
    ]
    .iter()
    .map(|(o, n)| format!(r#"portcullis_plugin_cache_total{{outcome="{o}"}} {n}"#))
    .collect()
}

/// Starts the proxy on `map` with the cache in `cache`.
async fn start(map: &ConfigMap, cache: &Path) -> ProxyProcess {
    ProxyProcess::start_on(
        map.path(),
        &["--plugin-cache", cache.to_str().expect("utf-8 path")],
    )
    .await
}

/// Stops the proxy as Kubernetes does, and waits for it to exit.
async fn stop(mut proxy: ProxyProcess) {
    proxy.signal("TERM");
    assert!(
        proxy
            .wait_exit(std::time::Duration::from_secs(10))
            .await
            .success()
    );
}

/// The plugin on `/api` answers as `example-require-header` does: 403
/// without the header, the upstream with it.
async fn assert_gate_runs(proxy: &ProxyProcess) {
    assert_eq!(client::get(&proxy.url("/api/a")).await.status, 403);
    let keyed = hyper::Request::get(proxy.url("/api/a"))
        .header("x-key", "1")
        .body(client::body(bytes::Bytes::new()))
        .expect("request");
    assert_eq!(client::send(&client::http1(), keyed).await.status, 200);
}

#[tokio::test]
async fn a_restart_loads_compiled_plugins_from_the_cache() {
    let (_app, map) = gated().await;
    let scratch = tempfile::tempdir().expect("tempdir");
    // A directory that is not there yet: the proxy makes it.
    let cache = scratch.path().join("plugin-cache");

    // First start: compiled, and the code written to the cache.
    let proxy = start(&map, &cache).await;
    let kept = proxy
        .find_log("plugin compiled and kept in the plugin cache")
        .await;
    assert!(kept.contains("gate.wasm"), "{kept}");
    assert_gate_runs(&proxy).await;
    proxy.metrics_showing(&outcomes(0, 1, 0)).await;
    stop(proxy).await;
    let files = cached_files(&cache);
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(kept.contains(&files[0].display().to_string()), "{kept}");

    // Second start: loaded, not compiled; and the loaded code runs.
    let proxy = start(&map, &cache).await;
    let loaded = proxy.find_log("plugin loaded from the plugin cache").await;
    assert!(loaded.contains("gate.wasm"), "{loaded}");
    assert_eq!(proxy.count_logs("plugin compiled"), 0);
    assert_gate_runs(&proxy).await;
    proxy.metrics_showing(&outcomes(1, 0, 0)).await;
    stop(proxy).await;

    // A damaged file is refused, named, compiled again and replaced.
    let mut bytes = std::fs::read(&files[0]).expect("read");
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x40;
    std::fs::write(&files[0], &bytes).expect("damage");
    let proxy = start(&map, &cache).await;
    let refused = proxy.find_log("not using the cached compiled plugin").await;
    assert!(
        refused.contains("damaged") && refused.contains(&files[0].display().to_string()),
        "{refused}"
    );
    proxy
        .find_log("plugin compiled and kept in the plugin cache")
        .await;
    assert_gate_runs(&proxy).await;
    proxy.metrics_showing(&outcomes(0, 1, 1)).await;
    stop(proxy).await;
    let proxy = start(&map, &cache).await;
    proxy.find_log("plugin loaded from the plugin cache").await;
    stop(proxy).await;
}

#[tokio::test]
async fn files_other_users_could_have_written_are_not_loaded() {
    use std::os::unix::fs::PermissionsExt;
    let (_app, map) = gated().await;
    let cache = tempfile::tempdir().expect("tempdir");
    stop(start(&map, cache.path()).await).await;
    let files = cached_files(cache.path());
    assert_eq!(files.len(), 1, "{files:?}");
    std::fs::set_permissions(&files[0], std::fs::Permissions::from_mode(0o662)).expect("chmod");

    let proxy = start(&map, cache.path()).await;
    let refused = proxy.find_log("not using the cached compiled plugin").await;
    assert!(refused.contains("writable by other users"), "{refused}");
    assert_eq!(proxy.count_logs("plugin loaded from the plugin cache"), 0);
    assert_gate_runs(&proxy).await;
    stop(proxy).await;
    // Written anew, as this user's alone.
    let mode = std::fs::metadata(&files[0])
        .expect("meta")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[tokio::test]
async fn the_cache_keeps_the_code_of_this_and_the_previous_configuration() {
    let (app, mut map) = gated().await;
    let yaml = policy(&app.url());
    let gate = std::fs::read(plugin_file("example-require-header")).expect("plugin");
    let trap = std::fs::read(plugin_file("fixture-trap")).expect("plugin");
    let hog = std::fs::read(plugin_file("fixture-grow-memory")).expect("plugin");
    let cache = tempfile::tempdir().expect("tempdir");
    let swap = |map: &mut ConfigMap, module: &[u8]| {
        map.update(&[("policy.yaml", yaml.as_bytes()), ("gate.wasm", module)]);
    };
    // Left alone: not a file the cache wrote.
    std::fs::write(cache.path().join("README"), "mine").expect("write");

    let first = start(&map, cache.path()).await;
    let g = cached_files(cache.path());
    assert_eq!(g.len(), 1, "{g:?}");
    stop(first).await;
    // A file an earlier run kept for a module no policy names now.
    let name = g[0].file_name().unwrap().to_str().unwrap();
    let stale = cache
        .path()
        .join(format!("{}{}", "0".repeat(64), &name[64..]));
    std::fs::copy(&g[0], &stale).expect("copy");
    let mut proxy = start(&map, cache.path()).await;
    proxy.find_log("plugin loaded from the plugin cache").await;
    assert_eq!(cached_files(cache.path()), g, "removed at start: {stale:?}");

    // A new version: its code and the one before are kept.
    swap(&mut map, &trap);
    proxy.wait_for_log("reload: configuration applied").await;
    assert_eq!(client::get(&proxy.url("/api/a")).await.status, 500);
    let gt = cached_files(cache.path());
    assert_eq!(gt.len(), 2, "{gt:?}");
    assert!(gt.contains(&g[0]));

    // Rolled back: loaded from the cache, not compiled.
    swap(&mut map, &gate);
    proxy.wait_for_log("reload: configuration applied").await;
    assert_gate_runs(&proxy).await;
    assert_eq!(proxy.count_logs("plugin loaded from the plugin cache"), 2);
    assert_eq!(cached_files(cache.path()), gt);

    // Another version: the one two configurations back goes.
    swap(&mut map, &hog);
    proxy.wait_for_log("reload: configuration applied").await;
    let gh = cached_files(cache.path());
    assert_eq!(gh.len(), 2, "{gh:?}");
    assert!(
        gh.contains(&g[0]),
        "the previous configuration's module stays"
    );
    assert!(
        gh.iter().all(|f| gt.contains(f) == (f == &g[0])),
        "{gh:?} {gt:?}"
    );
    proxy
        .find_log("removed compiled plugins no policy uses from the plugin cache")
        .await;
    assert!(cache.path().join("README").exists());
    stop(proxy).await;

    // Restarted on policies that use no plugin (which never start the
    // engine): the cache is emptied all the same.
    let plain = yaml
        .replace("plugins: [{ name: gate, path: gate.wasm }]\n", "")
        .replace(", plugins: [{ use: gate, config: { header: x-key } }]", "");
    map.update(&[("policy.yaml", plain.as_bytes())]);
    let proxy = start(&map, cache.path()).await;
    assert_eq!(client::get(&proxy.url("/api/a")).await.status, 200);
    // Before the listeners are announced, so by now.
    proxy
        .find_log("removed compiled plugins no policy uses from the plugin cache")
        .await;
    assert_eq!(cached_files(cache.path()), Vec::<PathBuf>::new());
    assert!(cache.path().join("README").exists());
    stop(proxy).await;
}

#[tokio::test]
async fn a_cache_that_cannot_be_used_only_costs_the_compile() {
    let (_app, map) = gated().await;
    let scratch = tempfile::tempdir().expect("tempdir");
    // A file where the directory should be.
    let cache = scratch.path().join("cache");
    std::fs::write(&cache, "not a directory").expect("write");

    let proxy = start(&map, &cache).await;
    let warned = proxy.find_log("not using the plugin cache").await;
    assert!(warned.contains(&cache.display().to_string()), "{warned}");
    proxy.find_log("plugin compiled").await;
    assert_gate_runs(&proxy).await;
    stop(proxy).await;
}

/// `check --plugin-cache` fills the cache and then loads from it: a file
/// it loaded is left as it was, a damaged one is written again.
#[tokio::test]
async fn check_uses_the_cache_too() {
    let (_app, map) = gated().await;
    let cache = tempfile::tempdir().expect("tempdir");
    let check = || {
        let flag = std::ffi::OsStr::new("--plugin-cache");
        let (ok, _, stderr) =
            crate::support::check_with(map.path(), &[flag, cache.path().as_os_str()]);
        assert!(ok, "{stderr}");
    };
    check();
    let files = cached_files(cache.path());
    assert_eq!(files.len(), 1, "{files:?}");
    let written = std::fs::read(&files[0]).expect("read");
    // Aged, so a rewrite would show in the time as well as the bytes.
    let long_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    let age = |t| {
        std::fs::File::options()
            .write(true)
            .open(&files[0])
            .and_then(|f| f.set_modified(t))
            .expect("set time");
    };
    age(long_ago);
    check();
    let modified = || {
        std::fs::metadata(&files[0])
            .and_then(|m| m.modified())
            .expect("mtime")
    };
    assert_eq!(modified(), long_ago, "loaded, not written again");

    let mut damaged = written;
    let mid = damaged.len() / 2;
    damaged[mid] ^= 1;
    std::fs::write(&files[0], &damaged).expect("damage");
    age(long_ago);
    check();
    assert_ne!(modified(), long_ago, "written again");
    assert_ne!(std::fs::read(&files[0]).expect("read"), damaged);
}

/// A proxy-wasm filter is compiled once for as long as a configuration
/// uses it: a reload that keeps the filter (another route changed) does
/// not compile it again, and one that brings a new version does.
#[tokio::test]
async fn a_reload_that_keeps_a_proxy_wasm_filter_does_not_compile_it_again() {
    let app = upstream::echo("app").await;
    let policy = |extra: &str| {
        format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: pw, path: pw.wasm }}]
routes:
  - {{ name: r, match: {{ path_prefix: / }}, upstream: app, plugins: [{{ use: pw, config: t }}] }}
{extra}"#,
            app.url()
        )
    };
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("policy.yaml"), policy("")).expect("policy");
    let headers = std::fs::read(plugin_file("proxy-wasm-headers")).expect("plugin");
    std::fs::write(dir.path().join("pw.wasm"), &headers).expect("plugin");
    let mut proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    assert_eq!(proxy.count_logs("plugin compiled"), 1);
    let more = "  - { name: more, match: { path: /more }, respond: { status: 204 } }\n";
    std::fs::write(dir.path().join("policy.yaml"), policy(more)).expect("policy");
    proxy.wait_for_log("reload: configuration applied").await;
    assert_eq!(client::get(&proxy.url("/more")).await.status, 204);
    assert_eq!(proxy.count_logs("plugin compiled"), 1, "compiled again");
    // Another module (the same filter, one byte more: a custom section).
    let mut other = headers.clone();
    other.extend_from_slice(&[0, 2, 1, b'x']);
    std::fs::write(dir.path().join("pw.wasm"), other).expect("plugin");
    proxy.wait_for_log("reload: configuration applied").await;
    assert_eq!(proxy.count_logs("plugin compiled"), 2);
}

/// A proxy-wasm filter is kept in the plugin cache too: a restart loads
/// its machine code instead of compiling it.
#[tokio::test]
async fn a_restart_loads_a_proxy_wasm_filter_from_the_cache() {
    let app = upstream::echo("app").await;
    let dir = tempfile::tempdir().expect("tempdir");
    let yaml = format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: pw, path: pw.wasm }}]
routes: [{{ name: r, match: {{ path_prefix: / }}, upstream: app, plugins: [{{ use: pw, config: t }}] }}]
"#,
        app.url()
    );
    std::fs::write(dir.path().join("policy.yaml"), yaml).expect("policy");
    std::fs::copy(
        plugin_file("proxy-wasm-headers"),
        dir.path().join("pw.wasm"),
    )
    .expect("plugin");
    let cache = tempfile::tempdir().expect("tempdir");
    let args = ["--plugin-cache", cache.path().to_str().expect("utf-8 path")];
    let first = ProxyProcess::start_on(dir.path(), &args).await;
    first
        .find_log("plugin compiled and kept in the plugin cache")
        .await;
    assert_eq!(cached_files(cache.path()).len(), 1);
    stop(first).await;
    let second = ProxyProcess::start_on(dir.path(), &args).await;
    second.find_log("plugin loaded from the plugin cache").await;
    assert_eq!(second.count_logs("plugin compiled"), 0);
    let seen = client::get(&second.url("/x")).await.json()["headers"].clone();
    assert_eq!(seen["x-pw-tag"], "t", "{seen:#}");
}
