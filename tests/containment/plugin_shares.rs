//! What plugins share, each its own share of it: shared data (one filter
//! filling the store made another's SDK panic on status 10, and kept it
//! failing after the first was removed), metric names (forty requests
//! made 194,684 series) and log lines (1,062 lines from one 10 ms call).

use super::*;

fn shared_policy(app: &str, hoarder: bool) -> String {
    let (plugin, route) = if hoarder {
        (
            "\n  - { name: hoarder, path: proxy-wasm-misbehave.wasm }",
            "\n  - { name: fill, match: { path: /fill }, upstream: app, plugins: [{ use: hoarder, timeout: 2s, memory: 64MiB }] }",
        )
    } else {
        ("", "")
    };
    format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{app}"] }}]
plugins:
  - {{ name: counter, path: proxy-wasm-shared.wasm }}{plugin}
routes:
  - {{ name: count, match: {{ path: /count }}, upstream: app, plugins: [{{ use: counter }}] }}{route}
"#
    )
}

/// A proxy whose route `path` forwards to `app` through the misbehaving
/// filter, named `plugin` (with a 2 s deadline: it works hard on purpose).
async fn misbehaving_on(plugin: &str, path: &str, app: &str) -> ProxyProcess {
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{app}"] }}]
plugins: [{{ name: {plugin}, path: proxy-wasm-misbehave.wasm }}]
routes: [{{ name: r, match: {{ path: {path} }}, upstream: app, plugins: [{{ use: {plugin}, timeout: 2s }}] }}]
"#
        ),
        &["proxy-wasm-misbehave"],
    );
    let mut proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    proxy.keep(dir);
    proxy
}

/// The shared data `plugin` holds, as `/status` shows it.
async fn shared_bytes(proxy: &ProxyProcess, plugin: &str) -> Option<u64> {
    let status = proxy.status().await;
    let plugins = status["config"]["plugins"].as_array()?.clone();
    let found = plugins.into_iter().find(|p| p["name"] == plugin)?;
    found["shared_data_bytes"].as_u64()
}

/// One filter fills 16 MiB of shared data: its own share, so another
/// filter's counting in shared data goes on (it used to fill the store
/// for all: the other's SDK panicked on the refusal). One more byte is
/// refused to it (its SDK panics: its own request fails), counted. Taken
/// out of the policies, its data goes with it: added back, it starts from
/// nothing.
#[tokio::test]
async fn one_filter_cannot_fill_shared_data_for_the_others() {
    let app = upstream::echo("app").await;
    let dir = policy_dir(
        &shared_policy(&app.url(), true),
        &["proxy-wasm-shared", "proxy-wasm-misbehave"],
    );
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let filled = misbehaving(proxy.url("/fill"), "fill", &[]).await;
    assert_eq!(filled.status, 200, "{:?}", filled.body);
    assert_eq!(filled.header("x-stored"), Some("16777216"));
    for n in 1..=3 {
        let counted = client::get(&proxy.url("/count")).await;
        assert_eq!(counted.status, 200, "{:?}", counted.body);
        assert_eq!(counted.json()["headers"]["x-shared-count"], n.to_string());
    }
    let share = portcullis::plugin::SHARED_BYTES_PER_PLUGIN as u64;
    assert_eq!(shared_bytes(&proxy, "hoarder").await, Some(share));
    let more = (share + 1).to_string();
    let over = misbehaving(proxy.url("/fill"), "fill", &[("x-fill-bytes", &more)]).await;
    assert_eq!(over.status, 500, "{:?}", over.body);
    assert_eq!(over.json()["plugin"], "hoarder");
    let metrics = metrics(&proxy).await;
    assert_eq!(
        plugin_counter(&metrics, "hoarder", "shared_data_refused"),
        1,
        "{metrics}"
    );
    assert_eq!(
        plugin_counter(&metrics, "counter", "failures"),
        0,
        "{metrics}"
    );

    let policy = dir.path().join("policy.yaml");
    let reload = |yaml: String| {
        std::fs::write(&policy, yaml).unwrap();
        async {
            let answer = client::call("POST", &proxy.admin_url("/reload")).await;
            assert_eq!(answer.json()["result"], "applied", "{:?}", answer.body);
        }
    };
    reload(shared_policy(&app.url(), false)).await;
    assert_eq!(shared_bytes(&proxy, "hoarder").await, None);
    reload(shared_policy(&app.url(), true)).await;
    assert_eq!(shared_bytes(&proxy, "hoarder").await, Some(0));
    let counted = client::get(&proxy.url("/count")).await;
    assert_eq!(counted.json()["headers"]["x-shared-count"], "4");
}

/// Ten requests each define 1,000 counters of new names: the filter keeps
/// its 500, the rest are refused (and counted), and the filter carries on.
#[tokio::test]
async fn a_filter_defines_at_most_its_share_of_metric_names() {
    let app = upstream::echo("app").await;
    let proxy = misbehaving_on("namer", "/names", &app.url()).await;
    for i in 0..10 {
        let name = format!("request{i}");
        let headers = [("x-name", name.as_str()), ("x-count", "1000")];
        let answer = misbehaving(proxy.url("/names"), "metrics", &headers).await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
    }
    let metrics = metrics(&proxy).await;
    assert_eq!(plugin_counter(&metrics, "namer", "metrics_refused"), 9_500);
    let own = metrics
        .lines()
        .filter(|l| {
            l.starts_with(r#"portcullis_plugin_counter_total{plugin="namer",name="request"#)
        })
        .count();
    assert_eq!(own, 500, "{metrics}");
    assert_eq!(plugin_counter(&metrics, "namer", "request0_0"), 1);
}

/// Lines below the log level (debug, under the default info) are neither
/// written nor counted against the plugin's 100 a second: 2,000 of them
/// drop nothing, and a warning right after is written, not crowded out.
#[tokio::test]
async fn lines_below_the_log_level_cost_a_plugin_nothing() {
    let app = upstream::echo("app").await;
    let proxy = misbehaving_on("chatty", "/chat", &app.url()).await;
    let debug = [("x-count", "2000"), ("x-level", "debug")];
    let answer = misbehaving(proxy.url("/chat"), "logs", &debug).await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let answer = misbehaving(proxy.url("/chat"), "logs", &[("x-count", "1")]).await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    eventually("the warning is logged", Duration::from_secs(10), || async {
        proxy.count_logs("flooding the log, line 0") == 1
    })
    .await;
    let dropped = plugin_counter(&metrics(&proxy).await, "chatty", "log_lines_dropped");
    assert_eq!(dropped, 0);
    assert_eq!(proxy.count_logs("chattering"), 0);
}

/// One call logs 2,000 lines: at most the plugin's budget reaches the log
/// (100 a second), the rest are counted as dropped.
#[tokio::test]
async fn a_plugins_log_lines_are_rate_limited() {
    let app = upstream::echo("app").await;
    let proxy = misbehaving_on("chatty", "/chat", &app.url()).await;
    let answer = misbehaving(proxy.url("/chat"), "logs", &[("x-count", "2000")]).await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let dropped = plugin_counter(&metrics(&proxy).await, "chatty", "log_lines_dropped");
    // One second's budget, or two if the call spanned a second's turn.
    assert!((1_800..=1_900).contains(&dropped), "{dropped}");
    let logged = 2_000 - dropped as usize;
    eventually(
        "the lines let through are logged",
        Duration::from_secs(10),
        || async { proxy.count_logs("flooding the log") == logged },
    )
    .await;
}
