//! The WebSocket transport (RFC 6455, over TLS for `wss://`): how a client
//! dials and presents itself, and how the server accepts and checks it.
//! What comes out on both sides is a plain byte stream ([`BoxIo`]) for
//! HTTP/2. The QUIC transport ([`super::quic`]) has a stream per request
//! instead.

use http::StatusCode;
use tokio::net::TcpStream;

use super::ws_io::{Role, WsIo};
use super::{BoxIo, Hello, Refused};
use portcullis_net::handshake_head;

/// Dials `server` (`ws://` or `wss://` with `tls`), presents `hello`, and
/// returns the tunnel's byte stream.
pub async fn dial(
    server: &http::Uri,
    tls: Option<&tokio_rustls::TlsConnector>,
    hello: &Hello,
) -> Result<BoxIo, String> {
    let host = server.host().unwrap_or_default();
    let port = server
        .port_u16()
        .unwrap_or(if tls.is_some() { 443 } else { 80 });
    let bare_host = host.trim_start_matches('[').trim_end_matches(']');
    let tcp = TcpStream::connect((bare_host, port))
        .await
        .map_err(|e| format!("connecting to {host}:{port}: {e}"))?;
    let _ = tcp.set_nodelay(true);
    let url = format!(
        "{}://{}{}",
        if tls.is_some() { "wss" } else { "ws" },
        server.authority().map_or(host, |a| a.as_str()),
        super::TUNNEL_PATH
    );
    let authority = server.authority().map_or(host, |a| a.as_str());
    let request = request(authority, hello)?;
    match tls {
        Some(connector) => {
            let name = rustls_pki_types::ServerName::try_from(bare_host.to_owned())
                .map_err(|e| format!("server name {host}: {e}"))?;
            let stream = connector.connect(name, tcp).await.map_err(|e| {
                portcullis_net::tls_errors::explain(format!("TLS with {host}: {e}"))
            })?;
            handshake(request, stream, &url).await
        }
        None => handshake(request, tcp, &url).await,
    }
}

/// The client's handshake request (RFC 6455 §4.1), presenting `hello`;
/// with the key whose answer the server must give back.
fn request(authority: &str, hello: &Hello) -> Result<(String, String), String> {
    let valid = |s: &str| {
        http::HeaderValue::from_str(s)
            .map(|_| ())
            .map_err(|_| "token or runtime id is not a valid header value".to_owned())
    };
    valid(authority)?;
    valid(&hello.token)?;
    valid(&hello.runtime)?;
    valid(&hello.instance)?;
    let key = tokio_tungstenite::tungstenite::handshake::client::generate_key();
    let request = format!(
        "GET {path} HTTP/1.1\r\nhost: {authority}\r\nconnection: Upgrade\r\n\
         upgrade: websocket\r\nsec-websocket-version: 13\r\nsec-websocket-key: {key}\r\n\
         authorization: Bearer {token}\r\n{runtime_h}: {runtime}\r\n\
         {instance_h}: {instance}\r\n{slot_h}: {slot}\r\n\r\n",
        path = super::TUNNEL_PATH,
        token = hello.token,
        runtime_h = super::RUNTIME_HEADER,
        runtime = hello.runtime,
        instance_h = super::INSTANCE_HEADER,
        instance = hello.instance,
        slot_h = super::SLOT_HEADER,
        slot = hello.slot,
    );
    Ok((request, key))
}

