//! `proxy_grpc_call`: a filter's unary gRPC call to an upstream of the
//! policies, made as Envoy's gRPC client makes it (`POST
//! /SERVICE/METHOD` over HTTP/2, the message in one length-prefixed
//! frame, `te: trailers`, `grpc-timeout`, the filter's metadata) through
//! the same way out as its HTTP calls. Its outcome comes back as Envoy
//! gives it: the answer's message through `proxy_on_grpc_receive`
//! (buffer 5), or a gRPC status through `proxy_on_grpc_close` with the
//! message `proxy_get_status` reads. `proxy_grpc_cancel` and
//! `proxy_grpc_close` drop a call's outcome.

use std::time::Duration;

use bytes::{BufMut, Bytes, BytesMut};
use wasmtime::{Caller, Linker};

use super::guest::{Status, read, write_u32};
use super::{VmState, map};
use crate::seam::{Callout, CalloutAnswer, MAX_CALLOUT_TIMEOUT};

/// `proxy_get_buffer_bytes`' buffer of a gRPC answer's message.
pub const GRPC_RECEIVE_BUFFER: i32 = 5;

/// ABI statuses Envoy answers a call it cannot make with (the Rust SDK
/// hands these two back; it panics on the others).
pub(super) const PARSE_FAILURE: i32 = 4;
pub(super) const INTERNAL_FAILURE: i32 = 10;

/// gRPC status codes this host gives.
pub(super) mod code {
    pub const OK: u32 = 0;
    pub const UNKNOWN: u32 = 2;
    pub const PERMISSION_DENIED: u32 = 7;
    pub const RESOURCE_EXHAUSTED: u32 = 8;
    pub const UNIMPLEMENTED: u32 = 12;
    pub const INTERNAL: u32 = 13;
    pub const UNAVAILABLE: u32 = 14;
    pub const UNAUTHENTICATED: u32 = 16;
}

/// What came of a call: its answer's message, or a status and message.
pub type Outcome = Result<Bytes, (u32, String)>;

/// A VM's gRPC calls in flight, by token, and whether the filter
/// cancelled each (its outcome is then dropped). Tokens come from the
/// same count as HTTP calls', so one tells which kind an answer is for.
#[derive(Default)]
pub struct Calls(Vec<(u32, bool)>);

impl Calls {
    /// Whether `token` is a gRPC call's; forgets it. `Some(true)`: one
    /// the filter cancelled.
    pub fn take(&mut self, token: u32) -> Option<bool> {
        // Usually empty: no search then.
        if self.0.is_empty() {
            return None;
        }
        let i = self.0.iter().position(|(t, _)| *t == token)?;
        Some(self.0.swap_remove(i).1)
    }

    fn cancel(&mut self, token: u32) -> bool {
        match self
            .0
            .iter_mut()
            .find(|(t, cancelled)| *t == token && !*cancelled)
        {
            Some((_, cancelled)) => {
                *cancelled = true;
                true
            }
            None => false,
        }
    }
}

/// Adds the gRPC calls to `linker`.
pub fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    type C<'a> = Caller<'a, VmState>;
    linker.func_wrap(
        "env",
        "proxy_grpc_call",
        |mut c: C<'_>,
         up_ptr: i32,
         up_len: i32,
         service_ptr: i32,
         service_len: i32,
         method_ptr: i32,
         method_len: i32,
         meta_ptr: i32,
         meta_len: i32,
         message_ptr: i32,
         message_len: i32,
         timeout_ms: i32,
         ret_token: i32|
         -> wasmtime::Result<i32> {
            let target = [(up_ptr, up_len), (service_ptr, service_len)];
            let target = (target, (method_ptr, method_len), (meta_ptr, meta_len));
            let message = read(&mut c, message_ptr, message_len)?;
            let callout = match request(&mut c, target, Some((&message, timeout_ms)))? {
                Ok(callout) => callout,
                Err(status) => return Ok(status),
            };
            let token = c.data_mut().take_token();
            c.data_mut().grpc.0.push((token, false));
            c.data_mut().call.callouts.push((token, callout));
            write_u32(&mut c, ret_token, token)?;
            Ok(Status::Ok as i32)
        },
    )?;
    // A unary call has nothing to half-close: both drop its outcome, as
    // Envoy cancels the request for either. A stream's cancel ends it; its
    // close half-closes it (see grpc_stream.rs).
    linker.func_wrap(
        "env",
        "proxy_grpc_cancel",
        |mut c: C<'_>, token: i32| -> i32 {
            let state = c.data_mut();
            match state.grpc.cancel(token as u32) || state.streams.cancel(token as u32) {
                true => Status::Ok as i32,
                false => Status::NotFound as i32,
            }
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_grpc_close",
        |mut c: C<'_>, token: i32| -> i32 {
            let state = c.data_mut();
            match state.grpc.cancel(token as u32) || state.streams.half_close(token as u32) {
                true => Status::Ok as i32,
                false => Status::NotFound as i32,
            }
        },
    )?;
    Ok(())
}

