//! HTTPS listeners: HTTP/1.1 and HTTP/2 by ALPN, the upstream told the
//! request came over https, plain HTTP told to use https, certificates
//! renewed without a restart, and client certificates (mutual TLS);
//! session resumption in [`sessions`].

mod http3;
mod sessions;

use crate::support::client;
use crate::support::process::ProxyProcess;
use crate::support::tls::{self, TestPki};
use crate::support::upstream;

/// A policy directory with `pki`'s leaf as tls.crt/tls.key (and its CA as
/// ca.crt) and an HTTPS listener sending everything to `upstream`, with
/// `extra` added to the listener's `tls`.
pub(super) fn policies(pki: &TestPki, upstream: &str, extra: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    write_pair(dir.path(), pki);
    std::fs::write(dir.path().join("ca.crt"), &pki.ca_pem).unwrap();
    let policy = format!(
        r#"
listeners:
  - name: https
    bind: "127.0.0.1:0"
    tls: {{ cert: tls.crt, key: tls.key{extra} }}
upstreams: [{{ name: svc, endpoints: ["{upstream}"] }}]
routes: [{{ name: any, match: {{ path_prefix: / }}, upstream: svc }}]
"#
    );
    std::fs::write(dir.path().join("policy.yaml"), policy).unwrap();
    dir
}

/// Writes `pki`'s leaf as tls.crt and tls.key in `dir`, as a renewed
/// Secret lands: each file replaced whole.
pub(super) fn write_pair(dir: &std::path::Path, pki: &TestPki) {
    for (name, pem) in [("tls.crt", &pki.leaf_pem), ("tls.key", &pki.leaf_key_pem)] {
        let tmp = dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, pem).unwrap();
        std::fs::rename(&tmp, dir.join(name)).unwrap();
    }
}

pub(super) async fn start(dir: &tempfile::TempDir) -> ProxyProcess {
    ProxyProcess::start_on(dir.path(), &[]).await
}

#[tokio::test]
async fn an_https_listener_serves_http1_and_http2_and_tells_the_upstream() {
    let pki = TestPki::new();
    let echo = upstream::echo("svc").await;
    let dir = policies(&pki, &echo.url(), "");
    let proxy = start(&dir).await;

    for (alpn, version) in [
        (&[&b"h2"[..], b"http/1.1"][..], http::Version::HTTP_2),
        (&[&b"http/1.1"[..]][..], http::Version::HTTP_11),
        // No ALPN at all: HTTP/1.1, as a client of before ALPN expects.
        (&[][..], http::Version::HTTP_11),
    ] {
        // A certificate header the client makes up never reaches the
        // upstream: this listener takes no client certificates.
        let forged = [("x-forwarded-client-cert", "Hash=0000;Subject=\"CN=admin\"")];
        let (got, answer) =
            tls::https_get_with(proxy.addr, "localhost", &pki.ca_pem, alpn, "/who", &forged)
                .await
                .unwrap();
        assert_eq!(got, version, "ALPN {alpn:?}");
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        let seen = answer.json();
        assert_eq!(seen["headers"]["x-forwarded-proto"], "https", "{seen}");
        assert_eq!(seen["headers"]["x-forwarded-host"], "localhost", "{seen}");
        assert_eq!(
            seen["headers"]["x-forwarded-client-cert"],
            serde_json::Value::Null
        );
    }
}

