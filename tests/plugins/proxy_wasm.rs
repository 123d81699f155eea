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
            .header("x-read-request-late", "1")
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
        // The request head as forwarded, read in the response phase (the
        // head the upstream got is the one kept for it, not a copy made
        // before the proxy's own fields were set). Not Envoy's behaviour:
        // it refuses this read (see the filter), a filter failing on it.
        assert_eq!(a.header("x-pw-request-saw"), Some("blue - http"));
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
pub(super) struct Seen {
    pub(super) status: u16,
    pub(super) upstream: Vec<(String, Option<String>)>,
    response: Vec<(String, Option<String>)>,
    pub(super) body: Option<String>,
}

/// The same request through `addr` (Envoy or Portcullis), reduced to
/// what the filter decides.
async fn seen_through(addr: std::net::SocketAddr, path: &str, headers: &[(&str, &str)]) -> Seen {
    let mut req = Request::get(format!("http://{addr}{path}"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let a = client::send(&client::http1(), req.body(body(Bytes::new())).unwrap()).await;
    let upstream = ["x-pw-tag", "x-pw-saw", "x-pw-added", "x-remove-me"];
    seen(
        a,
        &upstream,
        &["x-pw-status", "x-denied-by", "content-type"],
    )
}

/// `a` reduced to what a filter decides: the `upstream` headers the echo
/// upstream got, the `response` headers the client got, and a body the
/// filter made.
fn seen(a: Answer, upstream: &[&str], response: &[&str]) -> Seen {
    let json: Option<serde_json::Value> = serde_json::from_slice(&a.body).ok();
    let upstream = upstream
        .iter()
        .map(|h| {
            let v = json
                .as_ref()
                .and_then(|j| j["headers"][*h].as_str().map(str::to_owned));
            (h.to_string(), v)
        })
        .collect();
    let response = response
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

/// An authorization service: `GET /check` with `authorization: Bearer
/// good` is 200 naming the user (and a body), anything else 403.
async fn authz() -> Upstream {
    upstream::serve(|req| async move {
        let good = req.uri().path() == "/check"
            && req.method() == hyper::Method::GET
            && req
                .headers()
                .get("authorization")
                .is_some_and(|v| v == "Bearer good");
        let mut resp = Response::new(upstream::full(if good { "ok-body" } else { "" }));
        if good {
            resp.headers_mut()
                .insert("x-user", HeaderValue::from_static("alice"));
        } else {
            *resp.status_mut() = hyper::StatusCode::FORBIDDEN;
        }
        resp
    })
    .await
}

fn auth_policy(app: &str, authz: &str) -> String {
    format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: app, endpoints: ["{app}"] }}
  - {{ name: authz, endpoints: ["{authz}"] }}
  - {{ name: down, endpoints: ["http://127.0.0.1:{down}"] }}
plugins: [{{ name: auth, path: proxy-wasm-auth.wasm }}]
routes:
  - {{ name: guarded, match: {{ path: /guarded }}, upstream: app, plugins: [{{ use: auth, config: authz }}] }}
  - {{ name: misnamed, match: {{ path: /misnamed }}, upstream: app, plugins: [{{ use: auth, config: nope }}] }}
  - {{ name: unreachable, match: {{ path: /unreachable }}, upstream: app, plugins: [{{ use: auth, config: down }}] }}
"#,
        down = crate::support::closed_port()
    )
}

