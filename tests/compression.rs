//! A route's `compress`: gzip for clients that take it, streamed, and
//! nothing done where it would be wrong.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper::{Request, Response};
use tokio::sync::Notify;

use crate::support::client::{self, Answer, body};
use crate::support::upstream::{self, RespBody, full};
use crate::support::{Proxy, check};

/// A JSON document of about `n` bytes, compressible as real ones are.
fn json_of(n: usize) -> String {
    let mut s = String::from("[");
    let mut i = 0;
    while s.len() < n {
        s.push_str(&format!(
            r#"{{"id":{i},"name":"workflow-{i}","phase":"Succeeded"}},"#
        ));
        i += 1;
    }
    s.pop();
    s.push(']');
    s
}

fn gunzip(data: &[u8]) -> Vec<u8> {
    let mut out = Decoder::new("gzip");
    out.push(data);
    out.finish()
}

/// A streaming decoder for `coding` (`gzip` or `br`).
enum Decoder {
    Gzip(Box<flate2::write::GzDecoder<Vec<u8>>>),
    Brotli(Box<brotli::DecompressorWriter<Vec<u8>>>),
}

impl Decoder {
    fn new(coding: &str) -> Decoder {
        match coding {
            "gzip" => Decoder::Gzip(Box::new(flate2::write::GzDecoder::new(Vec::new()))),
            "br" => Decoder::Brotli(Box::new(brotli::DecompressorWriter::new(Vec::new(), 4096))),
            other => panic!("no decoder for {other}"),
        }
    }

    /// Decodes `data`; returns all the output so far.
    fn push(&mut self, data: &[u8]) -> &[u8] {
        match self {
            Decoder::Gzip(d) => {
                d.write_all(data).expect("a gzip stream");
                d.flush().unwrap();
                d.get_ref()
            }
            Decoder::Brotli(d) => {
                d.write_all(data).expect("a brotli stream");
                d.flush().unwrap();
                d.get_ref()
            }
        }
    }

    /// The whole output, checking the stream ended properly.
    fn finish(self) -> Vec<u8> {
        match self {
            Decoder::Gzip(d) => d.finish().expect("a whole gzip stream"),
            Decoder::Brotli(d) => d.into_inner().expect("a whole brotli stream"),
        }
    }
}

/// An upstream answering by path: `/json` 20 KB of JSON with a strong
/// ETag, `/small` 100 bytes of JSON, `/png` 20 KB as image/png,
/// `/gzipped` JSON already gzip-encoded, `/no-transform` JSON that
/// forbids changes.
async fn typed_upstream() -> upstream::Upstream {
    upstream::serve(|req| async move {
        let json = json_of(20_000);
        let (body, content_type, extra): (Vec<u8>, &str, Option<(&str, &str)>) =
            match req.uri().path() {
                "/json" => (json.into(), "application/json", Some(("etag", "\"v1\""))),
                "/small" => (json_of(100).into(), "application/json", None),
                "/png" => (json.into(), "image/png", None),
                "/gzipped" => {
                    let mut enc =
                        flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                    enc.write_all(json.as_bytes()).unwrap();
                    (
                        enc.finish().unwrap(),
                        "application/json",
                        Some(("content-encoding", "gzip")),
                    )
                }
                _ => (
                    json.into(),
                    "application/json",
                    Some(("cache-control", "public, no-transform")),
                ),
            };
        let mut resp = Response::builder().header("content-type", content_type);
        if let Some((k, v)) = extra {
            resp = resp.header(k, v);
        }
        resp.body(full(body)).unwrap()
    })
    .await
}

async fn compressing_proxy(up: &upstream::Upstream, compress: &str) -> Proxy {
    Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: e, endpoints: ["{}"] }}]
routes:
  - {{ name: all, match: {{ path_prefix: / }}, upstream: e, compress: {compress} }}
"#,
        up.url()
    ))
    .await
}

async fn get(proxy: &Proxy, method: &str, path: &str, accept: Option<&str>) -> Answer {
    let mut req = Request::builder().method(method).uri(proxy.url(path));
    if let Some(accept) = accept {
        req = req.header("accept-encoding", accept);
    }
    client::send(&client::http1(), req.body(body(Bytes::new())).unwrap()).await
}

