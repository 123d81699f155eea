//! Envoy proxy-wasm filters, built from the public `proxy-wasm` crate
//! (plugins/proxy-wasm), run unchanged in the real proxy.

use super::*;

fn headers_policy(upstream: &str, config: &str) -> String {
    format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{upstream}"] }}]
plugins: [{{ name: pw, path: proxy-wasm-headers.wasm }}]
routes:
  - {{ name: filtered, match: {{ path_prefix: /pw }}, upstream: app, plugins: [{{ use: pw, config: "{config}" }}] }}
  - {{ name: plain, match: {{ path: /plain }}, upstream: app }}
"#
    )
}

#[tokio::test]
pub(super) async fn a_header_filter_edits_requests_and_responses_as_in_envoy() {
    let app = upstream::echo("app").await;
    let dir = policy_dir(&headers_policy(&app.url(), "blue"), &["proxy-wasm-headers"]);
    let proxy = Proxy::start_dir(dir, &[]).await;
    let http = client::http1();
    for _ in 0..3 {
        let req = Request::get(proxy.url("/pw/a?q=1"))
            .header("x-remove-me", "secret")
            .body(body(Bytes::new()))
            .unwrap();
        let a = client::send(&http, req).await;
        assert_eq!(a.status, 200, "{:?}", a.body);
        let seen = &a.json()["headers"];
        // The plugin's configuration (a YAML string) reached on_configure
        // as its text; the pseudo-headers read as Envoy gives them.
        assert_eq!(seen["x-pw-tag"], "blue", "{seen}");
        assert_eq!(seen["x-pw-saw"], "GET /pw/a?q=1", "{seen}");
        assert_eq!(seen["x-pw-added"], "one, two", "{seen}");
        assert!(seen.get("x-remove-me").is_none(), "{seen}");
        // The response as the filter saw it: its status, and its fields
        // with `:status` among them.
        assert_eq!(a.header("x-pw-status"), Some("200"));
        let fields: usize = a.header("x-pw-response-fields").unwrap().parse().unwrap();
        assert!(fields >= 2, "{fields}");
    }
    // A local response: the filter's status, headers and body, and the
    // upstream never asked.
    let req = Request::get(proxy.url("/pw/b"))
        .header("x-deny", "1")
        .body(body(Bytes::new()))
        .unwrap();
    let a = client::send(&http, req).await;
    assert_eq!(a.status, 403);
    assert_eq!(a.header("x-denied-by"), Some("proxy-wasm-headers"));
    assert_eq!(a.body, "denied by the filter\n");
    // Routes without it see nothing of it.
    let a = client::get(&proxy.url("/plain")).await;
    assert!(a.json()["headers"].get("x-pw-tag").is_none());
}

#[test]
pub(super) fn check_reports_a_filter_that_refuses_its_configuration() {
    let dir = policy_dir(
        &headers_policy("http://127.0.0.1:9", "refuse"),
        &["proxy-wasm-headers"],
    );
    let (ok, _, stderr) = crate::support::check(dir.path());
    assert!(!ok);
    assert!(
        stderr.contains("policy.yaml:6:")
            && stderr.contains("plugin `pw` on route `filtered`")
            && stderr.contains("refused its configuration (proxy_on_configure returned false)"),
        "{stderr}"
    );
    // A configuration it takes passes.
    let dir = policy_dir(
        &headers_policy("http://127.0.0.1:9", "green"),
        &["proxy-wasm-headers"],
    );
    let (ok, _, stderr) = crate::support::check(dir.path());
    assert!(ok, "{stderr}");
}

/// One request on `conn` to `path`, with `x-misbehave: how` when given.
async fn misbehave(conn: &mut client::Connection, url: String, how: Option<&str>) -> Answer {
    let mut req = Request::get(url);
    if let Some(how) = how {
        req = req.header("x-misbehave", how);
    }
    conn.send(req.body(body(Bytes::new())).unwrap()).await
}

#[tokio::test]
pub(super) async fn a_filter_that_loops_traps_or_hoards_fails_its_request_and_gets_a_fresh_vm() {
    let app = upstream::echo("app").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: bad, path: proxy-wasm-misbehave.wasm }}]
routes:
  - {{ name: closed, match: {{ path: /closed }}, upstream: app, plugins: [{{ use: bad, timeout: 50ms, memory: 16MiB }}] }}
  - {{ name: open, match: {{ path: /open }}, upstream: app, plugins: [{{ use: bad, timeout: 50ms, fail: open }}] }}
  - {{ name: plain, match: {{ path: /plain }}, upstream: app }}
