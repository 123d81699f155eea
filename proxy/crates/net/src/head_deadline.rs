//! The deadline for a request head on a client connection.
//!
//! hyper has one clock for request heads: it starts when hyper waits for
//! a head, which on a keep-alive connection is as soon as the previous
//! response is sent. A short value there is a slowloris cut-off but also
//! closes idle keep-alive connections early, and a balancer in front that
//! keeps its idle connections longer (60 s for AWS ALB and ingress-nginx)
//! then reuses one just as the proxy closes it: a 502 at the balancer.
//!
//! So hyper's clock gets the keep-alive timeout (nginx's 75 s by default),
//! and this module gives each head the short header-read timeout, as
//! nginx's `client_header_timeout` does:
//! - a new connection's first head, from the accept;
//! - a later head on a kept-alive HTTP/1 connection, from its first byte.
//!   An idle connection sends no bytes and keeps its keep-alive timeout;
//!   one that starts a head and stalls is closed like a new one.
//!
//! Three parts share a [`HeadClock`]: the connection's socket
//! ([`Watched`]) notes bytes that arrive between requests, the service
//! notes each request and gives its response body an [`Ended`] to note
//! its end, and [`within`], around the served connection, times the head
//! awaited. All three run on the connection's own task; the clock's
//! atomics are relaxed loads and stores, a few nanoseconds a request.

use std::future::Future;
use std::ops::Deref;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU16, AtomicU32, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use http::Version;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::linger::Lingering;

/// Where a connection is between requests, for the head deadline.
///
/// Bits 0-1 are the phase, bit 2 turns the deadline off (HTTP/2: its
/// frames arrive between requests and hyper times the connection itself),
/// bits 3-4 tell [`Watched`] whose bytes it writes, and the bits above
/// count requests, so that a head that starts within the same poll in
/// which the previous one ended is seen as a new head.
///
/// It also keeps the status of the answer [`Watched`] gave in place of
/// hyper's to a head hyper could not parse, for the access line; whether
/// the connection is to linger; and whether hyper's read buffer grew
/// large ([`HeadClock::grown`]).
#[derive(Debug, Default)]
pub struct HeadClock(AtomicU32, AtomicU16, AtomicBool, AtomicBool, AtomicU8);

/// [`HeadClock`]'s parking states (see [`Within::parking`]).
const AWAKE: u8 = 0;
/// hyper is to read the end of the stream, and close its connection so
/// that the socket can be kept without it.
const TO_PARK: u8 = 1;
/// The socket is kept without hyper, until bytes arrive.
const PARKED: u8 = 2;

const PHASE: u32 = 0b11;
/// No request yet: the first head is awaited from the accept.
const FIRST: u32 = 0;
/// A request is being served.
const BUSY: u32 = 1;
/// Between requests, no byte of the next head yet.
const IDLE: u32 = 2;
/// Bytes of the next head have arrived.
const HEAD: u32 = 3;
const OFF: u32 = 0b100;
/// The last response's bytes may still be in hyper's write buffer: set
/// when its body ends, cleared when hyper next flushes the socket (it
/// writes out its whole buffer first).
const UNFLUSHED: u32 = 0b1000;
/// The connection was upgraded (101): what is written is another
/// protocol's, never hyper's.
const UPGRADED: u32 = 0b1_0000;
const ONE_REQUEST: u32 = 0b10_0000;

impl HeadClock {
    fn load(&self) -> u32 {
        self.0.load(Ordering::Relaxed)
    }

    fn store(&self, state: u32) {
        self.0.store(state, Ordering::Relaxed);
    }

    /// Notes that a request head arrived (the service calls this first).
    pub fn request(&self, version: Version) {
        let s = self.load();
        let off = if version == Version::HTTP_2 {
            OFF
        } else {
            s & OFF
        };
        self.store((s & !(PHASE | OFF)).wrapping_add(ONE_REQUEST) | off | BUSY);
    }

    /// Notes that the response to the current request has been sent.
    fn response_done(&self) {
        let s = self.load();
        if s & PHASE == BUSY {
            self.store(s & !PHASE | IDLE | UNFLUSHED);
        }
    }

    /// Notes that hyper flushed the socket: every byte of the responses
    /// before has been written.
    fn flushed(&self) {
        let s = self.load();
        if s & UNFLUSHED != 0 {
            self.store(s & !UNFLUSHED);
        }
    }

