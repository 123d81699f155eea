//! A throwaway CA and server certificates for TLS tests.

use std::sync::Arc;

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// A CA and one leaf certificate it signed.
pub struct TestPki {
    /// The CA certificate, PEM.
    pub ca_pem: String,
    /// The leaf chain.
    pub leaf_chain: Vec<CertificateDer<'static>>,
    /// The leaf key, PKCS#8 DER.
    pub leaf_key: Vec<u8>,
    /// Leaf certificate, PEM.
    pub leaf_pem: String,
    /// Leaf key, PEM.
    pub leaf_key_pem: String,
    /// The CA, to sign renewed leaves.
    ca: Arc<CertifiedIssuer<'static, KeyPair>>,
}

impl TestPki {
    /// Makes a fresh CA and a leaf for `localhost` and 127.0.0.1.
    pub fn new() -> TestPki {
        Self::for_names(&["localhost", "127.0.0.1"])
    }

    /// Makes a fresh CA and a leaf for `names` (`*.example` for a wildcard).
    pub fn for_names(names: &[&str]) -> TestPki {
        let ca_key = KeyPair::generate().expect("ca key");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("ca params");
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        // A name of its own: with rcgen's default for both, the leaf's
        // issuer reads as its own subject, and OpenSSL-based clients
        // (aioquic) take the leaf for self-signed.
        ca_params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "portcullis test CA");
        let ca = CertifiedIssuer::self_signed(ca_params, ca_key).expect("ca cert");
        Self::leaf(Arc::new(ca), names)
    }

    /// A new leaf for `names` from the same CA, as a renewal gives.
    pub fn renewed(&self, names: &[&str]) -> TestPki {
        Self::leaf(self.ca.clone(), names)
    }

    /// A client certificate from the same CA, with the subject `cn` and
    /// the alternative names `sans`.
    pub fn client(&self, cn: &str, sans: Vec<rcgen::SanType>) -> TestPki {
        let mut params = CertificateParams::default();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        params.subject_alt_names = sans;
        Self::signed(self.ca.clone(), params)
    }

    fn leaf(ca: Arc<CertifiedIssuer<'static, KeyPair>>, names: &[&str]) -> TestPki {
        let params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .expect("leaf params");
        Self::signed(ca, params)
    }

    fn signed(ca: Arc<CertifiedIssuer<'static, KeyPair>>, params: CertificateParams) -> TestPki {
        let leaf_key = KeyPair::generate().expect("leaf key");
        let leaf = params.signed_by(&leaf_key, &*ca).expect("leaf cert");
        TestPki {
            ca_pem: ca.pem(),
            leaf_chain: vec![leaf.der().clone()],
            leaf_key: leaf_key.serialize_der(),
            leaf_pem: leaf.pem(),
            leaf_key_pem: leaf_key.serialize_pem(),
            ca,
        }
    }

    /// A rustls server config for the leaf, offering `alpn`.
    pub fn server_config(&self, alpn: &[&[u8]]) -> Arc<rustls::ServerConfig> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(
                self.leaf_chain.clone(),
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(self.leaf_key.clone())),
            )
            .expect("server cert");
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(config)
    }
}

/// A root store of the one CA in `ca_pem`.
fn roots(ca_pem: &str) -> rustls::RootCertStore {
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).expect("CA PEM"))
        .expect("CA");
    roots
}

/// An HTTPS GET of `path` from `addr`, as a client that trusts only
/// `ca_pem` and asks for `host` (SNI and Host), offering `alpn`: the
/// protocol the server chose, and the answer (20 s limit).
pub async fn https_get(
    addr: std::net::SocketAddr,
    host: &str,
    ca_pem: &str,
    alpn: &[&[u8]],
    path: &str,
) -> Result<(http::Version, super::client::Answer), String> {
    https_get_after(addr, b"", host, ca_pem, alpn, path).await
}

/// [`https_get`] with these request headers.
pub async fn https_get_with(
    addr: std::net::SocketAddr,
    host: &str,
    ca_pem: &str,
    alpn: &[&[u8]],
    path: &str,
    headers: &[(&str, &str)],
) -> Result<(http::Version, super::client::Answer), String> {
    https_exchange(
        addr,
        b"",
        host,
        connector(ca_pem, alpn, None),
        path,
        headers,
    )
    .await
}

