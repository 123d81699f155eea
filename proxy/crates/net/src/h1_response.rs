//! An HTTP/1.1 response head as the routing core's own server codec
//! writes it (#66, step 2), byte for byte as hyper's server writes the
//! same answer (the differential tests hold it to that), so a client sees
//! no difference between the two: lower-case field names in the map's
//! order, the framing fields settled from what the body says of its
//! length, `Connection` completed for the connection's fate, and a `Date`
//! field unless the answer has one. The answers our codec leaves to hyper
//! (`101 Switching Protocols`, other 1xx, a `CONNECT` tunnel) are refused
//! here rather than written differently.
//!
//! Also the pieces of a chunked body ([`chunk_size`], [`LAST_CHUNK`],
//! [`encode_trailers`]).

use std::cell::RefCell;

use http::header::{self, HeaderMap, HeaderValue};
use http::{Method, StatusCode, Version};

/// What the answer's body says of its length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BodySize {
    /// No body at all (it is at its end already).
    #[default]
    None,
    /// Exactly this many bytes.
    Known(u64),
    /// Unknown until it ends.
    Unknown,
}

/// How the body goes on the wire after the head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// This many bytes, as `Content-Length` says (0 for answers that
    /// cannot have a body: to `HEAD`, 204, 304).
    Length(u64),
    /// Chunked (`Transfer-Encoding: chunked`).
    Chunked,
    /// Until the connection closes (an HTTP/1.0 client, an unknown
    /// length).
    CloseDelimited,
}

/// The head written: how its body follows, and whether the connection
/// ends after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Encoded {
    pub framing: Framing,
    pub close: bool,
}

/// The request an answer is for, as far as its head depends on it.
#[derive(Debug, Clone, Copy)]
pub struct Asked<'a> {
    pub method: &'a Method,
    /// The request's version: an HTTP/1.0 client gets an HTTP/1.0 head.
    pub version: Version,
    /// Whether the connection may go on after this answer (the request
    /// did not say `close`, and the server does not mean to).
    pub keep_alive: bool,
}

/// An answer this codec does not write (hyper's server refuses the same
/// ones, or serves them by means the codec leaves to it), and why.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unwritable(pub &'static str);

impl std::fmt::Display for Unwritable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

impl std::error::Error for Unwritable {}

/// Writes the head of an answer of `status` with `headers` and a body of
/// `body`'s size to `request`, onto `dst`.
pub fn encode_head(
    dst: &mut Vec<u8>,
    status: StatusCode,
    headers: &HeaderMap,
    body: BodySize,
    request: Asked<'_>,
) -> Result<Encoded, Unwritable> {
    if status.is_informational() {
        return Err(Unwritable("an interim (1xx) answer"));
    }
    if request.method == Method::CONNECT && status.is_success() {
        return Err(Unwritable("a CONNECT tunnel"));
    }
    let start = dst.len();
    dst.reserve(30 + headers.len() * 32);
    status_line(dst, status, request.version);
    // The connection's fate, added to `Connection` where the client would
    // not assume it (as hyper completes it).
    let connection = headers.get_all(header::CONNECTION);
    let said_close = connection.iter().any(|v| token(v, b"close"));
    let said_keep_alive = connection.iter().any(|v| token(v, b"keep-alive"));
    let http10 = request.version == Version::HTTP_10;
    let added: Option<&'static [u8]> = match (http10, request.keep_alive) {
        (false, false) if !said_close => Some(b"close"),
        (true, true) if !said_keep_alive => Some(b"keep-alive"),
        _ => None,
    };
    let mut fields = Fields {
        status,
        head: request.method == Method::HEAD,
        http10,
        body,
        added,
        ..Fields::default()
    };
    if let Err(e) = fields.write(dst, headers) {
        dst.truncate(start);
        return Err(e);
    }
    if let Some(value) = fields.added.take() {
        line(dst, "connection", value);
    }
    let framing = fields.framing(dst);
    match fields.wrote_date {
        true => dst.extend_from_slice(b"\r\n"),
        false => {
            dst.extend_from_slice(b"date: ");
            DATE.with(|d| dst.extend_from_slice(&d.borrow_mut().now()));
            dst.extend_from_slice(b"\r\n\r\n");
        }
    }
    let close = !request.keep_alive || said_close || framing == Framing::CloseDelimited;
    Ok(Encoded { framing, close })
}

fn status_line(dst: &mut Vec<u8>, status: StatusCode, version: Version) {
    if version != Version::HTTP_10 && status == StatusCode::OK {
        dst.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
        return;
    }
    dst.extend_from_slice(match version {
        Version::HTTP_10 => b"HTTP/1.0 ",
        _ => b"HTTP/1.1 ",
    });
    dst.extend_from_slice(status.as_str().as_bytes());
    dst.push(b' ');
    // A reason must be written: many parsers expect one.
    dst.extend_from_slice(status.canonical_reason().unwrap_or("<none>").as_bytes());
    dst.extend_from_slice(b"\r\n");
}

