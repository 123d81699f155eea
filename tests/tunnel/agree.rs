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

/// The runtimes behind one server, both in front of `url`: `rt-a` over a
/// WebSocket tunnel, `rt-b` over QUIC.
async fn tunnels_to(url: &str) -> (TunnelServer, [ProxyProcess; 2]) {
    let server = TunnelServer::start_quic().await;
    let websocket = server
        .client("rt-a", TOKENS[0].1, &["--upstream", url])
        .await;
    let quic = server
        .client(
            "rt-b",
            TOKENS[1].1,
            &["--transport", "quic", "--upstream", url],
        )
        .await;
    (server, [websocket, quic])
}

/// The runtimes [`tunnels_to`] starts, with their transports.
const RUNTIMES: [(&str, &str); 2] = [("rt-a", "websocket"), ("rt-b", "quic")];

#[tokio::test]
async fn requests_cross_either_transport_as_they_reach_the_core_directly() {
    let echo = upstream::echo("agree").await;
    let direct = proxy_to(&echo).await;
    let (server, _clients) = tunnels_to(&echo.url()).await;
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
            for (runtime, transport) in RUNTIMES {
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

/// The other way: each upstream answer of the table in
/// `upstream_h1_vs_hyper` reaches a public client through either tunnel
/// as it reaches a client of the routing core directly (the tunnel server
/// adds a `Date` only where the core would have).
#[tokio::test]
async fn answers_cross_either_transport_as_they_leave_the_core_directly() {
    use crate::upstream_h1_vs_hyper::{Seen, cases, send_as, upstream};
    let addr = upstream().await;
    let url = format!("http://{addr}");
    let direct = crate::support::Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: up, endpoints: ["{url}"], retries: 0 }}]
routes: [{{ name: all, match: {{ path_prefix: / }}, upstream: up, timeout: 5s }}]
"#
    ))
    .await;
    let (server, _clients) = tunnels_to(&url).await;
    let mut report = String::new();
    for (n, case) in cases().iter().enumerate() {
        let want = send_as(direct.addr, "upstream.test", n, true).await;
        for (runtime, transport) in RUNTIMES {
            let host = format!("{runtime}.{DOMAIN}");
            let mut got = send_as(server.public, &host, n, true).await;
            // The id the tunnel server gives every public request.
            if let Seen::Answer { headers, .. } = &mut got {
                headers.retain(|(name, _)| name != "x-request-id");
            }
            if !case.alike(&got, &want) {
                report.push_str(&format!(
                    "\n{n} {} ({transport}):\n  direct: {want:?}\n  tunnel: {got:?}\n",
                    case.name
                ));
            }
        }
    }
    assert!(report.is_empty(), "{report}");
}
