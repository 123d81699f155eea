//! A filter's gRPC streams (`proxy_grpc_stream`, `_send`, `_close`,
//! `_cancel`), in Portcullis as in Envoy 1.40: the same filter
//! (`proxy-wasm-grpc`, whose root context opens streams as a request
//! asks) against one streaming service, compared on what the filter was
//! told of each stream, in order.

use super::*;

/// `message` framed as gRPC sends one.
fn framed(message: &[u8]) -> Bytes {
    let mut out = vec![0];
    out.extend_from_slice(&(message.len() as u32).to_be_bytes());
    out.extend_from_slice(message);
    Bytes::from(out)
}

/// A streaming gRPC service on HTTP/2 (h2c): `test.Chat/Echo` answers
/// its head at once (`x-server: chat`), each message as it comes
/// (`echo:` and the message) and, once the caller half-closes, status 0
/// with `x-count`, the messages it got; `Reject` answers trailers-only
/// with status 7; anything else is HTTP 404.
async fn chat_service() -> Upstream {
    use http_body_util::BodyExt;
    type Frame = hyper::body::Frame<Bytes>;
    upstream::serve(|req: Request<hyper::body::Incoming>| async move {
        let grpc = Response::builder().header("content-type", "application/grpc");
        match req.uri().path() {
            "/test.Chat/Echo" => {
                let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame, std::io::Error>>(16);
                tokio::spawn(async move {
                    let mut body = req.into_body();
                    let (mut got, mut count) = (Vec::new(), 0);
                    while let Some(Ok(frame)) = body.frame().await {
                        let Ok(data) = frame.into_data() else {
                            continue;
                        };
                        got.extend_from_slice(&data);
                        while got.len() >= 5 {
                            let len = u32::from_be_bytes([got[1], got[2], got[3], got[4]]) as usize;
                            if got.len() < 5 + len {
                                break;
                            }
                            let message: Vec<u8> = got.drain(..5 + len).skip(5).collect();
                            count += 1;
                            let reply = framed(&[b"echo:".as_slice(), &message].concat());
                            let _ = tx.send(Ok(Frame::data(reply))).await;
                        }
                    }
                    let mut trailers = http::HeaderMap::new();
                    trailers.insert("grpc-status", HeaderValue::from_static("0"));
                    trailers.insert("x-count", HeaderValue::from(count));
                    let _ = tx.send(Ok(Frame::trailers(trailers))).await;
                });
                let frames = futures_util::stream::unfold(rx, |mut rx| async move {
                    rx.recv().await.map(|frame| (frame, rx))
                });
                grpc.header("x-server", "chat")
                    .body(http_body_util::StreamBody::new(frames).boxed())
                    .unwrap()
            }
            // Answers its head and never reads the caller's messages:
            // HTTP/2 flow control holds them back after 64 KiB.
            "/test.Chat/Deaf" => {
                let unread = req.into_body();
                let never = futures_util::stream::unfold(unread, |unread| async move {
                    std::future::pending::<()>().await;
                    drop(unread);
                    None::<(Result<Frame, std::io::Error>, _)>
                });
                grpc.header("x-server", "deaf")
                    .body(http_body_util::StreamBody::new(never).boxed())
                    .unwrap()
            }
            "/test.Chat/Reject" => grpc
                .header("grpc-status", "7")
                .header("grpc-message", "not%20now")
                .body(upstream::full(Bytes::new()))
                .unwrap(),
            _ => Response::builder()
                .status(404)
                .body(upstream::full(Bytes::new()))
                .unwrap(),
        }
    })
    .await
}

/// The filter's transcript at `addr`.
async fn transcript(addr: std::net::SocketAddr) -> String {
    let req = Request::get(format!("http://{addr}/t")).header("x-grpc-transcript", "1");
    let a = client::send(&client::http1(), req.body(body(Bytes::new())).unwrap()).await;
    assert_eq!(a.status, 200, "{addr}: {:?}", a.body);
    String::from_utf8_lossy(&a.body).into_owned()
}