#[tokio::test]
pub(super) async fn an_auth_filter_calls_an_upstream_and_decides_from_its_answer() {
    let app = upstream::echo("app").await;
    let authz = authz().await;
    let dir = policy_dir(&auth_policy(&app.url(), &authz.url()), &["proxy-wasm-auth"]);
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let http = client::http1();
    let get = |path: &str, token: Option<&str>| {
        let mut req = Request::get(proxy.url(path));
        if let Some(token) = token {
            req = req.header("authorization", token);
        }
        client::send(&http, req.body(body(Bytes::new())).unwrap())
    };
    // Allowed: on to the upstream with what the answer said.
    let a = get("/guarded", Some("Bearer good")).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(a.json()["headers"]["x-user"], "alice");
    assert_eq!(a.json()["headers"]["x-auth-body"], "ok-body");
    // Refused: the filter's 401, with the status it got.
    let a = get("/guarded", Some("Bearer bad")).await;
    assert_eq!(a.status, 401);
    assert_eq!(a.header("x-auth-status"), Some("403"));
    assert_eq!(a.body, "unauthorized\n");
    // An upstream the policies do not have: the call is refused at once
    // (Envoy's BadArgument), and the filter says so.
    let a = get("/misnamed", Some("Bearer good")).await;
    assert_eq!(a.status, 500);
    assert_eq!(a.header("x-dispatch-error"), Some("BadArgument"));
    // An upstream that cannot be reached: the filter gets Envoy's 503.
    let a = get("/unreachable", Some("Bearer good")).await;
    assert_eq!(a.status, 401);
    assert_eq!(a.header("x-auth-status"), Some("503"));
    // The callouts count in the auth service's upstream metrics.
    proxy
        .metrics_showing(&[
            r#"portcullis_upstream_responses_total{upstream="authz",code="200"} 1"#.into(),
            r#"portcullis_upstream_responses_total{upstream="authz",code="403"} 1"#.into(),
            r#"portcullis_upstream_errors_total{upstream="down",reason="connect"} 1"#.into(),
        ])
        .await;
}

/// The auth filter's callouts, through Envoy and through Portcullis:
/// allowed, refused, an unknown cluster, one that does not answer.
#[tokio::test]
pub(super) async fn an_auth_filter_calls_out_as_in_envoy() {
    let app = upstream::echo("app").await;
    let authz = authz().await;
    let down: std::net::SocketAddr = format!("127.0.0.1:{}", crate::support::closed_port())
        .parse()
        .unwrap();
    let filter = plugin_file("proxy-wasm-auth");
    let dir = policy_dir(&auth_policy(&app.url(), &authz.url()), &["proxy-wasm-auth"]);
    let proxy = Proxy::start_dir(dir, &[]).await;
    let clusters = [("app", app.addr), ("authz", authz.addr), ("down", down)];
    for (config, path) in [
        ("authz", "/guarded"),
        ("nope", "/misnamed"),
        ("down", "/unreachable"),
    ] {
        let envoy = crate::support::envoy::Envoy::with_clusters(&filter, config, &clusters).await;
        for token in ["Bearer good", "Bearer bad"] {
            let reference = auth_seen(envoy.addr, path, token).await;
            let ours = auth_seen(proxy.addr, path, token).await;
            assert_eq!(ours, reference, "{config} {token}");
        }
    }
}

/// What the auth filter decided for one request through `addr`.
async fn auth_seen(addr: std::net::SocketAddr, path: &str, token: &str) -> Seen {
    let req = Request::get(format!("http://{addr}{path}"))
        .header("authorization", token)
        .body(body(Bytes::new()))
        .unwrap();
    let a = client::send(&client::http1(), req).await;
    let response = ["x-auth-status", "x-dispatch-error", "content-type"];
    seen(a, &["x-user", "x-auth-body"], &response)
}

#[tokio::test]
pub(super) async fn filters_share_data_and_queues_tick_and_export_metrics() {
    let app = upstream::echo("app").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: counter, path: proxy-wasm-shared.wasm }}]
