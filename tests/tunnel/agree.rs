//! A request crossing a tunnel, over either transport, reaches the
//! upstream as it does through the routing core alone: the tunnel hop
//! converts HTTP/1.1 to HTTP/2 streams (WebSocket transport) or carries it
//! on QUIC streams, and neither may change what the upstream sees.

use super::*;
use crate::support::client::ReqBody;

/// One of the two ways to send the payload.
type MakeBody = fn() -> ReqBody;
use crate::upstream_paths_agree::{SHAPES, as_received, in_hand, proxy_to, send_to, streamed};

/// What the tunnel hop changes on purpose: the Host (the public name),
/// the forwarding fields (they name the public client) and the request
/// id the server gives every public request.
fn without_hop(mut seen: serde_json::Value) -> serde_json::Value {
    let headers = seen["headers"].as_object_mut().expect("headers");
    for name in [
        "host",
        "x-forwarded-for",
        "x-forwarded-proto",
        "x-forwarded-host",
        "x-request-id",
    ] {
        headers.remove(name);
    }
    seen
}

#[tokio::test]
async fn requests_cross_either_transport_as_they_reach_the_core_directly() {
    let echo = upstream::echo("agree").await;
    let direct = proxy_to(&echo).await;
    let server = TunnelServer::start_quic().await;
    let url = echo.url();
    let _websocket = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    let _quic = server
        .client(
            "rt-b",
            TOKENS[1].1,
            &["--transport", "quic", "--upstream", &url],
        )
        .await;
    let bodies: [(&str, MakeBody); 2] = [("in hand", in_hand), ("streamed", streamed)];
    let mut report = String::new();
    // A Host of its own would not reach the runtime.
    let shapes = SHAPES
        .iter()
        .filter(|s| !s.headers.iter().any(|(name, _)| *name == "host"));
    for shape in shapes {
        for (how, body) in bodies {
            let direct = send_to(direct.addr, "agree.test", shape, body()).await;
            let want = without_hop(as_received(direct));
            for (runtime, transport) in [("rt-a", "websocket"), ("rt-b", "quic")] {
                let host = format!("{runtime}.{DOMAIN}");
                let crossed = send_to(server.public, &host, shape, body()).await;
                let got = without_hop(as_received(crossed));
                if got != want {
                    report.push_str(&format!(
                        "\n{} ({how}, {transport}):\n  direct:  {want}\n  tunnel:  {got}\n",
                        shape.name
                    ));
                }
            }
        }
    }
    assert!(report.is_empty(), "{report}");
}
