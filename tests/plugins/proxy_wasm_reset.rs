//! A filter that resets its request (`proxy_close_stream`), in
//! Portcullis as in Envoy 1.40: the client gets no answer at all (an
//! HTTP/1.1 connection closes with nothing sent; an HTTP/2 stream is
//! reset, its connection serving on), and the access log says 444.

use super::*;

/// What an HTTP/1.1 client reading to the end gets for a request with
/// `x-reset: how`.
async fn raw_answer(addr: std::net::SocketAddr, how: &str) -> String {
    let raw = format!("GET /r HTTP/1.1\r\nhost: app\r\nx-reset: {how}\r\n\r\n");
    client::raw_until_closed(addr, raw.as_bytes()).await
}

/// An h2c request with `x-reset: how` on `h2`'s connection: its status,
/// or the error it ended with.
async fn h2_answer(
    h2: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        client::ReqBody,
    >,
    addr: std::net::SocketAddr,
    how: &str,
) -> Result<u16, String> {
    let req = Request::get(format!("http://{addr}/r"))
        .header("x-reset", how)
        .body(body(Bytes::new()))
        .unwrap();
    let sent = tokio::time::timeout(Duration::from_secs(10), h2.request(req)).await;
    match sent.expect("an answer or a reset within 10 s") {
        Ok(resp) => Ok(resp.status().as_u16()),
        Err(e) => Err(format!("{e:?}")),
    }
}

#[tokio::test]
pub(super) async fn a_filter_resets_its_request_as_in_envoy() {
    let (app, hits) = upstream::counted_echo("app").await;
    let filter = plugin_file("proxy-wasm-headers");
    let envoy = crate::support::envoy::Envoy::with_filter(&filter, "t", app.addr).await;
    let dir = super::proxy_wasm::headers_filter_everywhere(&app);
    let log = dir.path().join("access.log");
    let proxy =
        ProxyProcess::start_on(dir.path(), &["--access-log", &log.display().to_string()]).await;
    for addr in [envoy.addr, proxy.addr] {
        let before = hits.load(Ordering::SeqCst);
        // Reset before the upstream: nothing sent, nothing forwarded.
        assert_eq!(raw_answer(addr, "request").await, "", "{addr}");
        assert_eq!(hits.load(Ordering::SeqCst), before, "{addr}");
        // Reset on the response head: forwarded, and nothing answered.
        assert_eq!(raw_answer(addr, "response").await, "", "{addr}");
        assert_eq!(hits.load(Ordering::SeqCst), before + 1, "{addr}");
        // Over HTTP/2 only the stream goes; the connection serves on.
        let h2 = client::h2c();
        let reset = h2_answer(&h2, addr, "request").await;
        assert!(reset.is_err(), "{addr}: {reset:?}");
        assert_eq!(h2_answer(&h2, addr, "no").await, Ok(200), "{addr}");
    }
    // Logged as nginx logs a connection closed unanswered (the workers
    // write their lines out in batches; nothing signals one).
    let started = Instant::now();
    let resets = loop {
        let lines = std::fs::read_to_string(&log).unwrap_or_default();
        let resets: Vec<String> = lines
            .lines()
            .filter(|l| l.contains("\"status\":444"))
            .map(str::to_owned)
            .collect();
        if resets.len() >= 3 || started.elapsed() > Duration::from_secs(10) {
            break resets;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(resets.len(), 3, "{resets:#?}");
    drop(proxy);
}
