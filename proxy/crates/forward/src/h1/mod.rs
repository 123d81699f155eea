//! HTTP/1.1 to an upstream within the request's own task, for requests
//! whose body (if any) is already in hand: most proxied traffic (GETs,
//! probes, SSE subscriptions, small JSON posts).
//!
//! hyper's client runs each connection as a separate task: a request is
//! handed to it over a channel, the response head comes back over another,
//! and the body is fed through a third, each hand-off a task wake-up. For a
//! small request that is most of the proxy's user-space CPU (bench/core.sh).
//! Here the request's task writes the head, parses the response head, and
//! the response body reads the socket itself as the client side pulls it;
//! when the body ends the connection goes back to its pool slot.
//!
//! Streamed request bodies, upgrades and HTTP/2 still go through hyper,
//! which reads the response while the body is still being sent.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, Response, StatusCode, Version};
use http_body::{Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;
use tokio_rustls::client::TlsStream;

use portcullis_net::field_names::FieldNames;

mod caseless;
mod head;
// Public: the response head's reader, for its fuzz target (fuzz).
pub mod parse;
mod response_body;
// Public: where a request's kept head map comes back when it ends (http).
pub mod spare_maps;

pub use head::Framing;
use head::*;
use response_body::*;
pub use response_body::{BodyError, H1Body, Home};

/// Response heads larger than this are refused (nginx's default buffer for
/// them is 4–8 KiB; this leaves room for big cookies).
pub const MAX_HEAD: usize = 64 * 1024;
/// Most header fields in a response head (hyper's client, for streamed
/// requests, is given the same).
pub const MAX_HEADERS: usize = 128;
/// The first read of a response; body reads grow from here when they fill it.
const FIRST_READ: usize = 8 * 1024;
/// The largest header map (in entries) kept for reuse by a connection.
const SPARE_HEADERS: usize = 64;
/// Largest single body read.
const MAX_READ: usize = 256 * 1024;
/// Longest chunk-size or trailer line accepted.
const MAX_LINE: usize = 4 * 1024;

/// An upstream byte stream: plain TCP or TLS.
pub enum Io {
    /// Cleartext.
    Tcp(TcpStream),
    /// TLS (boxed: the session state is large).
    Tls(Box<TlsStream<TcpStream>>),
}

impl AsyncRead for Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    // hyper's client queues a streamed body's chunks behind the head and
    // writes them in one call (forward/pool.rs): both sockets gather.
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Io::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Io::Tcp(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Tcp(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Io::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

/// An upstream connection driven by the request's task.
pub struct H1Conn {
    io: Io,
    /// Bytes read and not yet used.
    buf: BytesMut,
    /// The request head being written (kept to reuse its allocation).
    head: Vec<u8>,
    /// The size of the next read.
    read_size: usize,
    /// An emptied header map to parse the next response head into. The
    /// request's map comes back here after its exchange, and hyper's server
    /// keeps each response's map for the connection's next request: the
    /// allocations go round instead of being made twice per request.
    spare: HeaderMap,
    /// The last response head's field names, for the next.
    names: FieldNames,
    /// Its age and use, for the pool's reuse limits.
    pub worn: super::worn::Worn,
}

/// Why an exchange failed.
#[derive(Debug)]
pub enum ExchangeError {
    /// The connection closed (or reset) before any byte of a response came
    /// back. On a reused connection the upstream most likely closed it
    /// while idle: an idempotent request may go again on a new one.
    Closed(String),
    /// Anything else; the request may have been processed.
    Failed(String),
    /// The try's deadline (`per_try_timeout`) passed before the response
    /// head came.
    RanOut,
}

impl H1Conn {
    /// A connection over `io`, with nothing buffered. Boxed once for its
    /// whole life: it moves between the pool and each response body, and
    /// inline it would make every body (and request future) much larger.
    pub fn new(io: Io) -> Box<H1Conn> {
        Box::new(H1Conn {
            io,
            buf: BytesMut::new(),
            head: Vec::new(),
            read_size: FIRST_READ,
            spare: HeaderMap::new(),
            names: FieldNames::default(),
            worn: super::worn::Worn::default(),
        })
    }

    /// Drops buffers grown for a large exchange, so an idle connection
    /// holds a few KiB, not what its biggest response needed.
    fn shrink(&mut self) {
        if self.buf.capacity() > 2 * FIRST_READ {
            self.buf = BytesMut::new();
        }
        if self.head.capacity() > 2 * FIRST_READ {
            self.head = Vec::new();
        }
        self.read_size = FIRST_READ;
    }

    /// Keeps a request's header map, emptied, for the next response head.
    /// A map grown for an unusual message is let go.
    pub fn recycle(&mut self, headers: &mut HeaderMap) {
        if headers.capacity() <= SPARE_HEADERS {
            headers.clear();
            // The spare left (empty, the last head's) goes back in its
            // place rather than being dropped here.
            std::mem::swap(&mut self.spare, headers);
        }
    }

    /// The stream, for a hand-over to hyper (only ever done while idle,
    /// when nothing is buffered).
    pub fn into_io(self) -> Io {
        self.io
    }

    /// Whether an idle connection can still carry a request: the upstream
    /// has neither closed it nor sent anything unasked. Costs no system
    /// call while the socket has not turned readable.
    pub fn is_reusable(&mut self) -> bool {
        if !self.buf.is_empty() {
            return false;
        }
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut probe = [0u8; 1];
        let mut rb = ReadBuf::new(&mut probe);
        // Pending: nothing to read, still open. Ready: EOF, an error, or
        // bytes nobody asked for; none leaves the connection usable.
        Pin::new(&mut self.io)
            .poll_read(&mut cx, &mut rb)
            .is_pending()
    }

    /// Reads more into `buf`; `Ok(0)` at end of stream.
    fn poll_fill(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        if self.buf.capacity() - self.buf.len() < self.read_size / 2 {
            self.buf.reserve(self.read_size);
        }
        let n = ready!(tokio_util::io::poll_read_buf(
            Pin::new(&mut self.io),
            cx,
            &mut self.buf
        ))?;
        // A read that filled what it was given suggests a fast stream:
        // read more at a time (as hyper's adaptive read buffer does).
        if n >= self.read_size && self.read_size < MAX_READ {
            self.read_size *= 2;
        }
        Poll::Ready(Ok(n))
    }

    /// Reads more of the response; `None` if `deadline` (the try's,
    /// when it has one) passes first.
    async fn fill(
        &mut self,
        deadline: &mut Option<&mut Pin<Box<Sleep>>>,
    ) -> Option<io::Result<usize>> {
        std::future::poll_fn(|cx| {
            if let Some(deadline) = deadline
                && deadline.as_mut().poll(cx).is_ready()
            {
                return Poll::Ready(None);
            }
            self.poll_fill(cx).map(Some)
        })
        .await
    }

    /// Sends a request (head and `body`, in one write) and reads the
    /// response head, unless `deadline` passes first. `host` is written
    /// first when given; `prefix` goes before `path` (an endpoint's base
    /// path). With the answer (its hop-by-hop fields removed): how its
    /// body is framed, and whether the connection may carry another
    /// request after it. The deadline is looked at here, between reads, rather than
    /// by a timeout around this future: a second way of awaiting it made
    /// the compiler stop inlining it into the request's, at ~250
    /// instructions a request.
    #[allow(clippy::too_many_arguments)]
    pub async fn exchange(
        &mut self,
        method: &Method,
        prefix: &str,
        path: &str,
        host: Option<&HeaderValue>,
        headers: (&HeaderMap, &crate::Forwarded),
        body: Option<&[u8]>,
        mut deadline: Option<&mut Pin<Box<Sleep>>>,
    ) -> Result<(Response<()>, Framing, bool), ExchangeError> {
        self.read_size = FIRST_READ;
        encode_head(&mut self.head, method, prefix, path, host, headers, body);
        if let Err(e) = self.io.write_all(&self.head).await {
            return Err(ExchangeError::Closed(format!("writing the request: {e}")));
        }
        let mut received = false;
        loop {
            if !self.buf.is_empty() {
                received = true;
                if let Some((mut resp, seen)) =
                    take_head(&mut self.buf, &mut self.spare, &mut self.names)?
                {
                    let status = resp.status();
                    // Interim answers (100 Continue, 103 Early Hints) come
                    // before the real one; the request went out whole, so
                    // they change nothing. 101 needs an upgrade, which goes
                    // by hyper.
                    if status.is_informational() {
                        if status == StatusCode::SWITCHING_PROTOCOLS {
                            return Err(ExchangeError::Failed(
                                "upstream switched protocols without being asked".into(),
                            ));
                        }
                        continue;
                    }
                    let framing = framing(method, &mut resp, seen)?;
                    // A chunked body already broken in what came with the
                    // head is a 502 while nothing has gone to the client;
                    // once streamed it could only be cut short, and the
                    // client would get no answer at all.
                    if framing == Framing::Chunked {
                        sound_chunks(&self.buf).map_err(|e| {
                            ExchangeError::Failed(format!("upstream response body: {e}"))
                        })?;
                    }
                    let keep_alive = keeps_alive(&resp, framing, seen);
                    // Framing and `Connection` read: the answer leaves
                    // without this hop's fields (the caller skips the pass
                    // for this reader's answers).
                    if seen.hop {
                        let _ = crate::headers::remove_hop_by_hop(resp.headers_mut(), false);
                    }
                    return Ok((resp, framing, keep_alive));
                }
                if self.buf.len() >= MAX_HEAD {
                    return Err(head_too_large());
                }
            }
            let Some(filled) = self.fill(&mut deadline).await else {
                return Err(ExchangeError::RanOut);
            };
            match filled {
                Ok(0) if !received => {
                    return Err(ExchangeError::Closed(
                        "connection closed before a response".into(),
                    ));
                }
                Ok(0) => {
                    return Err(ExchangeError::Failed(
                        "connection closed in the middle of the response head".into(),
                    ));
                }
                Ok(_) => {}
                Err(e) if !received => {
                    return Err(ExchangeError::Closed(format!("reading the response: {e}")));
                }
                Err(e) => {
                    return Err(ExchangeError::Failed(format!("reading the response: {e}")));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests;
