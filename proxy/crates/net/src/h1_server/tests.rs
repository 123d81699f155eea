use super::*;

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Context;

use http_body::Frame;
use http_body_util::BodyExt;
use http_body_util::combinators::BoxBody;
use tokio::net::{TcpListener, TcpStream};

/// Answers by path: `/known` a body of known length, `/chunked` one of
/// unknown length in two pieces and a trailer, `/never` never (noting
/// when its request is dropped); anything else echoes the request.
struct Answers {
    dropped: Arc<AtomicBool>,
}

struct NoteDrop(Arc<AtomicBool>);

impl Drop for NoteDrop {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// Two pieces and a trailer, its length unknown.
struct Pieces(Vec<Frame<Bytes>>);

impl Body for Pieces {
    type Data = Bytes;
    type Error = Infallible;
    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready((!self.0.is_empty()).then(|| Ok(self.0.remove(0))))
    }
}

impl Respond for Answers {
    type Body = BoxBody<Bytes, Infallible>;

    async fn respond(&self, req: Request<()>) -> Response<Self::Body> {
        let full = |s: String| http_body_util::Full::new(Bytes::from(s)).boxed();
        match req.uri().path() {
            "/known" => Response::new(full("hello".into())),
            "/chunked" => {
                let mut trailers = http::HeaderMap::new();
                trailers.insert("x-sum", "4".parse().unwrap());
                let frames = vec![
                    Frame::data(Bytes::from_static(b"ab")),
                    Frame::data(Bytes::from_static(b"cd")),
                    Frame::trailers(trailers),
                ];
                Response::new(Pieces(frames).boxed())
            }
            "/never" => {
                let _noted = NoteDrop(self.dropped.clone());
                std::future::pending::<()>().await;
                unreachable!()
            }
            path => {
                let a = req
                    .headers()
                    .get("x-a")
                    .map(|v| v.to_str().unwrap().to_owned());
                Response::new(full(format!(
                    "{} {path} {:?} {a:?}",
                    req.method(),
                    req.version()
                )))
            }
        }
    }
}

const LIMITS: Limits = Limits {
    head: Duration::from_secs(10),
    idle: Duration::from_secs(10),
};

/// A served connection: the client's end, and how the server's ended.
async fn connection(
    limits: Limits,
    stop: CancellationToken,
) -> (
    TcpStream,
    tokio::task::JoinHandle<std::io::Result<Ended<TcpStream>>>,
    Arc<AtomicBool>,
) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let client = TcpStream::connect(listener.local_addr().unwrap())
        .await
        .unwrap();
    let (socket, _) = listener.accept().await.unwrap();
    let dropped = Arc::new(AtomicBool::new(false));
    let answers = Answers {
        dropped: dropped.clone(),
    };
    let served =
        tokio::spawn(async move { serve(socket, BytesMut::new(), &answers, limits, &stop).await });
    (client, served, dropped)
}

/// Reads one answer (length-framed or chunked): its head and body.
async fn answer(client: &mut TcpStream, pending: &mut Vec<u8>) -> (String, Vec<u8>) {
    answer_to(client, pending, false).await
}

/// [`answer`], to a HEAD request (`head`: no body follows).
async fn answer_to(
    client: &mut TcpStream,
    pending: &mut Vec<u8>,
    head_only: bool,
) -> (String, Vec<u8>) {
    let mut buf = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
            break i + 4;
        }
        let n = client.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "closed before a whole head: {:?}",
            String::from_utf8_lossy(pending)
        );
        pending.extend_from_slice(&buf[..n]);
    };
    let head = String::from_utf8(pending[..head_end].to_vec()).unwrap();
    pending.drain(..head_end);
    let lower = head.to_ascii_lowercase();
    let body_end = |pending: &[u8]| -> Option<usize> {
        if head_only {
            return Some(0);
        }
        if let Some(len) = lower
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
        {
            let len: usize = len.trim().parse().unwrap();
            return (pending.len() >= len).then_some(len);
        }
        if lower.contains("transfer-encoding: chunked") {
            return pending
                .windows(4)
                .position(|w| w == b"\r\n\r\n")
                .map(|i| i + 4);
        }
        Some(0)
    };
    let end = loop {
        if let Some(end) = body_end(pending) {
            break end;
        }
        let n = client.read(&mut buf).await.unwrap();
        assert!(n > 0, "closed inside a body");
        pending.extend_from_slice(&buf[..n]);
    };
    let body = pending.drain(..end).collect();
    (head, body)
}

/// Whether the server closed the connection (nothing more to read).
async fn closed(client: &mut TcpStream) -> bool {
    let mut byte = [0u8; 1];
    matches!(client.read(&mut byte).await, Ok(0) | Err(_))
}

