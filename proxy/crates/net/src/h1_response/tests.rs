use super::*;

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::BodyExt;
use http_body_util::combinators::BoxBody;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// An answer and the request it is for.
#[derive(Clone)]
struct Case {
    method: &'static str,
    version: &'static str,
    /// The request's `Connection` field, if any.
    connection: Option<&'static str>,
    status: u16,
    headers: &'static [(&'static str, &'static str)],
    body: BodySize,
}

const fn case(
    status: u16,
    headers: &'static [(&'static str, &'static str)],
    body: BodySize,
) -> Case {
    Case {
        method: "GET",
        version: "HTTP/1.1",
        connection: None,
        status,
        headers,
        body,
    }
}

fn cases() -> Vec<Case> {
    use BodySize::{Known, Unknown};
    let mut all = vec![
        case(200, &[("content-type", "text/plain")], Known(2)),
        case(200, &[("content-type", "text/plain")], Unknown),
        case(200, &[], BodySize::None),
        case(404, &[("content-length", "5"), ("x-a", "1")], Known(5)),
        case(200, &[("content-length", "3")], Unknown),
        case(204, &[("x-a", "1")], BodySize::None),
        case(304, &[("etag", "\"v1\"")], BodySize::None),
        case(418, &[], Known(1)),
        case(599, &[], Known(1)),
        case(
            200,
            &[("set-cookie", "a=1"), ("vary", "x"), ("set-cookie", "b=2")],
            Known(1),
        ),
        case(200, &[("date", "Tue, 01 Dec 2026 10:00:00 GMT")], Known(1)),
        case(200, &[("transfer-encoding", "gzip")], Unknown),
        case(200, &[("connection", "x-hop")], Known(1)),
        case(200, &[("connection", "close")], Known(1)),
        case(200, &[("trailer", "x-sum"), ("x-b", "2")], Unknown),
    ];
    let head = |headers, body| Case {
        method: "HEAD",
        ..case(200, headers, body)
    };
    all.push(head(&[("content-length", "10")], BodySize::None));
    all.push(head(&[], BodySize::None));
    for connection in [Some("close"), Some("keep-alive")] {
        for (headers, body) in [
            (&[][..], Known(1)),
            (&[("connection", "keep-alive")][..], Known(1)),
            (&[("x-a", "1")][..], Unknown),
        ] {
            all.push(Case {
                connection,
                ..case(200, headers, body)
            });
        }
    }
    for connection in [None, Some("keep-alive")] {
        for (headers, body) in [
            (&[][..], Known(1)),
            (&[][..], Unknown),
            (&[("connection", "close")][..], Known(1)),
            (&[("transfer-encoding", "chunked")][..], Unknown),
        ] {
            all.push(Case {
                version: "HTTP/1.0",
                connection,
                ..case(200, headers, body)
            });
        }
    }
    all
}

/// What hyper's server writes for `case`: the response head's bytes.
async fn hyper_head(case: &Case) -> Vec<u8> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let answer = case.clone();
    let server = tokio::spawn(async move {
        let (stream, _) = listener.accept().await.unwrap();
        let service = hyper::service::service_fn(move |_req| {
            let case = answer.clone();
            async move { Ok::<_, Infallible>(response(&case)) }
        });
        let io = hyper_util::rt::TokioIo::new(stream);
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(io, service)
            .await;
    });
    let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
    let connection = case
        .connection
        .map(|c| format!("connection: {c}\r\n"))
        .unwrap_or_default();
    let request = format!(
        "{} / {}\r\nhost: x\r\n{connection}\r\n",
        case.method, case.version
    );
    client.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let end = loop {
        if let Some(i) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = client.read(&mut buf).await.unwrap();
        assert!(n > 0, "hyper closed before a whole head");
        got.extend_from_slice(&buf[..n]);
    };
    drop(client);
    server.abort();
    got.truncate(end);
    got
}

