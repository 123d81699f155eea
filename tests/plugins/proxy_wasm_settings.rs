//! What the policies give an Envoy proxy-wasm filter besides `config`:
//! its root id and VM configuration, as Envoy's `root_id` and
//! `vm_config.configuration`.

use super::*;

/// The headers filter behind `routes` (which name it `pw`, upstream
/// `app`), with `env` for the proxy: the upstream must outlive it.
async fn headers_filter_on(routes: &str, env: &[(&str, String)]) -> (Proxy, upstream::Upstream) {
    let app = upstream::echo("app").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: pw, path: proxy-wasm-headers.wasm }}]
routes:
{routes}"#,
            app.url()
        ),
        &["proxy-wasm-headers"],
    );
    (Proxy::start_dir(dir, env).await, app)
}

/// What the headers filter on `path` told the upstream: its root id, its
/// VM configuration and its configuration.
async fn filter_saw(proxy: &Proxy, path: &str) -> (Option<String>, Option<String>, Option<String>) {
    let headers = client::get(&proxy.url(path)).await.json()["headers"].clone();
    let get = |h: &str| headers[h].as_str().map(str::to_owned);
    (get("x-pw-root"), get("x-pw-vm"), get("x-pw-tag"))
}

#[tokio::test]
pub(super) async fn a_filter_gets_its_root_id_and_vm_configuration() {
    let (proxy, _app) = headers_filter_on(
        r#"
  - name: set
    match: { path: /set }
    upstream: app
    plugins: [{ use: pw, config: blue, root_id: main, vm_config: { shards: 2 } }]
  - { name: text, match: { path: /text }, upstream: app, plugins: [{ use: pw, config: blue, vm_config: "as text" }] }
  - { name: unset, match: { path: /unset }, upstream: app, plugins: [{ use: pw, config: blue }] }
  - name: order
    match: { path: /order }
    upstream: app
    plugins: [{ use: pw, config: { zeta: 1, alpha: { b: 2, a: 3 } }, vm_config: { zeta: 1, alpha: { b: 2, a: 3 } } }]
"#,
        &[],
    )
    .await;
    let seen = |path: &'static str| filter_saw(&proxy, path);
    // A mapping reaches the filter as JSON, a string as its text.
    let blue = Some("blue".to_owned());
    assert_eq!(
        seen("/set").await,
        (
            Some("main".into()),
            Some(r#"{"shards":2}"#.into()),
            blue.clone()
        )
    );
    assert_eq!(
        seen("/text").await,
        (None, Some("as text".into()), blue.clone())
    );
    assert_eq!(seen("/unset").await, (None, None, blue));
    // Keys arrive in the order written, as Envoy hands a filter its
    // configuration: a filter may resolve rules in declaration order.
    let written = r#"{"zeta":1,"alpha":{"b":2,"a":3}}"#.to_owned();
    assert_eq!(
        seen("/order").await,
        (None, Some(written.clone()), Some(written))
    );
}

/// `root_id` and `vm_config` mean nothing to a component: `check` says
/// so, naming the plugin and where it is used.
#[test]
pub(super) fn a_component_refuses_root_id_and_vm_config() {
    let dir = policy_dir(
        r#"
plugins: [{ name: key, path: example-require-header.wasm }]
routes: [{ name: r, match: { path: /r }, respond: { status: 204 }, plugins: [{ use: key, root_id: main }] }]
"#,
        &["example-require-header"],
    );
    let (ok, _, stderr) = crate::support::check(dir.path());
    assert!(!ok);
    assert!(
        stderr.contains("plugin `key` on route `r`")
            && stderr.contains("`root_id` and `vm_config`"),
        "{stderr}"
    );
}

/// A filter whose root context fetches what it checks from a service
/// (from a tick, outside any request) gets the answer, in Portcullis as
/// in Envoy: requests soon carry what it fetched.
#[tokio::test]
pub(super) async fn a_root_context_calls_out_from_a_tick_as_in_envoy() {
    let app = upstream::echo("app").await;
    let keys = upstream::serve(|req| async move {
        let found = req.uri().path() == "/keys";
        let mut resp = Response::new(upstream::full(if found { "k1" } else { "" }));
        if !found {
            *resp.status_mut() = hyper::StatusCode::NOT_FOUND;
        }
        resp
    })
    .await;
    let filter = plugin_file("proxy-wasm-keys");
    let clusters = [("app", app.addr), ("keys", keys.addr)];
    let envoy = crate::support::envoy::Envoy::with_clusters(&filter, "", &clusters).await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}, {{ name: keys, endpoints: ["{}"] }}]