/// Requests on one connection are answered in turn, pipelined ones too,
/// with what the service saw of each.
#[tokio::test]
async fn keep_alive_and_pipelined_requests_are_answered_in_order() {
    let (mut client, served, _) = connection(LIMITS, CancellationToken::new()).await;
    let mut pending = Vec::new();
    client
        .write_all(b"GET /one HTTP/1.1\r\nhost: h\r\nx-a: 1\r\n\r\n")
        .await
        .unwrap();
    let (head, body) = answer(&mut client, &mut pending).await;
    assert!(head.starts_with("HTTP/1.1 200 OK\r\n"), "{head}");
    assert!(head.contains("\r\ndate: "), "{head}");
    assert_eq!(body, b"GET /one HTTP/1.1 Some(\"1\")");
    client
        .write_all(b"GET /two HTTP/1.1\r\nhost: h\r\n\r\nHEAD /known HTTP/1.1\r\nhost: h\r\n\r\nGET /known HTTP/1.1\r\nhost: h\r\n\r\n")
        .await
        .unwrap();
    let (_, body) = answer(&mut client, &mut pending).await;
    assert_eq!(body, b"GET /two HTTP/1.1 None");
    // HEAD: the length of the body it would have, and no body.
    let (head, _) = answer_to(&mut client, &mut pending, true).await;
    assert!(head.contains("content-length: 5\r\n"), "{head}");
    let (_, body) = answer(&mut client, &mut pending).await;
    assert_eq!(body, b"hello", "HEAD's answer left no body behind");
    drop(client);
    assert!(matches!(served.await.unwrap().unwrap(), Ended::Closed));
}

/// A body of unknown length goes chunked, with its trailers.
#[tokio::test]
async fn a_body_of_unknown_length_is_chunked_with_its_trailers() {
    let (mut client, _served, _) = connection(LIMITS, CancellationToken::new()).await;
    client
        .write_all(b"GET /chunked HTTP/1.1\r\nhost: h\r\n\r\n")
        .await
        .unwrap();
    let mut pending = Vec::new();
    let (head, body) = answer(&mut client, &mut pending).await;
    assert!(head.contains("transfer-encoding: chunked\r\n"), "{head}");
    assert_eq!(body, b"2\r\nab\r\n2\r\ncd\r\n0\r\nx-sum: 4\r\n\r\n");
}

/// `Connection: close`, and HTTP/1.0 without keep-alive, end the
/// connection after the answer; HTTP/1.0 with keep-alive does not.
#[tokio::test]
async fn the_client_decides_whether_its_connection_goes_on() {
    for (request, goes_on) in [
        (
            "GET /x HTTP/1.1\r\nhost: h\r\nconnection: close\r\n\r\n",
            false,
        ),
        ("GET /x HTTP/1.0\r\n\r\n", false),
        ("GET /x HTTP/1.0\r\nconnection: keep-alive\r\n\r\n", true),
    ] {
        let (mut client, served, _) = connection(LIMITS, CancellationToken::new()).await;
        client.write_all(request.as_bytes()).await.unwrap();
        let mut pending = Vec::new();
        let (head, _) = answer(&mut client, &mut pending).await;
        if goes_on {
            assert!(head.contains("connection: keep-alive\r\n"), "{head}");
            client.write_all(request.as_bytes()).await.unwrap();
            answer(&mut client, &mut pending).await;
            drop(client);
        } else {
            assert!(closed(&mut client).await, "{request:?} left open");
        }
        assert!(matches!(served.await.unwrap().unwrap(), Ended::Closed));
    }
}

/// A smuggling shape is answered 400 and closed, its status returned
/// for the log; a request with a body goes to the other server with
/// every byte read, its head first.
#[tokio::test]
async fn refused_heads_close_and_bodies_are_handed_over() {
    let (mut client, served, _) = connection(LIMITS, CancellationToken::new()).await;
    client
        .write_all(b"POST /x HTTP/1.1\r\nhost: h\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n")
        .await
        .unwrap();
    let mut pending = Vec::new();
    let (head, _) = answer(&mut client, &mut pending).await;
    assert!(head.starts_with("HTTP/1.1 400 Bad Request\r\n"), "{head}");
    assert!(closed(&mut client).await);
    match served.await.unwrap().unwrap() {
        Ended::Refused(r) => assert_eq!(r.status, StatusCode::BAD_REQUEST),
        other => panic!("{other:?}"),
    }

    let (mut client, served, _) = connection(LIMITS, CancellationToken::new()).await;
    let sent = b"GET /a HTTP/1.1\r\nhost: h\r\n\r\nPOST /b HTTP/1.1\r\nhost: h\r\ncontent-length: 3\r\n\r\nabc";
    client.write_all(sent).await.unwrap();
    answer(&mut client, &mut pending).await;
    match served.await.unwrap().unwrap() {
        Ended::Handover(_, read) => {
            let post = sent.windows(4).position(|w| w == b"POST").unwrap();
            assert_eq!(&read[..], &sent[post..]);
        }
        other => panic!("{other:?}"),
    }
}

/// A client that closes while its answer is being made has its request
/// dropped; an idle connection closes at its limit, and at once when
/// stopped.
#[tokio::test]
async fn a_client_gone_drops_its_request_and_idle_connections_end() {
    let (mut client, served, dropped) = connection(LIMITS, CancellationToken::new()).await;
    client
        .write_all(b"GET /never HTTP/1.1\r\nhost: h\r\n\r\n")
        .await
        .unwrap();
    client.shutdown().await.unwrap();
    assert!(matches!(served.await.unwrap().unwrap(), Ended::Closed));
    assert!(
        dropped.load(Ordering::SeqCst),
        "the request was not dropped"
    );

    let short = Limits {
        idle: Duration::from_millis(50),
        ..LIMITS
    };
    let (mut client, served, _) = connection(short, CancellationToken::new()).await;
    assert!(matches!(served.await.unwrap().unwrap(), Ended::Closed));
    assert!(closed(&mut client).await);

    let stop = CancellationToken::new();
    let (_client, served, _) = connection(LIMITS, stop.clone()).await;
    stop.cancel();
    assert!(matches!(served.await.unwrap().unwrap(), Ended::Closed));
}
