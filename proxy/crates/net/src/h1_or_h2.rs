//! HTTP/1.1 and cleartext HTTP/2 on one port: the first bytes of a
//! connection are compared with HTTP/2's connection preface, and the
//! connection is served by hyper's own HTTP/1 or HTTP/2 connection.
//!
//! hyper-util's `auto` builder does the same, but it does not pass on
//! hyper's `max_header_size`. Without that, the one bound on a request
//! head is hyper's HTTP/1 read buffer (`max_buf_size`). That buffer also
//! sets how much of a request body is read at once: kept small enough to
//! bound heads, it made uploads cost up to half again as much CPU (see
//! bench/HISTORY.md, "Large bodies"). With `max_header_size`, heads keep
//! their bound and the buffer is sized for bodies.
//!
//! An idle HTTP/1 connection is parked: once its socket asks (see
//! `head_deadline::Within::parking`), hyper's connection, which ended on
//! the end of stream the socket gave it, is dropped with its buffers; the
//! socket waits for its next bytes in the `Parked` state and a new hyper
//! connection serves them. nginx frees its buffers between requests the
//! same way: an idle connection costs ~4 KiB instead of ~26.

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use hyper::body::Incoming;
use hyper::server::conn::{http1, http2};
use hyper::service::HttpService;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// What opens every cleartext HTTP/2 connection (RFC 9113, 3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// A connection's error: hyper's, or the socket's while its first bytes
/// were read.
pub type ConnError = Box<dyn StdError + Send + Sync>;

/// How both protocols are served.
#[derive(Clone)]
pub struct Builder {
    /// HTTP/1.1 (and 1.0).
    pub http1: http1::Builder,
    /// Cleartext HTTP/2 (prior knowledge).
    pub http2: http2::Builder<TokioExecutor>,
    /// How long a parked HTTP/1 connection may stay idle (the keep-alive
    /// timeout less the idle time before it was parked); `None`: as long
    /// as the client keeps it.
    pub parked_for: Option<std::time::Duration>,
}

/// A socket whose HTTP/1 connection may be parked while idle: hyper
/// closes its side (dropping its buffers) and the socket is kept until
/// bytes arrive, then served by a new hyper connection. The socket says
/// when hyper's close was for parking (see `head_deadline::Within::parking`).
pub trait Park {
    /// True, once, when hyper closed the connection only to be parked.
    fn take_to_park(&self) -> bool;
    /// Bytes arrived on the parked connection: hyper serves it again.
    fn unpark(&self);
}

/// The error that ends a parked connection idle for longer than
/// [`Builder::parked_for`]: the keep-alive timeout.
#[derive(Debug)]
pub struct KeepAliveTimeout;

impl std::fmt::Display for KeepAliveTimeout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("idle keep-alive connection timed out")
    }
}

impl StdError for KeepAliveTimeout {}

impl Builder {
    /// Both protocols with hyper's defaults.
    pub fn new() -> Builder {
        Builder {
            http1: http1::Builder::new(),
            http2: http2::Builder::new(TokioExecutor::new()),
            parked_for: None,
        }
    }

    /// Serves `io` with `service` once its first bytes tell the protocol;
    /// HTTP/1 upgrades (WebSocket) are allowed.
    pub fn serve<I, S>(self: &Arc<Self>, io: I, service: S) -> Connection<I, S>
    where
        I: AsyncRead + AsyncWrite + Park + Unpin + Send + 'static,
        S: HttpService<Incoming>,
    {
        Connection {
            state: State::Sniffing {
                io: Some(io),
                sniffed: Sniffed::default(),
                builder: self.clone(),
                service: Some(service),
            },
        }
    }
}

impl Default for Builder {
    fn default() -> Builder {
        Builder::new()
    }
}

/// The first bytes read from a connection, to be read again by hyper.
#[derive(Default, Clone, Copy)]
struct Sniffed {
    bytes: [u8; PREFACE.len()],
    /// How many were read.
    len: u8,
    /// How many of those were handed on again.
    taken: u8,
}

