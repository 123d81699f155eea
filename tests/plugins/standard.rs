//! The standard plugins on requests: jwt-auth, canary-route, forward decisions, ip-allow, basic-auth.

use super::*;

pub(super) fn jwt(
    header: serde_json::Value,
    claims: serde_json::Value,
    sign: impl Fn(&[u8]) -> Vec<u8>,
) -> String {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let signed = format!(
        "{}.{}",
        b64.encode(header.to_string()),
        b64.encode(claims.to_string())
    );
    format!("{signed}.{}", b64.encode(sign(signed.as_bytes())))
}

pub(super) fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

#[tokio::test]
pub(super) async fn jwt_auth_checks_signature_expiry_and_audience() {
    use base64::Engine as _;
    use p256::ecdsa::signature::Signer;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let ec_key = p256::ecdsa::SigningKey::random(&mut rand_core::OsRng);
    let point = ec_key.verifying_key().to_encoded_point(false);
    let jwks = serde_json::json!({ "keys": [
        { "kty": "EC", "kid": "k1", "crv": "P-256", "x": b64.encode(point.x().unwrap()), "y": b64.encode(point.y().unwrap()) }
    ]});
    let (api, hits) = upstream::counted_echo("counted").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: api, endpoints: ["{}"] }}]
plugins: [{{ name: jwt, path: jwt-auth.wasm }}]
routes:
  - name: api
    match: {{ path_prefix: /api }}
    upstream: api
    plugins:
      - use: jwt
        config:
          hs256_secret: "${{JWT_SECRET}}"
          jwks: {jwks}
          issuer: https://issuer.example
          audiences: [runtime-api]
          claims_to_headers: {{ sub: x-user, tenant: x-tenant }}
  - name: open
    match: {{ path_prefix: /open }}
    upstream: api
    plugins:
      - use: jwt
        config:
          hs256_secret: "${{JWT_SECRET}}"
          required: false
          claims_to_headers: {{ sub: x-user }}
"#,
            api.url()
        ),
        &["jwt-auth"],
    );
    let proxy = Proxy::start_dir(dir, &[("JWT_SECRET", "hs-secret".into())]).await;
    let claims = |exp: u64, aud: &str| serde_json::json!({ "sub": "alice", "tenant": "blue", "iss": "https://issuer.example", "aud": aud, "exp": exp });
    let es256 = |c: serde_json::Value| {
        jwt(serde_json::json!({ "alg": "ES256", "kid": "k1" }), c, |m| {
            let sig: p256::ecdsa::Signature = ec_key.sign(m);
            sig.to_bytes().to_vec()
        })
    };
    let hs256 = |c: serde_json::Value| {
        jwt(serde_json::json!({ "alg": "HS256" }), c, |m| {
            use hmac::Mac;
            let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(b"hs-secret").unwrap();
            mac.update(m);
            mac.finalize().into_bytes().to_vec()
        })
    };
    let call = |token: Option<String>| {
        let url = proxy.url("/api/me");
        async move {
            let mut req = Request::get(url).header("x-user", "mallory");
            if let Some(t) = token {
                req = req.header("authorization", format!("Bearer {t}"));
            }
            client::send(&client::http1(), req.body(body(Bytes::new())).unwrap()).await
        }
    };
    let later = now_secs() + 600;

    let token = es256(claims(later, "runtime-api"));
    let a = call(Some(token.clone())).await;
    assert_eq!(a.status, 200, "{:?}", String::from_utf8_lossy(&a.body));
    assert_eq!(
        a.json()["headers"]["x-user"],
        "alice",
        "the claim replaces a client-sent header"
    );
    assert_eq!(a.json()["headers"]["x-tenant"], "blue");
    // Again: the plugin remembers the token, and the claims still go on.
    let again = call(Some(token.clone())).await;
    assert_eq!(again.status, 200);
    assert_eq!(again.json()["headers"]["x-user"], "alice");
    // The remembered token with its signature changed is not it.
    let mut tampered = token.clone();
    tampered.replace_range(tampered.len() - 4.., "AAAA");
    assert_eq!(call(Some(tampered)).await.status, 401);
    assert_eq!(
        call(Some(hs256(claims(later, "runtime-api")))).await.status,
        200
    );

    let expired = call(Some(es256(claims(now_secs() - 3600, "runtime-api")))).await;
    assert_eq!(expired.status, 401);
    assert_eq!(expired.header("www-authenticate"), Some("Bearer"));
    assert_eq!(
        call(Some(es256(claims(later, "other-api")))).await.status,
        401
    );
    assert_eq!(call(None).await.status, 401);
    assert_eq!(call(Some("not.a.jwt".into())).await.status, 401);
    assert_eq!(
        hits.load(Ordering::SeqCst),
        3,
        "refused requests never reach the upstream"
    );

    // Where a token is optional, a request without one passes, but not a
    // claim header the client wrote itself.
    let req = Request::get(proxy.url("/open/me"))
        .header("x-user", "mallory")
        .body(body(Bytes::new()))
        .unwrap();
    let a = client::send(&client::http1(), req).await;
    assert_eq!(a.status, 200);
    assert!(a.json()["headers"].get("x-user").is_none(), "{}", a.json());
}

