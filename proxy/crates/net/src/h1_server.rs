//! The routing core's own HTTP/1.1 server connection (#66, step 3; not
//! serving yet): requests read with [`h1_request`](crate::h1_request),
//! answers written with [`h1_response`](crate::h1_response), one after
//! another on a keep-alive connection, pipelined requests read as they
//! come. It serves the requests that make up nearly all of a proxy's
//! traffic, those without a body, and hands the connection over whole
//! (the socket, and every byte read of it, the request's head first) at
//! the first request it leaves to hyper: one with a body, `Expect:
//! 100-continue`, an upgrade, `CONNECT`. A head it cannot read is
//! answered as RFC 9112 asks (400, 431, 501) and the connection closed.
//!
//! While a request is served the socket is still read: pipelined
//! requests wait in the buffer, and a client that closes its side has its
//! request dropped (as hyper's server does), which the proxy counts as a
//! 499.

use std::future::Future;
use std::pin::pin;
use std::task::Poll;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::header;
use http::{Method, Request, Response, StatusCode, Uri, Version};
use http_body::Body;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::field_names::FieldNames;
use crate::h1_request::{self, BodyLength, MAX_HEAD, Refused, RequestHead};
use crate::h1_response::{self, Asked, BodySize, Framing, LAST_CHUNK};

/// What answers a connection's requests.
pub trait Respond {
    type Body: Body<Data = Bytes>;
    /// The answer to one request (which has no body).
    fn respond(&self, req: Request<()>) -> impl Future<Output = Response<Self::Body>>;
}

/// A connection's time limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// How long a request head may take once its first byte is in.
    pub head: Duration,
    /// How long the connection may wait idle for its next request.
    pub idle: Duration,
}

/// How a connection's service ended.
#[derive(Debug)]
pub enum Ended<I> {
    /// The connection is over: either side closed it, an answer ended
    /// it, it idled out or was stopped.
    Closed,
    /// A head that could not be read, answered with its status; closed.
    Refused(Refused),
    /// A request left to another server: the socket, and what was read
    /// of it (the request's head first).
    Handover(I, BytesMut),
}

/// Why a request goes to another server.
fn handed_over(head: &RequestHead) -> bool {
    head.body != BodyLength::Empty
        || head.expects_continue
        || head.method == Method::CONNECT
        || head.headers.contains_key(header::UPGRADE)
}

/// Serves HTTP/1.1 on `io` (`buf`: bytes already read of it) with
/// `respond`, until the connection ends or is handed over; `stop` ends it
/// after the answer in progress.
pub async fn serve<I, R>(
    mut io: I,
    mut buf: BytesMut,
    respond: &R,
    limits: Limits,
    stop: &CancellationToken,
) -> std::io::Result<Ended<I>>
where
    I: AsyncRead + AsyncWrite + Unpin,
    R: Respond,
    <R::Body as Body>::Error: std::fmt::Display,
{
    let mut names = FieldNames::default();
    let mut out = Vec::with_capacity(4096);
    loop {
        let head = match next_head(&mut io, &mut buf, &mut names, limits, stop).await? {
            Next::Head(head) => head,
            Next::Closed => return Ok(Ended::Closed),
            Next::Refused(refused) => {
                answer_refusal(&mut io, &mut out, refused.status).await?;
                return Ok(Ended::Refused(refused));
            }
        };
        if handed_over(&head) {
            let mut read = BytesMut::with_capacity(head.raw.len() + buf.len());
            read.extend_from_slice(&head.raw);
            read.extend_from_slice(&buf);
            return Ok(Ended::Handover(io, read));
        }
        let Ok(uri) = Uri::from_maybe_shared(head.target.clone()) else {
            let refused = Refused {
                status: StatusCode::BAD_REQUEST,
                why: "invalid request target",
            };
            answer_refusal(&mut io, &mut out, refused.status).await?;
            return Ok(Ended::Refused(refused));
        };
        let (method, version, close) = (head.method.clone(), head.version, head.close);
        let mut req = Request::new(());
        *req.method_mut() = head.method;
        *req.uri_mut() = uri;
        *req.version_mut() = head.version;
        *req.headers_mut() = head.headers;
        // Pinned where it is made: passed on by value, the answer's future
        // (~5 KiB for the proxy's pipeline) was copied whole, ~600
        // instructions a request (bench/versus-nginx.sh, wired in a trial).
        let answer = pin!(respond.respond(req));
        let Some(resp) = answered(&mut io, &mut buf, answer).await else {
            return Ok(Ended::Closed);
        };
        let keep_alive = !close && !stop.is_cancelled();
        let asked = Asked {
            method: &method,
            version,
            keep_alive,
        };
        if !write_answer(&mut io, &mut out, resp, asked).await? {
            let _ = io.shutdown().await;
            return Ok(Ended::Closed);
        }
    }
}

enum Next {
    Head(RequestHead),
    Closed,
    Refused(Refused),
}

/// The next request head: read until it is all there, within the
/// connection's idle limit for its first byte and the head limit after.
async fn next_head<I: AsyncRead + Unpin>(
    io: &mut I,
    buf: &mut BytesMut,
    names: &mut FieldNames,
    limits: Limits,
    stop: &CancellationToken,
) -> std::io::Result<Next> {
    loop {
        match h1_request::take_head(buf, names) {
            Ok(Some(head)) => return Ok(Next::Head(head)),
            Err(refused) => return Ok(Next::Refused(refused)),
            Ok(None) => {}
        }
        let limit = match buf.is_empty() {
            true => limits.idle,
            false => limits.head,
        };
        buf.reserve(8192);
        let read = tokio::select! {
            read = tokio::time::timeout(limit, io.read_buf(buf)) => read,
            // Stopping: an idle connection closes now; one with a head
            // coming gets to finish it.
            _ = stop.cancelled(), if buf.is_empty() => return Ok(Next::Closed),
        };
        match read {
            Ok(Ok(0)) | Err(_) => return Ok(Next::Closed),
            Ok(Ok(_)) => {}
            Ok(Err(e)) if buf.is_empty() => return Err(e),
            Ok(Err(_)) => return Ok(Next::Closed),
        }
    }
}