    /// Notes a status line written: a 101 switches the connection to
    /// another protocol. Returns whether the line is hyper's own: written
    /// while no request is being served and the last response is out, on
    /// an HTTP/1 connection not upgraded. (HTTP/2's first frames are
    /// written between requests too, but none starts as a status line.)
    #[inline]
    fn status_line(&self, line: &[u8]) -> bool {
        let s = self.load();
        // A 101 may go out after its (empty) body ended, so in any phase.
        if line[9..].starts_with(b"101 ") {
            self.store(s | UPGRADED);
            return false;
        }
        s & PHASE != BUSY && s & (OFF | UNFLUSHED | UPGRADED) == 0
    }

    /// The status of the answer given in place of hyper's to a head it
    /// could not parse; 0 when none was.
    pub fn refused(&self) -> u16 {
        self.1.load(Ordering::Relaxed)
    }

    /// Notes that the connection is to linger when it closes (see
    /// [`crate::linger`]): an answer went out before the request's body
    /// was read.
    pub fn linger(&self) {
        self.2.store(true, Ordering::Relaxed);
    }

    /// Whether hyper's read buffer for this connection has grown past
    /// [`GROWN`]: a fast upload grows it up to the listener's read buffer
    /// (256 KiB), and hyper keeps that for the connection's life, so an
    /// idle keep-alive connection after a large upload held ~570 KiB of
    /// the proxy's memory (~160 KiB when the buffer stopped at 64 KiB).
    /// The service closes such a connection after its answer (HTTP/1.1
    /// `Connection: close`): the client's next request takes a new one,
    /// a handshake, after an upload of 128 KiB or more.
    pub fn grown(&self) -> bool {
        self.3.load(Ordering::Relaxed)
    }

    /// Makes `resp` the connection's last answer when the read buffer has
    /// [`grown`](HeadClock::grown) (HTTP/1 only: an HTTP/2 connection's
    /// buffers are the h2 codec's).
    pub fn close_if_grown<B>(&self, version: Version, resp: &mut http::Response<B>) {
        if version < Version::HTTP_2
            && self.grown()
            && resp.status() != http::StatusCode::SWITCHING_PROTOCOLS
        {
            resp.headers_mut().insert(
                http::header::CONNECTION,
                http::HeaderValue::from_static("close"),
            );
        }
    }

    /// Notes bytes read from the client: a head has started when no
    /// request is being served. (Bytes read while one is are its body.)
    fn bytes_read(&self) {
        let s = self.load();
        if s & PHASE == IDLE {
            self.store(s | HEAD);
        }
    }

    /// The state of an HTTP/1 connection that is between requests, waits
    /// for no head byte, and could be parked; `None` for any other (busy,
    /// HTTP/2, upgraded, to linger or close). Two equal snapshots a while
    /// apart mean no request came in between: the request count is part.
    fn idle(&self) -> Option<u32> {
        let s = self.load() & !UNFLUSHED;
        let parkable = s & PHASE == IDLE && s & (OFF | UPGRADED) == 0;
        let closing = self.2.load(Ordering::Relaxed) || self.3.load(Ordering::Relaxed);
        (parkable && !closing).then_some(s)
    }

    /// Whether hyper is to read the end of the stream (see [`Within::parking`]).
    fn to_park(&self) -> bool {
        self.4.load(Ordering::Relaxed) == TO_PARK
    }

