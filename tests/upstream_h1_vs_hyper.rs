//! The proxy's own HTTP/1.1 client (`forward::h1`) against hyper's, on
//! the same bytes from an upstream: for each answer in the table, what a
//! client gets through the proxy must be what hyper's client makes of the
//! answer directly (the status, the end-to-end headers, the body, and
//! whether it ended well), or a refusal where hyper refuses. Where the
//! proxy differs on purpose, the table says how and why. An HTTP/2
//! client of the proxy must get what an HTTP/1.1 one does, and a request
//! with a streamed body (whose answer hyper's client reads in the proxy)
//! what one without a body does.

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::Request;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::support::Proxy;

/// What a client made of one answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seen {
    /// No answer: hyper's error before a head, or the proxy's own 502.
    Refused,
    /// The connection ended without an answer (through the proxy).
    Nothing,
    Answer {
        status: u16,
        /// End-to-end headers, lower case, in order (framing and
        /// connection headers left out: each hop has its own).
        headers: Vec<(String, Vec<u8>)>,
        body: Vec<u8>,
        /// The body ended as its framing said (not cut short).
        whole: bool,
    },
}

/// An upstream that answers `GET /N` with case N's bytes, then closes.
pub async fn upstream() -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut head = Vec::new();
                while !head.ends_with(b"\r\n\r\n") {
                    let mut byte = [0u8; 1];
                    match sock.read(&mut byte).await {
                        Ok(1) => head.push(byte[0]),
                        _ => return,
                    }
                }
                let head = String::from_utf8_lossy(&head).into_owned();
                let n: usize = head
                    .split(' ')
                    .nth(1)
                    .and_then(|t| t.trim_start_matches('/').parse().ok())
                    .expect("GET /N");
                let _ = sock.write_all(cases()[n].answer).await;
                let _ = sock.shutdown().await;
                // Read what else comes (nothing should) until the peer
                // closes, so the close is a FIN and not a reset.
                let mut rest = [0u8; 1024];
                while matches!(sock.read(&mut rest).await, Ok(n) if n > 0) {}
            });
        }
    });
    addr
}

/// Case N's request (to `/N`) on a fresh connection to `addr` with
/// hyper's client, and what came of it.
pub async fn send(addr: std::net::SocketAddr, n: usize, through_proxy: bool) -> Seen {
    send_as(addr, "upstream.test", n, through_proxy).await
}

/// [`send`] with `host` as the Host.
pub async fn send_as(
    addr: std::net::SocketAddr,
    host: &str,
    n: usize,
    through_proxy: bool,
) -> Seen {
    let empty = Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed();
    exchange(addr, host, n, through_proxy, cases()[n].method, empty).await
}

/// Case N's request through the proxy at `addr` as a POST with a body of
/// unknown length: the proxy streams it through hyper's client, which
/// then reads the answer, not the proxy's own reader.
async fn send_streamed(addr: std::net::SocketAddr, n: usize) -> Seen {
    let frames = [Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(
        Bytes::from_static(b"streamed"),
    ))];
    let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames)).boxed();
    exchange(addr, "upstream.test", n, true, "POST", body).await
}

type Body = http_body_util::combinators::BoxBody<Bytes, std::convert::Infallible>;

async fn exchange(
    addr: std::net::SocketAddr,
    host: &str,
    n: usize,
    through_proxy: bool,
    method: &str,
    body: Body,
) -> Seen {
    let exchange = async {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let io = hyper_util::rt::TokioIo::new(tcp);
        // Limits well past both readers' own, so that they are what the
        // cases compare.
        let Ok((mut send, conn)) = hyper::client::conn::http1::Builder::new()
            .max_headers(1000)
            .max_buf_size(1 << 20)
            .handshake(io)
            .await
        else {
            return Seen::Refused;
        };
        tokio::spawn(conn);
        let req = Request::builder()
            .method(method)
            .uri(format!("/{n}"))
            .header("host", host)
            .body(body)
            .unwrap();
        match send.send_request(req).await {
            Ok(resp) => read(resp, through_proxy).await,
            Err(_) if through_proxy => Seen::Nothing,
            Err(_) => Seen::Refused,
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), exchange)
        .await
        .unwrap_or_else(|_| panic!("case {n}: no outcome within 10 s"))
}

