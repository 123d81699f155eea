//! Bodies through Envoy proxy-wasm filters: request and response bodies
//! streamed piece by piece to a filter that keeps them until the last, or
//! a response body read whole while a filter holds the head; Envoy as the
//! reference.

use super::proxy_wasm::body_seen;
use super::*;
use http_body_util::BodyExt;

/// An upstream whose `/r` answers `top secret stuff\n` in three pieces
/// (no length), `/big` 2 MiB in 64 KiB pieces, and `/whole` and
/// `/refuse` `top secret stuff\n` and `refuse me\n` in one piece with
/// their lengths (the body at hand with its head, as small answers come).
/// The upstream of these tests, and the signal that lets a `late-*`
/// answer's body go (see [`late`]).
async fn pieces() -> (Upstream, Arc<tokio::sync::Notify>) {
    let head_seen = Arc::new(tokio::sync::Notify::new());
    let seen = head_seen.clone();
    let app = upstream::serve(move |req| {
        let seen = seen.clone();
        async move {
            let late = req
                .headers()
                .get("x-redact")
                .is_some_and(|v| v.as_bytes().starts_with(b"late-"));
            let chunks: Vec<Bytes> = match req.uri().path() {
                "/big" => vec![Bytes::from(vec![b'a'; 64 << 10]); 32],
                path @ ("/whole" | "/refuse") => {
                    let text: &'static str = match path {
                        "/whole" => "top secret stuff\n",
                        _ => "refuse me\n",
                    };
                    return Response::new(
                        http_body_util::Full::new(Bytes::from_static(text.as_bytes()))
                            .map_err(|never| match never {})
                            .boxed(),
                    );
                }
                _ => ["top ", "secret ", "stuff\n"]
                    .into_iter()
                    .map(|s: &'static str| Bytes::from_static(s.as_bytes()))
                    .collect(),
            };
            let frames = chunks
                .into_iter()
                .map(|c| Ok::<_, std::io::Error>(hyper::body::Frame::data(c)));
            // The pieces come after the head, not in its packet: a body the
            // proxy reads with its head is a body at hand, which the filter
            // gets before the head leaves, and these answers test a body
            // that streams. A `late-*` answer's pieces wait until the
            // client has the head (what it tests is a call after the head
            // went); the others, whose outcome is the same either way, a
            // pause.
            let after_the_head = futures_util::stream::once(async move {
                if late {
                    let _ = tokio::time::timeout(Duration::from_secs(10), seen.notified()).await;
                } else {
                    tokio::time::sleep(Duration::from_millis(30)).await;
                }
                futures_util::stream::iter(frames)
            });
            let stream = futures_util::StreamExt::flatten(after_the_head);
            Response::new(http_body_util::StreamBody::new(stream).boxed())
        }
    })
    .await;
    (app, head_seen)
}

/// [`redacted`] for a `late-*` answer streamed from `/r`: its body is let
/// go (`head_seen`) once the client has the head.
async fn late(addr: std::net::SocketAddr, how: &str, head_seen: &tokio::sync::Notify) -> Redacted {
    let req = Request::get(format!("http://{addr}/r")).header("x-redact", how);
    let Ok(resp) = client::http1()
        .request(req.body(body(Bytes::new())).unwrap())
        .await
    else {
        return cut();
    };
    head_seen.notify_one();
    let status = resp.status().as_u16();
    match resp.into_body().collect().await {
        Ok(b) => answer(status, Some(&String::from_utf8_lossy(&b.to_bytes())), None),
        Err(_) => cut(),
    }
}

fn bodies_policy(upstream: &str) -> String {
    format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{upstream}"] }}]
plugins: [{{ name: redact, path: proxy-wasm-body.wasm }}]
routes: [{{ name: r, match: {{ path_prefix: / }}, upstream: app, plugins: [{{ use: redact }}] }}]
"#
    )
}

/// What a client sees of a GET of `path` through `addr` with
/// `x-redact: how`: status, body, `x-body-was`; or [`cut`], an answer
/// cut off (whether its head came before the cut is a matter of timing,
/// in Envoy as here).
#[derive(Debug, PartialEq)]
struct Redacted {
    status: u16,
    body: Option<String>,
    body_was: Option<String>,
}

