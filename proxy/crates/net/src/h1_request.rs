//! An HTTP/1.1 request as a server reads it off the wire: the head, and
//! how long the body that follows is (RFC 9112 §6), by rules that leave
//! no two readings of one message. The first piece of the routing core's
//! own HTTP/1.1 server codec (#66), checked by its unit tests and a fuzz
//! target before it serves a connection.
//!
//! A request the proxy would frame one way and an upstream another is how
//! requests are smuggled: the part one reads as the body, the other reads
//! as the next request. So every message whose framing is not plain is
//! refused, and its connection closed, never forwarded:
//! `Transfer-Encoding` beside `Content-Length` (CL.TE, TE.CL), a coding
//! list that is not exactly `chunked` (TE.TE obfuscations: `xchunked`,
//! `chunked, chunked`, `chunked` not last), `Transfer-Encoding` in an
//! HTTP/1.0 request, more than one `Content-Length` (even equal ones) or
//! one that is not plain digits, obs-fold, a line ended by a bare LF, a
//! `Host` missing from an HTTP/1.1 request or given twice; and in a chunked
//! body ([`ChunkedDecoder`]) a chunk size that is not plain hex, that
//! overflows, or data not followed by CRLF. An unknown transfer coding is
//! 501, a head over the limits 431, the rest 400 (as nginx, hyper and
//! Envoy answer them).

use std::mem::MaybeUninit;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, StatusCode, Version};

use crate::field_names::FieldNames;

/// The largest request head read, in bytes (hyper's default is 400 KiB;
/// nginx's `large_client_header_buffers` 4 x 8 KiB).
pub const MAX_HEAD: usize = 64 * 1024;
/// The most header fields in a head.
pub const MAX_HEADERS: usize = 128;
/// The longest chunk-size line (size and extensions).
const MAX_CHUNK_LINE: usize = 4096;
/// The largest trailer section of a chunked body.
const MAX_TRAILERS: usize = 16 * 1024;

/// A request head, parsed and its framing decided.
#[derive(Debug)]
pub struct RequestHead {
    pub method: Method,
    /// The request target as sent (origin, absolute, authority or `*`).
    pub target: Bytes,
    pub version: Version,
    pub headers: HeaderMap,
    pub body: BodyLength,
    /// Whether the connection ends after this request's answer.
    pub close: bool,
    /// `Expect: 100-continue`.
    pub expects_continue: bool,
    /// The whole head as read (its fields and target share these bytes):
    /// what a connection handed to another server reads again.
    pub raw: Bytes,
}

/// How the body that follows the head is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyLength {
    /// No body (no `Content-Length`, no `Transfer-Encoding`).
    Empty,
    /// `Content-Length` bytes.
    Known(u64),
    /// `Transfer-Encoding: chunked`: read with [`ChunkedDecoder`].
    Chunked,
}

/// Why a request was refused: its status, and what was wrong, for the
/// log. The connection is closed after the answer in every case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    pub status: StatusCode,
    pub why: &'static str,
}

fn bad(why: &'static str) -> Refused {
    Refused {
        status: StatusCode::BAD_REQUEST,
        why,
    }
}

/// Parses the request head at the start of `buf`: `Ok(None)` while it is
/// not all there (and still within [`MAX_HEAD`]), else the head and its
/// length in bytes. [`take_head`] on a copy, for tests and fuzzing.
pub fn parse_head(buf: &[u8]) -> Result<Option<(RequestHead, usize)>, Refused> {
    let mut taken = BytesMut::from(buf);
    let head = take_head(&mut taken, &mut FieldNames::default())?;
    Ok(head.map(|head| (head, buf.len() - taken.len())))
}