/// [`https_get`] presenting `identity`'s leaf as a client certificate.
pub async fn https_get_as(
    addr: std::net::SocketAddr,
    host: &str,
    ca_pem: &str,
    identity: &TestPki,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<(http::Version, super::client::Answer), String> {
    let connector = connector(ca_pem, &[b"http/1.1"], Some(identity));
    https_exchange(addr, b"", host, connector, path, headers).await
}

/// The certificate `addr` presents to a client asking for `host` (DER),
/// trusting only `ca_pem` (20 s limit).
pub async fn server_certificate(
    addr: std::net::SocketAddr,
    host: &str,
    ca_pem: &str,
) -> Result<Vec<u8>, String> {
    let connector = connector(ca_pem, &[], None);
    let handshake = async {
        let tls = tls_connect(addr, b"", host, &connector).await?;
        let certs = tls.get_ref().1.peer_certificates().unwrap_or_default();
        Ok(certs.first().map(|c| c.to_vec()).unwrap_or_default())
    };
    tokio::time::timeout(std::time::Duration::from_secs(20), handshake)
        .await
        .map_err(|_| "no handshake within 20s".to_owned())?
}

/// An HTTP/1.1 TLS connection to `addr` asking for `host`, trusting only
/// `ca_pem`.
pub async fn connect(
    addr: std::net::SocketAddr,
    host: &str,
    ca_pem: &str,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, String> {
    tls_connect(addr, b"", host, &connector(ca_pem, &[b"http/1.1"], None)).await
}

/// Connects to `addr`, sends `before` (a PROXY header, say), and does the
/// TLS handshake asking for `host`.
async fn tls_connect(
    addr: std::net::SocketAddr,
    before: &[u8],
    host: &str,
    connector: &tokio_rustls::TlsConnector,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, String> {
    let mut tcp = tokio::net::TcpStream::connect(addr)
        .await
        .map_err(|e| e.to_string())?;
    tokio::io::AsyncWriteExt::write_all(&mut tcp, before)
        .await
        .map_err(|e| e.to_string())?;
    let name =
        rustls_pki_types::ServerName::try_from(host.to_owned()).map_err(|e| e.to_string())?;
    connector
        .connect(name, tcp)
        .await
        .map_err(|e| format!("TLS: {e}"))
}

/// A client TLS connector trusting only `ca_pem`, offering `alpn`, and
/// presenting `identity`'s leaf when given. It keeps the sessions servers
/// hand it (rustls' default), and offers them again, as a browser does.
pub fn connector(
    ca_pem: &str,
    alpn: &[&[u8]],
    identity: Option<&TestPki>,
) -> tokio_rustls::TlsConnector {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_root_certificates(roots(ca_pem));
    let mut config = match identity {
        None => builder.with_no_client_auth(),
        Some(id) => builder
            .with_client_auth_cert(
                id.leaf_chain.clone(),
                PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(id.leaf_key.clone())),
            )
            .expect("client certificate"),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// A TLS 1.2 client offering HTTP/1.1 that resumes by session ID only,
/// never by ticket: what only the server's session cache can resume.
pub fn connector_tls12_session_ids(ca_pem: &str) -> tokio_rustls::TlsConnector {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS12])
        .expect("versions")
        .with_root_certificates(roots(ca_pem))
        .with_no_client_auth();
    config.resumption = rustls::client::Resumption::in_memory_sessions(32)
        .tls12_resumption(rustls::client::Tls12Resumption::SessionIdOnly);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// A `Connection: close` GET of `/` on a new connection made with
/// `connector`, read to the end (so a TLS 1.3 server's session tickets,
/// sent after the handshake, are taken in): whether the handshake resumed
/// a session (20 s limit).
pub async fn get_resumed(
    addr: std::net::SocketAddr,
    host: &str,
    connector: &tokio_rustls::TlsConnector,
) -> Result<bool, String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let exchange = async {
        let mut tls = tls_connect(addr, b"", host, connector).await?;
        let resumed = tls.get_ref().1.handshake_kind() == Some(rustls::HandshakeKind::Resumed);
        let request = format!("GET / HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n");
        tls.write_all(request.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let mut answer = Vec::new();
        // A peer closing without close_notify still leaves the answer read.
        let _ = tls.read_to_end(&mut answer).await;
        if !answer.starts_with(b"HTTP/1.1 200") {
            return Err(format!("answer: {}", String::from_utf8_lossy(&answer)));
        }
        Ok(resumed)
    };
    tokio::time::timeout(std::time::Duration::from_secs(20), exchange)
        .await
        .map_err(|_| "no answer within 20s".to_owned())?
}

/// [`https_get`] sending `before` on the connection ahead of the TLS
/// handshake, as a balancer sends a PROXY protocol header.
pub async fn https_get_after(
    addr: std::net::SocketAddr,
    before: &[u8],
    host: &str,
    ca_pem: &str,
    alpn: &[&[u8]],
    path: &str,
) -> Result<(http::Version, super::client::Answer), String> {
    https_exchange(addr, before, host, connector(ca_pem, alpn, None), path, &[]).await
}

async fn https_exchange(
    addr: std::net::SocketAddr,
    before: &[u8],
    host: &str,
    connector: tokio_rustls::TlsConnector,
    path: &str,
    headers: &[(&str, &str)],
) -> Result<(http::Version, super::client::Answer), String> {
    let exchange = async {
        let tls = tls_connect(addr, before, host, &connector).await?;
        let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
        let io = hyper_util::rt::TokioIo::new(tls);
        let req = |uri: String| {
            let mut req = http::Request::get(uri);
            if !h2 {
                req = req.header(http::header::HOST, host);
            }
            for (name, value) in headers {
                req = req.header(*name, *value);
            }
            req.body(super::client::body(bytes::Bytes::new()))
                .expect("request")
        };
        let resp = if h2 {
            let (mut send, conn) =
                hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                    // Large response heads, as browsers take them (hyper: 16 KiB).
                    .max_header_list_size(256 << 10)
                    .handshake(io)
                    .await
                    .map_err(|e| e.to_string())?;
            tokio::spawn(conn);
            // HTTP/2 carries the host as the :authority of an absolute URI.
            send.send_request(req(format!("https://{host}{path}")))
                .await
                .map_err(|e| e.to_string())?
        } else {
            let (mut send, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(|e| e.to_string())?;
            tokio::spawn(conn);
            send.send_request(req(path.to_owned()))
                .await
                .map_err(|e| e.to_string())?
        };
        let version = resp.version();
        Ok((version, super::client::collect(resp).await))
    };
    tokio::time::timeout(std::time::Duration::from_secs(20), exchange)
        .await
        .map_err(|_| "no answer within 20s".to_owned())?
}

/// An HTTP/3 connection to `addr` as a client that trusts only `ca_pem`
/// and asks for `host`: its endpoint (close it when done), the
/// connection's driver and its request sender.
async fn h3_connect(
    addr: std::net::SocketAddr,
    host: &str,
    ca_pem: &str,
) -> Result<
    (
        quinn::Endpoint,
        h3::client::Connection<h3_quinn::Connection, bytes::Bytes>,
        h3::client::SendRequest<h3_quinn::OpenStreams, bytes::Bytes>,
    ),
    String,
> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .with_root_certificates(roots(ca_pem))
        .with_no_client_auth();
    tls.alpn_protocols = vec![b"h3".to_vec()];
    let quic = quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(|e| e.to_string())?;
    let mut endpoint =
        quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).map_err(|e| e.to_string())?;
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(quic)));
    let conn = endpoint
        .connect(addr, host)
        .map_err(|e| e.to_string())?
        .await
        .map_err(|e| format!("QUIC: {e}"))?;
    let (driver, sender) = h3::client::new(h3_quinn::Connection::new(conn))
        .await
        .map_err(|e| e.to_string())?;
    Ok((endpoint, driver, sender))
}

