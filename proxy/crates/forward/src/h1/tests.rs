use super::*;
use crate::pool::Slot;
use http_body::Body as _;
use tokio::io::AsyncReadExt;

/// A loopback pair: the proxy's end wrapped as an upstream connection,
/// and the upstream's end to write scripted bytes into.
async fn pair() -> (Box<H1Conn>, TcpStream) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let ours = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
    let (theirs, _) = l.accept().await.unwrap();
    (H1Conn::new(Io::Tcp(ours)), theirs)
}

/// `GET /` on `conn`, no fields, no body: the answer's head, framing and
/// whether the connection goes on.
async fn get(conn: &mut H1Conn) -> (Response<()>, Framing, bool) {
    conn.exchange(
        &Method::GET,
        "",
        "/",
        None,
        (&HeaderMap::new(), &Default::default()),
        None,
        None,
    )
    .await
    .unwrap()
}

async fn next_data(body: &mut H1Body) -> Bytes {
    let frame = std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await;
    frame
        .expect("a frame")
        .expect("no error")
        .into_data()
        .expect("data")
}

#[tokio::test]
async fn chunked_body_split_anywhere_ends_exactly_and_goes_home() {
    let (conn, mut up) = pair().await;
    let slot = Arc::new(Slot::default());
    let mut body = H1Body::new(conn, Framing::Chunked, Some(slot.clone()));
    // Each write is read before the next is sent, so the decoder sees
    // the framing cut in the middle of a size line, of data, of a CRLF
    // and of the trailers.
    up.write_all(b"5;ext").await.unwrap();
    up.write_all(b"=1\r\nhel").await.unwrap();
    assert_eq!(next_data(&mut body).await, "hel");
    up.write_all(b"lo\r").await.unwrap();
    assert_eq!(next_data(&mut body).await, "lo");
    up.write_all(b"\n3\r\n!!!\r\n0\r\nx-t: 1\r").await.unwrap();
    assert_eq!(next_data(&mut body).await, "!!!");
    assert!(!body.is_end_stream(), "the trailers have not ended yet");
    assert_eq!(slot.idle_count(), 0);
    up.write_all(b"\n\r\n").await.unwrap();
    let end = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await;
    assert!(end.is_none());
    assert!(body.is_end_stream());
    assert_eq!(
        slot.idle_count(),
        1,
        "a cleanly ended body returns its connection"
    );
}

#[tokio::test]
async fn length_body_ends_with_its_last_byte_and_a_dropped_body_closes() {
    let (conn, mut up) = pair().await;
    let slot = Arc::new(Slot::default());
    let mut body = H1Body::new(conn, Framing::Length(6), Some(slot.clone()));
    assert_eq!(body.size_hint().exact(), Some(6));
    up.write_all(b"abc").await.unwrap();
    assert_eq!(next_data(&mut body).await, "abc");
    up.write_all(b"def").await.unwrap();
    assert_eq!(next_data(&mut body).await, "def");
    // Ended with the last data frame, before the client asks again.
    assert!(body.is_end_stream());
    assert_eq!(slot.idle_count(), 1);

    let (conn, mut up) = pair().await;
    let body = H1Body::new(conn, Framing::Length(6), Some(slot.clone()));
    drop(body);
    // The upstream sees the connection closed, not parked.
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(std::time::Duration::from_secs(5), up.read_to_end(&mut rest));
    assert!(
        closed.await.is_ok(),
        "the dropped body's connection stayed open"
    );
    assert_eq!(slot.idle_count(), 1);
}

