//! Request heads written and response heads read: the bytes on the wire, and how long the body that follows is.

use super::caseless::Caseless;
use super::*;

pub(super) fn head_too_large() -> ExchangeError {
    ExchangeError::Failed(format!(
        "upstream response head is larger than {} KiB",
        MAX_HEAD / 1024
    ))
}

/// Writes the request head, then `body`, into `out`. Header values are
/// valid by construction (`HeaderValue` holds no CR or LF), so nothing
/// needs escaping. `host`, when given, is the only `Host` written; the
/// forwarding fields not in `headers` follow its fields. The body's
/// length is written from the bytes at hand; a `Content-Length` in
/// `headers` is not copied.
pub(super) fn encode_head(
    out: &mut Vec<u8>,
    method: &Method,
    prefix: &str,
    path: &str,
    host: Option<&HeaderValue>,
    (headers, forwarded): (&HeaderMap, &crate::Forwarded),
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
        // This exchange frames the body itself (its length, below), and
        // never chunks it.
        if name == header::CONTENT_LENGTH
            || name == header::TRANSFER_ENCODING
            || (name == header::HOST && host.is_some())
        {
            continue;
        }
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    forwarded.write(out);
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

pub(super) fn needs_zero_length(m: &Method) -> bool {
    !matches!(
        *m,
        Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS | Method::TRACE
    ) && *m != Method::CONNECT
}

/// Takes a whole response head off the front of `buf` (read by
/// [`parse`]): `None` while it is incomplete. Header values share the
/// head's bytes rather than being copied; the header map is `spare`'s
/// when it has one. A plain function (not async): its 2 KiB of spans
/// live on the stack for the call only, not in every request's future.
pub(super) fn take_head(
    buf: &mut BytesMut,
    spare: &mut HeaderMap,
    names: &mut FieldNames,
) -> Result<Option<(Response<()>, HeadFields)>, ExchangeError> {
    // Left uninitialized: 128 spans are 2 KiB, and writing them all out
    // for every response (~6 fields) cost more than parsing.
    let mut spans = [const { std::mem::MaybeUninit::<parse::Span>::uninit() }; MAX_HEADERS];
    let parsed = match parse::parse_response(buf, &mut spans) {
        Ok(Some(parsed)) => parsed,
        Ok(None) => return Ok(None),
        Err(parse::ParseError::TooManyHeaders) => {
            return Err(ExchangeError::Failed(format!(
                "upstream response has more than {MAX_HEADERS} header fields"
            )));
        }
        Err(e) => return Err(ExchangeError::Failed(format!("invalid response head: {e}"))),
    };
    let len = parsed.len;
    if len > MAX_HEAD {
        return Err(head_too_large());
    }
    let status = StatusCode::from_u16(parsed.code)
        .map_err(|_| ExchangeError::Failed("invalid response status".into()))?;
    let version = match parsed.minor {
        0 => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    let n = parsed.fields;
    let head = buf.split_to(len).freeze();
    let mut resp = Response::new(());
    *resp.status_mut() = status;
    *resp.version_mut() = version;
    if spare.capacity() == 0 {
        // The request's map was kept by the caller: one another request
        // left on this thread, if any.
        *spare = spare_maps::take();
    }
    // Swapped, not assigned: the response's own empty map becomes the
    // spare, where the next request's map takes its place the same way.
    // Each empty map dropped cost ~60 instructions (#66).
    let headers = resp.headers_mut();
    std::mem::swap(headers, spare);
    headers.reserve(n);
    let mut seen = HeadFields::default();
    for (i, span) in spans[..n].iter().enumerate() {
        // SAFETY: the parser wrote the first `n` spans.
        let [ns, nl, vs, vl] = unsafe { span.assume_init() }.map(|x| x as usize);
        if nl == 10 && connection_only(&head[ns..ns + nl], &head[vs..vs + vl], &mut seen) {
            continue;
        }
        let name = names.name(i, &head[ns..ns + nl]).map_err(|_| {
            ExchangeError::Failed(format!(
                "invalid header name `{}` in the response",
                String::from_utf8_lossy(&head[ns..ns + nl])
            ))
        })?;
        // SAFETY: the parser accepted the value, and its value bytes (tab,
        // visible ASCII, space, obs-text; no other control byte, no DEL) are
        // exactly the ones `HeaderValue` allows; obs-fold is refused (as by
        // httparse's default config). hyper relies on the same for its heads;
        // checking every byte again cost 3% of a forwarded request.
        let value = unsafe { HeaderValue::from_maybe_shared_unchecked(head.slice(vs..vs + vl)) };
        if name == header::CONTENT_LENGTH {
            // The usual single plain value is read here; anything else
            // (two fields, `42, 42`) goes the long way in `framing`.
            seen.plain = match seen.length {
                false => plain_length(&head[vs..vs + vl]),
                true => None,
            };
            seen.length = true;
        }
        seen.coding |= name == header::TRANSFER_ENCODING;
        // Most names' lengths are none of the hop-by-hop names': no compare.
        if nl < 32 && HOP_LENGTHS >> nl & 1 != 0 {
            seen.hop |= crate::headers::is_hop_by_hop(&name);
        }
        headers.append(name, value);
    }
    Ok(Some((resp, seen)))
}

/// The lengths of the hop-by-hop names (`TE` 2, `Trailer` and `Upgrade`
/// 7, `Connection` 10, `Proxy-Connection` 16, `Transfer-Encoding` 17,
/// `Proxy-Authorization` 19), a bit each: a field of another length is
/// none of them, known without comparing its name.
const HOP_LENGTHS: u32 = 1 << 2 | 1 << 7 | 1 << 10 | 1 << 16 | 1 << 17 | 1 << 19;

/// Whether a field of a 10-byte name, `Connection: keep-alive` (or
/// `close`) or `Keep-Alive`, says only how this connection goes on (noted
/// in `seen`): read here, such fields never enter the map, which the
/// forwarding would have to look them up in to remove them (with the
/// lookups for framing, ~900 instructions a response).
#[inline]
fn connection_only(name: &[u8], value: &[u8], seen: &mut HeadFields) -> bool {
    const KEEP_ALIVE: Caseless = Caseless::new(b"keep-alive");
    const CONNECTION: Caseless = Caseless::new(b"connection");
    if KEEP_ALIVE.matches(name) {
        return true;
    }
    if !CONNECTION.matches(name) {
        return false;
    }
    if KEEP_ALIVE.matches(value) {
        return true;
    }
    if value.eq_ignore_ascii_case(b"close") {
        seen.close = true;
        return true;
    }
    seen.connection = true;
    false
}

/// What [`take_head`] saw of the fields that frame the body and say
/// whether the connection goes on, so neither needs a lookup after.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct HeadFields {
    /// A `Content-Length` field.
    length: bool,
    /// Its value, when it is one field of digits only.
    plain: Option<u64>,
    /// A `Transfer-Encoding` field.
    coding: bool,
    /// `Connection: close`, taken out of the map.
    close: bool,
    /// A `Connection` field other than a bare `keep-alive` or `close`,
    /// left in the map (`keep-alive, close`, `upgrade`, names).
    connection: bool,
    /// A hop-by-hop field left in the map (`Transfer-Encoding`, such a
    /// `Connection`, `Trailer`...): the reader removes them before the
    /// answer leaves it, and a head without any is spared the pass.
    pub(super) hop: bool,
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

/// A `Content-Length` value of digits only, as nearly every upstream
/// writes it.
fn plain_length(digits: &[u8]) -> Option<u64> {
    (!digits.is_empty() && digits.len() <= 19 && digits.iter().all(u8::is_ascii_digit)).then(|| {
        digits
            .iter()
            .fold(0u64, |n, d| n * 10 + u64::from(d - b'0'))
    })
}

/// The response's framing; also drops a `Content-Length` that a
/// `Transfer-Encoding` overrides, so it cannot reach the client, and
/// leaves a repeated one (`42, 42`, or two fields) as one plain value, so
/// the answer needs no more work on its framing fields
/// ([`crate::headers::single_content_length`] is for other readers'
/// answers). `seen`: which framing fields the head has.
pub(super) fn framing(
    method: &Method,
    resp: &mut Response<()>,
    seen: HeadFields,
) -> Result<Framing, ExchangeError> {
    let status = resp.status();
    let bodiless = *method == Method::HEAD
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED;
    let version = resp.version();
    let headers = resp.headers_mut();
    if seen.coding {
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
        if seen.length && seen.plain.is_none() {
            crate::headers::single_content_length(headers);
        }
        return Ok(Framing::Length(0));
    }
    if !seen.length {
        return Ok(Framing::UntilClose);
    }
    if let Some(n) = seen.plain {
        return Ok(Framing::Length(n));
    }
    let mut length = None;
    for value in headers.get_all(header::CONTENT_LENGTH) {
        // The usual value, digits only: no split, no trim.
        if let Some(n) = plain_length(value.as_bytes()) {
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
        Some(n) => {
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(n));
            Framing::Length(n)
        }
        None => Framing::UntilClose,
    })
}

pub(super) fn invalid_length(v: &HeaderValue) -> ExchangeError {
    ExchangeError::Failed(format!(
        "invalid Content-Length `{}` in the response",
        String::from_utf8_lossy(v.as_bytes())
    ))
}

/// Whether the connection may carry another request after this response.
pub(super) fn keeps_alive(resp: &Response<()>, framing: Framing, seen: HeadFields) -> bool {
    if framing == Framing::UntilClose || resp.version() != Version::HTTP_11 || seen.close {
        return false;
    }
    !seen.connection
        || !resp.headers().get_all(header::CONNECTION).iter().any(|v| {
            // Most upstreams say just `keep-alive`: no split, no trim.
            !v.as_bytes().eq_ignore_ascii_case(b"keep-alive")
                && v.to_str()
                    .is_ok_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("close")))
        })
}
