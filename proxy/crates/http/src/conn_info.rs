//! What the request path knows about the connection a request came on,
//! read by every phase (and by plugins, through their request facts).

use std::net::SocketAddr;
use std::sync::Arc;

use http::HeaderValue;

use portcullis_config::Listener;
use portcullis_forward as forward;
use portcullis_forward::client_watch::ClientSocket;

/// What the pipeline knows about the connection a request came on.
#[derive(Debug)]
pub struct ConnInfo {
    /// The client's address.
    pub client: SocketAddr,
    /// The client's IP as an `X-Forwarded-For` entry, made once per connection.
    pub client_ip: HeaderValue,
    /// The listener's settings.
    pub listener: Arc<Listener>,
    /// Whether the client connection is TLS.
    pub tls: bool,
    /// Its TLS version (`TLSv1.3`), for the access log.
    pub tls_version: Option<&'static str>,
    /// The server name the client asked for in its TLS handshake (SNI).
    pub sni: Option<Arc<str>>,
    /// The client's verified certificate (mutual TLS).
    pub client_cert: Option<Arc<portcullis_net::client_cert::ClientCertificate>>,
    /// The worker thread serving it, which picks its upstream pools.
    pub worker: usize,
    /// Its socket, watched for the client leaving while a request waits
    /// (HTTP/1 only; `None` for requests that come through a tunnel).
    pub socket: Option<ClientSocket>,
    /// `Alt-Svc` for its answers, when its listener also serves HTTP/3.
    pub alt_svc: Option<HeaderValue>,
}

impl ConnInfo {
    /// Sets the `X-Forwarded-*` headers of a request from this connection
    /// bound upstream (`seen`: which of them the client sent, from
    /// [`forward::remove_hop_by_hop`]; `public_host`: the host it asked
    /// for). With `defer`, those the request lacks are not inserted but
    /// returned, to add later ([`forward::Forwarded`]); else none are.
    #[inline]
    pub fn forwarded(
        &self,
        headers: &mut http::HeaderMap,
        seen: forward::Seen,
        public_host: Option<HeaderValue>,
        defer: bool,
    ) -> forward::Forwarded {
        let proto = if self.tls { "https" } else { "http" };
        let client = (
            &self.client_ip,
            self.client_cert.as_ref().map(|c| &c.header),
            seen,
        );
        let trust = self.listener.trust_forwarded_headers;
        if defer {
            forward::forwarded(headers, client, proto, public_host, trust)
        } else {
            forward::set_forwarded(headers, client, proto, public_host, trust);
            forward::Forwarded::default()
        }
    }
}
