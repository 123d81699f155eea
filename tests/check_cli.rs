//! `portcullis check`: exit codes and `file:line:column: message` errors.

use std::process::Command;

use crate::support::{binary, check};

#[test]
fn the_shipped_policies_are_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../policies");
    let (ok, stdout, stderr) = check(&dir);
    assert!(ok, "{stderr}");
    assert!(stdout.contains("ok"), "{stdout}");
    // And the built-in copy too, which says whether it traces: that
    // hangs on the environment.
    let out = Command::new(binary())
        .arg("check")
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .output()
        .expect("run check");
    assert!(out.status.success());
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains("ok (") && !said.contains("tracing"), "{said}");
    let out = Command::new(binary())
        .arg("check")
        .env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "http://otel-collector.observability:4318",
        )
        .output()
        .expect("run check");
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(said.contains(", tracing to otel-collector)"), "{said}");
}

/// `serve`, `tunnel-server` and `tunnel-client` started on one host (the
/// tunnel walk-through, tried locally) each get their admin listener:
/// their defaults, as `--help` shows them, are three different ports.
#[test]
fn the_three_commands_default_their_admin_listeners_apart() {
    let admin_default = |command: &str| {
        let out = Command::new(binary())
            .args([command, "--help"])
            .env_remove("PORTCULLIS_ADMIN")
            .output()
            .expect("run portcullis");
        assert!(out.status.success(), "{command} --help");
        let help = String::from_utf8_lossy(&out.stdout).into_owned();
        let from = help.find("--admin").expect("an --admin flag");
        help[from..]
            .split("[default: ")
            .nth(1)
            .and_then(|d| d.split(']').next())
            .expect("a default")
            .to_owned()
    };
    let defaults = ["serve", "tunnel-server", "tunnel-client"].map(admin_default);
    assert_eq!(
        defaults,
        ["127.0.0.1:9901", "127.0.0.1:9902", "127.0.0.1:9903"]
    );
}

/// Each command's `--help` ends with an example of itself.
#[test]
fn every_commands_help_shows_an_example() {
    for command in [
        "serve",
        "tunnel-server",
        "tunnel-client",
        "hash-token",
        "dev-certs",
        "check",
    ] {
        let out = Command::new(binary())
            .args([command, "--help"])
            .output()
            .expect("run portcullis");
        let help = String::from_utf8_lossy(&out.stdout);
        let example = help.split("Example:").nth(1).unwrap_or_default();
        assert!(
            example.contains(&format!("portcullis {command}")),
            "{command}: {help}"
        );
    }
}

#[test]
fn every_error_is_reported_with_file_line_and_column() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("a.yaml"),
        r#"listeners:
  - name: http
    bind: "nope"
upstreams:
  - name: u1
    endpoints: ["http://127.0.0.1:1"]
    timeouts: { connect: 5 }
  - name: u2
    endpoints: ["ftp://a"]
routes:
  - name: r1
    match: { path: /a }
    upstream: missing
  - name: r2
    match: { path: "/x/{a}" }
    upstream: u1
  - name: r3
    match: { path: "/x/{b}" }
    upstream: u1
  - name: r4
    match: { path: "/x/{a}" }
    upstream: u1
  - name: r5
    match: { path: /b }
    upstream: u1
    timeout: soon
  - name: r6
    match: { path: /c }
    upstream: u2
"#,
    )
    .unwrap();
    std::fs::write(
        dir.path().join("b.yaml"),
        "routes:\n  - name: x\n    match: { path: /y\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("c.yaml"),
        "upstreams:\n  - name: z\n    endpoint: [\"http://a\"]\n",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("d.yaml"),
        "routes:\n  - name: d\n    match: { path: /d }\n    url: \"${UNSET_TEST_VAR_XYZ}\"\n",
    )
    .unwrap();
    std::fs::write(dir.path().join("notes.txt"), "not a policy").unwrap();
    let (ok, _, stderr) = check(dir.path());
    assert!(!ok, "invalid policies must fail");
    let a = dir.path().join("a.yaml").display().to_string();
    let b = dir.path().join("b.yaml").display().to_string();
    let c = dir.path().join("c.yaml").display().to_string();
    let d = dir.path().join("d.yaml").display().to_string();
    let expect = [
        format!("{a}:3:11: `nope` is not a bind address"),
        format!("{a}:7:26: `5` is not a duration"),
        format!("{a}:9:17: `ftp://a` must start with http:// or https://"),
        format!("{a}:13:15: unknown upstream `missing`"),
        format!("{a}:18:12: path `/x/{{b}}` conflicts with path `/x/{{a}}` of route `r2`"),
        format!("{a}:21:12: route `r4` conflicts with route `r2`"),
        format!("{a}:26:14: `soon` is not a duration"),
        format!("{b}:3:"),
        format!("{c}:3:5: unknown field `endpoint`"),
        format!("{d}:4:10: environment variable `UNSET_TEST_VAR_XYZ` is not set"),
    ];
    for e in &expect {
        assert!(
            stderr.lines().any(|l| l.starts_with(e.as_str())),
            "missing `{e}` in:\n{stderr}"
        );
    }
    // An upstream defined with errors is not also "unknown" where it is used.
    assert!(!stderr.contains("upstream `u2`"), "{stderr}");
    // A name unknown while some files did not parse may be defined in them.
    let unknown = stderr
        .lines()
        .find(|l| l.contains("unknown upstream `missing`"))
        .unwrap();
    assert!(
        unknown.ends_with(&format!("(or in what of {b}, {c} did not parse)")),
        "{unknown}"
    );
}

