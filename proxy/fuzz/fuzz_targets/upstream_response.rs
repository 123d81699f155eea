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

fuzz_target!(|bytes: &[u8]| {
    let Some((&first, response)) = bytes.split_first() else {
        return;
    };
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
