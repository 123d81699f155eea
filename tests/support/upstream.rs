//! Real upstream servers on 127.0.0.1:0.

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

/// The body type test upstreams answer with.
pub type RespBody = BoxBody<Bytes, std::io::Error>;

/// Wraps bytes as a response body.
pub fn full(data: impl Into<Bytes>) -> RespBody {
    Full::new(data.into())
        .map_err(|never| match never {})
        .boxed()
}

/// The client address of the connection a request came on.
#[derive(Clone, Copy, Debug)]
pub struct Peer(pub SocketAddr);

/// A running upstream server.
pub struct Upstream {
    /// Its address.
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Upstream {
    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts an HTTP/1.1 + h2c server that answers with `handler`.
pub async fn serve<F, Fut>(handler: F) -> Upstream
where
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<RespBody>> + Send + 'static,
{
    serve_with(handler, None, "127.0.0.1:0".parse().unwrap()).await
}

/// [`echo`] listening on `addr` (another loopback address: a second pod
/// of one DNS name).
pub async fn echo_at(name: &'static str, addr: SocketAddr) -> Upstream {
    serve_at(echo_handler(name), addr).await
}

/// [`serve`] listening on `addr`.
pub async fn serve_at<F, Fut>(handler: F, addr: SocketAddr) -> Upstream
where
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<RespBody>> + Send + 'static,
{
    serve_with(handler, None, addr).await
}

/// Like [`serve`], over TLS with `tls` (ALPN picks HTTP/1.1 or HTTP/2).
pub async fn serve_tls<F, Fut>(handler: F, tls: Arc<rustls::ServerConfig>) -> Upstream
where
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<RespBody>> + Send + 'static,
{
    let any = "127.0.0.1:0".parse().unwrap();
    serve_with(handler, Some(tokio_rustls::TlsAcceptor::from(tls)), any).await
}

async fn serve_with<F, Fut>(
    handler: F,
    tls: Option<tokio_rustls::TlsAcceptor>,
    at: SocketAddr,
) -> Upstream
where
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Response<RespBody>> + Send + 'static,
{
    let listener = TcpListener::bind(at)
        .await
        .unwrap_or_else(|e| panic!("bind upstream on {at}: {e}"));
    let addr = listener.local_addr().expect("addr");
    let handler = Arc::new(handler);
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, peer)) = listener.accept().await else {
                continue;
            };
            let handler = handler.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                let svc = service_fn(move |mut req: Request<Incoming>| {
                    req.extensions_mut().insert(Peer(peer));
                    let handler = handler.clone();
                    async move { Ok::<_, Infallible>(handler(req).await) }
                });
                let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                match tls {
                    None => {
                        let _ = builder
                            .serve_connection_with_upgrades(TokioIo::new(stream), svc)
                            .await;
                    }
                    Some(acceptor) => {
                        let Ok(stream) = acceptor.accept(stream).await else {
                            return;
                        };
                        let _ = builder
                            .serve_connection_with_upgrades(TokioIo::new(stream), svc)
                            .await;
                    }
                }
            });
        }
    });
    Upstream { addr, task }
}

/// An upstream that answers every request with a JSON description of it:
/// method, path (with query), headers, body length and an FNV-1a hash of
/// the body, plus `name` so tests can tell upstreams apart.
pub async fn echo(name: &'static str) -> Upstream {
    serve(echo_handler(name)).await
}

/// [`echo`], also counting the requests that reach it.
pub async fn counted_echo(name: &'static str) -> (Upstream, Arc<AtomicUsize>) {
    let hits = Arc::new(AtomicUsize::new(0));
    let counter = hits.clone();
    let handler = echo_handler(name);
    let echo = serve(move |req| {
        counter.fetch_add(1, Ordering::SeqCst);
        handler(req)
    })
    .await;
    (echo, hits)
}

/// [`echo`] over TLS.
pub async fn echo_tls(name: &'static str, tls: Arc<rustls::ServerConfig>) -> Upstream {
    serve_tls(echo_handler(name), tls).await
}

fn echo_handler(
    name: &'static str,
) -> impl Fn(Request<Incoming>) -> std::pin::Pin<Box<dyn Future<Output = Response<RespBody>> + Send>>
+ Send
+ Sync
+ 'static {
    move |req: Request<Incoming>| {
        Box::pin(async move {
            let version = format!("{:?}", req.version());
            let peer = req
                .extensions()
                .get::<Peer>()
                .map(|p| p.0.to_string())
                .unwrap_or_default();
            let method = req.method().to_string();
            // As written on the request line: origin or absolute form.
            let target = req.uri().to_string();
            let path = req
                .uri()
                .path_and_query()
                .map(|p| p.to_string())
                .unwrap_or_default();
            let mut headers = serde_json::Map::new();
            for (k, v) in req.headers() {
                let v = String::from_utf8_lossy(v.as_bytes()).into_owned();
                headers
                    .entry(k.as_str().to_owned())
                    .and_modify(|e| {
                        if let serde_json::Value::String(s) = e {
                            s.push_str(", ");
                            s.push_str(&v);
                        }
                    })
                    .or_insert(serde_json::Value::String(v));
            }
            let mut body = req.into_body();
            let mut len = 0u64;
            let mut hash = 0xcbf29ce484222325u64;
            while let Some(frame) = body.frame().await {
                let Ok(frame) = frame else { break };
                if let Some(data) = frame.data_ref() {
                    len += data.len() as u64;
                    for b in data.iter() {
                        hash ^= *b as u64;
                        hash = hash.wrapping_mul(0x100000001b3);
                    }
                }
            }
            let json = serde_json::json!({
                "upstream": name, "method": method, "path": path, "target": target, "headers": headers, "version": version, "peer": peer,
                "body_len": len, "body_fnv": format!("{hash:016x}"),
            });
            Response::builder()
                .header("content-type", "application/json")
                .body(full(json.to_string()))
                .expect("response")
        })
    }
}

