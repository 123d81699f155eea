//! HTTP/3 on an HTTPS listener (`http3: true`): QUIC on the listener's
//! port, advertised by `Alt-Svc` on its HTTP/1.1 and HTTP/2 answers, its
//! requests through the same routes as theirs.

use std::time::Duration;

use bytes::Bytes;

use crate::support::aioquic;
use crate::support::process::ProxyProcess;
use crate::support::tls::{self, TestPki};
use crate::support::upstream;

/// An HTTPS listener with `http3` and `listener_extra`, routes to
/// `upstream` and a local answer at /local.
fn policies(pki: &TestPki, upstream: &str, listener_extra: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    super::write_pair(dir.path(), pki);
    let policy = format!(
        r#"
listeners:
  - name: https
    bind: "127.0.0.1:0"
    tls: {{ cert: tls.crt, key: tls.key }}
    http3: true{listener_extra}
upstreams: [{{ name: svc, endpoints: ["{upstream}"] }}]
routes:
  - {{ name: local, match: {{ path: /local }}, respond: {{ status: 204 }} }}
  - {{ name: small, match: {{ path: /small }}, upstream: svc, max_request_body: 1KiB }}
  - {{ name: any, match: {{ path_prefix: / }}, upstream: svc }}
"#
    );
    std::fs::write(dir.path().join("policy.yaml"), policy).unwrap();
    dir
}

async fn h3(
    proxy: &ProxyProcess,
    ca: &str,
    method: &str,
    path: &str,
    body: Vec<u8>,
) -> crate::support::client::Answer {
    tls::h3_request(proxy.addr, "localhost", ca, method, path, Bytes::from(body))
        .await
        .expect("HTTP/3 exchange")
}

#[tokio::test]
async fn an_https_listener_serves_http3_through_its_routes_and_advertises_it() {
    let pki = TestPki::new();
    let echo = upstream::echo("svc").await;
    let dir = policies(&pki, &echo.url(), "");
    let mut proxy = ProxyProcess::start_on(dir.path(), &[]).await;

    // HTTP/1.1 and HTTP/2 answers name the port HTTP/3 is on.
    let advertised = format!("h3=\":{}\"; ma=86400", proxy.addr.port());
    for (alpn, path, protocol) in [
        (&[&b"h2"[..]][..], "/over-h2", "HTTP/2"),
        (&[&b"http/1.1"[..]][..], "/over-h1", "HTTP/1.1"),
    ] {
        let (_, a) = tls::https_get(proxy.addr, "localhost", &pki.ca_pem, alpn, path)
            .await
            .unwrap();
        assert_eq!(a.header("alt-svc"), Some(advertised.as_str()), "{alpn:?}");
        // The access line says which protocol.
        let line = proxy.wait_for_log(&format!("\"path\":\"{path}\"")).await;
        let said = format!("\"protocol\":\"{protocol}\"");
        assert!(line.contains(&said), "{line}");
    }

    let a = h3(&proxy, &pki.ca_pem, "GET", "/over-quic?q=1", Vec::new()).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert!(
        a.header("alt-svc").is_none(),
        "HTTP/3 answers need no Alt-Svc"
    );
    let seen = a.json();
    assert_eq!(seen["upstream"], "svc");
    assert_eq!(seen["target"], "/over-quic?q=1");
    assert_eq!(seen["headers"]["x-forwarded-proto"], "https", "{seen}");
    assert_eq!(seen["headers"]["x-forwarded-host"], "localhost", "{seen}");

    // An upload streams through whole.
    let data: Vec<u8> = (0..(1 << 20) / 4)
        .flat_map(|i: u32| i.to_le_bytes())
        .collect();
    let a = h3(&proxy, &pki.ca_pem, "POST", "/upload", data.clone()).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    let seen = a.json();
    assert_eq!(seen["body_len"], data.len());
    assert_eq!(seen["body_fnv"], upstream::fnv(&data));

    // The route's own answers and limits, as on TCP.
    let a = h3(&proxy, &pki.ca_pem, "GET", "/local", Vec::new()).await;
    assert_eq!(a.status, 204);
    let a = h3(&proxy, &pki.ca_pem, "POST", "/small", vec![b'x'; 4096]).await;
    assert_eq!(a.status, 413, "{:?}", a.body);

    // The access line says which protocol, and the TLS version QUIC has.
    let line = proxy.wait_for_log("\"path\":\"/upload\"").await;
    assert!(line.contains("\"protocol\":\"HTTP/3\""), "{line}");
    assert!(line.contains("\"tls\":\"TLSv1.3\""), "{line}");
}

