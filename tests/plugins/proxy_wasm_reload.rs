//! Reloads and a proxy-wasm filter's VMs: a use stated as before keeps
//! them; a use whose config changed is configured in them (a root context
//! of its own beside the old use's, as Envoy does), unless the filter's
//! configure is too slow to run beside the requests on the old one.

use super::*;

/// How many workers have a VM with the use on `route`.
fn ready(status: &serde_json::Value, route: &str) -> Option<u64> {
    super::proxy_wasm_isolation::use_field(status, route, "instances_ready")
}

/// A reload keeps the plugin uses it states as before, with their VMs and
/// instances (and what they hold: a VM's count of requests goes on), even
/// when routes before them moved; a use whose config changed is a new use
/// (its calls counted from 0) configured in the same VMs. As Envoy keeps
/// a root context whose configuration did not change, and configures a
/// new one in the running VM for one that did.
#[tokio::test]
pub(super) async fn a_reload_keeps_the_plugin_uses_it_leaves_alone() {
    let app = upstream::echo("app").await;
    let policy = |first_route: bool, filter_config: &str| {
        let first = match first_route {
            true => "- { name: added, match: { path: /added }, upstream: app }",
            false => "",
        };
        format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins:
  - {{ name: bad, path: proxy-wasm-misbehave.wasm }}
  - {{ name: component, path: fixture-forward.wasm }}
routes:
  {first}
  - {{ name: filter, match: {{ path: /filter }}, upstream: app, plugins: [{{ use: bad, config: {filter_config} }}] }}
  - {{ name: component, match: {{ path: /component }}, upstream: app, plugins: [{{ use: component }}] }}
"#,
            app.url()
        )
    };
    let dir = policy_dir(
        &policy(false, "{ v: 1 }"),
        &["proxy-wasm-misbehave", "fixture-forward"],
    );
    let proxy = ProxyProcess::start_on(dir.path(), &["--workers", "2"]).await;
    // One connection: its requests stay on one worker, so on one VM.
    let mut conn = client::Connection::open(proxy.addr).await;
    let get = |path: &str| {
        Request::get(proxy.url(path))
            .body(body(Bytes::new()))
            .unwrap()
    };
    for n in 1..=3 {
        let a = conn.send(get("/filter")).await;
        assert_eq!(a.header("x-vm-requests"), Some(n.to_string().as_str()));
        assert_eq!(a.header("x-route-name"), Some("filter"));
    }
    assert_eq!(conn.send(get("/component")).await.status, 200);
    let calls = |status: &serde_json::Value, route: &str| {
        super::proxy_wasm_isolation::use_field(status, route, "calls")
    };
    let reload = |text: String| {
        std::fs::write(dir.path().join("policy.yaml"), text).unwrap();
        async {
            let answer = client::call("POST", &proxy.admin_url("/reload")).await;
            assert_eq!(answer.json()["result"], "applied", "{:?}", answer.body);
        }
    };
    // A route added before both: the uses are stated as before, so kept.
    reload(policy(true, "{ v: 1 }")).await;
    let status = proxy.status().await;
    assert!(
        calls(&status, "component") >= Some(1),
        "kept, with its count: {status:#}"
    );
    assert!(
        calls(&status, "filter") >= Some(3),
        "kept, with its count: {status:#}"
    );
    let a = conn.send(get("/filter")).await;
    assert_eq!(a.header("x-vm-requests"), Some("4"), "the same VM");
    assert_eq!(a.header("x-route-name"), Some("filter"), "its route, moved");
    assert_eq!(conn.send(get("/added")).await.status, 200);
    assert_eq!(a.header("x-config"), Some(r#"{"v":1}"#));
    // The filter's config changed: a new use, configured in the running
    // VMs (all before the reload answered); the component's is kept.
    reload(policy(true, "{ v: 2 }")).await;
    let status = proxy.status().await;
    assert_eq!(calls(&status, "filter"), Some(0), "{status:#}");
    assert_eq!(ready(&status, "filter"), Some(2), "{status:#}");
    assert!(calls(&status, "component") >= Some(1), "{status:#}");
    let a = conn.send(get("/filter")).await;
    assert_eq!(a.header("x-vm-requests"), Some("5"), "the same VM");
    assert_eq!(a.header("x-config"), Some(r#"{"v":2}"#), "the new config");
    assert_eq!(a.header("x-config-now"), Some(r#"{"v":2}"#));
    assert_eq!(a.header("x-route-name"), Some("filter"));
}

/// The misbehave filter on route `filter` with `config` (upstream `app`,
/// and `slow` for its calls).
fn misbehave_policy(app: &Upstream, slow: &Upstream, config: &str) -> String {
    format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}, {{ name: slow, endpoints: ["{}"] }}]
plugins: [{{ name: filter, path: proxy-wasm-misbehave.wasm }}]
routes:
  - {{ name: filter, match: {{ path: /filter }}, upstream: app, plugins: [{{ use: filter, config: {config} }}] }}
"#,
        app.url(),
        slow.url()
    )
}

/// The proxy on one worker (every request on one VM) with the misbehave
/// filter's `config`, and a connection to it.
async fn one_worker(
    app: &Upstream,
    slow: &Upstream,
    config: &str,
) -> (tempfile::TempDir, ProxyProcess, client::Connection) {
    let dir = policy_dir(
        &misbehave_policy(app, slow, config),
        &["proxy-wasm-misbehave"],
    );
    let proxy = ProxyProcess::start_on(dir.path(), &["--workers", "1"]).await;
    let conn = client::Connection::open(proxy.addr).await;
    (dir, proxy, conn)
}

fn get_filter(proxy: &ProxyProcess) -> Request<client::ReqBody> {
    Request::get(proxy.url("/filter"))
        .body(body(Bytes::new()))
        .unwrap()
}

async fn reload_to(proxy: &ProxyProcess, dir: &std::path::Path, policy: String) {
    std::fs::write(dir.join("policy.yaml"), policy).unwrap();
    let answer = client::call("POST", &proxy.admin_url("/reload")).await;
    assert_eq!(answer.json()["result"], "applied", "{:?}", answer.body);
}

/// A request on the old use when its config changes finishes on the old
/// use's root context (its config, what the host gives it), while new
/// requests get the new one's in the same VM; the old root context is
/// ended (`proxy_on_done`) once its last request is.
#[tokio::test]
pub(super) async fn a_changed_config_is_configured_beside_the_old_one_in_the_running_vm() {
    let app = upstream::echo("app").await;
    let (slow, mut arrived, release) = upstream::holding().await;
    let (dir, proxy, mut conn) = one_worker(&app, &slow, "{ v: 1 }").await;
    let get = || get_filter(&proxy);
    let a = conn.send(get()).await;
    assert_eq!(a.header("x-vm-requests"), Some("1"));
    assert_eq!(a.header("x-vm-roots"), Some("1"));
    assert_eq!(a.header("x-config"), Some(r#"{"v":1}"#));
    // A request on the old use, waiting on its call across the reload.
    let held = Request::get(proxy.url("/filter"))
        .header("x-misbehave", "slow-call")
        .header("x-cluster", "slow")
        .header("x-call-ms", "20000")
        .body(body(Bytes::new()))
        .unwrap();
    let held = tokio::spawn(async move { client::send(&client::http1(), held).await });
    arrived
        .recv()
        .await
        .expect("the held request's call arrives");
    reload_to(
        &proxy,
        dir.path(),
        misbehave_policy(&app, &slow, "{ v: 2 }"),
    )
    .await;
    let a = conn.send(get()).await;
    assert_eq!(a.header("x-vm-requests"), Some("2"), "the same VM");
    assert_eq!(
        a.header("x-vm-roots"),
        Some("2"),
        "the old use's root still serves"
    );
    assert_eq!(a.header("x-config"), Some(r#"{"v":2}"#));
    assert_eq!(a.header("x-config-now"), Some(r#"{"v":2}"#));
    release.notify_one();
    let old = held.await.unwrap();
    assert_eq!(old.status, 200, "{:?}", old.body);
    assert_eq!(old.json()["headers"]["x-call-status"], "200");
    assert_eq!(old.header("x-config"), Some(r#"{"v":1}"#), "its own use's");
    assert_eq!(
        old.header("x-config-now"),
        Some(r#"{"v":1}"#),
        "its own use's"
    );
    // The old use goes with its last request (as the request's answer
    // ends, just after the client has it); its root context is ended as
    // the VM's next request ends.
    let mut roots = Vec::new();
    for _ in 0..50 {
        let a = conn.send(get()).await;
        assert_eq!(a.header("x-config"), Some(r#"{"v":2}"#));
        roots.push(a.header("x-vm-roots").unwrap_or_default().to_owned());
        if roots.last().is_some_and(|r| r == "1") {
            return;
        }
    }
    panic!("the old use's root context was never ended: {roots:?}");
}

/// A filter whose configure takes longer than its use's per-request
/// `timeout` is not configured in VMs that requests on the old use are
/// waiting for: its new use gets VMs of its own, as every use did before.
#[tokio::test]
pub(super) async fn a_slow_configure_gets_fresh_vms_instead() {
    let app = upstream::echo("app").await;
    let (slow, _arrived, _release) = upstream::holding().await;
    // 30 ms, against the default `timeout` of 10 ms.
    let config = |v: u32| format!("{{ v: {v}, configure_ms: 30 }}");
    let (dir, proxy, mut conn) = one_worker(&app, &slow, &config(1)).await;
    let get = || get_filter(&proxy);
    assert_eq!(conn.send(get()).await.header("x-vm-requests"), Some("1"));
    assert_eq!(conn.send(get()).await.header("x-vm-requests"), Some("2"));
    reload_to(
        &proxy,
        dir.path(),
        misbehave_policy(&app, &slow, &config(2)),
    )
    .await;
    let a = conn.send(get()).await;
    assert_eq!(a.header("x-vm-requests"), Some("1"), "a fresh VM");
    assert_eq!(a.header("x-vm-roots"), Some("1"));
    assert!(
        a.header("x-config").is_some_and(|c| c.contains(r#""v":2"#)),
        "{a:?}"
    );
}

/// The same as Envoy 1.40: a listener update that changes only the
/// filter's configuration configures it in the running VM (its count of
/// requests goes on), and the new requests get the new configuration.
/// Each proxy runs one worker; the old config's requests and the new
/// one's on one connection each time.
#[tokio::test]
pub(super) async fn a_changed_config_keeps_the_vm_as_in_envoy() {
    let app = upstream::echo("app").await;
    let (slow, _arrived, _release) = upstream::holding().await;
    let filter = plugin_file("proxy-wasm-misbehave");
    let envoy =
        crate::support::envoy::Envoy::with_filter_reloadable(&filter, r#"{"v":1}"#, app.addr).await;
    let (dir, proxy, mut conn) = one_worker(&app, &slow, "{ v: 1 }").await;
    let seen = |a: &client::Answer| {
        (
            a.header("x-vm-requests").map(str::to_owned),
            a.header("x-config").map(str::to_owned),
        )
    };
    let mut ours = Vec::new();
    let mut envoys = Vec::new();
    let get = |url: String| Request::get(url).body(body(Bytes::new())).unwrap();
    let mut at_envoy = client::Connection::open(envoy.addr).await;
    for round in 0..4 {
        if round == 2 {
            let policy = misbehave_policy(&app, &slow, "{ v: 2 }");
            reload_to(&proxy, dir.path(), policy).await;
            envoy.set_configuration(r#"{"v":2}"#).await;
            // Envoy drains the old listener's connections (their requests
            // keep its old config): a new one for each.
            conn = client::Connection::open(proxy.addr).await;
            at_envoy = client::Connection::open(envoy.addr).await;
        }
        ours.push(seen(&conn.send(get_filter(&proxy)).await));
        let to_envoy = get(format!("http://{}/filter", envoy.addr));
        envoys.push(seen(&at_envoy.send(to_envoy).await));
    }
    let config = |v: &str| Some(format!(r#"{{"v":{v}}}"#));
    let expected: Vec<_> = [("1", "1"), ("2", "1"), ("3", "2"), ("4", "2")]
        .iter()
        .map(|(n, v)| (Some(n.to_string()), config(v)))
        .collect();
    assert_eq!(envoys, expected, "Envoy");
    assert_eq!(ours, expected, "Portcullis");
}
