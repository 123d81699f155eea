//! HTTP/3 on the routing core's HTTPS listeners (`http3: true`): QUIC on
//! the listener's port over UDP, with the listener's certificates and
//! client-certificate rules, its connection cap and keep-alive timeout.
//! The first worker drives the QUIC endpoint and hands each connection to
//! a worker in turn; its requests go through the pipeline as the
//! listener's HTTP/1.1 and HTTP/2 requests do ([`crate::http3`]).
//!
//! A reload that changes the listener's TLS settings gives the endpoint
//! the new ones for its next handshakes; turning `http3` on or off opens
//! the listener anew.

use std::sync::OnceLock;

use super::*;
use crate::http3;

/// A listener's QUIC endpoint, once its worker has made it: a reload
/// gives it the listener's new TLS settings.
pub(super) type Endpoint = Arc<OnceLock<quinn::Endpoint>>;

/// The QUIC settings of a listener: its live TLS (the session cache and
/// ticket key its TCP side uses too), its keep-alive timeout.
fn quic_config(settings: &ListenerSettings) -> Result<quinn::ServerConfig, String> {
    let Some(tls) = &settings.tls else {
        return Err("HTTP/3 needs the listener's TLS".into());
    };
    let idle = settings.spec.keepalive_timeout;
    http3::server_config(tls.acceptor.config().as_ref().clone(), idle, |_| {})
}

/// Gives a running endpoint its listener's current TLS settings.
pub(super) fn reconfigure(endpoint: &Endpoint, settings: &ListenerSettings) {
    let Some(endpoint) = endpoint.get() else {
        // Not made yet: its worker makes it from the current settings.
        return;
    };
    match quic_config(settings) {
        Ok(config) => endpoint.set_server_config(Some(config)),
        Err(e) => {
            tracing::error!(listener = %settings.spec.name, error = %e, "HTTP/3 keeps its previous TLS settings")
        }
    }
}

impl Control {
    /// Serves HTTP/3 on `socket` for the listener whose settings are
    /// `settings`, until `stop`.
    pub(super) fn start_http3(
        &self,
        socket: std::net::UdpSocket,
        settings: &Arc<ArcSwap<ListenerSettings>>,
        stop: &CancellationToken,
    ) -> Endpoint {
        let endpoint = Endpoint::default();
        let name: Arc<str> = Arc::from(settings.load().spec.name.as_str());
        let (to_workers, inboxes): (Vec<_>, Vec<_>) =
            (0..self.workers).map(|_| mpsc::unbounded_channel()).unzip();
        for (worker, inbox) in inboxes.into_iter().enumerate() {
            let (settings, stop, name) = (settings.clone(), stop.clone(), name.clone());
            self.spawn_on_worker(worker, move |ctx| {
                let max_head = (settings.load().spec.max_request_header_size * 2) as u64;
                let listener = http3::Listener {
                    name,
                    max_head,
                    responder: move |conn: &quinn::Connection| Client {
                        pipeline: ctx.pipeline.clone(),
                        conn: Arc::new(conn_info(conn, &settings.load(), ctx.worker)),
                    },
                };
                Box::pin(http3::serve(inbox, Arc::new(listener), stop))
            });
        }
        let (made, settings, stop) = (endpoint.clone(), settings.clone(), stop.clone());
        self.spawn_on_worker(0, move |_| {
            Box::pin(async move {
                let current = settings.load_full();
                let name = current.spec.name.clone();
                let made_with = |config| {
                    let runtime = Arc::new(quinn::TokioRuntime);
                    quinn::Endpoint::new(Default::default(), Some(config), socket, runtime)
                        .map_err(|e| e.to_string())
                };
                let endpoint = match quic_config(&current).and_then(made_with) {
                    Ok(endpoint) => endpoint,
                    Err(e) => {
                        tracing::error!(listener = %name, error = %e, "cannot serve HTTP/3");
                        return;
                    }
                };
                let _ = made.set(endpoint.clone());
                // A reload between the settings read above and now found
                // no endpoint to give its settings to.
                let now = settings.load_full();
                if !Arc::ptr_eq(&now, &current) {
                    reconfigure(&made, &now);
                }
                let slots = move || settings.load().limit.clone();
                http3::accept(endpoint, slots, to_workers, stop).await;
            })
        });
        endpoint
    }
}

/// What the requests of an HTTP/3 connection are told of it.
fn conn_info(conn: &quinn::Connection, settings: &ListenerSettings, worker: usize) -> ConnInfo {
    let client = conn.remote_address();
    let sni = conn
        .handshake_data()
        .and_then(|d| d.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
        .and_then(|d| d.server_name)
        .map(Arc::from);
    let client_cert = conn
        .peer_identity()
        .and_then(|p| {
            p.downcast::<Vec<rustls_pki_types::CertificateDer<'static>>>()
                .ok()
        })
        .and_then(|chain| {
            let leaf = chain.first()?;
            Some(Arc::new(
                portcullis_net::client_cert::ClientCertificate::of(leaf),
            ))
        });
    ConnInfo {
        client,
        client_ip: portcullis_forward::client_ip_header(client.ip()),
        listener: settings.spec.clone(),
        tls: true,
        // QUIC has no other.
        tls_version: Some(portcullis_net::tls_listen::version_name(
            rustls::ProtocolVersion::TLSv1_3,
        )),
        sni,
        client_cert,
        worker,
        socket: None,
        // Already on HTTP/3.
        alt_svc: None,
    }
}

/// One HTTP/3 connection's requests, each through the pipeline current at
/// its arrival.
struct Client {
    pipeline: Arc<ArcSwap<Pipeline>>,
    conn: Arc<ConnInfo>,
}

impl http3::Respond for Client {
    fn respond(
        &self,
        req: Request<portcullis_forward::Body>,
    ) -> impl Future<Output = hyper::Response<portcullis_forward::ResponseBody>> + Send {
        let pipeline = crate::pipeline::current(&self.pipeline);
        let conn = self.conn.clone();
        async move {
            let _waiting = portcullis_net::worker_idle::Busy::new();
            pipeline.handle(req, &conn).await
        }
    }
}
