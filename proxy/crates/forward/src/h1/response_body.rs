//! An upstream's response body, read as its framing says (length, chunks, to the close), chunk by chunk.

use super::*;

/// Where the body reader is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum State {
    /// Bytes left in a `Content-Length` body.
    Length(u64),
    /// Before a chunk-size line.
    ChunkSize,
    /// Bytes left in the current chunk.
    ChunkData(u64),
    /// The CRLF after a chunk's data.
    ChunkEnd,
    /// After the last chunk: trailer lines up to an empty one.
    Trailers,
    /// Until the upstream closes.
    UntilClose,
    /// The body has ended.
    Done,
}

/// Where a connection goes once its response has been read whole: the
/// pool's slot for its endpoint. A trait, so this reader does not name
/// the pool that holds it (one call through it per response).
pub trait Home: Send + Sync {
    /// Takes `conn` back, to be used again or closed.
    fn put_h1(&self, conn: Box<H1Conn>);
}

/// A response body read from the upstream connection as it is polled.
/// When the body ends the connection returns to its slot (if it can carry
/// another request); dropped before that, the connection is closed.
pub struct H1Body {
    pub(super) conn: Option<Box<H1Conn>>,
    pub(super) state: State,
    /// Where the connection goes when the body ends; `None` to close it.
    pub(super) home: Option<Arc<dyn Home>>,
}

/// What went wrong with a response body.
#[derive(Debug, thiserror::Error)]
#[error("upstream response body: {0}")]
pub struct BodyError(String);

impl H1Body {
    /// The body of a response that arrived on `conn`.
    pub fn new(conn: Box<H1Conn>, framing: Framing, home: Option<Arc<dyn Home>>) -> H1Body {
        let state = match framing {
            Framing::Length(n) => State::Length(n),
            Framing::Chunked => State::ChunkSize,
            Framing::UntilClose => State::UntilClose,
        };
        let mut body = H1Body {
            conn: Some(conn),
            state,
            home,
        };
        if state == State::Length(0) {
            body.end();
        }
        body
    }

    /// The body is complete: give the connection back, or close it.
    pub(super) fn end(&mut self) {
        self.state = State::Done;
        if let (Some(mut conn), Some(home)) = (self.conn.take(), self.home.take())
            && conn.buf.is_empty()
        {
            conn.shrink();
            home.put_h1(conn);
        }
    }

    /// The whole body when all of it came with its head (a
    /// `Content-Length` body already read), taken as polling it would
    /// take it, the connection given back; `None`, and nothing taken,
    /// otherwise. Lets a plugin's head and body calls be made together
    /// without a poll that might leave half a body in hand.
    pub fn take_whole(&mut self) -> Option<Bytes> {
        let State::Length(n) = self.state else {
            return None;
        };
        let conn = self.conn.as_mut()?;
        let n = usize::try_from(n)
            .ok()
            .filter(|&n| n > 0 && n <= conn.buf.len())?;
        let data = conn.buf.split_to(n).freeze();
        self.end();
        Some(data)
    }

    pub(super) fn fail(&mut self, msg: String) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.conn = None;
        self.state = State::Done;
        Poll::Ready(Some(Err(BodyError(msg))))
    }

    /// Consumes the chunked framing that is already buffered, up to the
    /// next chunk's data, so the end of the body is seen as soon as its
    /// bytes are in (and the connection freed before the client asks again).
    pub(super) fn settle(&mut self) -> Result<(), String> {
        let Some(conn) = self.conn.as_mut() else {
            return Ok(());
        };
        loop {
            match self.state {
                State::ChunkEnd => {
                    let Some(line) = take_line(&mut conn.buf)? else {
                        return Ok(());
                    };
                    if !line.is_empty() {
                        return Err("chunk data longer than its size".into());
                    }
                    self.state = State::ChunkSize;
                }
                State::ChunkSize => {
                    let Some(line) = take_line(&mut conn.buf)? else {
                        return Ok(());
                    };
                    let size = chunk_size(&line)?;
                    self.state = if size == 0 {
                        State::Trailers
                    } else {
                        State::ChunkData(size)
                    };
                    if size != 0 {
                        return Ok(());
                    }
                }
                State::Trailers => {
                    // Trailer fields are dropped, as nginx does for HTTP/1.1.
                    let Some(line) = take_line(&mut conn.buf)? else {
                        return Ok(());
                    };
                    if line.is_empty() {
                        self.end();
                        return Ok(());
                    }
                }
                _ => return Ok(()),
            }
        }
    }
}