"#,
            app.url()
        ),
        &["proxy-wasm-misbehave"],
    );
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    // One connection: its requests stay on one worker, so on one VM.
    let mut conn = client::Connection::open(proxy.addr).await;
    let url = |p: &str| proxy.url(p);
    for n in 1..=3 {
        let a = misbehave(&mut conn, url("/closed"), None).await;
        assert_eq!(a.header("x-vm-requests"), Some(n.to_string().as_str()));
    }
    // Each failure fails its own request, closed, by its kind; the next
    // request finds a fresh VM (its count starts again), and a route
    // without the filter never noticed.
    for (how, status, error) in [
        ("loop", 503, "plugin timed out"),
        ("trap", 500, "plugin failed"),
        ("hoard", 500, "plugin ran out of memory"),
    ] {
        let a = misbehave(&mut conn, url("/closed"), Some(how)).await;
        assert_eq!(a.status, status, "{how}: {:?}", a.body);
        assert_eq!(a.json()["error"], error, "{how}");
        assert_eq!(a.json()["plugin"], "bad", "{how}");
        let a = misbehave(&mut conn, url("/closed"), None).await;
        assert_eq!(a.header("x-vm-requests"), Some("1"), "after {how}");
        assert_eq!(client::get(&url("/plain")).await.status, 200);
    }
    // fail: open lets the request through without the filter's word.
    let a = misbehave(&mut conn, url("/open"), Some("trap")).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert!(a.header("x-vm-requests").is_none());
    proxy
        .metrics_showing(&[
            r#"portcullis_plugin_counter_total{plugin="bad",name="vm_restarts"} 4"#.into(),
            r#"portcullis_plugin_counter_total{plugin="bad",name="deadline_hits"} 1"#.into(),
        ])
        .await;
}

#[test]
pub(super) fn a_core_module_that_is_no_filter_is_named_as_such() {
    let dir = policy_dir(
        r#"
plugins: [{ name: empty, path: empty.wasm }]
routes: [{ name: r, match: { path: /r }, respond: { status: 204 }, plugins: [{ use: empty }] }]
"#,
        &[],
    );
    // The smallest valid core module: no exports at all.
    std::fs::write(dir.path().join("empty.wasm"), b"\0asm\x01\0\0\0").unwrap();
    let (ok, _, stderr) = crate::support::check(dir.path());
    assert!(!ok);
    assert!(
        stderr.contains("policy.yaml:2:")
            && stderr.contains("a core WebAssembly module that exports no proxy_abi_version_0_2_1"),
        "{stderr}"
    );
}

/// What a header filter did to one exchange, as seen from outside: what
/// the upstream got of the filter's headers, and what the client got.
#[derive(Debug, PartialEq)]
struct Seen {
    status: u16,
    upstream: Vec<(String, Option<String>)>,
    response: Vec<(String, Option<String>)>,
    body: Option<String>,
}

/// The same request through `addr` (Envoy or Portcullis), reduced to
/// what the filter decides.
async fn seen_through(addr: std::net::SocketAddr, path: &str, headers: &[(&str, &str)]) -> Seen {
    let mut req = Request::get(format!("http://{addr}{path}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let a = client::send(&client::http1(), req.body(body(Bytes::new())).unwrap()).await;
    let json: Option<serde_json::Value> = serde_json::from_slice(&a.body).ok();
    let upstream = ["x-pw-tag", "x-pw-saw", "x-pw-added", "x-remove-me"]
        .iter()
        .map(|h| {
            let v = json
                .as_ref()
                .and_then(|j| j["headers"][*h].as_str().map(str::to_owned));
            (h.to_string(), v)
        })
        .collect();
    let response = ["x-pw-status", "x-denied-by", "content-type"]
        .iter()
        .map(|h| (h.to_string(), a.header(h).map(str::to_owned)))
        .collect();
    Seen {
        status: a.status.as_u16(),
        upstream,
        response,
        // The upstream's echo differs by proxy (each adds its own
        // forwarding headers): only a body the filter made is compared.
        body: json
            .is_none()
            .then(|| String::from_utf8_lossy(&a.body).into_owned()),
    }
}

/// Envoy is the reference: the same filter and requests through Envoy
/// 1.40 and through Portcullis give the same answers.
#[tokio::test]
pub(super) async fn a_header_filter_behaves_as_in_envoy() {
    let app = upstream::echo("app").await;
    let filter = plugin_file("proxy-wasm-headers");
    let envoy = crate::support::envoy::Envoy::with_filter(&filter, "blue", app.addr).await;
    let dir = policy_dir(&headers_policy(&app.url(), "blue"), &["proxy-wasm-headers"]);
    let proxy = Proxy::start_dir(dir, &[]).await;
    let cases: [(&str, &[(&str, &str)]); 5] = [
        ("/pw/a?q=1", &[("x-remove-me", "secret")]),
        ("/pw/b", &[]),
        ("/pw/c", &[("x-deny", "1")]),
        // An error answer with no body goes as the filter made it.
        ("/pw/e", &[("x-deny", "quietly")]),
        ("/pw/d?x=%20y", &[("x-remove-me", "a"), ("x-other", "b")]),
    ];
    for (path, headers) in cases {
        let reference = seen_through(envoy.addr, path, headers).await;
        let ours = seen_through(proxy.addr, path, headers).await;
        assert_eq!(ours, reference, "{path} {headers:?}");
    }
}