routes: [{{ name: counted, match: {{ path_prefix: /c }}, upstream: app, plugins: [{{ use: counter }}] }}]
"#,
            app.url()
        ),
        &["proxy-wasm-shared"],
    );
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    // Connections of their own, so requests land on every worker's VM;
    // the shared count is one across them, each request counted once.
    let mut seen = Vec::new();
    for i in 0..6 {
        let mut conn = client::Connection::open(proxy.addr).await;
        let req = Request::get(proxy.url(&format!("/c/{}", "x".repeat(i))))
            .body(body(Bytes::new()))
            .unwrap();
        let a = conn.send(req).await;
        assert_eq!(a.status, 200, "{:?}", a.body);
        let n: u64 = a.json()["headers"]["x-shared-count"]
            .as_str()
            .unwrap()
            .parse()
            .unwrap();
        seen.push(n);
    }
    assert_eq!(seen, vec![1, 2, 3, 4, 5, 6]);
    proxy
        .metrics_showing(&[
            r#"portcullis_plugin_counter_total{plugin="counter",name="requests"} 6"#.into(),
            // The last path: /c/xxxxx.
            r#"portcullis_plugin_gauge{plugin="counter",name="last_path_len"} 8"#.into(),
            // A histogram of the path lengths (3 to 8).
            r#"portcullis_plugin_histogram_bucket{plugin="counter",name="path_len",le="5"} 3"#
                .into(),
            r#"portcullis_plugin_histogram_bucket{plugin="counter",name="path_len",le="10"} 6"#
                .into(),
            r#"portcullis_plugin_histogram_sum{plugin="counter",name="path_len"} 33"#.into(),
            r#"portcullis_plugin_histogram_count{plugin="counter",name="path_len"} 6"#.into(),
            // Every path went through the shared queue to its owner.
            r#"portcullis_plugin_counter_total{plugin="counter",name="dequeued"} 6"#.into(),
            // Its VMs tick (every 10 ms) once started.
            r#"portcullis_plugin_gauge{plugin="counter",name="ticking"} 1"#.into(),
        ])
        .await;
    // The ticks go on, counted in shared data, which requests read.
    let ticks = |text: &str| plugin_counter(text, "counter", "ticks");
    let first = ticks(&proxy.metrics_showing(&[]).await);
    let deadline = Instant::now() + Duration::from_secs(10);
    // Two ticks on: the first of them has added to shared data by then.
    while ticks(&proxy.metrics_showing(&[]).await) < first + 2 {
        assert!(Instant::now() < deadline, "no tick after {first}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let a = client::get(&proxy.url("/c/t")).await;
    let shared: u64 = a.json()["headers"]["x-shared-ticks"]
        .as_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(
        shared > first,
        "{shared} ticks in shared data, {first} counted before"
    );
}

/// Plugin `plugin`'s counter `name` in the `/metrics` text `text` (0
/// while it is not there).
pub(super) fn plugin_counter(text: &str, plugin: &str, name: &str) -> u64 {
    let prefix = format!(r#"portcullis_plugin_counter_total{{plugin="{plugin}",name="{name}"}} "#);
    let at = text.lines().find_map(|l| l.strip_prefix(&prefix));
    at.map_or(0, |n| n.parse().unwrap())
}

/// A filter importing calls this host does not offer (one outside the
/// proxy-wasm ABI and WASI, one of ABI 0.1.0's) is refused at load,
/// naming each: it never learns on a request.
#[test]
pub(super) fn imports_the_host_lacks_are_refused_by_name() {
    // A core module exporting the ABI version and importing these from
    // `env`: sections by hand (type, import, function, export, code).
    let fields: [&[u8]; 2] = [b"not_in_the_abi", b"proxy_get_configuration"];
    let mut wasm = b"\0asm\x01\0\0\0".to_vec();
    wasm.extend([1, 4, 1, 0x60, 0, 0]);
    let mut import = vec![fields.len() as u8];
    for field in fields {
        import.extend([3, b'e', b'n', b'v', field.len() as u8]);
        import.extend(field);
        import.extend([0, 0]);
    }
    wasm.extend([2, import.len() as u8]);
    wasm.extend(import);
    wasm.extend([3, 2, 1, 0]);
    let name = b"proxy_abi_version_0_2_1";
    let mut export = vec![1, name.len() as u8];
    export.extend(name);
    export.extend([0, fields.len() as u8]);
    wasm.extend([7, export.len() as u8]);
    wasm.extend(export);
    wasm.extend([10, 4, 1, 2, 0, 0x0b]);
    let dir = policy_dir(
        r#"
plugins: [{ name: odd, path: odd.wasm }]
routes: [{ name: r, match: { path: /r }, respond: { status: 204 }, plugins: [{ use: odd }] }]
"#,
        &[],
    );
    std::fs::write(dir.path().join("odd.wasm"), wasm).unwrap();
    let (ok, _, stderr) = crate::support::check(dir.path());
    assert!(!ok);
    let named = "it imports `env::not_in_the_abi`, `env::proxy_get_configuration` which this proxy-wasm host does not offer";
    assert!(
        stderr.contains("plugin `odd` on route `r`") && stderr.contains(named),
        "{stderr}"
    );
}

/// A POST of `payload` through `addr`, with `x-inspect: inspect`.
pub(super) async fn body_seen(
    addr: std::net::SocketAddr,
    payload: impl Into<Bytes>,
    inspect: Option<&str>,
) -> Seen {
    let mut req = Request::post(format!("http://{addr}/b"));
    if let Some(inspect) = inspect {
        req = req.header("x-inspect", inspect);
    }
    let a = client::send(&client::http1(), req.body(body(payload.into())).unwrap()).await;
    let json: Option<serde_json::Value> = serde_json::from_slice(&a.body).ok();
    let mut seen = seen(a, &["x-body-seen"], &["content-type"]);
    // The body the upstream got, by its length.
    let len = json.map(|j| j["body_len"].to_string());
    seen.upstream.push(("body_len".into(), len));
    seen
}

#[tokio::test]
pub(super) async fn a_body_filter_reads_and_rewrites_the_request_body() {
    let app = upstream::echo("app").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: inspect, path: proxy-wasm-body.wasm }}]
