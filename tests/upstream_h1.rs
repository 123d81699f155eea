//! The proxy's HTTP/1.1 exchange with upstreams, against a scripted TCP
//! upstream that answers with exact bytes: framing (length, chunked,
//! until close), keep-alive and reuse, stale pooled connections,
//! upstreams that send something broken, and a client that leaves
//! mid-request.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use hyper::Request;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::support::Proxy;
use crate::support::client::{self, body};

/// What the scripted upstream does with one request.
enum Reply {
    /// Write these bytes and keep the connection for the next request.
    Keep(Vec<u8>),
    /// Write these bytes, then close.
    Close(Vec<u8>),
    /// Write the first bytes, then, once notified, the second, and close.
    Then(Vec<u8>, Arc<tokio::sync::Notify>, Vec<u8>),
}

/// One request as the upstream saw it.
#[derive(Debug, Clone)]
struct Seen {
    /// Which accepted connection (0, 1, ...).
    conn: usize,
    /// The request head, as text.
    head: String,
    /// The request body (Content-Length bodies only).
    body: Vec<u8>,
}

/// A TCP upstream that reads request heads (and Content-Length bodies) and
/// answers each with the handler's bytes.
struct Scripted {
    addr: std::net::SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Scripted {
    async fn start<F>(reply: F) -> Scripted
    where
        F: Fn(usize, &str) -> Reply + Send + Sync + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let reply = Arc::new(reply);
        let log = seen.clone();
        tokio::spawn(async move {
            for conn in 0.. {
                let Ok((sock, _)) = listener.accept().await else {
                    return;
                };
                tokio::spawn(serve(sock, conn, log.clone(), reply.clone()));
            }
        });
        Scripted { addr, seen }
    }

    fn yaml(&self) -> String {
        self.yaml_with_timeout("30s")
    }

    fn yaml_with_timeout(&self, timeout: &str) -> String {
        format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: up, endpoints: ["http://{}"], retries: 0 }}]
routes: [{{ name: all, match: {{ path_prefix: / }}, upstream: up, timeout: {timeout} }}]
"#,
            self.addr
        )
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    /// How many connections the proxy opened.
    fn connections(&self) -> usize {
        self.seen().iter().map(|s| s.conn + 1).max().unwrap_or(0)
    }
}

async fn serve<F>(mut sock: TcpStream, conn: usize, seen: Arc<Mutex<Vec<Seen>>>, reply: Arc<F>)
where
    F: Fn(usize, &str) -> Reply + Send + Sync + 'static,
{
    let mut buf = Vec::new();
    loop {
        let end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 4096];
            match sock.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..end]).into_owned();
        buf.drain(..end);
        // Skip a Content-Length body (chunked request bodies are not used here).
        let length = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .and_then(|n| n.trim().parse::<usize>().ok())
            .unwrap_or(0);
        while buf.len() < length {
            let mut chunk = [0u8; 4096];
            match sock.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let body: Vec<u8> = buf.drain(..length).collect();
        let n = {
            let mut s = seen.lock().unwrap();
            s.push(Seen {
                conn,
                head: head.clone(),
                body,
            });
            s.iter().filter(|s| s.conn == conn).count() - 1
        };
        match reply(n, &head) {
            Reply::Keep(bytes) => {
                if sock.write_all(&bytes).await.is_err() {
                    return;
                }
            }
            Reply::Close(bytes) => {
                let _ = sock.write_all(&bytes).await;
                return;
            }
            Reply::Then(first, go, rest) => {
                if sock.write_all(&first).await.is_ok() {
                    go.notified().await;
                    let _ = sock.write_all(&rest).await;
                }
                return;
            }
        }
    }
}

