//! The QUIC transport (`--transport quic`): the client dials the server's
//! tunnel port over UDP, and each public request is a QUIC stream of its
//! own, opened by the server, that carries one HTTP/1.1 exchange.
//!
//! Why streams and not one byte stream for HTTP/2, as the WebSocket
//! transport does: QUIC's streams are flow-controlled and retransmitted
//! each on its own, so a lost packet stalls only the request it belongs
//! to, where under HTTP/2 over TCP it stalls every request of the tunnel.
//! HTTP/1.1 on each stream keeps hyper on both ends, and a WebSocket
//! upgrade is the plain HTTP/1.1 one, the stream carrying its bytes after
//! the 101.
//!
//! The client opens one stream first, the control stream: it presents its
//! [`Hello`] there as an HTTP/1.1 request head and reads the answer. It
//! keeps the stream open; finishing it later tells the server the client
//! is draining, so the server sends no new requests through this tunnel
//! while those in flight finish.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response, StatusCode};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

use super::{Hello, Refused};
use portcullis_forward::Body;

/// The ALPN protocol both ends speak, so a QUIC client of something else
/// (an HTTP/3 browser) is refused in the TLS handshake.
pub const ALPN: &[u8] = b"portcullis-tunnel/1";

/// How a dial error the server answered (bad token, rate limit) starts.
pub const REFUSED: &str = "the server refused the tunnel";

/// Most bytes a control-stream head may take (a few hundred are sent).
const MAX_HELLO: usize = 16 << 10;

/// Most header fields in a request or response head crossing a stream:
/// HTTP/2 and HTTP/3 public clients are not held to hyper's HTTP/1.1
/// default of 100, and the routing core applies its own limits.
const MAX_FIELDS: usize = 256;

/// Requests a tunnel carries at once; more wait for a stream.
const MAX_STREAMS: u32 = super::MAX_TUNNELED_STREAMS;

/// How often each end sends a QUIC PING when nothing else is sent.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(3);

/// How long a connection may hear nothing before it counts as dead.
/// Shorter than the WebSocket transport's ping timeout: a peer whose
/// process died leaves TCP a reset to end the connection with at once,
/// but QUIC only silence, and requests in flight wait that long for
/// their 502. Three pings (each retransmitted when lost) fit in it.
const IDLE_TIMEOUT: Duration = Duration::from_secs(10);

/// How a QUIC sender of this process paces itself (`--quic-congestion`):
/// each end picks its own, for what it sends (the tunnel client for
/// downloads, the server for uploads and, with `--http3`, its public
/// answers).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Congestion {
    /// CUBIC (RFC 9438), quinn's default and TCP's on most Linux hosts:
    /// every loss is taken for congestion and cuts the window by 30%, so
    /// random loss (a radio link, a lossy peering) caps a stream at
    /// about what TCP CUBIC gets there.
    #[default]
    Cubic,
    /// BBR: sends at the bandwidth and round trip it measures and does
    /// not back off for a loss alone, so a stream keeps the link's rate
    /// through random loss (`bench/lossy.sh`). quinn marks its BBR
    /// experimental, and like TCP's BBRv1 it fills queues more and
    /// yields less to CUBIC flows sharing a congested bottleneck.
    Bbr,
}

impl Congestion {
    /// `cubic` or `bbr`, as the flag takes it.
    pub fn parse(name: &str) -> Result<Congestion, String> {
        match name {
            "cubic" => Ok(Congestion::Cubic),
            "bbr" => Ok(Congestion::Bbr),
            other => Err(format!(
                "`{other}` is not a QUIC congestion control: give cubic or bbr"
            )),
        }
    }

    /// The name the flag and `/status` use.
    pub fn name(self) -> &'static str {
        match self {
            Congestion::Cubic => "cubic",
            Congestion::Bbr => "bbr",
        }
    }

    /// Sets it on `transport`.
    pub fn apply(self, transport: &mut quinn::TransportConfig) {
        let factory: Arc<dyn quinn::congestion::ControllerFactory + Send + Sync> = match self {
            Congestion::Cubic => Arc::new(quinn::congestion::CubicConfig::default()),
            Congestion::Bbr => Arc::new(quinn::congestion::BbrConfig::default()),
        };
        transport.congestion_controller_factory(factory);
    }
}