/// Sends the handshake request and reads the server's answer: 101 with
/// the key's answer makes the tunnel's byte stream; any other status is
/// the server's refusal, with its body.
async fn handshake<S>(
    (request, key): (String, String),
    mut stream: S,
    url: &str,
) -> Result<BoxIo, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let failed = |what: String| format!("WebSocket handshake with {url}: {what}");
    stream
        .write_all(request.as_bytes())
        .await
        .map_err(|e| failed(e.to_string()))?;
    stream.flush().await.map_err(|e| failed(e.to_string()))?;
    let mut read = Vec::with_capacity(1024);
    loop {
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut resp = httparse::Response::new(&mut headers);
        match resp.parse(&read) {
            Ok(httparse::Status::Complete(len)) => {
                let status = resp.code.unwrap_or(0);
                let header = |name: &str| {
                    resp.headers
                        .iter()
                        .find(|h| h.name.eq_ignore_ascii_case(name))
                        .map(|h| h.value.trim_ascii())
                };
                if status != 101 {
                    let body_len = header("content-length")
                        .and_then(|v| std::str::from_utf8(v).ok()?.parse().ok())
                        .unwrap_or(0usize)
                        .min(4096);
                    let status = http::StatusCode::from_u16(status)
                        .map_or_else(|_| status.to_string(), |s| s.to_string());
                    let body = read_body(&mut stream, read.split_off(len), body_len).await;
                    return Err(format!("{} {status} {body}", super::quic::REFUSED));
                }
                let accept =
                    tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes());
                let upgraded =
                    header("upgrade").is_some_and(|v| v.eq_ignore_ascii_case(b"websocket"));
                if !upgraded || header("sec-websocket-accept") != Some(accept.as_bytes()) {
                    return Err(failed("the server's 101 is not a WebSocket's".into()));
                }
                let carried = read.split_off(len);
                return Ok(Box::new(WsIo::new(stream, Role::Client, carried)));
            }
            Ok(httparse::Status::Partial) if read.len() < 16 * 1024 => {}
            Ok(httparse::Status::Partial) => {
                return Err(failed("response head over 16 KiB".into()));
            }
            Err(e) => return Err(failed(format!("not an HTTP response: {e}"))),
        }
        let mut chunk = [0u8; 1024];
        let n = stream
            .read(&mut chunk)
            .await
            .map_err(|e| failed(e.to_string()))?;
        if n == 0 {
            return Err(failed("the server closed the connection".into()));
        }
        read.extend_from_slice(&chunk[..n]);
    }
}

/// A refusal's body (`len` bytes, of which `read` came with the head), as
/// text: what the server said.
async fn read_body<S: tokio::io::AsyncRead + Unpin>(
    stream: &mut S,
    mut read: Vec<u8>,
    len: usize,
) -> String {
    use tokio::io::AsyncReadExt;
    while read.len() < len {
        let mut chunk = [0u8; 1024];
        match stream.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => read.extend_from_slice(&chunk[..n]),
        }
    }
    read.truncate(len);
    String::from_utf8_lossy(&read).into_owned()
}

/// Why a connection to the tunnel port did not become a tunnel.
#[derive(Debug)]
pub enum NotATunnel {
    /// A load balancer's health check (`GET /healthz`), answered 200.
    HealthCheck,
    /// Anything else, refused; the reason to log.
    Refused(String),
}

impl From<String> for NotATunnel {
    fn from(reason: String) -> NotATunnel {
        NotATunnel::Refused(reason)
    }
}

/// Accepts a tunnel handshake on `stream` (TLS first with `tls`): `check`
/// decides on the client's [`Hello`]; a refusal answers the client with
/// its status and is returned as the error to log.
pub async fn accept<T>(
    stream: TcpStream,
    tls: Option<tokio_rustls::TlsAcceptor>,
    check: impl FnOnce(&Hello) -> Result<T, Refused> + Unpin,
) -> Result<(BoxIo, Hello, T), NotATunnel> {
    match tls {
        Some(acceptor) => {
            let stream = acceptor
                .accept(stream)
                .await
                .map_err(|e| format!("TLS handshake: {e}"))?;
            upgrade(stream, check).await
        }
        None => upgrade(stream, check).await,
    }
}