/// Case N's request through the proxy at `addr`, as an HTTP/2 client
/// (prior knowledge) sends it.
async fn send_h2c(addr: std::net::SocketAddr, n: usize) -> Seen {
    let exchange = async {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let io = hyper_util::rt::TokioIo::new(tcp);
        let (mut send, conn) =
            hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                .max_header_list_size(1 << 20)
                .handshake(io)
                .await
                .expect("HTTP/2 handshake with the proxy");
        tokio::spawn(conn);
        let req = Request::builder()
            .method(cases()[n].method)
            .uri(format!("http://upstream.test/{n}"))
            .body(Empty::<Bytes>::new())
            .unwrap();
        match send.send_request(req).await {
            Ok(resp) => read(resp, true).await,
            Err(_) => Seen::Nothing,
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), exchange)
        .await
        .unwrap_or_else(|_| panic!("case {n} over HTTP/2: no outcome within 10 s"))
}

/// What a client makes of `resp`, read to its end.
async fn read(resp: hyper::Response<hyper::body::Incoming>, through_proxy: bool) -> Seen {
    let status = resp.status().as_u16();
    let headers: Vec<(String, Vec<u8>)> = resp
        .headers()
        .iter()
        .filter(|(name, _)| !HOP.contains(&name.as_str()))
        .filter(|(name, _)| !(through_proxy && PROXY_ADDS.contains(&name.as_str())))
        .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
        .collect();
    let mut body = resp.into_body();
    let mut bytes = Vec::new();
    let whole = loop {
        match body.frame().await {
            None => break true,
            Some(Err(_)) => break false,
            Some(Ok(frame)) => {
                if let Some(data) = frame.data_ref() {
                    bytes.extend_from_slice(data);
                }
            }
        }
    };
    if through_proxy && status == 502 && bytes.starts_with(b"{\"error\"") {
        return Seen::Refused;
    }
    Seen::Answer {
        status,
        headers,
        body: bytes,
        whole,
    }
}

/// Framing and connection headers: each hop sends its own.
const HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "transfer-encoding",
    "content-length",
    "trailer",
    "upgrade",
    "proxy-connection",
];

/// What the proxy's server adds to an answer that lacks it.
const PROXY_ADDS: &[&str] = &["date"];

/// One upstream answer to a request with `method`, and how the proxy's
/// outcome relates to hyper's.
pub struct Case {
    pub name: &'static str,
    method: &'static str,
    answer: &'static [u8],
    expect: Expect,
}

impl Case {
    /// Whether the answer's body breaks: what a client gets then depends
    /// on timing (no answer, a 502, or the answer cut short), never a
    /// whole answer.
    fn breaks(&self) -> bool {
        matches!(self.expect, Expect::CutShort | Expect::BrokenFirst)
    }

    /// Whether two ways of getting this answer came out alike: the same,
    /// or neither whole when its body breaks.
    pub fn alike(&self, one: &Seen, other: &Seen) -> bool {
        let whole = |seen: &Seen| matches!(seen, Seen::Answer { whole: true, .. });
        if self.breaks() {
            !whole(one) && !whole(other)
        } else {
            one == other
        }
    }
}

const fn get(name: &'static str, answer: &'static [u8], expect: Expect) -> Case {
    Case {
        name,
        method: "GET",
        answer,
        expect,
    }
}

const fn head(name: &'static str, answer: &'static [u8], expect: Expect) -> Case {
    Case {
        name,
        method: "HEAD",
        answer,
        expect,
    }
}

