//! The tunnel port's first look at a connection's request head, before
//! the WebSocket handshake: a load balancer's `GET /healthz` gets 200, and
//! any other plain HTTP request (a browser, someone with curl) `426
//! Upgrade Required` saying what the port is for, where the WebSocket
//! library would close the connection without a word. The bytes read are handed on to the
//! handshake, which parses the head again from them. The public listener, when it serves
//! HTTPS, uses the same reading to answer a plain HTTP request.

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The most a handshake head may take; a client's is a few hundred bytes.
const MAX_HEAD: usize = 16 * 1024;

/// What the first request head on the tunnel port is.
#[derive(Debug, PartialEq, Eq)]
pub enum Head {
    /// A WebSocket upgrade: go on with the handshake.
    Upgrade,
    /// `GET /healthz` (or `HEAD`): a load balancer checking the port.
    HealthCheck,
    /// Another HTTP request, answered and refused (`METHOD /path`).
    Plain(String),
}

/// Reads the request head off `stream`. Returns the bytes read (the head
/// and anything after it) and what the head is; an error for bytes that
/// are not an HTTP request head, or none within [`MAX_HEAD`].
pub async fn read<S: AsyncRead + Unpin>(stream: &mut S) -> Result<(Vec<u8>, Head), String> {
    let mut buf = Vec::with_capacity(1024);
    loop {
        if let Some(head) = classify(&buf)? {
            return Ok((buf, head));
        }
        let mut chunk = [0u8; 2048];
        let n = stream
            .read(&mut chunk)
            .await
            .map_err(|e| format!("reading the request head: {e}"))?;
        if n == 0 {
            return Err("the peer closed before a request head".into());
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// What the bytes read so far are: `None` while the head is incomplete
/// (and under [`MAX_HEAD`]).
pub fn classify(buf: &[u8]) -> Result<Option<Head>, String> {
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    match req.parse(buf) {
        Ok(httparse::Status::Complete(_)) => {
            let upgrade = req.headers.iter().any(|h| {
                h.name.eq_ignore_ascii_case("upgrade")
                    && h.value.trim_ascii().eq_ignore_ascii_case(b"websocket")
            });
            let (method, path) = (req.method.unwrap_or("?"), req.path.unwrap_or("?"));
            Ok(Some(if upgrade {
                Head::Upgrade
            } else if matches!(method, "GET" | "HEAD") && path == "/healthz" {
                Head::HealthCheck
            } else {
                Head::Plain(format!("{method} {path}"))
            }))
        }
        Ok(httparse::Status::Partial) if buf.len() < MAX_HEAD => Ok(None),
        Ok(httparse::Status::Partial) => Err(format!("no request head within {MAX_HEAD} bytes")),
        Err(e) => Err(format!("not HTTP: {e}")),
    }
}

/// Answers a health check on the tunnel port and closes: the server is
/// up and taking tunnels.
pub async fn answer_health_check<S: AsyncWrite + Unpin>(stream: &mut S) {
    let _ = stream
        .write_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncache-control: no-store\r\n\
              connection: close\r\ncontent-length: 3\r\n\r\nok\n",
        )
        .await;
    let _ = stream.shutdown().await;
}

/// Answers a plain HTTP request on the tunnel port and closes.
pub async fn refuse_plain<S: AsyncWrite + Unpin>(stream: &mut S) {
    let body = concat!(
        r#"{"error":"this port takes Portcullis tunnel connections (a WebSocket upgrade to "#,
        r#"/_portcullis/tunnel); public requests go to the public listener","status":426}"#
    );
    refuse(stream, "426 Upgrade Required\r\nupgrade: websocket", body).await;
}

/// Answers a plain HTTP request on an HTTPS port with 400 and the JSON
/// `body`, and closes, as nginx does, rather than leaving the client with
/// a closed connection and a TLS alert it cannot read.
pub async fn refuse_plain_on_https<S: AsyncWrite + Unpin>(stream: &mut S, body: &str) {
    refuse(stream, "400 Bad Request", body).await;
}

/// Writes a response with `status` (the status line's rest, and any
/// headers) and the JSON `body`, then closes.
pub async fn refuse<S: AsyncWrite + Unpin>(stream: &mut S, status: &str, body: &str) {
    let head = format!(
        "HTTP/1.1 {status}\r\nconnection: close\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    let _ = stream.write_all(head.as_bytes()).await;
    let _ = stream.write_all(body.as_bytes()).await;
    let _ = stream.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn head_of(bytes: &[u8]) -> Result<(Vec<u8>, Head), String> {
        // Two reads' worth, to cross a chunk boundary.
        let (mut client, mut server) = tokio::io::duplex(64);
        let bytes = bytes.to_vec();
        // The writer's end closes when it is done: a head cut short then
        // reads as the peer closing.
        let writer = tokio::spawn(async move {
            let _ = client.write_all(&bytes).await;
        });
        let got = read(&mut server).await;
        drop(server);
        writer.await.unwrap();
        got
    }

    #[tokio::test]
    async fn an_upgrade_goes_on_with_the_bytes_read() {
        let raw = b"GET /_portcullis/tunnel HTTP/1.1\r\nHost: t\r\nUpgrade: WebSocket\r\n\
            Connection: upgrade\r\n\r\nafter";
        let (read_bytes, head) = head_of(raw).await.unwrap();
        assert_eq!(head, Head::Upgrade);
        // The whole head (the handshake parses it again from these, and
        // takes what follows it as the first frames' bytes).
        assert!(raw.starts_with(&read_bytes));
        assert!(read_bytes.len() >= raw.len() - "after".len());
    }

    #[tokio::test]
    async fn a_plain_request_is_named_and_garbage_is_not_http() {
        let (_, head) = head_of(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(head, Head::HealthCheck);
        let (_, head) = head_of(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n").await.unwrap();
        assert_eq!(head, Head::Plain("GET /".into()));
        let err = head_of(b"\x16\x03\x01garbage\r\n\r\n").await.unwrap_err();
        assert!(err.starts_with("not HTTP"), "{err}");
        let err = head_of(b"GET / HTTP/1.1\r\nHost: t\r\n").await.unwrap_err();
        assert_eq!(err, "the peer closed before a request head");
    }
}