#[tokio::test]
async fn plain_http_on_the_https_port_is_told_to_use_https_and_counted() {
    let pki = TestPki::new();
    let echo = upstream::echo("svc").await;
    let dir = policies(&pki, &echo.url(), "");
    let proxy = start(&dir).await;

    let answer = client::raw(proxy.addr, b"GET /x HTTP/1.1\r\nhost: a\r\n\r\n").await;
    assert!(answer.starts_with("HTTP/1.1 400 "), "{answer}");
    let body: serde_json::Value =
        serde_json::from_str(answer.split_once("\r\n\r\n").unwrap().1).unwrap();
    assert!(
        body["error"].as_str().unwrap().contains("use https://"),
        "{body}"
    );
    // A client that does not trust the certificate fails its handshake.
    let other = TestPki::new();
    let refused = tls::https_get(proxy.addr, "localhost", &other.ca_pem, &[], "/x").await;
    assert!(refused.is_err(), "{refused:?}");
    // Garbage that is neither.
    let _ = client::raw_until_closed(proxy.addr, b"\x16\x03\x01\x00\x05hello").await;
    proxy
        .metrics_showing(&[
            crate::support::process::connection_errors("https", "plain_http", 1),
            crate::support::process::connection_errors("https", "tls_handshake", 2),
        ])
        .await;
    // None of it disturbed the listener.
    let (_, ok) = tls::https_get(proxy.addr, "localhost", &pki.ca_pem, &[], "/x")
        .await
        .unwrap();
    assert_eq!(ok.status, 200);
}

#[tokio::test]
async fn a_renewed_certificate_is_served_without_a_restart() {
    let pki = TestPki::new();
    let echo = upstream::echo("svc").await;
    let dir = policies(&pki, &echo.url(), "");
    let mut proxy = start(&dir).await;
    let first = tls::server_certificate(proxy.addr, "localhost", &pki.ca_pem)
        .await
        .unwrap();
    assert_eq!(first, pki.leaf_chain[0].to_vec());

    // Renewed by the same CA, as cert-manager does.
    let renewed = pki.renewed(&["localhost"]);
    write_pair(dir.path(), &renewed);
    // The next handshake finds the files changed and serves the new pair.
    let served = tls::server_certificate(proxy.addr, "localhost", &pki.ca_pem)
        .await
        .unwrap();
    assert_eq!(served, renewed.leaf_chain[0].to_vec());
    assert_ne!(served, first);
    proxy.wait_for_log("TLS certificate reloaded").await;
    let (_, ok) = tls::https_get(proxy.addr, "localhost", &pki.ca_pem, &[], "/x")
        .await
        .unwrap();
    assert_eq!(ok.status, 200);
}

#[tokio::test]
async fn with_a_client_ca_only_clients_with_its_certificates_get_in() {
    let pki = TestPki::new();
    let clients = TestPki::for_names(&["client.example"]);
    let echo = upstream::echo("svc").await;
    let dir = policies(&pki, &echo.url(), ", client_ca: clients.crt");
    std::fs::write(dir.path().join("clients.crt"), &clients.ca_pem).unwrap();
    let proxy = start(&dir).await;

    let (_, ok) = tls::https_get_as(proxy.addr, "localhost", &pki.ca_pem, &clients, "/in", &[])
        .await
        .unwrap();
    assert_eq!(ok.status, 200, "{:?}", ok.body);
    // The upstream learns which certificate: Envoy's X-Forwarded-Client-Cert.
    let xfcc = ok.json()["headers"]["x-forwarded-client-cert"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let hash = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(&clients.leaf_chain[0]))
    };
    assert!(xfcc.starts_with(&format!("Hash={hash};Cert=\"")), "{xfcc}");
    let pem: String = xfcc
        .split("Cert=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap()
        .replace("%0A", "\n")
        .replace("%2B", "+")
        .replace("%2F", "/")
        .replace("%3D", "=")
        .replace("%20", " ");
    assert_eq!(pem.trim(), clients.leaf_pem.trim());
    // And its names, as Envoy adds them.
    assert!(
        xfcc.ends_with("\";Subject=\"CN=rcgen self signed cert\";DNS=client.example"),
        "{xfcc}"
    );
    // No certificate, or one from another CA: refused in the handshake.
    let none = tls::https_get(proxy.addr, "localhost", &pki.ca_pem, &[], "/in").await;
    assert!(none.is_err(), "{none:?}");
    // /status says what the listener asks for.
    let status = proxy.status().await;
    let tls = &status["config"]["listeners"][0]["tls"];
    assert_eq!(tls["client_certificates"], "required", "{status:#}");
    let served = &tls["certificates"][0];
    let cert = served["cert"].as_str().unwrap();
    assert!(cert.ends_with("tls.crt"), "{status:#}");
    // rcgen's leaves run to 4096-01-01: notAfter read from the DER.
    assert_eq!(served["not_after"], 67_090_118_400i64, "{status:#}");
    proxy
        .metrics_showing(&[format!(
            "portcullis_tls_certificate_expiry_timestamp_seconds{{listener=\"https\",cert=\"{cert}\"}} 67090118400"
        )])
        .await;
    let stranger = TestPki::for_names(&["client.example"]);
    let other =
        tls::https_get_as(proxy.addr, "localhost", &pki.ca_pem, &stranger, "/in", &[]).await;
    assert!(other.is_err(), "{other:?}");
}

