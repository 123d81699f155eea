//! W3C Trace Context (`traceparent`), the header that ties a request's
//! spans together across services: a request that brings a valid one
//! joins its trace as a child of the caller's span, and follows the
//! caller's sampling decision; one without starts a trace, sampled by the
//! configured share. Either way the upstream gets a `traceparent` naming
//! this proxy's span as its parent, so its spans nest under ours.

use http::HeaderMap;
use http::header::{HeaderName, HeaderValue};

/// The header carrying the trace id, the parent span and the flags.
pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
/// Vendors' own state, passed on as long as the trace is joined.
pub const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");

/// The request's place in its trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    /// 128 bits, never zero.
    pub trace_id: u128,
    /// This proxy's span for the request, the upstream's parent.
    pub span_id: u64,
    /// The caller's span, when the request brought a `traceparent`.
    pub parent: Option<u64>,
    /// Whether the trace is recorded (the `sampled` flag).
    pub sampled: bool,
}

impl TraceContext {
    /// The trace id as 32 lower-case hex digits.
    pub fn trace_hex(&self) -> [u8; 32] {
        let mut out = [0u8; 32];
        crate::request_id::hex_into((self.trace_id >> 64) as u64, &mut out[..16]);
        crate::request_id::hex_into(self.trace_id as u64, &mut out[16..]);
        out
    }

    /// The `traceparent` to send upstream: this trace, this proxy's span.
    pub fn header(&self) -> HeaderValue {
        let mut text = *b"00-00000000000000000000000000000000-0000000000000000-00";
        text[3..35].copy_from_slice(&self.trace_hex());
        crate::request_id::hex_into(self.span_id, &mut text[36..52]);
        if self.sampled {
            text[54] = b'1';
        }
        HeaderValue::from_bytes(&text).expect("hex digits make a header value")
    }
}

/// Joins the trace `headers` name (when the caller is `trusted`), or
/// starts one sampled when a random draw falls under `threshold` (out of
/// 2^64; above `u64::MAX` always), and sets the `traceparent` the
/// upstream gets.
pub fn join(headers: &mut HeaderMap, threshold: u128, trusted: bool) -> TraceContext {
    let span_id = nonzero(crate::request_id::random_u64);
    let context = match caller(headers).filter(|_| trusted) {
        Some((trace_id, parent, flags)) => TraceContext {
            trace_id,
            span_id,
            parent: Some(parent),
            sampled: flags & 1 == 1,
        },
        None => {
            // A new trace: whatever state came with an unusable parent
            // belongs to no trace of ours.
            headers.remove(TRACESTATE);
            let high = nonzero(crate::request_id::random_u64);
            let trace_id = u128::from(high) << 64 | u128::from(crate::request_id::random_u64());
            TraceContext {
                trace_id,
                span_id,
                parent: None,
                sampled: u128::from(crate::request_id::random_u64()) < threshold,
            }
        }
    };
    headers.insert(TRACEPARENT, context.header());
    context
}

fn nonzero(random: fn() -> u64) -> u64 {
    loop {
        let n = random();
        if n != 0 {
            return n;
        }
    }
}

/// The caller's trace id, span id and flags, when the request brings
/// exactly one valid `traceparent`.
fn caller(headers: &HeaderMap) -> Option<(u128, u64, u8)> {
    let mut all = headers.get_all(TRACEPARENT).iter();
    let value = all.next()?;
    if all.next().is_some() {
        return None;
    }
    parse(value.as_bytes())
}

/// A `traceparent` value: version, trace id, parent id, flags, as the
/// W3C recommendation defines them. Version `ff` and all-zero ids are
/// invalid; a later version may add fields after a `-`, and is read as
/// version 00.
pub fn parse(value: &[u8]) -> Option<(u128, u64, u8)> {
    const LEN: usize = 55;
    if value.len() < LEN {
        return None;
    }
    let version = hex(&value[0..2])?;
    let fits = match version {
        0xff => false,
        0 => value.len() == LEN,
        _ => value.len() == LEN || value[LEN] == b'-',
    };
    if !fits || value[2] != b'-' || value[35] != b'-' || value[52] != b'-' {
        return None;
    }
    let trace_id = u128::from(hex(&value[3..19])?) << 64 | u128::from(hex(&value[19..35])?);
    let parent = hex(&value[36..52])?;
    let flags = hex(&value[53..55])? as u8;
    (trace_id != 0 && parent != 0).then_some((trace_id, parent, flags))
}