/// Pointers to a call's upstream and service, its method, and its
/// metadata, in the filter's memory.
type Target = ([(i32, i32); 2], (i32, i32), (i32, i32));

/// The HTTP/2 request a call (with its message and timeout) or a stream
/// (with neither) is, read from the filter's memory; the ABI status to
/// answer instead when it cannot be made.
pub(super) fn request(
    c: &mut Caller<'_, VmState>,
    ([upstream, service], method, metadata): Target,
    unary: Option<(&[u8], i32)>,
) -> wasmtime::Result<Result<Callout, i32>> {
    let upstream = read(c, upstream.0, upstream.1)?;
    let service = read(c, service.0, service.1)?;
    let method = read(c, method.0, method.1)?;
    let metadata = read(c, metadata.0, metadata.1)?;
    // A cluster Envoy does not know is a ParseFailure there (it first
    // tries the name as a serialized GrpcService).
    let names = &c.data().upstreams;
    let Some((_, upstream)) = names.iter().find(|(n, _)| n.as_bytes() == upstream) else {
        return Ok(Err(PARSE_FAILURE));
    };
    let upstream = upstream.to_string();
    let Some(pairs) = map::deserialize(&metadata) else {
        return Ok(Err(INTERNAL_FAILURE));
    };
    let path = format!(
        "/{}/{}",
        String::from_utf8_lossy(&service),
        String::from_utf8_lossy(&method)
    );
    Ok(callout(upstream, path, &pairs, unary).ok_or(INTERNAL_FAILURE))
}

/// The HTTP/2 request a call (its message and timeout given) or a stream
/// is: `None` when its metadata or path cannot be a request's. A stream
/// has no deadline; its callout's timeout bounds the wait for its head.
fn callout(
    upstream: String,
    path: String,
    metadata: &[(&[u8], &[u8])],
    unary: Option<(&[u8], i32)>,
) -> Option<Callout> {
    use http::header::{HeaderName, HeaderValue};
    // No timeout given (0): the ceiling, as Envoy's is none.
    let timeout = match unary {
        Some((_, ms)) if ms > 0 => Duration::from_millis(ms as u64).min(MAX_CALLOUT_TIMEOUT),
        _ => MAX_CALLOUT_TIMEOUT,
    };
    let mut headers = http::HeaderMap::new();
    for (k, v) in metadata {
        // What the call's framing sets is the host's.
        if k.starts_with(b":") || k.eq_ignore_ascii_case(b"content-type") {
            continue;
        }
        headers.append(
            HeaderName::from_bytes(k).ok()?,
            HeaderValue::from_bytes(v).ok()?,
        );
    }
    let constant = HeaderValue::from_static;
    headers.insert(http::header::CONTENT_TYPE, constant("application/grpc"));
    headers.insert(http::header::TE, constant("trailers"));
    let body = match unary {
        Some((message, _)) => {
            let deadline = format!("{}m", timeout.as_millis());
            headers.insert("grpc-timeout", HeaderValue::from_str(&deadline).ok()?);
            frame(message)
        }
        None => Bytes::new(),
    };
    http::uri::PathAndQuery::try_from(path.as_str()).ok()?;
    Some(Callout {
        upstream,
        method: http::Method::POST,
        path,
        authority: None,
        headers,
        body,
        timeout,
        redis: false,
    })
}

/// `message` as gRPC sends one: uncompressed, length-prefixed.
pub(super) fn frame(message: &[u8]) -> Bytes {
    let mut body = BytesMut::with_capacity(5 + message.len());
    body.put_u8(0);
    body.put_u32(message.len() as u32);
    body.put_slice(message);
    body.freeze()
}

