//! The first bytes on the tunnel port: a WebSocket upgrade, a balancer's
//! health check, a stray HTTP request, or garbage.
#![no_main]

use libfuzzer_sys::fuzz_target;
use portcullis::handshake_head::{Head, classify};

fuzz_target!(|bytes: &[u8]| {
    if let Ok(Some(Head::Plain(request))) = classify(bytes) {
        // Logged as the refused request: bounded by the head it came in.
        assert!(request.len() <= bytes.len() + 2, "{request:?}");
    }
});
