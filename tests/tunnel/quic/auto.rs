//! `--transport auto`: QUIC where it gets through, the WebSocket
//! transport where it does not, and QUIC tried again later.

use super::*;

/// `--transport auto` takes QUIC where the server offers it, and falls
/// back to WebSocket (for good, saying why) where it does not.
#[tokio::test]
async fn auto_takes_quic_where_it_can_and_websocket_where_it_cannot() {
    let echo = upstream::echo("auto").await;
    let url = echo.url();
    let auto = [
        "--transport",
        "auto",
        "--upstream",
        &url,
        "--connections",
        "1",
    ];

    let with_quic = TunnelServer::start_quic().await;
    let _client = with_quic.client("rt-a", TOKENS[0].1, &auto).await;
    with_quic.wait_connections("rt-a", 1).await;
    assert_eq!(transports(&with_quic, "rt-a").await, ["quic"]);
    assert_eq!(with_quic.get("rt-a", "/q").await.status, 200);

    let without = TunnelServer::start_with(true).await;
    let client = without.client("rt-a", TOKENS[0].1, &auto).await;
    let line = client.find_log("QUIC failed; using WebSocket").await;
    assert!(line.contains("\"reason\""), "{line}");
    without.wait_connections("rt-a", 1).await;
    assert_eq!(transports(&without, "rt-a").await, ["websocket"]);
    let a = without.get("rt-a", "/ws").await;
    assert_eq!(a.status, 200);
    assert_eq!(a.json()["upstream"], "auto");
}

/// After `auto` fell back, QUIC is tried again at a dial once
/// `--quic-retry-after` has passed (here at once; the period itself is a
/// unit test): a server that came up without QUIC and is restarted with
/// it gets the client back over QUIC, without the client restarting.
#[tokio::test]
async fn auto_tries_quic_again_after_falling_back() {
    let echo = upstream::echo("again").await;
    let url = echo.url();
    let without = TunnelServer::start_with(true).await;
    let mut client = without
        .client(
            "rt-a",
            TOKENS[0].1,
            &[
                "--transport",
                "auto",
                "--quic-retry-after",
                "0s",
                "--upstream",
                &url,
                "--connections",
                "1",
            ],
        )
        .await;
    client.find_log("QUIC failed; using WebSocket").await;
    without.wait_connections("rt-a", 1).await;
    assert_eq!(transports(&without, "rt-a").await, ["websocket"]);

    // The same addresses and certificate, now with QUIC.
    let (public, tunnel) = (without.public, without.tunnel);
    let TunnelServer {
        mut process, dir, ..
    } = without;
    process.signal("TERM");
    assert!(process.wait_exit(Duration::from_secs(20)).await.success());
    client.wait_for_log("tunnel lost").await;
    let with_quic = TunnelServer::start_in_with(dir, public, tunnel, &["--tunnel-quic"]).await;
    let line = client.wait_for_log("tunnel connected").await;
    assert!(line.contains("\"transport\":\"quic\""), "{line}");
    with_quic.wait_connections("rt-a", 1).await;
    assert_eq!(transports(&with_quic, "rt-a").await, ["quic"]);
    let answer = with_quic.get("rt-a", "/q").await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.json()["upstream"], "again");
}