/// Up to 16 lower-case hex digits (upper case is invalid in a
/// `traceparent`): a table lookup a digit, and one check at the end.
fn hex(digits: &[u8]) -> Option<u64> {
    const NIBBLES: [u8; 256] = {
        let mut table = [0xff; 256];
        let mut d = 0;
        while d < 16 {
            table[b"0123456789abcdef"[d] as usize] = d as u8;
            d += 1;
        }
        table
    };
    let mut n = 0u64;
    let mut invalid = 0u8;
    for &d in digits {
        let v = NIBBLES[usize::from(d)];
        invalid |= v;
        n = n << 4 | u64::from(v & 0xf);
    }
    (invalid & 0xf0 == 0).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn parses_the_recommendations_example() {
        assert_eq!(
            parse(EXAMPLE.as_bytes()),
            Some((0x4bf92f3577b34da6a3ce929d0e0e4736, 0x00f067aa0ba902b7, 1))
        );
        // A later version with a field added is read as 00.
        let later = "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what";
        assert!(parse(later.as_bytes()).is_some());
    }

    #[test]
    fn hex_digits_read_as_the_text_says() {
        for n in [0u64, 1, 0xdead_beef, u64::MAX, 0x00f0_67aa_0ba9_02b7] {
            assert_eq!(hex(format!("{n:016x}").as_bytes()), Some(n));
        }
        assert_eq!(hex(b"01"), Some(1));
        for bad in [&b"0G"[..], b"AB", b"1 ", b"-1", b"\xff0"] {
            assert_eq!(hex(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn refuses_what_the_recommendation_calls_invalid() {
        for bad in [
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "",
        ] {
            assert_eq!(parse(bad.as_bytes()), None, "{bad}");
        }
    }

    #[test]
    fn a_caller_trace_is_joined_and_its_sampling_followed() {
        for (flags, sampled) in [("01", true), ("00", false)] {
            let mut headers = HeaderMap::new();
            let sent = EXAMPLE.replace("-01", &format!("-{flags}"));
            headers.insert(TRACEPARENT, sent.parse().unwrap());
            headers.insert(TRACESTATE, "congo=t61rcWkgMzE".parse().unwrap());
            // Never sampled by chance: only the caller's flag decides.
            let ctx = join(&mut headers, 0, true);
            assert_eq!(ctx.trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
            assert_eq!(ctx.parent, Some(0x00f067aa0ba902b7));
            assert_eq!(ctx.sampled, sampled);
            let out = headers[TRACEPARENT].to_str().unwrap().to_owned();
            assert_eq!(&out[..36], &EXAMPLE[..36]);
            assert_eq!(&out[36..52], format!("{:016x}", ctx.span_id));
            assert_ne!(&out[36..52], "00f067aa0ba902b7");
            assert_eq!(&out[52..], format!("-{flags}"));
            assert_eq!(headers[TRACESTATE], "congo=t61rcWkgMzE");
        }
    }

    #[test]
    fn an_untrusted_caller_gets_a_trace_of_its_own() {
        let mut headers = HeaderMap::new();
        headers.insert(TRACEPARENT, EXAMPLE.parse().unwrap());
        headers.insert(TRACESTATE, "congo=t61rcWkgMzE".parse().unwrap());
        // Its sampled flag decides nothing either.
        let ctx = join(&mut headers, 0, false);
        assert_ne!(ctx.trace_id, 0x4bf92f3577b34da6a3ce929d0e0e4736);
        assert_eq!((ctx.parent, ctx.sampled), (None, false));
        assert!(!headers.contains_key(TRACESTATE));
        assert_eq!(
            parse(headers[TRACEPARENT].as_bytes()),
            Some((ctx.trace_id, ctx.span_id, 0))
        );
    }

    #[test]
    fn a_new_trace_is_sampled_by_the_threshold() {
        let mut headers = HeaderMap::new();
        headers.insert(TRACESTATE, "orphan=1".parse().unwrap());
        let ctx = join(&mut headers, 1 << 64, true);
        assert!(ctx.sampled && ctx.parent.is_none() && ctx.trace_id >> 64 != 0);
        assert!(!headers.contains_key(TRACESTATE));
        assert_eq!(
            parse(headers[TRACEPARENT].as_bytes()),
            Some((ctx.trace_id, ctx.span_id, 1))
        );
        let never = join(&mut HeaderMap::new(), 0, true);
        assert!(!never.sampled);
        // Two headers are one too many: a new trace.
        let mut headers = HeaderMap::new();
        headers.append(TRACEPARENT, EXAMPLE.parse().unwrap());
        headers.append(TRACEPARENT, EXAMPLE.parse().unwrap());
        assert_eq!(join(&mut headers, 0, true).parent, None);
        // About half with half the range.
        let sampled = (0..2000)
            .filter(|_| join(&mut HeaderMap::new(), 1 << 63, true).sampled)
            .count();
        assert!((800..1200).contains(&sampled), "{sampled}");
    }
}