plugins: [{{ name: keyed, path: proxy-wasm-keys.wasm }}]
routes: [{{ name: k, match: {{ path_prefix: / }}, upstream: app, plugins: [{{ use: keyed }}] }}]
"#,
            app.url(),
            keys.url()
        ),
        &["proxy-wasm-keys"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;
    for addr in [envoy.addr, proxy.addr] {
        // One connection: its requests stay on one worker's VM, whose
        // first request starts it (and its ticks).
        let mut conn = client::Connection::open(addr).await;
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let req = Request::get(format!("http://{addr}/r"))
                .body(body(Bytes::new()))
                .unwrap();
            let a = conn.send(req).await;
            let got = a.json()["headers"]["x-keys"].as_str().map(str::to_owned);
            if got.as_deref() == Some("k1") {
                break;
            }
            assert_eq!(got.as_deref(), Some("none"), "{addr}");
            assert!(Instant::now() < deadline, "{addr}: never got the keys");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A filter that calls out and goes on (an audit record) sends the call
/// without the request waiting for it, in Envoy and here: the audit
/// upstream never answers, and the request is answered all the same.
#[tokio::test]
pub(super) async fn a_call_a_filter_does_not_wait_for_is_sent_as_in_envoy() {
    let app = upstream::echo("app").await;
    let (sent, mut audited) = tokio::sync::mpsc::unbounded_channel::<String>();
    let audit = upstream::serve(move |req: Request<hyper::body::Incoming>| {
        let sent = sent.clone();
        async move {
            use http_body_util::BodyExt;
            let line = format!("{} {}", req.method(), req.uri().path());
            let body = req.into_body().collect().await.unwrap().to_bytes();
            let _ = sent.send(format!("{line} {}", String::from_utf8_lossy(&body)));
            std::future::pending().await
        }
    })
    .await;
    let filter = plugin_file("proxy-wasm-headers");
    let clusters = [("app", app.addr), ("audit", audit.addr)];
    let envoy = crate::support::envoy::Envoy::with_clusters(&filter, "t", &clusters).await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}, {{ name: audit, endpoints: ["{}"] }}]
plugins: [{{ name: pw, path: proxy-wasm-headers.wasm }}]
routes: [{{ name: a, match: {{ path_prefix: / }}, upstream: app, plugins: [{{ use: pw, config: t }}] }}]
"#,
            app.url(),
            audit.url()
        ),
        &["proxy-wasm-headers"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;
    for addr in [envoy.addr, proxy.addr] {
        let req = Request::get(format!("http://{addr}/orders?id=7"))
            .header("x-audit", "audit")
            .body(body(Bytes::new()))
            .unwrap();
        let a = client::send(&client::http1(), req).await;
        assert_eq!(a.status, 200, "{addr}: {:?}", a.body);
        assert_eq!(a.json()["headers"]["x-pw-audit"], "sent", "{addr}");
        let got = tokio::time::timeout(Duration::from_secs(10), audited.recv()).await;
        assert_eq!(
            got.expect("the audit call arrives").as_deref(),
            Some("POST /audit /orders?id=7"),
            "{addr}"
        );
    }
}

