//! A listener as the policies state it: address, limits, TLS.

use crate::*;

/// A TCP listener that serves HTTP/1.1 and cleartext HTTP/2 on one port.
#[derive(Debug, Clone)]
pub struct Listener {
    /// Unique name, used in logs.
    pub name: String,
    /// Address to bind; port 0 picks a free port.
    pub bind: SocketAddr,
    /// Connections served at once; further clients wait in the accept queue.
    pub max_connections: usize,
    /// Time a request head may take: a new connection's first from the
    /// accept, a later one on a keep-alive connection from its first byte.
    pub header_read_timeout: Duration,
    /// Time an idle keep-alive connection may wait for its next request
    /// after a response (a head it starts has `header_read_timeout`).
    pub keepalive_timeout: Duration,
    /// Requests a client connection carries before it is closed (nginx's
    /// `keepalive_requests`): the last HTTP/1.1 answer says `Connection:
    /// close`, HTTP/2 gets a GOAWAY; 0: no limit.
    pub max_requests_per_connection: u32,
    /// How long a client connection is kept, from its accept, before the
    /// next answer closes it the same way (nginx's `keepalive_time`,
    /// Envoy's `max_connection_duration`); zero: no limit.
    pub connection_lifetime: Duration,
    /// Largest request head (request line and headers) accepted; larger gets 431.
    pub max_request_header_size: usize,
    /// Keep `X-Forwarded-Proto`/`-Host` from the client (behind an ingress controller).
    pub trust_forwarded_headers: bool,
    /// Connections start with a PROXY protocol header (version 1 or 2)
    /// giving the client's address (behind a TCP balancer).
    pub proxy_protocol: bool,
    /// What the listener does with each request's `X-Request-Id`.
    pub request_id: RequestIds,
    /// HTTPS: the handshake's settings; `None` for cleartext.
    pub tls: Option<ListenerTls>,
    /// Answer every request (but health probes) with a redirect to the
    /// same URL over https, on this port.
    pub redirect_https: Option<u16>,
    /// HTTPS listeners: HTTP/3 too, over QUIC on the same port's UDP
    /// twin, advertised to HTTP/1.1 and HTTP/2 clients by `Alt-Svc`.
    pub http3: Option<Http3>,
    /// Where the listener was defined.
    pub defined_at: Pos,
}

/// A listener's HTTP/3 (`http3: true`, or the port to advertise).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Http3 {
    /// The port `Alt-Svc` names: the listener's own unless a balancer in
    /// front maps another to it.
    pub advertised_port: Option<u16>,
}

/// A listener's TLS settings: its certificates (read again when the files
/// change), whether clients must present one, its ticket keys. Data: the
/// listener makes its live handshake from them and keeps what handshakes
/// build up across reloads (`portcullis_net::tls_live`).
#[derive(Clone)]
pub struct ListenerTls {
    /// The handshake's settings, without the session cache and (unless
    /// `keyed`) the ticket key, which are the listener's.
    pub template: Arc<rustls::ServerConfig>,
    /// Whether its ticket keys come from files (`session_ticket_keys`).
    pub keyed: bool,
    /// The certificate files (cert, key), in order.
    pub pairs: Vec<(PathBuf, PathBuf)>,
    /// The certificate file, for logs.
    pub cert: PathBuf,
    /// The certificates served, for their expiry.
    pub certificates: Arc<portcullis_net::cert_files::ByServerName>,
    /// Which client certificates it asks for.
    pub client_auth: ClientAuthMode,
    /// A digest of its client CA and session ticket keys (not of its
    /// certificates, which are reread at handshakes), for the config's
    /// fingerprint.
    pub material: [u8; 32],
}

impl ListenerTls {
    /// What a reload compares to keep the listener's sessions.
    pub fn source(&self) -> portcullis_net::tls_live::TlsSource {
        portcullis_net::tls_live::TlsSource {
            rules: self.material,
            pairs: self.pairs.clone(),
        }
    }
}

/// Whether a listener asks for client certificates (`client_ca`), and
/// whether a client may go without one (`client_auth: optional`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAuthMode {
    /// No `client_ca`: no client certificates.
    Off,
    /// Every client presents one from `client_ca`.
    Required,
    /// A client may present none; one it presents must be valid.
    Optional,
}

impl ClientAuthMode {
    /// As `/status` shows it.
    pub fn as_str(self) -> &'static str {
        match self {
            ClientAuthMode::Off => "off",
            ClientAuthMode::Required => "required",
            ClientAuthMode::Optional => "optional",
        }
    }
}

impl std::fmt::Debug for ListenerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListenerTls")
            .field("cert", &self.cert)
            .field("client_auth", &self.client_auth)
            .finish_non_exhaustive()
    }
}
