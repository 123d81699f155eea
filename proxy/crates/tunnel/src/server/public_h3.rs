//! HTTP/3 on the tunnel server's public side (`--http3`): QUIC on the
//! public port's UDP twin, with the HTTPS certificate, advertised to
//! HTTPS clients by `Alt-Svc`. Served by the routing core's HTTP/3
//! serving ([`portcullis_http::http3`]); each request goes through the
//! same [`super`] forwarding as HTTP/1.1 and HTTP/2 (an HTTP/2 stream in
//! the runtime's tunnel).

use std::net::SocketAddr;
use std::sync::Arc;

use http::{Request, Response};
use portcullis_forward::{Body, ResponseBody};
use portcullis_http::http3;
use tokio_util::sync::CancellationToken;

/// The QUIC settings for the public side: TLS 1.3 only (QUIC has no
/// other), ALPN `h3`, the certificate files re-read on change as the
/// HTTPS side's are; idle connections close after the keep-alive timeout;
/// answers sent with the server's congestion control.
pub fn server_config(
    cert: &std::path::Path,
    key: &std::path::Path,
    congestion: crate::quic::Congestion,
) -> anyhow::Result<quinn::ServerConfig> {
    let mut transport = quinn::TransportConfig::default();
    congestion.apply(&mut transport);
    transport.max_idle_timeout(Some(
        portcullis_config::DEFAULT_KEEPALIVE_TIMEOUT.try_into()?,
    ));
    crate::quic::server_config(cert, key, http3::ALPN, transport)
}

/// Accepts HTTP/3 connections on `socket` until `stop` and hands them to
/// `workers` in turn.
pub(super) async fn accept(
    socket: std::net::UdpSocket,
    config: quinn::ServerConfig,
    slots: Arc<tokio::sync::Semaphore>,
    workers: Vec<tokio::sync::mpsc::UnboundedSender<http3::Handed>>,
    stop: CancellationToken,
) {
    let endpoint = match quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        Some(config),
        socket,
        Arc::new(quinn::TokioRuntime),
    ) {
        Ok(endpoint) => endpoint,
        Err(e) => {
            tracing::error!(error = %e, "cannot serve HTTP/3 on the public UDP socket");
            return;
        }
    };
    http3::accept(endpoint, || slots.clone(), workers, stop).await;
}

/// Serves the HTTP/3 connections handed to this worker until `stop`.
pub(super) async fn serve(
    handed: tokio::sync::mpsc::UnboundedReceiver<http3::Handed>,
    public: super::public::Public,
    stop: CancellationToken,
) {
    let listener = http3::Listener {
        name: Arc::from("public"),
        max_head: u64::from(crate::MAX_PUBLIC_HEAD),
        responder: move |conn: &quinn::Connection| Client {
            public: public.clone(),
            peer: conn.remote_address(),
        },
    };
    http3::serve(handed, Arc::new(listener), stop).await;
}

/// One public HTTP/3 client's requests.
struct Client {
    public: super::public::Public,
    peer: SocketAddr,
}

impl http3::Respond for Client {
    fn respond(
        &self,
        req: Request<Body>,
    ) -> impl std::future::Future<Output = Response<ResponseBody>> + Send {
        // QUIC is TLS 1.3 only.
        let tls = Some(rustls::ProtocolVersion::TLSv1_3);
        self.public.respond(req, self.peer, tls)
    }
}