/// Has the filter at `addr` run `plan`, and waits for the transcript to
/// end in a line starting `last`: the lines it added.
async fn run(addr: std::net::SocketAddr, plan: &str, last: &str) -> Vec<String> {
    let before = transcript(addr).await.lines().count();
    let req = Request::get(format!("http://{addr}/s")).header("x-grpc-stream", plan);
    let a = client::send(&client::http1(), req.body(body(Bytes::new())).unwrap()).await;
    assert_eq!(a.status, 202, "{addr}: {:?}", a.body);
    let started = Instant::now();
    loop {
        let now = transcript(addr).await;
        let added: Vec<String> = now.lines().skip(before).map(str::to_owned).collect();
        if added.last().is_some_and(|l| l.starts_with(last)) {
            return added;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "{addr}: {plan}: no `{last}` in 10 s: {added:?}"
        );
        // The stream's events arrive on their own; nothing signals them
        // to the test but the transcript.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
pub(super) async fn a_filters_grpc_streams_go_as_in_envoy() {
    let app = upstream::echo("app").await;
    let chat = chat_service().await;
    let (envoy, dir) = super::proxy_wasm_grpc::both_on(&app, "chat", &chat).await;
    // Its own process: shared queues and data are the process's, and the
    // unary test's filter registers the same queue.
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let lines = |all: &[&str]| all.iter().map(|l| l.to_string()).collect::<Vec<_>>();
    let head = "head x-server=chat";
    // What the filter is told, plan by plan (the close's message is
    // Envoy's only where it is empty: Envoy hands a status message over
    // percent-encoded, against the gRPC spec; Portcullis decodes it).
    let cases = [
        (
            "chat|test.Chat/Echo|a,b|close",
            "close",
            lines(&[
                head,
                "message echo:a",
                "message echo:b",
                "trailers x-count=2",
                "close 0 ",
            ]),
        ),
        // An empty last message with end_stream, as Envoy sends it.
        (
            "chat|test.Chat/Echo|c|end",
            "close",
            lines(&[
                head,
                "message echo:c",
                "message echo:",
                "trailers x-count=2",
                "close 0 ",
            ]),
        ),
        (
            "chat|test.Chat/Reject||open",
            "close",
            lines(&["head x-server=", "trailers x-count=", "close 7 not now"]),
        ),
        (
            "chat|test.Chat/Missing||open",
            "close",
            lines(&[
                "head x-server=",
                "trailers x-count=",
                "close 12 upstream answered HTTP 404",
            ]),
        ),
        // Cancelled: nothing more is told (the next plan's lines follow).
        (
            "chat|test.Chat/Echo|x|cancel",
            "cancelled",
            lines(&["cancelled"]),
        ),
        // An unknown cluster is the ABI's ParseFailure, as in Envoy.
        (
            "nowhere|test.Chat/Echo||close",
            "refused",
            lines(&["refused ParseFailure"]),
        ),
    ];
    let but_messages = |all: &[String]| -> Vec<String> {
        let cut = |l: &String| match l.strip_prefix("close ") {
            Some(rest) => format!("close {}", rest.split(' ').next().unwrap_or("")),
            None => l.clone(),
        };
        all.iter().map(cut).collect()
    };
    for (plan, last, expected) in &cases {
        let theirs = run(envoy.addr, plan, last).await;
        let ours = run(proxy.addr, plan, last).await;
        assert_eq!(&ours, expected, "{plan}; Envoy's: {theirs:?}");
        assert_eq!(but_messages(&ours), but_messages(&theirs), "{plan}");
    }
    // gRPC needs HTTP/2: a stream to an upstream without `http2: true`
    // fails at once, saying so (Envoy has no such upstream to compare),
    // ended as Envoy ends a failed stream: empty trailing metadata first.
    let over_h1 = run(proxy.addr, "chat1|test.Chat/Echo|a|close", "close").await;
    let why = "close 14 upstream `chat1` speaks HTTP/1.1; a gRPC call needs `http2: true` on it";
    assert_eq!(over_h1, lines(&["trailers x-count=", why]));
}

/// A filter sending on a stream faster than its upstream reads: past
/// 4 MiB waiting, the stream fails with RESOURCE_EXHAUSTED (the filter
/// is told as of any failed stream), the proxy's memory stays bounded,
/// and the filter's next stream works. Envoy has its own bound (the
/// connection's buffer limit) and reports it otherwise; not compared.
#[tokio::test]
pub(super) async fn a_stream_its_upstream_does_not_read_fails_past_its_bound() {
    let chat = chat_service().await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: chat, endpoints: ["{}"], http2: true }}]
plugins: [{{ name: pw, path: proxy-wasm-grpc.wasm }}]
routes: [{{ name: g, match: {{ path_prefix: / }}, respond: {{ status: 204 }}, plugins: [{{ use: pw }}] }}]
"#,
            chat.url()
        ),
        &["proxy-wasm-grpc"],
    );
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let mib = "#1048576";
    let plan = format!("chat|test.Chat/Deaf|{mib},{mib},{mib},{mib},{mib}|open");
    let told = run(proxy.addr, &plan, "close").await;
    let close = told.last().expect("a close");
    assert!(
        close.starts_with(
            "close 8 the stream's messages waiting for the upstream passed 4194304 bytes"
        ),
        "{told:?}"
    );
    // Told as a failed stream is: empty trailing metadata, then the close.
    assert_eq!(told.len(), 2, "{told:?}");
    assert_eq!(told[0], "trailers x-count=");
    // The filter's next stream goes as ever.
    let again = run(proxy.addr, "chat|test.Chat/Echo|a|close", "close").await;
    assert_eq!(
        again.last().map(String::as_str),
        Some("close 0 "),
        "{again:?}"
    );
}