impl Sniffed {
    fn left(&self) -> &[u8] {
        &self.bytes[self.taken as usize..self.len as usize]
    }
}

/// A socket whose first bytes, read to tell the protocol, are read again.
pub struct Rewind<I> {
    sniffed: Sniffed,
    io: I,
    /// An error met reading on past the sniffed bytes, for the next read.
    failed: Option<std::io::Error>,
}

impl<I> Rewind<I> {
    /// The socket.
    pub fn get_ref(&self) -> &I {
        &self.io
    }
}

impl<I: AsyncRead + Unpin> AsyncRead for Rewind<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        // Every read of the connection's life passes here: two byte
        // compares and a null check, the replay out of line.
        if self.sniffed.taken == self.sniffed.len && self.failed.is_none() {
            return Pin::new(&mut self.io).poll_read(cx, buf);
        }
        self.replay(cx, buf)
    }
}

impl<I: AsyncRead + Unpin> Rewind<I> {
    #[cold]
    fn replay(&mut self, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        if let Some(e) = self.failed.take() {
            return Poll::Ready(Err(e));
        }
        let left = self.sniffed.left();
        let n = left.len().min(buf.remaining());
        buf.put_slice(&left[..n]);
        self.sniffed.taken += n as u8;
        // Read on into the same buffer: handed only the sniffed bytes (at
        // most 24), hyper would find the head incomplete and, to read the
        // rest, grow its 8 KiB buffer to 16 KiB, kept for the connection's
        // life.
        if self.sniffed.left().is_empty() && buf.remaining() > 0 {
            let filled = buf.filled().len();
            if let Poll::Ready(Err(e)) = Pin::new(&mut self.io).poll_read(cx, buf) {
                debug_assert_eq!(buf.filled().len(), filled);
                self.failed = Some(e);
            }
        }
        Poll::Ready(Ok(()))
    }
}

impl<I: AsyncWrite + Unpin> AsyncWrite for Rewind<I> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

type Io<I> = TokioIo<Rewind<I>>;

pin_project_lite::pin_project! {
    /// A connection being served: a future that completes when it ends.
    pub struct Connection<I, S>
    where
        S: HttpService<Incoming>,
    {
        #[pin]
        state: State<I, S>,
    }
}