/// What a filter keeps of a request with `proxy_set_property` is its
/// request's alone (read back on its response, by `proxy_get_property`),
/// and gone with it.
#[tokio::test]
pub(super) async fn a_filter_keeps_state_for_its_request_alone() {
    let app = upstream::echo("app").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: pw, path: proxy-wasm-misbehave.wasm }}]
routes: [{{ name: app, match: {{ path: /app }}, upstream: app, plugins: [{{ use: pw }}] }}]
"#,
            app.url()
        ),
        &["proxy-wasm-misbehave"],
    );
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    // One connection: one worker, one VM, contexts one after another.
    let mut conn = client::Connection::open(proxy.addr).await;
    for state in ["first", "second"] {
        let req = Request::get(proxy.url("/app"))
            .header("x-state", state)
            .body(body(Bytes::new()))
            .unwrap();
        let answer = conn.send(req).await;
        assert_eq!(answer.header("x-state-seen"), Some(state));
    }
    let req = Request::get(proxy.url("/app"))
        .body(body(Bytes::new()))
        .unwrap();
    assert_eq!(conn.send(req).await.header("x-state-seen"), None);
}

/// A filter that runs out of its deadline on a request is logged naming
/// the call and the setting to raise.
#[tokio::test]
pub(super) async fn a_filters_deadline_error_names_the_call_and_the_setting() {
    let app = upstream::echo("app").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: spin, path: proxy-wasm-misbehave.wasm }}]
routes: [{{ name: app, match: {{ path: /app }}, upstream: app, plugins: [{{ use: spin, timeout: 20ms }}] }}]
"#,
            app.url()
        ),
        &["proxy-wasm-misbehave"],
    );
    let mut proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let req = Request::get(proxy.url("/app"))
        .header("x-misbehave", "loop")
        .body(body(Bytes::new()))
        .unwrap();
    assert_eq!(client::send(&client::http1(), req).await.status, 503);
    proxy
        .wait_for_log("timed out after 20ms in proxy_on_request_headers (the use's `timeout`)")
        .await;
}

/// Every worker's VM (and a component's first instance a worker) is
/// started before the policies take traffic, at the start and at each
/// reload: no request waits for a start (a Go filter's takes ~200 ms of
/// CPU). `/status` shows the instances ready.
#[tokio::test]
pub(super) async fn vms_and_instances_start_before_the_policies_take_traffic() {
    let app = upstream::echo("app").await;
    let policy = |tag: &str| {
        format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins:
  - {{ name: pw, path: proxy-wasm-headers.wasm }}
  - {{ name: component, path: fixture-forward.wasm }}
routes:
  - {{ name: filter, match: {{ path: /filter }}, upstream: app, plugins: [{{ use: pw, config: {tag} }}] }}
  - {{ name: component, match: {{ path: /component }}, upstream: app, plugins: [{{ use: component }}] }}
"#,
            app.url()
        )
    };
    let dir = policy_dir(&policy("blue"), &["proxy-wasm-headers", "fixture-forward"]);
    let proxy = ProxyProcess::start_on(dir.path(), &["--workers", "3"]).await;
    let ready = |status: &serde_json::Value, route: &str| {
        Some(super::proxy_wasm_isolation::uses_ready(status, route))
    };
    let status = proxy.status().await;
    assert_eq!(ready(&status, "filter"), Some(3), "{status:#}");
    assert_eq!(ready(&status, "component"), Some(3), "{status:#}");
    // A reload that changes the filter's config: its new use's VMs are
    // all started when the reload reports applied.
    std::fs::write(dir.path().join("policy.yaml"), policy("green")).unwrap();
    let answer = client::call("POST", &proxy.admin_url("/reload")).await;
    assert_eq!(answer.json()["result"], "applied", "{:?}", answer.body);
    let status = proxy.status().await;
    assert_eq!(ready(&status, "filter"), Some(3), "{status:#}");
    let seen = client::get(&proxy.url("/filter")).await.json();
    assert_eq!(seen["headers"]["x-pw-tag"], "green", "{seen:#}");
}

