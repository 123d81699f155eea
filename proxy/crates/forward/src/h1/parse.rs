//! An upstream's response head read off the front of a buffer: the status
//! line, and where each field's name and value sit.
//!
//! Written by hand (#66): httparse, which read it before, cost ~1,370
//! instructions for the ~150-byte head an upstream usually sends (its
//! byte iterator, and a run-time SIMD dispatch whose 32-byte blocks
//! short values never fill); this does the same in one pass over a
//! class table, eight value bytes at a time. It accepts exactly what
//! httparse's default `ParserConfig` accepts, and answers the same at
//! every byte (a partial head, an error, the same spans): its tests and
//! the `response_parse` fuzz target hold it to httparse.

use std::mem::MaybeUninit;

/// Why a head cannot be read: httparse's errors, with its words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParseError {
    HeaderName,
    HeaderValue,
    NewLine,
    Status,
    TooManyHeaders,
    Version,
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ParseError::HeaderName => "invalid header name",
            ParseError::HeaderValue => "invalid header value",
            ParseError::NewLine => "invalid new line",
            ParseError::Status => "invalid response status",
            ParseError::TooManyHeaders => "too many headers",
            ParseError::Version => "invalid HTTP version",
        })
    }
}

/// A whole head: its length (to the end of its empty line), its
/// version's minor number (`HTTP/1.0` or `HTTP/1.1`), its status code
/// (three digits, any value), and how many fields it has (their spans
/// are the first that many of those given).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    pub len: usize,
    pub minor: u8,
    pub code: u16,
    pub fields: usize,
}

/// Where a field sits in the buffer: name start, name length, value
/// start, value length (the value without the whitespace around it).
pub type Span = [u32; 4];

/// Bytes a field name may have (RFC 9110 `tchar`).
const TOKEN: u8 = 1;
/// Bytes a field value may have: tab, visible ASCII, space, obs-text.
const VALUE: u8 = 2;
/// Bytes a reason phrase may have (the same as a value's).
const REASON: u8 = VALUE;

static CLASS: [u8; 256] = {
    let mut table = [0u8; 256];
    let mut b = 0;
    while b < 256 {
        let c = b as u8;
        let token = c.is_ascii_alphanumeric()
            || matches!(
                c,
                b'!' | b'#'
                    | b'$'
                    | b'%'
                    | b'&'
                    | b'\''
                    | b'*'
                    | b'+'
                    | b'-'
                    | b'.'
                    | b'^'
                    | b'_'
                    | b'`'
                    | b'|'
                    | b'~'
            );
        let value = c == b'\t' || (c >= b' ' && c != 0x7f);
        table[b] = (token as u8 * TOKEN) | (value as u8 * VALUE);
        b += 1;
    }
    table
};

#[inline(always)]
fn is(class: u8, b: u8) -> bool {
    CLASS[b as usize] & class != 0
}

/// Reads the head at the front of `buf`: `None` while it is incomplete;
/// its fields' spans go in `spans` (more fields than that is an error).
/// A buffer past 4 GiB is read as its first 4 GiB (spans are `u32`).
pub fn parse_response(
    buf: &[u8],
    spans: &mut [MaybeUninit<Span>],
) -> Result<Option<Head>, ParseError> {
    let buf = &buf[..buf.len().min(u32::MAX as usize)];
    let mut at = match skip_empty_lines(buf)? {
        Some(at) => at,
        None => return Ok(None),
    };
    let Some((minor, code, after)) = status_line(buf, at)? else {
        return Ok(None);
    };
    at = after;
    let mut fields = 0;
    loop {
        let Some(&b) = buf.get(at) else {
            return Ok(None);
        };
        if b == b'\r' || b == b'\n' {
            let Some(end) = line_end(buf, at, ParseError::NewLine)? else {
                return Ok(None);
            };
            return Ok(Some(Head {
                len: end,
                minor,
                code,
                fields,
            }));
        }
        let Some((span, next)) = field(buf, at)? else {
            return Ok(None);
        };
        // As httparse: the field is read whole before it is found to be
        // one too many.
        let Some(slot) = spans.get_mut(fields) else {
            return Err(ParseError::TooManyHeaders);
        };
        slot.write(span);
        fields += 1;
        at = next;
    }
}

