//! A real HTTP client for tests (hyper's pooled client).

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

/// Request body type.
pub type ReqBody = BoxBody<Bytes, std::io::Error>;

/// A new HTTP/1.1 client.
pub fn http1() -> Client<HttpConnector, ReqBody> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// A new cleartext HTTP/2 (prior knowledge) client.
pub fn h2c() -> Client<HttpConnector, ReqBody> {
    Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http()
}

/// Wraps bytes as a request body.
pub fn body(data: impl Into<Bytes>) -> ReqBody {
    Full::new(data.into())
        .map_err(|never| match never {})
        .boxed()
}

/// A collected response.
#[derive(Debug)]
pub struct Answer {
    /// Status.
    pub status: StatusCode,
    /// Headers.
    pub headers: http::HeaderMap,
    /// Body bytes.
    pub body: Bytes,
}

impl Answer {
    /// The body as JSON.
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// A header as text.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }
}

/// Collects a response, failing the test after 20 s.
pub async fn collect(resp: Response<Incoming>) -> Answer {
    let (parts, body) = resp.into_parts();
    let body = tokio::time::timeout(Duration::from_secs(20), body.collect())
        .await
        .expect("response body within 20s")
        .expect("response body")
        .to_bytes();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

/// Sends a request and collects the answer (20 s limit).
pub async fn send(client: &Client<HttpConnector, ReqBody>, req: Request<ReqBody>) -> Answer {
    let resp = tokio::time::timeout(Duration::from_secs(20), client.request(req))
        .await
        .expect("response within 20s")
        .expect("request");
    collect(resp).await
}

/// GET `url` with a fresh client.
pub async fn get(url: &str) -> Answer {
    let req = Request::get(url).body(body(Bytes::new())).expect("request");
    send(&http1(), req).await
}

/// `method` on `url` without a body, with a fresh client.
pub async fn call(method: &str, url: &str) -> Answer {
    let req = Request::builder()
        .method(method)
        .uri(url)
        .body(body(Bytes::new()))
        .expect("request");
    send(&http1(), req).await
}

/// [`call`] taking its method and URL, for a task of its own.
pub async fn call_owned(method: &'static str, url: String) -> Answer {
    call(method, &url).await
}

/// [`get`] taking its URL, for a task of its own.
pub async fn get_owned(url: String) -> Answer {
    get(&url).await
}

/// Opens a WebSocket to an echo server through `request` (10 s at most for
/// the handshake, which must answer 101) and checks the exchange.
pub async fn websocket_echo<R>(request: R)
where
    R: tokio_tungstenite::tungstenite::client::IntoClientRequest + Unpin,
{
    let (conn, resp) = tokio::time::timeout(
        Duration::from_secs(10),
        tokio_tungstenite::connect_async(request),
    )
    .await
    .expect("handshake in time")
    .expect("handshake");
    assert_eq!(resp.status(), 101);
    websocket_echo_exchange(conn).await;
}

/// Checks a WebSocket connection to an echo server: 20 text messages and a
/// 1 MiB binary one come back unchanged; then closes it.
pub async fn websocket_echo_exchange<S>(mut conn: tokio_tungstenite::WebSocketStream<S>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use futures_util::{SinkExt, StreamExt};
    use tokio_tungstenite::tungstenite::Message;
    for i in 0..20 {
        let msg = format!("hello {i}");
        conn.send(Message::text(msg.clone())).await.unwrap();
        let back = tokio::time::timeout(Duration::from_secs(10), conn.next())
            .await
            .expect("echo")
            .expect("frame")
            .unwrap();
        assert_eq!(back.into_text().unwrap().as_str(), msg);
    }
    let big = vec![7u8; 1 << 20];
    conn.send(Message::binary(big.clone())).await.unwrap();
    let back = tokio::time::timeout(Duration::from_secs(10), conn.next())
        .await
        .expect("echo")
        .expect("frame")
        .unwrap();
    assert_eq!(back.into_data(), big);
    conn.close(None).await.unwrap();
}

/// Sends `GET path` with `Host: host` on an open HTTP/1.1 connection and
/// reads until `body` arrives; the answer must be a 200.
pub async fn get_on(conn: &mut tokio::net::TcpStream, host: &str, path: &str, body: &str) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    conn.write_all(format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    let mut answer = Vec::new();
    while !answer.windows(body.len()).any(|w| w == body.as_bytes()) {
        let n = conn.read(&mut buf).await.unwrap();
        assert!(n > 0, "connection closed before the answer");
        answer.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&answer);
    assert!(text.contains("HTTP/1.1 200"), "{text}");
}

/// The status code and the body of a raw HTTP/1.1 answer.
pub fn status_and_body(answer: &str) -> (u16, &str) {
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line: {answer:?}"));
    (status, answer.split_once("\r\n\r\n").map_or("", |(_, b)| b))
}

/// Writes `raw` bytes on a new connection to `addr` and reads the answer
/// until the server closes the connection (10 s at most).
pub async fn raw(addr: std::net::SocketAddr, raw: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(raw).await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut buf))
        .await
        .expect("the server did not close the connection")
        .unwrap();
    String::from_utf8_lossy(&buf).into_owned()
}