/// `answer`'s outcome, reading on meanwhile (pipelined requests are kept
/// in `buf`, up to a head's limit): `None` once the client has closed,
/// its request dropped.
async fn answered<I, F>(
    io: &mut I,
    buf: &mut BytesMut,
    mut answer: std::pin::Pin<&mut F>,
) -> Option<F::Output>
where
    I: AsyncRead + Unpin,
    F: Future,
{
    loop {
        if buf.len() >= MAX_HEAD {
            return Some(answer.await);
        }
        buf.reserve(4096);
        tokio::select! {
            biased;
            out = &mut answer => return Some(out),
            read = io.read_buf(buf) => match read {
                Ok(0) | Err(_) => return None,
                Ok(_) => {}
            },
        }
    }
}

/// Answers a head that could not be read with `status`, closing.
async fn answer_refusal<I: AsyncWrite + Unpin>(
    io: &mut I,
    out: &mut Vec<u8>,
    status: StatusCode,
) -> std::io::Result<()> {
    out.clear();
    let asked = Asked {
        method: &Method::GET,
        version: Version::HTTP_11,
        keep_alive: false,
    };
    let headers = http::HeaderMap::new();
    h1_response::encode_head(out, status, &headers, BodySize::None, asked)
        .expect("a refusal's head is writable");
    io.write_all(out).await?;
    io.shutdown().await
}

/// Writes `resp` to the request `asked`: whether the connection goes on.
async fn write_answer<I, B>(
    io: &mut I,
    out: &mut Vec<u8>,
    resp: Response<B>,
    asked: Asked<'_>,
) -> std::io::Result<bool>
where
    I: AsyncWrite + Unpin,
    B: Body<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    let (parts, body) = resp.into_parts();
    let size = match (body.is_end_stream(), body.size_hint().exact()) {
        (true, _) => BodySize::None,
        (false, Some(n)) => BodySize::Known(n),
        (false, None) => BodySize::Unknown,
    };
    out.clear();
    let encoded = match h1_response::encode_head(out, parts.status, &parts.headers, size, asked) {
        Ok(encoded) => encoded,
        Err(e) => {
            // As hyper does with an answer it cannot write: a 500, closed.
            tracing::warn!(error = %e, "answer not writable; 500 sent instead");
            out.clear();
            let closing = Asked {
                keep_alive: false,
                ..asked
            };
            let none = http::HeaderMap::new();
            let status = StatusCode::INTERNAL_SERVER_ERROR;
            h1_response::encode_head(out, status, &none, BodySize::None, closing)
                .expect("a 500's head is writable");
            io.write_all(out).await?;
            return Ok(false);
        }
    };
    let whole = match encoded.framing {
        Framing::Length(0) => {
            io.write_all(out).await?;
            true
        }
        framing => write_body(io, out, body, framing).await?,
    };
    Ok(whole && !encoded.close)
}

/// Writes the head in `out` and the body after it, framed as `framing`
/// says; pieces at hand go out with the head in one write. Whether the
/// body went whole (a body that failed or broke its length ends the
/// connection: the client cannot tell where the answer ends).
async fn write_body<I, B>(
    io: &mut I,
    out: &mut Vec<u8>,
    body: B,
    framing: Framing,
) -> std::io::Result<bool>
where
    I: AsyncWrite + Unpin,
    B: Body<Data = Bytes>,
    B::Error: std::fmt::Display,
{
    let mut body = pin!(body);
    let mut sent = 0u64;
    loop {
        let frame = match std::future::poll_fn(|cx| Poll::Ready(body.as_mut().poll_frame(cx))).await
        {
            Poll::Ready(frame) => frame,
            Poll::Pending => {
                // Nothing more at hand: what is ready goes now.
                io.write_all(out).await?;
                out.clear();
                std::future::poll_fn(|cx| body.as_mut().poll_frame(cx)).await
            }
        };
        match frame {
            None => break,
            Some(Err(e)) => {
                tracing::debug!(error = %e, "answer body failed; connection closed");
                io.write_all(out).await?;
                return Ok(false);
            }
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => {
                    sent += data.len() as u64;
                    if let Framing::Length(n) = framing
                        && sent > n
                    {
                        tracing::debug!(length = n, "answer body longer than its length; cut");
                        io.write_all(out).await?;
                        return Ok(false);
                    }
                    if data.is_empty() {
                        continue;
                    }
                    if framing == Framing::Chunked {
                        let (line, len) = h1_response::chunk_size(data.len());
                        out.extend_from_slice(&line[..len]);
                        out.extend_from_slice(&data);
                        out.extend_from_slice(b"\r\n");
                    } else {
                        out.extend_from_slice(&data);
                    }
                }
                Err(frame) => {
                    if let (Framing::Chunked, Ok(trailers)) = (framing, frame.into_trailers()) {
                        h1_response::encode_trailers(out, &trailers);
                        io.write_all(out).await?;
                        out.clear();
                        return Ok(true);
                    }
                }
            },
        }
    }
    let whole = match framing {
        Framing::Chunked => {
            out.extend_from_slice(LAST_CHUNK);
            true
        }
        Framing::Length(n) => sent == n,
        Framing::CloseDelimited => false,
    };
    io.write_all(out).await?;
    out.clear();
    Ok(whole)
}

#[cfg(test)]
mod tests;