#[tokio::test]
async fn check_names_a_missing_or_mismatched_certificate_at_its_line() {
    let pki = TestPki::new();
    let other = TestPki::new();
    let echo = upstream::echo("svc").await;
    let dir = policies(&pki, &echo.url(), "");
    let (ok, out, err) = crate::support::check(dir.path());
    assert!(ok, "{out}{err}");
    // `check` on `dir`, with `policy` written first when given: it must
    // fail, and its errors are returned.
    let refused = |dir: &tempfile::TempDir, policy: Option<&str>| {
        if let Some(policy) = policy {
            std::fs::write(dir.path().join("policy.yaml"), policy).unwrap();
        }
        let (ok, _, err) = crate::support::check(dir.path());
        assert!(!ok);
        err
    };

    // A key that is not the certificate's.
    std::fs::write(dir.path().join("tls.key"), &other.leaf_key_pem).unwrap();
    let err = refused(&dir, None);
    assert!(err.contains("policy.yaml:5:"), "{err}");
    assert!(err.contains("do not belong together"), "{err}");

    let policy = std::fs::read_to_string(dir.path().join("policy.yaml")).unwrap();
    // An HTTPS listener that would redirect to itself.
    let looping = policy.replace("key: tls.key }", "key: tls.key }\n    redirect_https: true");
    let err = refused(&dir, Some(&looping));
    assert!(err.contains("policy.yaml:6:"), "{err}");
    assert!(err.contains("does not redirect to https"), "{err}");

    // Both forms at once, or half of one.
    let both = policy.replace(
        "key: tls.key }",
        "key: tls.key, certificates: [{ cert: tls.crt, key: tls.key }] }",
    );
    let err = refused(&dir, Some(&both));
    assert!(err.contains("not both"), "{err}");
    let half = policy.replace(", key: tls.key }", " }");
    let err = refused(&dir, Some(&half));
    assert!(err.contains("needs both `cert` and `key`"), "{err}");
    // A ticket key too short to be one.
    std::fs::write(dir.path().join("short.key"), b"12345").unwrap();
    let short = policy.replace(
        "key: tls.key }",
        "key: tls.key, session_ticket_keys: [short.key] }",
    );
    let err = refused(&dir, Some(&short));
    assert!(err.contains("policy.yaml:5:"), "{err}");
    assert!(err.contains("holds 5 bytes"), "{err}");
    // Optional client certificates, but from which CA? And a mode that
    // is neither.
    let no_ca = policy.replace("key: tls.key }", "key: tls.key, client_auth: optional }");
    let err = refused(&dir, Some(&no_ca));
    assert!(err.contains("policy.yaml:5:"), "{err}");
    assert!(err.contains("`client_auth` needs `client_ca`"), "{err}");
    let odd = policy.replace(
        "key: tls.key }",
        "key: tls.key, client_ca: ca.crt, client_auth: sometimes }",
    );
    let err = refused(&dir, Some(&odd));
    assert!(err.contains("client_auth `sometimes`"), "{err}");
    std::fs::write(dir.path().join("policy.yaml"), &policy).unwrap();

    // A missing file.
    std::fs::remove_file(dir.path().join("tls.crt")).unwrap();
    let err = refused(&dir, None);
    assert!(err.contains("policy.yaml:5:"), "{err}");
    assert!(err.contains("tls.crt"), "{err}");
}