/// A client that opens a connection and sends nothing is closed after
/// the listener's keep-alive timeout, not kept; the listener's connection
/// cap counts QUIC connections too.
#[tokio::test]
async fn http3_connections_are_capped_and_timed_out_as_the_listeners() {
    let pki = TestPki::new();
    let echo = upstream::echo("svc").await;
    let extra = "\n    keepalive_timeout: 1s\n    max_connections: 1";
    let dir = policies(&pki, &echo.url(), extra);
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let (addr, ca) = (proxy.addr, pki.ca_pem.clone());
    let idle = tokio::spawn(async move { tls::h3_idle(addr, "localhost", &ca).await });
    proxy
        .wait_status("the idle connection counted", |s| {
            s["config"]["listeners"][0]["connections"] == 1
        })
        .await;
    // While it holds the one slot, another connection is refused.
    let refused = tls::h3_request(
        addr,
        "localhost",
        &pki.ca_pem,
        "GET",
        "/second",
        Bytes::new(),
    )
    .await;
    assert!(refused.is_err(), "served past the cap: {refused:?}");
    let held = idle.await.unwrap().expect("the idle connection closed");
    // The keep-alive timeout (1 s) closed it, not the first-request one (10 s).
    assert!(held < Duration::from_secs(8), "kept {held:?}");
    // Its slot is free again.
    proxy
        .wait_status("the idle connection gone", |s| {
            s["config"]["listeners"][0]["connections"] == 0
        })
        .await;
    let a = h3(&proxy, &pki.ca_pem, "GET", "/after", Vec::new()).await;
    assert_eq!(a.status, 200);
}

/// `http3` needs TLS: QUIC is always encrypted.
#[test]
fn http3_without_tls_is_refused_where_it_is_written() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("policy.yaml"),
        "listeners:\n  - name: plain\n    bind: \"127.0.0.1:0\"\n    http3: true\nroutes: [{ name: ok, match: { path: / }, respond: { status: 200 } }]\n",
    )
    .unwrap();
    let (ok, _, err) = crate::support::check(dir.path());
    assert!(!ok);
    assert!(err.contains("policy.yaml:4:"), "{err}");
    assert!(err.contains("give this listener `tls:`"), "{err}");
}

/// A reload that swaps the listener's certificate gives HTTP/3's next
/// handshakes the new one; one that turns `http3` off opens the listener
/// anew without it.
#[tokio::test]
async fn http3_follows_reloads_of_its_listener() {
    let pki = TestPki::new();
    let echo = upstream::echo("svc").await;
    let dir = policies(&pki, &echo.url(), "");
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let reload = |generation: u64, text: String| {
        let tmp = dir.path().join(".policy.yaml.tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, dir.path().join("policy.yaml")).unwrap();
        proxy.wait_status("the reload applied", move |s| {
            s["config"]["generation"] == generation
        })
    };
    let policy = std::fs::read_to_string(dir.path().join("policy.yaml")).unwrap();

    // A certificate of another CA, in other files.
    let other = TestPki::new();
    std::fs::write(dir.path().join("other.crt"), &other.leaf_pem).unwrap();
    std::fs::write(dir.path().join("other.key"), &other.leaf_key_pem).unwrap();
    let before = tls::h3_request(
        proxy.addr,
        "localhost",
        &other.ca_pem,
        "GET",
        "/",
        Bytes::new(),
    )
    .await;
    assert!(before.is_err(), "{before:?}");
    let swapped = policy.replace(
        "cert: tls.crt, key: tls.key",
        "cert: other.crt, key: other.key",
    );
    reload(2, swapped.clone()).await;
    let a = h3(&proxy, &other.ca_pem, "GET", "/after-swap", Vec::new()).await;
    assert_eq!(a.status, 200);

    // Off: the listener opens again (port 0: on another port), TCP only.
    let status = reload(3, swapped.replace("    http3: true\n", "")).await;
    let listener = &status["config"]["listeners"][0];
    assert_eq!(listener["http3"], false, "{listener}");
    let addr: std::net::SocketAddr = listener["addr"].as_str().unwrap().parse().unwrap();
    let (_, a) = tls::https_get(addr, "localhost", &other.ca_pem, &[b"h2"], "/no-h3")
        .await
        .unwrap();
    assert_eq!(a.status, 200);
    assert!(a.header("alt-svc").is_none(), "{:?}", a.headers);
    // Nothing holds its UDP port.
    assert!(
        std::net::UdpSocket::bind(addr).is_ok(),
        "UDP {addr} is taken"
    );
}

/// A second HTTP/3 client with a QUIC stack of its own (aioquic, from
/// PyPI) is served as quinn's is: the same answers, an upload whole.
#[tokio::test]
async fn an_independent_http3_client_is_served_alike() {
    let pki = TestPki::new();
    let echo = upstream::echo("svc").await;
    let dir = policies(&pki, &echo.url(), "");
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &pki.ca_pem).unwrap();
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    for (method, path, size) in [
        ("GET", "/aioquic?q=1", 0),
        ("POST", "/aioquic-upload", 300_000),
    ] {
        let a = aioquic::request(proxy.addr, "localhost", &ca, (method, path, size)).await;
        assert_eq!(a["status"], 200, "{a}");
        let seen: serde_json::Value = serde_json::from_str(a["body"].as_str().unwrap()).unwrap();
        assert_eq!(seen["target"], path, "{seen}");
        assert_eq!(seen["method"], method, "{seen}");
        assert_eq!(seen["body_len"], size, "{seen}");
        assert_eq!(seen["headers"]["x-forwarded-proto"], "https", "{seen}");
    }
    let a = aioquic::request(proxy.addr, "localhost", &ca, ("GET", "/local", 0)).await;
    assert_eq!(a["status"], 204, "{a}");
}
