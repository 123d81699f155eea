//! `https` upstreams: a configured CA, verification failures, and HTTP/2.

use crate::support::Proxy;
use crate::support::client;
use crate::support::tls::TestPki;
use crate::support::upstream;

/// The proxy on `policy`, loaded from a directory that also holds the
/// test CA as `ca.pem` (for `tls: { ca_file: ca.pem }`).
async fn trusting_ca(pki: &TestPki, policy: &str) -> Proxy {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ca.pem"), &pki.ca_pem).unwrap();
    std::fs::write(dir.path().join("policy.yaml"), policy).unwrap();
    let config = portcullis::config::load_dir(dir.path()).unwrap_or_else(|e| panic!("{e}"));
    Proxy::start_config_for_test(config).await
}

#[tokio::test]
async fn https_upstreams_verify_against_the_configured_ca() {
    let pki = TestPki::new();
    let h1 = upstream::echo_tls("h1", pki.server_config(&[b"http/1.1"])).await;
    let h2 = upstream::echo_tls("h2", pki.server_config(&[b"h2"])).await;
    let policy = format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: trusted, endpoints: ["https://localhost:{p1}"], tls: {{ ca_file: ca.pem }} }}
  - {{ name: untrusted, endpoints: ["https://localhost:{p1}"] }}
  - {{ name: skip, endpoints: ["https://localhost:{p1}"], tls: {{ insecure_skip_verify: true }} }}
  - {{ name: renamed, endpoints: ["https://127.0.0.1:{p1}"], tls: {{ ca_file: ca.pem, server_name: localhost }} }}
  - {{ name: h2, endpoints: ["https://localhost:{p2}"], http2: true, tls: {{ ca_file: ca.pem }} }}
routes:
  - {{ name: trusted, match: {{ path: /trusted }}, upstream: trusted }}
  - {{ name: untrusted, match: {{ path: /untrusted }}, upstream: untrusted }}
  - {{ name: skip, match: {{ path: /skip }}, upstream: skip }}
  - {{ name: renamed, match: {{ path: /renamed }}, upstream: renamed }}
  - {{ name: h2, match: {{ path: /h2 }}, upstream: h2 }}
"#,
        p1 = h1.addr.port(),
        p2 = h2.addr.port()
    );
    let proxy = trusting_ca(&pki, &policy).await;

    let ok = client::get(&proxy.url("/trusted")).await;
    assert_eq!(ok.status, 200, "{:?}", ok.body);
    assert_eq!(ok.json()["upstream"], "h1");
    assert_eq!(ok.json()["version"], "HTTP/1.1");

    let bad = client::get(&proxy.url("/untrusted")).await;
    assert_eq!(bad.status, 502, "an unknown issuer must not be trusted");
    assert_eq!(bad.json()["error"], "upstream unreachable");

    assert_eq!(client::get(&proxy.url("/skip")).await.status, 200);
    assert_eq!(client::get(&proxy.url("/renamed")).await.status, 200);

    let h2 = client::get(&proxy.url("/h2")).await;
    assert_eq!(h2.status, 200);
    assert_eq!(h2.json()["version"], "HTTP/2.0");
}

#[tokio::test]
async fn upstream_host_names_are_resolved() {
    let echo = upstream::echo("named").await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: named, endpoints: ["http://localhost:{}"] }}]
routes: [{{ name: all, match: {{ path_prefix: / }}, upstream: named }}]
"#,
        echo.addr.port()
    ))
    .await;
    let a = client::get(&proxy.url("/x")).await;
    assert_eq!(a.status, 200);
    assert_eq!(
        a.json()["headers"]["host"],
        format!("localhost:{}", echo.addr.port())
    );
}

#[tokio::test]
async fn turning_verification_off_is_warned_once_and_only_where_tls_is_used() {
    let proxy = crate::support::process::ProxyProcess::start(
        r#"
listeners: [{ name: http, bind: "127.0.0.1:0" }]
upstreams:
  - { name: cleartext, endpoints: ["http://127.0.0.1:1"], tls: { insecure_skip_verify: true } }
  - { name: unverified, endpoints: ["https://127.0.0.1:1"], tls: { insecure_skip_verify: true } }
routes:
  - { name: a, match: { path: /a }, upstream: cleartext }
  - { name: b, match: { path: /b }, upstream: unverified }
"#,
        &["--workers", "2"],
    )
    .await;
    // The pipeline (and its warnings) is built before the listeners open.
    let logs = proxy.logs.lock().unwrap().clone();
    let warned: Vec<&String> = logs
        .iter()
        .filter(|l| l.contains("verification is off"))
        .collect();
    assert_eq!(warned.len(), 1, "{logs:#?}");
    assert!(warned[0].contains("unverified"), "{}", warned[0]);
}

