//! A plugin's callouts: one `Host` on the wire; a request waiting on one
//! bounded by its route's timeout and let go when its client leaves; the
//! calls a filter fires without waiting capped per VM.

use super::*;
use crate::support::nginx::Nginx;

/// The keys filter fetches its key set from nginx, which answers a
/// request with two `Host` headers 400: it used to get the endpoint's
/// `Host` and its own `:authority` both, and never got its keys.
#[tokio::test]
async fn a_filters_callout_to_nginx_carries_one_host() {
    let nginx = Nginx::start(r#"location = /keys { return 200 "keys-from-nginx"; }"#).await;
    let app = upstream::echo("app").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}, {{ name: keys, endpoints: ["{}"] }}]
plugins: [{{ name: keyed, path: proxy-wasm-keys.wasm }}]
routes: [{{ name: app, match: {{ path: /app }}, upstream: app, plugins: [{{ use: keyed }}] }}]
"#,
            app.url(),
            nginx.url
        ),
        &["proxy-wasm-keys"],
    );
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    // Each worker's VM fetches its own; requests on fresh connections
    // reach both workers.
    eventually(
        "every VM has nginx's keys",
        Duration::from_secs(20),
        || async {
            let mut all = true;
            for _ in 0..8 {
                let a = client::get(&proxy.url("/app")).await;
                all &= a.json()["headers"]["x-keys"] == "keys-from-nginx";
            }
            all
        },
    )
    .await;
    // The upstream's metrics saw nginx's 200s, no 400.
    let metrics = metrics(&proxy).await;
    assert!(
        !metrics.contains(r#"portcullis_upstream_responses_total{upstream="keys",code="400"}"#),
        "{metrics}"
    );
}

fn waiting_policy(app: &str, slow: &str, route: &str) -> String {
    format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{app}"] }}, {{ name: slow, endpoints: ["{slow}"] }}]
plugins: [{{ name: caller, path: proxy-wasm-misbehave.wasm }}]
routes:
  - {{ name: waits, match: {{ path: /waits }}, upstream: app, {route} plugins: [{{ use: caller }}] }}
"#
    )
}

/// A filter waits on a callout that asks for 30 s, on a route with a
/// 1 s timeout: the request is answered 504 once the route's second is
/// out (it used to wait out the call, then go on).
#[tokio::test]
async fn a_request_waiting_on_a_callout_is_bounded_by_its_routes_timeout() {
    let app = upstream::echo("app").await;
    let slow = upstream::silent().await;
    let yaml = waiting_policy(&app.url(), &format!("http://{}", slow.addr), "timeout: 1s,");
    let dir = policy_dir(&yaml, &["proxy-wasm-misbehave"]);
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let headers = [("x-cluster", "slow"), ("x-call-ms", "30000")];
    let asked = misbehaving(proxy.url("/waits"), "slow-call", &headers);
    let answer = tokio::time::timeout(Duration::from_secs(20), asked)
        .await
        .expect("answered well before the call's own 30 s");
    assert_eq!(answer.status, 504, "{:?}", answer.body);
    let error = answer.json();
    assert_eq!(
        error["error"],
        "plugin callout timeout: the route's timeout passed"
    );
    assert_eq!(error["plugin"], "caller");
    assert_eq!(error["route"], "waits");
    assert_eq!(slow.connections(), 1, "the call was made");
}

/// A client that leaves while its request waits on a callout: the
/// callout is dropped with its upstream connection, and the request is
/// logged as 499 (it used to hold the upstream socket until SIGTERM, and
/// log nothing).
#[tokio::test]
async fn a_client_that_leaves_cancels_the_callout_it_waits_on() {
    use tokio::io::AsyncWriteExt;
    let app = upstream::echo("app").await;
    let mut slow = upstream::never_answering().await;
    let yaml = waiting_policy(&app.url(), &format!("http://{}", slow.addr), "");
    let dir = policy_dir(&yaml, &["proxy-wasm-misbehave"]);
    let mut proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    conn.write_all(
        b"GET /waits?leaving HTTP/1.1\r\nhost: example.com\r\nx-misbehave: slow-call\r\n\
          x-cluster: slow\r\nx-call-ms: 50000\r\n\r\n",
    )
    .await
    .unwrap();
    slow.request_arrived().await;
    drop(conn);
    slow.closed_soon().await;
    let line = proxy.wait_for_log("/waits?leaving").await;
    assert!(line.contains(r#""status":499"#), "{line}");
}

/// A filter that fires 1,000 calls without waiting for them: 100 go (the
/// cap of one VM's calls in flight), the rest fail at once and are
/// counted; the request itself goes on.
#[tokio::test]
async fn the_calls_a_filter_does_not_wait_for_are_capped_per_vm() {
    let app = upstream::echo("app").await;
    let slow = upstream::silent().await;
    let yaml = waiting_policy(&app.url(), &format!("http://{}", slow.addr), "");
    let dir = policy_dir(&yaml, &["proxy-wasm-misbehave"]);
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let headers = [("x-cluster", "slow"), ("x-count", "1000")];
    let answer = misbehaving(proxy.url("/waits"), "callouts", &headers).await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    proxy
        .metrics_showing(&[
            r#"portcullis_plugin_counter_total{plugin="caller",name="callouts_refused"} 900"#
                .to_owned(),
        ])
        .await;
    eventually(
        "the 100 calls reach the upstream",
        Duration::from_secs(10),
        || async { slow.connections() == 100 },
    )
    .await;
}
