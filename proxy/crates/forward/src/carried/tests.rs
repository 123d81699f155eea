use super::*;
use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const CLIENT: HeaderName = HeaderName::from_static("x-test-client");
const OWN: HeaderName = HeaderName::from_static("x-test-own");
const HOST: &str = "rt-1.tunnels.example";

fn carriage(trust: bool) -> Carriage<'static> {
    Carriage {
        host: HOST,
        scheme: "https",
        trust,
        own_fields: &["x-test-own"],
        client: Some((CLIENT, HeaderValue::from_static("192.0.2.7:4000"))),
    }
}

/// A public HTTP/1.1 request with hop-by-hop fields, forwarded fields it
/// made up, a client certificate it claims and the carrier's own fields.
fn public_request() -> Request<Body> {
    Request::builder()
        .uri("/a/b?c=d")
        .header("host", "rt-1.tunnels.example:8443")
        .header("connection", "keep-alive, x-hop")
        .header("x-hop", "1")
        .header("x-forwarded-proto", "http")
        .header("x-forwarded-host", "elsewhere.example")
        .header(CLIENT_CERT, "made-up")
        .header(OWN, "spoofed")
        .header(CLIENT, "spoofed")
        .header("x-keep", "yes")
        .body(Body::full(bytes::Bytes::from_static(b"hello")))
        .unwrap()
}

#[test]
fn a_request_crosses_as_http2_to_its_host_with_its_client_named_and_made_up_fields_gone() {
    let mut carried = Carried::new(public_request(), &carriage(false)).unwrap();
    let req = carried.request_mut();
    assert_eq!(req.version(), Version::HTTP_2);
    assert_eq!(req.method(), Method::GET);
    assert_eq!(req.uri(), "https://rt-1.tunnels.example/a/b?c=d");
    let h = req.headers();
    for gone in ["host", "connection", "x-hop", "x-forwarded-client-cert"] {
        assert!(!h.contains_key(gone), "{gone}: {h:?}");
    }
    assert!(!h.contains_key(&OWN), "{h:?}");
    assert_eq!(h[&CLIENT], "192.0.2.7:4000");
    assert_eq!(h["x-forwarded-proto"], "https");
    assert_eq!(h["x-forwarded-host"], HOST);
    assert_eq!(h["x-keep"], "yes");
    assert!(carried.upgrade.is_none());
}

#[test]
fn a_trusted_request_keeps_its_forwarded_fields_but_never_the_carriers_own() {
    let mut carried = Carried::new(public_request(), &carriage(true)).unwrap();
    let h = carried.request_mut().headers();
    assert_eq!(h["x-forwarded-proto"], "http");
    assert_eq!(h["x-forwarded-host"], "elsewhere.example");
    assert_eq!(h[CLIENT_CERT], "made-up");
    assert!(!h.contains_key(&OWN), "{h:?}");
    assert_eq!(h[&CLIENT], "192.0.2.7:4000");
}

#[test]
fn a_websocket_upgrade_crosses_as_an_extended_connect_without_a_body() {
    for (req, as_connect) in [
        (
            Request::builder()
                .uri("/ws")
                .header("connection", "Upgrade")
                .header("upgrade", "websocket")
                .header("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ==")
                .body(Body::full(bytes::Bytes::from_static(b"x")))
                .unwrap(),
            false,
        ),
        // A replica passing one on: an extended CONNECT already.
        (
            {
                let mut r = Request::builder()
                    .method(Method::CONNECT)
                    .uri("https://rt-1.tunnels.example/ws")
                    .version(Version::HTTP_2)
                    .body(Body::empty())
                    .unwrap();
                r.extensions_mut()
                    .insert(hyper::ext::Protocol::from_static("websocket"));
                r
            },
            true,
        ),
    ] {
        let mut carried = Carried::new(req, &carriage(false)).unwrap();
        let upgrade = carried.upgrade.as_ref().expect("an upgrade");
        assert_eq!(
            (upgrade.protocol.as_bytes(), upgrade.as_connect),
            (&b"websocket"[..], as_connect)
        );
        let req = carried.request_mut();
        assert_eq!(req.method(), Method::CONNECT);
        let protocol = req.extensions().get::<hyper::ext::Protocol>().unwrap();
        assert_eq!(protocol.as_str(), "websocket");
        assert!(!req.headers().contains_key("upgrade"));
        // The handshake's own fields go on to the far end.
        let key = req.headers().contains_key("sec-websocket-key");
        assert_eq!(key, !as_connect);
        assert!(http_body::Body::is_end_stream(req.body()));
    }
    // A plain CONNECT, or an `Upgrade` that is not WebSocket's, is no
    // upgrade here.
    let plain = Request::builder()
        .method(Method::CONNECT)
        .uri("rt-1.tunnels.example:443")
        .body(Body::empty())
        .unwrap();
    assert!(
        Carried::new(plain, &carriage(false))
            .unwrap()
            .upgrade
            .is_none()
    );
    let h2c = Request::builder()
        .header("connection", "upgrade")
        .header("upgrade", "h2c")
        .body(Body::empty())
        .unwrap();
    assert!(
        Carried::new(h2c, &carriage(false))
            .unwrap()
            .upgrade
            .is_none()
    );
}