/// Past the empty lines some servers send before a status line.
fn skip_empty_lines(buf: &[u8]) -> Result<Option<usize>, ParseError> {
    let mut at = 0;
    loop {
        match buf.get(at) {
            None => return Ok(None),
            Some(b'\r') => match buf.get(at + 1) {
                None => return Ok(None),
                Some(b'\n') => at += 2,
                Some(_) => return Err(ParseError::NewLine),
            },
            Some(b'\n') => at += 1,
            Some(_) => return Ok(Some(at)),
        }
    }
}

/// `HTTP/1.x NNN reason`: the version's minor, the code, and where the
/// fields begin.
fn status_line(buf: &[u8], at: usize) -> Result<Option<(u8, u16, usize)>, ParseError> {
    let rest = &buf[at..];
    let minor = match rest.get(..8) {
        Some(b"HTTP/1.0") => 0,
        Some(b"HTTP/1.1") => 1,
        Some(_) => return Err(ParseError::Version),
        None => {
            // As far as it goes, it must be the start of a version.
            return match b"HTTP/1.".starts_with(rest) {
                true => Ok(None),
                false => Err(ParseError::Version),
            };
        }
    };
    let mut at = at + 8;
    match buf.get(at) {
        None => return Ok(None),
        Some(b' ') => at += 1,
        Some(_) => return Err(ParseError::Version),
    }
    let mut code = 0u16;
    for _ in 0..3 {
        match buf.get(at) {
            None => return Ok(None),
            Some(d) if d.is_ascii_digit() => code = code * 10 + u16::from(d - b'0'),
            Some(_) => return Err(ParseError::Status),
        }
        at += 1;
    }
    match buf.get(at) {
        None => return Ok(None),
        Some(b' ') => {
            at += 1;
            while let Some(&b) = buf.get(at) {
                if !is(REASON, b) {
                    break;
                }
                at += 1;
            }
        }
        Some(b'\r' | b'\n') => {}
        Some(_) => return Err(ParseError::Status),
    }
    match buf.get(at) {
        None => Ok(None),
        Some(b'\r' | b'\n') => {
            Ok(line_end(buf, at, ParseError::Status)?.map(|next| (minor, code, next)))
        }
        Some(_) => Err(ParseError::Status),
    }
}

/// Past the line end at `at` (`\r\n`, or a bare `\n`); a `\r` followed
/// by anything else is `error`.
#[inline(always)]
fn line_end(buf: &[u8], at: usize, error: ParseError) -> Result<Option<usize>, ParseError> {
    if buf[at] == b'\n' {
        return Ok(Some(at + 1));
    }
    match buf.get(at + 1) {
        None => Ok(None),
        Some(b'\n') => Ok(Some(at + 2)),
        Some(_) => Err(error),
    }
}

/// The field line at `at` (which is not an empty line): its span and
/// where the next line begins.
#[inline]
fn field(buf: &[u8], at: usize) -> Result<Option<(Span, usize)>, ParseError> {
    let name = at;
    let mut at = name_blocks(buf, at);
    while at < buf.len() && is(TOKEN, buf[at]) {
        at += 1;
    }
    match buf.get(at) {
        None => return Ok(None),
        Some(b':') if at > name => {}
        Some(_) => return Err(ParseError::HeaderName),
    }
    let name_len = at - name;
    at += 1;
    // Whitespace before the value.
    while at < buf.len() && matches!(buf[at], b' ' | b'\t') {
        at += 1;
    }
    let value = at;
    let end = value_end(buf, value);
    let next = match buf.get(end) {
        None => return Ok(None),
        Some(b'\n') => end + 1,
        Some(b'\r') => match buf.get(end + 1) {
            None => return Ok(None),
            Some(b'\n') => end + 2,
            Some(_) => return Err(ParseError::HeaderValue),
        },
        Some(_) => return Err(ParseError::HeaderValue),
    };
    // Whitespace after the value.
    let mut last = end;
    while last > value && matches!(buf[last - 1], b' ' | b'\t') {
        last -= 1;
    }
    let span = [
        name as u32,
        name_len as u32,
        value as u32,
        (last - value) as u32,
    ];
    Ok(Some((span, next)))
}

