//! The proxy alone frames messages: a `Content-Length` or
//! `Transfer-Encoding` a policy or a plugin set beside a body of another
//! length used to go on the wire, and a pipelined second request read the
//! rest of the first answer as the start of its own (behind an ingress
//! controller that pools connections to the proxy, one user's bytes in
//! another user's answer).

use super::*;

/// `check` refuses every way a policy could set a framing field: a fixed
/// answer's headers (the reported reproduction: `content-length: 1` with
/// `hello world`), the route's request and response edits, the fields an
/// auth service's answer is copied from, a 1xx fixed answer, and the
/// standard header-rules plugin's edits.
#[test]
fn check_refuses_a_policy_that_sets_a_framing_field() {
    assert_check_errors(
        r#"
listeners: [{ name: http, bind: "127.0.0.1:0" }]
upstreams: [{ name: app, endpoints: ["http://127.0.0.1:9"] }]
routes:
  - name: fixed
    match: { path: /fixed }
    respond: { status: 200, body: "hello world", headers: { content-length: "1" } }
  - name: edits
    match: { path: /edits }
    upstream: app
    request_headers: { set: { transfer-encoding: chunked } }
    response_headers: { add: { Connection: close }, remove: [keep-alive] }
  - name: auth
    match: { path: /auth }
    upstream: app
    auth_request: { upstream: app, path: /check, copy_headers: [x-user, content-length] }
  - name: early
    match: { path: /early }
    respond: { status: 101 }
"#,
        &[
            (
                7,
                "`respond.headers` edits `content-length`, which frames the message",
            ),
            (11, "`request_headers` edits `transfer-encoding`"),
            (12, "`response_headers` edits `connection`"),
            (12, "`response_headers` edits `keep-alive`"),
            (16, "`copy_headers` names `content-length`"),
            (
                19,
                "not an HTTP status code a route can answer with (200-599)",
            ),
        ],
    );
    let dir = policy_dir(
        r#"
listeners: [{ name: http, bind: "127.0.0.1:0" }]
plugins: [{ name: rules, path: "builtin:header-rules" }]
routes:
  - name: ruled
    match: { path: /ruled }
    respond: { status: 200 }
    plugins: [{ use: rules, config: { response: { set: { content-length: "1" } } } }]
"#,
        &[],
    );
    let (ok, _, stderr) = crate::support::check(dir.path());
    assert!(!ok, "{stderr}");
    assert!(
        stderr.contains("policy.yaml:8:") && stderr.contains("`response` edits `content-length`"),
        "{stderr}"
    );
}

/// Plugins of both kinds set `Content-Length: 1` and `Transfer-Encoding:
/// chunked` on an answer, and `Transfer-Encoding`, `Content-Length` and
/// `Connection` on a body-less request: the edits are ignored and
/// counted, the upstream gets none of them, and two answers pipelined on
/// one connection each come whole, framed by the proxy.
#[tokio::test]
async fn a_plugin_cannot_frame_a_message_on_a_shared_connection() {
    let app = upstream::echo("app").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins:
  - {{ name: component, path: fixture-forward.wasm }}
  - {{ name: filter, path: proxy-wasm-misbehave.wasm }}
routes:
  - name: component
    match: {{ path: /component }}
    upstream: app
    plugins:
      - use: component
        config:
          set_request: {{ transfer-encoding: chunked, content-length: "5", connection: close }}
          set_response: {{ content-length: "1", transfer-encoding: chunked }}
  - {{ name: filter, match: {{ path: /filter }}, upstream: app, plugins: [{{ use: filter }}] }}
"#,
            app.url()
        ),
        &["fixture-forward", "proxy-wasm-misbehave"],
    );
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    for (path, extra) in [("/component", ""), ("/filter", "x-misbehave: framing\r\n")] {
        let request = format!("GET {path} HTTP/1.1\r\n{extra}");
        let answers = pipelined(proxy.addr, &[&request, &request]).await;
        assert_eq!(answers.len(), 2, "{path}: {answers:#?}");
        for a in &answers {
            assert_eq!(a.status, 200, "{path}: {a:#?}");
            let seen: serde_json::Value = serde_json::from_slice(&a.body).unwrap_or_else(|e| {
                panic!("{path}: not the upstream's whole answer ({e}): {a:#?}")
            });
            assert_eq!(seen["path"], path);
            let headers = &seen["headers"];
            for field in ["transfer-encoding", "content-length"] {
                assert!(
                    headers.get(field).is_none(),
                    "{path}: {field} went upstream: {seen:#}"
                );
            }
            assert_ne!(headers["connection"], "close", "{path}: {seen:#}");
        }
    }
    let metrics = metrics(&proxy).await;
    for plugin in ["component", "filter"] {
        let refused = plugin_counter(&metrics, plugin, "framing_edits_refused");
        assert!(refused >= 2 * 4, "{plugin}: {refused} refused\n{metrics}");
    }
}

/// A plugin that answers itself cannot frame its answer either: a
/// component's local answer with `Content-Length: 1` and a 11-byte body
/// goes framed by its body, and the next pipelined answer follows whole.
#[tokio::test]
async fn a_plugins_own_answer_is_framed_by_its_body() {
    let dir = policy_dir(
        r#"
listeners: [{ name: http, bind: "127.0.0.1:0" }]
plugins: [{ name: answers, path: fixture-forward.wasm }]
routes:
  - name: answered
    match: { path: /answered }
    respond: { status: 404 }
    plugins:
      - use: answers
        config:
          respond: { status: 200, body: "hello world", headers: { content-length: "1", connection: close } }
"#,
        &["fixture-forward"],
    );
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let request = "GET /answered HTTP/1.1\r\n";
    let answers = pipelined(proxy.addr, &[request, request]).await;
    assert_eq!(answers.len(), 2, "{answers:#?}");
    let first = answers[0].head.to_ascii_lowercase();
    assert!(!first.contains("connection: close"), "{first}");
    for a in answers {
        assert_eq!(
            (a.status, a.body.as_slice()),
            (200, &b"hello world"[..]),
            "{a:#?}"
        );
    }
}