/// QUIC settings for both ends: HTTP/2's windows, pings that keep an
/// idle connection (and the NAT mappings on its path) alive, and the
/// congestion control asked for. `peer_streams` is how many request
/// streams the peer may have open at once.
fn transport(peer_streams: u32, congestion: Congestion) -> quinn::TransportConfig {
    let mut t = quinn::TransportConfig::default();
    congestion.apply(&mut t);
    t.max_idle_timeout(IDLE_TIMEOUT.try_into().ok())
        .keep_alive_interval(Some(KEEPALIVE_INTERVAL))
        .stream_receive_window(super::STREAM_WINDOW.into())
        .receive_window(super::CONNECTION_WINDOW.into())
        .send_window(super::CONNECTION_WINDOW.into())
        .max_concurrent_bidi_streams(peer_streams.into())
        .max_concurrent_uni_streams(0u32.into());
    t
}

/// A QUIC server configuration with the certificate pair in `cert` and
/// `key` (re-read when they change), offering `alpn`; TLS 1.3 only, as
/// QUIC has no other.
pub fn server_config(
    cert: &std::path::Path,
    key: &std::path::Path,
    alpn: &[u8],
    transport: quinn::TransportConfig,
) -> anyhow::Result<quinn::ServerConfig> {
    let files = portcullis_net::cert_files::CertFiles::load(cert.to_path_buf(), key.to_path_buf())
        .map_err(anyhow::Error::msg)?;
    let mut tls = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_protocol_versions(&[&rustls::version::TLS13])?
    .with_no_client_auth()
    .with_cert_resolver(Arc::new(files));
    tls.alpn_protocols = vec![alpn.to_vec()];
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls)?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    config.transport_config(Arc::new(transport));
    Ok(config)
}

/// The tunnel server's QUIC settings: clients open only their control
/// stream.
pub fn tunnel_server_config(
    cert: &std::path::Path,
    key: &std::path::Path,
    congestion: Congestion,
) -> anyhow::Result<quinn::ServerConfig> {
    server_config(cert, key, ALPN, transport(1, congestion))
}

/// The tunnel client's QUIC settings, from the TLS settings it trusts the
/// server with.
pub fn client_config(
    mut tls: rustls::ClientConfig,
    congestion: Congestion,
) -> Result<quinn::ClientConfig, String> {
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls)
        .map_err(|e| format!("QUIC needs TLS 1.3: {e}"))?;
    let mut config = quinn::ClientConfig::new(Arc::new(crypto));
    config.transport_config(Arc::new(transport(MAX_STREAMS, congestion)));
    Ok(config)
}

/// A stream's two halves as one byte stream for hyper.
type StreamIo = TokioIo<tokio::io::Join<quinn::RecvStream, quinn::SendStream>>;

fn stream_io(send: quinn::SendStream, recv: quinn::RecvStream) -> StreamIo {
    TokioIo::new(tokio::io::join(recv, send))
}

/// Reshapes a request made for the HTTP/2 tunnel into HTTP/1.1: `Host`
/// and an origin-form target for the absolute one, an upgrade for an
/// extended CONNECT, and `TE: trailers` so the client's HTTP/1.1 server
/// sends a response's trailers (gRPC's status) as HTTP/2 would.
fn to_http1(req: &mut Request<Body>) {
    use http::HeaderValue;
    use http::header::{CONNECTION, HOST, TE, UPGRADE};
    if let Some(authority) = req.uri().authority()
        && !req.headers().contains_key(HOST)
        && let Ok(host) = HeaderValue::from_str(authority.as_str())
    {
        req.headers_mut().insert(HOST, host);
    }
    let target = req
        .uri()
        .path_and_query()
        .map_or_else(|| http::Uri::from_static("/"), |p| p.clone().into());
    *req.uri_mut() = target;
    *req.version_mut() = http::Version::HTTP_11;
    if let Some(protocol) = req.extensions_mut().remove::<hyper::ext::Protocol>() {
        *req.method_mut() = http::Method::GET;
        let protocol = HeaderValue::from_str(protocol.as_str())
            .unwrap_or(HeaderValue::from_static("websocket"));
        req.headers_mut().insert(UPGRADE, protocol);
        req.headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("upgrade"));
    }
    req.headers_mut()
        .insert(TE, HeaderValue::from_static("trailers"));
}

