//! `X-Request-Id`: kept or made per request, sent upstream, written in the
//! access line and the forwarding warnings, and returned to the client.

use bytes::Bytes;
use hyper::Request;

use crate::support::client::{self, Answer, body};
use crate::support::closed_port;
use crate::support::process::ProxyProcess;
use crate::support::upstream;

/// A proxy process with a route to `up` at `/` and one to a closed port
/// at `/dead`, on a listener with `listener_extra` settings.
async fn proxy_to(up: &upstream::Upstream, listener_extra: &str) -> ProxyProcess {
    ProxyProcess::start(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" {listener_extra} }}]
upstreams:
  - {{ name: e, endpoints: ["{}"] }}
  - {{ name: dead, endpoints: ["http://127.0.0.1:{}"] }}
routes:
  - {{ name: dead, match: {{ path_prefix: /dead }}, upstream: dead }}
  - {{ name: all, match: {{ path_prefix: / }}, upstream: e }}
"#,
            up.url(),
            closed_port()
        ),
        &[],
    )
    .await
}

async fn get(proxy: &ProxyProcess, path: &str, id: Option<&str>) -> Answer {
    let mut req = Request::get(proxy.url(path));
    if let Some(id) = id {
        req = req.header("x-request-id", id);
    }
    client::send(&client::http1(), req.body(body(Bytes::new())).unwrap()).await
}

fn is_new_id(id: &str) -> bool {
    id.len() == 32
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[tokio::test]
async fn each_request_carries_one_id_upstream_into_the_logs_and_back() {
    let echo = upstream::echo("ids").await;
    let mut proxy = proxy_to(&echo, ", request_id: make").await;

    let answer = get(&proxy, "/made", None).await;
    assert_eq!(answer.status, 200);
    let id = answer
        .header("x-request-id")
        .expect("an id on the answer")
        .to_owned();
    assert!(is_new_id(&id), "{id}");
    assert_eq!(answer.json()["headers"]["x-request-id"], id.as_str());
    let line = proxy
        .wait_for_log(&format!("\"request_id\":\"{id}\""))
        .await;
    assert!(line.contains("/made"), "{line}");
    let again = get(&proxy, "/made", None).await;
    assert_ne!(again.header("x-request-id"), Some(id.as_str()));

    // An ingress controller's id is kept; one that is not a usable id
    // (too long) is replaced.
    let answer = get(&proxy, "/kept", Some("ingress-7f3a")).await;
    assert_eq!(answer.header("x-request-id"), Some("ingress-7f3a"));
    assert_eq!(answer.json()["headers"]["x-request-id"], "ingress-7f3a");
    let long = "x".repeat(200);
    let answer = get(&proxy, "/replaced", Some(&long)).await;
    let id = answer.header("x-request-id").unwrap().to_owned();
    assert!(is_new_id(&id), "{id}");
    assert_eq!(answer.json()["headers"]["x-request-id"], id.as_str());

    // The proxy's own error answers carry it, and so does the warning.
    let answer = get(&proxy, "/dead", Some("failing-1")).await;
    assert_eq!(answer.status, 502);
    assert_eq!(answer.header("x-request-id"), Some("failing-1"));
    let line = proxy.wait_for_log("upstream request failed").await;
    assert!(line.contains("\"request_id\":\"failing-1\""), "{line}");
}

/// By default a listener logs the id a request brings (an ingress
/// controller's, the tunnel server's) and makes none; `off` ignores ids.
#[tokio::test]
async fn by_default_ids_are_kept_and_logged_but_not_made() {
    let echo = upstream::echo("keep").await;
    let mut proxy = proxy_to(&echo, "").await;
    let answer = get(&proxy, "/none", None).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.header("x-request-id"), None);
    assert!(answer.json()["headers"].get("x-request-id").is_none());
    let answer = get(&proxy, "/given", Some("ingress-42")).await;
    assert_eq!(answer.json()["headers"]["x-request-id"], "ingress-42");
    assert_eq!(
        answer.header("x-request-id"),
        None,
        "not echoed: not made here"
    );
    let line = proxy.wait_for_log("\"request_id\":\"ingress-42\"").await;
    assert!(line.contains("/given"), "{line}");

    let mut off = proxy_to(&echo, ", request_id: off").await;
    let answer = get(&off, "/ignored", Some(&"y".repeat(200))).await;
    assert_eq!(answer.json()["headers"]["x-request-id"], "y".repeat(200));
    assert_eq!(answer.header("x-request-id"), None);
    let line = off.wait_for_log("/ignored").await;
    assert!(line.contains("\"request_id\":\"-\""), "{line}");
}

#[test]
fn an_unknown_request_id_mode_is_reported_with_its_place() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("a.yaml"),
        "listeners: [{ name: http, bind: \"127.0.0.1:0\", request_id: always }]\n",
    )
    .unwrap();
    let (ok, _, stderr) = crate::support::check(dir.path());
    assert!(!ok);
    assert!(
        stderr.contains("a.yaml:1:") && stderr.contains("`always` is not a request id mode"),
        "{stderr}"
    );
}