/// `200 ok`, keeping the connection.
fn ok() -> Reply {
    keep("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
}

fn keep(s: &str) -> Reply {
    Reply::Keep(s.as_bytes().to_vec())
}

/// `method` on `path` through `client` (one connection to the proxy, so
/// its requests share a worker and its upstream pool).
async fn get(
    client: &mut client::Connection,
    proxy: &Proxy,
    method: &str,
    path: &str,
) -> client::Answer {
    let req = Request::builder()
        .method(method)
        .uri(proxy.url(path))
        .body(body(Bytes::new()))
        .unwrap();
    client.send(req).await
}

#[tokio::test]
async fn chunked_bodies_with_extensions_and_trailers_arrive_whole_and_the_connection_is_reused() {
    let up = Scripted::start(|_, _| {
        keep(
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nx-up: 1\r\n\r\n\
             5;name=value\r\nhello\r\n7\r\n, world\r\n0\r\nx-trailer: t\r\n\r\n",
        )
    })
    .await;
    let proxy = Proxy::start_yaml(&up.yaml()).await;
    let mut c = client::Connection::open(proxy.addr).await;
    for _ in 0..3 {
        let a = get(&mut c, &proxy, "GET", "/c").await;
        assert_eq!(a.status, 200);
        assert_eq!(&a.body[..], b"hello, world");
        assert_eq!(a.header("x-up"), Some("1"));
    }
    assert_eq!(up.seen().len(), 3);
    assert_eq!(
        up.connections(),
        1,
        "each response ended cleanly, so one connection serves all"
    );
}

#[tokio::test]
async fn content_length_bodies_keep_the_connection_and_the_request_head_is_as_sent() {
    let up = Scripted::start(|_, _| ok()).await;
    let proxy = Proxy::start_yaml(&up.yaml()).await;
    let mut c = client::Connection::open(proxy.addr).await;
    let a = get(&mut c, &proxy, "GET", "/a/b?q=1").await;
    assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"ok"[..]));
    let a = get(&mut c, &proxy, "POST", "/p").await;
    assert_eq!(a.status, 200);
    let seen = up.seen();
    assert_eq!(up.connections(), 1);
    let first = &seen[0].head;
    assert!(first.starts_with("GET /a/b?q=1 HTTP/1.1\r\n"), "{first}");
    assert!(first.contains(&format!("host: {}\r\n", up.addr)), "{first}");
    assert!(first.contains("x-forwarded-for: 127.0.0.1\r\n"), "{first}");
    // An empty POST says so: some servers answer 411 otherwise.
    assert!(seen[1].head.starts_with("POST /p HTTP/1.1\r\n"));
    assert!(
        seen[1].head.contains("content-length: 0\r\n"),
        "{}",
        seen[1].head
    );
}

#[tokio::test]
async fn a_connection_idle_longer_than_the_idle_timeout_is_not_reused() {
    let up = Scripted::start(|_, _| ok()).await;
    let yaml = up
        .yaml()
        .replace("retries: 0 }", "retries: 0, timeouts: { idle: 200ms } }");
    assert!(yaml.contains("idle: 200ms"), "{yaml}");
    let proxy = Proxy::start_yaml(&yaml).await;
    let mut c = client::Connection::open(proxy.addr).await;
    for _ in 0..2 {
        assert_eq!(get(&mut c, &proxy, "GET", "/a").await.status, 200);
    }
    assert_eq!(up.connections(), 1, "reused within the idle timeout");
    // Waiting out the idle timeout is the behaviour under test.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(get(&mut c, &proxy, "GET", "/a").await.status, 200);
    assert_eq!(up.connections(), 2, "idle too long: a new connection");
}

/// An upstream answering 200 to everything, and a proxy to it whose
/// upstream has `settings` too.
async fn ok_upstream_with(settings: &str) -> (Scripted, Proxy) {
    let up = Scripted::start(|_, _| ok()).await;
    let yaml = up
        .yaml()
        .replace("retries: 0 }", &format!("retries: 0, {settings} }}"));
    assert!(yaml.contains(settings), "{yaml}");
    let proxy = Proxy::start_yaml(&yaml).await;
    (up, proxy)
}