/// A tunnel as the server holds it.
#[derive(Clone)]
pub struct ServerTunnel {
    conn: quinn::Connection,
}

impl ServerTunnel {
    /// True once the connection has ended.
    pub fn is_closed(&self) -> bool {
        self.conn.close_reason().is_some()
    }

    /// Sends `req`, shaped for HTTP/2 as the WebSocket transport's are
    /// (absolute target, an extended CONNECT for an upgrade), as HTTP/1.1
    /// on a new stream; waits for a stream while the client's limit is
    /// reached. An upgrade's 101 comes back as the 200 an extended CONNECT
    /// gets, with the stream to splice to in its extensions.
    pub async fn send(&self, mut req: Request<Body>) -> Result<Response<Incoming>, String> {
        to_http1(&mut req);
        let (send, recv) = self
            .conn
            .open_bi()
            .await
            .map_err(|e| format!("opening a stream: {e}"))?;
        let (mut sender, conn) = hyper::client::conn::http1::Builder::new()
            .max_buf_size(super::MAX_TUNNELED_HEAD as usize)
            .max_headers(MAX_FIELDS)
            .handshake::<_, Body>(stream_io(send, recv))
            .await
            .map_err(|e| portcullis_forward::error_chain(&e))?;
        tokio::spawn(async move {
            // Errors reach the response or its body; this only drives it.
            let _ = conn.with_upgrades().await;
        });
        let mut resp = sender
            .send_request(req)
            .await
            .map_err(|e| portcullis_forward::error_chain(&e))?;
        if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
            *resp.status_mut() = StatusCode::OK;
        }
        Ok(resp)
    }

    /// Ends the connection (a replaced or stale tunnel, shutdown).
    pub fn close(&self, why: &'static str) {
        self.conn.close(0u32.into(), why.as_bytes());
    }

    /// Completes when the connection ends: `Ok` when the client closed it
    /// cleanly (code 0: it drained or stopped), else why it broke.
    pub async fn closed(&self) -> Result<(), String> {
        match self.conn.closed().await {
            quinn::ConnectionError::ApplicationClosed(close) if close.error_code == 0u32.into() => {
                Ok(())
            }
            e => Err(e.to_string()),
        }
    }

    /// The client's address now: QUIC follows a client whose address
    /// changed (a NAT that rebound its port) without a new dial.
    pub fn remote(&self) -> SocketAddr {
        self.conn.remote_address()
    }
}

/// The server's end of a control stream, once the client is accepted.
pub struct Control {
    recv: quinn::RecvStream,
}

impl Control {
    /// Completes when the client finishes its control stream (it is
    /// draining) or the stream breaks.
    pub async fn draining(mut self) {
        let mut scratch = [0u8; 64];
        // The client sends nothing more; whatever it does is ignored.
        while let Ok(Some(_)) = self.recv.read(&mut scratch).await {}
    }
}

/// Accepts a tunnel on `incoming`: the QUIC handshake, then the client's
/// [`Hello`] on its control stream, which `check` decides on; a refusal
/// is answered with its status before the connection closes.
pub async fn accept<T>(
    incoming: quinn::Incoming,
    check: impl FnOnce(&Hello) -> Result<T, Refused>,
) -> Result<(ServerTunnel, Control, Hello, T), String> {
    let conn = incoming.await.map_err(|e| format!("QUIC handshake: {e}"))?;
    let (mut send, mut recv) = conn
        .accept_bi()
        .await
        .map_err(|e| format!("waiting for the control stream: {e}"))?;
    let head = read_head(&mut recv).await?;
    let hello = parse_hello(&head)?;
    match check(&hello) {
        Ok(accepted) => {
            send.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                .await
                .map_err(|e| format!("answering the hello: {e}"))?;
            // The control stream's server half has nothing more to say;
            // the client's half stays open until it drains.
            let _ = send.finish();
            Ok((ServerTunnel { conn }, Control { recv }, hello, accepted))
        }
        Err(refused) => {
            let body = format!("{{\"error\":\"{}\"}}", refused.message);
            let head = format!(
                "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                refused.status.as_u16(),
                refused.status.canonical_reason().unwrap_or(""),
                body.len()
            );
            if send.write_all(head.as_bytes()).await.is_ok() && send.finish().is_ok() {
                // Until the client has read it, or gives up: closing at once
                // could discard the answer in flight.
                let _ = tokio::time::timeout(super::HANDSHAKE_TIMEOUT, send.stopped()).await;
            }
            conn.close(1u32.into(), refused.message.as_bytes());
            Err(refused.reason)
        }
    }
}

