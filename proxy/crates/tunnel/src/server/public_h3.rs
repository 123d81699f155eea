//! HTTP/3 on the tunnel server's public side (`--http3`): QUIC on the
//! public port's UDP twin, with the HTTPS certificate, advertised to
//! HTTPS clients by `Alt-Svc`. Each request goes through the same
//! [`super`] forwarding as HTTP/1.1 and HTTP/2 (an HTTP/2 stream
//! in the runtime's tunnel); only the framing to the client differs.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Buf, Bytes};
use http_body::Frame;
use http_body_util::BodyExt;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use portcullis_http::body::{Body, BodyError};

/// Time a new connection has for its handshake and then again for its
/// first request, as a TCP connection has for its first head: one that
/// says nothing holds a slot under the cap no longer.
const FIRST_REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

type RecvStream = h3::server::RequestStream<h3_quinn::RecvStream, Bytes>;
type Resolver = h3::server::RequestResolver<h3_quinn::Connection, Bytes>;

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
    crate::quic::server_config(cert, key, b"h3", transport)
}

/// A connection the public endpoint accepted, with its slot under the
/// public connection cap, on its way to the worker that serves it.
pub(super) type Handed = (quinn::Incoming, tokio::sync::OwnedSemaphorePermit);

/// Accepts HTTP/3 connections on `socket` until `stop` and hands them to
/// `workers` in turn, as the TCP side spreads its connections: served
/// all on the thread that drives the endpoint (the first worker), every
/// public HTTP/3 request would share one core.
pub(super) async fn accept(
    socket: std::net::UdpSocket,
    config: quinn::ServerConfig,
    slots: Arc<tokio::sync::Semaphore>,
    workers: Vec<tokio::sync::mpsc::UnboundedSender<Handed>>,
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
    let mut next = 0;
    loop {
        let incoming = tokio::select! {
            incoming = endpoint.accept() => incoming,
            _ = stop.cancelled() => break,
        };
        let Some(incoming) = incoming else { break };
        // One slot under the public connection cap, as a TCP connection.
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            incoming.refuse();
            continue;
        };
        // A worker that has stopped drops it: the client retries.
        let _ = workers[next % workers.len()].send((incoming, permit));
        next += 1;
    }
}

/// Serves the HTTP/3 connections handed to this worker until `stop`, then
/// tells each to go away (GOAWAY) and lets its requests finish.
pub(super) async fn serve(
    mut handed: tokio::sync::mpsc::UnboundedReceiver<Handed>,
    public: super::public::Public,
    tracker: TaskTracker,
    stop: CancellationToken,
) {
    loop {
        let (incoming, permit) = tokio::select! {
            next = handed.recv() => match next {
                Some(next) => next,
                None => break,
            },
            _ = stop.cancelled() => break,
        };
        let (public, tracker_, stop) = (public.clone(), tracker.clone(), stop.clone());
        tracker.spawn(async move {
            connection(incoming, public, tracker_, stop).await;
            drop(permit);
        });
    }
}

/// One QUIC connection: its handshake, then its requests, each in a task
/// of its own.
async fn connection(
    incoming: quinn::Incoming,
    public: super::public::Public,
    tracker: TaskTracker,
    stop: CancellationToken,
) {
    let peer = incoming.remote_address();
    let conn = match tokio::time::timeout(FIRST_REQUEST_TIMEOUT, incoming).await {
        Ok(Ok(conn)) => conn,
        Ok(Err(e)) => {
            portcullis_obs::metrics::count_connection_error("public", "quic_handshake");
            tracing::debug!(peer = %peer, error = %e, "public QUIC handshake failed");
            return;
        }
        Err(_) => {
            portcullis_obs::metrics::connection_timed_out("public");
            return;
        }
    };
    let h3 = h3::server::builder()
        .max_field_section_size(u64::from(crate::MAX_PUBLIC_HEAD))
        .build(h3_quinn::Connection::new(conn))
        .await;
    let mut h3: h3::server::Connection<h3_quinn::Connection, Bytes> = match h3 {
        Ok(h3) => h3,
        Err(e) => {
            tracing::debug!(peer = %peer, error = %e, "HTTP/3 connection setup failed");
            return;
        }
    };
    // This connection's requests: dropping `h3` closes the connection, so
    // at shutdown it is kept until they are done.
    let requests = TaskTracker::new();
    // Cancelled when the connection is lost or closed under its requests.
    let gone = CancellationToken::new();
    let mut first = Some(tokio::time::Instant::now() + FIRST_REQUEST_TIMEOUT);
    loop {
        let next = tokio::select! {
            next = h3.accept() => next,
            _ = tokio::time::sleep_until(first.unwrap_or_else(tokio::time::Instant::now)), if first.is_some() => {
                portcullis_obs::metrics::connection_timed_out("public");
                tracing::debug!(peer = %peer, "no HTTP/3 request within 10s; closed");
                return;
            }
            _ = stop.cancelled() => {
                // The client is told not to start more requests here (it
                // retries them on a new connection); those accepted finish.
                let _ = h3.shutdown(0).await;
                requests.close();
                requests.wait().await;
                return;
            }
        };
        match next {
            Ok(Some(resolver)) => {
                first = None;
                let answer = request(resolver, peer, public.clone(), gone.clone());
                tracker.spawn(requests.track_future(answer));
            }
            // A GOAWAY: the requests already sent are still answered.
            Ok(None) => return,
            Err(e) => {
                // Nothing can be answered on a connection that is gone:
                // requests still waiting stop, and with them their tunnel
                // streams and the runtime's work, as when an HTTP/1.1 or
                // HTTP/2 client leaves.
                gone.cancel();
                if !e.is_h3_no_error() {
                    tracing::debug!(peer = %peer, error = %e, "HTTP/3 connection ended");
                }
                return;
            }
        }
    }
}

