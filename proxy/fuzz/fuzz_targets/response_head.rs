//! An answer's head as the server codec of our own writes it
//! (`net::h1_response`), for any status, fields, body size and request:
//! what it writes must read back as one whole response head, framed one
//! way only and as the codec says it will send the body. A head a client
//! frames otherwise than the body is sent desyncs the connection.
#![no_main]

use http::header::{CONTENT_LENGTH, HeaderMap, HeaderName, HeaderValue, TRANSFER_ENCODING};
use http::{Method, StatusCode, Version};
use libfuzzer_sys::fuzz_target;
use portcullis::h1_response::{Asked, BodySize, Framing, encode_head};

fuzz_target!(|bytes: &[u8]| {
    let [s0, s1, how, n, rest @ ..] = bytes else {
        return;
    };
    let Ok(status) = StatusCode::from_u16(100 + u16::from_le_bytes([*s0, *s1]) % 900) else {
        return;
    };
    let method = match how & 3 {
        0 => Method::GET,
        1 => Method::HEAD,
        2 => Method::POST,
        _ => Method::CONNECT,
    };
    let version = match how & 4 {
        0 => Version::HTTP_11,
        _ => Version::HTTP_10,
    };
    let body = match (how >> 3) & 3 {
        0 => BodySize::None,
        1 => BodySize::Unknown,
        _ => BodySize::Known(u64::from(*n)),
    };
    let asked = Asked {
        method: &method,
        version,
        keep_alive: how & 0x20 != 0,
    };
    let mut headers = HeaderMap::new();
    // As many fields as a head the proxy takes in may have (the reader
    // below has room for the few the codec adds).
    for line in rest.split(|&b| b == b'\n').take(128) {
        let Some(colon) = line.iter().position(|&b| b == b':') else {
            continue;
        };
        let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(&line[..colon]),
            HeaderValue::from_bytes(line[colon + 1..].trim_ascii()),
        ) else {
            continue;
        };
        headers.append(name, value);
    }
    let mut dst = Vec::new();
    let Ok(encoded) = encode_head(&mut dst, status, &headers, body, asked) else {
        assert!(dst.is_empty(), "a refused head leaves nothing written");
        return;
    };
    let mut fields = [httparse::EMPTY_HEADER; 256];
    let mut parsed = httparse::Response::new(&mut fields);
    let len = match parsed.parse(&dst) {
        Ok(httparse::Status::Complete(len)) => len,
        other => panic!(
            "unreadable head {other:?}: {:?}",
            String::from_utf8_lossy(&dst)
        ),
    };
    assert_eq!(len, dst.len(), "one head, nothing after it");
    assert_eq!(parsed.code, Some(status.as_u16()));
    let (mut lengths, mut codings) = (Vec::new(), Vec::new());
    for h in parsed.headers.iter() {
        if h.name.eq_ignore_ascii_case(CONTENT_LENGTH.as_str()) {
            lengths.push(h.value);
        } else if h.name.eq_ignore_ascii_case(TRANSFER_ENCODING.as_str()) {
            codings.push(h.value);
        }
    }
    let bodiless = method == Method::HEAD || matches!(status.as_u16(), 204 | 304);
    match encoded.framing {
        Framing::Chunked => {
            assert!(lengths.is_empty() && codings.len() == 1);
            let last = codings[0].rsplit(|&b| b == b',').next().unwrap_or_default();
            assert!(last.trim_ascii().eq_ignore_ascii_case(b"chunked"));
        }
        Framing::CloseDelimited => {
            assert!(encoded.close && lengths.is_empty() && codings.is_empty());
        }
        Framing::Length(n) => {
            assert!(codings.is_empty() || bodiless);
            if !bodiless {
                assert!(lengths.len() <= 1);
                let said = lengths
                    .first()
                    .map(|v| std::str::from_utf8(v).unwrap().trim());
                assert_eq!(
                    said.unwrap_or("0"),
                    n.to_string(),
                    "{:?}",
                    String::from_utf8_lossy(&dst)
                );
            } else {
                assert_eq!(n, 0);
            }
        }
    }
});