/// A body all read with its head is taken whole, as a poll would take
/// it (its connection home, or closed with bytes after it); any other is
/// left as it was, nothing taken.
#[tokio::test]
async fn a_body_is_taken_whole_only_when_all_of_it_is_read() {
    let slot = Arc::new(Slot::default());
    let (mut conn, _up) = pair().await;
    conn.buf.extend_from_slice(b"hel");
    let mut body = H1Body::new(conn, Framing::Length(5), Some(slot.clone()));
    assert_eq!(body.take_whole(), None, "two bytes are still to come");
    assert_eq!(next_data(&mut body).await, "hel", "nothing was taken");

    let (mut conn, _up) = pair().await;
    conn.buf.extend_from_slice(b"abc");
    let mut body = H1Body::new(conn, Framing::Length(3), Some(slot.clone()));
    assert_eq!(body.take_whole().as_deref(), Some(&b"abc"[..]));
    assert!(body.is_end_stream());
    assert_eq!(slot.idle_count(), 1, "the connection went home");

    // Bytes after the body: taken the same, the connection not reused.
    let (mut conn, _up) = pair().await;
    conn.buf.extend_from_slice(b"abcX");
    let mut body = H1Body::new(conn, Framing::Length(3), Some(slot.clone()));
    assert_eq!(body.take_whole().as_deref(), Some(&b"abc"[..]));
    assert!(body.is_end_stream());
    assert_eq!(slot.idle_count(), 1);

    let (mut conn, _up) = pair().await;
    conn.buf.extend_from_slice(b"3\r\nabc\r\n0\r\n\r\n");
    let mut body = H1Body::new(conn, Framing::Chunked, Some(slot.clone()));
    assert_eq!(
        body.take_whole(),
        None,
        "a chunked body is read as it streams"
    );
    assert_eq!(next_data(&mut body).await, "abc");
}

#[tokio::test]
async fn a_recycled_request_map_holds_only_the_response_headers() {
    let (mut conn, mut up) = pair().await;
    let mut request = HeaderMap::with_capacity(16);
    request.insert(header::AUTHORIZATION, HeaderValue::from_static("secret"));
    request.insert("x-request-only", HeaderValue::from_static("1"));
    let reused = request.capacity();
    conn.recycle(&mut request);
    assert!(
        request.is_empty(),
        "the spare left was not handed back empty"
    );
    up.write_all(b"HTTP/1.1 200 OK\r\nserver: up\r\ncontent-length: 0\r\n\r\n")
        .await
        .unwrap();
    let (resp, ..) = get(&mut conn).await;
    let names: Vec<&str> = resp.headers().keys().map(|k| k.as_str()).collect();
    assert_eq!(names, ["server", "content-length"]);
    assert_eq!(resp.headers().capacity(), reused, "the map was not reused");

    // A map grown past the bound is not kept.
    let mut big = HeaderMap::with_capacity(4 * SPARE_HEADERS);
    big.insert("x-big", HeaderValue::from_static("1"));
    conn.recycle(&mut big);
    assert!(conn.spare.capacity() < 4 * SPARE_HEADERS);
    assert_eq!(big.len(), 1, "a map not kept stays the caller's");
}

/// The answer leaves the reader without this hop's fields: those named
/// hop-by-hop, and those `Connection` lists, the rest in their order.
#[tokio::test]
async fn an_answer_leaves_without_its_hop_by_hop_fields() {
    let (mut conn, mut up) = pair().await;
    up.write_all(
        b"HTTP/1.1 200 OK\r\nserver: up\r\nConnection: keep-alive, x-hop\r\nx-hop: 1\r\n\
          TE: trailers\r\nTrailer: x-sum\r\nUpgrade: h2c\r\nProxy-Connection: keep-alive\r\n\
          Proxy-Authorization: Basic eA==\r\nx-kept: 2\r\nTransfer-Encoding: chunked\r\n\r\n",
    )
    .await
    .unwrap();
    let (resp, framing, _) = get(&mut conn).await;
    assert_eq!(framing, Framing::Chunked, "framed before the fields went");
    let names: Vec<&str> = resp.headers().keys().map(|k| k.as_str()).collect();
    assert_eq!(names, ["server", "x-kept"]);

    // A head with none keeps every field (and is spared the pass).
    let (mut conn, mut up) = pair().await;
    up.write_all(b"HTTP/1.1 200 OK\r\nserver: up\r\nx-te: 1\r\ncontent-length: 0\r\n\r\n")
        .await
        .unwrap();
    let (resp, ..) = get(&mut conn).await;
    let names: Vec<&str> = resp.headers().keys().map(|k| k.as_str()).collect();
    assert_eq!(names, ["server", "x-te", "content-length"]);
}