#[tokio::test]
async fn a_connection_is_closed_after_its_max_requests() {
    let (up, proxy) = ok_upstream_with("max_requests_per_connection: 3").await;
    let mut c = client::Connection::open(proxy.addr).await;
    // Bodiless (exchanged in the request's task), then a body too large to
    // hold (hyper takes the connection over, and its count with it).
    assert_eq!(get(&mut c, &proxy, "GET", "/1").await.status, 200);
    let large = Bytes::from(vec![b'x'; 100 * 1024]);
    let req = Request::post(proxy.url("/2")).body(body(large)).unwrap();
    assert_eq!(c.send(req).await.status, 200);
    for path in ["/3", "/4", "/5", "/6", "/7"] {
        assert_eq!(get(&mut c, &proxy, "GET", path).await.status, 200);
    }
    let per_conn: Vec<usize> = (0..up.connections())
        .map(|n| up.seen().iter().filter(|s| s.conn == n).count())
        .collect();
    assert_eq!(per_conn, [3, 3, 1]);
}

#[tokio::test]
async fn a_busy_connection_is_replaced_at_the_end_of_its_lifetime() {
    let (up, proxy) = ok_upstream_with("timeouts: { lifetime: 300ms }").await;
    let mut c = client::Connection::open(proxy.addr).await;
    // Never idle for long (the idle timeout is 90 s): only its age ends
    // the first connection. Letting time pass is the behaviour under test.
    for _ in 0..8 {
        assert_eq!(get(&mut c, &proxy, "GET", "/a").await.status, 200);
        tokio::time::sleep(std::time::Duration::from_millis(60)).await;
    }
    let first = up.seen().iter().filter(|s| s.conn == 0).count();
    assert!(up.connections() >= 2, "one connection for 480 ms");
    assert!((2..8).contains(&first), "{first} requests on the first");
}

#[tokio::test]
async fn an_http2_connection_is_replaced_after_its_max_requests() {
    let up = crate::support::upstream::echo("h2").await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: up, endpoints: ["{}"], http2: true, max_requests_per_connection: 2 }}]
routes: [{{ name: all, match: {{ path_prefix: / }}, upstream: up }}]
"#,
        up.url()
    ))
    .await;
    let mut c = client::Connection::open(proxy.addr).await;
    let mut peers = Vec::new();
    for _ in 0..5 {
        let answer = get(&mut c, &proxy, "GET", "/a").await;
        assert_eq!(answer.json()["version"], "HTTP/2.0");
        peers.push(answer.json()["peer"].as_str().unwrap().to_owned());
    }
    assert_eq!(peers[0], peers[1]);
    assert_ne!(peers[1], peers[2]);
    assert_eq!(peers[2], peers[3]);
    assert_ne!(peers[3], peers[4]);
}

#[tokio::test]
async fn requests_with_and_without_bodies_share_the_pooled_connections() {
    let up = Scripted::start(|_, _| ok()).await;
    let proxy = Proxy::start_yaml(&up.yaml()).await;
    let mut c = client::Connection::open(proxy.addr).await;
    // Bodiless; a small body (sent whole by the request's task); a body
    // too large to hold (streamed by hyper, which takes the pooled
    // connection over); bodiless again on the connection hyper now drives.
    assert_eq!(get(&mut c, &proxy, "GET", "/1").await.status, 200);
    assert_eq!(
        send_body(&mut c, &proxy, "POST", b"payload").await.status,
        200
    );
    let large = Bytes::from(vec![b'x'; 100 * 1024]);
    let req = Request::post(proxy.url("/3")).body(body(large)).unwrap();
    assert_eq!(c.send(req).await.status, 200);
    assert_eq!(get(&mut c, &proxy, "GET", "/4").await.status, 200);
    let seen = up.seen();
    assert_eq!(seen.len(), 4);
    assert_eq!(seen[1].body, b"payload");
    assert_eq!(seen[2].body.len(), 100 * 1024);
    assert!(seen[3].head.starts_with("GET /4 "), "{}", seen[3].head);
    assert_eq!(up.connections(), 1);
}