/// POSTs to `path` on a new connection to `addr` a chunked body whose
/// first chunk (`hello`) is whole, waits for `arrived` (the upstream has
/// the head), then writes `bad` (broken framing) and reads the answer up
/// to the server's close (10 s limit each).
pub async fn broken_chunked_post(
    addr: std::net::SocketAddr,
    (host, path): (&str, &str),
    bad: &[u8],
    arrived: impl std::future::Future<Output = ()>,
) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: {host}\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n"
    );
    conn.write_all(head.as_bytes()).await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), arrived)
        .await
        .expect("the head reached the upstream");
    conn.write_all(bad).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut answer))
        .await
        .expect("the proxy answers and closes")
        .expect("read");
    String::from_utf8_lossy(&answer).into_owned()
}

/// Whether `answer` (a raw HTTP/1.1 answer) is the proxy's 400 for a
/// request body it could not read.
pub fn is_unreadable_body_400(answer: &str) -> bool {
    answer.starts_with("HTTP/1.1 400 ")
        && answer.contains(r#""error":"request body could not be read""#)
}

/// Sends `raw` and reads what comes back until the server closes (10 s
/// limit), a reset included: for connections the server refuses with
/// their request unread, where the kernel resets rather than closes.
pub async fn raw_until_closed(addr: std::net::SocketAddr, raw: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(raw).await.unwrap();
    let mut buf = Vec::new();
    let closed = conn.read_to_end(&mut buf);
    let _reset_or_end = tokio::time::timeout(Duration::from_secs(10), closed)
        .await
        .expect("the server did not close the connection");
    String::from_utf8_lossy(&buf).into_owned()
}

/// POSTs `size` bytes to `path` on a new connection to `addr` as a client
/// without `Expect: 100-continue` does: the head and the whole body
/// written at once, the answer read only then, up to the server's close.
/// Panics when a write fails (the server reset the connection) or the
/// server neither takes the body nor closes within 20 s.
pub async fn post_all_then_read(
    addr: std::net::SocketAddr,
    host: &str,
    path: &str,
    size: usize,
) -> String {
    let head = format!("POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-length: {size}\r\n\r\n");
    let mut raw = head.into_bytes();
    raw.resize(raw.len() + size, b'a');
    raw_written_whole(addr, &raw).await
}

/// Writes all of `raw` on a new connection to `addr`, then reads the
/// answer up to the server's close. Panics when a write fails (the server
/// reset the connection) or the server neither takes it all nor closes
/// within 20 s.
pub async fn raw_written_whole(addr: std::net::SocketAddr, raw: &[u8]) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let sent = tokio::time::timeout(Duration::from_secs(20), async {
        conn.write_all(raw).await?;
        conn.shutdown().await
    })
    .await
    .expect("the bytes were not all taken in 20 s");
    sent.expect("writing on after the answer");
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), conn.read_to_end(&mut answer))
        .await
        .expect("the server did not close in 20 s");
    read.expect("reading the answer and the close");
    String::from_utf8_lossy(&answer).into_owned()
}

/// A POST whose streamed body (chunked) the test feeds through the sender.
pub fn streamed_post(
    url: String,
) -> (
    tokio::sync::mpsc::Sender<Bytes>,
    tokio::task::JoinHandle<Answer>,
) {
    streamed_post_with(url, &[])
}

/// [`streamed_post`] with these request headers.
pub fn streamed_post_with(
    url: String,
    headers: &[(&str, &str)],
) -> (
    tokio::sync::mpsc::Sender<Bytes>,
    tokio::task::JoinHandle<Answer>,
) {
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(1);
    let frames = futures_util::stream::poll_fn(move |cx| {
        rx.poll_recv(cx)
            .map(|c| c.map(|c| Ok::<_, std::io::Error>(hyper::body::Frame::data(c))))
    });
    let mut req = Request::post(url);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req
        .body(http_body_util::BodyExt::boxed(
            http_body_util::StreamBody::new(frames),
        ))
        .unwrap();
    let sent = tokio::spawn(async move { send(&http1(), req).await });
    (tx, sent)
}

/// One HTTP/1.1 connection, every request sent on it. The pooled client
/// may open a second connection while the last answer's is still on its
/// way back to the pool, and the proxy may give that one to another
/// worker (with pools of its own): tests that count the proxy's upstream
/// connections need one client connection for sure.
pub struct Connection {
    send: hyper::client::conn::http1::SendRequest<ReqBody>,
}

impl Connection {
    /// Connects to `addr`; the connection lives as long as this value.
    pub async fn open(addr: std::net::SocketAddr) -> Self {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .expect("connect to the proxy");
        let io = hyper_util::rt::TokioIo::new(tcp);
        let (send, conn) = hyper::client::conn::http1::handshake(io)
            .await
            .expect("HTTP/1.1 handshake");
        tokio::spawn(conn);
        Self { send }
    }

    /// Sends `req` on this connection and collects the answer (20 s limit);
    /// fails the test if the connection has closed. An absolute URI goes
    /// as the pooled client sends it: the authority as `Host`, the path
    /// and query as the request target.
    pub async fn send(&mut self, mut req: Request<ReqBody>) -> Answer {
        if let Some(authority) = req.uri().authority().cloned() {
            let host = hyper::header::HeaderValue::from_str(authority.as_str()).expect("host");
            req.headers_mut().entry(hyper::header::HOST).or_insert(host);
            let target = req.uri().path_and_query().map_or("/", |p| p.as_str());
            *req.uri_mut() = target.parse().expect("request target");
        }
        let exchange = async {
            self.send.ready().await.expect("connection still open");
            self.send.send_request(req).await.expect("request")
        };
        let resp = tokio::time::timeout(Duration::from_secs(20), exchange)
            .await
            .expect("response within 20s");
        collect(resp).await
    }
}
