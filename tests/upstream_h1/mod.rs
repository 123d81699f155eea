//! The proxy's HTTP/1.1 exchange with upstreams, against a scripted TCP
//! upstream that answers with exact bytes: framing (length, chunked,
//! until close), keep-alive and reuse, stale pooled connections,
//! upstreams that send something broken, and a client that leaves
//! mid-request.

mod failures;
mod reuse;

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