#[tokio::test]
async fn json_is_compressed_for_clients_that_take_it_and_left_alone_otherwise() {
    let up = typed_upstream().await;
    let proxy = compressing_proxy(&up, "true").await;
    let plain = json_of(20_000);

    // What browsers send gets brotli; a client weighing gzip higher, or
    // naming only gzip, gets gzip.
    for (accept, coding) in [
        ("gzip, deflate, br, zstd", "br"),
        ("br;q=0.5, gzip", "gzip"),
        ("gzip", "gzip"),
    ] {
        let a = get(&proxy, "GET", "/json", Some(accept)).await;
        assert_eq!(a.status, 200);
        assert_eq!(a.header("content-encoding"), Some(coding), "{accept}");
        assert_eq!(a.header("content-length"), None);
        assert_eq!(a.header("vary"), Some("accept-encoding"));
        assert_eq!(a.header("etag"), Some("W/\"v1\""));
        assert!(
            a.body.len() < plain.len() / 4,
            "{accept}: {} bytes",
            a.body.len()
        );
        let mut decoder = Decoder::new(coding);
        decoder.push(&a.body);
        assert_eq!(decoder.finish(), plain.as_bytes(), "{accept}");
    }

    // Not asked for, or refused: the upstream's bytes, still with Vary.
    for accept in [None, Some("gzip;q=0"), Some("deflate")] {
        let a = get(&proxy, "GET", "/json", accept).await;
        assert_eq!(a.header("content-encoding"), None, "{accept:?}");
        assert_eq!(a.body, plain.as_bytes(), "{accept:?}");
        assert_eq!(a.header("vary"), Some("accept-encoding"), "{accept:?}");
        assert_eq!(a.header("etag"), Some("\"v1\""), "{accept:?}");
    }
    // HEAD keeps the upstream's length, and says the GET would vary.
    let a = get(&proxy, "HEAD", "/json", Some("gzip")).await;
    assert_eq!(a.header("content-encoding"), None);
    assert_eq!(a.header("content-length"), Some(&*plain.len().to_string()));
    assert_eq!(a.header("vary"), Some("accept-encoding"));

    // Too small, not a compressible type, already encoded, or forbidden.
    // Too small for anyone to get it compressed, an answer does not vary
    // (nginx's gzip_vary the same), nor does its HEAD.
    let a = get(&proxy, "GET", "/small", Some("gzip")).await;
    assert_eq!(a.header("content-encoding"), None);
    assert_eq!(a.body, json_of(100).as_bytes());
    assert_eq!(a.header("vary"), None);
    let a = get(&proxy, "HEAD", "/small", Some("gzip")).await;
    assert_eq!(a.header("vary"), None);
    let a = get(&proxy, "GET", "/png", Some("gzip")).await;
    assert_eq!(a.header("content-encoding"), None);
    assert_eq!(a.header("vary"), None);
    let a = get(&proxy, "GET", "/gzipped", Some("gzip")).await;
    assert_eq!(a.header("content-encoding"), Some("gzip"));
    assert_eq!(
        gunzip(&a.body),
        plain.as_bytes(),
        "compressed once, not twice"
    );
    let a = get(&proxy, "GET", "/no-transform", Some("gzip")).await;
    assert_eq!(a.header("content-encoding"), None);
    assert_eq!(a.body, plain.as_bytes());
}

#[tokio::test]
async fn settings_pick_types_and_size_and_routes_without_compress_are_untouched() {
    let up = typed_upstream().await;
    let proxy = compressing_proxy(
        &up,
        r#"{ types: ["image/*"], min_size: 50, level: 9, brotli: false }"#,
    )
    .await;
    let a = get(&proxy, "GET", "/png", Some("br, gzip")).await;
    assert_eq!(a.header("content-encoding"), Some("gzip"));
    assert_eq!(gunzip(&a.body), json_of(20_000).as_bytes());
    let a = get(&proxy, "GET", "/json", Some("gzip")).await;
    assert_eq!(a.header("content-encoding"), None, "JSON is not listed");

    let off = compressing_proxy(&up, "false").await;
    let a = get(&off, "GET", "/json", Some("gzip")).await;
    assert_eq!(a.header("content-encoding"), None);
    assert_eq!(a.header("vary"), None);
}

/// The proxy's own answers are judged by their length too, with or
/// without a `Content-Length` field: a short one goes as it is and does
/// not vary, a long one is compressed.
#[tokio::test]
async fn the_proxys_own_answers_are_compressed_only_past_min_size() {
    let long = "x".repeat(2_000);
    let proxy = Proxy::start_yaml(&format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
routes:
  - name: short
    match: {{ path: /short }}
    respond: {{ status: 200, body: "short text", headers: {{ content-type: text/plain }} }}
    compress: true
  - name: long
    match: {{ path: /long }}
    respond: {{ status: 200, body: "{long}", headers: {{ content-type: text/plain }} }}
    compress: true
"#
    ))
    .await;
    let a = get(&proxy, "GET", "/short", Some("gzip")).await;
    assert_eq!(a.status, 200);
    assert_eq!(a.header("content-encoding"), None);
    assert_eq!(a.header("vary"), None);
    assert_eq!(a.body, "short text".as_bytes());
    let a = get(&proxy, "GET", "/long", Some("gzip")).await;
    assert_eq!(a.header("content-encoding"), Some("gzip"));
    assert_eq!(a.header("vary"), Some("accept-encoding"));
    assert_eq!(gunzip(&a.body), long.as_bytes());
}

