//! Who may use the admin listeners: a web page in an operator's browser
//! cannot reload the proxy (cross-site, or through a DNS name rebound to
//! the listener), and with `--admin-token-file` `/status` and `/reload`
//! want the token while `/metrics` and `/readyz` stay open. The tunnel
//! server's `/readyz` turns 503 when it drains.

use std::time::Duration;

use crate::support::browser;
use crate::support::client;
use crate::support::process::ProxyProcess;

const POLICY: &str = r#"
listeners: [{ name: main, bind: "127.0.0.1:0" }]
routes:
  - { name: v, match: { path: /v }, respond: { status: 200, body: "v" } }
"#;

/// Sends `method path` to the admin listener with `headers` (each
/// `Name: value`), the Host `host` (the listener's own address when
/// `None`); the status and the body.
async fn admin(
    proxy: &ProxyProcess,
    method: &str,
    path: &str,
    host: Option<&str>,
    headers: &[&str],
) -> (u16, String) {
    let addr = proxy.admin.expect("an admin listener");
    let host = host.map_or_else(|| addr.to_string(), str::to_owned);
    let mut raw = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n");
    for h in headers {
        raw.push_str(h);
        raw.push_str("\r\n");
    }
    raw.push_str("Content-Length: 0\r\n\r\n");
    let answer = client::raw(addr, raw.as_bytes()).await;
    let (status, body) = client::status_and_body(&answer);
    (status, body.to_owned())
}

#[tokio::test]
async fn a_cross_site_page_cannot_reload_or_read_through_a_rebound_name() {
    let proxy = ProxyProcess::start(POLICY, &[]).await;
    let addr = proxy.admin.unwrap();
    let origin = format!("Origin: http://{addr}");
    // The operator's own tools: curl, or the status page (same origin).
    assert_eq!(admin(&proxy, "POST", "/reload", None, &[]).await.0, 200);
    assert_eq!(
        admin(&proxy, "POST", "/reload", None, &[&origin]).await.0,
        200
    );
    let local = format!("localhost:{}", addr.port());
    assert_eq!(
        admin(&proxy, "GET", "/status", Some(&local), &[]).await.0,
        200
    );
    // Another site's page: a form or fetch POST carries its Origin and
    // Sec-Fetch-Site; a DNS name rebound to 127.0.0.1 is same-origin to
    // the browser, but names a host that is not this listener's address.
    for (host, headers) in [
        (None, &["Origin: https://evil.example"][..]),
        (None, &["Sec-Fetch-Site: cross-site"][..]),
        (None, &["Origin: null"][..]),
        (
            Some("evil.example:9901"),
            &["Origin: http://evil.example:9901"][..],
        ),
    ] {
        let (status, body) = admin(&proxy, "POST", "/reload", host, headers).await;
        assert_eq!(status, 403, "{host:?} {headers:?}: {body}");
    }
    let (status, body) = admin(&proxy, "GET", "/status", Some("evil.example:9901"), &[]).await;
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("DNS rebinding"), "{body}");
    // None of the refused requests reloaded: each reload asked for logs
    // a line, and after one more good one there are three.
    assert_eq!(admin(&proxy, "POST", "/reload", None, &[]).await.0, 200);
    let logged = async {
        while proxy.count_logs("policies unchanged") < 3 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), logged)
        .await
        .expect("the three reloads logged");
    assert_eq!(proxy.count_logs("policies unchanged"), 3);
}

#[tokio::test]
async fn the_admin_token_guards_status_and_reload_not_metrics_or_readyz() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("admin-token");
    let token = "s3cr3t-admin-token-0123456789";
    std::fs::write(&file, format!("{token}\n")).unwrap();
    let file_arg = file.display().to_string();
    let proxy = ProxyProcess::start(POLICY, &["--admin-token-file", &file_arg]).await;
    let bearer = format!("Authorization: Bearer {token}");
    for (method, path) in [("GET", "/status"), ("POST", "/reload")] {
        let (status, body) = admin(&proxy, method, path, None, &[]).await;
        assert_eq!(status, 401, "{path}: {body}");
        let wrong = admin(&proxy, method, path, None, &["Authorization: Bearer nope"]).await;
        assert_eq!(wrong.0, 401, "{path}");
        let (status, body) = admin(&proxy, method, path, None, &[&bearer]).await;
        assert_eq!(status, 200, "{path}: {body}");
    }
    // With the token, any name may address the listener.
    let named = admin(&proxy, "GET", "/status", Some("admin.internal"), &[&bearer]).await;
    assert_eq!(named.0, 200);
    for path in ["/metrics", "/readyz"] {
        assert_eq!(admin(&proxy, "GET", path, None, &[]).await.0, 200, "{path}");
    }
    // The status page asks for the token rather than failing.
    let dom = browser::rendered(&proxy.admin_url("/")).await;
    assert!(dom.contains("token needed"), "{dom}");
}

#[tokio::test]
async fn a_short_or_missing_admin_token_file_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("policy.yaml"), POLICY).unwrap();
    let short = dir.path().join("short");
    std::fs::write(&short, "abc\n").unwrap();
    for (file, expected) in [
        (short, "the token is 3 characters"),
        (dir.path().join("missing"), "No such file"),
    ] {
        let out = std::process::Command::new(crate::support::binary())
            .args(["serve", "--policies"])
            .arg(dir.path())
            .arg("--admin-token-file")
            .arg(&file)
            .output()
            .expect("run portcullis");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains("--admin-token-file"), "{stderr}");
        assert!(stderr.contains(expected), "{stderr}");
    }
}

#[tokio::test]
async fn the_tunnel_servers_readyz_is_503_while_it_drains() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens.yaml");
    std::fs::write(&tokens, "{}\n").unwrap();
    let args: Vec<String> = [
        "tunnel-server",
        "--public",
        "127.0.0.1:0",
        "--tunnel-listen",
        "127.0.0.1:0",
        "--domain",
        "tunnels.test",
        "--tokens",
        &tokens.display().to_string(),
        "--shutdown-delay",
        "30s",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut server = ProxyProcess::launch(&args, &[], "tunnel listening").await;
    let (status, body) = admin(&server, "GET", "/readyz", None, &[]).await;
    assert_eq!((status, body.as_str()), (200, r#"{"ready":true}"#));
    server.signal("TERM");
    server.wait_for_log("draining").await;
    let (status, body) = admin(&server, "GET", "/readyz", None, &[]).await;
    assert_eq!((status, body.as_str()), (503, r#"{"ready":false}"#));
    // Still serving its public side meanwhile.
    let public = server.addrs["public listening"];
    let answer = client::get(&format!("http://{public}/")).await;
    assert_eq!(answer.status, 404);
    server.signal("KILL");
    server.wait_exit(Duration::from_secs(10)).await;
}
