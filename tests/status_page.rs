//! The status page on the admin listener (`/`), opened in headless
//! Chromium from a real running proxy: what a person sees.

use crate::support::process::ProxyProcess;
use crate::support::{browser, client, closed_port, upstream};

/// The routing core's page shows its routes with their requests, each
/// upstream endpoint and whether it is in the rotation, the plugins with
/// their calls, and the last reload; it is self-contained HTML.
#[tokio::test]
async fn the_status_page_shows_routes_upstreams_plugins_and_reloads() {
    let echo = upstream::echo("app").await;
    let down = format!("http://127.0.0.1:{}", closed_port());
    // Takes every connection and fails every request: no connect fails,
    // so only its answers tell.
    let broken = upstream::serve(|_| async {
        let mut resp = hyper::Response::new(upstream::full("down for everyone"));
        *resp.status_mut() = hyper::StatusCode::SERVICE_UNAVAILABLE;
        resp
    })
    .await;
    let proxy = ProxyProcess::start(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: app, endpoints: ["{}", "{down}"], eject_for: 60s }}
  - {{ name: broken, endpoints: ["{}"] }}
plugins: [{{ name: rules, path: "builtin:header-rules" }}, {{ name: rules-v2, path: "builtin:header-rules" }}]
routes:
  - name: api
    match: {{ path_prefix: /api }}
    upstream: app
    plugins: [{{ use: rules, config: {{ response: {{ set: {{ x-seen: "yes" }} }} }} }}]
  - name: down
    match: {{ path: /down }}
    upstream: broken
  - name: canary
    match: {{ path: /canary }}
    respond: {{ status: 204 }}
    plugins: [{{ use: rules, rollout: {{ to: rules-v2, percent: 30 }} }}]
  - name: trial
    match: {{ path: /trial }}
    respond: {{ status: 204 }}
    plugins: [{{ use: rules-v2, mode: shadow }}]
"#,
            echo.url(),
            broken.url()
        ),
        &[],
    )
    .await;
    // Enough requests for round robin to meet the closed endpoint (a
    // failed connect takes it out) and for the plugin to count calls.
    for _ in 0..4 {
        let a = client::get(&proxy.url("/api/x")).await;
        assert!(a.status == 200 || a.status == 502, "{}", a.status);
    }
    for _ in 0..3 {
        assert_eq!(client::get(&proxy.url("/down")).await.status, 503);
    }
    let status = proxy.status().await;
    assert_eq!(
        status["config"]["ejected_endpoints"]
            .as_array()
            .map(Vec::len),
        Some(1),
        "{status}"
    );

    // Served as a page of its own: no asset from anywhere else.
    let page = client::get(&proxy.admin_url("/")).await;
    assert_eq!(page.status, 200);
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    let html = String::from_utf8_lossy(&page.body);
    for external in ["src=\"http", "href=\"http", "@import", "url("] {
        assert!(!html.contains(external), "the page loads {external}");
    }

    let dom = browser::rendered(&proxy.admin_url("/")).await;
    assert!(dom.contains("updated "), "the page did not render: {dom}");
    let text = visible_text(&dom);
    assert!(!text.contains("cannot reach"), "{text}");
    for want in [
        "Listeners",
        "ready",
        echo.addr.to_string().as_str(),
        &down[7..],
        "in rotation",
        "ejected",
        "rules",
        "builtin:header-rules",
        "Reloads",
        // A rollout and a use in shadow, each in a table of its own.
        "rolled out",
        "holding",
        "30%",
        "in shadow",
    ] {
        assert!(text.contains(want), "`{want}` not on the page: {text}");
    }
    // The route's row, with its requests by status; the plugin's use,
    // with its calls (one per request that reached the chain).
    assert!(text.contains("api 200: "), "{text}");
    // The upstream that fails every request is failing, not in rotation;
    // the one that answers some is in rotation, with its failures shown.
    let broken_row = format!("broken {} failing 3 / 3", broken.addr);
    assert!(text.contains(&broken_row), "{text}");
    let app_row = format!("app {} in rotation", echo.addr);
    assert!(text.contains(&app_row), "{text}");
    let calls = status_calls(&proxy.status().await);
    assert!(calls >= 4, "{calls}");
    assert!(text.contains(&format!("rules api {calls}")), "{text}");

    if let Some(path) = std::env::var_os("STATUS_PAGE_SCREENSHOT") {
        let path = std::path::PathBuf::from(path);
        browser::screenshot(&proxy.admin_url("/"), &path, (1280, 900)).await;
        let png = std::fs::read(&path).expect("the screenshot");
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    }
}

/// The calls `/status` counts for the first plugin use.
fn status_calls(status: &serde_json::Value) -> u64 {
    status["config"]["plugin_uses"][0]["calls"]
        .as_u64()
        .expect("plugin_uses[0].calls")
}

/// The text of an HTML document, its tags replaced by single spaces.
pub fn visible_text(dom: &str) -> String {
    let body = dom.split("<body>").nth(1).unwrap_or(dom);
    let body = body.split("<script>").next().unwrap_or(body);
    let mut text = String::new();
    let mut in_tag = false;
    for c in body.chars() {
        match c {
            '<' => {
                in_tag = true;
                text.push(' ');
            }
            '>' => in_tag = false,
            c if !in_tag => text.push(c),
            _ => {}
        }
    }
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}
