//! The one body type that flows through the proxy: a streamed hyper body
//! (client → upstream, upstream → client) or a small body the proxy made
//! itself. An enum rather than a boxed trait object keeps the hot path free
//! of a per-request allocation.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body as _, Frame, SizeHint};
use hyper::body::Incoming;

pub use crate::body_progress::{BodyError, BodyProgress};
use crate::client_watch::{ClientSocket, Gone};
use crate::h1::H1Body;
use crate::held::Held;
use portcullis_net::head_deadline::Ended;
use portcullis_obs::metrics;
use portcullis_obs::telemetry::AccessLog;

pin_project_lite::pin_project! {
    /// A request or response body.
    #[project = BodyProj]
    pub enum Body {
        /// Streamed from a peer, frame by frame, with backpressure.
        Stream { #[pin] inner: Incoming },
        /// A client's request body streamed to an upstream, noting its
        /// progress for the wait on the upstream's answer (boxed: only
        /// streamed uploads take it, and inline it would make every body
        /// larger).
        Tracked { inner: Box<Tracked> },
        /// Read from an upstream HTTP/1.1 connection by the request's task.
        Upstream { inner: H1Body },
        /// Made by the proxy (error bodies, local answers); `None` once sent.
        Full { data: Option<Bytes> },
        /// Any other body: an HTTP/3 request's, read from its QUIC stream
        /// (boxed: only that path takes it).
        Boxed { inner: Pin<Box<dyn http_body::Body<Data = Bytes, Error = BodyError> + Send>> },
    }
}

impl Body {
    /// A body of these bytes.
    pub fn full(data: impl Into<Bytes>) -> Body {
        let data: Bytes = data.into();
        Body::Full {
            data: (!data.is_empty()).then_some(data),
        }
    }

    /// A body of another type, boxed.
    pub fn boxed(
        inner: impl http_body::Body<Data = Bytes, Error = BodyError> + Send + 'static,
    ) -> Body {
        Body::Boxed {
            inner: Box::pin(inner),
        }
    }

    /// The bytes of a body already in memory (read for a plugin, or made
    /// here), shared rather than copied; `None` for a streamed one.
    pub fn in_memory(&self) -> Option<Bytes> {
        match self {
            Body::Full { data } => Some(data.clone().unwrap_or_default()),
            _ => None,
        }
    }

    /// The whole body when it is in memory or came whole with its head
    /// ([`crate::H1Body::take_whole`]), taken (the body left ended);
    /// `None`, and nothing taken, for an empty body or one still to come.
    pub fn take_whole(&mut self) -> Option<Bytes> {
        match self {
            Body::Full { data } => data.take(),
            Body::Upstream { inner } => inner.take_whole(),
            _ => None,
        }
    }

    /// An empty body.
    pub fn empty() -> Body {
        Body::Full { data: None }
    }

    /// Notes this body's progress in what is returned, when it is still to
    /// be streamed from the client; `None` (and the body left as it is,
    /// not moved: most requests have none) when it is in memory or empty.
    pub fn track(&mut self) -> Option<Arc<BodyProgress>> {
        if let Body::Tracked { inner } = self {
            return Some(inner.progress.clone());
        }
        let streamed = match self {
            Body::Stream { inner } => !inner.is_end_stream(),
            Body::Boxed { inner } => !inner.is_end_stream(),
            _ => false,
        };
        if !streamed {
            return None;
        }
        let inner = match std::mem::replace(self, Body::empty()) {
            Body::Stream { inner } => Source::Hyper(inner),
            Body::Boxed { inner } => Source::Other(inner),
            _ => unreachable!("matched above"),
        };
        let progress = Arc::new(BodyProgress::started());
        *self = Body::Tracked {
            inner: Box::new(Tracked {
                inner,
                progress: progress.clone(),
                seen: 0,
                max: u64::MAX,
                tee: None,
                counted: None,
            }),
        };
        Some(progress)
    }

    /// Counts the bytes of a body still to be streamed from the client in
    /// `stats` (its route's or runtime's), when the body is dropped: all
    /// of it once read, or as much as came before the request ended. A
    /// body in memory or empty is left as it is (a GET costs nothing).
    pub fn count_into(&mut self, stats: &'static metrics::RouteStats) {
        if self.track().is_some()
            && let Body::Tracked { inner } = self
        {
            inner.counted = Some(stats);
        }
    }

    /// A copy of a body still to be streamed from the client, fed as the
    /// body is read (see [`crate::tee`]); `None` for a body in memory,
    /// or empty.
    pub fn tee(&mut self, cut: Arc<AtomicU64>) -> Option<crate::tee::Copy> {
        self.track()?;
        let Body::Tracked { inner } = self else {
            return None;
        };
        let (sender, copy) = crate::tee::pair(inner.inner.size_hint().exact(), cut);
        inner.tee = Some(Box::new(sender));
        Some(copy)
    }

    /// Ends a body still to be streamed from the client with [`TooLarge`]
    /// once more than `max` bytes of it have come (a body of declared
    /// length is checked against its `Content-Length` before this).
    pub fn limit(&mut self, max: u64) {
        if self.track().is_some()
            && let Body::Tracked { inner } = self
        {
            inner.max = max;
        }
    }
}

/// Where a client's streamed body comes from: hyper's connection
/// (HTTP/1.1, HTTP/2) or another reader (HTTP/3's QUIC stream).
enum Source {
    Hyper(Incoming),
    Other(Pin<Box<dyn http_body::Body<Data = Bytes, Error = BodyError> + Send>>),
}

impl Source {
    fn poll_frame(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self {
            Source::Hyper(inner) => Pin::new(inner).poll_frame(cx).map_err(Into::into),
            Source::Other(inner) => inner.as_mut().poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Source::Hyper(inner) => inner.is_end_stream(),
            Source::Other(inner) => inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Source::Hyper(inner) => inner.size_hint(),
            Source::Other(inner) => inner.size_hint(),
        }
    }
}

/// A streamed request body and its progress.
pub struct Tracked {
    inner: Source,
    progress: Arc<BodyProgress>,
    /// Bytes come so far, and how many the route takes.
    seen: u64,
    max: u64,
    /// Where a copy of each frame goes (a mirror), while it keeps up.
    tee: Option<Box<crate::tee::Sender>>,
    /// Where the bytes read are counted, when the body is dropped.
    counted: Option<&'static metrics::RouteStats>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        if let Some(stats) = self.counted {
            stats.received(self.seen);
        }
    }
}