async fn redacted(addr: std::net::SocketAddr, path: &str, how: Option<&str>) -> Redacted {
    let mut req = Request::get(format!("http://{addr}{path}"));
    if let Some(how) = how {
        req = req.header("x-redact", how);
    }
    let http = client::http1();
    let Ok(resp) = http.request(req.body(body(Bytes::new())).unwrap()).await else {
        return cut();
    };
    let status = resp.status().as_u16();
    let body_was = resp
        .headers()
        .get("x-body-was")
        .map(|v| v.to_str().unwrap().to_owned());
    let length = resp
        .headers()
        .get("content-length")
        .map(|v| v.to_str().unwrap().parse::<usize>().unwrap());
    let body = resp.into_body().collect().await.ok().map(|b| {
        let bytes = b.to_bytes();
        // A declared length is the body's own.
        if let Some(n) = length {
            assert_eq!(n, bytes.len(), "content-length of {path} {how:?}");
        }
        let text = String::from_utf8_lossy(&bytes).into_owned();
        // A large body by its length; the proxy's JSON answers whole.
        if text.len() > 64 && !text.starts_with('{') {
            format!("{} bytes", text.len())
        } else {
            text
        }
    });
    match body {
        None => cut(),
        body => Redacted {
            status,
            body,
            body_was,
        },
    }
}

/// An answer cut off.
/// The `error` of a JSON error answer's body.
fn error_of(body: &str) -> String {
    let json: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
    json["error"].as_str().unwrap_or(body).to_owned()
}

fn cut() -> Redacted {
    Redacted {
        status: 0,
        body: None,
        body_was: None,
    }
}

fn answer(status: u16, body: Option<&str>, body_was: Option<&str>) -> Redacted {
    Redacted {
        status,
        body: body.map(str::to_owned),
        body_was: body_was.map(str::to_owned),
    }
}

#[tokio::test]
pub(super) async fn a_filter_rewrites_a_response_body() {
    let (app, head_seen) = pieces().await;
    let dir = policy_dir(&bodies_policy(&app.url()), &["proxy-wasm-body"]);
    // A process, for its `/status`: a failing call drops its VM, and the
    // next request on that worker fails (`plugin could not start`) until
    // the fresh one is up; the status says when it is.
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let ready = super::proxy_wasm_isolation::uses_ready(&proxy.status().await, "r");
    assert_eq!(ready, 2, "a VM a worker, started before any request");
    let vms_back = || {
        proxy.wait_status("the fresh VM started", |s| {
            super::proxy_wasm_isolation::uses_ready(s, "r") == ready
        })
    };
    // Streamed: the head went on without its length, the pieces were
    // kept until the last, and the whole body rewritten.
    let a = redacted(proxy.addr, "/r", Some("stream")).await;
    assert_eq!(a, answer(200, Some("top [redacted] stuff\n"), None));
    // The head held for the body: rewritten, its length set, and a
    // header the filter set once it had the body.
    let a = redacted(proxy.addr, "/r", Some("hold")).await;
    assert_eq!(a, answer(200, Some("top [redacted] stuff\n"), Some("17")));
    // Not asked: the body streams through as it came.
    let a = redacted(proxy.addr, "/r", None).await;
    assert_eq!(a, answer(200, Some("top secret stuff\n"), None));
    // A body at hand with its head goes through the filter before the
    // head goes, with the calls and outcomes of a streamed one: rewritten
    // (its length the new body's), and a late refusal a response cut off.
    let a = redacted(proxy.addr, "/whole", Some("stream")).await;
    assert_eq!(a, answer(200, Some("top [redacted] stuff\n"), None));
    let a = redacted(proxy.addr, "/whole", Some("hold")).await;
    assert_eq!(a, answer(200, Some("top [redacted] stuff\n"), Some("17")));
    let a = redacted(proxy.addr, "/whole", None).await;
    assert_eq!(a, answer(200, Some("top secret stuff\n"), None));
    let a = redacted(proxy.addr, "/refuse", Some("stream")).await;
    assert_eq!(a, cut());
    // The filter's calls on the head once it has let it go fail (it
    // panics): a streamed response is cut off; one at hand had not gone
    // yet and is answered with the failure, as Envoy answers it.
    for how in ["late-write", "late-read"] {
        assert_eq!(late(proxy.addr, how, &head_seen).await, cut(), "{how}");
        vms_back().await;
        let a = redacted(proxy.addr, "/whole", Some(how)).await;
        assert_eq!(a.status, 500, "{how}: {a:?}");
        assert_eq!(
            a.body.as_deref().map(error_of),
            Some("plugin failed".to_owned()),
            "{how}"
        );
        vms_back().await;
    }
    // Past the buffer limit with the head held: the proxy's 500, as
    // Envoy's; kept while streaming: the response cut off.
    let a = redacted(proxy.addr, "/big", Some("hold")).await;
    assert_eq!(a.status, 500, "{a:?}");
    assert_eq!(
        a.body.as_deref().map(error_of),
        Some("response body too large for the route's plugin".to_owned())
    );
    let a = redacted(proxy.addr, "/big", Some("stream")).await;
    assert_eq!(a, cut());
    // A body as large passes a filter that does not keep it.
    let a = redacted(proxy.addr, "/big", None).await;
    assert_eq!(a.body.as_deref(), Some("2097152 bytes"));
}

