//! TLS on a listening port, for the routing core's listeners and the
//! tunnel server's public one: the acceptor (a certificate read from
//! files, and again when they change; optionally a client-certificate
//! check), and the handshake, which answers plain HTTP with a 400 saying
//! to use https, as nginx does, rather than a TLS alert the client cannot
//! read; with [`open`], the whole step from accept to HTTP, a PROXY
//! protocol header first where one is expected.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls_pki_types::CertificateDer;
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::client_cert::ClientCertificate;

/// What a listener offers in ALPN: HTTP/2 first, as browsers and curl
/// prefer, then HTTP/1.1.
pub const HTTP_ALPN: &[&[u8]] = &[b"h2", b"http/1.1"];

/// Which client certificates a listener asks for (mutual TLS).
#[derive(Debug, Clone)]
pub struct ClientAuth {
    /// The CAs a client certificate must chain to.
    pub roots: Vec<CertificateDer<'static>>,
    /// Clients without a certificate get in too (nginx's
    /// `ssl_verify_client optional`), for routes whose plugins decide;
    /// one that presents a certificate must still present a valid one.
    pub optional: bool,
}

/// A TLS acceptor serving the pair in `cert` and `key` (read again when
/// they change), offering `alpn`, with a session cache and ticket key of
/// its own. With `client_auth`, clients present a certificate that chains
/// to one of its roots (mutual TLS). An error names the file and the
/// problem.
pub fn acceptor(
    cert: &Path,
    key: &Path,
    client_auth: Option<ClientAuth>,
    alpn: &[&[u8]],
) -> Result<TlsAcceptor, String> {
    let files = crate::cert_files::CertFiles::load(cert.to_path_buf(), key.to_path_buf())?;
    let template = Arc::new(server_config(Arc::new(files), client_auth, alpn)?);
    Ok(crate::tls_live::LiveTls::fresh(&template, false).acceptor)
}

/// The settings of a listener with several pairs, chosen by the name the
/// client asks for (SNI; the first is the default): a template the
/// listener makes its live TLS from ([`crate::tls_live::LiveTls`]), with
/// `tickets` (keys from files) when given, else none yet: the listener
/// adds its own ticket key and session cache.
/// The certificates come back too, for their expiry in `/status` and
/// `/metrics`.
pub fn template_by_name(
    pairs: &[(PathBuf, PathBuf)],
    client_auth: Option<ClientAuth>,
    tickets: Option<Arc<dyn rustls::server::ProducesTickets>>,
    alpn: &[&[u8]],
) -> Result<
    (
        Arc<rustls::ServerConfig>,
        Arc<crate::cert_files::ByServerName>,
    ),
    String,
> {
    let files = pairs
        .iter()
        .map(|(cert, key)| crate::cert_files::CertFiles::load(cert.clone(), key.clone()))
        .collect::<Result<Vec<_>, _>>()?;
    let certificates = Arc::new(crate::cert_files::ByServerName(files));
    let mut config = server_config(certificates.clone(), client_auth, alpn)?;
    if let Some(tickets) = tickets {
        config.ticketer = tickets;
    }
    Ok((Arc::new(config), certificates))
}

fn server_config(
    certificates: Arc<dyn rustls::server::ResolvesServerCert>,
    client_auth: Option<ClientAuth>,
    alpn: &[&[u8]],
) -> Result<rustls::ServerConfig, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let builder = match client_auth {
        None => builder.with_no_client_auth(),
        Some(auth) => {
            let mut store = rustls::RootCertStore::empty();
            for root in auth.roots {
                store
                    .add(root)
                    .map_err(|e| format!("client CA certificate: {e}"))?;
            }
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(store),
                provider,
            );
            let verifier = if auth.optional {
                verifier.allow_unauthenticated()
            } else {
                verifier
            };
            let verifier = verifier.build().map_err(|e| format!("client CA: {e}"))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_cert_resolver(certificates);
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(config)
}

/// Why a connection was closed before HTTP.
#[derive(Debug)]
pub enum Refused {
    /// It spoke plain HTTP (`METHOD /path`) on the HTTPS port, and was
    /// answered 400.
    PlainHttp(String),
    /// The TLS handshake failed.
    Handshake(std::io::Error),
}