#[test]
fn a_configmap_mount_is_read_through_its_symlinks() {
    use std::os::unix::fs::symlink;
    // The kubelet's layout: files in a timestamped directory, `..data`
    // pointing at it, and each key a symlink through `..data`.
    let dir = tempfile::tempdir().unwrap();
    let stamp = dir.path().join("..2026_11_22_00_00_00.000000001");
    std::fs::create_dir(&stamp).unwrap();
    std::fs::write(
        stamp.join("routing.yaml"),
        "listeners: [{ name: http, bind: \"127.0.0.1:0\" }]\nroutes: [{ name: ok, match: { path: /ok }, respond: { status: 200 } }]\n",
    )
    .unwrap();
    std::fs::write(stamp.join("notes.txt"), "not a policy").unwrap();
    symlink(stamp.file_name().unwrap(), dir.path().join("..data")).unwrap();
    symlink("..data/routing.yaml", dir.path().join("routing.yaml")).unwrap();
    symlink("..data/notes.txt", dir.path().join("notes.txt")).unwrap();
    let (ok, stdout, stderr) = check(dir.path());
    assert!(ok, "{stderr}");
    assert!(stdout.contains("1 routes"), "{stdout}");
}

#[test]
fn logs_to_a_file_or_pipe_carry_no_colour_codes() {
    // Text logs (not JSON), to a pipe as under Kubernetes: an escape code
    // would wrap every field of every line.
    let out = Command::new(binary())
        .args([
            "serve",
            "--policies",
            "/nonexistent-policy-dir",
            "--admin",
            "off",
        ])
        .env_remove("PORTCULLIS_LOG_FORMAT")
        .env_remove("NO_COLOR")
        .output()
        .expect("run serve");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("ERROR portcullis: invalid policies"),
        "{stderr}"
    );
    assert!(!stderr.contains('\x1b'), "{stderr:?}");
    // Said once, not once as a log line and again plainly.
    assert_eq!(
        stderr.matches("/nonexistent-policy-dir").count(),
        1,
        "{stderr}"
    );
}

#[test]
fn a_fatal_error_shows_even_with_logs_off() {
    let out = Command::new(binary())
        .args(["serve", "--policies", "/nonexistent-policy-dir"])
        .args(["--admin", "off"])
        .env("RUST_LOG", "off")
        .output()
        .expect("run serve");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.starts_with("portcullis: invalid policies")
            && stderr.contains("/nonexistent-policy-dir"),
        "{stderr}"
    );
}

#[test]
fn a_directory_without_policies_is_named_without_a_line() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("notes.txt"), "not a policy").unwrap();
    let (ok, _, stderr) = check(dir.path());
    assert!(!ok);
    let expected = format!(
        "{}: no *.yaml policy files in this directory",
        dir.path().display()
    );
    assert!(stderr.contains(&expected), "{stderr}");
}

#[test]
fn a_listener_that_cannot_bind_is_named_with_its_place_and_the_os_error_once() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("a.yaml"),
        format!(
            "listeners: [{{ name: web, bind: \"127.0.0.1:{port}\" }}]\n\
             upstreams: [{{ name: u, endpoints: [\"http://127.0.0.1:1\"] }}]\n\
             routes: [{{ name: r, match: {{ path: / }}, upstream: u }}]\n"
        ),
    )
    .unwrap();
    let out = Command::new(binary())
        .args(["serve", "--admin", "off", "--policies"])
        .arg(dir.path())
        .env("RUST_LOG", "off")
        .output()
        .expect("run serve");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let place = format!("listener `web` ({}:1:", dir.path().join("a.yaml").display());
    assert!(stderr.contains(&place), "{stderr}");
    assert!(
        stderr.contains(&format!("cannot bind 127.0.0.1:{port}")),
        "{stderr}"
    );
    assert_eq!(stderr.matches("in use").count(), 1, "{stderr}");
}