#[tokio::test]
pub(super) async fn canary_route_by_header_cookie_and_share() {
    let stable = upstream::echo("stable").await;
    let canary = upstream::echo("canary").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: stable, endpoints: ["{}"] }}
  - {{ name: canary, endpoints: ["{}"] }}
plugins: [{{ name: canary, path: canary-route.wasm }}]
routes:
  - name: app
    match: {{ path_prefix: / }}
    upstream: stable
    plugins:
      - use: canary
        config: {{ upstream: canary, percent: 25, header: {{ name: x-canary, value: always }}, cookie: {{ name: canary }} }}
"#,
            stable.url(),
            canary.url()
        ),
        &["canary-route"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;
    let c = client::http1();
    let which = |req: Request<_>| {
        let c = c.clone();
        async move {
            client::send(&c, req).await.json()["upstream"]
                .as_str()
                .unwrap()
                .to_owned()
        }
    };
    let header = Request::get(proxy.url("/x"))
        .header("x-canary", "always")
        .body(body(Bytes::new()))
        .unwrap();
    assert_eq!(which(header).await, "canary");
    let cookie = Request::get(proxy.url("/x"))
        .header("cookie", "a=1; canary=1")
        .body(body(Bytes::new()))
        .unwrap();
    assert_eq!(which(cookie).await, "canary");
    // Browsers over HTTP/2 send each cookie as a field of its own.
    let crumbs = Request::get(proxy.url("/x"))
        .header("cookie", "a=1")
        .header("cookie", "canary=1")
        .body(body(Bytes::new()))
        .unwrap();
    let a = client::send(&client::h2c(), crumbs).await;
    assert_eq!(a.json()["upstream"], "canary");
    let mut to_canary = 0;
    for _ in 0..100 {
        if which(
            Request::get(proxy.url("/x"))
                .body(body(Bytes::new()))
                .unwrap(),
        )
        .await
            == "canary"
        {
            to_canary += 1;
        }
    }
    // Each plugin instance spreads exactly 25 in 100; requests served by
    // more than one instance land close to that.
    assert!(
        (15..=35).contains(&to_canary),
        "{to_canary} of 100 went to the canary"
    );
}

#[tokio::test]
pub(super) async fn each_field_of_a_forward_decision_is_applied() {
    // The host lifts a `forward` with nothing in it by a shortcut; each
    // field set alone must still take effect (and nothing set must change
    // nothing).
    let main = upstream::echo("main").await;
    let other = upstream::echo("other").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: main, endpoints: ["{}"] }}
  - {{ name: other, endpoints: ["{}"] }}
plugins: [{{ name: fwd, path: fixture-forward.wasm }}, {{ name: rules, path: header-rules.wasm }}]
routes:
  - {{ name: same, match: {{ path: /same }}, upstream: main, plugins: [{{ use: fwd }}] }}
  - {{ name: path, match: {{ path: /path }}, upstream: main, plugins: [{{ use: fwd, config: {{ path: "/elsewhere?x=1" }} }}] }}
  - {{ name: upstream, match: {{ path: /upstream }}, upstream: main, plugins: [{{ use: fwd, config: {{ upstream: other }} }}] }}
  - {{ name: remove, match: {{ path: /remove }}, upstream: main, plugins: [{{ use: rules, config: {{ request: {{ remove: [x-drop] }} }} }}] }}
  - {{ name: set, match: {{ path: /set }}, upstream: main, plugins: [{{ use: rules, config: {{ request: {{ set: {{ x-set: "1" }} }} }} }}] }}
  - {{ name: add, match: {{ path: /add }}, upstream: main, plugins: [{{ use: rules, config: {{ request: {{ add: {{ x-add: "1" }} }} }} }}] }}