/// Past the value bytes from `at`: sixteen at a time while none of them
/// is a control byte (tab included) or DEL, then one by one. Values are
/// short, and the block usually holds the line's end: one block, then a
/// byte or two.
#[inline(always)]
fn value_end(buf: &[u8], at: usize) -> usize {
    let mut at = value_blocks(buf, at);
    while at < buf.len() && is(VALUE, buf[at]) {
        at += 1;
    }
    at
}

/// Past the 16-byte blocks from `at` whose bytes are all in `class` (its
/// mask: 0xff for a byte in it), and the bytes of the next block before
/// its first other byte.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn blocks(buf: &[u8], mut at: usize, class: impl Fn(X86Block) -> X86Block) -> usize {
    use std::arch::x86_64::{_mm_loadu_si128, _mm_movemask_epi8};
    while at + 16 <= buf.len() {
        // SAFETY: SSE2 is part of every x86_64 CPU; the load reads the 16
        // bytes from `at`, inside `buf` (checked above), unaligned.
        let plain = unsafe {
            let x = _mm_loadu_si128(buf.as_ptr().add(at).cast::<X86Block>());
            _mm_movemask_epi8(class(x)) as u32
        };
        if plain != 0xffff {
            return at + plain.trailing_ones() as usize;
        }
        at += 16;
    }
    at
}

#[cfg(target_arch = "x86_64")]
type X86Block = std::arch::x86_64::__m128i;

/// Past the 16-byte blocks from `at` that are all value bytes other than
/// tab, and the bytes of the next block before its first other byte.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn value_blocks(buf: &[u8], at: usize) -> usize {
    use std::arch::x86_64::{_mm_andnot_si128, _mm_cmpeq_epi8, _mm_max_epu8, _mm_set1_epi8};
    // SAFETY (each block): SSE2 is part of every x86_64 CPU.
    blocks(buf, at, |x| unsafe {
        // Not under 0x20 (unsigned: the larger of it and 0x20 is it).
        let printable = _mm_cmpeq_epi8(_mm_max_epu8(x, _mm_set1_epi8(0x20)), x);
        let del = _mm_cmpeq_epi8(x, _mm_set1_epi8(0x7f));
        _mm_andnot_si128(del, printable)
    })
}

/// Past the 16-byte blocks from `at` that are all letters, digits and
/// `-` (the bytes of nearly every field name; any other token byte is
/// left to the byte loop in [`field`]), and the bytes of the next block
/// before its first other byte. The byte loop cost ~7 instructions a
/// byte, ~330 for the names of an upstream's usual head (#66).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn name_blocks(buf: &[u8], at: usize) -> usize {
    use std::arch::x86_64::{
        _mm_and_si128, _mm_cmpeq_epi8, _mm_cmpgt_epi8, _mm_or_si128, _mm_set1_epi8,
    };
    // SAFETY (each block): SSE2 is part of every x86_64 CPU. The compares
    // are signed: bytes from 0x80 are below every range.
    blocks(buf, at, |x| unsafe {
        let within = |x, lo: u8, hi: u8| {
            _mm_and_si128(
                _mm_cmpgt_epi8(x, _mm_set1_epi8(lo as i8 - 1)),
                _mm_cmpgt_epi8(_mm_set1_epi8(hi as i8 + 1), x),
            )
        };
        // With 0x20 set, exactly the letters fall in `a`..=`z`.
        let letter = within(_mm_or_si128(x, _mm_set1_epi8(0x20)), b'a', b'z');
        let digit = within(x, b'0', b'9');
        let dash = _mm_cmpeq_epi8(x, _mm_set1_epi8(b'-' as i8));
        _mm_or_si128(_mm_or_si128(letter, digit), dash)
    })
}

/// Elsewhere, the byte loops in [`value_end`] and [`field`] do it all.
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
fn value_blocks(_buf: &[u8], at: usize) -> usize {
    at
}

/// See [`value_blocks`].
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
fn name_blocks(_buf: &[u8], at: usize) -> usize {
    at
}

#[cfg(test)]
mod tests;
