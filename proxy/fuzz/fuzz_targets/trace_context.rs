//! A request's `traceparent`, as any client sends it: joined when valid,
//! replaced by a new trace when not, and always sent on well formed.
#![no_main]

use http::{HeaderMap, HeaderValue};
use libfuzzer_sys::fuzz_target;
use portcullis::trace_context::{TRACEPARENT, join, parse};

fuzz_target!(|bytes: &[u8]| {
    let caller = parse(bytes);
    if let Some((trace, parent, _)) = caller {
        assert!(trace != 0 && parent != 0, "{bytes:?}");
    }
    let Ok(value) = HeaderValue::from_bytes(bytes) else {
        return;
    };
    let mut headers = HeaderMap::new();
    headers.insert(TRACEPARENT, value);
    let context = join(&mut headers, 1 << 63, true);
    // What goes upstream parses back to this trace and this proxy's span.
    let sent = headers.get(TRACEPARENT).expect("a traceparent is sent on");
    assert_eq!(
        parse(sent.as_bytes()),
        Some((context.trace_id, context.span_id, u8::from(context.sampled))),
        "{bytes:?} -> {sent:?}"
    );
    match caller {
        Some((trace, parent, flags)) => assert_eq!(
            (context.trace_id, context.parent, context.sampled),
            (trace, Some(parent), flags & 1 == 1),
            "{bytes:?}"
        ),
        None => assert_eq!(context.parent, None, "{bytes:?}"),
    }
});
