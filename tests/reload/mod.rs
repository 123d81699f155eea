//! Hot reload: the kubelet's ConfigMap swap, plugin module changes, reload
//! under load, rejected updates, SIGHUP, secrets by file, listeners coming
//! and going. All against the real binary.

mod rejected;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper::{Request, Response};

use crate::support::client::{self, body};
use crate::support::configmap::ConfigMap;
use crate::support::plugin_file;
use crate::support::process::ProxyProcess;
use crate::support::upstream::{self, RespBody};

/// Waits until GET `url` answers `want`, failing after `limit`; returns how
/// long it took.
async fn served_within(url: &str, want: &str, limit: Duration) -> Duration {
    let start = Instant::now();
    loop {
        let answer = client::get(url).await;
        if answer.body == want.as_bytes() {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < limit,
            "{url} still answers {:?} {:?} after {limit:?}, want {want:?}",
            answer.status,
            String::from_utf8_lossy(&answer.body)
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

fn answering(body: &str) -> String {
    format!(
        r#"
listeners: [{{ name: main, bind: "127.0.0.1:0" }}]
routes:
  - {{ name: v, match: {{ path: /v }}, respond: {{ status: 200, body: "{body}" }} }}
"#
    )
}

#[tokio::test]
async fn kubelet_swaps_are_served_within_a_second_each_time() {
    let mut map = ConfigMap::new(&[("routing.yaml", answering("v0").as_bytes())]);
    let proxy = ProxyProcess::start_on(map.path(), &[]).await;
    assert_eq!(client::get(&proxy.url("/v")).await.body, "v0");
    for n in 1..=5 {
        let want = format!("v{n}");
        // A second key arrives and leaves along the way, as keys do.
        let extra = "routes: [{ name: other, match: { path: /other }, respond: { status: 200 } }]";
        let mut files = vec![("routing.yaml", answering(&want).into_bytes())];
        if n % 2 == 1 {
            files.push(("extra.yaml", extra.as_bytes().to_vec()));
        }
        let files: Vec<(&str, &[u8])> = files.iter().map(|(k, v)| (*k, v.as_slice())).collect();
        map.update(&files);
        served_within(&proxy.url("/v"), &want, Duration::from_secs(1)).await;
        let other = client::get(&proxy.url("/other")).await.status;
        assert_eq!(other, if n % 2 == 1 { 200 } else { 404 }, "swap {n}");
    }
    let status = proxy.status().await;
    assert_eq!(status["config"]["generation"], 6, "{status:#}");
    assert_eq!(status["reloads"]["applied"], 5, "{status:#}");
    assert!(status["last_error"].is_null(), "{status:#}");
}

#[tokio::test]
async fn kubelet_swap_of_a_plugin_module_is_applied() {
    let yaml = r#"
listeners: [{ name: main, bind: "127.0.0.1:0" }]
plugins: [{ name: gate, path: gate.wasm }]
routes:
  - name: v
    match: { path: /v }
    respond: { status: 200, body: "through" }
    plugins: [{ use: gate, config: { header: x-key } }]
"#;
    let trap = std::fs::read(plugin_file("fixture-trap")).unwrap();
    let require = std::fs::read(plugin_file("example-require-header")).unwrap();
    let mut map = ConfigMap::new(&[("routing.yaml", yaml.as_bytes()), ("gate.wasm", &trap)]);
    let proxy = ProxyProcess::start_on(map.path(), &[]).await;
    let url = proxy.url("/v");
    let plain = || client::get(&url);
    // The trapping plugin fails closed.
    assert_eq!(plain().await.status, 500);
    // Each swap waits for its reload to be applied, then the module it
    // brought must answer at once: a compile takes longer on a loaded
    // machine, and its time is the benchmarks' (bench/reload.sh), not a
    // test's.
    let applied = |n: u64| {
        let proxy = &proxy;
        async move {
            let what = format!("{n} reloads applied");
            proxy
                .wait_status(&what, |s| s["reloads"]["applied"] == n)
                .await;
        }
    };
    for round in 0..3u64 {
        // Only the module changes; the policy text stays the same.
        map.update(&[("routing.yaml", yaml.as_bytes()), ("gate.wasm", &require)]);
        applied(2 * round + 1).await;
        assert_eq!(
            plain().await.status,
            403,
            "round {round}: new module not served"
        );
        let keyed = Request::get(proxy.url("/v"))
            .header("x-key", "1")
            .body(body(Bytes::new()))
            .unwrap();
        assert_eq!(client::send(&client::http1(), keyed).await.body, "through");
        map.update(&[("routing.yaml", yaml.as_bytes()), ("gate.wasm", &trap)]);
        applied(2 * round + 2).await;
        assert_eq!(
            plain().await.status,
            500,
            "round {round}: old module back not served"
        );
    }
    let status = proxy.status().await;
    assert_eq!(status["reloads"]["applied"], 6, "{status:#}");
}

/// An upstream that streams `x-version` back in ten chunks over about
/// 200 ms, so responses are still running while configurations change.
async fn slow_streamer() -> upstream::Upstream {
    upstream::serve(|req: Request<hyper::body::Incoming>| async move {
        let version = req
            .headers()
            .get("x-version")
            .map(|v| v.to_str().unwrap_or("?").to_owned())
            .unwrap_or_else(|| "none".into());
        let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::io::Error>>(1);
        tokio::spawn(async move {
            for i in 0..10 {
                let chunk = Bytes::from(format!("{version}:{i};"));
                if tx.send(Ok(Frame::data(chunk))).await.is_err() {
                    return;
                }
                // The upstream's own pace, not a wait for anything.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        let mut rx = rx;
        let stream = futures_util::stream::poll_fn(move |cx| rx.poll_recv(cx));
        Response::new(BodyExt::boxed(StreamBody::new(stream)) as RespBody)
    })
    .await
}

fn versioned(version: &str, streamer: &str) -> String {
    format!(
        r#"
listeners: [{{ name: main, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: slow, endpoints: ["{streamer}"] }}]
routes:
  - {{ name: "x-{version}", match: {{ path: /x }}, respond: {{ status: 200, body: "{version}" }} }}
  - name: "stream-{version}"
    match: {{ path: /stream }}
    upstream: slow
    request_headers: {{ set: {{ x-version: "{version}" }} }}
"#
    )
}

/// What the load clients saw.
#[derive(Default)]
struct Tally {
    ok: AtomicUsize,
    failures: std::sync::Mutex<Vec<String>>,
}

impl Tally {
    fn fail(&self, what: String) {
        self.failures.lock().unwrap().push(what);
    }
}

fn check_plain(tally: &Tally, result: Result<(u16, Bytes), String>) {
    match result {
        Ok((200, b)) if b == "A" || b == "B" => {
            tally.ok.fetch_add(1, Ordering::Relaxed);
        }
        Ok((status, b)) => tally.fail(format!("/x answered {status} {b:?}")),
        Err(e) => tally.fail(format!("/x failed: {e}")),
    }
}

fn check_stream(tally: &Tally, result: Result<(u16, Bytes), String>) {
    match result {
        Ok((200, b)) => {
            let text = String::from_utf8_lossy(&b);
            // One version from start to end: the configuration the request
            // started on.
            let whole = ["A", "B"]
                .iter()
                .any(|v| text == (0..10).map(|i| format!("{v}:{i};")).collect::<String>());
            if whole {
                tally.ok.fetch_add(1, Ordering::Relaxed);
            } else {
                tally.fail(format!("/stream answered {text:?}"));
            }
        }
        Ok((status, b)) => tally.fail(format!("/stream answered {status} {b:?}")),
        Err(e) => tally.fail(format!("/stream failed: {e}")),
    }
}

async fn fetch(
    client: &hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        client::ReqBody,
    >,
    url: &str,
) -> Result<(u16, Bytes), String> {
    let req = Request::get(url).body(body(Bytes::new())).unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
        .await
        .map_err(|_| "no answer in 10 s".to_owned())?
        .map_err(|e| format!("{e:?}"))?;
    let status = resp.status().as_u16();
    let body = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("body: {e:?}"))?
        .to_bytes();
    Ok((status, body))
}

#[tokio::test]
async fn a_hundred_reloads_under_load_fail_no_request() {
    let streamer = slow_streamer().await;
    let a = versioned("A", &streamer.url());
    let b = versioned("B", &streamer.url());
    let mut map = ConfigMap::new(&[("routing.yaml", a.as_bytes())]);
    // A short debounce keeps 100 swaps quick; what is tested is the swap.
    let proxy = ProxyProcess::start_on(map.path(), &["--watch-debounce", "10ms"]).await;
    let tally = Arc::new(Tally::default());
    let stop = Arc::new(AtomicBool::new(false));
    let mut clients = Vec::new();
    // Keep-alive clients: new configurations must reach requests on
    // connections opened before them.
    for _ in 0..3 {
        let (url, tally, stop) = (proxy.url("/x"), tally.clone(), stop.clone());
        clients.push(tokio::spawn(async move {
            let c = client::http1();
            while !stop.load(Ordering::Relaxed) {
                check_plain(&tally, fetch(&c, &url).await);
            }
        }));
    }
    // Fresh connections each time.
    for _ in 0..2 {
        let (url, tally, stop) = (proxy.url("/x"), tally.clone(), stop.clone());
        clients.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                check_plain(&tally, fetch(&client::http1(), &url).await);
            }
        }));
    }
    // Slow streaming responses that span reloads.
    for _ in 0..4 {
        let (url, tally, stop) = (proxy.url("/stream"), tally.clone(), stop.clone());
        clients.push(tokio::spawn(async move {
            let c = client::http1();
            while !stop.load(Ordering::Relaxed) {
                check_stream(&tally, fetch(&c, &url).await);
            }
        }));
    }
    let mut proxy = proxy;
    for n in 1..=100u64 {
        let next = if n % 2 == 1 { &b } else { &a };
        map.update(&[("routing.yaml", next.as_bytes())]);
        // The reload's own signal: its log line.
        let line = proxy.wait_for_log("configuration applied").await;
        assert!(
            line.contains(&format!("\"generation\":{}", n + 1)),
            "{line}"
        );
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    let failures = tally.failures.lock().unwrap().clone();
    eprintln!(
        "{} requests answered across 100 reloads",
        tally.ok.load(Ordering::Relaxed)
    );
    assert!(
        failures.is_empty(),
        "{} of {} requests failed, first: {:?}",
        failures.len(),
        failures.len() + tally.ok.load(Ordering::Relaxed),
        &failures[..failures.len().min(5)]
    );
    assert!(
        tally.ok.load(Ordering::Relaxed) > 100,
        "too little load to mean anything"
    );
    let status = proxy.status().await;
    assert_eq!(status["reloads"]["applied"], 100, "{status:#}");
    assert_eq!(status["reloads"]["rejected"], 0, "{status:#}");
}

#[tokio::test]
async fn sighup_reloads_when_watching_is_off() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("routing.yaml");
    std::fs::write(&file, answering("before")).unwrap();
    let mut proxy =
        ProxyProcess::start_on(dir.path(), &["--watch", "false", "--watch-poll", "0s"]).await;
    std::fs::write(&file, answering("after")).unwrap();
    // Nothing reloads by itself; the file is already complete on disk.
    assert_eq!(client::get(&proxy.url("/v")).await.body, "before");
    proxy.signal("HUP");
    let line = proxy.wait_for_log("configuration applied").await;
    assert!(line.contains("\"trigger\":\"signal\""), "{line}");
    assert_eq!(client::get(&proxy.url("/v")).await.body, "after");
    // The admin endpoint reloads on demand too, and says when nothing changed.
    let req = Request::post(proxy.admin_url("/reload"))
        .body(body(Bytes::new()))
        .unwrap();
    let answer = client::send(&client::http1(), req).await;
    assert_eq!(answer.status, 200);
    assert_eq!(answer.json()["result"], "unchanged");
    // A GET does not reload: 405 says which method does.
    let answer = client::get(&proxy.admin_url("/reload")).await;
    assert_eq!(answer.status, 405);
    assert_eq!(answer.header("allow"), Some("POST"));
    let req = Request::head(proxy.admin_url("/status"))
        .body(body(Bytes::new()))
        .unwrap();
    assert_eq!(client::send(&client::http1(), req).await.status, 200);
    std::fs::write(&file, "routes: [ oops").unwrap();
    let req = Request::post(proxy.admin_url("/reload"))
        .body(body(Bytes::new()))
        .unwrap();
    let answer = client::send(&client::http1(), req).await;
    assert_eq!(answer.status, 422);
    assert!(
        answer.json()["errors"][0]
            .as_str()
            .unwrap()
            .contains("routing.yaml:")
    );
    assert_eq!(client::get(&proxy.url("/v")).await.body, "after");
}

#[tokio::test]
async fn a_secret_file_mounted_elsewhere_reloads_the_plugin_config() {
    let events = upstream::echo("events").await;
    let yaml = format!(
        r#"
listeners: [{{ name: main, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: events, endpoints: ["{}"] }}]
plugins: [{{ name: sig, path: sig.wasm }}]
routes:
  - name: hook
    match: {{ path: /hook }}
    upstream: events
    plugins: [{{ use: sig, config: {{ provider: gitlab, secret: {{ from_file: ../secret/token }} }} }}]
"#,
        events.url()
    );
    // The policies and the Secret are two volumes, as in a pod.
    let root = tempfile::tempdir().unwrap();
    let policies = root.path().join("policies");
    let secret = root.path().join("secret");
    std::fs::create_dir_all(&policies).unwrap();
    std::fs::create_dir_all(&secret).unwrap();
    std::fs::write(policies.join("routing.yaml"), yaml).unwrap();
    std::fs::copy(plugin_file("webhook-signature"), policies.join("sig.wasm")).unwrap();
    std::fs::write(secret.join("token"), "first\n").unwrap();
    let proxy = ProxyProcess::start_on(&policies, &[]).await;
    let hook = |token: &'static str| {
        let req = Request::post(proxy.url("/hook"))
            .header("x-gitlab-token", token)
            .body(body("{}"))
            .unwrap();
        async move { client::send(&client::http1(), req).await.status }
    };
    assert_eq!(hook("first").await, 200);
    // The Secret rotates: written aside, then renamed into place.
    std::fs::write(secret.join(".token.new"), "second\n").unwrap();
    std::fs::rename(secret.join(".token.new"), secret.join("token")).unwrap();
    let start = Instant::now();
    while hook("second").await != 200 {
        assert!(
            start.elapsed() < Duration::from_secs(1),
            "rotated secret not applied"
        );
    }
    assert_eq!(hook("first").await, 401);
}

