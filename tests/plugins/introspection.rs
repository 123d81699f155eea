//! The standard token-introspection plugin (RFC 7662) against an
//! authorization server: a real one over loopback that speaks the RFC,
//! checks the proxy's client credentials and counts what it is asked.

use std::collections::HashMap;
use std::sync::Mutex;

use super::*;

/// The proxy's client secret at the server: `:` and `&` must be
/// form-encoded before the Basic encoding (RFC 6749, 2.3.1).
const SECRET: &str = "s3:cr&t";

/// Introspection answers by token, and how often each was asked.
struct Server {
    upstream: Upstream,
    asked: Arc<Mutex<HashMap<String, usize>>>,
}

async fn authorization_server() -> Server {
    use base64::Engine as _;
    let asked = Arc::new(Mutex::new(HashMap::<String, usize>::new()));
    let counts = asked.clone();
    let upstream = upstream::serve(move |req: Request<hyper::body::Incoming>| {
        let counts = counts.clone();
        async move {
            use http_body_util::BodyExt;
            let reply = |status: u16, json: serde_json::Value| {
                Response::builder()
                    .status(status)
                    .header("content-type", "application/json")
                    .body(upstream::full(json.to_string()))
                    .unwrap()
            };
            let basic = req
                .headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok()?.strip_prefix("Basic "))
                .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
                .map(|b| String::from_utf8(b).unwrap());
            let form_type = req.headers()["content-type"] == "application/x-www-form-urlencoded";
            let path_ok = req.uri().path() == "/oauth2/introspect" && req.method() == "POST";
            let body = req.into_body().collect().await.unwrap().to_bytes();
            let form: HashMap<String, String> =
                form_urlencoded::parse(&body).into_owned().collect();
            let decode = |s: &str| {
                form_urlencoded::parse(format!("v={s}").as_bytes())
                    .next()
                    .map(|(_, v)| v.into_owned())
            };
            let client = basic.as_deref().and_then(|b| b.split_once(':'));
            let authenticated = client.is_some_and(|(id, secret)| {
                decode(id).as_deref() == Some("portcullis")
                    && decode(secret).as_deref() == Some(SECRET)
            });
            if !(authenticated && form_type && path_ok) {
                return reply(401, serde_json::json!({ "error": "invalid_client" }));
            }
            let token = form.get("token").cloned().unwrap_or_default();
            *counts.lock().unwrap().entry(token.clone()).or_default() += 1;
            let exp = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs()
                + 3600;
            let active = |scope: &str| {
                serde_json::json!({
                    "active": true, "sub": "alice", "client_id": "web", "scope": scope,
                    "aud": ["other", "api"], "iss": "https://idp.example", "exp": exp,
                })
            };
            match token.as_str() {
                "alice" => reply(200, active("read write")),
                "reader" => reply(200, active("read")),
                "broken" => reply(500, serde_json::json!({ "error": "server_error" })),
                _ => reply(200, serde_json::json!({ "active": false })),
            }
        }
    })
    .await;
    Server { upstream, asked }
}

#[tokio::test]
pub(super) async fn token_introspection_asks_the_server_once_per_token_and_refuses_as_rfc_6750_says()
 {
    let (api, hits) = upstream::counted_echo("api").await;
    let idp = authorization_server().await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: api, endpoints: ["{}"] }}
  - {{ name: idp, endpoints: ["{}"] }}
plugins: [{{ name: introspect, path: "builtin:token-introspection" }}]
routes:
  - name: api
    match: {{ path_prefix: /api }}
    upstream: api
    plugins:
      - use: introspect
        config:
          upstream: idp
          path: /oauth2/introspect
          client_id: portcullis
          client_secret: "{SECRET}"
          issuer: https://idp.example
          audiences: [api]
          scopes: [write]
          claims_to_headers: {{ sub: x-user, client_id: x-client }}
"#,
            api.url(),
            idp.upstream.url()
        ),
        &[],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;
    let c = client::http1();
    let send = |token: Option<&'static str>| {
        let mut req = Request::get(proxy.url("/api/orders")).header("x-user", "mallory");
        if let Some(t) = token {
            req = req.header("authorization", format!("Bearer {t}"));
        }
        let c = c.clone();
        let req = req.body(body(Bytes::new())).unwrap();
        async move { client::send(&c, req).await }
    };
    let challenge = |a: &Answer| a.headers["www-authenticate"].to_str().unwrap().to_owned();

    // Active, with the scope: on to the upstream, with the answer's
    // fields in place of the client's own header.
    for _ in 0..3 {
        let ok = send(Some("alice")).await;
        assert_eq!(ok.status, 200, "{:?}", ok.body);
        assert_eq!(ok.json()["headers"]["x-user"], "alice");
        assert_eq!(ok.json()["headers"]["x-client"], "web");
    }
    assert_eq!(
        idp.asked.lock().unwrap().get("alice").copied(),
        Some(1),
        "an answer is kept until the token's exp: the server is asked once"
    );

    // No token; one the server does not vouch for; one without the scope.
    let missing = send(None).await;
    assert_eq!(missing.status, 401);
    assert_eq!(challenge(&missing), "Bearer");
    let inactive = send(Some("revoked")).await;
    assert_eq!(inactive.status, 401);
    assert_eq!(challenge(&inactive), r#"Bearer error="invalid_token""#);
    assert_eq!(inactive.json()["plugin"], "introspect");
    let reader = send(Some("reader")).await;
    assert_eq!(reader.status, 403);
    assert_eq!(
        challenge(&reader),
        r#"Bearer error="insufficient_scope", scope="write""#
    );
    // A refusal of an active token is kept too; an inactive one is not
    // (anyone can make those).
    send(Some("reader")).await;
    send(Some("revoked")).await;
    let asked = idp.asked.lock().unwrap().clone();
    assert_eq!((asked["reader"], asked["revoked"]), (1, 2));

    // The server fails: neither let on nor called invalid.
    let broken = send(Some("broken")).await;
    assert_eq!(broken.status, 503, "{:?}", broken.body);
    assert_eq!(broken.json()["error"], "token introspection unavailable");
    assert_eq!(
        hits.load(Ordering::SeqCst),
        3,
        "only alice's requests reached the upstream"
    );
}

#[test]
pub(super) fn check_names_what_is_wrong_in_a_token_introspection_config() {
    let dir = policy_dir(
        r#"
upstreams: [{ name: idp, endpoints: ["http://127.0.0.1:9"] }]
plugins: [{ name: introspect, path: "builtin:token-introspection" }]
routes:
  - name: api
    match: { path_prefix: /api }
    upstream: idp
    plugins: [{ use: introspect, config: { upstream: idp, path: introspect, client_id: me } }]
"#,
        &[],
    );
    let (ok, _, stderr) = crate::support::check(dir.path());
    assert!(!ok, "{stderr}");
    assert!(
        stderr.contains("plugin `introspect` on route `api`")
            && stderr
                .contains("`path`: the introspection endpoint's path, from `/` (not `introspect`)"),
        "{stderr}"
    );
}