#[tokio::test]
async fn a_body_until_close_is_passed_whole_and_the_connection_is_not_reused() {
    let up = Scripted::start(|_, _| {
        Reply::Close(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it".to_vec())
    })
    .await;
    let proxy = Proxy::start_yaml(&up.yaml()).await;
    let mut c = client::Connection::open(proxy.addr).await;
    for _ in 0..2 {
        let a = get(&mut c, &proxy, "GET", "/").await;
        assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"all of it"[..]));
    }
    assert_eq!(up.connections(), 2);
}

#[tokio::test]
async fn connection_close_and_http_1_0_answers_are_not_reused() {
    let up = Scripted::start(|_, head| {
        if head.starts_with("GET /old ") {
            keep("HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\nb")
        } else {
            keep("HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 1\r\n\r\na")
        }
    })
    .await;
    let proxy = Proxy::start_yaml(&up.yaml()).await;
    let mut c = client::Connection::open(proxy.addr).await;
    for (path, want) in [("/close", "a"), ("/old", "b"), ("/close", "a")] {
        assert_eq!(
            &get(&mut c, &proxy, "GET", path).await.body[..],
            want.as_bytes()
        );
    }
    // Each connection served exactly one request: the proxy never sent a
    // second one on a connection the upstream asked to close.
    assert_eq!(up.connections(), 3);
    assert_eq!(up.seen().len(), 3);
}

#[tokio::test]
async fn head_204_304_and_interim_answers_carry_no_body() {
    let up = Scripted::start(|_, head| {
        if head.starts_with("HEAD") {
            keep("HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
        } else if head.starts_with("GET /204") {
            keep("HTTP/1.1 204 No Content\r\n\r\n")
        } else if head.starts_with("GET /304") {
            keep("HTTP/1.1 304 Not Modified\r\netag: \"x\"\r\n\r\n")
        } else {
            keep(
                "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </s.css>\r\n\r\n\
                 HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nfinal",
            )
        }
    })
    .await;
    let proxy = Proxy::start_yaml(&up.yaml()).await;
    let mut c = client::Connection::open(proxy.addr).await;
    let a = get(&mut c, &proxy, "HEAD", "/h").await;
    assert_eq!(a.status, 200);
    assert_eq!(a.header("content-length"), Some("1000"));
    assert!(a.body.is_empty());
    assert_eq!(get(&mut c, &proxy, "GET", "/204").await.status, 204);
    let a = get(&mut c, &proxy, "GET", "/304").await;
    assert_eq!((a.status.as_u16(), a.header("etag")), (304, Some("\"x\"")));
    let a = get(&mut c, &proxy, "GET", "/interim").await;
    assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"final"[..]));
    assert_eq!(
        up.connections(),
        1,
        "none of these answers ends the connection"
    );
}

#[tokio::test]
async fn a_reused_connection_dropped_by_the_upstream_is_retried_for_idempotent_methods_only() {
    // The upstream reads the second request on each connection and closes
    // without answering: what a keep-alive timeout racing a request looks
    // like from the proxy.
    let up = Scripted::start(|n, _| match n {
        0 => ok(),
        _ => Reply::Close(Vec::new()),
    })
    .await;
    let proxy = Proxy::start_yaml(&up.yaml()).await;
    let mut c = client::Connection::open(proxy.addr).await;
    assert_eq!(get(&mut c, &proxy, "GET", "/").await.status, 200);
    // The GET finds its pooled connection dead after sending; it goes again
    // on a new connection and succeeds.
    let a = get(&mut c, &proxy, "GET", "/").await;
    assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"ok"[..]));
    assert_eq!(up.connections(), 2);
    // So does a PUT with a small body (held whole), body and all.
    let a = send_body(&mut c, &proxy, "PUT", b"{\"v\":1}").await;
    assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"ok"[..]));
    let puts: Vec<Seen> = up
        .seen()
        .into_iter()
        .filter(|s| s.head.starts_with("PUT"))
        .collect();
    assert_eq!(puts.len(), 2);
    for put in &puts {
        assert_eq!(put.body, b"{\"v\":1}");
        assert!(put.head.contains("content-length: 7\r\n"), "{}", put.head);
    }
    // A POST is not sent twice: the upstream may have acted on it.
    let a = send_body(&mut c, &proxy, "POST", b"once").await;
    assert_eq!(a.status, 502);
    assert_eq!(a.json()["error"], "upstream connection failed");
    let posts = up
        .seen()
        .iter()
        .filter(|s| s.head.starts_with("POST"))
        .count();
    assert_eq!(posts, 1);
}