"#,
            main.url(),
            other.url()
        ),
        &["fixture-forward", "header-rules"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;
    let c = client::http1();
    let seen = |path: &'static str| {
        let req = Request::get(proxy.url(path))
            .header("x-drop", "d")
            .body(body(Bytes::new()))
            .unwrap();
        let c = c.clone();
        async move {
            let a = client::send(&c, req).await;
            assert_eq!(a.status, 200, "{path}");
            a.json()
        }
    };
    let same = seen("/same").await;
    assert_eq!(
        (same["upstream"].as_str(), same["path"].as_str()),
        (Some("main"), Some("/same"))
    );
    assert_eq!(same["headers"]["x-drop"], "d");
    assert_eq!(seen("/path").await["path"], "/elsewhere?x=1");
    assert_eq!(seen("/upstream").await["upstream"], "other");
    assert!(seen("/remove").await["headers"].get("x-drop").is_none());
    assert_eq!(seen("/set").await["headers"]["x-set"], "1");
    assert_eq!(seen("/add").await["headers"]["x-add"], "1");
}

#[tokio::test]
pub(super) async fn a_plugin_reads_every_byte_of_the_header_it_asks_for() {
    // The header calls lift short ASCII names onto the stack and write the
    // value straight into the plugin; long and non-ASCII names take
    // wasmtime's own lift. The fixture echoes what it got, in hex.
    let app = upstream::echo("app").await;
    let long = format!("x-{}", "long".repeat(20));
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: echo, path: fixture-forward.wasm }}]
routes:
  - {{ name: token, match: {{ path: /token }}, upstream: app, plugins: [{{ use: echo, config: {{ echo: X-Token }} }}] }}
  - {{ name: long, match: {{ path: /long }}, upstream: app, plugins: [{{ use: echo, config: {{ echo: "{long}" }} }}] }}
  - {{ name: empty, match: {{ path: /empty }}, upstream: app, plugins: [{{ use: echo, config: {{ echo: x-empty }} }}] }}
  - {{ name: missing, match: {{ path: /missing }}, upstream: app, plugins: [{{ use: echo, config: {{ echo: x-missing }} }}] }}
  - {{ name: unicode, match: {{ path: /unicode }}, upstream: app, plugins: [{{ use: echo, config: {{ echo: "x-tökén" }} }}] }}
  - {{ name: response, match: {{ path: /response }}, upstream: app, plugins: [{{ use: echo, config: {{ echo_response: Content-Type }} }}] }}
"#,
            app.url()
        ),
        &["fixture-forward"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;
    let c = client::http1();
    let send = |path: &'static str| {
        let req = Request::get(proxy.url(path))
            .header("x-token", HeaderValue::from_bytes(b"a\xffb c").unwrap())
            .header("x-token", "second")
            .header(long.as_str(), "far")
            .header("x-empty", "")
            .body(body(Bytes::new()))
            .unwrap();
        let c = c.clone();
        async move {
            let a = client::send(&c, req).await;
            assert_eq!(a.status, 200, "{path}");
            a
        }
    };
    let echoed = |a: Answer| a.json()["headers"]["x-echo"].as_str().map(str::to_owned);
    // The first value, every byte of it, whatever the name's case.
    assert_eq!(echoed(send("/token").await).as_deref(), Some("61ff622063"));
    assert_eq!(echoed(send("/long").await).as_deref(), Some("666172"));
    assert_eq!(echoed(send("/empty").await).as_deref(), Some(""));
    assert_eq!(echoed(send("/missing").await).as_deref(), Some("absent"));
    assert_eq!(echoed(send("/unicode").await).as_deref(), Some("absent"));
    let response = send("/response").await;
    assert_eq!(
        response.headers["x-echo"],
        "application/json"
            .bytes()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    );
}

#[tokio::test]
pub(super) async fn ip_allow_trusts_only_the_configured_hops() {
    let app = upstream::echo("app").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: ips, path: ip-allow.wasm }}]
routes:
  - {{ name: local, match: {{ path: /local }}, upstream: app, plugins: [{{ use: ips, config: {{ allow: [127.0.0.0/8] }} }}] }}
  - {{ name: office, match: {{ path: /office }}, upstream: app, plugins: [{{ use: ips, config: {{ allow: [203.0.113.0/24], deny: [203.0.113.66], trusted_hops: 1 }} }}] }}