/// Takes the request head off the front of `buf` (the connection's read
/// buffer): `Ok(None)` while it is not all there (and still within
/// [`MAX_HEAD`]). The target and the field values share the head's bytes
/// rather than being copied, and the names are `names`' where the client
/// spelled them as in its last head, as the forwarding reads an
/// upstream's answers.
pub fn take_head(
    buf: &mut BytesMut,
    names: &mut FieldNames,
) -> Result<Option<RequestHead>, Refused> {
    // Left uninitialized: 128 fields are 4 KiB, and writing them all out
    // for every request (~6 fields) would cost more than parsing.
    let mut fields = [const { MaybeUninit::<httparse::Header>::uninit() }; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut []);
    let len = match httparse::ParserConfig::default().parse_request_with_uninit_headers(
        &mut req,
        buf,
        &mut fields,
    ) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() > MAX_HEAD => {
            return Err(too_large("request head over 64 KiB"));
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(too_large("more than 128 header fields"));
        }
        Err(_) => return Err(bad("malformed request head")),
    };
    if len > MAX_HEAD {
        return Err(too_large("request head over 64 KiB"));
    }
    // httparse takes a lone LF as a line's end, as RFC 9112 lets a
    // recipient; a proxy must not, since the next hop may not.
    if bare_lf(&buf[..len]) {
        return Err(bad("line ended by a bare LF"));
    }
    let version = match req.version {
        Some(0) => Version::HTTP_10,
        Some(1) => Version::HTTP_11,
        _ => return Err(bad("unknown HTTP version")),
    };
    let method = Method::from_bytes(req.method.unwrap_or_default().as_bytes())
        .map_err(|_| bad("invalid method"))?;
    // Where the target and each field sit in the head, to slice the frozen
    // bytes with (offsets fit in u32: the head is at most MAX_HEAD bytes).
    let base = buf.as_ptr() as usize;
    let at = |s: &[u8]| (s.as_ptr() as usize - base) as u32;
    let path = req.path.unwrap_or_default().as_bytes();
    let target = (at(path), path.len() as u32);
    let mut spans = [const { MaybeUninit::<[u32; 4]>::uninit() }; MAX_HEADERS];
    let n = req.headers.len();
    for (span, h) in spans.iter_mut().zip(req.headers.iter()) {
        span.write([
            at(h.name.as_bytes()),
            h.name.len() as u32,
            at(h.value),
            h.value.len() as u32,
        ]);
    }
    let head = buf.split_to(len).freeze();
    // Room for the fields the forwarding adds (X-Forwarded-*, a request
    // id): grown there, the map was rehashed and moved (~1,000
    // instructions a request, bench/versus-nginx.sh in a wired trial).
    let mut headers = HeaderMap::with_capacity(n + 6);
    for (i, span) in spans[..n].iter().enumerate() {
        // SAFETY: the loop above wrote the first `n` spans.
        let [ns, nl, vs, vl] = unsafe { span.assume_init() }.map(|x| x as usize);
        let name = names
            .name(i, &head[ns..ns + nl])
            .map_err(|_| bad("invalid field name"))?;
        // SAFETY: httparse accepted the value, and the bytes it accepts in
        // one (tab, visible ASCII, space, obs-text; no other control byte,
        // no DEL) are exactly those `HeaderValue` allows; obs-fold is
        // refused by the parser's default config. The forwarding takes an
        // upstream's values the same way.
        let value = unsafe { HeaderValue::from_maybe_shared_unchecked(head.slice(vs..vs + vl)) };
        headers.append(name, value);
    }
    let target = head.slice(target.0 as usize..(target.0 + target.1) as usize);
    let body = body_length(&headers, version)?;
    let hosts = headers.get_all(header::HOST).iter().count();
    if hosts > 1 || (hosts == 0 && version == Version::HTTP_11) {
        return Err(bad("an HTTP/1.1 request has one Host field"));
    }
    let close = match version {
        Version::HTTP_10 => !has_token(&headers, header::CONNECTION, "keep-alive"),
        _ => has_token(&headers, header::CONNECTION, "close"),
    };
    let expects_continue = headers
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    Ok(Some(RequestHead {
        method,
        target,
        version,
        headers,
        body,
        close,
        expects_continue,
        raw: head,
    }))
}