#[tokio::test]
async fn broken_answers_are_502_and_the_proxy_keeps_serving() {
    let big = format!(
        "HTTP/1.1 200 OK\r\nx-big: {}\r\n\r\n",
        "a".repeat(70 * 1024)
    );
    let up = Scripted::start(move |_, head| {
        let path = head.split(' ').nth(1).unwrap_or("");
        match path {
            "/garbage" => Reply::Close(b"SSH-2.0-OpenSSH\r\n\r\n".to_vec()),
            "/bad-length" => {
                Reply::Close(b"HTTP/1.1 200 OK\r\ncontent-length: 1, 2\r\n\r\nx".to_vec())
            }
            "/huge-head" => Reply::Close(big.clone().into_bytes()),
            "/switch" => Reply::Close(b"HTTP/1.1 101 Switching Protocols\r\n\r\n".to_vec()),
            // Broken in what comes with the head: nothing has gone to
            // the client yet.
            "/bad-chunk" => Reply::Close(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n".to_vec(),
            ),
            "/bad-second-chunk" => Reply::Close(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n-1\r\n".to_vec(),
            ),
            "/long-chunk" => Reply::Close(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nokay\r\n".to_vec(),
            ),
            _ => ok(),
        }
    })
    .await;
    let mut proxy = crate::support::process::ProxyProcess::start(&up.yaml(), &[]).await;
    for path in [
        "/garbage",
        "/bad-length",
        "/huge-head",
        "/switch",
        "/bad-chunk",
        "/bad-second-chunk",
        "/long-chunk",
    ] {
        let a = client::get(&proxy.url(path)).await;
        assert_eq!(a.status, 502, "{path}");
        assert_eq!(a.json()["error"], "upstream connection failed", "{path}");
        assert_eq!(client::get(&proxy.url("/fine")).await.status, 200);
    }
    let why = proxy.wait_for_log("invalid chunk size `-1`").await;
    assert!(why.contains("upstream response body"), "{why}");
}

