//! The PROXY protocol header, the first bytes of a connection on a
//! listener behind a TCP balancer: any bytes a client sends.
#![no_main]

use libfuzzer_sys::fuzz_target;
use portcullis::proxy_protocol::{Parsed, parse};

fuzz_target!(|bytes: &[u8]| {
    if let Parsed::Header(len, _) = parse(bytes) {
        assert!(len <= bytes.len(), "header longer than the input");
        // The reader consumes every byte while the header is partial, so
        // each proper prefix of a header must parse as partial: never as a
        // header of its own, nor as invalid.
        for cut in 0..len {
            assert_eq!(
                parse(&bytes[..cut]),
                Parsed::Partial,
                "prefix of {cut} bytes"
            );
        }
        // What follows the header (the client's own bytes) changes nothing.
        assert_eq!(parse(&bytes[..len]), parse(bytes));
    }
});