fn too_large(why: &'static str) -> Refused {
    Refused {
        status: StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
        why,
    }
}

/// Whether a LF in `head` is not preceded by a CR.
fn bare_lf(head: &[u8]) -> bool {
    head.iter()
        .enumerate()
        .any(|(i, &b)| b == b'\n' && (i == 0 || head[i - 1] != b'\r'))
}

/// Whether field `name`'s comma-separated values hold `token`.
fn has_token(headers: &HeaderMap, name: HeaderName, token: &str) -> bool {
    headers.get_all(name).iter().any(|v| {
        v.as_bytes()
            .split(|&b| b == b',')
            .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
    })
}

/// The body's framing by RFC 9112 §6.3, refusing every message two
/// readers could frame differently.
fn body_length(headers: &HeaderMap, version: Version) -> Result<BodyLength, Refused> {
    let codings = headers.get_all(header::TRANSFER_ENCODING);
    let lengths = headers.get_all(header::CONTENT_LENGTH);
    if codings.iter().next().is_some() {
        if version == Version::HTTP_10 {
            return Err(bad("Transfer-Encoding in an HTTP/1.0 request"));
        }
        if lengths.iter().next().is_some() {
            return Err(bad("both Transfer-Encoding and Content-Length"));
        }
        let mut list = codings
            .iter()
            .flat_map(|v| v.as_bytes().split(|&b| b == b','))
            .map(<[u8]>::trim_ascii);
        // Exactly `chunked`, once: a coding before it would have to be
        // undone here (none is), and anything else is a coding the next
        // hop may read otherwise.
        return match (list.next(), list.next()) {
            (Some(c), None) if c.eq_ignore_ascii_case(b"chunked") => Ok(BodyLength::Chunked),
            (Some(c), None) if c.is_empty() || !c.iter().all(|&b| is_token_byte(b)) => {
                Err(bad("malformed Transfer-Encoding"))
            }
            (Some(_), None) => Err(Refused {
                status: StatusCode::NOT_IMPLEMENTED,
                why: "unknown transfer coding",
            }),
            _ => Err(bad("more than one transfer coding")),
        };
    }
    let mut values = lengths.iter();
    let Some(first) = values.next() else {
        return Ok(BodyLength::Empty);
    };
    if values.next().is_some() {
        return Err(bad("more than one Content-Length"));
    }
    digits(first.as_bytes())
        .map(BodyLength::Known)
        .ok_or(bad("Content-Length is not a length"))
}

/// A decimal length of 1 to 19 digits, nothing else (no sign, no list, no
/// spaces inside).
fn digits(s: &[u8]) -> Option<u64> {
    if s.is_empty() || s.len() > 19 || !s.iter().all(u8::is_ascii_digit) {
        return None;
    }
    s.iter().try_fold(0u64, |n, &d| {
        n.checked_mul(10)?.checked_add(u64::from(d - b'0'))
    })
}

/// RFC 9110's tchar.
fn is_token_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
}

/// What a chunked body gave so far.
#[derive(Debug, PartialEq, Eq)]
pub enum Chunk {
    /// Body bytes.
    Data(Bytes),
    /// More input is needed.
    More,
    /// The body ended, with these trailers.
    End(HeaderMap),
}