/// A request body over its route's `max_request_body`: the error the body
/// ends with, told apart from a client's broken body by its type.
#[derive(Debug, thiserror::Error)]
#[error("request body larger than the route's max_request_body of {0} bytes")]
pub struct TooLarge(pub u64);

/// Whether a client's body error is bytes that break the framing, as
/// hyper's decoder reports them (`InvalidInput`, `InvalidData`), rather
/// than a connection that ended early.
fn is_malformed(e: &BodyError) -> bool {
    let Some(e) = e.downcast_ref::<hyper::Error>() else {
        return false;
    };
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        if let Some(io) = inner.downcast_ref::<std::io::Error>() {
            return matches!(
                io.kind(),
                std::io::ErrorKind::InvalidInput | std::io::ErrorKind::InvalidData
            );
        }
        source = inner.source();
    }
    false
}

impl From<Incoming> for Body {
    fn from(inner: Incoming) -> Body {
        Body::Stream { inner }
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.project() {
            BodyProj::Stream { inner } => inner.poll_frame(cx).map_err(Into::into),
            BodyProj::Tracked { inner } => {
                let Tracked {
                    inner,
                    progress,
                    seen,
                    max,
                    tee,
                    ..
                } = &mut **inner;
                let polled = inner.poll_frame(cx);
                match &polled {
                    Poll::Ready(Some(Ok(frame))) => {
                        let n = frame.data_ref().map_or(0, |d| d.len() as u64);
                        *seen += n;
                        if *seen > *max {
                            progress.too_large.store(true, Ordering::Relaxed);
                            *tee = None;
                            return Poll::Ready(Some(Err(TooLarge(*max).into())));
                        }
                        let ended = inner.is_end_stream();
                        progress.moved(ended);
                        if let Some(copy) = tee {
                            if !copy.send(frame) {
                                // It cannot keep up: dropped, cut.
                                *tee = None;
                            } else if ended && let Some(copy) = tee.take() {
                                copy.finish();
                            }
                        }
                    }
                    Poll::Ready(None) => {
                        progress.moved(true);
                        if let Some(copy) = tee.take() {
                            copy.finish();
                        }
                    }
                    Poll::Pending => progress.waiting.store(true, Ordering::Relaxed),
                    Poll::Ready(Some(Err(e))) => {
                        *tee = None;
                        if is_malformed(e) {
                            progress.malformed.store(true, Ordering::Relaxed);
                        }
                    }
                }
                polled
            }
            BodyProj::Upstream { inner } => Pin::new(inner).poll_frame(cx).map_err(Into::into),
            BodyProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            BodyProj::Boxed { inner } => inner.as_mut().poll_frame(cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Body::Stream { inner } => inner.is_end_stream(),
            Body::Tracked { inner } => inner.inner.is_end_stream(),
            Body::Upstream { inner } => inner.is_end_stream(),
            Body::Full { data } => data.is_none(),
            Body::Boxed { inner } => inner.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Body::Stream { inner } => inner.size_hint(),
            Body::Tracked { inner } => inner.inner.size_hint(),
            Body::Upstream { inner } => inner.size_hint(),
            Body::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
            Body::Boxed { inner } => inner.size_hint(),
        }
    }
}

pin_project_lite::pin_project! {
    /// A response body on its way to the client. It carries the request's
    /// access-log record and metrics, written when the body is finished or
    /// dropped, so the logged duration and byte count cover the whole
    /// response.
    pub struct ResponseBody {
        #[pin]
        inner: Body,
        log: Option<Box<AccessLog>>,
        // Dropped after `log` (fields drop in order): the access-log line
        // is written first, the counters right after.
        counted: Option<metrics::Pending>,
        // The client's socket, watched once the body has waited on the
        // upstream for a while (a quiet stream), so a client that left
        // ends it.
        watch: Option<ClientSocket>,
        // Made when the body first waits: most never do.
        waits: Option<Pin<Box<Waits>>>,
        // The upstream connection and in-flight count, released when the
        // body ends so the connection can serve the next request.
        held: Held,
        // Tells the connection's head deadline that the response is done.
        ended: Option<Ended>,
    }
}

pin_project_lite::pin_project! {
    /// What a response body keeps once it has waited on the upstream.
    struct Waits {
        // The client's socket, watched from a while on.
        gone: Option<Gone>,
        // The upstream's read timeout, from when the body last began to
        // wait.
        #[pin]
        stall: tokio::time::Sleep,
        waiting: bool,
    }
}

impl ResponseBody {
    /// Wraps `inner`, logging with `log` and counting with `counted` when
    /// done.
    pub fn new(
        inner: Body,
        mut log: Option<Box<AccessLog>>,
        counted: Option<metrics::Pending>,
        mut held: Held,
    ) -> Self {
        if inner.is_end_stream() {
            held.finish();
        }
        if let Some(log) = log.as_mut() {
            // Until the body ends: one dropped before that (its HTTP/2
            // client reset the stream mid-response) was cut short, as
            // one that broke or whose HTTP/1 client left was.
            log.aborted = !inner.is_end_stream();
        }
        ResponseBody {
            inner,
            log,
            counted,
            watch: None,
            waits: None,
            held,
            ended: None,
        }
    }