/// A request's filter context ends once (`proxy_on_done`, `_log`,
/// `_delete`), whether its answer's body came whole with its head (head,
/// body and end made in one visit to the VM) or streamed, and whatever
/// the filter made of it; ending one twice would fail the VM (the SDK
/// panics on a context it no longer has).
#[tokio::test]
pub(super) async fn a_filters_context_ends_once_a_request() {
    let (app, _) = pieces().await;
    let dir = policy_dir(&bodies_policy(&app.url()), &["proxy-wasm-body"]);
    // One worker: the lines of one request come before the next's.
    let mut proxy = ProxyProcess::start_on(dir.path(), &["--workers", "1"]).await;
    // Passed, held for the body, streamed, refused too late (cut off).
    let asked = [
        ("/whole", "whole-passed", false),
        ("/whole", "hold", false),
        ("/r", "in-pieces", false),
        ("/refuse", "stream", true),
        ("/whole", "whole-again", false),
    ];
    for (path, how, cut_off) in asked {
        let a = redacted(proxy.addr, path, Some(how)).await;
        assert_eq!(a == cut(), cut_off, "{path} {how}: {a:?}");
    }
    proxy.wait_for_log("request logged: whole-again").await;
    for (_, how, _) in asked {
        let logged = proxy.count_logs(&format!("request logged: {how}"));
        assert_eq!(logged, 1, "{how}: its context ended {logged} times");
    }
    assert_eq!(proxy.count_logs("proxy-wasm VM failed"), 0);
}

/// Envoy is the reference: the same filter and requests through Envoy
/// 1.40 and through Portcullis give the same answers. Not the filter's
/// failures once it let the head go (`late-write`, `late-read`): Envoy
/// answers 503 if its head had not left yet, and cuts the response off
/// if it had, as the pieces happen to come. Not `hold`: Envoy
/// turns a filter's pause on a head into a pause of everything (its
/// body callback is never called, proxy-wasm's `StopIteration` made
/// `StopAllIterationAndWatermark`), so the request waits for its stream
/// timeout; Portcullis gives such a filter the body whole instead
/// (docs/plugins.md).
#[tokio::test]
pub(super) async fn a_response_body_filter_behaves_as_in_envoy() {
    let (app, _) = pieces().await;
    let filter = plugin_file("proxy-wasm-body");
    let envoy = crate::support::envoy::Envoy::with_filter(&filter, "", app.addr).await;
    let dir = policy_dir(&bodies_policy(&app.url()), &["proxy-wasm-body"]);
    let proxy = Proxy::start_dir(dir, &[]).await;
    for (path, how) in [
        ("/r", Some("stream")),
        ("/r", None),
        ("/big", Some("stream")),
        ("/big", None),
        ("/whole", Some("stream")),
        ("/whole", None),
        ("/refuse", Some("stream")),
    ] {
        let reference = redacted(envoy.addr, path, how).await;
        let ours = redacted(proxy.addr, path, how).await;
        assert_eq!(ours, reference, "{path} {how:?}");
    }
}