fn response(case: &Case) -> http::Response<BoxBody<Bytes, Infallible>> {
    let body: BoxBody<Bytes, Infallible> = match case.body {
        BodySize::None => http_body_util::Empty::new().boxed(),
        BodySize::Known(n) => {
            http_body_util::Full::new(Bytes::from(vec![b'x'; n as usize])).boxed()
        }
        BodySize::Unknown => Unsized(Some(Bytes::from_static(b"abc"))).boxed(),
    };
    let mut resp = http::Response::new(body);
    *resp.status_mut() = StatusCode::from_u16(case.status).unwrap();
    for (name, value) in case.headers {
        resp.headers_mut()
            .append(*name, HeaderValue::from_static(value));
    }
    resp
}

/// A body of one frame whose length is not known ahead.
struct Unsized(Option<Bytes>);

impl http_body::Body for Unsized {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        std::task::Poll::Ready(self.0.take().map(|d| Ok(http_body::Frame::data(d))))
    }
}

/// What this codec writes for `case`.
fn our_head(case: &Case) -> (Vec<u8>, Encoded) {
    let version = match case.version {
        "HTTP/1.0" => Version::HTTP_10,
        _ => Version::HTTP_11,
    };
    let keep_alive = match (version, case.connection) {
        (Version::HTTP_10, c) => c == Some("keep-alive"),
        (_, c) => c != Some("close"),
    };
    let resp = response(case);
    let method = Method::from_bytes(case.method.as_bytes()).unwrap();
    let mut dst = Vec::new();
    let asked = Asked {
        method: &method,
        version,
        keep_alive,
    };
    let status = resp.status();
    let encoded = encode_head(&mut dst, status, resp.headers(), case.body, asked).unwrap();
    (dst, encoded)
}

/// The head with its `Date` value (which the two wrote at different
/// moments) blanked.
fn dateless(head: &[u8]) -> String {
    let text = String::from_utf8(head.to_vec()).unwrap();
    text.lines()
        .map(|l| match l.strip_prefix("date: ") {
            Some(v) if v.len() == 29 && v.ends_with(" GMT") => "date: <now>",
            _ => l,
        })
        .collect::<Vec<_>>()
        .join("\r\n")
}

/// Every case's head as hyper's server writes it, byte for byte (the
/// date aside), with a framing and connection fate that agree with it.
#[tokio::test]
async fn heads_are_written_as_hyper_writes_them() {
    for case in cases() {
        let theirs = hyper_head(&case).await;
        let (ours, encoded) = our_head(&case);
        let label = format!(
            "{} {} connection={:?} -> {} {:?} {:?}",
            case.method, case.version, case.connection, case.status, case.headers, case.body
        );
        assert_eq!(dateless(&ours), dateless(&theirs), "{label}");
        let text = dateless(&ours).to_ascii_lowercase();
        match encoded.framing {
            Framing::Chunked => assert!(text.contains("chunked"), "{label}"),
            Framing::Length(n) if n > 0 => {
                assert!(text.contains(&format!("content-length: {n}")), "{label}")
            }
            _ => {}
        }
        if text.contains("connection: close") || text.contains(", close") {
            assert!(encoded.close, "{label}");
        }
    }
}

/// A date is written when the answer has none, in the form RFC 9110
/// gives (IMF-fixdate), and none added to one that has its own.
#[test]
fn the_date_is_the_current_second_in_imf_fixdate() {
    let asked = Asked {
        method: &Method::GET,
        version: Version::HTTP_11,
        keep_alive: true,
    };
    let mut dst = Vec::new();
    encode_head(
        &mut dst,
        StatusCode::OK,
        &HeaderMap::new(),
        BodySize::None,
        asked,
    )
    .unwrap();
    let text = String::from_utf8(dst).unwrap();
    let date = text
        .lines()
        .find_map(|l| l.strip_prefix("date: "))
        .expect("a date");
    let when = httpdate::parse_http_date(date).expect("an HTTP date");
    let off = std::time::SystemTime::now()
        .duration_since(when)
        .unwrap_or_default();
    assert!(off.as_secs() < 5, "{date}");
}