    /// Notes the response's end on its connection's head deadline when
    /// the body is dropped.
    pub fn set_ended(&mut self, ended: Ended) {
        self.ended = Some(ended);
    }

    /// Ends the body early if the client behind `socket` goes away while
    /// the body waits on the upstream.
    pub fn watching(mut self, socket: Option<ClientSocket>) -> Self {
        self.watch = socket;
        self
    }
}

impl http_body::Body for ResponseBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let mut this = self.project();
        let polled = this.inner.as_mut().poll_frame(cx);
        if polled.is_pending() {
            let limit = this.held.read_timeout();
            let watch = *this.watch;
            if watch.is_some() || !limit.is_zero() {
                // Only a body that waits gets clocks (and, after a while, a
                // watch of its client): most end without ever waiting.
                let waits = this.waits.get_or_insert_with(|| {
                    Box::pin(Waits {
                        gone: watch.map(Gone::after_a_while),
                        stall: tokio::time::sleep(limit),
                        waiting: false,
                    })
                });
                let w = waits.as_mut().project();
                if let Some(gone) = w.gone.as_mut()
                    && Pin::new(gone).poll(cx).is_ready()
                {
                    if let Some(log) = this.log.as_mut() {
                        log.aborted = true;
                    }
                    return Poll::Ready(Some(Err("the client went away".into())));
                }
                if !limit.is_zero() {
                    // Counted from when the body began to wait, not from
                    // the last frame: a client slow to read holds the body
                    // back, and that is not the upstream's silence.
                    let mut stall = w.stall;
                    if !std::mem::replace(w.waiting, true) {
                        stall.as_mut().reset(tokio::time::Instant::now() + limit);
                    }
                    if stall.poll(cx).is_ready() {
                        let (route, upstream) = this.log.as_mut().map_or((None, None), |log| {
                            log.aborted = true;
                            (log.route.clone(), log.upstream.clone())
                        });
                        tracing::warn!(route = route.as_deref(), upstream = upstream.as_deref(), read_timeout = ?limit, "upstream sent nothing within the read timeout; response cut");
                        return Poll::Ready(Some(Err(format!(
                            "the upstream sent nothing for {limit:?}"
                        )
                        .into())));
                    }
                }
            }
        } else if let Some(waits) = this.waits.as_mut() {
            *waits.as_mut().project().waiting = false;
        }
        let ended = match &polled {
            Poll::Ready(None) => true,
            Poll::Ready(Some(Ok(_))) => this.inner.is_end_stream(),
            _ => false,
        };
        if ended {
            this.held.finish();
            if let Some(log) = this.log.as_mut() {
                log.aborted = false;
            }
        }
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            if let Some(log) = this.log.as_mut() {
                log.bytes_sent += data.len() as u64;
            }
            if let Some(counted) = this.counted.as_ref() {
                counted.stats.sent(data.len() as u64);
            }
        }
        if let (Poll::Ready(Some(Err(e))), Some(log)) = (&polled, this.log.as_mut()) {
            log.aborted = true;
            // The access line says `aborted`; this says why, as nginx's
            // "upstream prematurely closed connection" does (a client that
            // leaves stops the polling instead, and is not logged here).
            tracing::warn!(
                route = log.route.as_deref(),
                upstream = log.upstream.as_deref(),
                endpoint = log.endpoint.as_ref().map(tracing::field::display),
                error = %e,
                "response cut: the upstream's body broke"
            );
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod layout {
    use super::*;

    /// A response goes through a dozen moves a request (out of the
    /// exchange, through the pipeline, into hyper), each a `memcpy`; past
    /// 256 bytes the C library's copy runs a loop and costs about twice as
    /// much (~25 instructions more a move). `Held`, `Pending` and
    /// `InFlight` were cut to fit (#66).
    #[test]
    fn a_response_fits_the_short_copy() {
        assert!(
            std::mem::size_of::<http::Response<ResponseBody>>() <= 256,
            "Response<ResponseBody> is {} bytes",
            std::mem::size_of::<http::Response<ResponseBody>>()
        );
    }
}
