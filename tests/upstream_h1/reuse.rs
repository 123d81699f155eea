//! Framing and keep-alive with HTTP/1.1 upstreams: bodies by length,
//! chunks and close, connection reuse and its ends (idle, count,
//! lifetime), and bodiless answers.

use super::*;

#[tokio::test]
async fn chunked_bodies_with_extensions_and_trailers_arrive_whole_and_the_connection_is_reused() {
    let up = Scripted::start(|_, _| {
        keep(
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nx-up: 1\r\n\r\n\
             5;name=value\r\nhello\r\n7\r\n, world\r\n0\r\nx-trailer: t\r\n\r\n",
        )
    })
    .await;
    let proxy = Proxy::start_yaml(&up.yaml()).await;
    let mut c = client::Connection::open(proxy.addr).await;
    for _ in 0..3 {
        let a = get(&mut c, &proxy, "GET", "/c").await;
        assert_eq!(a.status, 200);
        assert_eq!(&a.body[..], b"hello, world");
        assert_eq!(a.header("x-up"), Some("1"));
    }
    assert_eq!(up.seen().len(), 3);
    assert_eq!(
        up.connections(),
        1,
        "each response ended cleanly, so one connection serves all"
    );
}

/// The upstream's hop-by-hop fields (named so, or listed by its
/// `Connection`) stop at the proxy; the rest reach the client, and the
/// connection, kept alive, serves the next request.
#[tokio::test]
async fn an_answers_hop_by_hop_fields_stop_at_the_proxy() {
    let up = Scripted::start(|_, _| {
        keep(
            "HTTP/1.1 200 OK\r\nConnection: keep-alive, x-hop\r\nx-hop: 1\r\nTE: trailers\r\n\
             Trailer: x-sum\r\nUpgrade: h2c\r\nProxy-Connection: keep-alive\r\n\
             Keep-Alive: timeout=5\r\nx-kept: 2\r\ncontent-length: 2\r\n\r\nok",
        )
    })
    .await;
    let proxy = Proxy::start_yaml(&up.yaml()).await;
    let mut c = client::Connection::open(proxy.addr).await;
    for _ in 0..2 {
        let a = get(&mut c, &proxy, "GET", "/h").await;
        assert_eq!(a.status, 200);
        assert_eq!(&a.body[..], b"ok");
        assert_eq!(a.header("x-kept"), Some("2"));
        for hop in [
            "x-hop",
            "te",
            "trailer",
            "upgrade",
            "proxy-connection",
            "keep-alive",
        ] {
            assert_eq!(a.header(hop), None, "{hop} reached the client");
        }
        assert_ne!(a.header("connection"), Some("keep-alive, x-hop"));
    }
    assert_eq!(up.connections(), 1, "the connection was kept");
}

#[tokio::test]
async fn content_length_bodies_keep_the_connection_and_the_request_head_is_as_sent() {
    let up = Scripted::start(|_, _| ok()).await;
    let proxy = Proxy::start_yaml(&up.yaml()).await;
    let mut c = client::Connection::open(proxy.addr).await;
    let a = get(&mut c, &proxy, "GET", "/a/b?q=1").await;
    assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"ok"[..]));
    let a = get(&mut c, &proxy, "POST", "/p").await;
    assert_eq!(a.status, 200);
    let seen = up.seen();
    assert_eq!(up.connections(), 1);
    let first = &seen[0].head;
    assert!(first.starts_with("GET /a/b?q=1 HTTP/1.1\r\n"), "{first}");
    assert!(first.contains(&format!("host: {}\r\n", up.addr)), "{first}");
    assert!(first.contains("x-forwarded-for: 127.0.0.1\r\n"), "{first}");
    // An empty POST says so: some servers answer 411 otherwise.
    assert!(seen[1].head.starts_with("POST /p HTTP/1.1\r\n"));
    assert!(
        seen[1].head.contains("content-length: 0\r\n"),
        "{}",
        seen[1].head
    );
}

