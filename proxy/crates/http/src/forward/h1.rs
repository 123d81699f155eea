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
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Response, StatusCode, Version};
use http_body::{Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Sleep;
use tokio_rustls::client::TlsStream;

use super::pool::Slot;

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
    /// Its age and use, for the pool's reuse limits.
    pub worn: super::pool::Worn,
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
            worn: super::pool::Worn::default(),
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
    pub fn recycle(&mut self, mut headers: HeaderMap) {
        if headers.capacity() <= SPARE_HEADERS {
            headers.clear();
            self.spare = headers;
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
    /// path). The deadline is looked at here, between reads, rather than
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
        headers: &HeaderMap,
        body: Option<&[u8]>,
        mut deadline: Option<&mut Pin<Box<Sleep>>>,
    ) -> Result<(Response<()>, Framing), ExchangeError> {
        self.read_size = FIRST_READ;
        encode_head(&mut self.head, method, prefix, path, host, headers, body);
        if let Err(e) = self.io.write_all(&self.head).await {
            return Err(ExchangeError::Closed(format!("writing the request: {e}")));
        }
        let mut received = false;
        loop {
            if !self.buf.is_empty() {
                received = true;
                if let Some(mut resp) = take_head(&mut self.buf, &mut self.spare)? {
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
                    let framing = framing(method, &mut resp)?;
                    // A chunked body already broken in what came with the
                    // head is a 502 while nothing has gone to the client;
                    // once streamed it could only be cut short, and the
                    // client would get no answer at all.
                    if framing == Framing::Chunked {
                        sound_chunks(&self.buf).map_err(|e| {
                            ExchangeError::Failed(format!("upstream response body: {e}"))
                        })?;
                    }
                    return Ok((resp, framing));
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

fn head_too_large() -> ExchangeError {
    ExchangeError::Failed(format!(
        "upstream response head is larger than {} KiB",
        MAX_HEAD / 1024
    ))
}

/// Writes the request head, then `body`, into `out`. Header values are
/// valid by construction (`HeaderValue` holds no CR or LF), so nothing
/// needs escaping. The body's length is written from the bytes at hand;
/// a `Content-Length` in `headers` is not copied.
fn encode_head(
    out: &mut Vec<u8>,
    method: &Method,
    prefix: &str,
    path: &str,
    host: Option<&HeaderValue>,
    headers: &HeaderMap,
    body: Option<&[u8]>,
) {
    out.clear();
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(prefix.as_bytes());
    out.extend_from_slice(path.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\n");
    if let Some(host) = host {
        out.extend_from_slice(b"host: ");
        out.extend_from_slice(host.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    for (name, value) in headers {
        if name == header::CONTENT_LENGTH {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    match body {
        Some(b) if !b.is_empty() => {
            use std::io::Write as _;
            let _ = write!(out, "content-length: {}\r\n\r\n", b.len());
            out.extend_from_slice(b);
            return;
        }
        // Some servers refuse a POST or PUT without a length (411), even
        // an empty one; hyper adds it the same way.
        _ if needs_zero_length(method) => out.extend_from_slice(b"content-length: 0\r\n"),
        _ => {}
    }
    out.extend_from_slice(b"\r\n");
}

fn needs_zero_length(m: &Method) -> bool {
    !matches!(
        *m,
        Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS | Method::TRACE
    ) && *m != Method::CONNECT
}

/// Takes a whole response head off the front of `buf`: `None` while it is
/// incomplete. Header values share the head's bytes rather than being
/// copied; the header map is `spare`'s when it has one. A plain function
/// (not async): its 4 KiB of parse state lives on the stack for the call
/// only, not in every request's future.
fn take_head(
    buf: &mut BytesMut,
    spare: &mut HeaderMap,
) -> Result<Option<Response<()>>, ExchangeError> {
    // Left uninitialized: 128 fields and their spans are 6 KiB, and writing
    // them all out for every response (~6 fields) cost more than parsing.
    let mut fields = [const { std::mem::MaybeUninit::<httparse::Header>::uninit() }; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut []);
    let len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut parsed,
        buf,
        &mut fields,
    ) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(ExchangeError::Failed(format!(
                "upstream response has more than {MAX_HEADERS} header fields"
            )));
        }
        Err(e) => return Err(ExchangeError::Failed(format!("invalid response head: {e}"))),
    };
    if len > MAX_HEAD {
        return Err(head_too_large());
    }
    let status = parsed
        .code
        .and_then(|c| StatusCode::from_u16(c).ok())
        .ok_or_else(|| ExchangeError::Failed("invalid response status".into()))?;
    let version = match parsed.version {
        Some(0) => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    // Where each field sits in the head, to slice the frozen bytes with.
    let base = buf.as_ptr() as usize;
    // Offsets fit in u32: the head is at most MAX_HEAD bytes.
    let mut spans = [const { std::mem::MaybeUninit::<[u32; 4]>::uninit() }; MAX_HEADERS];
    let n = parsed.headers.len();
    for (span, h) in spans.iter_mut().zip(parsed.headers.iter()) {
        span.write([
            (h.name.as_ptr() as usize - base) as u32,
            h.name.len() as u32,
            (h.value.as_ptr() as usize - base) as u32,
            h.value.len() as u32,
        ]);
    }
    let head = buf.split_to(len).freeze();
    let mut resp = Response::new(());
    *resp.status_mut() = status;
    *resp.version_mut() = version;
    let headers = resp.headers_mut();
    *headers = std::mem::take(spare);
    headers.reserve(n);
    for span in &spans[..n] {
        // SAFETY: the loop above wrote the first `n` spans.
        let [ns, nl, vs, vl] = unsafe { span.assume_init() }.map(|x| x as usize);
        let name = HeaderName::from_bytes(&head[ns..ns + nl]).map_err(|_| {
            ExchangeError::Failed(format!(
                "invalid header name `{}` in the response",
                String::from_utf8_lossy(&head[ns..ns + nl])
            ))
        })?;
        // SAFETY: httparse accepted the value, and its value bytes (tab,
        // visible ASCII, space, obs-text; no other control byte, no DEL) are
        // exactly the ones `HeaderValue` allows; obs-fold is refused by the
        // default parser config. hyper relies on the same for its heads;
        // checking every byte again cost 3% of a forwarded request.
        let value = unsafe { HeaderValue::from_maybe_shared_unchecked(head.slice(vs..vs + vl)) };
        headers.append(name, value);
    }
    Ok(Some(resp))
}

/// How the response body is delimited (RFC 9112 §6.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// This many bytes follow (0: no body).
    Length(u64),
    /// Chunked transfer coding.
    Chunked,
    /// The body runs until the upstream closes the connection.
    UntilClose,
}

/// The response's framing; also drops a `Content-Length` that a
/// `Transfer-Encoding` overrides, so it cannot reach the client.
fn framing(method: &Method, resp: &mut Response<()>) -> Result<Framing, ExchangeError> {
    let status = resp.status();
    let bodiless = *method == Method::HEAD
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED;
    let version = resp.version();
    let headers = resp.headers_mut();
    if headers.contains_key(header::TRANSFER_ENCODING) {
        // HTTP/1.0 has no transfer codings: RFC 9112 §6.1 says to treat
        // such framing as faulty, as hyper's client does.
        if version == Version::HTTP_10 {
            return Err(ExchangeError::Failed(
                "upstream sent an HTTP/1.0 response with Transfer-Encoding, whose framing cannot be trusted"
                    .into(),
            ));
        }
        // Also without a body (RFC 9112 §6.3: a proxy removes it before
        // forwarding): a HEAD answer's length is the GET's, which the
        // coding says this one is not.
        headers.remove(header::CONTENT_LENGTH);
        if bodiless {
            return Ok(Framing::Length(0));
        }
        let last = headers
            .get_all(header::TRANSFER_ENCODING)
            .iter()
            .next_back()
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.rsplit(',').next())
            .map(str::trim);
        return Ok(match last {
            Some(c) if c.eq_ignore_ascii_case("chunked") => Framing::Chunked,
            _ => Framing::UntilClose,
        });
    }
    if bodiless {
        return Ok(Framing::Length(0));
    }
    let mut length = None;
    for value in headers.get_all(header::CONTENT_LENGTH) {
        // The usual value, digits only: no split, no trim.
        let digits = value.as_bytes();
        if !digits.is_empty() && digits.len() <= 19 && digits.iter().all(u8::is_ascii_digit) {
            let n = digits
                .iter()
                .fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
            if length.is_some_and(|l| l != n) {
                return Err(invalid_length(value));
            }
            length = Some(n);
            continue;
        }
        // "42, 42" (a repeated field folded) is allowed; different numbers are not.
        for part in value.to_str().unwrap_or("x").split(',') {
            let n = part.trim();
            let n = (!n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                .then(|| n.parse::<u64>().ok())
                .flatten()
                .ok_or_else(|| invalid_length(value))?;
            if length.is_some_and(|l| l != n) {
                return Err(invalid_length(value));
            }
            length = Some(n);
        }
    }
    Ok(match length {
        Some(n) => Framing::Length(n),
        None => Framing::UntilClose,
    })
}

fn invalid_length(v: &HeaderValue) -> ExchangeError {
    ExchangeError::Failed(format!(
        "invalid Content-Length `{}` in the response",
        String::from_utf8_lossy(v.as_bytes())
    ))
}

/// Whether the connection may carry another request after this response.
pub fn keeps_alive(resp: &Response<()>, framing: Framing) -> bool {
    if framing == Framing::UntilClose || resp.version() != Version::HTTP_11 {
        return false;
    }
    !resp.headers().get_all(header::CONNECTION).iter().any(|v| {
        // Most upstreams say just `keep-alive`: no split, no trim.
        !v.as_bytes().eq_ignore_ascii_case(b"keep-alive")
            && v.to_str()
                .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("close")))
    })
}

/// Where the body reader is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
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

/// A response body read from the upstream connection as it is polled.
/// When the body ends the connection returns to its slot (if it can carry
/// another request); dropped before that, the connection is closed.
pub struct H1Body {
    conn: Option<Box<H1Conn>>,
    state: State,
    /// Where the connection goes when the body ends; `None` to close it.
    home: Option<Arc<Slot>>,
}

/// What went wrong with a response body.
#[derive(Debug, thiserror::Error)]
#[error("upstream response body: {0}")]
pub struct BodyError(String);

impl H1Body {
    /// The body of a response that arrived on `conn`.
    pub fn new(conn: Box<H1Conn>, framing: Framing, home: Option<Arc<Slot>>) -> H1Body {
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
    fn end(&mut self) {
        self.state = State::Done;
        if let (Some(mut conn), Some(home)) = (self.conn.take(), self.home.take())
            && conn.buf.is_empty()
        {
            conn.shrink();
            home.put_h1(conn);
        }
    }

    fn fail(&mut self, msg: String) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.conn = None;
        self.state = State::Done;
        Poll::Ready(Some(Err(BodyError(msg))))
    }

    /// Consumes the chunked framing that is already buffered, up to the
    /// next chunk's data, so the end of the body is seen as soon as its
    /// bytes are in (and the connection freed before the client asks again).
    fn settle(&mut self) -> Result<(), String> {
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
fn take_line(buf: &mut BytesMut) -> Result<Option<Bytes>, String> {
    Ok(line_end(buf)?.map(|i| {
        let mut line = buf.split_to(i + 2);
        line.truncate(i);
        line.freeze()
    }))
}

/// Where the CR of the first line's CRLF is in `buf`, if a whole line is
/// there ([`take_line`]'s rules).
fn line_end(buf: &[u8]) -> Result<Option<usize>, String> {
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
fn sound_chunks(mut buf: &[u8]) -> Result<(), String> {
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
fn chunk_size(line: &[u8]) -> Result<u64, String> {
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

#[cfg(test)]
mod tests;