#[test]
fn check_names_bad_redirects() {
    crate::support::assert_check_errors(
        r#"
routes:
  - { name: a, match: { path: /a }, redirect: { to: "docs.example.com/" } }
  - { name: b, match: { path: /b }, redirect: { to: /x, status: 200 } }
  - { name: c, match: { path: /c }, redirect: { to: "/{rest}" } }
  - { name: d, match: { path: /d }, redirect: { to: /x }, upstream: nowhere }
"#,
        &[
            (3, "must be an http(s) URL or a path starting with `/`"),
            (4, "must be 301, 302, 303, 307 or 308"),
            (
                5,
                "redirect uses `{rest}` but path `/c` does not capture it",
            ),
            (
                6,
                "exactly one of `upstream`, `url`, `respond`, `redirect` or `health`",
            ),
        ],
    );
}

#[test]
fn check_names_bad_dns_settings() {
    let yaml = r#"
upstreams:
  - { name: a, endpoints: ["http://pods:9"], dns: every_address }
  - { name: b, endpoints: ["http://pods:9"], dns_refresh: 5s }
  - { name: c, url: "http://{name}.svc:9", dns: each_address }
  - { name: d, endpoints: ["http://pods:9"], dns: each_address, dns_refresh: 0s }
  - { name: e, endpoints: ["http://pods:9"], dns: each_address, dns_refresh: 1s, eject_after_5xx: 3 }
"#;
    crate::support::assert_check_errors(
        yaml,
        &[
            (3, "dns `every_address`: use connect (the default"),
            (4, "dns_refresh is for `dns: each_address`"),
            (5, "dns: each_address needs `endpoints`"),
            (6, "dns_refresh `0s`: hosts must be looked up again"),
        ],
    );
    // One host may stand for several pods: outlier ejection makes sense.
    let dir = crate::support::policy_dir(yaml, &[]);
    let (_, _, stderr) = crate::support::check(dir.path());
    assert!(!stderr.contains("policy.yaml:7:"), "{stderr}");
}

#[test]
fn check_names_bad_upstream_guards() {
    crate::support::assert_check_errors(
        r#"
upstreams:
  - { name: a, endpoints: ["http://127.0.0.1:9"], retry_on: [500] }
  - { name: b, endpoints: ["http://127.0.0.1:9"], max_requests: 0 }
"#,
        &[
            (
                3,
                "only 502, 503, 504 and reset say the request was not acted on",
            ),
            (4, "max_requests `0` is not a positive number of requests"),
        ],
    );
    crate::support::assert_check_errors(
        r#"
upstreams:
  - { name: a, endpoints: ["http://127.0.0.1:9"], retry_on: [503], per_try_timeout: 1s }
  - { name: b, endpoints: ["http://127.0.0.1:9"], retry_on: [504], per_try_timeout: 0s }
  - { name: c, endpoints: ["http://127.0.0.1:9"], retry_budget: { percent: 20 } }
  - name: d
    endpoints: ["http://127.0.0.1:9"]
    retry_on: [reset]
    retry_budget: { percent: 0, min_concurrent: many }
"#,
        &[
            (3, "per_try_timeout needs 504 in retry_on"),
            (4, "per_try_timeout 0s: leave it out"),
            (5, "this upstream has no retry_on"),
            (9, "retry_budget percent `0` is not a share from 1 to 100"),
            (9, "min_concurrent `many` is not a number of retries"),
        ],
    );
    crate::support::assert_check_errors(
        r#"
upstreams:
  - { name: a, endpoints: ["http://127.0.0.1:9", "http://127.0.0.1:8"], eject_after_5xx: 0 }
  - { name: b, endpoints: ["http://127.0.0.1:9"], eject_after_5xx: 5 }
  - { name: c, endpoints: ["http://127.0.0.1:9", "http://127.0.0.1:8"], eject_after_5xx: 5, eject_for: 0s }
"#,
        &[
            (
                3,
                "eject_after_5xx `0` is not a count of answers from 1 to 1000",
            ),
            (4, "eject_after_5xx needs two endpoints or more"),
            (
                5,
                "eject_after_5xx with eject_for 0s never takes an endpoint out",
            ),
        ],
    );
    crate::support::assert_check_errors(
        r#"
upstreams:
  - { name: a, endpoints: ["http://127.0.0.1:9"], hash_on: client }
  - { name: b, endpoints: ["http://127.0.0.1:9"], balance: hash, hash_on: "session" }
  - { name: c, endpoints: ["http://127.0.0.1:9"], balance: hash, hash_on: "header:bad name" }
  - { name: d, endpoints: ["http://127.0.0.1:9"], balance: sticky }
  - { name: e, endpoints: ["http://127.0.0.1:9"], balance: hash, hash_cookie_ttl: 1h }
  - { name: f, endpoints: ["http://127.0.0.1:9"], balance: hash, hash_on: "cookie:a b" }
"#,
        &[
            (7, "hash_cookie_ttl is for `hash_on: cookie:NAME`"),
            (8, "use client, header:NAME or cookie:NAME"),
            (3, "hash_on is for `balance: hash`"),
            (
                4,
                "hash_on `session`: use client, header:NAME or cookie:NAME",
            ),
            (5, "`bad name` is not a header name"),
            (6, "use round_robin, least_requests or hash"),
        ],
    );
    crate::support::assert_check_errors(
        r#"
upstreams:
  - { name: a, endpoints: ["http://127.0.0.1:9 weight=0"] }
  - { name: b, endpoints: ["http://127.0.0.1:9 heavy"] }
"#,
        &[
            (
                3,
                "`weight=0` after the URL: only weight=N, N from 1 to 100",
            ),
            (4, "`heavy` after the URL"),
        ],
    );
    crate::support::assert_check_errors(
        r#"
upstreams:
  - { name: a, endpoints: ["http://127.0.0.1:9"], max_requests_per_connection: -1 }
  - { name: b, endpoints: ["http://127.0.0.1:9"], timeouts: { lifetime: forever } }
"#,
        &[
            (
                3,
                "max_requests_per_connection `-1` is not a number of requests",
            ),
            (4, "forever"),
        ],
    );
}