/// What hyper refuses or serves by other means is refused, and nothing
/// of it is left written.
#[test]
fn answers_left_to_hyper_are_refused_whole() {
    let get = Asked {
        method: &Method::GET,
        version: Version::HTTP_11,
        keep_alive: true,
    };
    let mut dst = b"before".to_vec();
    for status in [100, 101, 103] {
        let status = StatusCode::from_u16(status).unwrap();
        assert!(encode_head(&mut dst, status, &HeaderMap::new(), BodySize::None, get).is_err());
    }
    let connect = Asked {
        method: &Method::CONNECT,
        ..get
    };
    assert!(
        encode_head(
            &mut dst,
            StatusCode::OK,
            &HeaderMap::new(),
            BodySize::None,
            connect
        )
        .is_err()
    );
    let mut two = HeaderMap::new();
    two.append(header::CONTENT_LENGTH, HeaderValue::from_static("3"));
    two.append(header::CONTENT_LENGTH, HeaderValue::from_static("4"));
    assert!(encode_head(&mut dst, StatusCode::OK, &two, BodySize::Unknown, get).is_err());
    let mut both = HeaderMap::new();
    both.append(
        header::TRANSFER_ENCODING,
        HeaderValue::from_static("chunked"),
    );
    both.append(header::CONTENT_LENGTH, HeaderValue::from_static("3"));
    assert!(encode_head(&mut dst, StatusCode::OK, &both, BodySize::Known(3), get).is_err());
    assert_eq!(dst, b"before");
}

/// Chunk sizes in lower-case hex without leading zeros, and trailers
/// after the last chunk.
#[test]
fn chunk_size_lines_and_trailers() {
    for (len, want) in [
        (0, "0\r\n"),
        (10, "a\r\n"),
        (4096, "1000\r\n"),
        (usize::MAX, "ffffffffffffffff\r\n"),
    ] {
        let (line, n) = chunk_size(len);
        assert_eq!(&line[..n], want.as_bytes());
    }
    let mut trailers = HeaderMap::new();
    trailers.insert("x-sum", HeaderValue::from_static("7"));
    let mut dst = Vec::new();
    encode_trailers(&mut dst, &trailers);
    assert_eq!(dst, b"0\r\nx-sum: 7\r\n\r\n");
}

/// The differential test's bodies are what they say (a test that
/// compared heads of the wrong body sizes would prove nothing).
#[tokio::test]
async fn the_cases_bodies_have_the_sizes_given() {
    for case in cases() {
        let body = response(&case).into_body();
        let hint = http_body::Body::size_hint(&body).exact();
        match case.body {
            BodySize::Known(n) => assert_eq!(hint, Some(n)),
            BodySize::None => assert_eq!(hint, Some(0)),
            BodySize::Unknown => assert_eq!(hint, None),
        }
        let _ = body.collect().await;
    }
}

/// The length written is the one the body is sent by, in one spelling:
/// the body's own when it knows it, a field's read as a number when not.
#[test]
fn content_length_says_the_length_sent() {
    let get = Asked {
        method: &Method::GET,
        version: Version::HTTP_11,
        keep_alive: true,
    };
    for (field, body, want) in [
        ("09", BodySize::Unknown, "content-length: 9\r\n"),
        ("3", BodySize::Known(5), "content-length: 5\r\n"),
    ] {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static(field));
        let mut dst = Vec::new();
        let encoded = encode_head(&mut dst, StatusCode::OK, &headers, body, get).unwrap();
        let text = String::from_utf8(dst).unwrap();
        assert!(text.contains(want), "{text}");
        assert_eq!(text.matches("content-length").count(), 1, "{text}");
        let n: u64 = want[16..want.len() - 2].parse().unwrap();
        assert_eq!(encoded.framing, Framing::Length(n));
    }
}
