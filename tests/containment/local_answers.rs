//! A plugin's own answers: only statuses 200-599 (a 101 sent to a client
//! that asked for no upgrade left its connection hanging; 65736 went out
//! as 200), and the first of two answers stands, as in Envoy.

use super::*;

/// A filter answering 101 or 65736: the call fails (`BadArgument`, on
/// which the Rust SDK panics: the request fails, 500, naming the plugin);
/// one answering twice: the first answer is the client's. A component
/// answering 101: its request fails likewise.
#[tokio::test]
async fn a_plugin_answers_only_with_a_final_status_and_its_first_answer_stands() {
    let app = upstream::echo("app").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins:
  - {{ name: filter, path: proxy-wasm-misbehave.wasm }}
  - {{ name: component, path: fixture-forward.wasm }}
routes:
  - {{ name: filtered, match: {{ path: /filtered }}, upstream: app, plugins: [{{ use: filter }}] }}
  - name: component
    match: {{ path: /component }}
    upstream: app
    plugins: [{{ use: component, config: {{ respond: {{ status: 101, body: "switching?" }} }} }}]
"#,
            app.url()
        ),
        &["proxy-wasm-misbehave", "fixture-forward"],
    );
    let mut proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    for how in ["local-101", "local-65736"] {
        // The first failure's VM starts again off the request path; a
        // request meeting its worker meanwhile fails with "could not
        // start" (the use's `fail`), not with the filter's answer: wait
        // for the VM (more than a moment on a loaded machine).
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        let answer = loop {
            let answer = tokio::time::timeout(
                Duration::from_secs(10),
                misbehaving(proxy.url("/filtered"), how, &[]),
            )
            .await
            .unwrap_or_else(|_| panic!("{how}: no answer"));
            let starting =
                answer.status == 500 && answer.json()["error"] == "plugin could not start";
            if !starting || tokio::time::Instant::now() > deadline {
                break answer;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert_eq!(answer.status, 500, "{how}: {:?}", answer.body);
        assert_eq!(answer.json()["plugin"], "filter", "{how}");
        assert_eq!(answer.json()["error"], "plugin failed", "{how}");
    }
    proxy.wait_for_log("unexpected status: 2").await;
    // Each failed VM's successor says when it is in place.
    proxy.wait_for_log("proxy-wasm VM started again").await;
    // The failed VMs are started again off the request path: until
    // then, a worker's requests fail by the use's `fail` (500). The first
    // answer from a worker whose VM is back is the one looked at.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut twice = misbehaving(proxy.url("/filtered"), "local-twice", &[]).await;
    while twice.status == 500 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the filter's VM never started again"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
        twice = misbehaving(proxy.url("/filtered"), "local-twice", &[]).await;
    }
    assert_eq!(
        (twice.status.as_u16(), twice.header("x-which")),
        (403, Some("first"))
    );
    assert_eq!(twice.body, "first\n");
    let component = tokio::time::timeout(
        Duration::from_secs(10),
        client::get(&proxy.url("/component")),
    )
    .await
    .expect("an answer, not a connection left hanging");
    assert_eq!(component.status, 500, "{:?}", component.body);
    let error = component.json();
    assert_eq!(error["plugin"], "component");
    assert_eq!(
        error["error"],
        "plugin answered with status 101, not 200-599"
    );
}