#[tokio::test]
async fn listeners_come_and_go_without_touching_the_others() {
    let one = answering("hi");
    let two = one.replace(
        "listeners: [{ name: main, bind: \"127.0.0.1:0\" }]",
        "listeners: [{ name: main, bind: \"127.0.0.1:0\" }, { name: extra, bind: \"127.0.0.1:0\" }]",
    );
    let mut map = ConfigMap::new(&[("routing.yaml", one.as_bytes())]);
    let mut proxy = ProxyProcess::start_on(map.path(), &[]).await;
    // One keep-alive connection on the first listener throughout.
    let keep = client::http1();
    let get = |url: String| {
        let keep = keep.clone();
        async move {
            let req = Request::get(url).body(body(Bytes::new())).unwrap();
            client::send(&keep, req).await
        }
    };
    let peer_before = get(proxy.url("/v")).await;
    assert_eq!(peer_before.body, "hi");

    map.update(&[("routing.yaml", two.as_bytes())]);
    proxy.wait_for_log("configuration applied").await;
    let status = proxy.status().await;
    let listeners = status["config"]["listeners"].as_array().unwrap().clone();
    assert_eq!(listeners.len(), 2, "{status:#}");
    let extra = listeners
        .iter()
        .find(|l| l["name"] == "extra")
        .and_then(|l| l["addr"].as_str())
        .unwrap()
        .to_owned();
    let main = listeners.iter().find(|l| l["name"] == "main").unwrap();
    assert_eq!(
        main["addr"],
        proxy.addr.to_string(),
        "main was not re-bound"
    );
    assert_eq!(client::get(&format!("http://{extra}/v")).await.body, "hi");
    assert_eq!(get(proxy.url("/v")).await.body, "hi");

    map.update(&[("routing.yaml", one.as_bytes())]);
    proxy.wait_for_log("configuration applied").await;
    let refused = tokio::net::TcpStream::connect(&extra).await;
    assert!(refused.is_err(), "extra listener still accepts");
    assert_eq!(get(proxy.url("/v")).await.body, "hi");
    let status = proxy.status().await;
    assert_eq!(status["config"]["listeners"].as_array().unwrap().len(), 1);
    // The keep-alive connection stayed open through both reloads.
    assert_eq!(
        status["config"]["listeners"][0]["connections"], 1,
        "{status:#}"
    );
}

