//! Envoy proxy-wasm filters that misbehave: each failure confined to its
//! request and its VM, the VM replaced, and a filter failing without end
//! kept from restarting VMs without end.

use super::*;

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
    // Each failure fails its own request, closed, by its kind; a fresh VM
    // starts off the request path, and the next request finds it (its
    // count starts again); a route without the filter never noticed.
    let ready = vms_ready(&proxy, "closed").await;
    assert_eq!(ready, 2, "a VM a worker, started before any request");
    for (how, status, error) in [
        ("loop", 503, "plugin timed out"),
        ("trap", 500, "plugin failed"),
        ("hoard", 500, "plugin ran out of memory"),
    ] {
        let a = misbehave(&mut conn, url("/closed"), Some(how)).await;
        assert_eq!(a.status, status, "{how}: {:?}", a.body);
        assert_eq!(a.json()["error"], error, "{how}");
        assert_eq!(a.json()["plugin"], "bad", "{how}");
        assert_eq!(client::get(&url("/plain")).await.status, 200);
        proxy
            .wait_status("the fresh VM started", |s| uses_ready(s, "closed") == ready)
            .await;
        let a = misbehave(&mut conn, url("/closed"), None).await;
        assert_eq!(a.header("x-vm-requests"), Some("1"), "after {how}");
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

/// A filter that fails every call gets at most 10 fresh VMs a second,
/// started off the request path: past them, the next start waits for the
/// second to be out (counted as refused).
#[tokio::test]
pub(super) async fn a_filter_failing_without_end_restarts_at_most_ten_times_a_second() {
    let app = upstream::echo("app").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: bad, path: proxy-wasm-misbehave.wasm }}]
routes: [{{ name: closed, match: {{ path: /closed }}, upstream: app, plugins: [{{ use: bad }}] }}]
"#,
            app.url()
        ),
        &["proxy-wasm-misbehave"],
    );
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let mut conn = client::Connection::open(proxy.addr).await;
    let ready = vms_ready(&proxy, "closed").await;
    // Each trap drops its VM; a fresh one starts off the request path
    // (the next trap waits for it): ten a second at most, the eleventh
    // start waiting for the second to be out.
    let started = Instant::now();
    let mut eleventh = Duration::ZERO;
    for n in 1..=15 {
        let a = misbehave(&mut conn, proxy.url("/closed"), Some("trap")).await;
        assert_eq!(a.status, 500, "{:?}", a.body);
        assert_eq!(a.json()["error"], "plugin failed", "{:?}", a.body);
        if n == 11 {
            eleventh = started.elapsed();
        }
        proxy
            .wait_status("the fresh VM started", |s| uses_ready(s, "closed") == ready)
            .await;
    }
    let text = proxy.metrics_showing(&[]).await;
    let value = |name: &str| super::proxy_wasm::plugin_counter(&text, "bad", name);
    assert_eq!(value("vm_restarts"), 15, "{text}");
    // Eleven traps within a second (as here, unless the machine crawls):
    // the eleventh VM waited.
    if eleventh < Duration::from_millis(900) {
        assert!(value("vm_restarts_refused") > 0, "{text}");
        assert!(started.elapsed() >= Duration::from_secs(1));
    }
    let a = misbehave(&mut conn, proxy.url("/closed"), None).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
}

/// The VMs (instances) ready for the plugin use on route `route`, as
/// `/status` shows them.
pub(super) fn uses_ready(status: &serde_json::Value, route: &str) -> u64 {
    use_field(status, route, "instances_ready").unwrap_or(0)
}

/// A number `/status` shows of the plugin use on route `route`.
pub(super) fn use_field(status: &serde_json::Value, route: &str, field: &str) -> Option<u64> {
    (status["config"]["plugin_uses"]
        .as_array()
        .into_iter()
        .flatten())
    .find(|u| u["route"] == route)
    .and_then(|u| u[field].as_u64())
}

async fn vms_ready(proxy: &ProxyProcess, route: &str) -> u64 {
    uses_ready(&proxy.status().await, route)
}