fn request_bodies_policy(upstream: &str) -> String {
    format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{upstream}"] }}]
plugins: [{{ name: inspect, path: proxy-wasm-body.wasm }}]
routes: [{{ name: b, match: {{ path: /b }}, upstream: app, plugins: [{{ use: inspect }}] }}]
"#
    )
}

/// A filter that lets the request head go and keeps the body's pieces
/// until the last: it may refuse the body then (the upstream request is
/// stopped, the client gets the filter's answer) or change it.
#[tokio::test]
pub(super) async fn a_filter_inspects_a_streamed_request_body() {
    let app = upstream::echo("app").await;
    let dir = policy_dir(&request_bodies_policy(&app.url()), &["proxy-wasm-body"]);
    let proxy = Proxy::start_dir(dir, &[]).await;
    let body_len = |s: &super::proxy_wasm::Seen| s.upstream[1].1.clone();
    let a = body_seen(proxy.addr, "hello", Some("stream")).await;
    assert_eq!(
        (a.status, body_len(&a)),
        (200, Some("16".into())),
        "hello (streamed)"
    );
    let a = body_seen(proxy.addr, "this is forbidden", Some("stream")).await;
    assert_eq!(
        (a.status, a.body.as_deref()),
        (403, Some("forbidden body\n"))
    );
    // Kept past the buffer limit: 413, as from Envoy.
    let a = body_seen(proxy.addr, vec![b'a'; 2 << 20], Some("stream")).await;
    assert_eq!(a.status, 413, "{:?}", a.body);
    // Bodies it does not keep pass as they are, however large.
    let a = body_seen(proxy.addr, vec![b'a'; 2 << 20], None).await;
    assert_eq!((a.status, body_len(&a)), (200, Some("2097152".into())));
}

#[tokio::test]
pub(super) async fn a_streamed_request_body_filter_behaves_as_in_envoy() {
    let app = upstream::echo("app").await;
    let filter = plugin_file("proxy-wasm-body");
    let envoy = crate::support::envoy::Envoy::with_filter(&filter, "", app.addr).await;
    let dir = policy_dir(&request_bodies_policy(&app.url()), &["proxy-wasm-body"]);
    let proxy = Proxy::start_dir(dir, &[]).await;
    let big = Bytes::from(vec![b'a'; 2 << 20]);
    let cases: [(Bytes, Option<&str>); 5] = [
        (Bytes::from_static(b"hello"), Some("stream")),
        (Bytes::from_static(b"this is forbidden"), Some("stream")),
        (Bytes::from_static(b"forbidden or not"), None),
        (big.clone(), Some("stream")),
        (big, None),
    ];
    for (payload, how) in cases {
        let len = payload.len();
        let reference = body_seen(envoy.addr, payload.clone(), how).await;
        let ours = body_seen(proxy.addr, payload, how).await;
        if reference.status == 413 {
            // The limit is the proxy's, and so is the answer's shape
            // (Envoy's text, Portcullis's JSON error): the status agrees.
            assert_eq!(ours.status, 413, "{len} bytes, {how:?}: {ours:?}");
            continue;
        }
        assert_eq!(ours, reference, "{len} bytes, {how:?}");
    }
}

/// An upstream for a gRPC-like exchange over HTTP/2: it answers with the
/// request trailers it got (`name=value;...`, sorted) as its body and a
/// `grpc-status: 0` trailer.
async fn trailers_echo() -> Upstream {
    upstream::serve(|req: Request<hyper::body::Incoming>| async move {
        let got = req.into_body().collect().await.unwrap();
        let mut seen: Vec<String> = got
            .trailers()
            .map(|t| {
                t.iter()
                    .map(|(k, v)| format!("{k}={}", v.to_str().unwrap()))
                    .collect()
            })
            .unwrap_or_default();
        seen.sort();
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from_static("0"));
        let frames = [
            hyper::body::Frame::data(Bytes::from(seen.join(";"))),
            hyper::body::Frame::trailers(trailers),
        ];
        let stream = futures_util::stream::iter(frames.map(Ok::<_, std::io::Error>));
        Response::new(http_body_util::StreamBody::new(stream).boxed())
    })
    .await
}