/// What the fields written so far settled.
#[derive(Default)]
struct Fields {
    status: StatusCode,
    head: bool,
    http10: bool,
    body: BodySize,
    /// The length the head gave, once written (`Content-Length` or
    /// `Transfer-Encoding`).
    length: Option<Framing>,
    /// A token for `Connection` not among its values yet: written with
    /// them, or as a field of its own after the map's.
    added: Option<&'static [u8]>,
    wrote_date: bool,
}

impl Fields {
    /// The fields of the map, in its order; one line per value but for
    /// `Connection`, `Transfer-Encoding` and `Trailer`, whose values are
    /// joined, as hyper writes them.
    fn write(&mut self, dst: &mut Vec<u8>, headers: &HeaderMap) -> Result<(), Unwritable> {
        // By value, not by name: a lookup per name would hash every name.
        // A name's values come one after another, sharing its reference.
        let mut last: *const header::HeaderName = std::ptr::null();
        for (name, value) in headers {
            let again = std::ptr::eq(last, name);
            last = name;
            match *name {
                header::CONTENT_LENGTH if !again => {
                    self.content_length(dst, headers.get_all(name))?
                }
                header::TRANSFER_ENCODING if !again => {
                    self.transfer_encoding(dst, headers.get_all(name))?
                }
                header::CONNECTION if !again => {
                    joined(dst, "connection", &headers.get_all(name));
                    if let Some(value) = self.added.take() {
                        dst.truncate(dst.len() - 2);
                        dst.extend_from_slice(b", ");
                        dst.extend_from_slice(value);
                        dst.extend_from_slice(b"\r\n");
                    }
                }
                header::TRAILER if !again && self.chunkable() => {
                    joined(dst, "trailer", &headers.get_all(name))
                }
                header::CONTENT_LENGTH
                | header::TRANSFER_ENCODING
                | header::CONNECTION
                | header::TRAILER => {}
                _ => {
                    self.wrote_date |= *name == header::DATE;
                    line(dst, name.as_str(), value.as_bytes());
                }
            }
        }
        Ok(())
    }

    fn content_length(
        &mut self,
        dst: &mut Vec<u8>,
        values: header::GetAll<'_, HeaderValue>,
    ) -> Result<(), Unwritable> {
        if self.length.is_some() {
            return Err(Unwritable("Content-Length beside Transfer-Encoding"));
        }
        let mut values = values.iter();
        let first = values.next().expect("a field has a value");
        match self.body {
            // The body's own length is what is sent, so it is what the
            // field says: hyper writes the field's value, trusting the two
            // agree (they do on the proxy's path), but a head that framed
            // the body otherwise than it is sent would desync the client.
            BodySize::Known(n) => {
                line(
                    dst,
                    "content-length",
                    itoa::Buffer::new().format(n).as_bytes(),
                );
                self.length = Some(Framing::Length(n));
            }
            BodySize::Unknown => {
                let n = length(first).ok_or(Unwritable("an invalid Content-Length"))?;
                if values.any(|v| length(v) != Some(n)) {
                    return Err(Unwritable("two different Content-Length values"));
                }
                // As read (`09` is 9): the one spelling every reader
                // takes alike.
                line(
                    dst,
                    "content-length",
                    itoa::Buffer::new().format(n).as_bytes(),
                );
                self.length = Some(Framing::Length(n));
            }
            // No body: the field stands only in an answer to HEAD (every
            // value, as given); otherwise `content-length: 0` follows.
            BodySize::None if self.head => {
                for value in std::iter::once(first).chain(values) {
                    line(dst, "content-length", value.as_bytes());
                }
                self.length = Some(Framing::Length(0));
            }
            BodySize::None => {}
        }
        Ok(())
    }

    fn transfer_encoding(
        &mut self,
        dst: &mut Vec<u8>,
        values: header::GetAll<'_, HeaderValue>,
    ) -> Result<(), Unwritable> {
        if !self.chunkable() {
            return Ok(());
        }
        if self.length.is_some() {
            return Err(Unwritable("Transfer-Encoding beside Content-Length"));
        }
        joined(dst, "transfer-encoding", &values);
        // `chunked` must be the last coding: added when it is not.
        let last = values.iter().next_back().expect("a field has a value");
        if !last_coding_is_chunked(last) {
            dst.truncate(dst.len() - 2);
            dst.extend_from_slice(b", chunked\r\n");
        }
        self.length = Some(Framing::Chunked);
        Ok(())
    }

    /// Whether the answer may be sent chunked.
    fn chunkable(&self) -> bool {
        !self.http10 && can_have_body(self.head, self.status)
    }