#[tokio::test]
async fn unchanged_upstreams_keep_their_pooled_connections() {
    let echo = upstream::echo("e").await;
    let policy = |body: &str, retries: u32| {
        format!(
            r#"
listeners: [{{ name: main, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: e, endpoints: ["{}"], retries: {retries} }}]
routes:
  - {{ name: v, match: {{ path: /v }}, respond: {{ status: 200, body: "{body}" }} }}
  - {{ name: e, match: {{ path: /e }}, upstream: e }}
"#,
            echo.url()
        )
    };
    let mut map = ConfigMap::new(&[("routing.yaml", policy("one", 0).as_bytes())]);
    // One worker: one pool per upstream, whichever connection asks.
    let proxy = ProxyProcess::start_on(map.path(), &["--workers", "1"]).await;
    let peer = || async {
        client::get(&proxy.url("/e")).await.json()["peer"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let first = peer().await;
    assert_eq!(peer().await, first, "no keep-alive to the upstream");

    // A change elsewhere keeps the upstream's warm connection.
    map.update(&[("routing.yaml", policy("two", 0).as_bytes())]);
    served_within(&proxy.url("/v"), "two", Duration::from_secs(1)).await;
    assert_eq!(peer().await, first, "the reload dropped the upstream pool");

    // A change to the upstream itself starts a new pool.
    map.update(&[("routing.yaml", policy("three", 1).as_bytes())]);
    served_within(&proxy.url("/v"), "three", Duration::from_secs(1)).await;
    assert_ne!(peer().await, first, "a changed upstream kept its old pool");
}

/// A reload keeps a route's rate-limit counts when its limit is
/// unchanged: an edit elsewhere in the ConfigMap gives no limited client
/// a fresh burst, as nginx keeps its zones. A changed limit starts afresh.
#[tokio::test]
async fn rate_limit_counts_survive_a_reload_unless_the_limit_changes() {
    let policy = |other: &str, rate: &str| {
        format!(
            r#"
listeners: [{{ name: main, bind: "127.0.0.1:0" }}]
routes:
  - {{ name: v, match: {{ path: /v }}, respond: {{ status: 200, body: "{other}" }} }}
  - {{ name: hooks, match: {{ path: /hooks }}, respond: {{ status: 200, body: ok }}, rate_limit: {{ rate: {rate} }} }}
"#
        )
    };
    let mut map = ConfigMap::new(&[("routing.yaml", policy("one", "1/h").as_bytes())]);
    let proxy = ProxyProcess::start_on(map.path(), &[]).await;
    let hooks = || async { client::get(&proxy.url("/hooks")).await.status.as_u16() };
    let status = proxy.status().await;
    assert_eq!(
        status["config"]["rate_limits"],
        serde_json::json!([{ "route": "hooks", "rate": "1/h", "burst": 0, "key": "client", "shared": false }]),
        "{status:#}"
    );
    assert_eq!(hooks().await, 200);
    assert_eq!(hooks().await, 429);

    map.update(&[("routing.yaml", policy("two", "1/h").as_bytes())]);
    served_within(&proxy.url("/v"), "two", Duration::from_secs(1)).await;
    assert_eq!(hooks().await, 429, "the reload reset an unchanged limit");

    map.update(&[("routing.yaml", policy("three", "2/h").as_bytes())]);
    served_within(&proxy.url("/v"), "three", Duration::from_secs(1)).await;
    assert_eq!(hooks().await, 200, "a changed limit kept the old counts");
}

/// Rotating a listener's session ticket key, or its client CA, is a
/// change: the files' contents are in the config's fingerprint, so the
/// reload that the Secret's swap triggers applies it, rather than
/// finding the policy text unchanged.
#[tokio::test]
async fn a_rotated_ticket_key_or_client_ca_is_applied() {
    let pki = crate::support::tls::TestPki::new();
    let other = crate::support::tls::TestPki::new();
    let policy = r#"
listeners:
  - name: https
    bind: "127.0.0.1:0"
    tls: { cert: tls.crt, key: tls.key, client_ca: ca.crt, session_ticket_keys: [ticket.key] }
routes: [{ name: v, match: { path: /v }, respond: { status: 200, body: ok } }]
"#;
    // The whole set each time, as kubelet swaps a mounted ConfigMap.
    let files = |ca: &str, ticket: u8| -> Vec<(String, Vec<u8>)> {
        vec![
            ("routing.yaml".into(), policy.into()),
            ("tls.crt".into(), pki.leaf_pem.clone().into()),
            ("tls.key".into(), pki.leaf_key_pem.clone().into()),
            ("ca.crt".into(), ca.into()),
            ("ticket.key".into(), vec![ticket; 48]),
        ]
    };
    let first = files(&pki.ca_pem, 1);
    let mut map = ConfigMap::new(&borrowed(&first));
    let proxy = ProxyProcess::start_on(map.path(), &[]).await;
    map.update(&borrowed(&files(&pki.ca_pem, 2)));
    proxy
        .wait_status("the new ticket key applied", |s| {
            s["config"]["generation"] == 2
        })
        .await;
    map.update(&borrowed(&files(&other.ca_pem, 2)));
    proxy
        .wait_status("the new client CA applied", |s| {
            s["config"]["generation"] == 3
        })
        .await;
}

/// Owned ConfigMap files as [`ConfigMap`] takes them.
fn borrowed(set: &[(String, Vec<u8>)]) -> Vec<(&str, &[u8])> {
    set.iter()
        .map(|(n, b)| (n.as_str(), b.as_slice()))
        .collect()
}