/// Values are read as written (see routing's numbers test), and switches
/// take every spelling YAML has for true and false, as they did when YAML
/// turned them into booleans first; anything else is named.
#[test]
fn switches_take_yamls_spellings_of_true_and_false() {
    let policy = |switch: &str| {
        format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0", request_id: on }}]
upstreams: [{{ name: app, endpoints: ["http://127.0.0.1:9"], http2: no }}]
routes:
  - {{ name: r, match: {{ path: /r }}, upstream: app, websocket: {switch}, access_log: Off }}
"#
        )
    };
    for spelling in [
        "true", "True", "TRUE", "yes", "Yes", "on", "y", "false", "No", "OFF", "n",
    ] {
        let dir = crate::support::policy_dir(&policy(spelling), &[]);
        let (ok, _, stderr) = crate::support::check(dir.path());
        assert!(ok, "{spelling}: {stderr}");
    }
    crate::support::assert_check_errors(
        &policy("maybe"),
        &[(5, "`maybe` is not a boolean; write true or false")],
    );
}

/// A value substituted from `${VAR}` (a secret, maybe) into a field that
/// fails validation, or into a plugin config the plugin refuses, is named
/// by its variable in the error, never shown.
#[test]
fn a_secret_from_the_environment_never_appears_in_an_error() {
    let secret = "Sup3r-S3cret-Value-0451";
    let yaml = r#"
listeners: [{ name: http, bind: "127.0.0.1:0" }]
plugins: [{ name: sig, path: "builtin:webhook-signature" }]
routes:
  - name: limited
    match: { path_prefix: /limited }
    respond: { status: 200 }
    max_request_body: "${WEBHOOK_SECRET}"
  - name: hooks
    match: { path_prefix: /hooks }
    respond: { status: 200 }
    plugins: [{ use: sig, config: { provider: "${WEBHOOK_SECRET}", secret: "${WEBHOOK_SECRET}" } }]
"#;
    let dir = crate::support::policy_dir(yaml, &[]);
    let out = Command::new(binary())
        .args(["check", "--policies"])
        .arg(dir.path())
        .env("WEBHOOK_SECRET", secret)
        .output()
        .expect("run portcullis");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(!stderr.contains(secret), "{stderr}");
    assert!(!stderr.contains("S3cret"), "{stderr}");
    for line in [8, 12] {
        let error = stderr
            .lines()
            .find(|l| l.contains(&format!("policy.yaml:{line}:")))
            .unwrap_or_else(|| panic!("no error on line {line}: {stderr}"));
        assert!(error.contains("${WEBHOOK_SECRET}"), "{error}");
    }
}
