//! A WebSocket connection, once its handshake is done, as a byte stream
//! for HTTP/2 (RFC 6455 §5): each write goes out as one binary frame,
//! and reads return the payloads of the data frames received, one after
//! another. Pings are answered, a close is answered and read as the end.
//!
//! Framed here rather than by tungstenite (which still makes the
//! handshakes' keys, `websocket.rs`): tungstenite's read buffer, zeroed
//! before every read, and its write buffer stayed with every idle tunnel
//! at the size of the largest frame it had carried, and each byte was
//! copied twice more on its way (measured: bench/idle-tunnels.sh, "after
//! traffic"). Here a payload is read straight into the reader's buffer
//! and unmasked there, and a frame to write is built in a buffer that is
//! freed once it is written: an idle tunnel holds no buffer of its own.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// Which end of the connection this is: a client masks the frames it
/// sends, and a server takes only masked frames (RFC 6455 §5.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The end that dialled (the tunnel client).
    Client,
    /// The end that accepted (the tunnel server).
    Server,
}

/// The longest frame head: 2 bytes, a 64-bit length, a mask.
const MAX_HEAD: usize = 14;
/// The most one write puts in a frame: HTTP/2 writes its frames whole
/// (16 KiB of payload, with a header or two), so one frame per write.
const MAX_FRAME: usize = 64 << 10;
/// Pongs and the close answer wait in the write buffer; past this much
/// unwritten, the reader waits for the writer before taking more pings.
const MAX_UNSENT_ANSWERS: usize = 4 << 10;

const OP_CONTINUATION: u8 = 0x0;
const OP_TEXT: u8 = 0x1;
const OP_BINARY: u8 = 0x2;
const OP_CLOSE: u8 = 0x8;
const OP_PING: u8 = 0x9;
const OP_PONG: u8 = 0xA;

/// A control frame being read: its opcode and payload (at most 125 bytes).
struct Control {
    opcode: u8,
    len: u8,
    got: u8,
    mask: Option<[u8; 4]>,
    payload: [u8; 125],
}

/// Byte-stream view of a WebSocket connection whose handshake is done.
pub struct WsIo<S> {
    io: S,
    role: Role,
    /// Bytes read with the handshake's head, taken before the stream's
    /// (freed once taken).
    carried: Vec<u8>,
    carried_at: usize,
    /// A frame head being read, and any bytes read past it.
    head: [u8; MAX_HEAD],
    head_at: u8,
    head_end: u8,
    /// The data frame being read: payload bytes still to come, its mask
    /// and where in the mask the next byte is.
    data_left: u64,
    data_mask: Option<[u8; 4]>,
    mask_at: usize,
    /// A control frame being read (boxed: rare, and ~130 bytes).
    control: Option<Box<Control>>,
    /// The peer's close came, or its stream ended: reads end.
    read_closed: bool,
    /// Whole frames to write, from `out_at`; freed when written.
    out: Vec<u8>,
    out_at: usize,
    /// This end's close frame is queued.
    close_queued: bool,
    /// A client's masks.
    masks: Option<Box<Masks>>,
}

impl<S> WsIo<S> {
    /// Wraps a connection whose handshake read `carried` past its head
    /// (the first bytes of the frames).
    pub fn new(io: S, role: Role, carried: Vec<u8>) -> WsIo<S> {
        WsIo {
            io,
            role,
            carried,
            carried_at: 0,
            head: [0; MAX_HEAD],
            head_at: 0,
            head_end: 0,
            data_left: 0,
            data_mask: None,
            mask_at: 0,
            control: None,
            read_closed: false,
            out: Vec::new(),
            out_at: 0,
            close_queued: false,
            masks: (role == Role::Client).then(|| Box::new(Masks::new())),
        }
    }
}

fn protocol_error(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("WebSocket protocol error: {what}"),
    )
}

/// A frame head, parsed.
struct Head {
    len: usize,
    opcode: u8,
    payload: u64,
    mask: Option<[u8; 4]>,
}