/// A filter's HTTP call may name an upstream as Istio and Higress name a
/// service's cluster, `outbound|PORT||HOST` (Higress's filters name every
/// call so), for any endpoint the upstream has.
#[tokio::test]
pub(super) async fn a_filter_reaches_an_upstream_by_its_outbound_cluster_name() {
    let app = upstream::echo("app").await;
    let called = upstream::echo("called").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}, {{ name: auth, endpoints: ["{}"] }}]
plugins: [{{ name: caller, path: proxy-wasm-misbehave.wasm }}]
routes: [{{ name: app, match: {{ path: /app }}, upstream: app, plugins: [{{ use: caller }}] }}]
"#,
            app.url(),
            called.url()
        ),
        &["proxy-wasm-misbehave"],
    );
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let cluster = format!("outbound|{}||127.0.0.1", called.addr.port());
    for (name, status) in [(cluster.as_str(), "200"), ("auth", "200")] {
        let req = Request::get(proxy.url("/app"))
            .header("x-misbehave", "slow-call")
            .header("x-cluster", name)
            .header("x-call-ms", "5000")
            .body(body(Bytes::new()))
            .unwrap();
        let answer = client::send(&client::http1(), req).await;
        assert_eq!(answer.status, 200, "{name}: {:?}", answer.body);
        assert_eq!(answer.json()["headers"]["x-call-status"], status, "{name}");
    }
    // One that names no upstream's endpoint is refused, as Envoy refuses
    // an unknown cluster (the filter answers 500 with the status).
    let req = Request::get(proxy.url("/app"))
        .header("x-misbehave", "slow-call")
        .header("x-cluster", "outbound|1||nowhere.example")
        .body(body(Bytes::new()))
        .unwrap();
    let answer = client::send(&client::http1(), req).await;
    assert_eq!(answer.header("x-call-error"), Some("BadArgument"));
}

/// A filter's config goes to it as written, as Envoy hands it over:
/// filters write `${...}` and `$1` of their own. A use that wants the
/// proxy's `${ENV}` and `{from_file}` asks with `expand_config: true`.
#[tokio::test]
pub(super) async fn a_filters_config_goes_as_written_unless_the_use_asks() {
    let (proxy, _app) = headers_filter_on(
        r#"
  - name: written
    match: { path: /written }
    upstream: app
    plugins: [{ use: pw, config: "${UNSET_HERE} $1 $$", vm_config: { tag: "${TAG}" } }]
  - name: asked
    match: { path: /asked }
    upstream: app
    plugins: [{ use: pw, config: "${TAG} $$", vm_config: { tag: "${TAG}" }, expand_config: true }]
"#,
        &[("TAG", "green".into())],
    )
    .await;
    let proxy = &proxy;
    let seen = |path: &'static str| async move {
        let (_, vm, tag) = filter_saw(proxy, path).await;
        (tag, vm)
    };
    assert_eq!(
        seen("/written").await,
        (
            Some("${UNSET_HERE} $1 $$".into()),
            Some(r#"{"tag":"${TAG}"}"#.into())
        )
    );
    assert_eq!(
        seen("/asked").await,
        (Some("green $".into()), Some(r#"{"tag":"green"}"#.into()))
    );
}

/// Asked to resolve a filter's config, the proxy reports what it cannot
/// resolve, as it does for a component's.
#[test]
pub(super) fn a_filters_config_that_asks_to_be_expanded_is_checked() {
    let dir = policy_dir(
        r#"
plugins: [{ name: pw, path: proxy-wasm-headers.wasm }]
routes: [{ name: r, match: { path: /r }, respond: { status: 204 }, plugins: [{ use: pw, config: "${UNSET_HERE}", expand_config: true }] }]
"#,
        &["proxy-wasm-headers"],
    );
    let (ok, _, stderr) = crate::support::check(dir.path());
    assert!(!ok);
    assert!(stderr.contains("UNSET_HERE"), "{stderr}");
}