/// Reads a chunked body (RFC 9112 §7.1) from the connection's buffer,
/// taking what it consumes from it.
#[derive(Debug, Default)]
pub struct ChunkedDecoder {
    /// Bytes left of the current chunk's data, then its CRLF.
    left: u64,
    state: State,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum State {
    #[default]
    Size,
    Data,
    DataEnd,
    Trailers,
    Done,
}

impl ChunkedDecoder {
    /// The next piece of the body from `buf` (its consumed bytes taken).
    pub fn next(&mut self, buf: &mut BytesMut) -> Result<Chunk, Refused> {
        loop {
            match self.state {
                State::Size => {
                    let Some(end) = line_end(buf, MAX_CHUNK_LINE)? else {
                        return Ok(Chunk::More);
                    };
                    let line = buf.split_to(end + 2);
                    self.left = chunk_size(&line[..end])?;
                    self.state = match self.left {
                        0 => State::Trailers,
                        _ => State::Data,
                    };
                }
                State::Data => {
                    if buf.is_empty() {
                        return Ok(Chunk::More);
                    }
                    let n = buf
                        .len()
                        .min(usize::try_from(self.left).unwrap_or(usize::MAX));
                    self.left -= n as u64;
                    if self.left == 0 {
                        self.state = State::DataEnd;
                    }
                    return Ok(Chunk::Data(buf.split_to(n).freeze()));
                }
                State::DataEnd => {
                    if buf.len() < 2 {
                        return Ok(Chunk::More);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(bad("chunk data not followed by CRLF"));
                    }
                    buf.advance(2);
                    self.state = State::Size;
                }
                State::Trailers => return self.trailers(buf),
                State::Done => return Ok(Chunk::End(HeaderMap::new())),
            }
        }
    }

    /// The trailer section, once all of it is in `buf`.
    fn trailers(&mut self, buf: &mut BytesMut) -> Result<Chunk, Refused> {
        if buf.starts_with(b"\r\n") {
            buf.advance(2);
            self.state = State::Done;
            return Ok(Chunk::End(HeaderMap::new()));
        }
        let mut fields = [httparse::EMPTY_HEADER; 32];
        let len = match httparse::parse_headers(buf, &mut fields) {
            Ok(httparse::Status::Complete((len, _))) => len,
            Ok(httparse::Status::Partial) if buf.len() > MAX_TRAILERS => {
                return Err(too_large("trailers over 16 KiB"));
            }
            Ok(httparse::Status::Partial) => return Ok(Chunk::More),
            Err(_) => return Err(bad("malformed trailers")),
        };
        if bare_lf(&buf[..len]) {
            return Err(bad("line ended by a bare LF"));
        }
        let mut trailers = HeaderMap::new();
        for field in fields.iter().take_while(|f| !f.name.is_empty()) {
            let name = HeaderName::from_bytes(field.name.as_bytes())
                .map_err(|_| bad("invalid trailer name"))?;
            let value =
                HeaderValue::from_bytes(field.value).map_err(|_| bad("invalid trailer value"))?;
            trailers.append(name, value);
        }
        buf.advance(len);
        self.state = State::Done;
        Ok(Chunk::End(trailers))
    }
}

/// Where the CRLF ending the line at the start of `buf` is, if it has
/// come; a lone LF, or no end within `max` bytes, is refused.
fn line_end(buf: &[u8], max: usize) -> Result<Option<usize>, Refused> {
    match buf.iter().take(max + 2).position(|&b| b == b'\n') {
        Some(0) => Err(bad("line ended by a bare LF")),
        Some(i) if buf[i - 1] == b'\r' => Ok(Some(i - 1)),
        Some(_) => Err(bad("line ended by a bare LF")),
        None if buf.len() > max + 1 => Err(bad("chunk-size line too long")),
        None => Ok(None),
    }
}

/// A chunk-size line's size: hex digits (at most 16), then perhaps
/// extensions after `;`, which are not read.
fn chunk_size(line: &[u8]) -> Result<u64, Refused> {
    let size = match line.iter().position(|&b| b == b';') {
        Some(i) => &line[..i],
        None => line,
    };
    // Whitespace before the extensions is allowed (BWS); none before the
    // size, nor inside it.
    let size = size.trim_ascii_end();
    if size.is_empty() || size.len() > 16 || !size.iter().all(u8::is_ascii_hexdigit) {
        return Err(bad("invalid chunk size"));
    }
    let text = std::str::from_utf8(size).map_err(|_| bad("invalid chunk size"))?;
    u64::from_str_radix(text, 16).map_err(|_| bad("invalid chunk size"))
}

#[cfg(test)]
mod tests;
