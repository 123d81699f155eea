//! HTTP/3 serving, one copy for every QUIC listener: the routing core's
//! HTTPS listeners with `http3` (`crate::server`) and the tunnel server's
//! public side (`--http3`). An endpoint's accept loop hands each new
//! connection to a worker in turn ([`accept`]); the worker runs its
//! requests ([`serve`]), each through what the listener does with a
//! request ([`Respond`]): the phase driver, as for HTTP/1.1 and HTTP/2.
//! Only the framing to the client differs.
//!
//! Here: connections and requests; `body.rs` a request's body, read from
//! its QUIC stream.

mod body;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use http_body::Frame;
use http_body_util::BodyExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use portcullis_forward::{Body, ResponseBody};

/// Time a new connection has for its handshake and then again for its
/// first request, as a TCP connection has for its first head: one that
/// says nothing holds a slot under the cap no longer.
pub const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The ALPN protocol of HTTP/3 (RFC 9114).
pub const ALPN: &[u8] = b"h3";

/// A connection an endpoint accepted, with its slot under the listener's
/// connection cap, on its way to the worker that serves it.
pub type Handed = (quinn::Incoming, OwnedSemaphorePermit);

/// What a listener does with each request of one HTTP/3 connection.
pub trait Respond: Send + Sync + 'static {
    /// The answer to `req`; never fails (a problem is an HTTP answer).
    fn respond(&self, req: Request<Body>) -> impl Future<Output = Response<ResponseBody>> + Send;
}

/// What one kind of listener serves HTTP/3 with.
pub struct Listener<F> {
    /// Its name in the connection metrics.
    pub name: Arc<str>,
    /// The largest request head accepted (QPACK's field section size).
    pub max_head: u64,
    /// Makes what answers a connection's requests, once its handshake is
    /// done (its peer address and what the handshake told are known).
    pub responder: F,
}

/// Accepts connections on `endpoint` until `stop` and hands them to
/// `workers` in turn, as the TCP side spreads its connections: served all
/// on the thread that drives the endpoint, every HTTP/3 request would
/// share one core. `slots` gives the listener's connection cap at each
/// accept (a reload may change it); a connection past it is refused.
pub async fn accept(
    endpoint: quinn::Endpoint,
    slots: impl Fn() -> Arc<Semaphore>,
    workers: Vec<mpsc::UnboundedSender<Handed>>,
    stop: CancellationToken,
) {
    let mut next = 0;
    loop {
        let incoming = tokio::select! {
            incoming = endpoint.accept() => incoming,
            _ = stop.cancelled() => break,
        };
        let Some(incoming) = incoming else { break };
        let Ok(permit) = slots().try_acquire_owned() else {
            incoming.refuse();
            continue;
        };
        // A worker that has stopped drops it: the client retries.
        let _ = workers[next % workers.len()].send((incoming, permit));
        next += 1;
    }
    // New connections are refused from now on; those open finish their
    // requests (their workers send GOAWAY).
    endpoint.set_server_config(None);
}

/// Serves the connections handed to this worker until `stop`, then tells
/// each to go away (GOAWAY) and waits for their requests to finish.
pub async fn serve<R, F>(
    mut handed: mpsc::UnboundedReceiver<Handed>,
    listener: Arc<Listener<F>>,
    stop: CancellationToken,
) where
    R: Respond,
    F: Fn(&quinn::Connection) -> R + Send + Sync + 'static,
{
    let connections = TaskTracker::new();
    loop {
        let (incoming, permit) = tokio::select! {
            next = handed.recv() => match next {
                Some(next) => next,
                None => break,
            },
            _ = stop.cancelled() => break,
        };
        let (listener, stop) = (listener.clone(), stop.clone());
        connections.spawn(async move {
            connection(incoming, &listener, stop).await;
            drop(permit);
        });
    }
    connections.close();
    connections.wait().await;
}