routes: [{{ name: b, match: {{ path: /b }}, upstream: app, plugins: [{{ use: inspect }}] }}]
"#,
            app.url()
        ),
        &["proxy-wasm-body"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;
    let upstream = |s: &Seen| (s.upstream[0].1.clone(), s.upstream[1].1.clone());
    // Inspected: the upstream gets the rewritten body, and its length.
    let a = body_seen(proxy.addr, "hello", Some("1")).await;
    assert_eq!(a.status, 200);
    assert_eq!(
        upstream(&a),
        (Some("5".into()), Some("15".into())),
        "hello (checked)"
    );
    // Refused from the body: the filter's answer, the upstream not asked.
    let a = body_seen(proxy.addr, "this is forbidden", Some("1")).await;
    assert_eq!(
        (a.status, a.body.as_deref()),
        (403, Some("forbidden body\n"))
    );
    // Not inspected (the headers went on): the body passes untouched.
    let a = body_seen(proxy.addr, "forbidden or not", None).await;
    assert_eq!(upstream(&a), (None, Some("16".into())));
    // No body: the headers ended the request, nothing is paused.
    let a = body_seen(proxy.addr, "", Some("1")).await;
    assert_eq!((a.status, upstream(&a).1), (200, Some("0".into())));
}

/// The benchmark's filter (bench/plugins.sh) decides as in Envoy: a
/// request with the configured header goes on, one without is 401.
#[tokio::test]
pub(super) async fn the_benchmark_filter_behaves_as_in_envoy() {
    let app = upstream::echo("app").await;
    let filter = plugin_file("proxy-wasm-require");
    let envoy = crate::support::envoy::Envoy::with_filter(&filter, "authorization", app.addr).await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: pw, path: proxy-wasm-require.wasm }}]
routes: [{{ name: pw, match: {{ path: /pw }}, upstream: app, plugins: [{{ use: pw, config: authorization }}] }}]
"#,
            app.url()
        ),
        &["proxy-wasm-require"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;
    let with: &[(&str, &str)] = &[("authorization", "Bearer x")];
    for headers in [with, &[], &[("x-api-key", "k")]] {
        let reference = seen_through(envoy.addr, "/pw", headers).await;
        let ours = seen_through(proxy.addr, "/pw", headers).await;
        assert_eq!(ours, reference, "{headers:?}");
        let expected = if headers == with { 200 } else { 401 };
        assert_eq!(ours.status, expected, "{headers:?}");
    }
}

/// A policy directory with the headers filter (config `t`) on every path
/// of a route to `app`, as the Envoy of [`crate::support::envoy::Envoy::with_filter`]
/// given the same filter and config has it.
pub(super) fn headers_filter_everywhere(app: &Upstream) -> tempfile::TempDir {
    policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: pw, path: proxy-wasm-headers.wasm }}]
routes: [{{ name: r, match: {{ path_prefix: / }}, upstream: app, plugins: [{{ use: pw, config: t }}] }}]
"#,
            app.url()
        ),
        &["proxy-wasm-headers"],
    )
}
