//! A copy of a streamed request body for a second reader (a route's
//! mirror), made as the upstream pulls the body: each frame is shared
//! (`Bytes` are counted references, not copied) into a queue the copy
//! reads from. The upstream's pace is the client's; the copy never slows
//! them. A copy that falls more than [`MAX_BEHIND`] bytes behind is cut:
//! its reader sees an error, not a shorter body, so its request ends
//! unfinished rather than complete and wrong.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use tokio::sync::mpsc;

use crate::body_progress::BodyError;

/// How far the copy may fall behind the upstream before it is cut: per
/// copy, so 64 mirrored requests in flight hold at most 16 MiB.
pub const MAX_BEHIND: usize = 256 * 1024;

/// What the copy's reader and the body's sender share.
struct Shared {
    /// Bytes sent and not yet read.
    behind: AtomicUsize,
    /// The whole body was sent.
    complete: AtomicBool,
}

/// The body's side: sends each frame on.
pub struct Sender {
    frames: mpsc::UnboundedSender<Frame<Bytes>>,
    shared: Arc<Shared>,
    /// Counts copies cut short (the mirror's `cut`).
    cut: Arc<AtomicU64>,
}

/// The copy's side: a body of the frames sent, in order.
pub struct Copy {
    frames: mpsc::UnboundedReceiver<Frame<Bytes>>,
    shared: Arc<Shared>,
    size: Option<u64>,
}

/// A sender and the copy it feeds; `size` is the body's length when known.
pub fn pair(size: Option<u64>, cut: Arc<AtomicU64>) -> (Sender, Copy) {
    let (tx, rx) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared {
        behind: AtomicUsize::new(0),
        complete: AtomicBool::new(false),
    });
    (
        Sender {
            frames: tx,
            shared: shared.clone(),
            cut,
        },
        Copy {
            frames: rx,
            shared,
            size,
        },
    )
}

impl Sender {
    /// Sends a copy of `frame` on; `false` when the copy is cut (too far
    /// behind, or its reader gone), and the sender should be dropped.
    pub fn send(&self, frame: &Frame<Bytes>) -> bool {
        let copy = if let Some(data) = frame.data_ref() {
            let n = data.len();
            if self.shared.behind.fetch_add(n, Ordering::Relaxed) + n > MAX_BEHIND {
                return false;
            }
            Frame::data(data.clone())
        } else if let Some(trailers) = frame.trailers_ref() {
            Frame::trailers(trailers.clone())
        } else {
            return true;
        };
        self.frames.send(copy).is_ok()
    }

    /// The body ended: the copy ends too, whole.
    pub fn finish(self) {
        self.shared.complete.store(true, Ordering::Relaxed);
    }
}

impl Drop for Sender {
    fn drop(&mut self) {
        if !self.shared.complete.load(Ordering::Relaxed) {
            self.cut.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl http_body::Body for Copy {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.frames.poll_recv(cx) {
            Poll::Ready(Some(frame)) => {
                if let Some(data) = frame.data_ref() {
                    self.shared.behind.fetch_sub(data.len(), Ordering::Relaxed);
                }
                Poll::Ready(Some(Ok(frame)))
            }
            // The sender is gone: whole, or cut.
            Poll::Ready(None) if self.shared.complete.load(Ordering::Relaxed) => Poll::Ready(None),
            Poll::Ready(None) => Poll::Ready(Some(Err(
                "the copy of the request body fell behind or was cut".into(),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn size_hint(&self) -> SizeHint {
        self.size
            .map_or_else(SizeHint::default, SizeHint::with_exact)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn a_finished_body_is_copied_whole() {
        let cut = Arc::new(AtomicU64::new(0));
        let (tx, copy) = pair(Some(6), cut.clone());
        assert!(tx.send(&Frame::data(Bytes::from_static(b"abc"))));
        assert!(tx.send(&Frame::data(Bytes::from_static(b"def"))));
        tx.finish();
        let got = copy.collect().await.unwrap().to_bytes();
        assert_eq!(&got[..], b"abcdef");
        assert_eq!(cut.load(Ordering::Relaxed), 0);
    }

    #[tokio::test]
    async fn a_copy_too_far_behind_is_cut_and_ends_in_an_error() {
        let cut = Arc::new(AtomicU64::new(0));
        let (tx, copy) = pair(None, cut.clone());
        let chunk = Bytes::from(vec![0u8; 64 * 1024]);
        let sent = (0..10)
            .take_while(|_| tx.send(&Frame::data(chunk.clone())))
            .count();
        assert_eq!(sent, MAX_BEHIND / chunk.len());
        drop(tx);
        assert_eq!(cut.load(Ordering::Relaxed), 1);
        assert!(copy.collect().await.is_err());
    }

    #[tokio::test]
    async fn a_copy_read_as_it_comes_never_falls_behind() {
        let cut = Arc::new(AtomicU64::new(0));
        let (tx, mut copy) = pair(None, cut.clone());
        let chunk = Bytes::from(vec![1u8; 64 * 1024]);
        for _ in 0..64 {
            assert!(tx.send(&Frame::data(chunk.clone())));
            let frame = copy.frame().await.unwrap().unwrap();
            assert_eq!(frame.data_ref().map(Bytes::len), Some(chunk.len()));
        }
        tx.finish();
        assert!(copy.frame().await.is_none());
    }
}
