//! A link to one peer replica: its HTTP/2 connection (over TLS when set), dialled once for the requests that share it, and requests forwarded through it.

use super::*;

/// The name a peer's certificate must carry: the host of the address it
/// advertises (`--peer-advertise`; an IP address: that address).
pub(super) fn server_name(entry: &str) -> rustls_pki_types::ServerName<'static> {
    let host = entry.rsplit_once(':').map_or(entry, |(host, _)| host);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    rustls_pki_types::ServerName::try_from(host.to_owned()).unwrap_or_else(|_| {
        // Not a name a certificate can carry: nothing will verify, and
        // the dial's error says so.
        rustls_pki_types::ServerName::try_from("invalid.peer.name").expect("a valid name")
    })
}

/// How a link dials with TLS: the connector and the name to verify.
pub(super) type LinkTls = (
    tokio_rustls::TlsConnector,
    rustls_pki_types::ServerName<'static>,
);

/// A connection to one peer, made when first needed and again after it
/// closes.
pub(crate) struct Link {
    /// The peer's advertised address, `host:port`.
    pub addr: String,
    pub(super) tls: Option<LinkTls>,
    pub(super) sender: Mutex<Option<SendRequest<Body>>>,
    /// One dial at a time, its failure shared with those waiting on it.
    pub(super) dialling: portcullis_net::shared_dial::SharedDial<String>,
    /// Requests forwarded on it.
    pub(super) sent: AtomicU64,
    /// Forwarded requests waiting for the peer's answer head.
    pub(super) active: AtomicUsize,
}

impl Link {
    pub(super) fn new(addr: String, tls: Option<LinkTls>) -> Link {
        Link {
            addr,
            tls,
            sender: Mutex::new(None),
            dialling: Default::default(),
            sent: AtomicU64::new(0),
            active: AtomicUsize::new(0),
        }
    }

    /// The link's connection, if it has one that is still open.
    pub(super) fn open(&self) -> Option<SendRequest<Body>> {
        self.sender
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .filter(|s| !s.is_closed())
            .cloned()
    }

    /// The link's connection, dialled now if it has none (one dial for
    /// the requests that find it missing together: see `SharedDial`).
    pub(super) async fn sender(&self) -> Result<SendRequest<Body>, String> {
        if let Some(s) = self.open() {
            return Ok(s);
        }
        let dial = || async {
            let send = self.dial().await?;
            *self.sender.lock().unwrap_or_else(|p| p.into_inner()) = Some(send.clone());
            Ok(send)
        };
        self.dialling.get(|| self.open(), dial).await
    }

    /// A new connection to the peer: TCP, TLS when peers speak it, HTTP/2.
    pub(super) async fn dial(&self) -> Result<SendRequest<Body>, String> {
        let tcp = tokio::time::timeout(DIAL_TIMEOUT, TcpStream::connect(self.addr.as_str()))
            .await
            .map_err(|_| "connect timed out".to_owned())?
            .map_err(|e| format!("connect: {e}"))?;
        let _ = tcp.set_nodelay(true);
        match &self.tls {
            None => self.h2(tcp).await,
            Some((connector, name)) => {
                let tls = tokio::time::timeout(DIAL_TIMEOUT, connector.connect(name.clone(), tcp))
                    .await
                    .map_err(|_| "TLS handshake timed out".to_owned())?
                    .map_err(|e| format!("TLS handshake: {e}"))?;
                self.h2(tls).await
            }
        }
    }

    /// HTTP/2 on a connection to the peer, driven by a task of its own.
    pub(super) async fn h2<S>(&self, io: S) -> Result<SendRequest<Body>, String>
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    {
        let (send, connection) = crate::h2_client()
            .handshake(TokioIo::new(io))
            .await
            .map_err(|e| format!("HTTP/2 handshake: {}", portcullis_forward::error_chain(&e)))?;
        let addr = self.addr.clone();
        tokio::spawn(async move {
            if let Err(e) = connection.await {
                tracing::debug!(peer = %addr, error = %e, "peer connection ended");
            }
        });
        Ok(send)
    }

    /// A connection to the peer ready for a request: made now if there
    /// is none. An error means nothing was sent.
    pub async fn ready(&self) -> Result<SendRequest<Body>, String> {
        let mut sender = self.sender().await?;
        sender
            .ready()
            .await
            .map_err(|e| portcullis_forward::error_chain(&e))?;
        Ok(sender)
    }

    /// Forwards one public request (shaped for HTTP/2) on `sender`, this
    /// link's ready connection.
    pub async fn forward(
        &self,
        mut sender: SendRequest<Body>,
        req: Request<Body>,
    ) -> Result<Response<Incoming>, String> {
        self.sent.fetch_add(1, Ordering::Relaxed);
        let _counted = crate::Active::count(&self.active);
        sender
            .send_request(req)
            .await
            .map_err(|e| portcullis_forward::error_chain(&e))
    }
}
