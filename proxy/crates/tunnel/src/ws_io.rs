//! A WebSocket connection as a byte stream, so HTTP/2 can run over it:
//! each write becomes one binary message, reads concatenate the binary
//! messages received. Pings are answered by tungstenite as it reads.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use futures_util::{Sink, Stream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;

/// Byte-stream view of a WebSocket.
pub struct WsIo<S> {
    ws: WebSocketStream<S>,
    /// The unread rest of the last message.
    pending: Bytes,
}

impl<S> WsIo<S> {
    /// Wraps an established WebSocket.
    pub fn new(ws: WebSocketStream<S>) -> WsIo<S> {
        WsIo {
            ws,
            pending: Bytes::new(),
        }
    }
}

fn to_io(e: tokio_tungstenite::tungstenite::Error) -> io::Error {
    use tokio_tungstenite::tungstenite::Error;
    match e {
        Error::Io(e) => e,
        Error::ConnectionClosed | Error::AlreadyClosed => io::ErrorKind::BrokenPipe.into(),
        e => io::Error::other(e),
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for WsIo<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        loop {
            if !self.pending.is_empty() {
                let n = buf.remaining().min(self.pending.len());
                let chunk = self.pending.split_to(n);
                buf.put_slice(&chunk);
                return Poll::Ready(Ok(()));
            }
            match ready!(Pin::new(&mut self.ws).poll_next(cx)) {
                Some(Ok(Message::Binary(data))) => self.pending = data,
                // The peer closed: end of stream.
                Some(Ok(Message::Close(_))) | None => return Poll::Ready(Ok(())),
                // Pings are answered inside tungstenite; text has no place here.
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Poll::Ready(Err(to_io(e))),
            }
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for WsIo<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        ready!(Pin::new(&mut self.ws).poll_ready(cx)).map_err(to_io)?;
        Pin::new(&mut self.ws)
            .start_send(Message::Binary(Bytes::copy_from_slice(buf)))
            .map_err(to_io)?;
        Poll::Ready(Ok(buf.len()))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        // One message for what HTTP/2 hands over at once (frame header and
        // payload), instead of one per slice.
        ready!(Pin::new(&mut self.ws).poll_ready(cx)).map_err(to_io)?;
        let len = bufs.iter().map(|b| b.len()).sum();
        let mut data = Vec::with_capacity(len);
        for b in bufs {
            data.extend_from_slice(b);
        }
        Pin::new(&mut self.ws)
            .start_send(Message::Binary(data.into()))
            .map_err(to_io)?;
        Poll::Ready(Ok(len))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.ws).poll_flush(cx).map_err(to_io)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.ws).poll_close(cx).map_err(to_io)
    }
}
