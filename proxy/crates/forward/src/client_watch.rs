//! Noticing an HTTP/1 client that leaves while its request is still open.
//!
//! hyper can notice it itself, by reading the client socket once more
//! right after it hands a request to the service; but that read first
//! reserves hyper's read buffer, which the request's head still holds, so
//! it allocated a new 8 KiB buffer on every request (~0.5 us of user time
//! per request). The listeners turn that read off (`half_close`), and
//! requests still open after [`WATCH_AFTER`] — waiting on the upstream, or
//! streaming a quiet response — watch the socket here instead: a
//! duplicate of its descriptor, polled for the end of stream. Fast
//! requests pay nothing. A client that leaves is then noticed within about
//! a second, and its upstream exchange is dropped, as nginx and Envoy do.

use std::future::Future;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use portcullis_net::coarse_deadline;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;

/// How long a request stays open before its client is watched.
pub const WATCH_AFTER: Duration = Duration::from_secs(1);

/// The socket of an HTTP/1 client connection.
#[derive(Debug, Clone, Copy)]
pub struct ClientSocket(RawFd);

impl ClientSocket {
    /// The socket of `stream`, for requests of an HTTP/1 connection that
    /// polls them itself: while such a request is polled, the connection
    /// (and so the descriptor) is alive. Not for HTTP/2, whose streams run
    /// as tasks of their own that can outlive the connection.
    pub fn of(stream: &impl AsRawFd) -> ClientSocket {
        ClientSocket(stream.as_raw_fd())
    }

    /// Starts watching: a duplicate of the descriptor, registered for
    /// readiness. `None` when that fails (out of descriptors): the request
    /// then goes on unwatched.
    fn watch(self) -> Option<Watch> {
        // SAFETY: the descriptor belongs to the connection whose task is
        // polling the caller (see `of`), so it is open for this call; the
        // duplicate is ours to close.
        let fd = unsafe { BorrowedFd::borrow_raw(self.0) };
        let owned = fd.try_clone_to_owned().ok()?;
        // SAFETY: the AsyncFd owns the duplicate, which stays open, and the
        // same descriptor, until the AsyncFd is dropped.
        unsafe { AsyncFd::register_with_interest(owned, Interest::READABLE) }
            .ok()
            .map(Watch)
    }
}

/// A watched client socket.
struct Watch(AsyncFd<OwnedFd>);

impl Watch {
    /// `Ready(true)` when the client has closed or reset its connection;
    /// `Ready(false)` when it sent more (a request body, a pipelined
    /// request): its end can then no longer be seen without reading, which
    /// is hyper's to do, so the watch should stop.
    fn poll_gone(&self, cx: &mut Context<'_>) -> Poll<bool> {
        loop {
            let mut guard = match self.0.poll_read_ready(cx) {
                Poll::Ready(Ok(guard)) => guard,
                Poll::Ready(Err(_)) => return Poll::Ready(true),
                Poll::Pending => return Poll::Pending,
            };
            // The client shut its side (EPOLLRDHUP), with bytes still
            // unread: the close_notify alert a TLS client sends before its
            // FIN, which a peek would take for more request. nginx reads
            // the same flag (`pending_eof`).
            if guard.ready().is_read_closed() {
                return Poll::Ready(true);
            }
            let mut byte = [MaybeUninit::<u8>::uninit()];
            match socket2::SockRef::from(self.0.get_ref()).peek(&mut byte) {
                Ok(0) => return Poll::Ready(true),
                Ok(_) => return Poll::Ready(false),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => guard.clear_ready(),
                Err(_) => return Poll::Ready(true),
            }
        }
    }
}

/// How an exchange run by [`exchange`] was cut short.
#[derive(Debug, PartialEq, Eq)]
pub enum Cut {
    /// The timeout passed with the request sent.
    TimedOut,
    /// The client sent none of the rest of its request body for the
    /// timeout, while it was waited for.
    BodyStalled,
    /// The client went away.
    ClientGone,
}