    /// The framing, writing the length field the map did not give.
    fn framing(&mut self, dst: &mut Vec<u8>) -> Framing {
        let framing = match (self.length, self.body) {
            (Some(framing), _) => framing,
            (None, BodySize::Unknown) if self.chunkable() => {
                dst.extend_from_slice(b"transfer-encoding: chunked\r\n");
                Framing::Chunked
            }
            (None, BodySize::Unknown) => Framing::CloseDelimited,
            (None, BodySize::None | BodySize::Known(0)) => {
                if !self.head && can_have_length(self.status) {
                    dst.extend_from_slice(b"content-length: 0\r\n");
                }
                Framing::Length(0)
            }
            (None, BodySize::Known(n)) => {
                if can_have_length(self.status) {
                    dst.extend_from_slice(b"content-length: ");
                    dst.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
                    dst.extend_from_slice(b"\r\n");
                }
                Framing::Length(n)
            }
        };
        if can_have_body(self.head, self.status) {
            framing
        } else {
            Framing::Length(0)
        }
    }
}

fn line(dst: &mut Vec<u8>, name: &str, value: &[u8]) {
    dst.extend_from_slice(name.as_bytes());
    dst.extend_from_slice(b": ");
    dst.extend_from_slice(value);
    dst.extend_from_slice(b"\r\n");
}

/// One line with every value of the field, joined by `, `.
fn joined(dst: &mut Vec<u8>, name: &str, values: &header::GetAll<'_, HeaderValue>) {
    dst.extend_from_slice(name.as_bytes());
    dst.extend_from_slice(b": ");
    for (i, value) in values.iter().enumerate() {
        if i > 0 {
            dst.extend_from_slice(b", ");
        }
        dst.extend_from_slice(value.as_bytes());
    }
    dst.extend_from_slice(b"\r\n");
}

fn token(value: &HeaderValue, token: &[u8]) -> bool {
    value
        .as_bytes()
        .split(|&b| b == b',')
        .any(|t| t.trim_ascii().eq_ignore_ascii_case(token))
}

fn last_coding_is_chunked(value: &HeaderValue) -> bool {
    value
        .as_bytes()
        .rsplit(|&b| b == b',')
        .next()
        .is_some_and(|t| t.trim_ascii().eq_ignore_ascii_case(b"chunked"))
}

fn length(value: &HeaderValue) -> Option<u64> {
    let s = value.to_str().ok()?.trim();
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// Whether an answer to `HEAD` (`head`) or of `status` carries a body.
fn can_have_body(head: bool, status: StatusCode) -> bool {
    !head && can_have_length(status)
}

/// Whether an answer of `status` may say its length.
fn can_have_length(status: StatusCode) -> bool {
    !status.is_informational()
        && status != StatusCode::NO_CONTENT
        && status != StatusCode::NOT_MODIFIED
}

/// The size line of a chunk of `len` bytes (`len` in hex, CRLF).
pub fn chunk_size(len: usize) -> ([u8; 18], usize) {
    let mut line = [0u8; 18];
    let digits = format_hex(len, &mut line);
    line[digits] = b'\r';
    line[digits + 1] = b'\n';
    (line, digits + 2)
}

fn format_hex(mut n: usize, out: &mut [u8; 18]) -> usize {
    let mut digits = [0u8; 16];
    let mut i = 16;
    loop {
        i -= 1;
        digits[i] = b"0123456789abcdef"[n & 0xf];
        n >>= 4;
        if n == 0 {
            break;
        }
    }
    let len = 16 - i;
    out[..len].copy_from_slice(&digits[i..]);
    len
}

/// The chunk that ends a chunked body without trailers.
pub const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// The last chunk with `trailers` (lower-case names, one line a value).
pub fn encode_trailers(dst: &mut Vec<u8>, trailers: &HeaderMap) {
    dst.extend_from_slice(b"0\r\n");
    for (name, value) in trailers {
        line(dst, name.as_str(), value.as_bytes());
    }
    dst.extend_from_slice(b"\r\n");
}

thread_local! {
    static DATE: RefCell<CachedDate> = const { RefCell::new(CachedDate { second: u64::MAX, text: [0; 29] }) };
}

/// The `Date` field's value, formatted once a second per thread (as
/// hyper caches its own): read from the coarse real-time clock, whose
/// few milliseconds of resolution a field of whole seconds does not see.
struct CachedDate {
    second: u64,
    text: [u8; 29],
}

impl CachedDate {
    fn now(&mut self) -> [u8; 29] {
        let second = crate::coarse_clock::coarse_wall_seconds();
        if second != self.second {
            let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs(second);
            self.text
                .copy_from_slice(httpdate::fmt_http_date(at).as_bytes());
            self.second = second;
        }
        self.text
    }
}

#[cfg(test)]
mod tests;