#[tokio::test]
async fn a_parked_connection_keeps_small_buffers() {
    let (conn, mut up) = pair().await;
    let slot = Arc::new(Slot::default());
    let mut body = H1Body::new(conn, Framing::Length(300_000), Some(slot.clone()));
    let sent = vec![7u8; 300_000];
    let writer = tokio::spawn(async move {
        up.write_all(&sent).await.unwrap();
        up
    });
    let mut got = 0;
    while got < 300_000 {
        got += next_data(&mut body).await.len();
    }
    let _up = writer.await.unwrap();
    assert_eq!(slot.idle_count(), 1);
    let parked = slot.take_bare().expect("the parked connection");
    assert!(
        parked.buf.capacity() <= 2 * FIRST_READ,
        "{}",
        parked.buf.capacity()
    );
    assert_eq!(parked.read_size, FIRST_READ);
}

#[test]
fn chunked_framing_is_checked_as_far_as_it_has_come() {
    for whole_so_far in [
        &b""[..],
        b"5",
        b"5\r\nhel",
        b"5\r\nhello",
        b"5\r\nhello\r",
        b"5\r\nhello\r\n3;x=y\r\nabc\r\n0\r\n",
        b"5\r\nhello\r\n0\r\nnot: checked here\r\n",
    ] {
        assert_eq!(sound_chunks(whole_so_far), Ok(()), "{whole_so_far:?}");
    }
    let broken = |b: &[u8]| sound_chunks(b).unwrap_err();
    assert!(broken(b"5\r\nhello\r\nzz\r\nmore").contains("invalid chunk size `zz`"));
    assert!(broken(b"5\r\nhello!\r\n").contains("longer than its size"));
    assert!(broken(b"5\nhello").contains("bare LF"));
    assert!(broken(&[b'1'; MAX_LINE + 1]).contains("too long"));
}

#[test]
fn chunk_sizes() {
    assert_eq!(chunk_size(b"1a3f").unwrap(), 0x1a3f);
    assert_eq!(chunk_size(b"0").unwrap(), 0);
    assert_eq!(chunk_size(b"10;name=value").unwrap(), 16);
    assert_eq!(chunk_size(b"A ").unwrap(), 10);
    assert!(chunk_size(b"").is_err());
    assert!(chunk_size(b"xyz").is_err());
    assert!(chunk_size(b"-1").is_err());
    assert!(chunk_size(b"1000000000000000").is_err());
}

#[test]
fn head_is_encoded_with_host_first_and_zero_length_for_post() {
    let mut headers = HeaderMap::new();
    headers.insert("x-a", HeaderValue::from_static("1"));
    let mut out = Vec::new();
    let host = HeaderValue::from_static("up:80");
    encode_head(
        &mut out,
        &Method::POST,
        "/base",
        "/p?q=1",
        Some(&host),
        (&headers, &Default::default()),
        None,
    );
    assert_eq!(
        out,
        b"POST /base/p?q=1 HTTP/1.1\r\nhost: up:80\r\nx-a: 1\r\ncontent-length: 0\r\n\r\n"
    );
    // The forwarding fields not in the map follow its fields.
    let mut none = HeaderMap::new();
    let seen = crate::remove_hop_by_hop(&mut none, false);
    let client = crate::client_ip_header("10.0.0.1".parse().unwrap());
    let later = crate::forwarded(&mut none, (&client, None, seen), "http", None, false);
    encode_head(
        &mut out,
        &Method::GET,
        "",
        "/",
        None,
        (&headers, &later),
        None,
    );
    assert_eq!(
        out,
        b"GET / HTTP/1.1\r\nx-a: 1\r\nx-forwarded-for: 10.0.0.1\r\nx-forwarded-proto: http\r\n\r\n"
    );
    let no_fields = (&headers, &Default::default());
    encode_head(&mut out, &Method::GET, "", "/", None, no_fields, None);
    assert_eq!(out, b"GET / HTTP/1.1\r\nx-a: 1\r\n\r\n");
    // The length comes from the bytes sent, whatever the client said.
    headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("99"));
    let fields = (&headers, &Default::default());
    encode_head(&mut out, &Method::PUT, "", "/", None, fields, Some(b"{}"));
    assert_eq!(
        out,
        b"PUT / HTTP/1.1\r\nx-a: 1\r\ncontent-length: 2\r\n\r\n{}"
    );
}

