use super::*;

fn head(raw: &str) -> Result<RequestHead, Refused> {
    match parse_head(raw.as_bytes())? {
        Some((head, len)) => {
            assert_eq!(len, raw.len(), "the whole head, nothing after it");
            Ok(head)
        }
        None => panic!("{raw:?}: incomplete"),
    }
}

fn status(raw: &str) -> StatusCode {
    match head(raw) {
        Ok(h) => panic!("{raw:?} was taken, framed {:?}", h.body),
        Err(refused) => refused.status,
    }
}

const BAD: StatusCode = StatusCode::BAD_REQUEST;

#[test]
fn a_plain_request_is_read_with_its_framing_and_connection() {
    let h = head("GET /a?b=1 HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    assert_eq!(
        (h.method, &h.target[..], h.version),
        (Method::GET, &b"/a?b=1"[..], Version::HTTP_11)
    );
    assert_eq!(
        (h.body, h.close, h.expects_continue),
        (BodyLength::Empty, false, false)
    );
    let h = head("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 12\r\nConnection: close\r\n\r\n")
        .unwrap();
    assert_eq!((h.body, h.close), (BodyLength::Known(12), true));
    let h = head("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding:  Chunked \r\nExpect: 100-continue\r\n\r\n")
        .unwrap();
    assert_eq!((h.body, h.expects_continue), (BodyLength::Chunked, true));
    // HTTP/1.0 closes unless asked to keep alive; it needs no Host.
    assert!(head("GET / HTTP/1.0\r\n\r\n").unwrap().close);
    assert!(
        !head("GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n")
            .unwrap()
            .close
    );
}

#[test]
fn a_head_not_all_there_waits_and_one_too_large_is_431() {
    assert!(
        parse_head(b"GET / HTTP/1.1\r\nHost: x\r\n")
            .unwrap()
            .is_none()
    );
    let long = format!("GET / HTTP/1.1\r\nHost: x\r\nX-A: {}", "a".repeat(MAX_HEAD));
    assert_eq!(
        parse_head(long.as_bytes()).unwrap_err().status,
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
    );
    let many: String = (0..=MAX_HEADERS).map(|i| format!("X-{i}: 1\r\n")).collect();
    assert_eq!(
        status(&format!("GET / HTTP/1.1\r\nHost: x\r\n{many}\r\n")),
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
    );
}

/// CL.TE and TE.CL: whichever the next hop believes, the two readings
/// differ, so neither is taken.
#[test]
fn both_framings_at_once_are_refused() {
    for raw in [
        "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 6\r\nTransfer-Encoding: chunked\r\n\r\n",
        "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n",
    ] {
        assert_eq!(status(raw), BAD, "{raw:?}");
    }
}

/// TE.TE: a coding one reader takes for `chunked` and another does not.
#[test]
fn transfer_encodings_other_than_plain_chunked_are_refused() {
    let te = |value: &str| {
        status(&format!(
            "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: {value}\r\n\r\n"
        ))
    };
    for value in [
        "chunked, chunked",
        "gzip, chunked",
        "chunked, identity",
        "chunked,",
        ", chunked",
        "\"chunked\"",
        "chunked;q=1",
    ] {
        assert_eq!(te(value), BAD, "{value:?}");
    }
    for value in ["xchunked", "chunk", "identity", "gzip", "chunked-x"] {
        assert_eq!(te(value), StatusCode::NOT_IMPLEMENTED, "{value:?}");
    }
    // Two fields are one list: `chunked` twice.
    assert_eq!(
        status(
            "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n"
        ),
        BAD
    );
    // A space before the colon, a vertical tab in the value: not a field.
    assert_eq!(
        status("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding : chunked\r\n\r\n"),
        BAD
    );
    assert_eq!(
        status("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: \x0bchunked\r\n\r\n"),
        BAD
    );
    // HTTP/1.0 has no transfer codings: its framing is faulty.
    assert_eq!(
        status("POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n"),
        BAD
    );
}

#[test]
fn content_lengths_other_than_one_plain_number_are_refused() {
    let cl = |fields: &str| status(&format!("POST / HTTP/1.1\r\nHost: x\r\n{fields}\r\n"));
    for fields in [
        "Content-Length: 5\r\nContent-Length: 6\r\n",
        // Equal values too: one reader may take the first, one the list.
        "Content-Length: 5\r\nContent-Length: 5\r\n",
        "Content-Length: 5, 5\r\n",
        "Content-Length: +5\r\n",
        "Content-Length: -1\r\n",
        "Content-Length: 5 5\r\n",
        "Content-Length: 0x10\r\n",
        "Content-Length: \r\n",
        "Content-Length: 99999999999999999999\r\n",
    ] {
        assert_eq!(cl(fields), BAD, "{fields:?}");
    }
}

