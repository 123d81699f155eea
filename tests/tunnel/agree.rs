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

/// An upstream for [`local_answers_cross_as_they_leave_the_core_directly`]:
/// `/204` and `/304` answer so, `/slow` after 5 s, anything else 200 with
/// a four-byte body.
async fn answering_upstream() -> upstream::Upstream {
    upstream::serve(|req: Request<hyper::body::Incoming>| async move {
        let answer = Response::builder().header("etag", "\"v1\"");
        match req.uri().path() {
            "/204" => answer.status(204).body(full("")).unwrap(),
            "/304" => answer.status(304).body(full("")).unwrap(),
            "/slow" => {
                tokio::time::sleep(Duration::from_secs(5)).await;
                answer.body(full("late")).unwrap()
            }
            _ => answer
                .header("content-type", "text/plain")
                .body(full("page"))
                .unwrap(),
        }
    })
    .await
}

/// The status, end-to-end headers (lower case, in order) and body of one
/// HTTP/1.1 exchange with `addr` (fields by name), less what each hop
/// sets for itself:
/// `date`, and the id the tunnel server gives every public request.
async fn exchange_h1(
    addr: SocketAddr,
    host: &str,
    (method, path): (&str, &str),
    extra: &[(&str, String)],
    body: &'static [u8],
) -> (u16, Vec<(String, String)>, Bytes) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::Builder::new()
        .handshake(hyper_util::rt::TokioIo::new(tcp))
        .await
        .expect("HTTP/1.1 handshake");
    tokio::spawn(conn);
    let mut req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", host);
    for (name, value) in extra {
        req = req.header(*name, value);
    }
    let resp = send
        .send_request(
            req.body(http_body_util::Full::new(Bytes::from_static(body)))
                .unwrap(),
        )
        .await
        .expect("an answer");
    let status = resp.status().as_u16();
    let mut headers: Vec<_> = resp
        .headers()
        .iter()
        .filter(|(name, _)| !["date", "x-request-id"].contains(&name.as_str()))
        .map(|(name, value)| (name.to_string(), value.to_str().unwrap().to_owned()))
        .collect();
    // The order of differently named fields means nothing (RFC 9110,
    // 5.3); that of one name's values stays.
    headers.sort_by(|a, b| a.0.cmp(&b.0));
    let body = resp
        .into_body()
        .collect()
        .await
        .expect("the body")
        .to_bytes();
    (status, headers, body)
}

/// A case's name, method and path, extra headers and body.
type LocalCase<'a> = (
    &'a str,
    (&'a str, &'a str),
    &'a [(&'a str, String)],
    &'static [u8],
);

/// The routing core's own answers (no route, a body or head over its
/// limits, an upstream down or too slow) and the bodiless ones (HEAD, 204,
/// 304) reach a public client through either tunnel with the status,
/// headers and body a client of the core gets from it directly.
#[tokio::test]
async fn local_answers_cross_as_they_leave_the_core_directly() {
    let up = answering_upstream().await;
    let down = crate::support::closed_port();
    let routes = format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: up, endpoints: ["{up}"], retries: 0 }}
  - {{ name: down, endpoints: ["http://127.0.0.1:{down}"], retries: 0 }}
routes:
  - {{ name: limited, match: {{ path: /limited }}, upstream: up, max_request_body: 16 }}
  - {{ name: down, match: {{ path: /down }}, upstream: down }}
  - {{ name: slow, match: {{ path: /slow }}, upstream: up, timeout: 300ms }}
  - {{ name: up, match: {{ path_prefix: /up/ }}, upstream: up, strip_prefix: /up }}
"#,
        up = up.url(),
    );
    let server = TunnelServer::start_quic().await;
    let dir = policies(&routes);
    let path = dir.path().display().to_string();
    let open = ["--open-listeners", "--policies", &path];
    let websocket = server.client("rt-a", TOKENS[0].1, &open).await;
    let quic_args = [&open[..], &["--transport", "quic"]].concat();
    let _quic = server.client("rt-b", TOKENS[1].1, &quic_args).await;
    let big = vec![("x-big", "b".repeat(40 << 10))];
    let cases: [LocalCase; 8] = [
        ("404", ("GET", "/nowhere"), &[], b""),
        ("413", ("POST", "/limited"), &[], &[b'x'; 64]),
        ("431", ("GET", "/up/page"), &big, b""),
        ("502", ("GET", "/down"), &[], b""),
        ("504", ("GET", "/slow"), &[], b""),
        ("HEAD", ("HEAD", "/up/page"), &[], b""),
        ("204", ("GET", "/up/204"), &[], b""),
        ("304", ("GET", "/up/304"), &[], b""),
    ];
    let mut report = String::new();
    for (name, request, extra, body) in cases {
        let want = exchange_h1(websocket.addr, "core.test", request, extra, body).await;
        for (runtime, transport) in RUNTIMES {
            let host = format!("{runtime}.{DOMAIN}");
            let got = exchange_h1(server.public, &host, request, extra, body).await;
            if got != want {
                report.push_str(&format!(
                    "\n{name} ({transport}):\n  direct: {want:?}\n  tunnel: {got:?}\n"
                ));
            }
        }
    }
    assert!(report.is_empty(), "{report}");
}