/// What a call's HTTP answer means in gRPC's terms, as Envoy's gRPC
/// client reads it: the status from the trailers (or a trailers-only
/// answer's headers), an HTTP error mapped to a status, and on OK the
/// answer's one message.
pub fn outcome(answer: CalloutAnswer) -> Outcome {
    let (status, headers, body, trailers) = match answer {
        // Envoy's own timeout is its router's 504, which is UNAVAILABLE
        // in gRPC's terms (not DEADLINE_EXCEEDED): filters written for it
        // see that code.
        CalloutAnswer::Failed {
            timed_out: true, ..
        } => return Err((code::UNAVAILABLE, "upstream request timeout".into())),
        CalloutAnswer::Failed { why, .. } => return Err((code::UNAVAILABLE, why)),
        CalloutAnswer::Answered {
            status,
            headers,
            body,
            trailers,
        } => (status, headers, body, trailers),
    };
    if status != 200 {
        return Err((
            from_http(status),
            format!("upstream answered HTTP {status}"),
        ));
    }
    let field = |name: &str| {
        let trailer = trailers.as_ref().and_then(|t| t.get(name));
        trailer.or_else(|| headers.get(name))
    };
    let Some(grpc_status) = field("grpc-status") else {
        return Err((code::INTERNAL, "the answer had no grpc-status".into()));
    };
    let grpc_status = std::str::from_utf8(grpc_status.as_bytes())
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(code::UNKNOWN);
    if grpc_status != code::OK {
        let message = field("grpc-message").map_or_else(String::new, |m| decode(m.as_bytes()));
        return Err((grpc_status, message));
    }
    match body.as_ref() {
        [0, len @ ..] if len.len() >= 4 => {
            let n = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
            if len.len() - 4 == n {
                Ok(body.slice(5..))
            } else {
                Err((code::INTERNAL, "the answer is not one gRPC message".into()))
            }
        }
        [1, ..] => Err((code::INTERNAL, "the answer's message is compressed".into())),
        _ => Err((code::INTERNAL, "the answer had no message".into())),
    }
}

/// The gRPC status of an HTTP error, as gRPC's HTTP mapping (and
/// Envoy's `httpToGrpcStatus`) gives it.
pub(super) fn from_http(status: u16) -> u32 {
    match status {
        400 => code::INTERNAL,
        401 => code::UNAUTHENTICATED,
        403 => code::PERMISSION_DENIED,
        404 => code::UNIMPLEMENTED,
        429 | 502 | 503 | 504 => code::UNAVAILABLE,
        _ => code::UNKNOWN,
    }
}

/// A `grpc-message`, percent-decoded as the gRPC spec sends it; as UTF-8
/// (the Rust SDK takes the status message as a `String`).
pub(super) fn decode(raw: &[u8]) -> String {
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (raw[i], raw.get(i + 1).copied(), raw.get(i + 2).copied()) {
            (b'%', Some(h), Some(l)) if hex(h).is_some() && hex(l).is_some() => {
                out.push((hex(h).unwrap_or(0) * 16 + hex(l).unwrap_or(0)) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered(status: u16, trailers: &[(&'static str, &'static str)], body: &[u8]) -> Outcome {
        let mut t = http::HeaderMap::new();
        for (k, v) in trailers {
            t.insert(*k, http::HeaderValue::from_static(v));
        }
        outcome(CalloutAnswer::Answered {
            status,
            headers: http::HeaderMap::new(),
            body: Bytes::copy_from_slice(body),
            trailers: Some(Box::new(t)),
        })
    }

    #[test]
    fn an_answer_reads_as_envoys_grpc_client_reads_it() {
        let ok = answered(200, &[("grpc-status", "0")], b"\0\0\0\0\x02hi");
        assert_eq!(ok, Ok(Bytes::from_static(b"hi")));
        let denied = answered(
            200,
            &[
                ("grpc-status", "7"),
                ("grpc-message", "no%20way%3A%20%E2%9C%8B"),
            ],
            b"",
        );
        assert_eq!(denied, Err((7, "no way: \u{270b}".into())));
        assert_eq!(answered(503, &[], b"").unwrap_err().0, code::UNAVAILABLE);
        assert_eq!(answered(404, &[], b"").unwrap_err().0, code::UNIMPLEMENTED);
        assert_eq!(answered(200, &[], b"").unwrap_err().0, code::INTERNAL);
        let short = answered(200, &[("grpc-status", "0")], b"\0\0\0\0\x09hi");
        assert_eq!(short.unwrap_err().0, code::INTERNAL);
        let timed_out = outcome(CalloutAnswer::Failed {
            timed_out: true,
            why: String::new(),
        });
        assert_eq!(timed_out.unwrap_err().0, code::UNAVAILABLE);
    }

    #[test]
    fn a_call_is_framed_as_grpc_asks() {
        let meta: [(&[u8], &[u8]); 2] = [(b"x-from", b"filter"), (b":authority", b"evil")];
        let c = callout(
            "app".into(),
            "/test.Echo/Say".into(),
            &meta,
            Some((b"hey", 0)),
        )
        .unwrap();
        assert_eq!(c.method, http::Method::POST);
        assert_eq!(&c.body[..], b"\0\0\0\0\x03hey");
        assert_eq!(c.headers["content-type"], "application/grpc");
        assert_eq!(c.headers["te"], "trailers");
        assert_eq!(c.headers["x-from"], "filter");
        assert_eq!(c.headers["grpc-timeout"], "60000m");
        assert_eq!(c.timeout, MAX_CALLOUT_TIMEOUT);
        assert!(c.authority.is_none());
    }
}