    /// Takes a connection hyper closed to be parked: true once, when it was.
    pub fn take_to_park(&self) -> bool {
        self.4
            .compare_exchange(TO_PARK, PARKED, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }

    /// Notes that the parked connection is served by hyper again.
    pub fn unpark(&self) {
        self.4.store(AWAKE, Ordering::Relaxed);
    }

    /// The head being awaited, if it is to be timed: its state, which
    /// changes when another head is awaited.
    fn awaited(&self) -> Option<u32> {
        // A flush or an upgrade is no new head.
        let s = self.load() & !(UNFLUSHED | UPGRADED);
        match s & PHASE {
            FIRST => Some(s),
            HEAD if s & OFF == 0 => Some(s),
            _ => None,
        }
    }
}

/// How long an HTTP/1 connection idles between requests before it is
/// parked, at most twice this (see [`Within::parking`]): longer than any
/// pause between a client's back-to-back requests, short beside the
/// keep-alive timeout (75 s) that idle connections wait out.
pub const PARK_AFTER: Duration = Duration::from_millis(500);

/// A read buffer larger than this marks the connection [`HeadClock::grown`].
/// hyper's buffer starts at 8 KiB and doubles with each read that fills
/// it; a body of about 128 KiB arriving faster than it is read already
/// leaves it at 256 KiB (it was at most 128 KiB when capped at 64 KiB).
pub const GROWN: usize = 128 * 1024;

/// Drives `served` (a connection) to its end, unless a head it awaits
/// takes longer than `limit`: the first from now, a later one from its
/// first byte. Then the connection is dropped, which closes it, and the
/// answer is `None`.
pub fn within<F, C>(served: F, clock: C, limit: Duration) -> Within<F, C>
where
    F: Future,
    C: Deref<Target = HeadClock>,
{
    Within {
        timed: clock.awaited(),
        served,
        deadline: tokio::time::sleep(limit),
        clock,
        limit,
        park: None,
    }
}

impl<F, C> Within<F, C> {
    /// Parks the HTTP/1 connection once it has been idle between
    /// requests for `after` to twice `after`: hyper reads the end of the
    /// stream and closes its side, and `h1_or_h2` keeps the socket with
    /// no buffer until bytes arrive (see [`crate::h1_or_h2`]), so an idle
    /// keep-alive connection holds no read or write buffer. The check
    /// shares the head deadline's timer: no timer work per request, one
    /// timer reset per `after` per connection.
    pub fn parking(mut self, after: Duration) -> Self {
        self.park = Some(Park {
            after,
            armed: false,
            seen: None,
        });
        self
    }
}

/// [`Within`]'s idle check.
struct Park {
    after: Duration,
    /// The deadline is set for the check (not for a head).
    armed: bool,
    /// The connection's idle state at the last check.
    seen: Option<u32>,
}

pin_project_lite::pin_project! {
    /// What [`within`] returns. A future of its own rather than an async
    /// fn: an async fn keeps its argument and the pinned copy it polls
    /// both, and the connection's task held a third, ~1.6 KiB each for
    /// every idle keep-alive connection.
    pub struct Within<F, C> {
        #[pin]
        served: F,
        #[pin]
        deadline: tokio::time::Sleep,
        clock: C,
        limit: Duration,
        timed: Option<u32>,
        park: Option<Park>,
    }
}

impl<F, C> Future for Within<F, C>
where
    F: Future,
    C: Deref<Target = HeadClock>,
{
    type Output = Option<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        if let Poll::Ready(out) = this.served.as_mut().poll(cx) {
            return Poll::Ready(Some(out));
        }
        let awaited = this.clock.awaited();
        if awaited != *this.timed {
            // Only a later head gets here with a value: it started within
            // the poll just made. Heads that arrive whole never do.
            if awaited.is_some() {
                let at = tokio::time::Instant::now() + *this.limit;
                this.deadline.as_mut().reset(at);
                if let Some(park) = this.park.as_mut() {
                    park.armed = false;
                }
            }
            *this.timed = awaited;
        }
        if this.timed.is_some() {
            if this.deadline.poll(cx).is_ready() {
                return Poll::Ready(None);
            }
            return Poll::Pending;
        }
        // An untimed deadline is not polled, unless parking uses it; if
        // it was registered, it wakes the connection once, for nothing.
        let Some(park) = this.park.as_mut() else {
            return Poll::Pending;
        };
        if this.clock.load() & (OFF | UPGRADED) != 0 {
            // HTTP/2 or another protocol now: never parked.
            *this.park = None;
            return Poll::Pending;
        }
        if this.clock.4.load(Ordering::Relaxed) == PARKED {
            park.armed = false;
            return Poll::Pending;
        }
        if park.armed && !this.deadline.is_elapsed() {
            return Poll::Pending;
        }
        let idle = this.clock.idle();
        if park.armed && idle.is_some() && idle == park.seen {
            // Idle since the last check: hyper reads the end of the
            // stream now and closes; `h1_or_h2` keeps the socket.
            this.clock.4.store(TO_PARK, Ordering::Relaxed);
            park.armed = false;
            if let Poll::Ready(out) = this.served.as_mut().poll(cx) {
                return Poll::Ready(Some(out));
            }
            return Poll::Pending;
        }
        park.seen = idle;
        park.armed = true;
        let at = tokio::time::Instant::now() + park.after;
        this.deadline.as_mut().reset(at);
        // Registers the timer; it cannot have run out yet.
        let _ = this.deadline.poll(cx);
        Poll::Pending
    }
}

/// A client's socket that tells the clock when bytes arrive, and sends
/// the proxy's JSON answer in place of hyper's bare one to a head hyper
/// could not parse ([`crate::unparsed_head`]).
#[derive(Debug)]
pub struct Watched<S> {
    io: S,
    clock: Arc<HeadClock>,
    /// The proxy's answer in place of hyper's, and how much of it is out.
    answer: Option<(Vec<u8>, usize)>,
    /// Once the write side is closed on a connection marked to linger.
    lingering: Option<Pin<Box<Lingering>>>,
}

