//! TLS session resumption on HTTPS listeners: from tickets beyond the
//! server's cache, across reloads that keep the listener's TLS, and
//! between replicas sharing ticket keys.

use super::{policies, start};
use crate::support::tls::{self, TestPki};
use crate::support::upstream;

/// Sessions resume from stateless tickets, as nginx and Envoy default to,
/// and not only from the server's session cache (256 entries in rustls):
/// a client comes back after 200 others have had full handshakes, each
/// taking cache entries, and still resumes.
#[tokio::test]
async fn sessions_resume_from_tickets_beyond_the_server_cache() {
    let pki = TestPki::new();
    let echo = upstream::echo("svc").await;
    let dir = policies(&pki, &echo.url(), "");
    let proxy = start(&dir).await;
    let resumed = |client| async move {
        tls::get_resumed(proxy.addr, "localhost", &client)
            .await
            .unwrap()
    };
    let browser = tls::connector(&pki.ca_pem, &[b"http/1.1"], None);
    assert!(!resumed(browser.clone()).await);
    assert!(resumed(browser.clone()).await);
    for _ in 0..200 {
        let stranger = tls::connector(&pki.ca_pem, &[b"http/1.1"], None);
        assert!(!resumed(stranger).await);
    }
    assert!(resumed(browser).await);
}

/// A reload keeps what a listener's clients resume from, as the listener
/// owns it: a session resumes across a reload that leaves the listener's
/// TLS alone and across one that swaps its certificate for other files,
/// by a TLS 1.3 ticket and by a TLS 1.2 session ID (the session cache);
/// a reload that changes its client-certificate rules starts afresh.
#[tokio::test]
async fn sessions_resume_across_reloads_that_keep_the_listeners_tls() {
    let pki = TestPki::new();
    let echo = upstream::echo("svc").await;
    let dir = policies(&pki, &echo.url(), "");
    let proxy = start(&dir).await;
    let tls13 = tls::connector(&pki.ca_pem, &[b"http/1.1"], None);
    let tls12 = tls::connector_tls12_session_ids(&pki.ca_pem);
    let resumed = |client: tokio_rustls::TlsConnector| async move {
        tls::get_resumed(proxy.addr, "localhost", &client)
            .await
            .unwrap()
    };
    for client in [&tls13, &tls12] {
        assert!(!resumed(client.clone()).await);
        assert!(resumed(client.clone()).await, "before any reload");
    }
    let reload = |generation: u64, text: String| {
        let policy = dir.path().join("policy.yaml");
        let tmp = dir.path().join(".policy.yaml.tmp");
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, &policy).unwrap();
        proxy.wait_status("the reload applied", move |s| {
            s["config"]["generation"] == generation
        })
    };
    let policy = std::fs::read_to_string(dir.path().join("policy.yaml")).unwrap();
    // Routes only.
    let more = format!(
        "{policy}  - {{ name: local, match: {{ path: /local }}, respond: {{ status: 204 }} }}\n"
    );
    let more = more.replace(
        "routes: [{ name: any, match: { path_prefix: / }, upstream: svc }]\n",
        "routes:\n  - { name: any, match: { path_prefix: / }, upstream: svc }\n",
    );
    reload(2, more.clone()).await;
    for (client, what) in [(&tls13, "TLS 1.3 ticket"), (&tls12, "TLS 1.2 session ID")] {
        assert!(
            resumed(client.clone()).await,
            "{what} after a routes-only reload"
        );
    }
    // Another certificate, in other files.
    let renewed = pki.renewed(&["localhost"]);
    std::fs::write(dir.path().join("renewed.crt"), &renewed.leaf_pem).unwrap();
    std::fs::write(dir.path().join("renewed.key"), &renewed.leaf_key_pem).unwrap();
    let swapped = more.replace(
        "cert: tls.crt, key: tls.key",
        "cert: renewed.crt, key: renewed.key",
    );
    reload(3, swapped.clone()).await;
    let served = tls::server_certificate(proxy.addr, "localhost", &pki.ca_pem)
        .await
        .unwrap();
    assert_eq!(
        served,
        renewed.leaf_chain[0].to_vec(),
        "the swapped certificate"
    );
    for (client, what) in [(&tls13, "TLS 1.3 ticket"), (&tls12, "TLS 1.2 session ID")] {
        assert!(
            resumed(client.clone()).await,
            "{what} after a certificate swap"
        );
    }
    // Client certificates asked for: other rules, nothing resumes.
    let asking = swapped.replace(
        "key: renewed.key",
        "key: renewed.key, client_ca: ca.crt, client_auth: optional",
    );
    reload(4, asking).await;
    for (client, what) in [(&tls13, "TLS 1.3 ticket"), (&tls12, "TLS 1.2 session ID")] {
        assert!(
            !resumed(client.clone()).await,
            "{what} after the client-certificate rules changed"
        );
    }
}

/// Replicas that share `session_ticket_keys` files resume each other's
/// sessions: a client that had a full handshake with one resumes on the
/// other, as behind a balancer. A replica with its own random key (no
/// files) takes none of their tickets.
#[tokio::test]
async fn replicas_sharing_ticket_keys_resume_each_others_sessions() {
    let pki = TestPki::new();
    let echo = upstream::echo("svc").await;
    let shared = ", session_ticket_keys: [ticket.key]";
    let (dir_a, dir_b) = (
        policies(&pki, &echo.url(), shared),
        policies(&pki, &echo.url(), shared),
    );
    let key: Vec<u8> = (0..80u8).map(|b| b.wrapping_mul(37)).collect();
    for dir in [&dir_a, &dir_b] {
        std::fs::write(dir.path().join("ticket.key"), &key).unwrap();
    }
    let dir_c = policies(&pki, &echo.url(), "");
    let (a, b, c) = (
        start(&dir_a).await,
        start(&dir_b).await,
        start(&dir_c).await,
    );
    let resumed =
        |addr, client| async move { tls::get_resumed(addr, "localhost", &client).await.unwrap() };
    let browser = tls::connector(&pki.ca_pem, &[b"http/1.1"], None);
    assert!(!resumed(a.addr, browser.clone()).await);
    assert!(
        resumed(b.addr, browser.clone()).await,
        "B did not take A's ticket"
    );
    assert!(
        resumed(a.addr, browser.clone()).await,
        "A did not take B's ticket"
    );
    assert!(
        !resumed(c.addr, browser).await,
        "C took a ticket of keys it lacks"
    );
}