fn parsed(raw: &str, method: &Method) -> Result<(Response<()>, Framing), ExchangeError> {
    parsed_seen(raw, method).map(|(resp, f, _)| (resp, f))
}

fn parsed_seen(
    raw: &str,
    method: &Method,
) -> Result<(Response<()>, Framing, HeadFields), ExchangeError> {
    let mut buf = BytesMut::from(raw.as_bytes());
    let (mut resp, seen) = take_head(&mut buf, &mut HeaderMap::new(), &mut FieldNames::default())?
        .expect("complete head");
    let f = framing(method, &mut resp, seen)?;
    Ok((resp, f, seen))
}

#[test]
fn header_values_are_taken_only_as_http_allows_them() {
    let head = |value: &[u8]| {
        let mut raw = b"HTTP/1.1 200 OK\r\nx-v: ".to_vec();
        raw.extend_from_slice(value);
        raw.extend_from_slice(b"\r\ncontent-length: 0\r\n\r\n");
        take_head(
            &mut BytesMut::from(&raw[..]),
            &mut HeaderMap::new(),
            &mut FieldNames::default(),
        )
    };
    // Control bytes and DEL never become a header value.
    for bad in [&b"a\x01b"[..], b"a\x7fb", b"a\x00b", b"a\rb"] {
        assert!(head(bad).is_err(), "{bad:?} was taken");
    }
    // Tabs, spaces and obs-text pass through byte for byte.
    let (resp, _) = head(b"a\tb c\xe9").unwrap().expect("complete head");
    let value = &resp.headers()["x-v"];
    assert_eq!(value.as_bytes(), b"a\tb c\xe9");
    assert_eq!(value, &HeaderValue::from_bytes(b"a\tb c\xe9").unwrap());
}

#[test]
fn framing_follows_rfc_9112() {
    let get = Method::GET;
    let f = |raw: &str| {
        parsed(raw, &get)
            .map(|(_, f)| f)
            .map_err(|e| format!("{e:?}"))
    };
    assert_eq!(
        f("HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n"),
        Ok(Framing::Length(5))
    );
    assert_eq!(
        f("HTTP/1.1 200 OK\r\ncontent-length: 5, 5\r\n\r\n"),
        Ok(Framing::Length(5))
    );
    assert!(f("HTTP/1.1 200 OK\r\ncontent-length: 5, 6\r\n\r\n").is_err());
    assert!(f("HTTP/1.1 200 OK\r\ncontent-length: +5\r\n\r\n").is_err());
    // Repeated fields must agree; a length past u64 is refused.
    assert!(f("HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n").is_err());
    assert_eq!(
        f("HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 5\r\n\r\n"),
        Ok(Framing::Length(5))
    );
    assert!(f("HTTP/1.1 200 OK\r\ncontent-length: 99999999999999999999\r\n\r\n").is_err());
    assert_eq!(
        f("HTTP/1.1 200 OK\r\ncontent-length: 9999999999999999999\r\n\r\n"),
        Ok(Framing::Length(9_999_999_999_999_999_999))
    );
    assert_eq!(
        f("HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"),
        Ok(Framing::Chunked)
    );
    assert_eq!(
        f("HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n"),
        Ok(Framing::UntilClose)
    );
    assert_eq!(f("HTTP/1.1 200 OK\r\n\r\n"), Ok(Framing::UntilClose));
    assert_eq!(
        f("HTTP/1.1 204 No Content\r\ncontent-length: 9\r\n\r\n"),
        Ok(Framing::Length(0))
    );
    assert_eq!(
        f("HTTP/1.1 304 Not Modified\r\n\r\n"),
        Ok(Framing::Length(0))
    );
    let (_, head) = parsed(
        "HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n",
        &Method::HEAD,
    )
    .unwrap();
    assert_eq!(head, Framing::Length(0));
    // Transfer-Encoding wins over Content-Length, which must not reach the client.
    let (resp, fr) = parsed(
        "HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n",
        &get,
    )
    .unwrap();
    assert_eq!(fr, Framing::Chunked);
    assert!(!resp.headers().contains_key(header::CONTENT_LENGTH));
    // The same in answers without a body (found by the
    // upstream_response fuzz target); a HEAD answer's own length stays.
    let both = "HTTP/1.1 200 OK\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n";
    let (resp, fr) = parsed(both, &Method::HEAD).unwrap();
    assert_eq!(fr, Framing::Length(0));
    assert!(!resp.headers().contains_key(header::CONTENT_LENGTH));
    let (resp, _) = parsed(&both.replace("200 OK", "304 Not Modified"), &get).unwrap();
    assert!(!resp.headers().contains_key(header::CONTENT_LENGTH));
    let (resp, _) = parsed(
        "HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n",
        &Method::HEAD,
    )
    .unwrap();
    assert_eq!(resp.headers()[header::CONTENT_LENGTH], "9");
}