/// A carrier over a real HTTP/2 connection to a loopback server that
/// answers with what it got, opens extended CONNECTs and echoes their
/// bytes; `broken` makes every send fail.
struct H2 {
    sender: hyper::client::conn::http2::SendRequest<Body>,
    broken: bool,
}

impl Carrier for H2 {
    async fn carry(&self, req: Request<Body>) -> Result<Response<Incoming>, String> {
        if self.broken {
            return Err("the carrier's connection is gone".into());
        }
        let mut sender = self.sender.clone();
        sender.send_request(req).await.map_err(|e| e.to_string())
    }
}

async fn h2_carrier() -> H2 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let service = hyper::service::service_fn(|mut req: Request<Incoming>| async move {
            if req.method() == Method::CONNECT {
                let upgraded = hyper::upgrade::on(&mut req);
                tokio::spawn(async move {
                    let mut io = TokioIo::new(upgraded.await.unwrap());
                    let mut buf = [0u8; 64];
                    let n = io.read(&mut buf).await.unwrap();
                    io.write_all(&buf[..n]).await.unwrap();
                    io.shutdown().await.unwrap();
                });
                return Ok::<_, hyper::Error>(Response::new(Body::empty()));
            }
            let uri = req.uri().to_string();
            let body = req.into_body().collect().await?.to_bytes();
            let mut resp = Response::new(Body::full(body));
            resp.headers_mut().insert("x-got-uri", uri.parse().unwrap());
            resp.headers_mut()
                .insert("keep-alive", "timeout=5".parse().unwrap());
            Ok(resp)
        });
        hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .enable_connect_protocol()
            .serve_connection(TokioIo::new(stream), service)
            .await
            .unwrap();
    });
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    H2 {
        sender,
        broken: false,
    }
}

#[tokio::test]
async fn a_carried_request_is_answered_without_the_far_ends_hop_by_hop_fields() {
    let carrier = h2_carrier().await;
    let carried = Carried::new(public_request(), &carriage(false)).unwrap();
    let tracker = TaskTracker::new();
    let resp = carried.send(&carrier, (&tracker, "rt-1")).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(
        resp.headers()["x-got-uri"],
        "https://rt-1.tunnels.example/a/b?c=d"
    );
    assert!(
        !resp.headers().contains_key("keep-alive"),
        "{:?}",
        resp.headers()
    );
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(&body[..], b"hello");
}

#[tokio::test]
async fn a_carriers_failure_is_a_failed_upstream() {
    let mut carrier = h2_carrier().await;
    carrier.broken = true;
    let carried = Carried::new(public_request(), &carriage(false)).unwrap();
    let Err(e) = carried.send(&carrier, (&TaskTracker::new(), "rt-1")).await else {
        panic!("a broken carrier answered");
    };
    assert!(
        matches!(&e, ForwardError::Failed(why) if why.contains("connection is gone")),
        "{e:?}"
    );
    assert_eq!(e.status(), StatusCode::BAD_GATEWAY);
}

/// An HTTP/1.1 client's WebSocket upgrade through a carried upstream:
/// answered 101, then its bytes go to the far end and back.
#[tokio::test]
async fn an_http1_upgrade_is_answered_101_and_spliced_to_the_far_end() {
    let carrier = std::sync::Arc::new(h2_carrier().await);
    let tracker = TaskTracker::new();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let serving = tracker.clone();
    tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let (carrier, tracker) = (carrier.clone(), serving.clone());
            async move {
                let carried = Carried::new(req, &carriage(false)).unwrap();
                carried.send(&*carrier, (&tracker, "rt-1")).await
            }
        });
        hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(stream), service)
            .with_upgrades()
            .await
            .unwrap();
    });
    let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
    client
        .write_all(b"GET /ws HTTP/1.1\r\nHost: rt-1.tunnels.example\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
        .await
        .unwrap();
    let mut head = Vec::new();
    while !head.ends_with(b"\r\n\r\n") {
        let mut byte = [0u8];
        client.read_exact(&mut byte).await.unwrap();
        head.push(byte[0]);
    }
    let head = String::from_utf8(head).unwrap().to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 101"), "{head}");
    assert!(head.contains("upgrade: websocket\r\n"), "{head}");
    client.write_all(b"ping through").await.unwrap();
    let mut echoed = Vec::new();
    client.read_to_end(&mut echoed).await.unwrap();
    assert_eq!(&echoed[..], b"ping through");
}