/// An HTTP/2 upstream's response head is taken up to the size an HTTP/1.1
/// upstream's is (64 KiB), not h2's 16 KiB default: a large `Set-Cookie`
/// reaches the client instead of turning into a 502.
#[tokio::test]
async fn large_response_heads_come_back_from_http2_upstreams() {
    let cookie = format!("session={}", "s".repeat(24 * 1024));
    let up = {
        let cookie = cookie.clone();
        upstream::serve(move |req: hyper::Request<hyper::body::Incoming>| {
            let cookie = cookie.clone();
            async move {
                hyper::Response::builder()
                    .header("set-cookie", cookie)
                    .body(upstream::full(format!("{:?}", req.version())))
                    .unwrap()
            }
        })
        .await
    };
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: h2c, endpoints: ["http://127.0.0.1:{}"], http2: true }}]
routes: [{{ name: all, match: {{ path_prefix: / }}, upstream: h2c }}]
"#,
        up.addr.port()
    ))
    .await;
    let a = client::get(&proxy.url("/")).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(a.body, "HTTP/2.0");
    assert_eq!(a.header("set-cookie"), Some(cookie.as_str()));
}

/// A streamed upload (written by hyper's client in the proxy) reaches a
/// cleartext and an https HTTP/1.1 upstream whole and in order: frames of
/// many sizes, from one byte to more than a socket buffer, each filled
/// with its own bytes.
#[tokio::test]
async fn streamed_uploads_reach_http1_upstreams_whole_in_cleartext_and_tls() {
    let pki = TestPki::new();
    let plain = upstream::echo("plain").await;
    let tls = upstream::echo_tls("tls", pki.server_config(&[b"http/1.1"])).await;
    let policy = format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: plain, endpoints: ["http://127.0.0.1:{}"] }}
  - {{ name: tls, endpoints: ["https://localhost:{}"], tls: {{ ca_file: ca.pem }} }}
routes:
  - {{ name: plain, match: {{ path: /plain }}, upstream: plain }}
  - {{ name: tls, match: {{ path: /tls }}, upstream: tls }}
"#,
        plain.addr.port(),
        tls.addr.port()
    );
    let proxy = trusting_ca(&pki, &policy).await;

    let sizes: Vec<usize> = (0..120)
        .map(|i| [1, 7, 100, 4096, 16_383, 65_536, 300_000][i % 7] + i)
        .collect();
    let frames: Vec<bytes::Bytes> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            (0..n)
                .map(|j| (i * 31 + j * 7) as u8)
                .collect::<Vec<u8>>()
                .into()
        })
        .collect();
    let whole: Vec<u8> = frames.iter().flat_map(|f| f.iter().copied()).collect();
    for path in ["/plain", "/tls"] {
        let stream = futures_util::stream::iter(
            frames
                .clone()
                .into_iter()
                .map(|f| Ok::<_, std::io::Error>(hyper::body::Frame::data(f))),
        );
        let req = hyper::Request::post(proxy.url(path))
            .body(http_body_util::BodyExt::boxed(
                http_body_util::StreamBody::new(stream),
            ))
            .unwrap();
        let a = client::send(&client::http1(), req).await;
        assert_eq!(a.status, 200, "{path}: {:?}", a.body);
        let echoed = a.json();
        assert_eq!(echoed["body_len"], whole.len(), "{path}");
        assert_eq!(echoed["body_fnv"], upstream::fnv(&whole), "{path}");
        assert_eq!(echoed["headers"]["transfer-encoding"], "chunked", "{path}");
    }
}

/// A burst of requests to an HTTP/2 upstream with no connection yet (at
/// start, after it restarted) shares the one connection made for the
/// first of them, as Envoy's and hyper's pools do, instead of opening one
/// each and keeping the last.
#[tokio::test]
async fn a_burst_to_a_cold_http2_upstream_shares_one_connection() {
    let up = upstream::echo("h2").await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: up, endpoints: ["{}"], http2: true }}]
routes: [{{ name: all, match: {{ path_prefix: / }}, upstream: up }}]
"#,
        up.url()
    ))
    .await;
    let mut peers = std::collections::BTreeSet::new();
    for answer in h2_burst(&proxy, 50).await {
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        assert_eq!(answer.json()["version"], "HTTP/2.0");
        peers.insert(answer.json()["peer"].as_str().unwrap().to_owned());
    }
    assert_eq!(peers.len(), 1, "{peers:?}");
}

/// Requests that waited on a dial to an HTTP/2 upstream that failed get
/// its answer (here a 504: the TLS handshake never ends) at the same
/// time, from that one dial: they do not each dial again after it, one
/// connect timeout after another.
#[tokio::test]
async fn requests_waiting_on_a_failed_http2_dial_share_its_failure() {
    let hung = upstream::silent().await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - name: hung
    endpoints: ["https://127.0.0.1:{}"]
    http2: true
    retries: 0
    timeouts: {{ connect: 1s }}
routes: [{{ name: all, match: {{ path_prefix: / }}, upstream: hung }}]
"#,
        hung.addr.port()
    ))
    .await;
    for answer in h2_burst(&proxy, 10).await {
        assert_eq!(answer.status, 504, "{:?}", answer.body);
    }
    assert_eq!(hung.connections(), 1);
}

/// `n` GETs at once on one HTTP/2 connection to the proxy (so one worker,
/// and one pool, takes them all).
async fn h2_burst(proxy: &Proxy, n: usize) -> Vec<client::Answer> {
    let h2 = client::h2c();
    let burst = (0..n).map(|i| {
        let req = hyper::Request::get(proxy.url(&format!("/{i}")))
            .body(client::body(bytes::Bytes::new()))
            .unwrap();
        client::send(&h2, req)
    });
    futures_util::future::join_all(burst).await
}