#[tokio::test]
async fn a_body_cut_short_by_the_upstream_is_cut_short_for_the_client() {
    let up = Scripted::start(|_, _| {
        Reply::Close(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf".to_vec())
    })
    .await;
    let proxy = Proxy::start_yaml(&up.yaml()).await;
    assert_cut_short(&proxy, "/").await;
}

#[tokio::test]
async fn a_body_the_upstream_breaks_is_logged_with_why() {
    // The first chunk passes and reaches the client; then the second's
    // size is not hex. The answer has begun, so it can only be cut short.
    let go = Arc::new(tokio::sync::Notify::new());
    let upstream_go = go.clone();
    let up = Scripted::start(move |_, _| {
        Reply::Then(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n".to_vec(),
            upstream_go.clone(),
            b"zz\r\nmore\r\n".to_vec(),
        )
    })
    .await;
    let mut proxy = crate::support::process::ProxyProcess::start(&up.yaml(), &[]).await;
    let mut conn = TcpStream::connect(proxy.addr).await.unwrap();
    conn.write_all(b"GET /broken HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("hello") {
        let mut chunk = [0u8; 1024];
        let n = conn.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed before the first chunk: {got:?}");
        got.extend_from_slice(&chunk[..n]);
    }
    assert!(got.starts_with(b"HTTP/1.1 200 OK\r\n"), "{got:?}");
    go.notify_one();
    let read_rest = conn.read_to_end(&mut got);
    tokio::time::timeout(std::time::Duration::from_secs(10), read_rest)
        .await
        .expect("the proxy did not close the connection")
        .unwrap();
    let got = String::from_utf8_lossy(&got);
    // Not a whole answer: the chunked body lacks its last chunk.
    assert!(!got.ends_with("0\r\n\r\n"), "{got}");
    let why = proxy
        .wait_for_log("response cut: the upstream's body broke")
        .await;
    assert!(why.contains("invalid chunk size `zz`"), "{why}");
    assert!(
        why.contains("upstream") && why.contains(&up.addr.to_string()),
        "{why}"
    );
    let access = proxy.wait_for_log(r#"/broken"#).await;
    assert!(access.contains("aborted"), "{access}");
}

/// GET `path` must fail on the client's side: either no response at all
/// (the proxy had not flushed the head when the body broke) or a body that
/// ends in an error, never what looks like a whole response.
async fn assert_cut_short(proxy: &Proxy, path: &str) {
    let req = Request::get(proxy.url(path))
        .body(body(Bytes::new()))
        .unwrap();
    let sent = tokio::time::timeout(
        std::time::Duration::from_secs(20),
        client::http1().request(req),
    )
    .await
    .expect("an answer or an error within 20 s");
    if let Ok(resp) = sent {
        let collected = tokio::time::timeout(
            std::time::Duration::from_secs(20),
            http_body_util::BodyExt::collect(resp.into_body()),
        )
        .await
        .expect("the body ends within 20 s");
        assert!(collected.is_err(), "{path}: a cut body looked complete");
    }
}

/// Sends `method /` with `body` through `client`.
async fn send_body(
    client: &mut client::Connection,
    proxy: &Proxy,
    method: &str,
    body_bytes: &'static [u8],
) -> client::Answer {
    let req = Request::builder()
        .method(method)
        .uri(proxy.url("/"))
        .body(body(Bytes::from_static(body_bytes)))
        .unwrap();
    client.send(req).await
}

#[tokio::test]
async fn a_large_body_streams_and_arrives_whole() {
    let up = Scripted::start(|_, _| ok()).await;
    let proxy = Proxy::start_yaml(&up.yaml()).await;
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let req = Request::post(proxy.url("/big"))
        .body(body(Bytes::from(payload.clone())))
        .unwrap();
    assert_eq!(client::send(&client::http1(), req).await.status, 200);
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert!(
        seen[0].head.contains("content-length: 200000\r\n"),
        "{}",
        seen[0].head
    );
    assert!(seen[0].body == payload, "the upstream got other bytes");
}

#[tokio::test]
async fn a_client_too_slow_with_its_body_gets_408_and_nothing_reaches_the_upstream() {
    let up = Scripted::start(|_, _| ok()).await;
    let proxy = Proxy::start_yaml(&up.yaml_with_timeout("300ms")).await;
    let mut sock = TcpStream::connect(proxy.addr).await.unwrap();
    sock.write_all(b"POST /slow HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nabc")
        .await
        .unwrap();
    let text = read_until(&mut sock, b"\r\n\r\n").await;
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(up.seen().is_empty(), "a partial body must not be forwarded");
    assert_eq!(client::get(&proxy.url("/fine")).await.status, 200);
}

#[tokio::test]
async fn a_client_expecting_100_continue_is_told_to_send_and_its_body_arrives() {
    let up = Scripted::start(|_, _| ok()).await;
    let proxy = Proxy::start_yaml(&up.yaml()).await;
    let mut sock = TcpStream::connect(proxy.addr).await.unwrap();
    sock.write_all(
        b"POST /e HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 5\r\n\r\n",
    )
    .await
    .unwrap();
    // The client sends nothing more until told to; a proxy waiting for the
    // body without saying so would hang here.
    let interim = read_until(&mut sock, b"\r\n\r\n").await;
    assert!(interim.starts_with("HTTP/1.1 100 Continue"), "{interim}");
    sock.write_all(b"hello").await.unwrap();
    let answer = read_until(&mut sock, b"\r\n\r\nok").await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].body, b"hello");
}