#[tokio::test]
async fn a_connection_idle_longer_than_the_idle_timeout_is_not_reused() {
    let up = Scripted::start(|_, _| ok()).await;
    let yaml = up
        .yaml()
        .replace("retries: 0 }", "retries: 0, timeouts: { idle: 200ms } }");
    assert!(yaml.contains("idle: 200ms"), "{yaml}");
    let proxy = Proxy::start_yaml(&yaml).await;
    let mut c = client::Connection::open(proxy.addr).await;
    for _ in 0..2 {
        assert_eq!(get(&mut c, &proxy, "GET", "/a").await.status, 200);
    }
    assert_eq!(up.connections(), 1, "reused within the idle timeout");
    // Waiting out the idle timeout is the behaviour under test.
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(get(&mut c, &proxy, "GET", "/a").await.status, 200);
    assert_eq!(up.connections(), 2, "idle too long: a new connection");
}

#[tokio::test]
async fn a_connection_is_closed_after_its_max_requests() {
    let (up, proxy) = ok_upstream_with("max_requests_per_connection: 3").await;
    let mut c = client::Connection::open(proxy.addr).await;
    // Bodiless (exchanged in the request's task), then a body too large to
    // hold (hyper takes the connection over, and its count with it).
    assert_eq!(get(&mut c, &proxy, "GET", "/1").await.status, 200);
    let large = Bytes::from(vec![b'x'; 100 * 1024]);
    let req = Request::post(proxy.url("/2")).body(body(large)).unwrap();
    assert_eq!(c.send(req).await.status, 200);
    for path in ["/3", "/4", "/5", "/6", "/7"] {
        assert_eq!(get(&mut c, &proxy, "GET", path).await.status, 200);
    }
    let per_conn: Vec<usize> = (0..up.connections())
        .map(|n| up.seen().iter().filter(|s| s.conn == n).count())
        .collect();
    assert_eq!(per_conn, [3, 3, 1]);
}

#[tokio::test]
async fn a_busy_connection_is_replaced_at_the_end_of_its_lifetime() {
    let (up, proxy) = ok_upstream_with("timeouts: { lifetime: 300ms }").await;
    let mut c = client::Connection::open(proxy.addr).await;
    // Never idle for long (the idle timeout is 90 s): only its age ends
    // the first connection. Letting time pass is the behaviour under test.
    for _ in 0..8 {
        assert_eq!(get(&mut c, &proxy, "GET", "/a").await.status, 200);
        tokio::time::sleep(std::time::Duration::from_millis(60)).await;
    }
    let first = up.seen().iter().filter(|s| s.conn == 0).count();
    assert!(up.connections() >= 2, "one connection for 480 ms");
    assert!((2..8).contains(&first), "{first} requests on the first");
}

#[tokio::test]
async fn an_http2_connection_is_replaced_after_its_max_requests() {
    let up = crate::support::upstream::echo("h2").await;
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: up, endpoints: ["{}"], http2: true, max_requests_per_connection: 2 }}]
routes: [{{ name: all, match: {{ path_prefix: / }}, upstream: up }}]
"#,
        up.url()
    ))
    .await;
    let mut c = client::Connection::open(proxy.addr).await;
    let mut peers = Vec::new();
    for _ in 0..5 {
        let answer = get(&mut c, &proxy, "GET", "/a").await;
        assert_eq!(answer.json()["version"], "HTTP/2.0");
        peers.push(answer.json()["peer"].as_str().unwrap().to_owned());
    }
    assert_eq!(peers[0], peers[1]);
    assert_ne!(peers[1], peers[2]);
    assert_eq!(peers[2], peers[3]);
    assert_ne!(peers[3], peers[4]);
}