/// Looks at the request head first: a health check is answered 200, any
/// other plain HTTP request 426 and refused; an upgrade goes on to the
/// WebSocket handshake, which reads the same bytes again.
async fn upgrade<S, T>(
    mut stream: S,
    check: impl FnOnce(&Hello) -> Result<T, Refused> + Unpin,
) -> Result<(BoxIo, Hello, T), NotATunnel>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (read, head) = handshake_head::read(&mut stream)
        .await
        .map_err(|e| format!("not a tunnel handshake: {e}"))?;
    match head {
        handshake_head::Head::Upgrade => {}
        handshake_head::Head::HealthCheck => {
            handshake_head::answer_health_check(&mut stream).await;
            return Err(NotATunnel::HealthCheck);
        }
        handshake_head::Head::Plain(request) => {
            handshake_head::refuse_plain(&mut stream).await;
            return Err(NotATunnel::Refused(format!(
                "not a tunnel handshake: a plain HTTP request ({request}), answered 426"
            )));
        }
    }
    Ok(websocket_handshake(stream, read, check).await?)
}

/// The server's side of the handshake (RFC 6455 §4.2) on the head in
/// `read`: the path and the client's [`Hello`] checked by `check`, then
/// 101 and the tunnel's byte stream (with the bytes read past the head);
/// or the refusal answered with its status and returned as the reason.
async fn websocket_handshake<S, T>(
    mut stream: S,
    read: Vec<u8>,
    check: impl FnOnce(&Hello) -> Result<T, Refused>,
) -> Result<(BoxIo, Hello, T), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    use tokio::io::AsyncWriteExt;
    let mut headers = [httparse::EMPTY_HEADER; 64];
    let mut req = httparse::Request::new(&mut headers);
    // `handshake_head::read` parsed the same head whole; this only fails
    // if the two parses ever disagree.
    let Ok(httparse::Status::Complete(len)) = req.parse(&read) else {
        return Err("not a tunnel handshake: its head did not parse again".into());
    };
    let field = |name: &str| {
        req.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .and_then(|h| std::str::from_utf8(h.value).ok())
            .map(str::trim)
    };
    let refuse = async |stream: &mut S, status: StatusCode, message: &str| {
        let body = format!("{{\"error\":\"{message}\"}}");
        let line = format!(
            "{} {}",
            status.as_u16(),
            status.canonical_reason().unwrap_or("")
        );
        handshake_head::refuse(stream, &line, &body).await;
    };
    let path = req.path.unwrap_or_default();
    if path != super::TUNNEL_PATH {
        refuse(&mut stream, StatusCode::NOT_FOUND, "not a tunnel endpoint").await;
        return Err(format!("wrong path {path}"));
    }
    let upgrade = field("connection").is_some_and(|v| {
        v.split(',')
            .any(|token| token.trim().eq_ignore_ascii_case("upgrade"))
    });
    let key = field("sec-websocket-key").filter(|_| req.method == Some("GET") && upgrade);
    let Some(key) = key else {
        refuse(
            &mut stream,
            StatusCode::BAD_REQUEST,
            "not a WebSocket handshake",
        )
        .await;
        return Err("not a tunnel handshake: no GET with Connection: upgrade and a key".into());
    };
    if field("sec-websocket-version") != Some("13") {
        let line = "426 Upgrade Required\r\nsec-websocket-version: 13";
        handshake_head::refuse(
            &mut stream,
            line,
            r#"{"error":"WebSocket version 13 only"}"#,
        )
        .await;
        return Err("not a tunnel handshake: a WebSocket version other than 13".into());
    }
    let hello = Hello::from_fields(|name| field(name).unwrap_or_default().to_owned());
    let accepted = match check(&hello) {
        Ok(accepted) => accepted,
        Err(refused) => {
            refuse(&mut stream, refused.status, refused.message).await;
            return Err(refused.reason);
        }
    };
    let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes());
    let answer = format!(
        "HTTP/1.1 101 Switching Protocols\r\nconnection: Upgrade\r\nupgrade: websocket\r\n\
         sec-websocket-accept: {accept}\r\n\r\n"
    );
    let sent = async {
        stream.write_all(answer.as_bytes()).await?;
        stream.flush().await
    };
    sent.await
        .map_err(|e| format!("answering the handshake: {e}"))?;
    let carried = read[len..].to_vec();
    Ok((
        Box::new(WsIo::new(stream, Role::Server, carried)),
        hello,
        accepted,
    ))
}