/// Parses the frame head at the start of `b`, `None` while incomplete.
fn parse_head(b: &[u8], role: Role) -> io::Result<Option<Head>> {
    if b.len() < 2 {
        return Ok(None);
    }
    let (fin, rsv, opcode) = (b[0] & 0x80 != 0, b[0] & 0x70, b[0] & 0x0F);
    let (masked, len7) = (b[1] & 0x80 != 0, b[1] & 0x7F);
    let ext = match len7 {
        126 => 2,
        127 => 8,
        _ => 0,
    };
    let len = 2 + ext + if masked { 4 } else { 0 };
    if b.len() < len {
        return Ok(None);
    }
    if rsv != 0 {
        return Err(protocol_error("reserved bits set, and no extension agreed"));
    }
    match (role, masked) {
        (Role::Server, false) => return Err(protocol_error("a client's frame is not masked")),
        (Role::Client, true) => return Err(protocol_error("a server's frame is masked")),
        _ => {}
    }
    let payload = match ext {
        2 => u64::from(u16::from_be_bytes([b[2], b[3]])),
        8 => u64::from_be_bytes(b[2..10].try_into().expect("8 bytes")),
        _ => u64::from(len7),
    };
    if payload >> 63 != 0 {
        return Err(protocol_error("frame length over 2^63"));
    }
    let mask = masked.then(|| b[2 + ext..len].try_into().expect("4 bytes"));
    match opcode {
        OP_CONTINUATION | OP_BINARY => {}
        OP_TEXT => return Err(protocol_error("a text frame on a tunnel")),
        OP_CLOSE | OP_PING | OP_PONG if !fin || payload > 125 => {
            return Err(protocol_error(
                "a control frame fragmented or over 125 bytes",
            ));
        }
        OP_CLOSE | OP_PING | OP_PONG => {}
        other => return Err(protocol_error(&format!("unknown opcode {other:#x}"))),
    }
    Ok(Some(Head {
        len,
        opcode,
        payload,
        mask,
    }))
}

/// XORs `bytes` with `mask`, starting `at` bytes into it; returns where
/// the next byte is. Eight bytes at a time: a tunnel's request bodies all
/// pass through here.
fn apply_mask(bytes: &mut [u8], mask: [u8; 4], at: usize) -> usize {
    let mut m = [0u8; 8];
    for (i, b) in m.iter_mut().enumerate() {
        *b = mask[(at + i) % 4];
    }
    let word = u64::from_ne_bytes(m);
    let mut chunks = bytes.chunks_exact_mut(8);
    for chunk in &mut chunks {
        let v = u64::from_ne_bytes((&*chunk).try_into().expect("8 bytes")) ^ word;
        chunk.copy_from_slice(&v.to_ne_bytes());
    }
    for (i, b) in chunks.into_remainder().iter_mut().enumerate() {
        *b ^= m[i];
    }
    (at + bytes.len()) % 4
}

/// A client's masking keys: from the system's random source, 64 at a
/// time (a read of it per frame would be a system call per frame).
struct Masks {
    keys: [u8; 256],
    next: usize,
}

impl Masks {
    fn new() -> Masks {
        Masks {
            keys: [0; 256],
            next: 256,
        }
    }

