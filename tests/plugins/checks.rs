//! How `check` reports plugin problems: configs, pins, places.

use super::*;

/// A plugin's config is YAML data, so an unquoted `0123` is a number;
/// the plugin's refusal says to quote it.
#[test]
pub(super) fn a_number_where_a_plugin_wants_text_gets_a_hint() {
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
pub(super) fn a_plugin_pin_is_checked_against_the_file() {
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
pub(super) fn check_reports_plugin_problems_with_route_and_place() {
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

/// `check` reads every plugin the policies define, used or not: a
/// missing file and a file that is no module are named on their own
/// lines before any route uses them. Serving reads only the plugins in
/// use, so such a definition (a plugin whose file is still on its way)
/// does not stop the proxy.
#[tokio::test]
pub(super) async fn check_reads_plugins_no_route_uses_and_serving_skips_them() {
    let dir = policy_dir(
        r#"
listeners: [{ name: http, bind: "127.0.0.1:0" }]
plugins:
  - { name: ghost, path: missing.wasm }
  - { name: junk, path: junk.wasm }
routes: [{ name: r, match: { path: /r }, respond: { status: 204 } }]
"#,
        &[],
    );
    std::fs::write(dir.path().join("junk.wasm"), b"not a module").unwrap();
    let (ok, _, stderr) = crate::support::check(dir.path());
    assert!(!ok, "{stderr}");
    let on = |line: usize, what: &str| {
        stderr
            .lines()
            .any(|l| l.contains(&format!("policy.yaml:{line}:")) && l.contains(what))
    };
    assert!(on(4, "cannot read plugin"), "{stderr}");
    assert!(on(5, "junk"), "{stderr}");
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let a = client::get(&format!("http://{}/r", proxy.addr)).await;
    assert_eq!(a.status, 204, "{:?}", a.body);
}

/// An upstream a standard plugin's config names is one of the policies':
/// a typo in canary-route's or token-introspection's `upstream` is an
/// error at the use, listing the upstreams there are, where it used to
/// pass and fail every request the plugin sent on with 500.
#[test]
pub(super) fn an_upstream_a_standard_plugins_config_names_must_exist() {
    let yaml = r#"
upstreams: [{ name: app, endpoints: ["http://127.0.0.1:1"] }, { name: app-canary, endpoints: ["http://127.0.0.1:2"] }]
plugins: [{ name: canary, path: "builtin:canary-route" }, { name: introspect, path: "builtin:token-introspection" }]
routes:
  - { name: a, match: { path: /a }, upstream: app, plugins: [{ use: canary, config: { upstream: app-canry, percent: 5 } }] }
  - { name: b, match: { path: /b }, upstream: app, plugins: [{ use: introspect, config: { upstream: idp, path: /introspect } }] }
  - { name: c, match: { path: /c }, upstream: app, plugins: [{ use: canary, config: { upstream: app-canary, percent: 5 } }] }
"#;
    crate::support::assert_check_errors(
        yaml,
        &[
            (
                5,
                "`upstream: app-canry` in canary-route's config names no upstream; defined under `upstreams:`: app, app-canary",
            ),
            (
                6,
                "`upstream: idp` in token-introspection's config names no upstream",
            ),
        ],
    );
    let dir = policy_dir(yaml, &[]);
    let (_, _, stderr) = crate::support::check(dir.path());
    assert!(!stderr.contains("policy.yaml:7:"), "{stderr}");
}