#[tokio::test]
async fn requests_with_and_without_bodies_share_the_pooled_connections() {
    let up = Scripted::start(|_, _| ok()).await;
    let proxy = Proxy::start_yaml(&up.yaml()).await;
    let mut c = client::Connection::open(proxy.addr).await;
    // Bodiless; a small body (sent whole by the request's task); a body
    // too large to hold (streamed by hyper, which takes the pooled
    // connection over); bodiless again on the connection hyper now drives.
    assert_eq!(get(&mut c, &proxy, "GET", "/1").await.status, 200);
    assert_eq!(
        send_body(&mut c, &proxy, "POST", b"payload").await.status,
        200
    );
    let large = Bytes::from(vec![b'x'; 100 * 1024]);
    let req = Request::post(proxy.url("/3")).body(body(large)).unwrap();
    assert_eq!(c.send(req).await.status, 200);
    assert_eq!(get(&mut c, &proxy, "GET", "/4").await.status, 200);
    let seen = up.seen();
    assert_eq!(seen.len(), 4);
    assert_eq!(seen[1].body, b"payload");
    assert_eq!(seen[2].body.len(), 100 * 1024);
    assert!(seen[3].head.starts_with("GET /4 "), "{}", seen[3].head);
    assert_eq!(up.connections(), 1);
}

#[tokio::test]
async fn a_body_until_close_is_passed_whole_and_the_connection_is_not_reused() {
    let up = Scripted::start(|_, _| {
        Reply::Close(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nall of it".to_vec())
    })
    .await;
    let proxy = Proxy::start_yaml(&up.yaml()).await;
    let mut c = client::Connection::open(proxy.addr).await;
    for _ in 0..2 {
        let a = get(&mut c, &proxy, "GET", "/").await;
        assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"all of it"[..]));
    }
    assert_eq!(up.connections(), 2);
}

#[tokio::test]
async fn connection_close_and_http_1_0_answers_are_not_reused() {
    let up = Scripted::start(|_, head| {
        if head.starts_with("GET /old ") {
            keep("HTTP/1.0 200 OK\r\ncontent-length: 1\r\n\r\nb")
        } else {
            keep("HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 1\r\n\r\na")
        }
    })
    .await;
    let proxy = Proxy::start_yaml(&up.yaml()).await;
    let mut c = client::Connection::open(proxy.addr).await;
    for (path, want) in [("/close", "a"), ("/old", "b"), ("/close", "a")] {
        assert_eq!(
            &get(&mut c, &proxy, "GET", path).await.body[..],
            want.as_bytes()
        );
    }
    // Each connection served exactly one request: the proxy never sent a
    // second one on a connection the upstream asked to close.
    assert_eq!(up.connections(), 3);
    assert_eq!(up.seen().len(), 3);
}

#[tokio::test]
async fn head_204_304_and_interim_answers_carry_no_body() {
    let up = Scripted::start(|_, head| {
        if head.starts_with("HEAD") {
            keep("HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\n")
        } else if head.starts_with("GET /204") {
            keep("HTTP/1.1 204 No Content\r\n\r\n")
        } else if head.starts_with("GET /304") {
            keep("HTTP/1.1 304 Not Modified\r\netag: \"x\"\r\n\r\n")
        } else {
            keep(
                "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </s.css>\r\n\r\n\
                 HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nfinal",
            )
        }
    })
    .await;
    let proxy = Proxy::start_yaml(&up.yaml()).await;
    let mut c = client::Connection::open(proxy.addr).await;
    let a = get(&mut c, &proxy, "HEAD", "/h").await;
    assert_eq!(a.status, 200);
    assert_eq!(a.header("content-length"), Some("1000"));
    assert!(a.body.is_empty());
    assert_eq!(get(&mut c, &proxy, "GET", "/204").await.status, 204);
    let a = get(&mut c, &proxy, "GET", "/304").await;
    assert_eq!((a.status.as_u16(), a.header("etag")), (304, Some("\"x\"")));
    let a = get(&mut c, &proxy, "GET", "/interim").await;
    assert_eq!((a.status.as_u16(), &a.body[..]), (200, &b"final"[..]));
    assert_eq!(
        up.connections(),
        1,
        "none of these answers ends the connection"
    );
}
