//! The header-rules plugin: response edits and CORS.

use super::*;

#[tokio::test]
pub(super) async fn header_rules_edit_responses_and_answer_cors_preflights() {
    let (app, hits) = upstream::counted_echo("counted").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: headers, path: header-rules.wasm }}]
routes:
  - name: app
    match: {{ path_prefix: /api }}
    upstream: app
    plugins:
      - use: headers
        config:
          request: {{ set: {{ x-tenant: blue }}, remove: [cookie] }}
          response: {{ set: {{ strict-transport-security: "max-age=63072000" }}, remove: [x-powered-by] }}
          cors: {{ allow_origins: ["https://ui.example.com"], allow_credentials: true, allow_headers: [authorization] }}
"#,
            app.url()
        ),
        &["header-rules"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;

    let req = Request::get(proxy.url("/api/x"))
        .header("origin", "https://ui.example.com")
        .header("cookie", "session=1")
        .body(body(Bytes::new()))
        .unwrap();
    let a = client::send(&client::http1(), req).await;
    assert_eq!(a.status, 200);
    assert_eq!(
        a.header("strict-transport-security"),
        Some("max-age=63072000")
    );
    assert_eq!(
        a.header("access-control-allow-origin"),
        Some("https://ui.example.com")
    );
    assert_eq!(a.header("access-control-allow-credentials"), Some("true"));
    let seen = a.json();
    assert_eq!(seen["headers"]["x-tenant"], "blue");
    assert!(seen["headers"].get("cookie").is_none());
    assert_eq!(hits.load(Ordering::SeqCst), 1);

    let preflight = Request::options(proxy.url("/api/x"))
        .header("origin", "https://ui.example.com")
        .header("access-control-request-method", "POST")
        .body(body(Bytes::new()))
        .unwrap();
    let a = client::send(&client::http1(), preflight).await;
    assert_eq!(a.status, 204);
    assert_eq!(
        a.header("access-control-allow-origin"),
        Some("https://ui.example.com")
    );
    assert_eq!(
        a.header("access-control-allow-headers"),
        Some("authorization")
    );
    assert!(
        a.header("access-control-allow-methods")
            .unwrap()
            .contains("POST")
    );
    assert_eq!(
        hits.load(Ordering::SeqCst),
        1,
        "a preflight is answered by the plugin"
    );

    let foreign = Request::options(proxy.url("/api/x"))
        .header("origin", "https://evil.example.com")
        .header("access-control-request-method", "POST")
        .body(body(Bytes::new()))
        .unwrap();
    assert_eq!(client::send(&client::http1(), foreign).await.status, 403);
}

#[tokio::test]
pub(super) async fn cors_responses_keep_the_upstreams_vary_and_are_safe_to_cache() {
    let app = upstream::serve(|_req| async {
        Response::builder()
            .header("vary", "Accept-Encoding")
            .body(upstream::full("ok"))
            .unwrap()
    })
    .await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: headers, path: header-rules.wasm }}]
routes:
  - name: listed
    match: {{ path_prefix: /listed }}
    upstream: app
    plugins: [{{ use: headers, config: {{ cors: {{ allow_origins: ["https://ui.example.com"] }} }} }}]
  - name: any
    match: {{ path_prefix: /any }}
    upstream: app
    plugins: [{{ use: headers, config: {{ cors: {{ allow_origins: ["*"] }} }} }}]
"#,
            app.url()
        ),
        &["header-rules"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;
    let http = client::http1();
    let get = |path: &str, origin: Option<&str>| {
        let mut req = Request::get(proxy.url(path));
        if let Some(o) = origin {
            req = req.header("origin", o);
        }
        client::send(&http, req.body(body(Bytes::new())).unwrap())
    };
    let vary = |a: &Answer| -> Vec<String> {
        a.headers
            .get_all("vary")
            .iter()
            .flat_map(|v| v.to_str().unwrap().split(','))
            .map(|t| t.trim().to_ascii_lowercase())
            .collect()
    };
    // The answer depends on Origin: every response says so, the one to a
    // request without Origin too, and the upstream's Vary stays.
    for origin in [Some("https://ui.example.com"), None] {
        let a = get("/listed", origin).await;
        assert_eq!(a.status, 200);
        assert_eq!(vary(&a), ["accept-encoding", "origin"], "origin {origin:?}");
        assert_eq!(
            a.header("access-control-allow-origin"),
            origin,
            "origin {origin:?}"
        );
    }
    // A plain `*` does not vary: it is on every response.
    let a = get("/any", None).await;
    assert_eq!(a.header("access-control-allow-origin"), Some("*"));
    assert_eq!(vary(&a), ["accept-encoding"]);
}