/// One HTTP/3 request, answered through the runtime's tunnel unless its
/// connection is `gone` first.
async fn request(
    resolver: Resolver,
    peer: SocketAddr,
    public: super::public::Public,
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
        body = request_body(&parts, recv) => body,
        _ = gone.cancelled() => return,
    };
    let req = http::Request::from_parts(parts, body);
    // QUIC is TLS 1.3 only.
    let resp = tokio::select! {
        resp = public.respond(req, peer, Some(rustls::ProtocolVersion::TLSv1_3)) => resp,
        _ = gone.cancelled() => return,
    };
    let (parts, body) = resp.into_parts();
    if send
        .send_response(http::Response::from_parts(parts, ()))
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

/// A request's body. HTTP/3 has no END_STREAM flag on the head: a
/// bodiless request is one whose stream ends after it, which h3 tells
/// only when the body is read. A request that usually has no body (no
/// `Content-Length`, or 0, and a method such as GET) is therefore read
/// up to its first frame before it goes on: when that is the end, it is
/// sent as bodiless, and so whole in hand and idempotent as over HTTP/1.1
/// and HTTP/2 — a GET on a pooled upstream connection that closed goes
/// again on a new one instead of failing with a 502. Other bodies
/// stream, with their declared length as their size.
async fn request_body(head: &http::request::Parts, mut recv: RecvStream) -> Body {
    use http::Method;
    let declared = head
        .headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    let usually_bodiless = matches!(
        head.method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::DELETE | Method::TRACE
    );
    let look = declared == Some(0) || (declared.is_none() && usually_bodiless);
    if !look {
        return Body::boxed(RequestBody::new(recv, declared));
    }
    // A client that sends neither body nor end keeps the stream open; as
    // long as a connection may wait for its first request, and then the
    // body streams as any other.
    let first = tokio::time::timeout(FIRST_REQUEST_TIMEOUT, recv.recv_data()).await;
    let mut ahead = match first {
        Ok(Ok(Some(mut data))) => Ahead::Data(data.copy_to_bytes(data.remaining())),
        // Trailers, if any, came before the end: no wait.
        Ok(Ok(None)) => match recv.recv_trailers().await {
            Ok(None) => return Body::empty(),
            Ok(Some(trailers)) => Ahead::Trailers(trailers),
            Err(e) => Ahead::Failed(e.into()),
        },
        Ok(Err(e)) => Ahead::Failed(e.into()),
        Err(_) => Ahead::Nothing,
    };
    let mut body = RequestBody::new(recv, declared);
    std::mem::swap(&mut body.ahead, &mut ahead);
    Body::boxed(body)
}

/// What [`request_body`] read of a body before it went on, handed out
/// first.
enum Ahead {
    Nothing,
    Data(Bytes),
    Trailers(http::HeaderMap),
    Failed(BodyError),
}

/// An HTTP/3 request body, read from its QUIC stream as the upstream
/// side reads it (backpressure by QUIC's flow control).
struct RequestBody {
    recv: RecvStream,
    ahead: Ahead,
    /// The declared `Content-Length`.
    size: Option<u64>,
    data_done: bool,
    done: bool,
}

impl RequestBody {
    fn new(recv: RecvStream, size: Option<u64>) -> RequestBody {
        RequestBody {
            recv,
            ahead: Ahead::Nothing,
            size,
            data_done: false,
            done: false,
        }
    }
}

impl http_body::Body for RequestBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        if this.done {
            return Poll::Ready(None);
        }
        match std::mem::replace(&mut this.ahead, Ahead::Nothing) {
            Ahead::Nothing => {}
            Ahead::Data(data) => return Poll::Ready(Some(Ok(Frame::data(data)))),
            Ahead::Trailers(trailers) => {
                this.done = true;
                return Poll::Ready(Some(Ok(Frame::trailers(trailers))));
            }
            Ahead::Failed(e) => {
                this.done = true;
                return Poll::Ready(Some(Err(e)));
            }
        }
        if !this.data_done {
            match ready!(this.recv.poll_recv_data(cx)) {
                Ok(Some(mut data)) => {
                    return Poll::Ready(Some(Ok(Frame::data(
                        data.copy_to_bytes(data.remaining()),
                    ))));
                }
                Ok(None) => this.data_done = true,
                Err(e) => {
                    this.done = true;
                    return Poll::Ready(Some(Err(e.into())));
                }
            }
        }
        let trailers = ready!(this.recv.poll_recv_trailers(cx));
        this.done = true;
        Poll::Ready(match trailers {
            Ok(Some(trailers)) => Some(Ok(Frame::trailers(trailers))),
            Ok(None) => None,
            Err(e) => Some(Err(e.into())),
        })
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match self.size {
            Some(n) => http_body::SizeHint::with_exact(n),
            None => http_body::SizeHint::default(),
        }
    }
}