/// Reads a head (up to the blank line) off a control stream.
async fn read_head(recv: &mut quinn::RecvStream) -> Result<Vec<u8>, String> {
    let mut head = Vec::with_capacity(512);
    let mut chunk = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() > MAX_HELLO {
            return Err(format!(
                "no head within {MAX_HELLO} bytes on the control stream"
            ));
        }
        // In chunks: a refusal's body may come with its head, and the
        // caller takes it from what follows the blank line.
        let n = recv
            .read(&mut chunk)
            .await
            .map_err(|e| format!("reading the control stream: {e}"))?
            .ok_or("the control stream ended before a complete head")?;
        head.extend_from_slice(&chunk[..n]);
    }
    Ok(head)
}

/// The [`Hello`] in a control-stream request head (any bytes a peer on
/// the UDP port sends: fuzzed).
pub fn parse_hello(head: &[u8]) -> Result<Hello, String> {
    let mut fields = [httparse::EMPTY_HEADER; 32];
    let mut req = httparse::Request::new(&mut fields);
    match req.parse(head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err("an incomplete hello".into()),
        Err(e) => return Err(format!("not a hello: {e}")),
    }
    if req.path != Some(super::TUNNEL_PATH) {
        return Err(format!("not a hello: {:?}", req.path.unwrap_or("")));
    }
    let field = |name: &str| {
        req.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .and_then(|h| std::str::from_utf8(h.value).ok())
            .unwrap_or("")
            .trim()
            .to_owned()
    };
    Ok(Hello::from_fields(field))
}

/// A tunnel as the client holds it.
pub struct ClientTunnel {
    /// Kept: dropping the endpoint would stop its socket.
    endpoint: quinn::Endpoint,
    conn: quinn::Connection,
    control: quinn::SendStream,
}

/// Dials `server`'s host and port over UDP and presents `hello`.
pub async fn dial(
    server: &http::Uri,
    config: quinn::ClientConfig,
    hello: &Hello,
) -> Result<ClientTunnel, String> {
    let host = server.host().unwrap_or_default();
    let bare_host = host.trim_start_matches('[').trim_end_matches(']');
    let port = server.port_u16().unwrap_or(443);
    // UDP gives no refusal to move on to the next address with, as a
    // TCP connect does: IPv4 first, which is reachable more often (and
    // `localhost` is 127.0.0.1 where a server binds it).
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host((bare_host, port))
        .await
        .map_err(|e| format!("resolving {host}: {e}"))?
        .collect();
    let addr = addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| format!("{host} has no address"))?;
    let local: SocketAddr = if addr.is_ipv6() {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    } else {
        (std::net::Ipv4Addr::UNSPECIFIED, 0).into()
    };
    // An endpoint (a UDP socket) per tunnel, created on the worker that
    // drives it, so its packets are handled on that worker's thread.
    let endpoint =
        quinn::Endpoint::client(local).map_err(|e| format!("opening a UDP socket: {e}"))?;
    let conn = endpoint
        .connect_with(config, addr, bare_host)
        .map_err(|e| format!("QUIC to {host}:{port}: {e}"))?
        .await
        .map_err(|e| {
            portcullis_net::tls_errors::explain(format!("QUIC handshake with {host}:{port}: {e}"))
        })?;
    let (mut control, mut recv) = conn
        .open_bi()
        .await
        .map_err(|e| format!("opening the control stream: {e}"))?;
    let value = |s: &str| {
        if s.bytes().all(|b| b == b'\t' || (b' '..=b'~').contains(&b)) {
            Ok(s.to_owned())
        } else {
            Err("token or runtime id is not a valid header value".to_owned())
        }
    };
    let hello_head = format!(
        "GET {} HTTP/1.1\r\nhost: {}\r\nauthorization: Bearer {}\r\n{}: {}\r\n{}: {}\r\n{}: {}\r\n\r\n",
        super::TUNNEL_PATH,
        server.authority().map_or(host, |a| a.as_str()),
        value(&hello.token)?,
        super::RUNTIME_HEADER,
        value(&hello.runtime)?,
        super::INSTANCE_HEADER,
        value(&hello.instance)?,
        super::SLOT_HEADER,
        hello.slot,
    );
    control
        .write_all(hello_head.as_bytes())
        .await
        .map_err(|e| format!("sending the hello: {e}"))?;
    let head = read_head(&mut recv)
        .await
        .map_err(|e| match conn.close_reason() {
            Some(reason) => format!("the server closed the tunnel: {reason}"),
            None => e,
        })?;
    let mut fields = [httparse::EMPTY_HEADER; 16];
    let mut resp = httparse::Response::new(&mut fields);
    let end = match resp.parse(&head) {
        Ok(httparse::Status::Complete(end)) => end,
        _ => return Err("the server's answer to the hello is not HTTP".into()),
    };
    let status = resp.code.unwrap_or(0);
    if status != 200 {
        let mut body = head[end..].to_vec();
        // The body follows the head; a short wait for the rest of it.
        if let Ok(Ok(rest)) =
            tokio::time::timeout(Duration::from_secs(1), recv.read_to_end(MAX_HELLO)).await
        {
            body.extend_from_slice(&rest);
        }
        return Err(format!(
            "{REFUSED}: {} {} {}",
            status,
            StatusCode::from_u16(status)
                .ok()
                .and_then(|s| s.canonical_reason())
                .unwrap_or(""),
            String::from_utf8_lossy(&body)
        ));
    }
    Ok(ClientTunnel {
        endpoint,
        conn,
        control,
    })
}

