//! When an exchange with an HTTP/1.1 upstream goes wrong: stale pooled
//! connections, broken or cut answers, slow or large request bodies, and
//! a client that leaves mid-request.

use super::*;

#[tokio::test]
async fn a_reused_connection_dropped_by_the_upstream_is_retried_for_idempotent_methods_only() {
    // The upstream reads the second request on each connection and closes
    // without answering: what a keep-alive timeout racing a request looks
    // like from the proxy.
    let up = Scripted::start(|n, _| match n {
        0 => ok(),
        _ => Reply::Close(Vec::new()),
    })
    .await;
    let proxy = Proxy::start_yaml(&up.yaml()).await;
    let mut c = client::Connection::open(proxy.addr).await;
    assert_eq!(get(&mut c, &proxy, "GET", "/").await.status, 200);
    // The GET finds its pooled connection dead after sending; it goes again
    // on a new connection and succeeds.
    let a = get(&mut c, &proxy, "GET", "/").await;
    assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"ok"[..]));
    assert_eq!(up.connections(), 2);
    // So does a PUT with a small body (held whole), body and all.
    let a = send_body(&mut c, &proxy, "PUT", b"{\"v\":1}").await;
    assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"ok"[..]));
    let puts: Vec<Seen> = up
        .seen()
        .into_iter()
        .filter(|s| s.head.starts_with("PUT"))
        .collect();
    assert_eq!(puts.len(), 2);
    for put in &puts {
        assert_eq!(put.body, b"{\"v\":1}");
        assert!(put.head.contains("content-length: 7\r\n"), "{}", put.head);
    }
    // A POST is not sent twice: the upstream may have acted on it.
    let a = send_body(&mut c, &proxy, "POST", b"once").await;
    assert_eq!(a.status, 502);
    assert_eq!(a.json()["error"], "upstream connection failed");
    let posts = up
        .seen()
        .iter()
        .filter(|s| s.head.starts_with("POST"))
        .count();
    assert_eq!(posts, 1);
}

#[tokio::test]
async fn broken_answers_are_502_and_the_proxy_keeps_serving() {
    let big = format!(
        "HTTP/1.1 200 OK\r\nx-big: {}\r\n\r\n",
        "a".repeat(70 * 1024)
    );
    let up = Scripted::start(move |_, head| {
        let path = head.split(' ').nth(1).unwrap_or("");
        match path {
            "/garbage" => Reply::Close(b"SSH-2.0-OpenSSH\r\n\r\n".to_vec()),
            "/bad-length" => {
                Reply::Close(b"HTTP/1.1 200 OK\r\ncontent-length: 1, 2\r\n\r\nx".to_vec())
            }
            "/huge-head" => Reply::Close(big.clone().into_bytes()),
            "/switch" => Reply::Close(b"HTTP/1.1 101 Switching Protocols\r\n\r\n".to_vec()),
            // Broken in what comes with the head: nothing has gone to
            // the client yet.
            "/bad-chunk" => Reply::Close(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n".to_vec(),
            ),
            "/bad-second-chunk" => Reply::Close(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n-1\r\n".to_vec(),
            ),
            "/long-chunk" => Reply::Close(
                b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nokay\r\n".to_vec(),
            ),
            _ => ok(),
        }
    })
    .await;
    let mut proxy = crate::support::process::ProxyProcess::start(&up.yaml(), &[]).await;
    for path in [
        "/garbage",
        "/bad-length",
        "/huge-head",
        "/switch",
        "/bad-chunk",
        "/bad-second-chunk",
        "/long-chunk",
    ] {
        let a = client::get(&proxy.url(path)).await;
        assert_eq!(a.status, 502, "{path}");
        assert_eq!(a.json()["error"], "upstream connection failed", "{path}");
        assert_eq!(client::get(&proxy.url("/fine")).await.status, 200);
    }
    let why = proxy.wait_for_log("invalid chunk size `-1`").await;
    assert!(why.contains("upstream response body"), "{why}");
}

