//! Prebuilt third-party proxy-wasm filters, as users bring them: from a
//! package registry (tests/third_party.sh fetches them, pinned), with no
//! settings of ours. Higress's filters are built for Higress's Envoy
//! (ABI marker `proxy_abi_version_0_2_100`), which Envoy 1.40 refuses to
//! load: their own documentation is the reference here.

use super::*;

/// A filter of the GPUStack Higress plugins wheel (PyPI
/// `gpustack-higress-plugins` 0.5.1), by name and version.
pub(super) fn higress_plugin(name: &str, version: &str) -> std::path::PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(
        || std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"),
        std::path::PathBuf::from,
    );
    let path = target
        .join("third-party/gpustack_higress_plugins/plugins")
        .join(name)
        .join(version)
        .join("plugin.wasm");
    assert!(
        path.exists(),
        "{} is missing: tests/run.sh fetches it (tests/third_party.sh {})",
        path.display(),
        target.join("third-party").display()
    );
    path
}

/// Higress's `transformer` (a Go filter, 6.5 MB) with the request-header
/// rules of its README, on the README's request: the upstream gets the
/// headers the README shows, with no `timeout` or `memory` set.
#[tokio::test]
pub(super) async fn higress_transformer_rewrites_request_headers_as_its_readme_says() {
    let app = upstream::echo("app").await;
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(
        higress_plugin("transformer", "2.0.0"),
        dir.path().join("transformer.wasm"),
    )
    .unwrap();
    let yaml = format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: transformer, path: transformer.wasm }}]
routes:
  - name: app
    match: {{ path_prefix: / }}
    upstream: app
    plugins:
      - use: transformer
        config:
          reqRules:
            - operate: remove
              headers: [{{ key: X-remove }}]
            - operate: rename
              headers: [{{ oldKey: X-not-renamed, newKey: X-renamed }}]
            - operate: replace
              headers: [{{ key: X-replace, newValue: replaced }}]
            - operate: add
              headers: [{{ key: X-add-append, value: host-$1, host_pattern: ^(.*)\.com$ }}]
            - operate: append
              headers: [{{ key: X-add-append, appendValue: path-$1, path_pattern: '^.*?\/(\w+)[\?]{{0,1}}.*$' }}]
            - operate: map
              headers: [{{ fromKey: X-add-append, toKey: X-map }}]
            - operate: dedupe
              headers:
                - {{ key: X-dedupe-first, strategy: RETAIN_FIRST }}
                - {{ key: X-dedupe-last, strategy: RETAIN_LAST }}
                - {{ key: X-dedupe-unique, strategy: RETAIN_UNIQUE }}
"#,
        app.url()
    );
    std::fs::write(dir.path().join("policy.yaml"), yaml).unwrap();
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let mut req = Request::get(proxy.url("/get"))
        .header("host", "foo.bar.com")
        .header("x-remove", "exist")
        .header("x-not-renamed", "test")
        .header("x-replace", "not-replaced");
    for (name, values) in [
        ("x-dedupe-first", &["1", "2", "3"][..]),
        ("x-dedupe-last", &["a", "b", "c"]),
        ("x-dedupe-unique", &["1", "2", "3", "3", "2", "1"]),
    ] {
        for v in values {
            req = req.header(name, *v);
        }
    }
    let answer = client::send(&client::http1(), req.body(body(Bytes::new())).unwrap()).await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let seen = answer.json()["headers"].clone();
    for (name, value) in [
        ("x-add-append", "host-foo.bar, path-get"),
        ("x-map", "host-foo.bar, path-get"),
        ("x-renamed", "test"),
        ("x-replace", "replaced"),
        ("x-dedupe-first", "1"),
        ("x-dedupe-last", "c"),
        ("x-dedupe-unique", "1, 2, 3"),
    ] {
        assert_eq!(seen[name], value, "{name}: {seen:#}");
    }
    for gone in ["x-remove", "x-not-renamed"] {
        assert!(seen.get(gone).is_none(), "{gone}: {seen:#}");
    }
}

/// Higress's `ai-data-masking` (Rust) needs ~200 ms of CPU and more than
/// 48 MiB to start (its rules compiled in `proxy_on_configure`): it
/// starts under the defaults, a start's budget (`start_timeout`, 1 s) and
/// a filter's memory (128 MiB), with no settings. A GPUStack filter that
/// refuses its configuration is refused by `check` in its own words; one
/// that imports Higress's Redis calls (`gpustack-rate-limit`) starts.
#[test]
fn higress_filters_start_with_no_settings_or_say_why_they_do_not() {
    let dir = tempfile::tempdir().unwrap();
    for (file, name, version) in [
        ("masking.wasm", "ai-data-masking", "2.0.3"),
        ("pre-route.wasm", "gpustack-set-header-pre-route", "1.0.1"),
        ("rate-limit.wasm", "gpustack-rate-limit", "1.0.1"),
    ] {
        std::fs::copy(higress_plugin(name, version), dir.path().join(file)).unwrap();
    }
    let policy = |routes: &str| {
        format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["http://127.0.0.1:9"] }}]
plugins:
  - {{ name: masking, path: masking.wasm }}
  - {{ name: pre-route, path: pre-route.wasm }}
  - {{ name: rate-limit, path: rate-limit.wasm }}
routes:
{routes}"#
        )
    };
    let masking = "  - { name: m, match: { path: /m }, upstream: app, plugins: [{ use: masking, config: {} }] }\n";
    std::fs::write(dir.path().join("policy.yaml"), policy(masking)).unwrap();
    let (ok, _, stderr) = crate::support::check(dir.path());
    assert!(ok, "{stderr}");
    let refused = "  - { name: p, match: { path: /p }, upstream: app, plugins: [{ use: pre-route, config: {} }] }\n";
    std::fs::write(dir.path().join("policy.yaml"), policy(refused)).unwrap();
    let (ok, _, stderr) = crate::support::check(dir.path());
    assert!(!ok, "{stderr}");
    assert!(
        stderr.contains("policy.yaml:9:")
            && stderr.contains(
                "refused its configuration (proxy_on_configure returned false); it logged:"
            )
            && stderr
                .contains("one of the routeNameHeader or clusterNameHeader should be configured"),
        "{stderr}"
    );
    let redis = "  - { name: l, match: { path: /l }, upstream: app, plugins: [{ use: rate-limit, config: {} }] }\n";
    std::fs::write(dir.path().join("policy.yaml"), policy(redis)).unwrap();
    let (ok, _, stderr) = crate::support::check(dir.path());
    assert!(ok, "{stderr}");
}
