//! An HTTP/3 request's body, read from its QUIC stream as the upstream
//! side reads it (backpressure by QUIC's flow control).

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::{Buf, Bytes};
use http_body::Frame;

use super::FIRST_REQUEST_TIMEOUT;
use portcullis_forward::{Body, BodyError};

type RecvStream = h3::server::RequestStream<h3_quinn::RecvStream, Bytes>;

/// A request's body. HTTP/3 has no END_STREAM flag on the head: a
/// bodiless request is one whose stream ends after it, which h3 tells
/// only when the body is read. A request that usually has no body (no
/// `Content-Length`, or 0, and a method such as GET) is therefore read
/// up to its first frame before it goes on: when that is the end, it is
/// sent as bodiless, and so whole in hand and idempotent as over HTTP/1.1
/// and HTTP/2 — a GET on a pooled upstream connection that closed goes
/// again on a new one instead of failing with a 502. Other bodies
/// stream, with their declared length as their size.
pub(super) async fn request_body(head: &http::request::Parts, mut recv: RecvStream) -> Body {
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
