//! `check` on policy files with mistakes in their structure: every one
//! reported in one run, each at the field at fault, with the mistakes in
//! the values of the rest of the file beside them.

/// Structural mistakes (unknown fields, lists written as maps or strings,
/// missing fields) are all reported by one `check`, each on its line with
/// the field, what was found and what is expected: twelve independent
/// mistakes, twelve errors.
#[test]
fn every_structural_mistake_in_a_file_is_reported_by_one_check() {
    let yaml = r#"listeners:
  - { name: http, bind: "127.0.0.1:8080" }
  - name: other
    bnd: "127.0.0.1:8081"
upstreams:
  - name: app
    endpoints: ["http://127.0.0.1:3000"]
    timeout: 5s
plugins:
  - { name: rules, pth: "builtin:header-rules" }
routes:
  - name: a
    match: { path_prefix: /a }
    upstrem: app
  - name: b
    match: "/b"
    upstream: app
  - match: { path: /c }
    upstream: app
  - name: d
    match: { path_prefx: /d }
    upstream: app
  - name: e
    match: { path: /e }
    upstream: app
    plugins: rules
  - name: f
    match: { path: /f }
    upstream: app
    strip_prefix: [/f]
global_plugins: { use: rules }
tracing:
  upstream: app
  sample: 10
extra: true
"#;
    let (stderr, errors) = failed_check(yaml);
    let at = |line: usize| {
        errors
            .iter()
            .find(|e| e.contains(&format!("policy.yaml:{line}:")))
            .unwrap_or_else(|| panic!("no error on line {line}:\n{stderr}"))
    };
    assert!(
        at(4).contains("unknown field `bnd` (did you mean `bind`?)"),
        "{stderr}"
    );
    assert!(at(8).contains("unknown field `timeout`"), "{stderr}");
    assert!(
        at(10).contains("unknown field `pth` (did you mean `path`?)"),
        "{stderr}"
    );
    assert!(
        at(14).contains("unknown field `upstrem` (did you mean `upstream`?)"),
        "{stderr}"
    );
    assert!(at(16).contains("`match`: expected a map"), "{stderr}");
    assert!(at(18).contains("missing field `name`"), "{stderr}");
    assert!(at(30).contains("expected a value"), "{stderr}");
    assert!(
        at(21).contains("unknown field `path_prefx` (did you mean `path_prefix`?)"),
        "{stderr}"
    );
    assert!(at(26).contains("`plugins`: expected a list"), "{stderr}");
    assert!(at(30).contains("`strip_prefix`"), "{stderr}");
    assert!(
        at(31).contains("`global_plugins`: expected a list"),
        "{stderr}"
    );
    assert!(at(34).contains("unknown field `sample`"), "{stderr}");
    assert!(at(35).contains("unknown field `extra`"), "{stderr}");
    assert_eq!(errors.len(), 12, "one error per mistake:\n{stderr}");
}

/// The mistakes a new user makes, in block and flow style, with a value
/// error beside them: all in one run, each naming its own field and
/// quoting its own value, a missing field at the map that lacks it, and
/// nothing reported that only follows from another error (an upstream
/// left without its `endpoints`, a route naming a plugin whose
/// definition was at fault).
#[test]
fn structural_and_value_mistakes_are_reported_together_each_at_its_field() {
    let yaml = r#"listeners:
  - name: http
    bind: 127.0.0.1:0
upstreams:
  - { name: a, endpoints: "http://127.0.0.1:2", timeouts: { connect: 1s }, bogus: 2 }
  - name: app
    endpoints: ["http://127.0.0.1:9"]
    timeouts: { connect: 5x }
plugins:
  name: rules
  path: builtin:header-rules
routes:
  - name: r1
    match: { path: /a }
    upstream: app
    rate_limit: { burst: 3 }
  - name: r2
    match: { path: /b }
    upstream: a
    plugins: [{ use: rules }]
  - name: r3
    match: { path: /c }
    upstream: nowhere
  - name: r4
    match: { path: /d }
    upstream: app
    rate_limit:
      burst: 3
"#;
    let (stderr, errors) = failed_check(yaml);
    let at = |place: &str| {
        errors
            .iter()
            .find(|e| e.contains(&format!("policy.yaml:{place}:")))
            .unwrap_or_else(|| panic!("no error at {place}:\n{stderr}"))
    };
    // Flow style: the field and its own value, and the sibling after it.
    let endpoints = at("5:27");
    assert!(
        endpoints.contains("`endpoints`: expected a list")
            && endpoints.contains("found the value `http://127.0.0.1:2`"),
        "{stderr}"
    );
    assert!(at("5:76").contains("unknown field `bogus`"), "{stderr}");
    // A value error in the same run as the structural ones.
    assert!(at("8:26").contains("`5x` is not a duration"), "{stderr}");
    // A list written as a block map: the list's field, not its first key.
    assert!(
        at("9:1").contains("`plugins`: expected a list") && at("9:1").contains("found a map"),
        "{stderr}"
    );
    // A missing field at the map that lacks it, flow and block.
    assert!(
        at("16:5").contains("`rate_limit`: missing field `rate`"),
        "{stderr}"
    );
    assert!(
        at("27:5").contains("`rate_limit`: missing field `rate`"),
        "{stderr}"
    );
    // A reference to an unknown name is still reported.
    assert!(
        at("23:15").contains("unknown upstream `nowhere`"),
        "{stderr}"
    );
    assert_eq!(errors.len(), 7, "one error per mistake:\n{stderr}");
}

/// `check`'s stderr on a policy file of `yaml`, which must fail, and its
/// error lines.
fn failed_check(yaml: &str) -> (String, Vec<String>) {
    let dir = crate::support::policy_dir(yaml, &[]);
    let (ok, _, stderr) = crate::support::check(dir.path());
    assert!(!ok, "{stderr}");
    let errors = stderr
        .lines()
        .filter(|l| l.contains("policy.yaml:"))
        .map(str::to_owned)
        .collect();
    (stderr, errors)
}