#[tokio::test]
async fn a_body_cut_short_by_the_upstream_is_cut_short_for_the_client() {
    let up = Scripted::start(|_, _| {
        Reply::Close(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf".to_vec())
    })
    .await;
    let proxy = Proxy::start_yaml(&up.yaml()).await;
    assert_cut_short(&proxy, "/").await;
}

#[tokio::test]
async fn a_body_the_upstream_breaks_is_logged_with_why() {
    // The first chunk passes and reaches the client; then the second's
    // size is not hex. The answer has begun, so it can only be cut short.
    let go = Arc::new(tokio::sync::Notify::new());
    let upstream_go = go.clone();
    let up = Scripted::start(move |_, _| {
        Reply::Then(
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n".to_vec(),
            upstream_go.clone(),
            b"zz\r\nmore\r\n".to_vec(),
        )
    })
    .await;
    let mut proxy = crate::support::process::ProxyProcess::start(&up.yaml(), &[]).await;
    let mut conn = TcpStream::connect(proxy.addr).await.unwrap();
    conn.write_all(b"GET /broken HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("hello") {
        let mut chunk = [0u8; 1024];
        let n = conn.read(&mut chunk).await.unwrap();
        assert!(n > 0, "closed before the first chunk: {got:?}");
        got.extend_from_slice(&chunk[..n]);
    }
    assert!(got.starts_with(b"HTTP/1.1 200 OK\r\n"), "{got:?}");
    go.notify_one();
    let read_rest = conn.read_to_end(&mut got);
    tokio::time::timeout(std::time::Duration::from_secs(10), read_rest)
        .await
        .expect("the proxy did not close the connection")
        .unwrap();
    let got = String::from_utf8_lossy(&got);
    // Not a whole answer: the chunked body lacks its last chunk.
    assert!(!got.ends_with("0\r\n\r\n"), "{got}");
    let why = proxy
        .wait_for_log("response cut: the upstream's body broke")
        .await;
    assert!(why.contains("invalid chunk size `zz`"), "{why}");
    assert!(
        why.contains("upstream") && why.contains(&up.addr.to_string()),
        "{why}"
    );
    let access = proxy.wait_for_log(r#"/broken"#).await;
    assert!(access.contains("aborted"), "{access}");
}

#[tokio::test]
async fn a_large_body_streams_and_arrives_whole() {
    let up = Scripted::start(|_, _| ok()).await;
    let proxy = Proxy::start_yaml(&up.yaml()).await;
    let payload: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
    let req = Request::post(proxy.url("/big"))
        .body(body(Bytes::from(payload.clone())))
        .unwrap();
    assert_eq!(client::send(&client::http1(), req).await.status, 200);
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert!(
        seen[0].head.contains("content-length: 200000\r\n"),
        "{}",
        seen[0].head
    );
    assert!(seen[0].body == payload, "the upstream got other bytes");
}

#[tokio::test]
async fn a_client_too_slow_with_its_body_gets_408_and_nothing_reaches_the_upstream() {
    let up = Scripted::start(|_, _| ok()).await;
    let proxy = Proxy::start_yaml(&up.yaml_with_timeout("300ms")).await;
    let mut sock = TcpStream::connect(proxy.addr).await.unwrap();
    sock.write_all(b"POST /slow HTTP/1.1\r\nhost: x\r\ncontent-length: 10\r\n\r\nabc")
        .await
        .unwrap();
    let text = read_until(&mut sock, b"\r\n\r\n").await;
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(up.seen().is_empty(), "a partial body must not be forwarded");
    assert_eq!(client::get(&proxy.url("/fine")).await.status, 200);
}

#[tokio::test]
async fn a_client_expecting_100_continue_is_told_to_send_and_its_body_arrives() {
    let up = Scripted::start(|_, _| ok()).await;
    let proxy = Proxy::start_yaml(&up.yaml()).await;
    let mut sock = TcpStream::connect(proxy.addr).await.unwrap();
    sock.write_all(
        b"POST /e HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 5\r\n\r\n",
    )
    .await
    .unwrap();
    // The client sends nothing more until told to; a proxy waiting for the
    // body without saying so would hang here.
    let interim = read_until(&mut sock, b"\r\n\r\n").await;
    assert!(interim.starts_with("HTTP/1.1 100 Continue"), "{interim}");
    sock.write_all(b"hello").await.unwrap();
    let answer = read_until(&mut sock, b"\r\n\r\nok").await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].body, b"hello");
}

#[tokio::test]
async fn a_client_that_leaves_mid_request_cancels_the_upstream_exchange() {
    let mut upstream = crate::support::upstream::never_answering().await;
    let proxy = proxy_to(upstream.addr).await;
    let mut client = TcpStream::connect(proxy.addr).await.unwrap();
    client
        .write_all(b"GET /slow HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    upstream.request_arrived().await;
    // The client goes away while the upstream works (as a browser tab
    // closed on a slow page): the proxy drops the exchange and its
    // upstream connection at once, as nginx and Envoy do, rather than
    // holding them until the 60 s route timeout.
    drop(client);
    upstream.closed_soon().await;
}

#[tokio::test]
async fn a_client_that_leaves_a_quiet_stream_ends_it_upstream() {
    // An event stream that sends one event, then nothing, and reports when
    // the proxy closes the connection.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (closed, closed_rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await.unwrap();
        if !read_head(&mut sock).await {
            return;
        }
        let event = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\
            transfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n";
        if sock.write_all(event).await.is_err() {
            return;
        }
        until_closed(&mut sock).await;
        let _ = closed.send(());
    });
    let proxy = proxy_to(addr).await;
    let mut client = TcpStream::connect(proxy.addr).await.unwrap();
    client
        .write_all(b"GET /events HTTP/1.1\r\nhost: a\r\n\r\n")
        .await
        .unwrap();
    let seen = read_until(&mut client, b"data: 1").await;
    assert!(seen.starts_with("HTTP/1.1 200"), "{seen}");
    // The client leaves while the stream is quiet: the proxy ends the
    // upstream stream too, without waiting for an event to fail on.
    drop(client);
    tokio::time::timeout(std::time::Duration::from_secs(5), closed_rx)
        .await
        .expect("the upstream stream was still open 5 s after the client left")
        .expect("upstream task");
}