/// A body of `total` bytes (a multiple of 64 KiB) as a stream of 64 KiB
/// frames, made as it is read.
pub fn chunks(
    total: u64,
) -> impl futures_util::Stream<Item = Result<hyper::body::Frame<Bytes>, std::io::Error>> + Send + 'static
{
    let chunk = Bytes::from(vec![0x5au8; 64 * 1024]);
    let n = total / chunk.len() as u64;
    futures_util::stream::iter((0..n).map(move |_| Ok(hyper::body::Frame::data(chunk.clone()))))
}

/// FNV-1a of a byte slice, matching [`echo`]'s `body_fnv`.
pub fn fnv(data: &[u8]) -> String {
    let mut hash = 0xcbf29ce484222325u64;
    for b in data {
        hash ^= *b as u64;
        hash = hash.wrapping_mul(0x100000001b3);
    }
    format!("{hash:016x}")
}

/// A WebSocket echo server (text and binary frames echoed back).
pub async fn websocket_echo() -> Upstream {
    use futures_util::{SinkExt, StreamExt};
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind ws");
    let addr = listener.local_addr().expect("addr");
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let Ok(mut ws) = tokio_tungstenite::accept_async(stream).await else {
                    return;
                };
                while let Some(Ok(msg)) = ws.next().await {
                    if msg.is_text() || msg.is_binary() {
                        if ws.send(msg).await.is_err() {
                            break;
                        }
                    } else if msg.is_close() {
                        break;
                    }
                }
            });
        }
    });
    Upstream { addr, task }
}

/// An upstream that takes one request and never answers it, for tests of
/// a client that leaves while its upstream works.
pub struct NeverAnswering {
    /// Its address.
    pub addr: SocketAddr,
    got: tokio::sync::oneshot::Receiver<()>,
    closed: tokio::sync::oneshot::Receiver<()>,
}

impl NeverAnswering {
    /// Waits for the request head to arrive.
    pub async fn request_arrived(&mut self) {
        (&mut self.got)
            .await
            .expect("the request reached the upstream");
    }

    /// Asserts that the proxy closes the connection within 5 s: it gave
    /// up on the exchange rather than holding it to the route timeout.
    pub async fn closed_soon(self) {
        tokio::time::timeout(std::time::Duration::from_secs(5), self.closed)
            .await
            .expect("the upstream connection was still open 5 s after the client left")
            .expect("upstream task");
    }
}

/// Starts a [`NeverAnswering`] upstream.
pub async fn never_answering() -> NeverAnswering {
    use tokio::io::AsyncReadExt;
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (got, got_rx) = tokio::sync::oneshot::channel();
    let (closed, closed_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        let mut chunk = [0u8; 4096];
        let mut head = Vec::new();
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match sock.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => head.extend_from_slice(&chunk[..n]),
            }
        }
        let _ = got.send(());
        while matches!(sock.read(&mut chunk).await, Ok(n) if n > 0) {}
        let _ = closed.send(());
    });
    NeverAnswering {
        addr,
        got: got_rx,
        closed: closed_rx,
    }
}

/// An address that takes connections and says nothing on them (a
/// process that hangs; a TLS handshake there never ends), counting them.
pub struct Silent {
    /// Its address.
    pub addr: SocketAddr,
    taken: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Silent {
    /// Connections taken so far.
    pub fn connections(&self) -> usize {
        self.taken.load(Ordering::SeqCst)
    }
}

impl Drop for Silent {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts a [`Silent`] address.
pub async fn silent() -> Silent {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let taken = Arc::new(AtomicUsize::new(0));
    let count = taken.clone();
    let task = tokio::spawn(async move {
        // Kept open, unread, until the test ends.
        let mut open = Vec::new();
        while let Ok((sock, _)) = listener.accept().await {
            count.fetch_add(1, Ordering::SeqCst);
            open.push(sock);
        }
    });
    Silent { addr, taken, task }
}

/// An upstream that holds each request for `/slow` until released (one
/// per `notify_one`, all waiting with `notify_waiters`), telling the test
/// when one arrives; other paths are answered at once. Answers say
/// `done <path>`.
pub async fn holding() -> (
    Upstream,
    tokio::sync::mpsc::UnboundedReceiver<()>,
    Arc<tokio::sync::Notify>,
) {
    let (arrived_tx, arrived) = tokio::sync::mpsc::unbounded_channel();
    let release = Arc::new(tokio::sync::Notify::new());
    let held = release.clone();
    let up = serve(move |req: Request<Incoming>| {
        let (arrived_tx, held) = (arrived_tx.clone(), held.clone());
        async move {
            if req.uri().path() == "/slow" {
                let _ = arrived_tx.send(());
                held.notified().await;
            }
            Response::new(full(format!("done {}", req.uri().path())))
        }
    })
    .await;
    (up, arrived, release)
}