/// What a client sees of a gRPC-like call: the HTTP status, the
/// `grpc-status` and `grpc-message` of the head (a trailers-only answer),
/// those of the trailers (with the filter's `x-pw-grpc-status`), and the
/// body.
#[derive(Debug, PartialEq)]
struct Called {
    status: u16,
    head: (Option<String>, Option<String>),
    trailers: (Option<String>, Option<String>),
    body: Bytes,
}

/// A gRPC-like call through `addr` over HTTP/2 with the request trailer
/// `trailer` (and `x-remove-me`).
async fn trailed_call(addr: std::net::SocketAddr, trailer: (&'static str, &'static str)) -> Called {
    let mut trailers = http::HeaderMap::new();
    trailers.insert(trailer.0, HeaderValue::from_static(trailer.1));
    trailers.insert("x-remove-me", HeaderValue::from_static("gone"));
    let frames = [
        hyper::body::Frame::data(Bytes::from_static(b"\0\0\0\0\0")),
        hyper::body::Frame::trailers(trailers),
    ];
    let stream = futures_util::stream::iter(frames.map(Ok::<_, std::io::Error>));
    let req = Request::post(format!("http://{addr}/pkg.Service/Call"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(http_body_util::StreamBody::new(stream).boxed())
        .unwrap();
    let resp = client::h2c().request(req).await.expect("response head");
    let status = resp.status().as_u16();
    let named = |h: &http::HeaderMap, n: &str| h.get(n).map(|v| v.to_str().unwrap().to_owned());
    let head = (
        named(resp.headers(), "grpc-status"),
        named(resp.headers(), "grpc-message"),
    );
    let got = resp.into_body().collect().await.expect("whole response");
    let t = got.trailers().cloned().unwrap_or_default();
    Called {
        status,
        head,
        trailers: (named(&t, "grpc-status"), named(&t, "x-pw-grpc-status")),
        body: got.to_bytes(),
    }
}

/// Trailers both ways through a filter that reads and edits them, and
/// answers on a request trailer; Envoy as the reference.
#[tokio::test]
pub(super) async fn a_filter_reads_and_edits_trailers_as_in_envoy() {
    let app = trailers_echo().await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"], http2: true }}]
plugins: [{{ name: pw, path: proxy-wasm-headers.wasm }}]
routes: [{{ name: grpc, match: {{ path_prefix: / }}, upstream: app, plugins: [{{ use: pw, config: t }}] }}]
"#,
            app.url()
        ),
        &["proxy-wasm-headers"],
    );
    let proxy = Proxy::start_dir(dir, &[]).await;

    // Request trailers reach the upstream as the filter left them (one
    // removed, one added with the count it was given); the response's
    // reach the client with the filter's copy of its `grpc-status`.
    let passed = trailed_call(proxy.addr, ("x-checksum", "abc")).await;
    assert_eq!(passed.status, 200, "{passed:?}");
    assert_eq!(&passed.body[..], b"x-checksum=abc;x-pw-trailers=2");
    let zero = Some("0".to_owned());
    assert_eq!(passed.trailers, (zero.clone(), zero));
    // A filter's answer on the trailers stops the request there, and a
    // gRPC client gets it in gRPC's terms, as from Envoy: 403 is
    // PERMISSION_DENIED, the body its message.
    let denied = trailed_call(proxy.addr, ("x-deny", "yes")).await;
    assert_eq!(denied.status, 200, "{denied:?}");
    assert_eq!(
        denied.head,
        (
            Some("7".into()),
            Some("denied by the filter's trailer check%0A".into())
        )
    );
    assert!(denied.body.is_empty());

    let filter = plugin_file("proxy-wasm-headers");
    let envoy = crate::support::envoy::Envoy::with_filter_h2(&filter, "t", app.addr).await;
    for trailer in [("x-checksum", "abc"), ("x-deny", "yes")] {
        let reference = trailed_call(envoy.addr, trailer).await;
        let ours = trailed_call(proxy.addr, trailer).await;
        assert_eq!(ours, reference, "{trailer:?}");
    }
}