#[derive(Clone, Copy)]
enum Expect {
    /// What hyper makes of it.
    Same,
    /// hyper's answer cut short, or no answer at all: hyper's server
    /// writes the head and the first body bytes together, so a body that
    /// breaks within the bytes already read ends the client connection
    /// before anything was sent. Either way a client cannot take it for
    /// a whole answer (the access log marks it aborted).
    CutShort,
    /// hyper's answer cut short, where the proxy answers 502: chunked
    /// framing broken in the bytes that came with the head, which the
    /// proxy's own reader checks before answering, while nothing has
    /// gone to the client (hyper's client, reading the answers to
    /// streamed requests, cuts them short as [`Expect::CutShort`]).
    BrokenFirst,
    /// Refused by the proxy (its 502) where hyper reads it.
    Refused,
    /// A head larger than the proxy takes (64 KiB; nginx's buffer is 4
    /// or 8 KiB): refused as [`Expect::Refused`], by its own reader and,
    /// for a streamed request, by hyper's client.
    HeadTooLarge,
}

const FIXED: &[Case] = &[
    get("content-length", b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-a: 1\r\n\r\nhello", Expect::Same),
    get("no reason phrase", b"HTTP/1.1 200\r\ncontent-length: 2\r\n\r\nok", Expect::Same),
    get("HTTP/1.0 until close", b"HTTP/1.0 200 OK\r\nx-a: 1\r\n\r\nuntil close", Expect::Same),
    get("HTTP/1.1 until close", b"HTTP/1.1 200 OK\r\n\r\nuntil close", Expect::Same),
    get("bare LF line ends", b"HTTP/1.1 200 OK\nx-a: 1\ncontent-length: 2\n\nok", Expect::Same),
    get("obs-fold", b"HTTP/1.1 200 OK\r\nx-a: one\r\n two\r\ncontent-length: 2\r\n\r\nok", Expect::Same),
    get("space before the colon", b"HTTP/1.1 200 OK\r\nx-a : v\r\ncontent-length: 2\r\n\r\nok", Expect::Same),
    get("two equal lengths", b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 2\r\n\r\nok", Expect::Same),
    get("a length list", b"HTTP/1.1 200 OK\r\ncontent-length: 2, 2\r\n\r\nok", Expect::Same),
    get("two different lengths", b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nok!", Expect::Same),
    get("a signed length", b"HTTP/1.1 200 OK\r\ncontent-length: +2\r\n\r\nok", Expect::Same),
    get("a length past u64", b"HTTP/1.1 200 OK\r\ncontent-length: 99999999999999999999\r\n\r\nok", Expect::Same),
    get("a body shorter than its length", b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", Expect::CutShort),
    get("chunked with an extension and trailers", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5;a=b\r\nhello\r\n0\r\nx-t: 1\r\n\r\n", Expect::Same),
    get("chunk size with trailing spaces", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5  \r\nhello\r\n0\r\n\r\n", Expect::Same),
    get("chunk size with leading zeros and capitals", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n000A\r\n0123456789\r\n0\r\n\r\n", Expect::Same),
    get("chunk size past u64", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nfffffffffffffffff\r\nhello\r\n0\r\n\r\n", Expect::BrokenFirst),
    get("chunk data longer than its size", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nhello\r\n0\r\n\r\n", Expect::BrokenFirst),
    get("chunked cut before the last chunk", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n", Expect::CutShort),
    get("chunk size not hex", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n", Expect::BrokenFirst),
    get("gzip then chunked", b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", Expect::Same),
    get("chunked then gzip", b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked, gzip\r\n\r\n2\r\nok\r\n0\r\n\r\n", Expect::Same),
    get("Chunked in capitals", b"HTTP/1.1 200 OK\r\ntransfer-encoding: Chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", Expect::Same),
    get("transfer-encoding and content-length", b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", Expect::Same),
    get("transfer-encoding in HTTP/1.0", b"HTTP/1.0 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n", Expect::Same),
    get("interim answers before the final one", b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", Expect::Same),
    get("status 600", b"HTTP/1.1 600 Odd\r\ncontent-length: 2\r\n\r\nok", Expect::Same),
    get("status of two digits", b"HTTP/1.1 99 Odd\r\ncontent-length: 2\r\n\r\nok", Expect::Same),
    get("two spaces after the version", b"HTTP/1.1  200 OK\r\ncontent-length: 2\r\n\r\nok", Expect::Same),
    get("HTTP/1.2", b"HTTP/1.2 200 OK\r\ncontent-length: 2\r\n\r\nok", Expect::Same),
    get("HTTP/2.0 in an HTTP/1 head", b"HTTP/2.0 200 OK\r\ncontent-length: 2\r\n\r\nok", Expect::Same),
    get("not HTTP at all", b"SSH-2.0-OpenSSH_9.6\r\n", Expect::Same),
    get("an empty header value", b"HTTP/1.1 200 OK\r\nx-a:\r\ncontent-length: 2\r\n\r\nok", Expect::Same),
    get("NUL in a header value", b"HTTP/1.1 200 OK\r\nx-a: a\0b\r\ncontent-length: 2\r\n\r\nok", Expect::Same),
    get("bare CR in a header value", b"HTTP/1.1 200 OK\r\nx-a: a\rb\r\ncontent-length: 2\r\n\r\nok", Expect::Same),
    get("a bad header name", b"HTTP/1.1 200 OK\r\nx(a): v\r\ncontent-length: 2\r\n\r\nok", Expect::Same),
    get("obs-text in a header value", b"HTTP/1.1 200 OK\r\nx-a: caf\xc3\xa9 \xff\r\ncontent-length: 2\r\n\r\nok", Expect::Same),
    get("204 with a length and a body", b"HTTP/1.1 204 No Content\r\ncontent-length: 5\r\n\r\nhello", Expect::Same),
    get("304 with a length", b"HTTP/1.1 304 Not Modified\r\ncontent-length: 5\r\netag: \"e\"\r\n\r\n", Expect::Same),
    get("set-cookie twice", b"HTTP/1.1 200 OK\r\nset-cookie: a=1\r\nset-cookie: b=2\r\ncontent-length: 2\r\n\r\nok", Expect::Same),
    get("a head cut short", b"HTTP/1.1 200 OK\r\ncontent-len", Expect::Same),
    get("nothing at all", b"", Expect::Same),
    get(
        "transfer-encoding twice",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
        Expect::Same,
    ),
    get(
        "transfer-encoding identity",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: identity\r\n\r\nuntil close",
        Expect::Same,
    ),
    // RFC 9112 lets a bare LF end a line of the head (2.2), not of
    // chunked coding (7.1). nginx takes it there too; hyper, and so the
    // proxy, do not (its two readers must agree: see the streamed check).
    get(
        "bare LF in chunk lines",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\nhello\n0\n\n",
        Expect::BrokenFirst,
    ),
    get(
        "a quoted chunk extension",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5;a=\"b c\"\r\nhello\r\n0\r\n\r\n",
        Expect::Same,
    ),
    get(
        "whitespace around a value",
        b"HTTP/1.1 200 OK\r\nx-a: \t v w \t\r\ncontent-length: 2 \r\n\r\nok",
        Expect::Same,
    ),
    get(
        "a lower-case version",
        b"http/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok",
        Expect::Same,
    ),
    // A protocol switch no one asked for: the client did not ask either,
    // and hyper would hand over the connection.
    get(
        "101 without an upgrade asked",
        b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
        Expect::Refused,
    ),
    get(
        "100 then the connection closes",
        b"HTTP/1.1 100 Continue\r\n\r\n",
        Expect::Same,
    ),
    get(
        "bytes after a zero length",
        b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\nextra",
        Expect::Same,
    ),
    head(
        "HEAD: a length and no body",
        b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\nx-a: 1\r\n\r\n",
        Expect::Same,
    ),
    head(
        "HEAD: chunked and no body",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
        Expect::Same,
    ),
    head(
        "HEAD: a body sent anyway",
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
        Expect::Same,
    ),
];

/// The table, and the cases made by code: large heads and many fields.
pub fn cases() -> &'static [Case] {
    static ALL: std::sync::LazyLock<Vec<Case>> = std::sync::LazyLock::new(|| {
        let made = |name, head: String, expect| {
            let answer = format!("HTTP/1.1 200 OK\r\n{head}content-length: 2\r\n\r\nok");
            get(
                name,
                Box::leak(answer.into_bytes().into_boxed_slice()),
                expect,
            )
        };
        let fields = |n: usize| (0..n).map(|i| format!("x-f{i}: {i}\r\n")).collect();
        let mut all: Vec<Case> = FIXED
            .iter()
            .map(|c| Case {
                name: c.name,
                method: c.method,
                answer: c.answer,
                expect: c.expect,
            })
            .collect();
        let big = |kib: usize| format!("x-big: {}\r\n", "a".repeat(kib << 10));
        all.push(made("120 fields", fields(120), Expect::Same));
        // More than the proxy takes (hyper's client: 100 by default).
        all.push(made("130 fields", fields(130), Expect::Refused));
        all.push(made("a head of 60 KiB", big(60), Expect::Same));
        // Larger than the proxy takes (nginx: 4 or 8 KiB, its buffer).
        all.push(made("a head of 70 KiB", big(70), Expect::HeadTooLarge));
        all
    });
    &ALL
}

#[tokio::test]
async fn upstream_answers_reach_the_client_as_hyper_reads_them() {
    let addr = upstream().await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: up, endpoints: ["http://{addr}"], retries: 0 }}]
routes: [{{ name: all, match: {{ path_prefix: / }}, upstream: up, timeout: 5s }}]
"#
    ))
    .await;
    let mut report = String::new();
    for (n, case) in cases().iter().enumerate() {
        let by_hyper = send(addr, n, false).await;
        let through_proxy = send(proxy.addr, n, true).await;
        let agrees = match case.expect {
            Expect::Same => through_proxy == by_hyper,
            Expect::Refused | Expect::HeadTooLarge => {
                assert!(
                    matches!(by_hyper, Seen::Answer { whole: true, .. }),
                    "{n} {}: hyper read {by_hyper:?}",
                    case.name
                );
                through_proxy == Seen::Refused
            }
            Expect::BrokenFirst => {
                assert!(
                    matches!(by_hyper, Seen::Answer { whole: false, .. }),
                    "{n} {}: hyper read {by_hyper:?}",
                    case.name
                );
                through_proxy == Seen::Refused
            }
            Expect::CutShort => {
                assert!(
                    matches!(by_hyper, Seen::Answer { whole: false, .. }),
                    "{n} {}: hyper read {by_hyper:?}",
                    case.name
                );
                // Or the head and part of what hyper read, if the proxy
                // sent the head before it came to the break.
                match (&through_proxy, &by_hyper) {
                    (Seen::Nothing, _) => true,
                    (
                        Seen::Answer {
                            status,
                            headers,
                            body,
                            whole: false,
                        },
                        Seen::Answer {
                            status: s,
                            headers: h,
                            body: b,
                            ..
                        },
                    ) => status == s && headers == h && b.starts_with(body),
                    _ => false,
                }
            }
        };
        if !agrees {
            report.push_str(&format!(
                "\n{n} {}:\n  hyper: {by_hyper:?}\n  proxy: {through_proxy:?}\n",
                case.name
            ));
        }
        // An HTTP/2 client of the proxy gets what an HTTP/1.1 one gets.
        let over_h2 = send_h2c(proxy.addr, n).await;
        if !case.alike(&over_h2, &through_proxy) {
            report.push_str(&format!(
                "\n{n} {} over HTTP/2:\n  HTTP/1.1: {through_proxy:?}\n  HTTP/2:   {over_h2:?}\n",
                case.name
            ));
        }
        // A streamed request body has hyper's client read the answer in
        // the proxy: the same answer must come of it.
        if case.method == "GET" {
            let read_by_hyper = send_streamed(proxy.addr, n).await;
            if !case.alike(&read_by_hyper, &through_proxy) {
                report.push_str(&format!(
                    "\n{n} {} after a streamed body:\n  own reader: {through_proxy:?}\n  hyper's:    {read_by_hyper:?}\n",
                    case.name
                ));
            }
        }
    }
    assert!(report.is_empty(), "{report}");
}