#[tokio::test]
async fn several_certificates_are_chosen_by_the_name_the_client_asks_for() {
    let default = TestPki::new();
    let wildcard = TestPki::for_names(&["*.b.example"]);
    let echo = upstream::echo("svc").await;
    let dir = tempfile::tempdir().unwrap();
    write_pair(dir.path(), &default);
    std::fs::write(dir.path().join("b.crt"), &wildcard.leaf_pem).unwrap();
    std::fs::write(dir.path().join("b.key"), &wildcard.leaf_key_pem).unwrap();
    let policy = format!(
        r#"
listeners:
  - name: https
    bind: "127.0.0.1:0"
    tls:
      certificates:
        - {{ cert: tls.crt, key: tls.key }}
        - {{ cert: b.crt, key: b.key }}
upstreams: [{{ name: svc, endpoints: ["{}"] }}]
routes: [{{ name: any, match: {{ path_prefix: / }}, upstream: svc }}]
"#,
        echo.url()
    );
    std::fs::write(dir.path().join("policy.yaml"), policy).unwrap();
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;

    let served = |host: &'static str, ca: &str| {
        let ca = ca.to_owned();
        let addr = proxy.addr;
        async move { tls::server_certificate(addr, host, &ca).await }
    };
    assert_eq!(
        served("x.b.example", &wildcard.ca_pem).await.unwrap(),
        wildcard.leaf_chain[0].to_vec()
    );
    assert_eq!(
        served("localhost", &default.ca_pem).await.unwrap(),
        default.leaf_chain[0].to_vec()
    );
    // An IP address sends no server name: the first certificate.
    assert_eq!(
        served("127.0.0.1", &default.ca_pem).await.unwrap(),
        default.leaf_chain[0].to_vec()
    );
    // A name none covers gets the first too, which the client rejects
    // for its names.
    let err = served("other.example", &default.ca_pem).await.unwrap_err();
    assert!(err.contains("localhost"), "{err}");
    // And requests go through on the chosen one.
    let (_, ok) = tls::https_get(proxy.addr, "x.b.example", &wildcard.ca_pem, &[], "/w")
        .await
        .unwrap();
    assert_eq!(ok.status, 200);
}

#[tokio::test]
async fn a_cleartext_listener_can_send_every_request_to_https() {
    let pki = TestPki::new();
    let echo = upstream::echo("svc").await;
    let dir = tempfile::tempdir().unwrap();
    write_pair(dir.path(), &pki);
    // Free for the proxy to listen on, and held till then.
    let (https_port, _held) = crate::support::reserved_port();
    let policy = format!(
        r#"
listeners:
  - {{ name: http, bind: "127.0.0.1:0", redirect_https: {https_port} }}
  - {{ name: https, bind: "127.0.0.1:{https_port}", tls: {{ cert: tls.crt, key: tls.key }} }}
upstreams: [{{ name: svc, endpoints: ["{}"] }}]
routes:
  - {{ name: health, match: {{ path: /healthz }}, health: live }}
  - {{ name: any, match: {{ path_prefix: /app }}, upstream: svc }}
"#,
        echo.url()
    );
    std::fs::write(dir.path().join("policy.yaml"), policy).unwrap();
    let proxy = crate::support::Proxy::start_dir(dir, &[]).await;

    // Routed or not, any method: 308 to the same host, path and query.
    for (method, path) in [
        ("GET", "/app/x?y=1&z"),
        ("POST", "/app"),
        ("GET", "/nowhere"),
    ] {
        let req = http::Request::builder()
            .method(method)
            .uri(proxy.url(path))
            .header("host", "portal.example:8080")
            .body(client::body(bytes::Bytes::new()))
            .unwrap();
        let answer = client::send(&client::http1(), req).await;
        assert_eq!(answer.status, 308, "{method} {path}");
        assert_eq!(
            answer.header("location"),
            Some(format!("https://portal.example:{https_port}{path}").as_str())
        );
    }
    // A balancer's health check is still answered.
    assert_eq!(client::get(&proxy.url("/healthz")).await.status, 200);
    // And the target serves.
    let (_, ok) = tls::https_get(
        std::net::SocketAddr::from(([127, 0, 0, 1], https_port)),
        "localhost",
        &pki.ca_pem,
        &[],
        "/app/x?y=1",
    )
    .await
    .unwrap();
    assert_eq!(ok.status, 200);
    assert_eq!(ok.json()["headers"]["x-forwarded-proto"], "https");
}