impl ClientTunnel {
    /// The next request stream the server opens, as a byte stream; `Err`
    /// with why once the connection has ended.
    pub async fn accept(&self) -> Result<StreamIo, String> {
        match self.conn.accept_bi().await {
            Ok((send, recv)) => Ok(stream_io(send, recv)),
            Err(quinn::ConnectionError::ApplicationClosed(close)) => Err(format!(
                "the server closed the tunnel ({})",
                String::from_utf8_lossy(&close.reason)
            )),
            Err(e) => Err(e.to_string()),
        }
    }

    /// Tells the server this client is draining: it sends no new requests
    /// here.
    pub fn drain(&mut self) {
        let _ = self.control.finish();
    }

    /// Closes the connection, and waits a moment for the close to reach
    /// the server.
    pub async fn close(self, why: &'static str) {
        self.conn.close(0u32.into(), why.as_bytes());
        let _ = tokio::time::timeout(Duration::from_secs(1), self.endpoint.wait_idle()).await;
    }
}

/// gRPC's trailers, declared for it (see [`declare_trailers`]).
const GRPC_TRAILERS: &str = "grpc-status, grpc-message, grpc-status-details-bin";

/// Declares a response's trailers in a `Trailer` header, as HTTP/1.1
/// wants before it sends any (hyper drops undeclared ones), where HTTP/2
/// sends them undeclared: gRPC's status for a gRPC response that does not
/// declare its own. The tunnel server drops the header again (hop-by-hop).
pub fn declare_trailers(resp: &mut Response<portcullis_forward::ResponseBody>) {
    use http::header::{CONTENT_LENGTH, CONTENT_TYPE, TRAILER};
    let headers = resp.headers();
    let grpc = headers
        .get(CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
    if grpc && !headers.contains_key(TRAILER) && !headers.contains_key(CONTENT_LENGTH) {
        resp.headers_mut()
            .insert(TRAILER, http::HeaderValue::from_static(GRPC_TRAILERS));
    }
}

/// Serves one request stream with `service` (HTTP/1.1, one exchange,
/// upgrades allowed).
pub async fn serve_stream<S>(io: StreamIo, service: S) -> Result<(), hyper::Error>
where
    S: hyper::service::Service<
            Request<Incoming>,
            Response = Response<portcullis_forward::ResponseBody>,
        >,
    S::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    S::Future: Send + 'static,
{
    hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .keep_alive(false)
        .max_buf_size(super::MAX_TUNNELED_HEAD as usize)
        .max_headers(MAX_FIELDS)
        .serve_connection(io, service)
        .with_upgrades()
        .await
}

#[cfg(test)]
mod tests;