/// Each frame the upstream sends is flushed compressed at once: the
/// first line of a stream is readable by the client while the upstream
/// still holds the second, with either coding.
#[tokio::test]
async fn a_compressed_stream_is_not_held_back() {
    stream_not_held_back("gzip").await;
    stream_not_held_back("br").await;
}

async fn stream_not_held_back(coding: &str) {
    let release = Arc::new(Notify::new());
    let hold = release.clone();
    let up = upstream::serve(move |_req| {
        let hold = hold.clone();
        async move {
            let frames = futures_util::stream::unfold(0, move |n| {
                let hold = hold.clone();
                async move {
                    match n {
                        0 => Some((line("first"), 1)),
                        1 => {
                            hold.notified().await;
                            Some((line("second"), 2))
                        }
                        _ => None,
                    }
                }
            });
            Response::builder()
                .header("content-type", "application/x-ndjson")
                .body(BodyExt::boxed(StreamBody::new(frames)) as RespBody)
                .unwrap()
        }
    })
    .await;
    let proxy = compressing_proxy(&up, "true").await;
    let req = Request::get(proxy.url("/stream"))
        .header("accept-encoding", coding)
        .body(body(Bytes::new()))
        .unwrap();
    let resp = client::http1().request(req).await.unwrap();
    assert_eq!(resp.headers()["content-encoding"], coding);
    let mut stream = resp.into_body();
    let mut decoder = Decoder::new(coding);
    let first = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let frame = stream.frame().await.expect("a frame").expect("no error");
            if let Ok(data) = frame.into_data() {
                let out = decoder.push(&data);
                if out.ends_with(b"\n") {
                    return out.to_vec();
                }
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{coding}: the first line before the upstream sent the second"));
    assert_eq!(first, line_text("first").as_bytes(), "{coding}");
    release.notify_one();
    let rest = stream.collect().await.unwrap().to_bytes();
    decoder.push(&rest);
    let whole = decoder.finish();
    assert_eq!(
        whole,
        [line_text("first"), line_text("second")]
            .concat()
            .as_bytes()
    );
}

fn line_text(word: &str) -> String {
    format!(
        "{{\"event\":\"{word}\",\"padding\":\"{}\"}}\n",
        "x".repeat(600)
    )
}

fn line(word: &str) -> Result<Frame<Bytes>, std::io::Error> {
    Ok(Frame::data(Bytes::from(line_text(word))))
}

#[test]
fn bad_compress_settings_are_reported_with_their_place() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("a.yaml"),
        r#"listeners: [{ name: http, bind: "127.0.0.1:0" }]
upstreams: [{ name: e, endpoints: ["http://127.0.0.1:1"] }]
routes:
  - { name: a, match: { path: /a }, upstream: e, compress: maybe }
  - { name: b, match: { path: /b }, upstream: e, compress: { level: 12 } }
  - { name: c, match: { path: /c }, upstream: e, compress: { types: [json] } }
  - { name: e, match: { path: /e }, upstream: e, compress: { brotli: 12 } }
"#,
    )
    .unwrap();
    // An unknown key stops its file's parse (the other files are still
    // checked), so it has a file of its own.
    std::fs::write(
        dir.path().join("b.yaml"),
        "routes:\n  - { name: d, match: { path: /d }, upstream: e, compress: { speed: 1 } }\n",
    )
    .unwrap();
    let (ok, _, stderr) = check(dir.path());
    assert!(!ok);
    for (place, message) in [
        ("a.yaml:4:", "`maybe` is not a boolean"),
        ("a.yaml:5:", "`12` is not a gzip level"),
        ("a.yaml:6:", "`json` is not a media type"),
        ("a.yaml:7:", "`12` is not a brotli quality"),
        ("b.yaml:2:", "unknown field `speed`"),
    ] {
        assert!(
            stderr
                .lines()
                .any(|l| l.contains(place) && l.contains(message)),
            "{place} {message}: {stderr}"
        );
    }
}