pin_project_lite::pin_project! {
    #[project = StateProj]
    enum State<I, S>
    where
        S: HttpService<Incoming>,
    {
        /// Reading the first bytes.
        Sniffing {
            io: Option<I>,
            sniffed: Sniffed,
            builder: Arc<Builder>,
            service: Option<S>,
        },
        // Boxed: a parked connection frees hyper's state with its buffers.
        H1 {
            conn: Option<Box<http1::UpgradeableConnection<Io<I>, S>>>,
            builder: Arc<Builder>,
        },
        H2 { #[pin] conn: http2::Connection<Io<I>, S, TokioExecutor> },
        /// An idle HTTP/1 connection kept without hyper: waiting for its
        /// next bytes, read into the rewind's few bytes.
        Parked {
            io: Option<Rewind<I>>,
            service: Option<S>,
            builder: Arc<Builder>,
            // Boxed: only parked connections have one.
            timeout: Option<Pin<Box<tokio::time::Sleep>>>,
            counted: ParkedCount,
        },
        /// Shut down before the protocol was known.
        Closed,
    }
}

impl<I, S, B> crate::drain::Graceful for Connection<I, S>
where
    I: AsyncRead + AsyncWrite + Park + Unpin + Send + 'static,
    S: HttpService<Incoming, ResBody = B>,
    S::Error: Into<ConnError>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<ConnError>,
    TokioExecutor: hyper::rt::bounds::Http2ServerConnExec<S::Future, B>,
{
    /// Finishes the requests in flight and closes: HTTP/1 once the current
    /// exchange is done, HTTP/2 with a GOAWAY; a connection still to send
    /// its first bytes closes at once.
    fn graceful_shutdown(self: Pin<&mut Self>) {
        let mut state = self.project().state;
        match state.as_mut().project() {
            StateProj::Sniffing { .. } | StateProj::Parked { .. } => state.set(State::Closed),
            StateProj::H1 { conn, .. } => {
                if let Some(conn) = conn {
                    Pin::new(&mut **conn).graceful_shutdown();
                }
            }
            StateProj::H2 { conn } => conn.graceful_shutdown(),
            StateProj::Closed => {}
        }
    }
}

impl<I, S, B> Future for Connection<I, S>
where
    I: AsyncRead + AsyncWrite + Park + Unpin + Send + 'static,
    S: HttpService<Incoming, ResBody = B>,
    S::Error: Into<ConnError>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<ConnError>,
    TokioExecutor: hyper::rt::bounds::Http2ServerConnExec<S::Future, B>,
{
    type Output = Result<(), ConnError>;

    // Every request of an HTTP/1 connection is polled from here, hyper's
    // dispatch and the service inlined: the rarer steps (a protocol
    // chosen, a connection parked or woken, HTTP/2) are functions of
    // their own, so that their temporaries (hyper's connection states,
    // several KiB) do not widen this frame. At 37 KiB it cost every poll
    // a probe of each of its pages (~100 instructions a request).
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut state = self.project().state;
        loop {
            match state.as_mut().project() {
                StateProj::Sniffing { io, sniffed, .. } => {
                    let h2 = ready!(sniff(io.as_mut().expect("until served"), sniffed, cx))?;
                    state.as_mut().serve_sniffed(h2);
                }
                StateProj::H1 { conn, .. } => {
                    let Some(served) = conn.as_mut() else {
                        return Poll::Ready(Ok(()));
                    };
                    ready!(Pin::new(&mut **served).poll(cx))?;
                    // Closed: for good, or to be parked.
                    if !state.as_mut().park() {
                        return Poll::Ready(Ok(()));
                    }
                }
                StateProj::Parked { io, timeout, .. } => {
                    if let Some(t) = timeout
                        && t.as_mut().poll(cx).is_ready()
                    {
                        return Poll::Ready(Err(Box::new(KeepAliveTimeout)));
                    }
                    let rewind = io.as_mut().expect("until served");
                    let mut buf = ReadBuf::new(&mut rewind.sniffed.bytes);
                    ready!(Pin::new(&mut rewind.io).poll_read(cx, &mut buf))?;
                    let n = buf.filled().len();
                    if n == 0 {
                        // The client closed its idle connection.
                        return Poll::Ready(Ok(()));
                    }
                    rewind.sniffed = Sniffed {
                        len: n as u8,
                        ..rewind.sniffed
                    };
                    rewind.io.unpark();
                    state.as_mut().unpark();
                }
                StateProj::H2 { conn } => return State::poll_h2(conn, cx),
                StateProj::Closed => return Poll::Ready(Ok(())),
            }
        }
    }
}