/// Reads from `sock` until `want` has arrived (10 s at most); everything
/// read, as text.
async fn read_until(sock: &mut TcpStream, want: &[u8]) -> String {
    let mut got = Vec::new();
    let mut chunk = [0u8; 1024];
    let reading = async {
        while !got.windows(want.len()).any(|w| w == want) {
            let n = sock.read(&mut chunk).await.unwrap();
            assert!(n > 0, "closed early: {}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&chunk[..n]);
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), reading)
        .await
        .unwrap_or_else(|_| panic!("no {:?} within 10 s", String::from_utf8_lossy(want)));
    String::from_utf8_lossy(&got).into_owned()
}

#[tokio::test]
async fn a_client_that_leaves_mid_request_cancels_the_upstream_exchange() {
    let mut upstream = crate::support::upstream::never_answering().await;
    let proxy = proxy_to(upstream.addr).await;
    let mut client = TcpStream::connect(proxy.addr).await.unwrap();
    client
        .write_all(b"GET /slow HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    upstream.request_arrived().await;
    // The client goes away while the upstream works (as a browser tab
    // closed on a slow page): the proxy drops the exchange and its
    // upstream connection at once, as nginx and Envoy do, rather than
    // holding them until the 60 s route timeout.
    drop(client);
    upstream.closed_soon().await;
}

#[tokio::test]
async fn a_client_that_leaves_a_quiet_stream_ends_it_upstream() {
    // An event stream that sends one event, then nothing, and reports when
    // the proxy closes the connection.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (closed, closed_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        if !read_head(&mut sock).await {
            return;
        }
        let event = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
            transfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n";
        if sock.write_all(event).await.is_err() {
            return;
        }
        until_closed(&mut sock).await;
        let _ = closed.send(());
    });
    let proxy = proxy_to(addr).await;
    let mut client = TcpStream::connect(proxy.addr).await.unwrap();
    client
        .write_all(b"GET /events HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let seen = read_until(&mut client, b"data: 1").await;
    assert!(seen.starts_with("HTTP/1.1 200"), "{seen}");
    // The client leaves while the stream is quiet: the proxy ends the
    // upstream stream too, without waiting for an event to fail on.
    drop(client);
    tokio::time::timeout(std::time::Duration::from_secs(5), closed_rx)
        .await
        .expect("the upstream stream was still open 5 s after the client left")
        .expect("upstream task");
}

/// Reads a request head off `sock`; false if the peer closed first.
async fn read_head(sock: &mut TcpStream) -> bool {
    let mut head = Vec::new();
    let mut chunk = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        match sock.read(&mut chunk).await {
            Ok(0) | Err(_) => return false,
            Ok(n) => head.extend_from_slice(&chunk[..n]),
        }
    }
    true
}

/// Reads and discards until the peer closes `sock`.
async fn until_closed(sock: &mut TcpStream) {
    let mut chunk = [0u8; 1024];
    while let Ok(n) = sock.read(&mut chunk).await {
        if n == 0 {
            break;
        }
    }
}

/// A proxy forwarding everything to `addr`, with a 60 s route timeout.
async fn proxy_to(addr: std::net::SocketAddr) -> Proxy {
    Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: up, endpoints: ["http://{addr}"], retries: 0 }}]
routes: [{{ name: all, match: {{ path_prefix: / }}, upstream: up, timeout: 60s }}]
"#
    ))
    .await
}