impl<S> Watched<S> {
    pub fn new(io: S, clock: Arc<HeadClock>) -> Watched<S> {
        Watched {
            io,
            clock,
            answer: None,
            lingering: None,
        }
    }
}

impl<S: AsyncWrite + Unpin> Watched<S> {
    /// Takes `buf` in place of sending it when it is hyper's own answer
    /// to a head it could not parse, and starts sending the proxy's.
    #[inline]
    fn replace_hypers_answer(
        &mut self,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Option<Poll<std::io::Result<usize>>> {
        // Every response starts so; only then is the clock read, and only
        // between requests can this be hyper's own answer.
        if !buf.starts_with(b"HTTP/1.1 ") || self.answer.is_some() || !self.clock.status_line(buf) {
            return None;
        }
        self.replace(cx, buf)
    }

    #[cold]
    #[inline(never)]
    fn replace(
        &mut self,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Option<Poll<std::io::Result<usize>>> {
        let (status, answer) = crate::unparsed_head::answer(buf)?;
        self.clock.1.store(status, Ordering::Relaxed);
        // The rest of a head too large is likely still coming: linger, so
        // that the client reads the 431 rather than a reset (nginx does
        // for its 494 too; a malformed head's client is not waited for).
        if status == 431 {
            self.clock.linger();
        }
        self.answer = Some((answer, 0));
        // hyper's head counts as written; the flush that follows sends
        // whatever of the answer this does not.
        if let Poll::Ready(Err(e)) = self.poll_answer(cx) {
            return Some(Poll::Ready(Err(e)));
        }
        Some(Poll::Ready(Ok(buf.len())))
    }

    /// Writes what is left of the answer given in hyper's place.
    fn poll_answer(&mut self, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        while let Some((answer, sent)) = &mut self.answer {
            if *sent == answer.len() {
                break;
            }
            let n = std::task::ready!(Pin::new(&mut self.io).poll_write(cx, &answer[*sent..]))?;
            if n == 0 {
                return Poll::Ready(Err(std::io::ErrorKind::WriteZero.into()));
            }
            *sent += n;
        }
        Poll::Ready(Ok(()))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        // Idle long enough: the end of the stream, for hyper to close its
        // side (`Within::parking`).
        if self.clock.to_park() {
            return Poll::Ready(Ok(()));
        }
        // hyper offers the whole free space of its buffer.
        if buf.remaining() > GROWN {
            self.clock.3.store(true, Ordering::Relaxed);
        }
        let before = buf.filled().len();
        let read = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.clock.bytes_read();
        }
        read
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        if let Some(replaced) = this.replace_hypers_answer(cx, buf) {
            return replaced;
        }
        std::task::ready!(this.poll_answer(cx))?;
        Pin::new(&mut this.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        let this = self.get_mut();
        // hyper's answer is a head alone: one slice (hyper queues a body
        // in slices of its own).
        let mut full = bufs.iter().filter(|b| !b.is_empty());
        if let (Some(head), None) = (full.next(), full.next())
            && let Some(replaced) = this.replace_hypers_answer(cx, head)
        {
            return replaced;
        }
        std::task::ready!(this.poll_answer(cx))?;
        Pin::new(&mut this.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        std::task::ready!(self.poll_answer(cx))?;
        self.clock.flushed();
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        // hyper closing to be parked: the socket stays open.
        if this.clock.to_park() {
            return Poll::Ready(Ok(()));
        }
        if this.lingering.is_none() {
            std::task::ready!(this.poll_answer(cx))?;
            std::task::ready!(Pin::new(&mut this.io).poll_shutdown(cx))?;
            if !this.clock.2.load(Ordering::Relaxed) {
                return Poll::Ready(Ok(()));
            }
            this.lingering = Some(Box::pin(Lingering::start()));
        }
        let lingering = this.lingering.as_mut().expect("set above");
        lingering.as_mut().poll_drain(&mut this.io, cx).map(Ok)
    }
}

impl<S> crate::h1_or_h2::Park for Watched<S> {
    fn take_to_park(&self) -> bool {
        self.clock.take_to_park()
    }

    fn unpark(&self) {
        self.clock.unpark();
    }
}

/// Held by a response body (`ResponseBody::set_ended`): when hyper drops
/// the body, which it does once it has taken its last frame and before it
/// reads on, the clock learns that the response is done. A field of the
/// body rather than a wrapper around it, so no response is moved for it.
pub struct Ended(Arc<HeadClock>);

impl Ended {
    pub fn new(clock: Arc<HeadClock>) -> Ended {
        Ended(clock)
    }
}

impl Drop for Ended {
    fn drop(&mut self) {
        self.0.response_done();
    }
}

#[cfg(test)]
mod tests;
