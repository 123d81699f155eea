//! A stream's outgoing messages ([`crate::seam::Callouts::stream`]):
//! queued by the plugin, taken by the upstream connection as its flow
//! control lets them go, and bounded in bytes between the two, so a
//! plugin that sends faster than its upstream reads cannot grow the
//! proxy's memory past its own cap.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

/// A stream's sending end, held by the plugin.
pub struct StreamSender {
    sender: UnboundedSender<Bytes>,
    queued: Arc<AtomicUsize>,
    max: usize,
}

/// A stream's body, read by the connection carrying it.
pub struct StreamBody {
    receiver: UnboundedReceiver<Bytes>,
    queued: Arc<AtomicUsize>,
}

/// Why a message was not queued.
#[derive(Debug, PartialEq, Eq)]
pub enum NotQueued {
    /// It would take the bytes waiting past the bound.
    Full { queued: usize, max: usize },
    /// The stream's connection is gone.
    Gone,
}

/// A stream's two ends, at most `max` bytes waiting between them.
pub fn stream_body(max: usize) -> (StreamSender, StreamBody) {
    let (sender, receiver) = unbounded_channel();
    let queued = Arc::new(AtomicUsize::new(0));
    let body = StreamBody {
        receiver,
        queued: queued.clone(),
    };
    (
        StreamSender {
            sender,
            queued,
            max,
        },
        body,
    )
}

impl StreamSender {
    /// Queues `message`, unless the bytes waiting would pass the bound.
    pub fn send(&self, message: Bytes) -> Result<(), NotQueued> {
        let len = message.len();
        let queued = self.queued.load(Ordering::Acquire);
        if queued.saturating_add(len) > self.max {
            return Err(NotQueued::Full {
                queued,
                max: self.max,
            });
        }
        // Counted before it is sent: the reader takes it off after.
        self.queued.fetch_add(len, Ordering::AcqRel);
        self.sender.send(message).map_err(|_| {
            self.queued.fetch_sub(len, Ordering::AcqRel);
            NotQueued::Gone
        })
    }
}

impl StreamBody {
    /// The next message, once the plugin sent one; `None` once it
    /// stopped sending (dropped its end).
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<Bytes>> {
        let polled = self.receiver.poll_recv(cx);
        if let Poll::Ready(Some(message)) = &polled {
            self.queued.fetch_sub(message.len(), Ordering::AcqRel);
        }
        polled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_past_the_bound_wait_for_the_reader() {
        let (sender, mut body) = stream_body(10);
        assert_eq!(sender.send(Bytes::from_static(b"123456")), Ok(()));
        assert_eq!(
            sender.send(Bytes::from_static(b"12345")),
            Err(NotQueued::Full { queued: 6, max: 10 })
        );
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert_eq!(
            body.poll_recv(&mut cx),
            Poll::Ready(Some(Bytes::from_static(b"123456")))
        );
        // Taken: room again.
        assert_eq!(sender.send(Bytes::from_static(b"12345")), Ok(()));
        drop(body);
        assert_eq!(sender.send(Bytes::from_static(b"1")), Err(NotQueued::Gone));
    }
}
