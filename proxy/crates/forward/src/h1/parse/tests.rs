//! The parser held to httparse (default `ParserConfig`), the reader it
//! replaced: the same answer for every head below, every truncation of
//! it, and every odd byte put in or over each of its bytes.

use super::*;

/// A head as read: its shape and each field's name, value and value
/// offset (`None` for an empty value, whose place httparse leaves open).
type Read = (Head, Vec<(Vec<u8>, Vec<u8>, Option<usize>)>);

fn ours(buf: &[u8], room: usize) -> Result<Option<Read>, ParseError> {
    let mut spans = vec![MaybeUninit::uninit(); room];
    let Some(head) = parse_response(buf, &mut spans)? else {
        return Ok(None);
    };
    let fields = spans[..head.fields]
        .iter()
        .map(|s| {
            // SAFETY: the parser wrote the first `head.fields`.
            let [ns, nl, vs, vl] = unsafe { s.assume_init() }.map(|x| x as usize);
            let value = buf[vs..vs + vl].to_vec();
            (buf[ns..ns + nl].to_vec(), value, (vl > 0).then_some(vs))
        })
        .collect();
    Ok(Some((head, fields)))
}

fn theirs(buf: &[u8], room: usize) -> Result<Option<Read>, ParseError> {
    let mut headers = vec![httparse::EMPTY_HEADER; room];
    let mut resp = httparse::Response::new(&mut headers);
    let len = match resp.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => {
            return Err(match e {
                httparse::Error::HeaderName => ParseError::HeaderName,
                httparse::Error::HeaderValue => ParseError::HeaderValue,
                httparse::Error::NewLine => ParseError::NewLine,
                httparse::Error::Status => ParseError::Status,
                httparse::Error::TooManyHeaders => ParseError::TooManyHeaders,
                httparse::Error::Version => ParseError::Version,
                httparse::Error::Token => panic!("a token error from a response"),
            });
        }
    };
    let base = buf.as_ptr() as usize;
    let head = Head {
        len,
        minor: resp.version.unwrap(),
        code: resp.code.unwrap(),
        fields: resp.headers.len(),
    };
    let fields = resp
        .headers
        .iter()
        .map(|h| {
            let at = h.value.as_ptr() as usize - base;
            let place = (!h.value.is_empty()).then_some(at);
            (h.name.as_bytes().to_vec(), h.value.to_vec(), place)
        })
        .collect();
    Ok(Some((head, fields)))
}

fn same(buf: &[u8], room: usize) {
    assert_eq!(
        ours(buf, room),
        theirs(buf, room),
        "{:?} (room for {room})",
        String::from_utf8_lossy(buf)
    );
}

const HEADS: &[&[u8]] = &[
    b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Fri, 04 Dec 2026 04:18:07 GMT\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok",
    b"HTTP/1.0 404 Not Found\r\n\r\n",
    b"HTTP/1.1 204\r\n\r\n",
    b"HTTP/1.1 200 \r\nA:\r\nB: \t \r\nC:x\r\n\r\n",
    b"\r\n\nHTTP/1.1 301 Moved\nLocation: /x\n\n",
    b"HTTP/1.1 200 OK\r\nX-Long: a value that runs well past eight bytes \t  \r\nX-Obs: caf\xc3\xa9 \xff\r\n\r\n",
    b"HTTP/1.1 200 R\xe9ason\tphrase\r\nSet-Cookie: a=b; Path=/\r\nSet-Cookie: c=d\r\n\r\n",
    b"HTTP/1.1 500 x\r\nName : v\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nFolded: a\r\n  b\r\n\r\n",
    b"HTTP/1.1 200 OK\r\n!#$%&'*+-.^_`|~09AZaz: 1234567890123456789\r\n\r\n",
    b"HTTP/2 200\r\n\r\n",
    b"HTTP/1.1  200 OK\r\n\r\n",
    b"HTTP/1.1 099 low\r\nK: v\r\n\r\n",
];

/// Bytes that sit on the grammar's edges.
const ODD: &[u8] = &[
    0, b'\t', b'\n', b'\r', b' ', b':', 0x1f, 0x7f, 0x80, 0xff, b'a', b'"', b'(', b'H', b'1',
];

#[test]
fn every_head_whole_and_cut_reads_as_httparse_reads_it() {
    for head in HEADS {
        for room in [0, 1, 2, 8] {
            for end in 0..=head.len() {
                same(&head[..end], room);
            }
        }
    }
}

#[test]
fn every_odd_byte_anywhere_reads_as_httparse_reads_it() {
    for head in HEADS {
        for at in 0..head.len() {
            for &odd in ODD {
                let mut over = head.to_vec();
                over[at] = odd;
                same(&over, 8);
                let mut put = head.to_vec();
                put.insert(at, odd);
                same(&put, 8);
            }
        }
    }
}

#[test]
fn values_of_every_length_around_a_word_read_whole() {
    // The block scan's edges: each length up to three blocks, each odd
    // byte at its end.
    for len in 0..=48 {
        for &odd in ODD {
            let mut head = b"HTTP/1.1 200 OK\r\nK: ".to_vec();
            head.extend(std::iter::repeat_n(b'v', len));
            head.push(odd);
            head.extend_from_slice(b"w\r\n\r\n");
            same(&head, 8);
        }
    }
}

#[test]
fn names_of_every_length_with_every_byte_read_whole() {
    // The name block scan's edges: every byte value (the letters' and
    // digits' neighbours, `|0x20` images, bytes from 0x80) at the end of
    // names up to three blocks long, and inside a long one.
    for len in 0..=40 {
        for odd in 0..=255u8 {
            let mut head = b"HTTP/1.1 200 OK\r\n".to_vec();
            head.extend(std::iter::repeat_n(b'N', len));
            head.push(odd);
            head.extend_from_slice(b"x-Y9: v\r\n\r\n");
            same(&head, 8);
        }
    }
    for at in 0..34 {
        for odd in 0..=255u8 {
            let mut head =
                b"HTTP/1.1 200 OK\r\nAbcdefghijklmnopqrstuvwxyz-0123456: v\r\n\r\n".to_vec();
            head[17 + at] = odd;
            same(&head, 8);
        }
    }
}

#[test]
fn a_field_past_the_room_is_an_error_once_read_whole() {
    let head = b"HTTP/1.1 200 OK\r\nA: 1\r\nB: 2\r\n\r\n";
    assert_eq!(ours(head, 1), Err(ParseError::TooManyHeaders));
    // Cut inside the field that does not fit: not yet known.
    assert_eq!(ours(&head[..26], 1), Ok(None));
    assert_eq!(ours(head, 2).unwrap().unwrap().0.fields, 2);
}