impl<I, S, B> State<I, S>
where
    I: AsyncRead + AsyncWrite + Park + Unpin + Send + 'static,
    S: HttpService<Incoming, ResBody = B>,
    S::Error: Into<ConnError>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<ConnError>,
    TokioExecutor: hyper::rt::bounds::Http2ServerConnExec<S::Future, B>,
{
    /// A sniffed connection handed to hyper's server for its protocol.
    #[inline(never)]
    fn serve_sniffed(mut self: Pin<&mut Self>, h2: bool) {
        let StateProj::Sniffing {
            io,
            sniffed,
            builder,
            service,
        } = self.as_mut().project()
        else {
            unreachable!("only a sniffing connection is served");
        };
        let io = TokioIo::new(Rewind {
            sniffed: *sniffed,
            io: io.take().expect("until served"),
            failed: None,
        });
        let service = service.take().expect("until served");
        let next = if h2 {
            State::H2 {
                conn: builder.http2.serve_connection(io, service),
            }
        } else {
            State::H1 {
                conn: Some(Box::new(
                    builder.http1.serve_connection(io, service).with_upgrades(),
                )),
                builder: builder.clone(),
            }
        };
        self.set(next);
    }

    /// An HTTP/1 connection hyper closed, parked if it closed to be
    /// parked ([`parked`]); `false` when the connection ends.
    #[inline(never)]
    fn park(mut self: Pin<&mut Self>) -> bool {
        let StateProj::H1 { conn, builder } = self.as_mut().project() else {
            unreachable!("only an HTTP/1 connection is parked");
        };
        let Some(parked) = conn.take().and_then(|c| parked(*c, builder)) else {
            return false;
        };
        self.set(parked);
        true
    }

    /// A parked connection whose client sent its next bytes, served by
    /// hyper again.
    #[inline(never)]
    fn unpark(mut self: Pin<&mut Self>) {
        let StateProj::Parked {
            io,
            service,
            builder,
            ..
        } = self.as_mut().project()
        else {
            unreachable!("only a parked connection is woken");
        };
        let rewind = io.take().expect("until served");
        let service = service.take().expect("until served");
        let conn = builder
            .http1
            .serve_connection(TokioIo::new(rewind), service)
            .with_upgrades();
        let builder = builder.clone();
        self.set(State::H1 {
            conn: Some(Box::new(conn)),
            builder,
        });
    }

    /// An HTTP/2 connection's poll, its frame apart from HTTP/1's.
    #[inline(never)]
    fn poll_h2(
        conn: Pin<&mut http2::Connection<Io<I>, S, TokioExecutor>>,
        cx: &mut Context<'_>,
    ) -> Poll<Result<(), ConnError>> {
        conn.poll(cx).map_err(Into::into)
    }
}

/// The parked state of a connection hyper closed, when it closed to be
/// parked (its socket says) with no byte left unread; `None` when the
/// connection ends.
fn parked<I, S, B>(
    conn: http1::UpgradeableConnection<Io<I>, S>,
    builder: &Arc<Builder>,
) -> Option<State<I, S>>
where
    I: AsyncRead + AsyncWrite + Park + Unpin + Send + 'static,
    S: HttpService<Incoming, ResBody = B>,
    S::Error: Into<ConnError>,
    B: http_body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<ConnError>,
{
    let parts = conn.into_parts()?;
    let rewind = parts.io.into_inner();
    if !rewind.io.take_to_park() || !parts.read_buf.is_empty() {
        return None;
    }
    Some(State::Parked {
        io: Some(Rewind {
            sniffed: Sniffed::default(),
            ..rewind
        }),
        service: Some(parts.service),
        builder: builder.clone(),
        timeout: builder.parked_for.map(|d| Box::pin(tokio::time::sleep(d))),
        counted: ParkedCount::new(),
    })
}

static PARKED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// HTTP/1 connections parked now, in the whole process.
pub fn parked_connections() -> u64 {
    PARKED.load(std::sync::atomic::Ordering::Relaxed)
}

/// One parked connection in [`parked_connections`], while it lives.
struct ParkedCount;

impl ParkedCount {
    fn new() -> ParkedCount {
        PARKED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        ParkedCount
    }
}

impl Drop for ParkedCount {
    fn drop(&mut self) {
        PARKED.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Reads until the bytes read differ from the preface (HTTP/1: `false`),
/// or are all of it (HTTP/2: `true`), or the peer closes (then HTTP/1,
/// whose server ends a connection closed before any byte quietly, and
/// reports one closed mid-head).
fn sniff<I: AsyncRead + Unpin>(
    io: &mut I,
    sniffed: &mut Sniffed,
    cx: &mut Context<'_>,
) -> Poll<std::io::Result<bool>> {
    loop {
        let len = sniffed.len as usize;
        if len == PREFACE.len() {
            return Poll::Ready(Ok(true));
        }
        let mut buf = ReadBuf::new(&mut sniffed.bytes[len..]);
        ready!(Pin::new(&mut *io).poll_read(cx, &mut buf))?;
        let n = buf.filled().len();
        sniffed.len += n as u8;
        if n == 0 || sniffed.bytes[len..len + n] != PREFACE[len..len + n] {
            return Poll::Ready(Ok(false));
        }
    }
}

#[cfg(test)]
mod tests;
