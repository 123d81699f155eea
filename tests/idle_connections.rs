//! Idle HTTP/1.1 keep-alive connections are parked: after half a second
//! to a second without a request, hyper lets go of the connection (and
//! its read and write buffers) and the socket waits alone; its next bytes
//! are served by a new hyper connection, pipelined or split as they come.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::process::ProxyProcess;

const POLICY: &str = r#"
listeners: [{ name: edge, bind: "127.0.0.1:0", keepalive_timeout: 60s }]
routes: [{ name: v, match: { path_prefix: /v }, respond: { status: 200, body: "v" } }]
"#;

/// Reads until `count` whole answers (each `v`) arrived.
async fn read_answers(sock: &mut TcpStream, count: usize) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    tokio::time::timeout(Duration::from_secs(20), async {
        while String::from_utf8_lossy(&got)
            .matches("HTTP/1.1 200")
            .count()
            < count
            || !got.ends_with(b"v")
        {
            let n = sock.read(&mut buf).await.expect("read");
            assert!(n > 0, "closed after {:?}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
        }
    })
    .await
    .expect("answers within 20 s");
    String::from_utf8_lossy(&got).into_owned()
}

const GET: &[u8] = b"GET /v HTTP/1.1\r\nhost: a\r\n\r\n";

#[tokio::test]
async fn idle_keep_alive_connections_let_go_of_their_buffers_and_serve_on() {
    let mut proxy = ProxyProcess::start(POLICY, &["--grace-period", "60s"]).await;
    let mut socks = Vec::new();
    for _ in 0..400 {
        let mut sock = TcpStream::connect(proxy.addr).await.unwrap();
        sock.write_all(GET).await.unwrap();
        read_answers(&mut sock, 1).await;
        socks.push(sock);
    }
    // Each parked within a second of its last request.
    proxy
        .metrics_showing(&["portcullis_connections_parked 400".into()])
        .await;
    // (What that saves, hyper's 8 KiB read and 8 KiB write buffers and
    // its state, is bench/idle.sh's figure.)

    // Every parked connection serves its next request.
    for sock in &mut socks {
        sock.write_all(GET).await.unwrap();
    }
    for sock in &mut socks {
        read_answers(sock, 1).await;
    }
    proxy
        .metrics_showing(&["portcullis_connections_parked 400".into()])
        .await;
    // Parked again: two requests at once, pipelined, both answered.
    let sock = &mut socks[0];
    sock.write_all(&[GET, GET].concat()).await.unwrap();
    let both = read_answers(sock, 2).await;
    assert_eq!(both.matches("HTTP/1.1 200").count(), 2, "{both}");
    // A head that arrives in pieces, the first shorter than any the
    // parked socket reads at once.
    let sock = &mut socks[1];
    sock.write_all(b"GE").await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    sock.write_all(b"T /v/pieces HTTP/1.1\r\nhost: a\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    sock.write_all(b"\r\n").await.unwrap();
    read_answers(sock, 1).await;
    // A client that closes its parked connection: nothing is logged as
    // an error, and it is no longer counted.
    proxy
        .metrics_showing(&["portcullis_connections_parked 400".into()])
        .await;
    drop(socks.pop());
    proxy
        .metrics_showing(&["portcullis_connections_parked 399".into()])
        .await;

    // A drain closes parked connections at once, instead of waiting out
    // the 60 s grace period for them.
    proxy.signal("TERM");
    let status = proxy.wait_exit(Duration::from_secs(30)).await;
    assert!(status.success(), "{status:?}");
    assert_eq!(proxy.count_logs("\"path\":\"/v\""), 802);
    assert_eq!(proxy.count_logs("/v/pieces"), 1);
    assert_eq!(proxy.count_logs("connection ended with an error"), 0);
}

#[tokio::test]
async fn a_parked_connection_is_closed_at_the_keep_alive_timeout() {
    let proxy = ProxyProcess::start(&POLICY.replace("60s", "2s"), &[]).await;
    let mut sock = TcpStream::connect(proxy.addr).await.unwrap();
    sock.write_all(GET).await.unwrap();
    read_answers(&mut sock, 1).await;
    let idle = tokio::time::Instant::now();
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(20), sock.read_to_end(&mut rest))
        .await
        .expect("closed within 20 s")
        .unwrap();
    // Parked after half a second or more, it has the rest of the two.
    assert!(
        idle.elapsed() >= Duration::from_millis(1900),
        "{:?}",
        idle.elapsed()
    );
    assert!(rest.is_empty(), "{rest:?}");
    proxy
        .metrics_showing(&[crate::support::process::connection_errors(
            "edge",
            "keepalive_timeout",
            1,
        )])
        .await;
}
