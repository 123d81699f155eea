//! Nothing a plugin, a policy, a log pipe or a peer does can desync,
//! freeze or starve other traffic: each test here is one way it used to,
//! against the real binary, real plugins and real peers (nginx as a
//! callout's target, a pipe nobody reads). The registry's and the peer
//! port's are with the tunnel's tests (`tunnel/registry.rs`,
//! `tunnel/peers.rs`), the kernel files' with the reload's.

use std::time::Duration;

use bytes::Bytes;
use hyper::Request;

use crate::support::client::{self, Answer, body};
use crate::support::process::ProxyProcess;
use crate::support::upstream;
use crate::support::{assert_check_errors, policy_dir};

mod admin_token;
mod callouts;
mod framing;
mod local_answers;
mod logs;
mod plugin_shares;

/// One answer as read off an HTTP/1.1 connection: status, head and body,
/// framed by its own head (`Content-Length`, or chunks).
#[derive(Debug)]
pub(super) struct Framed {
    pub status: u16,
    pub head: String,
    pub body: Vec<u8>,
}

/// Splits what came back on one connection into its answers, each framed
/// by its own head; panics (with all of it) where an answer does not
/// start where the one before it ended.
pub(super) fn framed_answers(raw: &[u8]) -> Vec<Framed> {
    let all = String::from_utf8_lossy(raw).into_owned();
    let mut rest = raw;
    let mut out = Vec::new();
    while !rest.is_empty() {
        let end = rest
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap_or_else(|| panic!("an answer's head does not end: {all:?}"));
        let head = String::from_utf8_lossy(&rest[..end]).into_owned();
        assert!(
            head.starts_with("HTTP/1.1 "),
            "an answer starts mid-way (another's bytes): {head:?} in {all:?}"
        );
        let status = head[9..12].parse().expect("a status");
        let field = |name: &str| -> Vec<String> {
            head.lines()
                .filter_map(|l| l.split_once(':'))
                .filter(|(k, _)| k.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.trim().to_owned())
                .collect()
        };
        let lengths = field("content-length");
        let chunked = field("transfer-encoding")
            .iter()
            .any(|v| v.eq_ignore_ascii_case("chunked"));
        assert!(
            lengths.len() <= 1 && !(chunked && !lengths.is_empty()),
            "an answer framed two ways: {head:?}"
        );
        rest = &rest[end + 4..];
        let body = if chunked {
            let mut body = Vec::new();
            loop {
                let line = rest
                    .windows(2)
                    .position(|w| w == b"\r\n")
                    .expect("a chunk size");
                let size = std::str::from_utf8(&rest[..line]).expect("ascii");
                let size = usize::from_str_radix(size.trim(), 16).expect("a chunk size");
                rest = &rest[line + 2..];
                if size == 0 {
                    rest = &rest[2..];
                    break body;
                }
                body.extend_from_slice(&rest[..size]);
                rest = &rest[size + 2..];
            }
        } else {
            let n: usize = lengths.first().map_or(0, |l| l.parse().expect("a length"));
            assert!(
                rest.len() >= n,
                "an answer shorter than its length: {all:?}"
            );
            let body = rest[..n].to_vec();
            rest = &rest[n..];
            body
        };
        out.push(Framed { status, head, body });
    }
    out
}

/// Sends `requests` pipelined on one connection (the last one asking to
/// close) and reads every answer until the proxy closes (10 s at most).
pub(super) async fn pipelined(addr: std::net::SocketAddr, requests: &[&str]) -> Vec<Framed> {
    let mut raw = String::new();
    for (i, r) in requests.iter().enumerate() {
        let close = if i + 1 == requests.len() {
            "connection: close\r\n"
        } else {
            ""
        };
        raw.push_str(&format!("{r}host: example.com\r\n{close}\r\n"));
    }
    let answer = client::raw(addr, raw.as_bytes()).await;
    framed_answers(answer.as_bytes())
}

/// A plugin's counter `name`, from a `/metrics` scrape.
pub(super) fn plugin_counter(metrics: &str, plugin: &str, name: &str) -> u64 {
    let prefix = format!("portcullis_plugin_counter_total{{plugin=\"{plugin}\",name=\"{name}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map_or(0, |v| v.parse().expect("a count"))
}

/// `/metrics` of `proxy`, scraped now.
pub(super) async fn metrics(proxy: &ProxyProcess) -> String {
    let answer = client::get(&proxy.admin_url("/metrics")).await;
    String::from_utf8_lossy(&answer.body).into_owned()
}

/// A GET of `url` with the `x-misbehave` header (and `extra` ones).
pub(super) async fn misbehaving(url: String, how: &str, extra: &[(&str, &str)]) -> Answer {
    let mut req = Request::get(url).header("x-misbehave", how);
    for (k, v) in extra {
        req = req.header(*k, *v);
    }
    client::send(&client::http1(), req.body(body(Bytes::new())).unwrap()).await
}

/// Polls `check` every 10 ms until it holds, for at most `limit`.
pub(super) async fn eventually<F, Fut>(what: &str, limit: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    while !check().await {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