/// An HTTP/3 request sent and left waiting for its answer.
pub struct H3Waiting {
    endpoint: quinn::Endpoint,
    driving: tokio::task::JoinHandle<h3::error::ConnectionError>,
    // Held: h3 closes a connection once its last sender goes.
    _sender: h3::client::SendRequest<h3_quinn::OpenStreams, bytes::Bytes>,
    _stream: h3::client::RequestStream<h3_quinn::BidiStream<bytes::Bytes>, bytes::Bytes>,
}

impl H3Waiting {
    /// The client goes away: its QUIC connection closed, the request
    /// unanswered.
    pub fn leave(self) {
        self.endpoint.close(0u32.into(), b"gone");
        self.driving.abort();
    }
}

/// Sends a GET for `path` over a new HTTP/3 connection (as
/// [`h3_request`] does) and does not wait for the answer.
pub async fn h3_send(
    addr: std::net::SocketAddr,
    host: &str,
    ca_pem: &str,
    path: &str,
) -> Result<H3Waiting, String> {
    let (endpoint, mut driver, mut sender) = h3_connect(addr, host, ca_pem).await?;
    let driving =
        tokio::spawn(
            async move { futures_util::future::poll_fn(|cx| driver.poll_close(cx)).await },
        );
    let req = http::Request::get(format!("https://{host}{path}"))
        .body(())
        .expect("request");
    let mut stream = sender.send_request(req).await.map_err(|e| e.to_string())?;
    stream.finish().await.map_err(|e| e.to_string())?;
    Ok(H3Waiting {
        endpoint,
        driving,
        _sender: sender,
        _stream: stream,
    })
}

