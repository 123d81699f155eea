//! Lingering close: after answering a request whose body it did not read
//! (a 413), the proxy closes its side of the connection and then reads
//! and drops what the client still sends before letting the socket go,
//! as nginx's `lingering_close` does.
//!
//! A socket closed with unread bytes in it makes the kernel send a reset
//! instead of a FIN, and discard whatever of the answer is still queued;
//! a client still writing its body then sees "connection reset" in place
//! of the 413. Reading on until the client stops (it has read the answer
//! and closed), goes quiet, or the time is up, lets the answer arrive.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, ReadBuf};
use tokio::time::{Instant, Sleep};

/// How long the client may stay silent before the socket is let go
/// (nginx's `lingering_timeout`).
const QUIET: Duration = Duration::from_secs(5);
/// The longest a connection lingers, however the client keeps sending
/// (nginx's `lingering_time`).
const AT_MOST: Duration = Duration::from_secs(30);

pin_project_lite::pin_project! {
    /// A connection's lingering, started once its write side is closed.
    #[derive(Debug)]
    pub struct Lingering {
        #[pin]
        quiet: Sleep,
        ends: Instant,
    }
}

impl Lingering {
    pub fn start() -> Lingering {
        let now = Instant::now();
        Lingering {
            quiet: tokio::time::sleep_until(now + QUIET),
            ends: now + AT_MOST,
        }
    }

    /// Reads and drops what `io` sends; ready once it has ended (end of
    /// stream, an error, or silence or time up).
    pub fn poll_drain<S: AsyncRead + Unpin>(
        self: Pin<&mut Self>,
        io: &mut S,
        cx: &mut Context<'_>,
    ) -> Poll<()> {
        let mut this = self.project();
        let mut scratch = [0u8; 8192];
        for _ in 0..64 {
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut *io).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if buf.filled().is_empty() => return Poll::Ready(()),
                Poll::Ready(Ok(())) => {
                    let next = (Instant::now() + QUIET).min(*this.ends);
                    this.quiet.as_mut().reset(next);
                }
                Poll::Ready(Err(_)) => return Poll::Ready(()),
                Poll::Pending => return this.quiet.as_mut().poll(cx),
            }
            // A client sending without pause is cut off at the end.
            if this.quiet.is_elapsed() || Instant::now() >= *this.ends {
                return Poll::Ready(());
            }
        }
        // A fast sender gets no more of this poll: the worker serves its
        // other connections before this one reads on.
        cx.waker().wake_by_ref();
        Poll::Pending
    }
}
