//! A request to an HTTP/1.1 upstream takes one of two paths: a body in
//! hand (none, or a known length up to 64 KiB) goes by the request's own
//! task (`forward::h1`), a streamed one (chunked, or longer) by hyper's
//! client. The upstream must not be able to tell which: the same request,
//! sent once with its body as a length and once chunked, must arrive with
//! the same method, target, headers (framing aside) and body. And an
//! HTTP/2 upstream must get what an HTTP/1.1 one gets.

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::Request;
use hyper::body::Frame;

use crate::support::Proxy;
use crate::support::client::{self, ReqBody};
use crate::support::upstream;

/// What the upstream echoed, without the framing headers (each path frames
/// the body its own way) and the connection's own address.
pub fn as_received(mut echoed: serde_json::Value) -> serde_json::Value {
    let headers = echoed["headers"].as_object_mut().expect("headers");
    headers.remove("content-length");
    headers.remove("transfer-encoding");
    echoed.as_object_mut().expect("echo").remove("peer");
    echoed
}

pub const PAYLOAD: &[u8] = b"{\"hello\":\"world\"}";

/// The payload with its length known: sent by the request's task.
pub fn in_hand() -> ReqBody {
    client::body(PAYLOAD)
}

/// The same bytes, of unknown length: chunked, streamed through hyper.
pub fn streamed() -> ReqBody {
    let frames = [Ok::<_, std::io::Error>(Frame::data(Bytes::from_static(
        PAYLOAD,
    )))];
    StreamBody::new(futures_util::stream::iter(frames)).boxed()
}

/// One request's method, target and headers.
pub struct Shape {
    pub name: &'static str,
    pub method: &'static str,
    pub target: &'static str,
    pub headers: &'static [(&'static str, &'static [u8])],
}

pub const SHAPES: &[Shape] = &[
    Shape {
        name: "plain POST",
        method: "POST",
        target: "/api/items",
        headers: &[("content-type", b"application/json")],
    },
    Shape {
        name: "a repeated field keeps its order",
        method: "PUT",
        target: "/x",
        headers: &[("x-dup", b"first"), ("x-other", b"o"), ("x-dup", b"second")],
    },
    Shape {
        name: "obs-text in a value",
        method: "POST",
        target: "/x",
        headers: &[("x-name", b"caf\xc3\xa9 \xff")],
    },
    Shape {
        name: "fields Connection names are dropped",
        method: "POST",
        target: "/x",
        headers: &[
            ("connection", b"keep-alive, x-hop"),
            ("x-hop", b"for the proxy only"),
            ("keep-alive", b"timeout=5"),
            ("proxy-connection", b"keep-alive"),
            ("x-kept", b"k"),
        ],
    },
    Shape {
        name: "TE trailers",
        method: "POST",
        target: "/grpc.Service/Call",
        headers: &[("te", b"trailers"), ("content-type", b"application/grpc")],
    },
    Shape {
        name: "an upgrade the route does not allow",
        method: "POST",
        target: "/x",
        headers: &[("connection", b"upgrade"), ("upgrade", b"h2c")],
    },
    Shape {
        name: "forwarded-for from a client",
        method: "PATCH",
        target: "/x",
        headers: &[
            ("x-forwarded-for", b"203.0.113.7, 198.51.100.2"),
            ("x-forwarded-proto", b"https"),
            ("forwarded", b"for=192.0.2.60;proto=http"),
        ],
    },
    Shape {
        name: "two cookie fields",
        method: "POST",
        target: "/x",
        headers: &[("cookie", b"a=1"), ("cookie", b"b=2")],
    },
    Shape {
        name: "an odd query and an encoded slash",
        method: "DELETE",
        target: "/a%2Fb/c?q=a%20b&x=%ZZ&&y",
        headers: &[],
    },
    Shape {
        name: "an extension method",
        method: "PURGE",
        target: "/cache/key",
        headers: &[("x-a", b"1")],
    },
    Shape {
        name: "a host with a port and capitals",
        method: "POST",
        target: "/x",
        headers: &[("host", b"API.Example.test:8443")],
    },
    Shape {
        name: "an empty value",
        method: "POST",
        target: "/x",
        headers: &[("x-empty", b"")],
    },
];

/// `shape` with `body`, on a connection of its own, as the upstream saw it.
async fn send(proxy: &Proxy, shape: &Shape, body: ReqBody) -> serde_json::Value {
    send_to(proxy.addr, "agree.test", shape, body).await
}

