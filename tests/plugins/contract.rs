//! What `portcullis:policy` 0.3 gave components: a callout to an upstream
//! of the policies before deciding, and the response body, read whole,
//! replaced or answered; and an answer to a response head.

use super::*;

/// An authorization server: answers the callout's body (`good`: 200
/// `ok:good`; `bad`: 403; `slow`: never), and keeps what it was sent.
async fn authorizer() -> (Upstream, Arc<std::sync::Mutex<Vec<String>>>) {
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let kept = seen.clone();
    let server = upstream::serve(move |req: Request<hyper::body::Incoming>| {
        let kept = kept.clone();
        async move {
            use http_body_util::BodyExt;
            let line = format!(
                "{} {} {}",
                req.method(),
                req.uri(),
                req.headers()
                    .get("content-type")
                    .map_or("", |v| v.to_str().unwrap())
            );
            let token = req.into_body().collect().await.unwrap().to_bytes();
            kept.lock()
                .unwrap()
                .push(format!("{line} {}", String::from_utf8_lossy(&token)));
            match &token[..] {
                b"bad" => Response::builder()
                    .status(403)
                    .body(upstream::full("no"))
                    .unwrap(),
                b"slow" => std::future::pending().await,
                t => {
                    let said = format!("ok:{}", String::from_utf8_lossy(t));
                    Response::new(upstream::full(said))
                }
            }
        }
    })
    .await;
    (server, seen)
}

#[tokio::test]
pub(super) async fn a_component_calls_out_before_it_decides() {
    let app = upstream::echo("app").await;
    let (auth, seen) = authorizer().await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: app, endpoints: ["{}"] }}
  - {{ name: auth, endpoints: ["{}"] }}
plugins: [{{ name: reach, path: fixture-contract-0-3.wasm }}]
routes:
  - name: call
    match: {{ path: /call }}
    upstream: app
    plugins: [{{ use: reach, config: {{ callout: {{ upstream: auth, path: "/check?from=proxy", timeout_ms: 300 }} }} }}]
  - name: nowhere
    match: {{ path: /nowhere }}
    upstream: app
    plugins: [{{ use: reach, config: {{ callout: {{ upstream: missing, path: /check }} }} }}]
"#,
            app.url(),
            auth.url()
        ),
        &["fixture-contract-0-3"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;
    let c = client::http1();
    let send = |path: &'static str, token: &'static str| {
        let req = Request::get(proxy.url(path))
            .header("x-token", token)
            .body(body(Bytes::new()))
            .unwrap();
        let c = c.clone();
        async move { client::send(&c, req).await }
    };

    // The answer reaches the plugin, which forwards with it.
    let good = send("/call", "good").await;
    assert_eq!(good.status, 200, "{:?}", good.body);
    assert_eq!(good.json()["headers"]["x-callout"], "200 ok:good");
    assert_eq!(
        seen.lock().unwrap().as_slice(),
        ["POST /check?from=proxy text/plain good"],
        "the callout as the plugin made it"
    );
    // The plugin's own answer, in the proxy's error shape.
    let bad = send("/call", "bad").await;
    assert_eq!(bad.status, 403, "{:?}", bad.body);
    assert_eq!(bad.json()["error"], "refused by the callout");
    assert_eq!(bad.json()["plugin"], "reach");
    // No answer within its timeout, and an upstream the policies lack:
    // the plugin is told which, and decides.
    let slow = send("/call", "slow").await;
    assert_eq!(slow.json()["headers"]["x-callout"], "timed-out");
    let nowhere = send("/nowhere", "good").await;
    assert_eq!(nowhere.json()["headers"]["x-callout"], "failed");
    assert_eq!(seen.lock().unwrap().len(), 3, "nothing sent to no upstream");
}

#[tokio::test]
pub(super) async fn a_component_reads_replaces_and_refuses_response_bodies() {
    let app = upstream::echo("app").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: reach, path: fixture-contract-0-3.wasm }}]
routes:
  - {{ name: upper, match: {{ path_prefix: /upper }}, upstream: app, plugins: [{{ use: reach, config: {{ body: {{ max: 65536, upper: true }} }} }}] }}
  - {{ name: refuse, match: {{ path_prefix: /refuse }}, upstream: app, plugins: [{{ use: reach, config: {{ body: {{ max: 65536, refuse: secret }} }} }}] }}
  - {{ name: small, match: {{ path_prefix: /small }}, upstream: app, plugins: [{{ use: reach, config: {{ body: {{ max: 16 }} }} }}] }}
  - {{ name: answer, match: {{ path_prefix: /answer }}, upstream: app, plugins: [{{ use: reach, config: {{ answer_response: 451 }} }}] }}
  - {{ name: echo, match: {{ path_prefix: /echo }}, upstream: app, plugins: [{{ use: reach, config: {{ echo_request: x-forwarded-proto }} }}] }}
"#,
            app.url()
        ),
        &["fixture-contract-0-3"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;
    // The response hook reads the request as forwarded: with the
    // proxy's fields, which the upstream got once.
    let echo = client::get(&proxy.url("/echo")).await;
    assert_eq!(echo.status, 200, "{:?}", echo.body);
    assert_eq!(echo.header("x-request-saw"), Some("http"));
    assert_eq!(echo.json()["headers"]["x-forwarded-proto"], "http");
    let plain = client::get(&format!("{}/plain", app.url())).await;

    // The echo's JSON, upper-cased whole; its length set to the new body.
    let upper = client::get(&proxy.url("/upper/a")).await;
    assert_eq!(upper.status, 200, "{:?}", upper.body);
    let text = String::from_utf8(upper.body.to_vec()).unwrap();
    assert!(text.contains(r#""PATH":"/UPPER/A""#), "{text}");
    assert_eq!(text, text.to_ascii_uppercase());
    assert_eq!(
        upper.headers["content-length"].to_str().unwrap(),
        upper.body.len().to_string()
    );
    let original: usize = upper.headers["x-body-bytes"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(
        original,
        upper.body.len(),
        "upper case keeps ASCII's length"
    );

    // A body the plugin refuses is its answer instead; one it passes goes
    // as it came.
    let refused = client::get(&proxy.url("/refuse/secret")).await;
    assert_eq!(refused.status, 502, "{:?}", refused.body);
    assert_eq!(refused.json()["error"], "the response held a refused word");
    let passed = client::get(&proxy.url("/refuse/public")).await;
    assert_eq!(passed.status, 200);
    assert_eq!(passed.json()["path"], "/refuse/public");
    assert!(plain.body.len() > 16, "the echo says more than 16 bytes");

    // Over the plugin's bound: 500, as Envoy answers a buffer overflow.
    let small = client::get(&proxy.url("/small")).await;
    assert_eq!(small.status, 500, "{:?}", small.body);

    // An answer to the response head replaces the upstream's response.
    let answered = client::get(&proxy.url("/answer")).await;
    assert_eq!(answered.status, 451);
    assert_eq!(answered.json()["error"], "answered by the plugin");
}
