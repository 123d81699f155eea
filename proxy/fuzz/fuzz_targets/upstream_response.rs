//! What an upstream sends back on a pooled HTTP/1.1 connection, read by
//! the proxy's own client (`forward::h1`): the response head, its framing
//! and the body. A misread length or chunk would hand the next request
//! the rest of this response (a desync on a shared connection).
#![no_main]

use std::io::Write as _;
use std::pin::Pin;
use std::sync::OnceLock;

use http::{HeaderMap, HeaderValue, Method, header};
use libfuzzer_sys::fuzz_target;
use portcullis::forward::h1::parse::{ParseError, Span, parse_response};
use portcullis::forward::h1::{Framing, H1Body, H1Conn, Io};

/// One runtime and one listener for every input.
fn world() -> &'static (tokio::runtime::Runtime, std::net::TcpListener) {
    static WORLD: OnceLock<(tokio::runtime::Runtime, std::net::TcpListener)> = OnceLock::new();
    WORLD.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        (rt, listener)
    })
}

/// Asserts that the parser and httparse read `head` alike: complete or
/// not, the same error, the same fields (room for `room`).
fn read_as_httparse(head: &[u8], room: usize) {
    let mut spans = vec![std::mem::MaybeUninit::<Span>::uninit(); room];
    let ours = parse_response(head, &mut spans);
    let mut fields = vec![httparse::EMPTY_HEADER; room];
    let mut resp = httparse::Response::new(&mut fields);
    let theirs = resp.parse(head);
    match (ours, theirs) {
        (Ok(None), Ok(httparse::Status::Partial)) => {}
        (Ok(Some(ours)), Ok(httparse::Status::Complete(len))) => {
            assert_eq!(ours.len, len);
            assert_eq!(Some(ours.minor), resp.version);
            assert_eq!(Some(ours.code), resp.code);
            assert_eq!(ours.fields, resp.headers.len());
            for (span, field) in spans.iter().zip(resp.headers.iter()) {
                // SAFETY: the parser wrote one span per field it counted.
                let [ns, nl, vs, vl] = unsafe { span.assume_init() }.map(|x| x as usize);
                assert_eq!(&head[ns..ns + nl], field.name.as_bytes());
                assert_eq!(&head[vs..vs + vl], field.value);
            }
        }
        (Err(e), Err(h)) => {
            let same = matches!(
                (e, h),
                (ParseError::HeaderName, httparse::Error::HeaderName)
                    | (ParseError::HeaderValue, httparse::Error::HeaderValue)
                    | (ParseError::NewLine, httparse::Error::NewLine)
                    | (ParseError::Status, httparse::Error::Status)
                    | (ParseError::TooManyHeaders, httparse::Error::TooManyHeaders)
                    | (ParseError::Version, httparse::Error::Version)
            );
            assert!(same, "{e:?} against httparse's {h:?}");
        }
        (ours, theirs) => panic!("{ours:?} against httparse's {theirs:?}"),
    }
}

fuzz_target!(|bytes: &[u8]| {
    let Some((&first, response)) = bytes.split_first() else {
        return;
    };
    read_as_httparse(response, 4 + usize::from(first >> 4));
    let method = if first & 1 == 1 {
        Method::HEAD
    } else {
        Method::GET
    };
    let (rt, listener) = world();
    let proxy_end = std::net::TcpStream::connect(listener.local_addr().unwrap()).expect("connect");
    let (mut upstream, _) = listener.accept().expect("accept");
    // Fits the socket buffers: the whole response is there, then its end.
    upstream.write_all(response).expect("write");
    upstream
        .shutdown(std::net::Shutdown::Write)
        .expect("shutdown");
    proxy_end.set_nonblocking(true).expect("nonblocking");
    rt.block_on(async move {
        let stream = tokio::net::TcpStream::from_std(proxy_end).expect("tokio stream");
        let mut conn = H1Conn::new(Io::Tcp(stream));
        let fields = (&HeaderMap::new(), &Default::default());
        let Ok((resp, framing, keep_alive)) = conn
            .exchange(&method, "", "/", None, fields, None, None)
            .await
        else {
            return;
        };
        // Values were taken without a second check: none may hold a byte
        // a header value cannot (CR, LF, NUL), or it would be written to
        // the client as a header of its own.
        for (name, value) in resp.headers() {
            assert!(
                HeaderValue::from_bytes(value.as_bytes()).is_ok(),
                "{name}: {value:?}"
            );
        }
        // This hop's own connection fields are read, never passed on.
        assert!(!resp.headers().contains_key("keep-alive"));
        if keep_alive {
            assert!(
                resp.version() == http::Version::HTTP_11 && framing != Framing::UntilClose,
                "a connection reused after a body that ends at its close"
            );
        }
        if resp.headers().contains_key(header::TRANSFER_ENCODING) {
            assert!(
                !resp.headers().contains_key(header::CONTENT_LENGTH),
                "a length the coding overrides must not reach the client"
            );
        }
        let mut body = H1Body::new(conn, framing, None);
        let mut got = 0usize;
        let mut ended = false;
        loop {
            let frame =
                std::future::poll_fn(|cx| http_body::Body::poll_frame(Pin::new(&mut body), cx))
                    .await;
            match frame {
                None => {
                    ended = true;
                    break;
                }
                Some(Ok(f)) => {
                    if let Ok(data) = f.into_data() {
                        got += data.len();
                    }
                }
                Some(Err(_)) => break,
            }
        }
        // The body is made of the response's own bytes.
        assert!(got <= response.len(), "{got} > {}", response.len());
        if ended && let Framing::Length(n) = framing {
            assert_eq!(got as u64, n, "a length-framed body ends at its length");
        }
        if method == Method::HEAD {
            assert_eq!(got, 0, "a HEAD response has no body");
        }
    });
});