/// `shape` with `body` to `addr` (with `host` unless the shape has its
/// own), on a connection of its own, as the upstream echoed it.
pub async fn send_to(
    addr: std::net::SocketAddr,
    host: &str,
    shape: &Shape,
    body: ReqBody,
) -> serde_json::Value {
    let mut req = Request::builder()
        .method(shape.method)
        .uri(shape.target)
        .body(body)
        .unwrap();
    for (name, value) in shape.headers {
        req.headers_mut().append(
            *name,
            hyper::header::HeaderValue::from_bytes(value).unwrap(),
        );
    }
    if !req.headers().contains_key("host") {
        req.headers_mut().insert("host", host.parse().unwrap());
    }
    let answer = client::Connection::open(addr).await.send(req).await;
    assert_eq!(answer.status, 200, "{}: {:?}", shape.name, answer.body);
    answer.json()
}

/// The routing core alone, every request to `echo`.
pub async fn proxy_to(echo: &upstream::Upstream) -> Proxy {
    proxy_with(echo, "").await
}

/// [`proxy_to`], the upstream with `settings` too (`, key: value`).
async fn proxy_with(echo: &upstream::Upstream, settings: &str) -> Proxy {
    Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: echo, endpoints: ["{}"], retries: 0{settings} }}]
routes: [{{ name: all, match: {{ path_prefix: / }}, upstream: echo }}]
"#,
        echo.url()
    ))
    .await
}

#[tokio::test]
async fn a_body_in_hand_and_a_streamed_one_reach_the_upstream_alike() {
    let echo = upstream::echo("agree").await;
    let proxy = proxy_to(&echo).await;
    let mut report = String::new();
    for shape in SHAPES {
        let by_task = send(&proxy, shape, in_hand()).await;
        let by_hyper = send(&proxy, shape, streamed()).await;
        // Each path framed the body as said, so the test compares what it
        // means to compare.
        assert_eq!(
            by_task["headers"]["content-length"],
            PAYLOAD.len().to_string(),
            "{}",
            shape.name
        );
        assert_eq!(
            by_hyper["headers"]["transfer-encoding"], "chunked",
            "{}",
            shape.name
        );
        assert_eq!(by_task["body_len"], PAYLOAD.len(), "{}", shape.name);
        let (task, hyper) = (as_received(by_task), as_received(by_hyper));
        if task != hyper {
            report.push_str(&format!(
                "\n{}:\n  in hand:  {task}\n  streamed: {hyper}\n",
                shape.name
            ));
        }
    }
    assert!(report.is_empty(), "{report}");
}

/// An HTTP/2 upstream (`http2: true`) gets what an HTTP/1.1 one gets,
/// but for what the protocol itself changes: the version, the target as
/// a full URI, and the Host as `:authority`.
#[tokio::test]
async fn an_http2_upstream_gets_what_an_http1_one_gets() {
    let echo = upstream::echo("agree").await;
    let h1 = proxy_to(&echo).await;
    let h2 = proxy_with(&echo, ", http2: true").await;
    // The authority as each protocol carries it: HTTP/1.1's Host, or the
    // full target's (HTTP/2's `:authority`), compared as one field.
    let bare = |echoed: serde_json::Value| {
        let mut seen = as_received(echoed);
        let host = seen["headers"]
            .as_object_mut()
            .expect("headers")
            .remove("host");
        let fields = seen.as_object_mut().expect("echo");
        let target = fields.remove("target").expect("target");
        let authority = match fields.remove("version").expect("version").as_str() {
            Some("HTTP/2.0") => target
                .as_str()
                .and_then(|t| t.parse::<hyper::Uri>().ok())
                .and_then(|u| u.authority().map(|a| a.to_string()))
                .map(serde_json::Value::from),
            _ => host,
        };
        fields.insert("authority".into(), authority.unwrap_or_default());
        seen
    };
    let mut report = String::new();
    for shape in SHAPES {
        let over_h1 = send(&h1, shape, in_hand()).await;
        let over_h2 = send(&h2, shape, in_hand()).await;
        assert_eq!(over_h2["version"], "HTTP/2.0", "{}", shape.name);
        let (over_h1, over_h2) = (bare(over_h1), bare(over_h2));
        assert!(over_h1["authority"].is_string(), "{}", shape.name);
        if over_h1 != over_h2 {
            report.push_str(&format!(
                "\n{}:\n  HTTP/1.1: {over_h1}\n  HTTP/2:   {over_h2}\n",
                shape.name
            ));
        }
    }
    assert!(report.is_empty(), "{report}");
}