#[test]
fn keep_alive_rules() {
    let ka = |raw: &str| {
        let (resp, f, seen) = parsed_seen(raw, &Method::GET).unwrap();
        keeps_alive(&resp, f, seen)
    };
    assert!(ka("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"));
    assert!(ka(
        "HTTP/1.1 200 OK\r\ncontent-length: 0\r\nConnection: Keep-Alive\r\n\r\n"
    ));
    assert!(!ka(
        "HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    ));
    assert!(!ka(
        "HTTP/1.1 200 OK\r\ncontent-length: 0\r\nConnection: keep-alive, Close\r\n\r\n"
    ));
    assert!(!ka("HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n"));
    assert!(!ka("HTTP/1.1 200 OK\r\n\r\n"));
    assert!(!ka(
        "HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: keep-alive\r\nConnection: close\r\n\r\n"
    ));
    assert!(ka(
        "HTTP/1.1 200 OK\r\ncontent-length: 0\r\nConnection: Upgrade\r\n\r\n"
    ));
}

/// The fields that only say how this hop's connection goes on are read,
/// not kept: the forwarding would remove them. Any other `Connection`
/// stays, for the hop-by-hop pass to read the names it lists.
#[test]
fn connection_fields_of_this_hop_stay_out_of_the_map() {
    let (resp, f) = parsed(
        "HTTP/1.1 200 OK\r\nConnection: keep-alive\r\nKeep-Alive: timeout=5\r\nx-a: 1\r\ncontent-length: 2\r\n\r\n",
        &Method::GET,
    )
    .unwrap();
    assert_eq!(f, Framing::Length(2));
    let names: Vec<&str> = resp.headers().keys().map(|k| k.as_str()).collect();
    assert_eq!(names, ["x-a", "content-length"]);
    let (resp, _) = parsed(
        "HTTP/1.1 200 OK\r\nConnection: close\r\ncontent-length: 0\r\n\r\n",
        &Method::GET,
    )
    .unwrap();
    assert!(!resp.headers().contains_key(header::CONNECTION));
    let (resp, _) = parsed(
        "HTTP/1.1 200 OK\r\nConnection: keep-alive, x-b\r\nx-b: 2\r\ncontent-length: 0\r\n\r\n",
        &Method::GET,
    )
    .unwrap();
    assert_eq!(resp.headers()[header::CONNECTION], "keep-alive, x-b");
}

#[test]
fn every_field_up_to_the_limit_keeps_its_name_and_value() {
    let head = |fields: usize| {
        let mut raw = String::from("HTTP/1.1 200 OK\r\n");
        for i in 0..fields {
            raw.push_str(&format!("x-field-{i}: value {i}\r\n"));
        }
        raw + "\r\n"
    };
    let (resp, _) = take_head(
        &mut BytesMut::from(head(MAX_HEADERS).as_bytes()),
        &mut HeaderMap::new(),
        &mut FieldNames::default(),
    )
    .unwrap()
    .unwrap();
    assert_eq!(resp.headers().len(), MAX_HEADERS);
    for i in 0..MAX_HEADERS {
        assert_eq!(resp.headers()[format!("x-field-{i}")], format!("value {i}"));
    }
    match take_head(
        &mut BytesMut::from(head(MAX_HEADERS + 1).as_bytes()),
        &mut HeaderMap::new(),
        &mut FieldNames::default(),
    ) {
        Err(ExchangeError::Failed(m)) => assert!(m.contains("more than"), "{m}"),
        other => panic!("expected a failure, got {other:?}"),
    }
}

#[test]
fn bad_heads_are_refused_with_a_reason() {
    let err = |raw: &str| match parsed(raw, &Method::GET) {
        Err(ExchangeError::Failed(m)) => m,
        other => panic!("expected a failure, got {other:?}"),
    };
    assert!(err("HTTP/1.1 200 OK\r\nbad header\r\n\r\n").contains("invalid response head"));
    assert!(err("HTTP/1.1 2000 OK\r\n\r\n").contains("invalid response head"));
    assert!(
        take_head(
            &mut BytesMut::from(&b"HTTP/1.1 200 OK\r\nx: y\r\n"[..]),
            &mut HeaderMap::new(),
            &mut FieldNames::default(),
        )
        .unwrap()
        .is_none()
    );
}

/// Names kept from one head serve the next where they are spelled the
/// same, and a head that differs gets its own names, never a kept one.
#[test]
fn names_kept_from_one_head_serve_only_where_they_match() {
    let mut names = FieldNames::default();
    let mut take = |raw: &str| {
        let (resp, _) = take_head(
            &mut BytesMut::from(raw.as_bytes()),
            &mut HeaderMap::new(),
            &mut names,
        )
        .unwrap()
        .unwrap();
        let fields: Vec<(String, String)> = resp
            .headers()
            .iter()
            .map(|(k, v)| (k.as_str().to_owned(), v.to_str().unwrap().to_owned()))
            .collect();
        fields
    };
    let first = take("HTTP/1.1 200 OK\r\nServer: a\r\nX-Custom: 1\r\ncontent-length: 0\r\n\r\n");
    assert_eq!(
        first,
        [("server", "a"), ("x-custom", "1"), ("content-length", "0")]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
    );
    let again = take("HTTP/1.1 200 OK\r\nServer: b\r\nX-Custom: 2\r\ncontent-length: 0\r\n\r\n");
    assert_eq!(
        again,
        [("server", "b"), ("x-custom", "2"), ("content-length", "0")]
            .map(|(k, v)| (k.to_owned(), v.to_owned()))
    );
    // Other names at the same places, and one more.
    let other = take(
        "HTTP/1.1 200 OK\r\nX-Other: 3\r\nServer: c\r\ncontent-length: 0\r\nx-last: 4\r\n\r\n",
    );
    assert_eq!(
        other,
        [
            ("x-other", "3"),
            ("server", "c"),
            ("content-length", "0"),
            ("x-last", "4")
        ]
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
    );
    // A name spelled in another case is parsed again, to the same name.
    let cased = take("HTTP/1.1 200 OK\r\nx-OTHER: 5\r\n\r\n");
    assert_eq!(cased, [("x-other".to_owned(), "5".to_owned())]);
    // An invalid name is refused, kept names or not.
    assert!(
        take_head(
            &mut BytesMut::from(&b"HTTP/1.1 200 OK\r\nx-other\x01: 5\r\n\r\n"[..]),
            &mut HeaderMap::new(),
            &mut names
        )
        .is_err()
    );
}

/// A repeated length the reader accepts leaves as one plain value, with
/// or without a body; a single plain one is read as it is.
#[test]
fn a_repeated_length_is_left_as_one_plain_value() {
    for (raw, method, want) in [
        ("content-length: 2, 2\r\n", Method::GET, Framing::Length(2)),
        (
            "content-length: 2\r\ncontent-length: 2\r\n",
            Method::GET,
            Framing::Length(2),
        ),
        ("content-length: 7, 7\r\n", Method::HEAD, Framing::Length(0)),
        ("content-length: 2\r\n", Method::GET, Framing::Length(2)),
    ] {
        let (resp, f) = parsed(&format!("HTTP/1.1 200 OK\r\n{raw}\r\n"), &method).unwrap();
        assert_eq!(f, want, "{raw:?}");
        let lengths: Vec<_> = resp
            .headers()
            .get_all(header::CONTENT_LENGTH)
            .iter()
            .collect();
        let plain = if method == Method::HEAD { "7" } else { "2" };
        assert_eq!(lengths, [plain], "{raw:?}");
    }
    assert!(
        parsed(
            "HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\n",
            &Method::GET
        )
        .is_err()
    );
}