/// Runs `exchange` for at most `timeout`, and from [`WATCH_AFTER`] on
/// watches `client`, dropping the exchange if the client goes away. One
/// timer serves both (first set to the watch, then moved to the
/// deadline), so a request pays no more than a plain timeout. The
/// exchange is borrowed pinned, not moved in: moving a future copies all
/// of it.
///
/// With a request body streaming to the upstream (`body`), the timeout
/// counts from the body's last progress, as nginx's `proxy_read_timeout`
/// starts once the request is sent: an upload longer than the timeout is
/// not the upstream being slow. A body that stops coming for the timeout
/// is [`Cut::BodyStalled`] (nginx's `client_body_timeout`).
pub async fn exchange<F: Future>(
    mut exchange: Pin<&mut F>,
    timeout: Duration,
    client: Option<ClientSocket>,
    body: Option<&crate::body_progress::BodyProgress>,
) -> Result<F::Output, Cut> {
    let first = if client.is_some() {
        WATCH_AFTER.min(timeout)
    } else {
        timeout
    };
    // Whether the timer is set to the timeout (else to the watch).
    let mut last = first == timeout;
    let mut timer = std::pin::pin!(Timer::new(timeout, first));
    let mut watch: Option<Watch> = None;
    std::future::poll_fn(|cx| {
        if let Poll::Ready(out) = exchange.as_mut().poll(cx) {
            return Poll::Ready(Ok(out));
        }
        loop {
            if let Some(w) = &watch
                && let Poll::Ready(gone) = w.poll_gone(cx)
            {
                if gone {
                    return Poll::Ready(Err(Cut::ClientGone));
                }
                watch = None;
            }
            if timer.as_mut().poll_passed(cx).is_pending() {
                return Poll::Pending;
            }
            if last {
                // The body moved since the deadline was set: the wait
                // starts again from then. A body not asked for is an
                // upstream that stopped reading it: its timeout, not the
                // client's.
                match body {
                    Some(b) => match b.wait_left(timeout) {
                        Some(rest) => {
                            timer.as_mut().reset(rest);
                            continue;
                        }
                        None if b.waiting_on_client() => {
                            return Poll::Ready(Err(Cut::BodyStalled));
                        }
                        None => return Poll::Ready(Err(Cut::TimedOut)),
                    },
                    None => return Poll::Ready(Err(Cut::TimedOut)),
                }
            }
            watch = client.and_then(ClientSocket::watch);
            // To the deadline, counted from the start as the watch was.
            timer.as_mut().extend(timeout - first);
            last = true;
        }
    })
    .await
}

pin_project_lite::pin_project! {
    /// The exchange's timer: for a timeout of [`coarse_deadline::LONG`]
    /// or more on a worker, kept by the worker's own list (~350
    /// instructions a request less than tokio's; seen up to half a second
    /// late); else tokio's, pinned in place as before.
    #[project = TimerProj]
    enum Timer {
        Coarse { deadline: coarse_deadline::Deadline },
        Tokio { #[pin] sleep: tokio::time::Sleep },
    }
}

impl Timer {
    /// A timer for a wait of `timeout`, set to `first`: both stages are
    /// kept alike.
    fn new(timeout: Duration, first: Duration) -> Timer {
        match coarse_deadline::Deadline::new(timeout, first) {
            Some(deadline) => Timer::Coarse { deadline },
            None => Timer::Tokio {
                sleep: tokio::time::sleep(first),
            },
        }
    }

    fn poll_passed(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match self.project() {
            TimerProj::Coarse { deadline } => deadline.poll_passed(cx),
            TimerProj::Tokio { sleep } => sleep.poll(cx),
        }
    }

    /// Sets it to `after` from now.
    fn reset(self: Pin<&mut Self>, after: Duration) {
        match self.project() {
            TimerProj::Coarse { deadline } => deadline.reset(after),
            TimerProj::Tokio { sleep } => sleep.reset(tokio::time::Instant::now() + after),
        }
    }

    /// Sets it `by` later than it was set.
    fn extend(self: Pin<&mut Self>, by: Duration) {
        match self.project() {
            TimerProj::Coarse { deadline } => deadline.extend(by),
            TimerProj::Tokio { mut sleep } => {
                let at = sleep.deadline() + by;
                sleep.as_mut().reset(at);
            }
        }
    }
}

/// Watches a client from [`WATCH_AFTER`] on, as a future: ready when the
/// client has gone.
pub struct Gone {
    socket: ClientSocket,
    state: State,
}

enum State {
    Waiting(Pin<Box<tokio::time::Sleep>>),
    Watching(Watch),
    /// Could not watch, or the client sent more: never ready.
    Off,
}

impl Gone {
    /// Starts the clock now.
    pub fn after_a_while(socket: ClientSocket) -> Gone {
        Gone {
            socket,
            state: State::Waiting(Box::pin(tokio::time::sleep(WATCH_AFTER))),
        }
    }
}

impl Future for Gone {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        loop {
            match &mut self.state {
                State::Waiting(sleep) => {
                    if sleep.as_mut().poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    self.state = match self.socket.watch() {
                        Some(watch) => State::Watching(watch),
                        None => State::Off,
                    };
                }
                State::Watching(watch) => match watch.poll_gone(cx) {
                    Poll::Ready(true) => return Poll::Ready(()),
                    Poll::Ready(false) => self.state = State::Off,
                    Poll::Pending => return Poll::Pending,
                },
                State::Off => return Poll::Pending,
            }
        }
    }
}