#[test]
fn obs_fold_bare_lf_and_host_rules_are_refused() {
    // obs-fold: a continuation line.
    assert_eq!(
        status("GET / HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n 2\r\n\r\n"),
        BAD
    );
    // A bare LF anywhere in the head.
    assert_eq!(status("GET / HTTP/1.1\nHost: x\r\n\r\n"), BAD);
    assert_eq!(status("GET / HTTP/1.1\r\nHost: x\n\r\n"), BAD);
    assert_eq!(status("GET / HTTP/1.1\r\nHost: x\r\n\n"), BAD);
    // An HTTP/1.1 request has one Host.
    assert_eq!(status("GET / HTTP/1.1\r\n\r\n"), BAD);
    assert_eq!(status("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"), BAD);
    // Not HTTP/1.x at all.
    assert!(parse_head(b"GET / HTTP/2.0\r\nHost: x\r\n\r\n").is_err());
    assert!(parse_head(b"G\x01T / HTTP/1.1\r\nHost: x\r\n\r\n").is_err());
}

/// Decodes `wire` given in pieces of `step` bytes: the body and trailers.
fn decode(wire: &[u8], step: usize) -> Result<(Vec<u8>, HeaderMap, usize), Refused> {
    let mut decoder = ChunkedDecoder::default();
    let mut buf = BytesMut::new();
    let mut body = Vec::new();
    let mut fed = 0;
    loop {
        match decoder.next(&mut buf)? {
            Chunk::Data(d) => body.extend_from_slice(&d),
            // What is left after the body: in the buffer, and not fed yet.
            Chunk::End(trailers) => return Ok((body, trailers, buf.len() + wire.len() - fed)),
            Chunk::More if fed < wire.len() => {
                let n = step.min(wire.len() - fed);
                buf.extend_from_slice(&wire[fed..fed + n]);
                fed += n;
            }
            Chunk::More => panic!("{wire:?}: ran out of input"),
        }
    }
}

#[test]
fn a_chunked_body_is_read_whole_in_any_pieces_and_stops_at_its_end() {
    let wire = b"5;ext=1\r\nhello\r\n6 ; x\r\n world\r\n0\r\nX-Sum: 7\r\n\r\nGET /next";
    for step in [1, 2, 3, 7, wire.len()] {
        let (body, trailers, left) = decode(wire, step).unwrap();
        assert_eq!(body, b"hello world", "step {step}");
        assert_eq!(trailers.get("x-sum").unwrap(), "7");
        // The next request's bytes are left in the buffer, not taken.
        assert_eq!(
            left,
            wire.len() - wire.iter().position(|&b| b == b'G').unwrap()
        );
    }
    let (body, trailers, _) = decode(b"A\r\n0123456789\r\n0\r\n\r\n", 4).unwrap();
    assert_eq!((body.len(), trailers.len()), (10, 0));
}

#[test]
fn chunk_sizes_and_line_ends_other_than_plain_are_refused() {
    for wire in [
        &b"0x5\r\nhello\r\n0\r\n\r\n"[..],
        b"+5\r\nhello\r\n0\r\n\r\n",
        b" 5\r\nhello\r\n0\r\n\r\n",
        b"\r\nhello\r\n0\r\n\r\n",
        b"g\r\n",
        b"1 1\r\nx\r\n0\r\n\r\n",
        // Overflows a u64 (17 digits), or a chunk-size line without end.
        b"10000000000000000\r\n",
        // Data not followed by CRLF: a length that lies.
        b"3\r\nhello\r\n0\r\n\r\n",
        // Bare LFs.
        b"5\nhello\r\n0\r\n\r\n",
        b"5\r\nhello\r\n0\r\nX: 1\n\r\n",
    ] {
        assert_eq!(
            decode(wire, 1).map(|(b, ..)| b).unwrap_err().status,
            BAD,
            "{:?}",
            String::from_utf8_lossy(wire)
        );
    }
    let long = format!("5;{}\r\n", "e".repeat(MAX_CHUNK_LINE + 10));
    assert_eq!(decode(long.as_bytes(), 512).unwrap_err().status, BAD);
}

/// Taken off a connection's buffer, a head leaves the next request's
/// bytes there; its target and values are the head's own bytes (no copy),
/// and names kept from one head serve the next only where spelled alike.
#[test]
fn a_head_taken_leaves_the_next_request_and_shares_its_bytes() {
    let mut buf = BytesMut::from(
        &b"GET /a?x=1 HTTP/1.1\r\nHost: h\r\nX-Custom: 1\r\n\r\nGET /b HTTP/1.1\r\nhost: h\r\nX-Other: 2\r\n\r\n"[..],
    );
    let start = buf.as_ptr() as usize;
    let mut names = FieldNames::default();
    let first = take_head(&mut buf, &mut names).unwrap().unwrap();
    assert_eq!(&first.target[..], b"/a?x=1");
    let value = first.headers.get("x-custom").unwrap();
    assert_eq!(value, "1");
    let within = |p: usize| (start..start + 80).contains(&p);
    assert!(
        within(first.target.as_ptr() as usize),
        "the target is not a copy"
    );
    assert!(
        within(value.as_bytes().as_ptr() as usize),
        "a value is not a copy"
    );
    assert!(buf.starts_with(b"GET /b HTTP/1.1\r\n"));
    let second = take_head(&mut buf, &mut names).unwrap().unwrap();
    assert!(buf.is_empty());
    assert_eq!(&second.target[..], b"/b");
    let fields: Vec<_> = second.headers.keys().map(|k| k.as_str()).collect();
    assert_eq!(fields, ["host", "x-other"]);
    assert_eq!(second.headers.get("x-other").unwrap(), "2");
    assert!(second.headers.get("x-custom").is_none());
}
