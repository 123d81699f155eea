//! A filter's gRPC calls (`proxy_grpc_call`), in Portcullis as in Envoy
//! 1.40: the same filter (`proxy-wasm-grpc`, built from the Rust SDK)
//! and requests in both, against one gRPC service, compared on what the
//! filter learnt and what the service was sent.

use super::*;

/// A gRPC service on HTTP/2 (h2c): `test.Echo/Say` answers `hi ` and the
/// message; `Deny` answers trailers-only with status 7 and a
/// percent-encoded message; `Missing` is HTTP 404; `Hang` never answers.
/// What each call brought (path, the gRPC headers, the filter's metadata,
/// the framed body) goes to `seen`.
async fn echo_service() -> (Upstream, tokio::sync::mpsc::UnboundedReceiver<String>) {
    use http_body_util::BodyExt;
    let (tx, seen) = tokio::sync::mpsc::unbounded_channel();
    let service = upstream::serve(move |req: Request<hyper::body::Incoming>| {
        let tx = tx.clone();
        async move {
            let path = req.uri().path().to_owned();
            let header = |h: &str| {
                req.headers()
                    .get(h)
                    .map_or("-", |v| v.to_str().unwrap_or("?"))
                    .to_owned()
            };
            let (version, kind, te) = (req.version(), header("content-type"), header("te"));
            let (from, deadline) = (header("x-from"), header("grpc-timeout") != "-");
            let body = req.into_body().collect().await.unwrap().to_bytes();
            let _ = tx.send(format!(
                "{version:?} POST {path} {kind} te={te} x-from={from} deadline={deadline} body={body:?}"
            ));
            let message = body.get(5..).unwrap_or_default();
            let grpc = |status: &'static str, extra: Option<&'static str>| {
                let mut r = Response::builder()
                    .header("content-type", "application/grpc")
                    .header("grpc-status", status);
                if let Some(m) = extra {
                    r = r.header("grpc-message", m);
                }
                r.body(upstream::full(Bytes::new())).unwrap()
            };
            match path.as_str() {
                "/test.Echo/Say" => {
                    let reply = [b"hi ".as_slice(), message].concat();
                    let mut framed = vec![0];
                    framed.extend_from_slice(&(reply.len() as u32).to_be_bytes());
                    framed.extend_from_slice(&reply);
                    let mut trailers = http::HeaderMap::new();
                    trailers.insert("grpc-status", HeaderValue::from_static("0"));
                    let frames = [
                        hyper::body::Frame::data(Bytes::from(framed)),
                        hyper::body::Frame::trailers(trailers),
                    ];
                    let stream = futures_util::stream::iter(frames.map(Ok::<_, std::io::Error>));
                    Response::builder()
                        .header("content-type", "application/grpc")
                        .body(http_body_util::StreamBody::new(stream).boxed())
                        .unwrap()
                }
                "/test.Echo/Deny" => grpc("7", Some("no%20way%3A%20not%20you")),
                "/test.Echo/Hang" => std::future::pending().await,
                _ => Response::builder()
                    .status(404)
                    .body(upstream::full(Bytes::new()))
                    .unwrap(),
            }
        }
    })
    .await;
    (service, seen)
}

/// Header fields, as the filter set them.
type Fields = Vec<(String, String)>;

/// What the filter told the upstream of a request with `headers`.
async fn learnt(addr: std::net::SocketAddr, headers: &[(&str, &str)]) -> Fields {
    let mut req = Request::get(format!("http://{addr}/r"));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let a = client::send(&client::http1(), req.body(body(Bytes::new())).unwrap()).await;
    assert_eq!(a.status, 200, "{addr}: {:?}", a.body);
    let seen = a.json()["headers"].clone();
    let told = [
        "x-grpc-reply",
        "x-grpc-status",
        "x-grpc-error",
        "x-grpc-refused",
        "x-grpc-cancelled",
    ];
    told.iter()
        .filter_map(|h| Some((h.to_string(), seen[*h].as_str()?.to_owned())))
        .collect()
}

/// Envoy with the `proxy-wasm-grpc` filter, and a policy directory for
/// Portcullis with it, both routing to `app`, with the gRPC service
/// `service` as cluster or upstream `name` (HTTP/2); Portcullis also has
/// it as `{name}1`, over HTTP/1.1.
pub(super) async fn both_on(
    app: &Upstream,
    name: &str,
    service: &Upstream,
) -> (crate::support::envoy::Envoy, tempfile::TempDir) {
    let filter = plugin_file("proxy-wasm-grpc");
    let clusters = [("app", app.addr), (name, service.addr)];
    let envoy = crate::support::envoy::Envoy::with_clusters_h2(&filter, "", &clusters).await;
    let dir = policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: app, endpoints: ["{}"] }}
  - {{ name: {name}, endpoints: ["{}"], http2: true }}
  - {{ name: {name}1, endpoints: ["{}"] }}