/// Takes one line (without its CRLF) off the front of `buf`, if a whole
/// line is there. A bare LF is refused: chunked coding's lines end in
/// CRLF (RFC 9112 7.1; the leave to take a bare LF is for the head), and
/// hyper's client, which reads the answers to streamed requests, refuses
/// it too, so an answer does not pass or fail by the request's body.
pub(super) fn take_line(buf: &mut BytesMut) -> Result<Option<Bytes>, String> {
    Ok(line_end(buf)?.map(|i| {
        let mut line = buf.split_to(i + 2);
        line.truncate(i);
        line.freeze()
    }))
}

/// Where the CR of the first line's CRLF is in `buf`, if a whole line is
/// there ([`take_line`]'s rules).
pub(super) fn line_end(buf: &[u8]) -> Result<Option<usize>, String> {
    match buf.iter().position(|&b| b == b'\n') {
        Some(i) if i == 0 || buf[i - 1] != b'\r' => {
            Err("chunk framing line ends in a bare LF".into())
        }
        Some(i) => Ok(Some(i - 1)),
        None if buf.len() > MAX_LINE => Err("chunk framing line too long".into()),
        None => Ok(None),
    }
}

/// Checks the chunked framing in `buf`, the start of a body, as far as
/// it goes, without taking anything: the body reader reads it again as
/// it streams.
pub(super) fn sound_chunks(mut buf: &[u8]) -> Result<(), String> {
    while let Some(end) = line_end(buf)? {
        let size = chunk_size(&buf[..end])?;
        if size == 0 {
            // Trailers are the body reader's.
            return Ok(());
        }
        let Some(after) = usize::try_from(size)
            .ok()
            .and_then(|n| buf.get(end + 2 + n..))
        else {
            return Ok(());
        };
        buf = match after {
            [b'\r', b'\n', rest @ ..] => rest,
            [] | [b'\r'] => return Ok(()),
            _ => return Err("chunk data longer than its size".into()),
        };
    }
    Ok(())
}

/// The size in a chunk-size line (`1a3f` or `1a3f;ext=value`).
pub(super) fn chunk_size(line: &[u8]) -> Result<u64, String> {
    let digits = line
        .split(|&b| b == b';')
        .next()
        .unwrap_or_default()
        .trim_ascii();
    if digits.is_empty() || digits.len() > 15 {
        return Err(format!(
            "invalid chunk size `{}`",
            String::from_utf8_lossy(line)
        ));
    }
    digits.iter().try_fold(0u64, |n, &b| {
        let d = (b as char)
            .to_digit(16)
            .ok_or_else(|| format!("invalid chunk size `{}`", String::from_utf8_lossy(line)))?;
        Ok(n * 16 + d as u64)
    })
}

impl http_body::Body for H1Body {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        loop {
            if let Err(e) = this.settle() {
                return this.fail(e);
            }
            let Some(conn) = this.conn.as_mut() else {
                return Poll::Ready(None);
            };
            let want = match this.state {
                State::Done => return Poll::Ready(None),
                State::Length(n) | State::ChunkData(n) => n,
                State::UntilClose => u64::MAX,
                // Framing lines not all buffered yet: read more.
                State::ChunkSize | State::ChunkEnd | State::Trailers => 0,
            };
            if want > 0 && !conn.buf.is_empty() {
                let n = conn
                    .buf
                    .len()
                    .min(usize::try_from(want).unwrap_or(usize::MAX));
                let data = conn.buf.split_to(n).freeze();
                let left = want - n as u64;
                match this.state {
                    State::Length(_) if left == 0 => this.end(),
                    State::Length(_) => this.state = State::Length(left),
                    State::ChunkData(_) if left == 0 => this.state = State::ChunkEnd,
                    State::ChunkData(_) => this.state = State::ChunkData(left),
                    _ => {}
                }
                if let Err(e) = this.settle() {
                    return this.fail(e);
                }
                return Poll::Ready(Some(Ok(Frame::data(data))));
            }
            match ready!(conn.poll_fill(cx)) {
                Ok(0) if this.state == State::UntilClose => {
                    this.state = State::Done;
                    this.conn = None;
                    return Poll::Ready(None);
                }
                Ok(0) => {
                    return this
                        .fail("upstream closed the connection before the body ended".into());
                }
                Ok(_) => {}
                Err(e) => return this.fail(format!("reading from the upstream: {e}")),
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.state == State::Done
    }

    fn size_hint(&self) -> SizeHint {
        match self.state {
            State::Length(n) => SizeHint::with_exact(n),
            State::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}