/// `client_auth: optional` lets clients without a certificate in, and
/// `client-cert-allow` decides per route on the names in the certificate,
/// as Envoy's RBAC does on a principal: a SPIFFE ID by prefix, a DNS name
/// by suffix. The upstream learns which name let the client in (a forged
/// copy of that header is replaced), and the client's names in
/// `X-Forwarded-Client-Cert`.
#[tokio::test]
async fn client_cert_allow_lets_in_only_the_names_a_route_lists() {
    use rcgen::SanType;
    let pki = TestPki::new();
    let clients = TestPki::for_names(&["clients-ca"]);
    let runner = clients.client(
        "ci-runner",
        vec![SanType::URI(
            "spiffe://cluster.local/ns/ci/sa/runner".try_into().unwrap(),
        )],
    );
    let partner = clients.client(
        "hooks",
        vec![SanType::DnsName(
            "hooks.partner.example".try_into().unwrap(),
        )],
    );
    let dev = clients.client(
        "dev",
        vec![SanType::URI(
            "spiffe://cluster.local/ns/dev/sa/x".try_into().unwrap(),
        )],
    );
    let echo = upstream::echo("svc").await;
    let dir = tempfile::tempdir().unwrap();
    write_pair(dir.path(), &pki);
    std::fs::write(dir.path().join("clients.crt"), &clients.ca_pem).unwrap();
    std::fs::copy(
        crate::support::plugin_file("client-cert-allow"),
        dir.path().join("client-cert-allow.wasm"),
    )
    .unwrap();
    let policy = format!(
        r#"
listeners:
  - name: https
    bind: "127.0.0.1:0"
    tls: {{ cert: tls.crt, key: tls.key, client_ca: clients.crt, client_auth: optional }}
upstreams: [{{ name: svc, endpoints: ["{}"] }}]
plugins: [{{ name: certs, path: client-cert-allow.wasm }}]
routes:
  - name: ci
    match: {{ path_prefix: /ci }}
    upstream: svc
    plugins:
      - use: certs
        config: {{ uris: ["spiffe://cluster.local/ns/ci/*"], identity_header: x-client-identity }}
  - name: hooks
    match: {{ path_prefix: /hooks }}
    upstream: svc
    plugins: [{{ use: certs, config: {{ dns_names: ["*.partner.example"] }} }}]
  - {{ name: open, match: {{ path_prefix: /open }}, upstream: svc }}
"#,
        echo.url()
    );
    std::fs::write(dir.path().join("policy.yaml"), policy).unwrap();
    let mut proxy = start(&dir).await;
    let forged = [("x-client-identity", "spiffe://cluster.local/ns/ci/sa/admin")];

    let (_, ok) = tls::https_get_as(
        proxy.addr,
        "localhost",
        &pki.ca_pem,
        &runner,
        "/ci",
        &forged,
    )
    .await
    .unwrap();
    assert_eq!(ok.status, 200, "{:?}", ok.body);
    let headers = &ok.json()["headers"];
    assert_eq!(
        headers["x-client-identity"], "spiffe://cluster.local/ns/ci/sa/runner",
        "{headers:#}"
    );
    let xfcc = headers["x-forwarded-client-cert"].as_str().unwrap();
    assert!(
        xfcc.ends_with(";Subject=\"CN=ci-runner\";URI=spiffe://cluster.local/ns/ci/sa/runner"),
        "{xfcc}"
    );
    // The access line says who it was, and over which TLS version.
    let line = proxy.wait_for_log("\"client_cert\":\"CN=ci-runner\"").await;
    let access: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(access["path"], "/ci", "{access:#}");
    assert_eq!(access["tls"], "TLSv1.3", "{access:#}");

    // Each route its own names; everyone else, a 403 saying why.
    async fn get(
        addr: std::net::SocketAddr,
        ca: &str,
        who: Option<&TestPki>,
        path: &str,
    ) -> (u16, serde_json::Value) {
        let forged = [("x-client-identity", "spiffe://cluster.local/ns/ci/sa/admin")];
        let answer = match who {
            Some(id) => tls::https_get_as(addr, "localhost", ca, id, path, &forged).await,
            None => tls::https_get_with(addr, "localhost", ca, &[b"http/1.1"], path, &forged).await,
        };
        let (_, answer) = answer.unwrap();
        (answer.status.as_u16(), answer.json()["error"].clone())
    }
    let get = |who, path| get(proxy.addr, &pki.ca_pem, who, path);
    assert_eq!(get(Some(&partner), "/hooks").await.0, 200);
    assert_eq!(
        get(Some(&partner), "/ci").await,
        (403, "client certificate not allowed".into())
    );
    assert_eq!(get(Some(&runner), "/hooks").await.0, 403);
    assert_eq!(
        get(Some(&dev), "/ci").await,
        (403, "client certificate not allowed".into())
    );
    // No certificate: the handshake lets it in (optional), the open route
    // serves it, and the plugin refuses it.
    assert_eq!(get(None, "/open").await.0, 200);
    assert_eq!(
        get(None, "/ci").await,
        (403, "client certificate required".into())
    );
    // Optional is not "anything goes": a certificate from another CA
    // still fails the handshake.
    let stranger = TestPki::for_names(&["x"]).client("ci-runner", vec![]);
    let refused = tls::https_get_as(
        proxy.addr,
        "localhost",
        &pki.ca_pem,
        &stranger,
        "/open",
        &[],
    )
    .await;
    assert!(refused.is_err(), "{refused:?}");
    let status = proxy.status().await;
    assert_eq!(
        status["config"]["listeners"][0]["tls"]["client_certificates"], "optional",
        "{status:#}"
    );
    proxy
        .metrics_showing(&[
            "portcullis_plugin_counter_total{plugin=\"certs\",name=\"refused\"} 4".to_owned(),
        ])
        .await;
}

/// A client that leaves an HTTPS request while the upstream works is
/// noticed as on cleartext, though the close_notify alert it sends
/// before its FIN is unread bytes to a peek: the upstream connection is
/// dropped within about a second, not held to the 60 s route timeout.
#[tokio::test]
async fn an_https_client_that_leaves_mid_request_cancels_the_upstream_exchange() {
    use tokio::io::AsyncWriteExt;
    let mut slow = upstream::never_answering().await;
    let pki = TestPki::new();
    let dir = policies(&pki, &format!("http://{}", slow.addr), "");
    let proxy = start(&dir).await;
    let mut client = tls::connect(proxy.addr, "localhost", &pki.ca_pem)
        .await
        .unwrap();
    client
        .write_all(b"GET /slow HTTP/1.1\r\nhost: localhost\r\n\r\n")
        .await
        .unwrap();
    client.flush().await.unwrap();
    slow.request_arrived().await;
    // close_notify, then FIN, as a browser closing the tab does.
    client.shutdown().await.unwrap();
    drop(client);
    slow.closed_soon().await;
}