"#,
            app.url()
        ),
        &["ip-allow"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;
    let get = |path: &str, xff: Option<&str>| {
        let mut req = Request::get(proxy.url(path));
        if let Some(x) = xff {
            req = req.header("x-forwarded-for", x);
        }
        let req = req.body(body(Bytes::new())).unwrap();
        async move { client::send(&client::http1(), req).await.status }
    };
    assert_eq!(get("/local", None).await, 200);
    // A client cannot talk its way in with its own X-Forwarded-For: only
    // the entry the trusted hop appended counts.
    assert_eq!(get("/local", Some("127.0.0.1")).await, 200);
    assert_eq!(get("/office", Some("203.0.113.10")).await, 200);
    assert_eq!(
        get("/office", Some("203.0.113.10, 198.51.100.7")).await,
        403
    );
    assert_eq!(get("/office", Some("203.0.113.66")).await, 403);
    assert_eq!(get("/office", None).await, 403);
    // A trusted proxy that adds a line of its own (HAProxy) instead of
    // appending: the client's line, first, does not decide.
    let req = Request::get(proxy.url("/office"))
        .header("x-forwarded-for", "203.0.113.10")
        .header("x-forwarded-for", "198.51.100.7")
        .body(body(Bytes::new()))
        .unwrap();
    assert_eq!(client::send(&client::http1(), req).await.status, 403);
}

#[tokio::test]
pub(super) async fn basic_auth_asks_for_credentials_and_passes_the_user_on() {
    use base64::Engine as _;
    let (app, hits) = upstream::counted_echo("app").await;
    // `htpasswd -nbB alice s3cret` (cost 5) and `htpasswd -nbs bob hunter2`.
    let users = "alice:$2y$05$PmaEhzIC7gk0i.vApT2PWO72KTz5zXcNK5vlbQ/Omzn0iGCuUWXgS\nbob:{SHA}87u9ZqY9S/F0eUBXjsPQEDUw4h0=\n";
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: basic, path: basic-auth.wasm }}]
routes:
  - name: ui
    match: {{ path_prefix: /ui }}
    upstream: app
    plugins:
      - use: basic
        timeout: 200ms
        config: {{ htpasswd: {{ from_file: htpasswd }}, realm: Argo, user_header: x-remote-user }}
"#,
            app.url()
        ),
        &["basic-auth"],
    );
    std::fs::write(dir.path().join("htpasswd"), users).unwrap();
    let proxy = Proxy::start_dir(dir, &[]).await;
    let get = |credentials: Option<&str>| {
        let mut req = Request::get(proxy.url("/ui/x")).header("x-remote-user", "admin");
        if let Some(c) = credentials {
            let encoded = base64::engine::general_purpose::STANDARD.encode(c);
            req = req.header("authorization", format!("Basic {encoded}"));
        }
        let req = req.body(body(Bytes::new())).unwrap();
        async move { client::send(&client::http1(), req).await }
    };
    for refused in [
        None,
        Some("alice:wrong"),
        Some("mallory:s3cret"),
        Some("bob:s3cret"),
    ] {
        let answer = get(refused).await;
        assert_eq!(answer.status, 401, "{refused:?}");
        assert_eq!(
            answer.header("www-authenticate"),
            Some(r#"Basic realm="Argo", charset="UTF-8""#)
        );
    }
    assert_eq!(
        hits.load(Ordering::SeqCst),
        0,
        "a refusal reached the upstream"
    );
    // Twice each: the second from what the instance remembers.
    for (credentials, user) in [("alice:s3cret", "alice"), ("bob:hunter2", "bob")].repeat(2) {
        let answer = get(Some(credentials)).await;
        assert_eq!(answer.status, 200, "{credentials}");
        let seen = answer.json();
        // The client's own claim replaced, the password kept back.
        assert_eq!(seen["headers"]["x-remote-user"], user);
        assert!(seen["headers"].get("authorization").is_none(), "{seen}");
    }
    assert_eq!(hits.load(Ordering::SeqCst), 4);
}

#[test]
pub(super) fn check_refuses_htpasswd_lines_basic_auth_cannot_use() {
    let dir = policy_dir(
        r#"
upstreams: [{ name: app, endpoints: ["http://127.0.0.1:9"] }]
plugins: [{ name: basic, path: basic-auth.wasm }]
routes:
  - name: ui
    match: { path_prefix: /ui }
    upstream: app
    plugins: [{ use: basic, config: { htpasswd: "carol:$apr1$x1y2z3$0123456789abcdefghijk." } }]
"#,
        &["basic-auth"],
    );
    let (ok, _, stderr) = crate::support::check(dir.path());
    assert!(!ok, "{stderr}");
    assert!(
        stderr.contains("htpasswd line 1: MD5 hashes are not supported"),
        "{stderr}"
    );
    assert!(stderr.contains("htpasswd -nB USER"), "{stderr}");
}

