//! An upstream's `health_check`: endpoints failing it leave the rotation,
//! come back once they pass, and with every endpoint failing requests
//! still go out; a reload that keeps the upstream keeps what was found.

use std::sync::Arc;
use std::sync::atomic::{AtomicU16, Ordering};

use bytes::Bytes;
use hyper::{Request, Response};

use crate::support::assert_check_errors;
use crate::support::client::{self, body};
use crate::support::process::ProxyProcess;
use crate::support::upstream::{self, Upstream};

/// An upstream answering `/healthz` with the status its switch holds (and
/// 400 to a probe without the checker's user agent, or not in `version`),
/// anything else with its name.
async fn switchable(name: &'static str, version: http::Version) -> (Upstream, Arc<AtomicU16>) {
    let health = Arc::new(AtomicU16::new(200));
    let switch = health.clone();
    let server = upstream::serve(move |req: Request<hyper::body::Incoming>| {
        let health = switch.clone();
        async move {
            if req.uri().path() != "/healthz" {
                return Response::new(upstream::full(name));
            }
            let agent = req.headers().get("user-agent");
            let status = if agent.is_some_and(|a| a == "portcullis-health-check")
                && req.version() == version
            {
                health.load(Ordering::SeqCst)
            } else {
                400
            };
            Response::builder()
                .status(status)
                .body(upstream::full(""))
                .unwrap()
        }
    })
    .await;
    (server, health)
}

fn policy(a: &Upstream, b: &Upstream, http2: bool, route: &str) -> String {
    format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - name: pair
    endpoints: ["{}", "{}"]
    http2: {http2}
    eject_for: 0s
    health_check: {{ path: /healthz, interval: 100ms, timeout: 100ms, unhealthy_after: 2, healthy_after: 2 }}
routes:
  - {{ name: {route}, match: {{ path_prefix: /app }}, upstream: pair }}
"#,
        a.url(),
        b.url()
    )
}

/// Which endpoints answer 16 requests.
async fn answering(proxy: &ProxyProcess) -> Vec<String> {
    let http = client::http1();
    let mut seen = Vec::new();
    for _ in 0..16 {
        let req = Request::get(proxy.url("/app")).body(body(Bytes::new()));
        let a = client::send(&http, req.unwrap()).await;
        assert_eq!(a.status, 200, "{:?}", a.body);
        seen.push(String::from_utf8_lossy(&a.body).into_owned());
    }
    seen.sort();
    seen.dedup();
    seen
}

/// The endpoints `/status` lists as failing their checks.
fn unhealthy(status: &serde_json::Value) -> Vec<String> {
    let list = status["config"]["unhealthy_endpoints"].as_array();
    let list = list.expect("unhealthy_endpoints in /status");
    list.iter()
        .map(|e| {
            assert_eq!(e["upstream"], "pair", "{e}");
            e["endpoint"].as_str().unwrap().to_owned()
        })
        .collect()
}

#[tokio::test]
async fn an_endpoint_failing_its_check_leaves_the_rotation_until_it_passes() {
    let (a, a_health) = switchable("a", http::Version::HTTP_11).await;
    let (b, b_health) = switchable("b", http::Version::HTTP_11).await;
    b_health.store(503, Ordering::SeqCst);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.yaml");
    std::fs::write(&file, policy(&a, &b, false, "app")).unwrap();
    let mut proxy = ProxyProcess::start_on(dir.path(), &["--workers", "2"]).await;
    let b_addr = b.addr.to_string();

    // b accepts connections and serves requests: only the check finds
    // it failing, and takes it out for both workers.
    let status = proxy
        .wait_status("b unhealthy", |s| unhealthy(s) == [b_addr.clone()])
        .await;
    assert_eq!(answering(&proxy).await, ["a"], "{status:#}");
    let line = proxy.find_log("endpoint failed its health check").await;
    assert!(
        line.contains("answered 503") && line.contains(&b_addr),
        "{line}"
    );
    proxy
        .metrics_showing(&[r#"portcullis_upstream_endpoints_unhealthy{upstream="pair"} 1"#.into()])
        .await;

    // A reload that keeps the upstream keeps what its checks found: b
    // does not come back for a round of probes.
    std::fs::write(&file, policy(&a, &b, false, "renamed")).unwrap();
    proxy.signal("HUP");
    let status = proxy
        .wait_status("the reload", |s| s["config"]["routes"][0] == "renamed")
        .await;
    assert_eq!(unhealthy(&status), [b_addr]);

    // Passing again, it is back.
    b_health.store(200, Ordering::SeqCst);
    proxy
        .wait_status("b healthy", |s| unhealthy(s).is_empty())
        .await;
    proxy.wait_for_log("endpoint passed its health check").await;
    assert_eq!(answering(&proxy).await, ["a", "b"]);

    // With every endpoint failing, requests still go out (Envoy's panic
    // mode): a try beats a certain 502.
    a_health.store(500, Ordering::SeqCst);
    b_health.store(500, Ordering::SeqCst);
    proxy
        .wait_status("both unhealthy", |s| unhealthy(s).len() == 2)
        .await;
    assert_eq!(answering(&proxy).await, ["a", "b"]);
}

#[tokio::test]
async fn an_http2_upstream_is_checked_over_http2() {
    let (a, _) = switchable("a", http::Version::HTTP_2).await;
    let (b, b_health) = switchable("b", http::Version::HTTP_2).await;
    b_health.store(503, Ordering::SeqCst);
    let proxy = ProxyProcess::start(&policy(&a, &b, true, "app"), &[]).await;
    let b_addr = b.addr.to_string();
    // a passes only probes that came over HTTP/2.
    proxy
        .wait_status("b unhealthy", |s| unhealthy(s) == [b_addr.clone()])
        .await;
    assert_eq!(answering(&proxy).await, ["a"]);
}

#[test]
fn check_names_bad_health_checks() {
    assert_check_errors(
        r#"
upstreams:
  - { name: t, url: "http://{x}.svc", health_check: { path: /healthz } }
  - { name: p, endpoints: ["http://127.0.0.1:9"], health_check: { path: healthz } }
  - { name: s, endpoints: ["http://127.0.0.1:9"], health_check: { path: /h, interval: 1s, timeout: 2s } }
  - { name: n, endpoints: ["http://127.0.0.1:9"], health_check: { path: /h, unhealthy_after: 0 } }
routes:
  - { name: r, match: { path: "/{x}" }, upstream: t }
"#,
        &[
            (3, "health_check needs `endpoints`"),
            (4, "`healthz` must be a path starting with `/`"),
            (5, "timeout (2s) is longer than its interval (1s)"),
            (6, "`0` is not a count of probes from 1 to 100"),
        ],
    );
}