    fn next(&mut self) -> [u8; 4] {
        use ring::rand::SecureRandom;
        if self.next == self.keys.len() {
            // ring's system source fails only where the OS has none.
            ring::rand::SystemRandom::new()
                .fill(&mut self.keys)
                .expect("the system's random source");
            self.next = 0;
        }
        let key = self.keys[self.next..self.next + 4]
            .try_into()
            .expect("4 bytes");
        self.next += 4;
        key
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> WsIo<S> {
    /// Reads into `dst`: the handshake's carried bytes first, then the
    /// stream's.
    fn poll_source(&mut self, cx: &mut Context<'_>, dst: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if self.carried_at < self.carried.len() {
            let n = dst.remaining().min(self.carried.len() - self.carried_at);
            dst.put_slice(&self.carried[self.carried_at..self.carried_at + n]);
            self.carried_at += n;
            if self.carried_at == self.carried.len() {
                self.carried = Vec::new();
                self.carried_at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.io).poll_read(cx, dst)
    }

    /// Appends a frame of `opcode` carrying `parts` to the write buffer.
    fn queue(&mut self, opcode: u8, parts: &[&[u8]]) {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let mask = self.masks.as_mut().map(|m| m.next());
        self.out.reserve(MAX_HEAD + len);
        self.out.push(0x80 | opcode);
        let mask_bit = if mask.is_some() { 0x80 } else { 0 };
        match len {
            0..=125 => self.out.push(mask_bit | len as u8),
            126..=0xFFFF => {
                self.out.push(mask_bit | 126);
                self.out.extend_from_slice(&(len as u16).to_be_bytes());
            }
            _ => {
                self.out.push(mask_bit | 127);
                self.out.extend_from_slice(&(len as u64).to_be_bytes());
            }
        }
        if let Some(mask) = mask {
            self.out.extend_from_slice(&mask);
        }
        let start = self.out.len();
        for part in parts {
            self.out.extend_from_slice(part);
        }
        if let Some(mask) = mask {
            apply_mask(&mut self.out[start..], mask, 0);
        }
    }

    /// Writes out what the write buffer holds, then frees it.
    fn poll_push(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while self.out_at < self.out.len() {
            let n = ready!(Pin::new(&mut self.io).poll_write(cx, &self.out[self.out_at..]))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.out_at += n;
        }
        if self.out.capacity() > 0 {
            self.out = Vec::new();
            self.out_at = 0;
        }
        Poll::Ready(Ok(()))
    }

    /// Writes out and flushes queued frames, if there are any.
    fn poll_flush_answers(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.out_at == self.out.len() {
            return Poll::Ready(Ok(()));
        }
        ready!(self.poll_push(cx))?;
        Pin::new(&mut self.io).poll_flush(cx)
    }

    /// Answers a whole control frame: a ping with its pong, a close with
    /// this end's close (the end of reading).
    fn answer(&mut self, control: &Control) {
        let payload = &control.payload[..usize::from(control.len)];
        match control.opcode {
            OP_PING if !self.close_queued => self.queue(OP_PONG, &[payload]),
            OP_CLOSE => {
                if !self.close_queued {
                    // The peer's status code back, as RFC 6455 §5.5.1 asks.
                    let code = payload.get(..2).unwrap_or(&[]);
                    self.queue(OP_CLOSE, &[code]);
                    self.close_queued = true;
                }
                self.read_closed = true;
            }
            _ => {}
        }
    }

    /// Reads the rest of the control frame under way; true once whole.
    fn poll_control(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<bool>> {
        let Some(mut control) = self.control.take() else {
            return Poll::Ready(Ok(true));
        };
        while control.got < control.len {
            let (got, len) = (usize::from(control.got), usize::from(control.len));
            let n = if self.head_at < self.head_end {
                let n = (len - got).min(usize::from(self.head_end - self.head_at));
                let at = usize::from(self.head_at);
                control.payload[got..got + n].copy_from_slice(&self.head[at..at + n]);
                self.head_at += n as u8;
                n
            } else {
                let mut dst = ReadBuf::new(&mut control.payload[got..len]);
                let polled = self.poll_source(cx, &mut dst);
                let n = dst.filled().len();
                match polled {
                    Poll::Pending => {
                        self.control = Some(control);
                        return Poll::Pending;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Ready(Ok(())) if n == 0 => {
                        return Poll::Ready(Err(io::ErrorKind::UnexpectedEof.into()));
                    }
                    Poll::Ready(Ok(())) => n,
                }
            };
            control.got += n as u8;
        }
        if let Some(mask) = control.mask {
            apply_mask(&mut control.payload[..usize::from(control.len)], mask, 0);
        }
        self.answer(&control);
        Poll::Ready(Ok(true))
    }

    /// Reads the next frame head (and sets up its payload's reading);
    /// `false` when the stream ended cleanly between frames.
    fn poll_head(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<bool>> {
        loop {
            let (at, end) = (usize::from(self.head_at), usize::from(self.head_end));
            if let Some(head) = parse_head(&self.head[at..end], self.role)? {
                self.head_at += head.len as u8;
                match head.opcode {
                    OP_CONTINUATION | OP_BINARY => {
                        self.data_left = head.payload;
                        self.data_mask = head.mask;
                        self.mask_at = 0;
                    }
                    opcode => {
                        self.control = Some(Box::new(Control {
                            opcode,
                            len: head.payload as u8,
                            got: 0,
                            mask: head.mask,
                            payload: [0; 125],
                        }));
                    }
                }
                return Poll::Ready(Ok(true));
            }
            // Move what there is to the front and read more after it.
            self.head.copy_within(at..end, 0);
            let kept = end - at;
            self.head_at = 0;
            self.head_end = kept as u8;
            let mut more = [0u8; MAX_HEAD];
            let mut dst = ReadBuf::new(&mut more[..MAX_HEAD - kept]);
            ready!(self.poll_source(cx, &mut dst))?;
            let n = dst.filled().len();
            self.head[kept..kept + n].copy_from_slice(&more[..n]);
            if n == 0 {
                return match kept {
                    0 => Poll::Ready(Ok(false)),
                    _ => Poll::Ready(Err(io::ErrorKind::UnexpectedEof.into())),
                };
            }
            self.head_end += n as u8;
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for WsIo<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        // Pongs and a close answer go out as reading goes on; a peer
        // that pings faster than it reads waits for them.
        if this.out_at < this.out.len() {
            let pushed = this.poll_flush_answers(cx);
            if this.out.len() - this.out_at > MAX_UNSENT_ANSWERS {
                ready!(pushed)?;
            }
        }
        loop {
            if this.read_closed {
                return Poll::Ready(Ok(()));
            }
            if this.control.is_some() {
                ready!(this.poll_control(cx))?;
                // Not waited for: the writer's next write or flush, or
                // the next read, pushes on.
                let _ = this.poll_flush_answers(cx);
                continue;
            }
            if this.data_left == 0 {
                if !ready!(this.poll_head(cx))? {
                    this.read_closed = true;
                }
                continue;
            }
            if buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            let want = (buf.remaining() as u64).min(this.data_left) as usize;
            // Payload read with the head first, then straight from the
            // stream into the reader's buffer.
            let n = if this.head_at < this.head_end {
                let at = usize::from(this.head_at);
                let n = want.min(usize::from(this.head_end) - at);
                let bytes = &mut this.head[at..at + n];
                if let Some(mask) = this.data_mask {
                    this.mask_at = apply_mask(bytes, mask, this.mask_at);
                }
                buf.put_slice(bytes);
                this.head_at += n as u8;
                n
            } else {
                let mut part = buf.take(want);
                ready!(this.poll_source(cx, &mut part))?;
                let n = part.filled().len();
                if n == 0 {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the WebSocket ended within a frame",
                    )));
                }
                if let Some(mask) = this.data_mask {
                    this.mask_at = apply_mask(part.filled_mut(), mask, this.mask_at);
                }
                // SAFETY: the `n` bytes `take` lent out were filled.
                unsafe { buf.assume_init(n) };
                buf.advance(n);
                n
            };
            this.data_left -= n as u64;
            return Poll::Ready(Ok(()));
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for WsIo<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.poll_write_vectored(cx, &[io::IoSlice::new(buf)])
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.close_queued {
            return Poll::Ready(Err(io::ErrorKind::BrokenPipe.into()));
        }
        // The frame before first: one frame in hand at most.
        ready!(this.poll_push(cx))?;
        // What HTTP/2 hands over at once (frame header and payload), in
        // one frame rather than one per slice.
        let mut parts: [&[u8]; 8] = [&[]; 8];
        let mut len = 0;
        for (part, b) in parts.iter_mut().zip(bufs.iter().filter(|b| !b.is_empty())) {
            let take = b.len().min(MAX_FRAME - len);
            *part = &b[..take];
            len += take;
            if len == MAX_FRAME {
                break;
            }
        }
        if len == 0 {
            return Poll::Ready(Ok(0));
        }
        this.queue(OP_BINARY, &parts);
        // Out now if the stream takes it; else on the next write or flush.
        if let Poll::Ready(Err(e)) = this.poll_push(cx) {
            return Poll::Ready(Err(e));
        }
        Poll::Ready(Ok(len))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_push(cx))?;
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.poll_push(cx))?;
        if !this.close_queued {
            // 1000: a normal closure.
            this.queue(OP_CLOSE, &[&1000u16.to_be_bytes()]);
            this.close_queued = true;
            ready!(this.poll_push(cx))?;
        }
        ready!(Pin::new(&mut this.io).poll_flush(cx))?;
        Pin::new(&mut this.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