/// One QUIC connection: its handshake, then its requests, each in a task
/// of its own.
async fn connection<R, F>(
    incoming: quinn::Incoming,
    listener: &Listener<F>,
    stop: CancellationToken,
) where
    R: Respond,
    F: Fn(&quinn::Connection) -> R,
{
    let peer = incoming.remote_address();
    let name = &*listener.name;
    let conn = match tokio::time::timeout(FIRST_REQUEST_TIMEOUT, incoming).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => {
            portcullis_obs::metrics::count_connection_error(name, "quic_handshake");
            tracing::debug!(listener = name, peer = %peer, error = %e, "QUIC handshake failed");
            return;
        }
        Err(_) => {
            portcullis_obs::metrics::connection_timed_out(name);
            return;
        }
    };
    let responder = Arc::new((listener.responder)(&conn));
    let h3 = h3::server::builder()
        .max_field_section_size(listener.max_head)
        .build(h3_quinn::Connection::new(conn))
        .await;
    let mut h3: h3::server::Connection<h3_quinn::Connection, Bytes> = match h3 {
        Ok(h3) => h3,
        Err(e) => {
            tracing::debug!(listener = name, peer = %peer, error = %e, "HTTP/3 connection setup failed");
            return;
        }
    };
    // This connection's requests: dropping `h3` closes the connection, so
    // it is kept until they are done.
    let requests = TaskTracker::new();
    // Cancelled when the connection is lost or closed under its requests.
    let gone = CancellationToken::new();
    let mut first = Some(tokio::time::Instant::now() + FIRST_REQUEST_TIMEOUT);
    loop {
        let next = tokio::select! {
            next = h3.accept() => next,
            _ = tokio::time::sleep_until(first.unwrap_or_else(tokio::time::Instant::now)), if first.is_some() => {
                portcullis_obs::metrics::connection_timed_out(name);
                tracing::debug!(listener = name, peer = %peer, "no HTTP/3 request within 10s; closed");
                return;
            }
            _ = stop.cancelled() => {
                // The client is told not to start more requests here (it
                // retries them on a new connection); those accepted finish.
                let _ = h3.shutdown(0).await;
                break;
            }
        };
        match next {
            Ok(Some(resolver)) => {
                first = None;
                let answer = request(resolver, peer, responder.clone(), gone.clone());
                requests.spawn(answer);
            }
            // A GOAWAY: the requests already sent are still answered.
            Ok(None) => break,
            Err(e) => {
                // Nothing can be answered on a connection that is gone:
                // requests still waiting stop, and with them their
                // upstream exchanges, as when an HTTP/1.1 or HTTP/2 client
                // leaves.
                gone.cancel();
                if !e.is_h3_no_error() {
                    tracing::debug!(listener = name, peer = %peer, error = %e, "HTTP/3 connection ended");
                }
                break;
            }
        }
    }
    requests.close();
    requests.wait().await;
}

type Resolver = h3::server::RequestResolver<h3_quinn::Connection, Bytes>;

/// One HTTP/3 request, answered unless its connection is `gone` first.
async fn request<R: Respond>(
    resolver: Resolver,
    peer: SocketAddr,
    responder: Arc<R>,
    gone: CancellationToken,
) {
    let (req, stream) = match resolver.resolve_request().await {
        Ok(pair) => pair,
        Err(e) => {
            tracing::debug!(peer = %peer, error = %e, "bad HTTP/3 request head");
            return;
        }
    };
    let (mut send, recv) = stream.split();
    let (parts, ()) = req.into_parts();
    let body = tokio::select! {
        body = body::request_body(&parts, recv) => body,
        _ = gone.cancelled() => return,
    };
    let req = Request::from_parts(parts, body);
    let resp = tokio::select! {
        resp = responder.respond(req) => resp,
        _ = gone.cancelled() => return,
    };
    let (parts, body) = resp.into_parts();
    if send
        .send_response(Response::from_parts(parts, ()))
        .await
        .is_err()
    {
        return;
    }
    // The body's access line and metrics are written when it is dropped,
    // at the end of this function, however the stream ends.
    let mut body = std::pin::pin!(body);
    while let Some(frame) = body.as_mut().frame().await {
        let sent = match frame.map(Frame::into_data) {
            Ok(Ok(data)) => send.send_data(data).await,
            Ok(Err(frame)) => match frame.into_trailers() {
                Ok(trailers) => send.send_trailers(trailers).await,
                Err(_) => Ok(()),
            },
            Err(e) => {
                tracing::debug!(peer = %peer, error = %e, "response body failed; HTTP/3 stream reset");
                send.stop_stream(h3::error::Code::H3_INTERNAL_ERROR);
                return;
            }
        };
        if sent.is_err() {
            return;
        }
    }
    let _ = send.finish().await;
}

/// The QUIC side of a listener's TLS settings: TLS 1.3 (QUIC has no
/// other) with ALPN `h3`; idle connections close after `idle`.
pub fn server_config(
    tls: rustls::ServerConfig,
    idle: Duration,
    transport: impl FnOnce(&mut quinn::TransportConfig),
) -> Result<quinn::ServerConfig, String> {
    let mut tls = tls;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    // No 0-RTT: early data can be replayed, and the routing core cannot
    // tell a route's requests apart as safe to replay.
    tls.max_early_data_size = 0;
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls)
        .map_err(|e| format!("QUIC needs TLS 1.3: {e}"))?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    let mut t = quinn::TransportConfig::default();
    t.max_idle_timeout(idle.try_into().ok());
    transport(&mut t);
    config.transport_config(Arc::new(t));
    Ok(config)
}
