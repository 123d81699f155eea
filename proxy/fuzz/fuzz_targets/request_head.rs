//! What a client sends the routing core on an HTTP/1.1 connection, read by
//! the server codec of our own (`net::h1_request`): the head, its framing,
//! and a chunked body. A request framed one way here and another way by
//! the upstream is a smuggled request, so a head taken must have one
//! plain framing, and the decoder must take no more than the body.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use portcullis::h1_request::{BodyLength, Chunk, ChunkedDecoder, parse_head};

fuzz_target!(|bytes: &[u8]| {
    let Ok(Some((head, len))) = parse_head(bytes) else {
        return;
    };
    assert!(len <= bytes.len());
    let te = head.headers.contains_key(http::header::TRANSFER_ENCODING);
    let cl = head
        .headers
        .get_all(http::header::CONTENT_LENGTH)
        .iter()
        .count();
    match head.body {
        BodyLength::Chunked => assert!(te && cl == 0),
        BodyLength::Known(_) => assert!(!te && cl == 1),
        BodyLength::Empty => assert!(!te && cl == 0),
    }
    if head.body != BodyLength::Chunked {
        return;
    }
    // The rest as a chunked body, fed in two pieces.
    let rest = &bytes[len..];
    let mut buf = BytesMut::from(&rest[..rest.len() / 2]);
    let mut fed = rest.len() / 2;
    let mut decoder = ChunkedDecoder::default();
    let mut taken = 0usize;
    loop {
        match decoder.next(&mut buf) {
            Err(_) | Ok(Chunk::End(_)) => break,
            Ok(Chunk::Data(d)) => taken += d.len(),
            Ok(Chunk::More) if fed < rest.len() => {
                buf.extend_from_slice(&rest[fed..]);
                fed = rest.len();
            }
            Ok(Chunk::More) => break,
        }
    }
    assert!(taken <= rest.len());
});