/// Behind a TCP balancer (an AWS NLB) a listener with `proxy_protocol`
/// takes the client's address from the PROXY header the balancer sends:
/// `ip-allow` judges that address, the upstream sees it in
/// `X-Forwarded-For`. The balancer's own health checks (version 2 LOCAL)
/// keep the connection's address; a connection without a header is
/// closed and counted, and the listener goes on serving.
#[tokio::test]
pub(super) async fn a_proxy_protocol_listener_sees_the_client_behind_the_balancer() {
    let app = upstream::echo("app").await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: nlb, bind: "127.0.0.1:0", proxy_protocol: true, header_read_timeout: 500ms }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: ips, path: ip-allow.wasm }}]
routes:
  - {{ name: office, match: {{ path: /office }}, upstream: app, plugins: [{{ use: ips, config: {{ allow: [203.0.113.0/24] }} }}] }}
  - {{ name: open, match: {{ path: /open }}, upstream: app }}
"#,
            app.url()
        ),
        &["ip-allow"],
    );
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let request = |header: &[u8], path: &str| {
        let mut raw = header.to_vec();
        raw.extend_from_slice(
            format!("GET {path} HTTP/1.1\r\nhost: app\r\nconnection: close\r\n\r\n").as_bytes(),
        );
        let addr = proxy.addr;
        async move { client::raw(addr, &raw).await }
    };
    let v1 = |source: &str| format!("PROXY TCP4 {source} 10.0.0.1 40000 8080\r\n").into_bytes();
    let office = request(&v1("203.0.113.10"), "/office").await;
    assert!(office.starts_with("HTTP/1.1 200 "), "{office}");
    assert!(
        office.contains(r#""x-forwarded-for":"203.0.113.10""#),
        "{office}"
    );
    let outside = request(&v1("198.51.100.7"), "/office").await;
    assert!(outside.starts_with("HTTP/1.1 403 "), "{outside}");

    // Version 2, IPv6 source, with a TLV as AWS adds one.
    let mut v2 = b"\r\n\r\n\0\r\nQUIT\n\x21\x21\x00\x2b".to_vec();
    v2.extend_from_slice(&[0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7]);
    v2.extend_from_slice(&[0; 16]);
    v2.extend_from_slice(&[
        0x9c, 0x40, 0x1f, 0x90, 0xea, 0x00, 0x04, b'v', b'p', b'c', b'e',
    ]);
    let open = request(&v2, "/open").await;
    assert!(
        open.contains(r#""x-forwarded-for":"2001:db8::7""#),
        "{open}"
    );
    // A health check from the balancer itself: the connection's address.
    let local = b"\r\n\r\n\0\r\nQUIT\n\x20\x00\x00\x00";
    let check = request(local, "/open").await;
    assert!(
        check.contains(r#""x-forwarded-for":"127.0.0.1""#),
        "{check}"
    );
    assert!(request(local, "/office").await.starts_with("HTTP/1.1 403 "));

    // A client that reaches the listener without the balancer is closed
    // unanswered (reset, as its request is left unread).
    let answer =
        client::raw_until_closed(proxy.addr, b"GET /open HTTP/1.1\r\nhost: a\r\n\r\n").await;
    assert_eq!(answer, "");
    proxy
        .metrics_showing(&[crate::support::process::connection_errors(
            "nlb",
            "proxy_protocol",
            1,
        )])
        .await;
    // One that starts a header and stalls is closed at the header-read
    // timeout, and counted as a slow head.
    let mut stalled = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    tokio::io::AsyncWriteExt::write_all(&mut stalled, b"PROXY TCP4 203.0")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let closed = tokio::io::AsyncReadExt::read_to_end(&mut stalled, &mut answer);
    tokio::time::timeout(Duration::from_secs(10), closed)
        .await
        .expect("a stalled header was not cut")
        .expect("closed cleanly");
    proxy
        .metrics_showing(&[crate::support::process::connection_errors(
            "nlb",
            "header_timeout",
            1,
        )])
        .await;
    let again = request(&v1("203.0.113.11"), "/office").await;
    assert!(again.starts_with("HTTP/1.1 200 "), "{again}");
}