plugins: [{{ name: pw, path: proxy-wasm-grpc.wasm }}]
routes: [{{ name: g, match: {{ path_prefix: / }}, upstream: app, plugins: [{{ use: pw }}] }}]
"#,
            app.url(),
            service.url(),
            service.url()
        ),
        &["proxy-wasm-grpc"],
    );
    (envoy, dir)
}

#[tokio::test]
pub(super) async fn a_filters_grpc_calls_end_as_in_envoy() {
    let app = upstream::echo("app").await;
    let (service, mut seen) = echo_service().await;
    let (envoy, dir) = both_on(&app, "echo", &service).await;
    let proxy = Proxy::start_dir(dir, &[]).await;
    let call = |method: &'static str| vec![("x-grpc-call", "echo"), ("x-grpc-method", method)];
    let pair = |k: &str, v: &str| (k.to_owned(), v.to_owned());
    let failed = |code: &str, message: &str| {
        vec![pair("x-grpc-status", code), pair("x-grpc-error", message)]
    };
    // What the filter learns of each call. Envoy gives the same but for
    // the messages of failed calls, which it hands over as they came,
    // percent-encoded against the gRPC spec, with its own response
    // details appended (`no%20way{via_upstream}`); Portcullis decodes
    // them, and says what happened where Envoy gives only a detail.
    let cases: [(Vec<(&str, &str)>, Fields); 6] = [
        (
            call("test.Echo/Say"),
            vec![pair("x-grpc-reply", "hi hello")],
        ),
        (call("test.Echo/Deny"), failed("7", "no way: not you")),
        // An unknown cluster is the ABI's ParseFailure, as in Envoy.
        (
            vec![("x-grpc-call", "nowhere")],
            vec![pair("x-grpc-refused", "ParseFailure")],
        ),
        (
            [call("test.Echo/Say"), vec![("x-grpc-cancel", "1")]].concat(),
            vec![pair("x-grpc-cancelled", "yes")],
        ),
        // HTTP 404 is UNIMPLEMENTED, by gRPC's HTTP mapping.
        (
            call("test.Echo/Missing"),
            failed("12", "upstream answered HTTP 404"),
        ),
        // The call's own timeout: Envoy's router answers 504 for it,
        // which is UNAVAILABLE (14), not DEADLINE_EXCEEDED.
        (
            [call("test.Echo/Hang"), vec![("x-grpc-timeout-ms", "300")]].concat(),
            failed("14", "upstream request timeout"),
        ),
    ];
    let but_messages = |fields: &Fields| -> Fields {
        let kept = fields.iter().filter(|(k, _)| k != "x-grpc-error");
        kept.cloned().collect()
    };
    for (headers, expected) in &cases {
        let theirs = learnt(envoy.addr, headers).await;
        let ours = learnt(proxy.addr, headers).await;
        assert_eq!(&ours, expected, "{headers:?}; Envoy's: {theirs:?}");
        assert_eq!(but_messages(&ours), but_messages(&theirs), "{headers:?}");
    }
    // gRPC needs HTTP/2: over an upstream without `http2: true` the call
    // fails at once, saying so (Envoy has no such upstream to compare).
    let over_h1 = learnt(proxy.addr, &[("x-grpc-call", "echo1")]).await;
    let why = "upstream `echo1` speaks HTTP/1.1; a gRPC call needs `http2: true` on it";
    assert_eq!(over_h1, failed("14", why));
    // The service was sent the same by both: one HTTP/2 POST per call
    // (none for the unknown cluster), framed, with the filter's metadata
    // and a deadline; the call cancelled at once may have gone or not.
    let mut sent = std::collections::BTreeMap::<String, usize>::new();
    while let Ok(line) = seen.try_recv() {
        *sent.entry(line).or_default() += 1;
    }
    let line = |method: &str| {
        format!(
            r#"HTTP/2.0 POST /test.Echo/{method} application/grpc te=trailers x-from=filter deadline=true body=b"\0\0\0\0\x05hello""#
        )
    };
    assert_eq!(sent.len(), 4, "{sent:#?}");
    for method in ["Deny", "Missing", "Hang"] {
        assert_eq!(sent.get(&line(method)), Some(&2), "{method}: {sent:#?}");
    }
    let said = sent.get(&line("Say")).copied().unwrap_or(0);
    assert!((2..=4).contains(&said), "{sent:#?}");
}