/// Opens an HTTP/3 connection and sends nothing: how long the server
/// keeps it (60 s limit).
pub async fn h3_idle(
    addr: std::net::SocketAddr,
    host: &str,
    ca_pem: &str,
) -> Result<std::time::Duration, String> {
    let (endpoint, mut driver, _sender) = h3_connect(addr, host, ca_pem).await?;
    let start = std::time::Instant::now();
    let closed = futures_util::future::poll_fn(|cx| driver.poll_close(cx));
    tokio::time::timeout(std::time::Duration::from_secs(60), closed)
        .await
        .map_err(|_| "the server kept an idle HTTP/3 connection for 60 s".to_owned())?;
    endpoint.close(0u32.into(), b"done");
    Ok(start.elapsed())
}

/// One HTTP/3 request to `addr`, as a client that trusts only `ca_pem` and
/// asks for `host` (SNI and `:authority`), sending `body` (20 s limit).
pub async fn h3_request(
    addr: std::net::SocketAddr,
    host: &str,
    ca_pem: &str,
    method: &str,
    path: &str,
    body: bytes::Bytes,
) -> Result<super::client::Answer, String> {
    use bytes::Buf;
    let exchange = async {
        let (endpoint, mut driver, mut sender) = h3_connect(addr, host, ca_pem).await?;
        let driving =
            tokio::spawn(
                async move { futures_util::future::poll_fn(|cx| driver.poll_close(cx)).await },
            );
        let req = http::Request::builder()
            .method(method)
            .uri(format!("https://{host}{path}"))
            .body(())
            .expect("request");
        let mut stream = sender.send_request(req).await.map_err(|e| e.to_string())?;
        // In pieces, as a client streaming an upload would send them.
        for piece in body.chunks(64 * 1024) {
            stream
                .send_data(bytes::Bytes::copy_from_slice(piece))
                .await
                .map_err(|e| e.to_string())?;
        }
        stream.finish().await.map_err(|e| e.to_string())?;
        let resp = stream.recv_response().await.map_err(|e| e.to_string())?;
        let mut data = Vec::new();
        while let Some(mut chunk) = stream.recv_data().await.map_err(|e| e.to_string())? {
            while chunk.has_remaining() {
                let part = chunk.chunk();
                data.extend_from_slice(part);
                let n = part.len();
                chunk.advance(n);
            }
        }
        drop(sender);
        driving.abort();
        endpoint.close(0u32.into(), b"done");
        Ok(super::client::Answer {
            status: resp.status(),
            headers: resp.headers().clone(),
            body: data.into(),
        })
    };
    tokio::time::timeout(std::time::Duration::from_secs(20), exchange)
        .await
        .map_err(|_| "HTTP/3 exchange timed out".to_owned())?
}
