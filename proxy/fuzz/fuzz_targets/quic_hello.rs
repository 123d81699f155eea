//! The hello on a QUIC tunnel's control stream: the first request head a
//! peer on the tunnel port's UDP twin sends, before its token is checked.
//! Any bytes are a hello or an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use portcullis::tunnel::TUNNEL_PATH;
use portcullis::tunnel::parse_hello;

fuzz_target!(|bytes: &[u8]| {
    match parse_hello(bytes) {
        // A hello is a request head for the tunnel's path.
        Ok(_) => assert!(
            bytes
                .windows(TUNNEL_PATH.len())
                .any(|w| w == TUNNEL_PATH.as_bytes()),
            "a hello for another path"
        ),
        Err(message) => assert!(!message.is_empty()),
    }
});
