use super::*;
use crate::drain::Graceful;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

// Sockets of tests that never park.
impl Park for tokio::io::DuplexStream {
    fn take_to_park(&self) -> bool {
        false
    }

    fn unpark(&self) {}
}

impl<R, W> Park for tokio::io::Join<R, W> {
    fn take_to_park(&self) -> bool {
        false
    }

    fn unpark(&self) {}
}

async fn sniffed(sent: &[&[u8]]) -> (bool, Vec<u8>) {
    let (mut client, mut server) = tokio::io::duplex(1024);
    let sends = async {
        for part in sent {
            client.write_all(part).await.unwrap();
            // Each part arrives as its own read.
            tokio::task::yield_now().await;
        }
        client.shutdown().await.unwrap();
    };
    let mut sniffed = Sniffed::default();
    let (h2, ()) = tokio::join!(
        std::future::poll_fn(|cx| sniff(&mut server, &mut sniffed, cx)),
        sends
    );
    let mut rewound = Rewind {
        sniffed,
        io: server,
        failed: None,
    };
    let mut all = Vec::new();
    rewound.read_to_end(&mut all).await.unwrap();
    (h2.unwrap(), all)
}

#[tokio::test]
async fn an_http1_head_is_told_at_its_first_byte_and_read_again_whole() {
    let head: &[u8] = b"GET / HTTP/1.1\r\nhost: a\r\n\r\n";
    assert_eq!(sniffed(&[head]).await, (false, head.to_vec()));
    // `P` as HTTP/2's preface starts, then not.
    let (h2, all) = sniffed(&[b"PRI", b" /x HTTP/1.1\r\n\r\n"]).await;
    assert!(!h2);
    assert_eq!(all, b"PRI /x HTTP/1.1\r\n\r\n");
}

#[tokio::test]
async fn the_preface_in_pieces_is_http2_and_what_follows_is_kept() {
    let (h2, all) = sniffed(&[b"PRI * HT", b"TP/2.0\r\n\r\nSM\r\n\r\n\0\0\x12\x04"]).await;
    assert!(h2);
    assert_eq!(all, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\x12\x04");
}

#[tokio::test]
async fn a_peer_that_closes_early_is_handed_to_http1_with_what_it_sent() {
    assert_eq!(sniffed(&[]).await, (false, Vec::new()));
    assert_eq!(sniffed(&[b"PRI *"]).await, (false, b"PRI *".to_vec()));
}

#[tokio::test]
async fn a_shutdown_before_the_first_byte_ends_the_connection_quietly() {
    let (_client, server) = tokio::io::duplex(64);
    let service = hyper::service::service_fn(|_req: http::Request<Incoming>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
    });
    let mut conn = std::pin::pin!(Arc::new(Builder::new()).serve(server, service));
    let polled = std::future::poll_fn(|cx| Poll::Ready(conn.as_mut().poll(cx))).await;
    assert!(polled.is_pending(), "no byte yet: still sniffing");
    conn.as_mut().graceful_shutdown();
    assert!(conn.await.is_ok());
}

/// A socket's read half that records the most free space a reader
/// offered it.
struct Offered<I> {
    io: I,
    most: Arc<std::sync::atomic::AtomicUsize>,
}

impl<I: AsyncRead + Unpin> AsyncRead for Offered<I> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let offered = buf.remaining();
        self.most
            .fetch_max(offered, std::sync::atomic::Ordering::Relaxed);
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

#[tokio::test]
async fn a_head_sent_whole_is_read_whole_and_hypers_buffer_keeps_its_first_size() {
    let (mut client, server) = tokio::io::duplex(64 * 1024);
    let most = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (read, write) = tokio::io::split(server);
    let read = Offered {
        io: read,
        most: most.clone(),
    };
    let io = tokio::io::join(read, write);
    let service = hyper::service::service_fn(|_req: http::Request<Incoming>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(String::from("ok")))
    });
    let served = tokio::spawn(Arc::new(Builder::new()).serve(io, service));
    for path in ["/first/request/on/the/connection", "/second"] {
        let head = format!("GET {path} HTTP/1.1\r\nhost: a\r\n\r\n");
        client.write_all(head.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        while !answer.ends_with(b"ok") {
            let mut chunk = [0; 256];
            let n = client.read(&mut chunk).await.unwrap();
            assert!(n > 0, "closed after {answer:?}");
            answer.extend_from_slice(&chunk[..n]);
        }
        assert!(answer.starts_with(b"HTTP/1.1 200"), "{answer:?}");
    }
    // Had the first read brought the sniffed bytes alone, hyper would
    // have grown its buffer to read the rest, and kept it.
    let most = most.load(std::sync::atomic::Ordering::Relaxed);
    assert!(most <= 8192, "hyper offered {most} bytes");
    drop(client);
    assert!(served.await.unwrap().is_ok());
}

/// Yields its parts one read at a time, then fails once, then ends:
/// an error dropped would be seen as an end.
struct ThenFails(Vec<&'static [u8]>, bool);

impl AsyncRead for ThenFails {
    fn poll_read(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if self.0.is_empty() {
            if std::mem::replace(&mut self.1, true) {
                return Poll::Ready(Ok(()));
            }
            return Poll::Ready(Err(std::io::ErrorKind::ConnectionReset.into()));
        }
        buf.put_slice(self.0.remove(0));
        Poll::Ready(Ok(()))
    }
}

#[tokio::test]
async fn an_error_met_reading_past_the_sniffed_bytes_comes_with_the_next_read() {
    let mut io = ThenFails(vec![b"GET "], false);
    let mut sniffed = Sniffed::default();
    let h2 = std::future::poll_fn(|cx| sniff(&mut io, &mut sniffed, cx)).await;
    assert!(!h2.unwrap());
    let mut rewound = Rewind {
        sniffed,
        io,
        failed: None,
    };
    let mut buf = [0; 64];
    assert_eq!(rewound.read(&mut buf).await.unwrap(), 4);
    assert_eq!(&buf[..4], b"GET ");
    let e = rewound.read(&mut buf).await.unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset);
    assert_eq!(rewound.read(&mut buf).await.unwrap(), 0);
}