impl Refused {
    /// The reason it is counted under in `portcullis_connection_errors_total`.
    pub fn reason(&self) -> &'static str {
        match self {
            Refused::PlainHttp(_) => "plain_http",
            Refused::Handshake(_) => "tls_handshake",
        }
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Refused::PlainHttp(request) => {
                write!(f, "plain HTTP ({request}) on the HTTPS port; answered 400")
            }
            Refused::Handshake(e) => write!(f, "TLS handshake failed: {e}"),
        }
    }
}

/// The TLS handshake on an accepted connection. A client that speaks
/// plain HTTP instead (its first byte is a letter, where a TLS record
/// starts with 0x16) gets a 400 with the JSON `body`.
pub async fn handshake(
    tls: &TlsAcceptor,
    mut stream: TcpStream,
    body: &str,
) -> Result<TlsStream<TcpStream>, Refused> {
    let mut first = [0u8; 1];
    if matches!(stream.peek(&mut first).await, Ok(1) if first[0].is_ascii_alphabetic()) {
        // The head is read first: closing with it unread would reset
        // the connection, and the client could lose the answer.
        let request = match crate::handshake_head::read(&mut stream).await {
            Ok((_, crate::handshake_head::Head::Plain(request))) => request,
            Ok(_) => "an upgrade or health check".to_owned(),
            Err(e) => e,
        };
        crate::handshake_head::refuse_plain_on_https(&mut stream, body).await;
        return Err(Refused::PlainHttp(request));
    }
    tls.accept(stream).await.map_err(Refused::Handshake)
}

/// What a TLS connection's handshake tells about the client.
#[derive(Debug, Clone, Default)]
pub struct ClientFacts {
    /// The server name it asked for (SNI).
    pub sni: Option<Arc<str>>,
    /// The protocol version agreed, as nginx's `$ssl_protocol` names it.
    pub version: Option<&'static str>,
    /// Its certificate (mutual TLS), read once per connection.
    pub client_cert: Option<Arc<ClientCertificate>>,
}

impl ClientFacts {
    /// The facts of a completed handshake.
    pub fn of(stream: &TlsStream<TcpStream>) -> ClientFacts {
        let session = stream.get_ref().1;
        ClientFacts {
            sni: session.server_name().map(Arc::from),
            version: session.protocol_version().map(version_name),
            client_cert: session
                .peer_certificates()
                .and_then(|chain| chain.first())
                .map(|leaf| Arc::new(ClientCertificate::of(leaf))),
        }
    }
}

/// nginx's name for a TLS version (`TLSv1.3`), which log pipelines
/// already parse; rustls offers none older than 1.2.
pub fn version_name(version: rustls::ProtocolVersion) -> &'static str {
    match version {
        rustls::ProtocolVersion::TLSv1_3 => "TLSv1.3",
        rustls::ProtocolVersion::TLSv1_2 => "TLSv1.2",
        _ => "other",
    }
}

/// An accepted connection ready for HTTP.
pub enum Opened {
    Tcp(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

/// Why a connection was closed before HTTP.
pub enum NotOpened {
    /// Its PROXY protocol header was missing or bad.
    ProxyHeader(crate::proxy_protocol::Error),
    /// Plain HTTP on the HTTPS port, or a failed handshake.
    Tls(Refused),
}

/// Reads a connection's PROXY header (with `proxy_protocol`) and does its
/// TLS handshake (with `tls`; plain HTTP gets the JSON `plain_body`).
/// Returns the connection and the client's address: the header's, or the
/// peer's.
pub async fn open(
    mut stream: TcpStream,
    peer: SocketAddr,
    proxy_protocol: bool,
    tls: Option<(&TlsAcceptor, &str)>,
) -> Result<(Opened, SocketAddr), NotOpened> {
    let mut client = peer;
    if proxy_protocol {
        let header = crate::proxy_protocol::read(&mut stream).await;
        if let Some(source) = header.map_err(NotOpened::ProxyHeader)? {
            client = source;
        }
    }
    let Some((tls, plain_body)) = tls else {
        return Ok((Opened::Tcp(stream), client));
    };
    let stream = handshake(tls, stream, plain_body)
        .await
        .map_err(NotOpened::Tls)?;
    Ok((Opened::Tls(Box::new(stream)), client))
}
