//! The WebSocket transport (RFC 6455, over TLS for `wss://`): how a client
//! dials and presents itself, and how the server accepts and checks it.
//! What comes out on both sides is a plain byte stream ([`BoxIo`]) for
//! HTTP/2. The QUIC transport ([`super::quic`]) has a stream per request
//! instead.

use http::StatusCode;
use tokio::net::TcpStream;

use super::ws_io::WsIo;
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
    let request = request(&url, hello)?;
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

fn request(
    url: &str,
    hello: &Hello,
) -> Result<tokio_tungstenite::tungstenite::handshake::client::Request, String> {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let mut request = url
        .into_client_request()
        .map_err(|e| format!("bad server URL {url}: {e}"))?;
    let value = |s: &str| {
        http::HeaderValue::from_str(s)
            .map_err(|_| "token or runtime id is not a valid header value".to_owned())
    };
    let headers = request.headers_mut();
    headers.insert(
        http::header::AUTHORIZATION,
        value(&format!("Bearer {}", hello.token))?,
    );
    headers.insert(super::RUNTIME_HEADER, value(&hello.runtime)?);
    headers.insert(super::INSTANCE_HEADER, value(&hello.instance)?);
    headers.insert(super::SLOT_HEADER, value(&hello.slot.to_string())?);
    Ok(request)
}

async fn handshake<S>(
    request: tokio_tungstenite::tungstenite::handshake::client::Request,
    stream: S,
    url: &str,
) -> Result<BoxIo, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    let (ws, _) =
        tokio_tungstenite::client_async_with_config(request, stream, Some(super::ws_config()))
            .await
            .map_err(|e| match e {
                tokio_tungstenite::tungstenite::Error::Http(resp) => format!(
                    "the server refused the tunnel: {} {}",
                    resp.status(),
                    resp.body()
                        .as_deref()
                        .map(String::from_utf8_lossy)
                        .unwrap_or_default()
                ),
                e => format!("WebSocket handshake with {url}: {e}"),
            })?;
    Ok(Box::new(WsIo::new(ws)))
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
    Ok(websocket_handshake(handshake_head::Replay::new(read, stream), check).await?)
}

// tungstenite's callback returns its error response by value.
#[allow(clippy::result_large_err)]
async fn websocket_handshake<S, T>(
    stream: S,
    check: impl FnOnce(&Hello) -> Result<T, Refused> + Unpin,
) -> Result<(BoxIo, Hello, T), String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
{
    use tokio_tungstenite::tungstenite::handshake::server::{ErrorResponse, Request, Response};
    let refuse = |status: StatusCode, message: &str| -> ErrorResponse {
        let mut resp = http::Response::new(Some(format!("{{\"error\":\"{message}\"}}")));
        *resp.status_mut() = status;
        resp
    };
    let mut outcome: Option<Result<(Hello, T), String>> = None;
    let callback = |req: &Request, resp: Response| {
        if req.uri().path() != super::TUNNEL_PATH {
            outcome = Some(Err(format!("wrong path {}", req.uri().path())));
            return Err(refuse(StatusCode::NOT_FOUND, "not a tunnel endpoint"));
        }
        let header = |name: &str| {
            req.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned()
        };
        let hello = Hello::from_fields(header);
        match check(&hello) {
            Ok(accepted) => {
                outcome = Some(Ok((hello, accepted)));
                Ok(resp)
            }
            Err(refused) => {
                outcome = Some(Err(refused.reason));
                Err(refuse(refused.status, refused.message))
            }
        }
    };
    let result =
        tokio_tungstenite::accept_hdr_async_with_config(stream, callback, Some(super::ws_config()))
            .await;
    match (result, outcome) {
        (Ok(ws), Some(Ok((hello, accepted)))) => Ok((Box::new(WsIo::new(ws)), hello, accepted)),
        (_, Some(Err(reason))) => Err(reason),
        (Ok(_), None) => Err("handshake accepted without a check".into()),
        (Err(e), _) => Err(format!("not a tunnel handshake: {e}")),
    }
}
