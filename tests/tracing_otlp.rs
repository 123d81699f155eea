//! The policies' `tracing`: W3C trace context to the upstreams, and a
//! span per sampled request to an OpenTelemetry collector (OTLP/HTTP,
//! JSON), here a loopback server that keeps what it is sent.

use std::time::Duration;

use http_body_util::BodyExt;
use hyper::{Request, Response};
use serde_json::Value;
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};

use crate::support::client;
use crate::support::process::ProxyProcess;
use crate::support::upstream::{self, Upstream, full};
use crate::support::{Proxy, assert_check_errors};

const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

/// A collector that answers every export 200 and passes on each span it
/// got, with the request's path and content type, and the resource.
pub(crate) async fn collector() -> (Upstream, UnboundedReceiver<(Value, Value)>) {
    let (tx, spans) = unbounded_channel();
    let server = upstream::serve(move |req: Request<hyper::body::Incoming>| {
        let tx = tx.clone();
        async move {
            let path = req.uri().path().to_owned();
            let content_type = req.headers()["content-type"].to_str().unwrap().to_owned();
            let body = req.into_body().collect().await.unwrap().to_bytes();
            let export: Value = serde_json::from_slice(&body).expect("the export is JSON");
            let resource = &export["resourceSpans"][0];
            let spans = resource["scopeSpans"][0]["spans"]
                .as_array()
                .expect("spans");
            for span in spans {
                let seen = serde_json::json!({
                    "path": path,
                    "content_type": content_type,
                    "service": resource["resource"]["attributes"][0]["value"]["stringValue"],
                    "scope": resource["scopeSpans"][0]["scope"]["name"],
                });
                let _ = tx.send((seen, span.clone()));
            }
            Response::new(full("{}"))
        }
    })
    .await;
    (server, spans)
}

pub(crate) async fn next_span(spans: &mut UnboundedReceiver<(Value, Value)>) -> (Value, Value) {
    tokio::time::timeout(Duration::from_secs(10), spans.recv())
        .await
        .expect("a span reached the collector")
        .expect("the collector runs")
}

/// A span's attributes as a map of key to value (strings and numbers
/// as OTLP's JSON writes them).
fn attributes(span: &Value) -> serde_json::Map<String, Value> {
    span["attributes"]
        .as_array()
        .expect("attributes")
        .iter()
        .map(|a| {
            let value = &a["value"];
            let v = value
                .get("stringValue")
                .or_else(|| value.get("intValue"))
                .cloned()
                .expect("a string or int value");
            (a["key"].as_str().unwrap().to_owned(), v)
        })
        .collect()
}

/// The trace id, span id and flags of a `traceparent` the upstream got.
fn traceparent(answer: &client::Answer) -> (String, String, String) {
    let tp = answer.json()["headers"]["traceparent"]
        .as_str()
        .expect("the upstream got a traceparent")
        .to_owned();
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!((parts.len(), parts[0]), (4, "00"), "{tp}");
    (parts[1].into(), parts[2].into(), parts[3].into())
}

async fn get_with(url: String, headers: &[(&str, String)]) -> client::Answer {
    let mut req = Request::get(url);
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    client::send(&client::http1(), req.body(client::body("")).unwrap()).await
}

fn policy(collector: &Upstream, app: &Upstream, tracing: &str) -> String {
    format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0", trust_forwarded_headers: true }}]
upstreams:
  - {{ name: collector, endpoints: ["{}"] }}
  - {{ name: app, endpoints: ["{}"] }}
  - {{ name: gone, endpoints: ["http://127.0.0.1:{}"] }}
routes:
  - {{ name: app, match: {{ path_prefix: /app }}, upstream: app }}
  - {{ name: gone, match: {{ path_prefix: /gone }}, upstream: gone }}
  - {{ name: healthz, match: {{ path: /healthz }}, health: live, access_log: errors }}
tracing: {tracing}
"#,
        collector.url(),
        app.url(),
        crate::support::closed_port(),
    )
}

#[tokio::test]
async fn upstreams_join_the_callers_trace_and_spans_reach_the_collector() {
    let (collector, mut spans) = collector().await;
    let app = upstream::echo("app").await;
    let yaml = policy(
        &collector,
        &app,
        "{ upstream: collector, service_name: edge, flush_every: 50ms }",
    );
    let mut proxy = ProxyProcess::start(&yaml, &["--workers", "2"]).await;

    // A sampled caller: the upstream's parent is our span, in its trace.
    let sampled = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
    let a = get_with(
        proxy.url("/app/orders?page=2"),
        &[
            ("traceparent", sampled),
            ("tracestate", "vendor=x".into()),
            ("x-request-id", "req-1".into()),
            ("x-forwarded-for", "203.0.113.7".into()),
        ],
    )
    .await;
    assert_eq!(a.status, 200);
    let (trace, our_span, flags) = traceparent(&a);
    assert_eq!((trace.as_str(), flags.as_str()), (CALLER_TRACE, "01"));
    assert_ne!(our_span, CALLER_SPAN);
    assert_eq!(a.json()["headers"]["tracestate"], "vendor=x");

    let (seen, span) = next_span(&mut spans).await;
    assert_eq!(seen["path"], "/v1/traces");
    assert_eq!(seen["content_type"], "application/json");
    assert_eq!(
        (&seen["service"], &seen["scope"]),
        (&"edge".into(), &"portcullis".into())
    );
    assert_eq!(span["traceId"], CALLER_TRACE);
    assert_eq!(span["spanId"], our_span.as_str());
    assert_eq!(span["parentSpanId"], CALLER_SPAN);
    assert_eq!(
        (&span["name"], &span["kind"]),
        (&"GET app".into(), &2.into())
    );
    let start: u64 = span["startTimeUnixNano"].as_str().unwrap().parse().unwrap();
    let end: u64 = span["endTimeUnixNano"].as_str().unwrap().parse().unwrap();
    assert!(start > 0 && start <= end, "{start}..{end}");
    let attrs = attributes(&span);
    for (key, want) in [
        ("http.request.method", "GET"),
        ("url.path", "/app/orders"),
        ("url.scheme", "http"),
        ("server.address", "127.0.0.1"),
        // Behind a trusted proxy: the client it names; the socket's peer
        // is the proxy.
        ("client.address", "203.0.113.7"),
        ("network.peer.address", "127.0.0.1"),
        ("network.protocol.version", "1.1"),
        ("http.response.status_code", "200"),
        ("portcullis.route", "app"),
        ("portcullis.upstream", "app"),
        ("portcullis.endpoint", &app.addr.to_string()),
        ("portcullis.request_id", "req-1"),
    ] {
        assert_eq!(attrs.get(key), Some(&Value::from(want)), "{key} in {span}");
    }
    assert!(span.get("status").is_none(), "a 200 is no error: {span}");
    // The access line names the trace, to go from a log to its trace.
    let line = proxy.wait_for_log("req-1").await;
    assert!(
        line.contains(&format!(r#""trace_id":"{CALLER_TRACE}""#)),
        "{line}"
    );

    // No traceparent: a trace of our own (100% sampled by default), ours
    // the root span.
    let b = client::get(&proxy.url("/app/new")).await;
    let (trace, our_span, flags) = traceparent(&b);
    assert_eq!(flags, "01");
    let (_, span) = next_span(&mut spans).await;
    assert_eq!(
        (&span["traceId"], &span["spanId"]),
        (&trace.into(), &our_span.into())
    );
    assert!(span.get("parentSpanId").is_none(), "{span}");

    // A caller that does not sample: the trace goes on, unrecorded.
    let unsampled = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-00");
    let c = get_with(proxy.url("/app/quiet"), &[("traceparent", unsampled)]).await;
    assert_eq!(traceparent(&c).2, "00");

    // A health probe: its route logs only errors, and records no span
    // of a success either.
    assert_eq!(client::get(&proxy.url("/healthz")).await.status, 200);

    // An upstream that cannot be reached: the span says it failed.
    let d = client::get(&proxy.url("/gone")).await;
    assert_eq!(d.status, 502);
    let (_, span) = next_span(&mut spans).await;
    assert_eq!(span["status"]["code"], 2, "{span}");
    let attrs = attributes(&span);
    assert_eq!(attrs["error.type"], "502");
    assert_eq!(attrs["portcullis.route"], "gone");

    // The unsampled request and the health probe made no span: three
    // were exported.
    proxy
        .metrics_showing(&[r#"portcullis_trace_spans_total{outcome="exported"} 3"#.into()])
        .await;
    assert!(spans.try_recv().is_err(), "no other span was sent");
}

#[tokio::test]
async fn the_last_spans_go_out_when_the_proxy_stops() {
    let (collector, mut spans) = collector().await;
    let app = upstream::echo("app").await;
    // Nothing goes out on a timer, and no new trace is sampled.
    let yaml = policy(
        &collector,
        &app,
        "{ upstream: collector, flush_every: 1h, sample_percent: 0 }",
    );
    let mut proxy = ProxyProcess::start(&yaml, &["--workers", "2"]).await;

    let a = client::get(&proxy.url("/app/unsampled")).await;
    let (_, _, flags) = traceparent(&a);
    assert_eq!(flags, "00", "0% samples no new trace");
    let sampled = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
    let b = get_with(proxy.url("/app/sampled"), &[("traceparent", sampled)]).await;
    let (_, our_span, _) = traceparent(&b);
    proxy
        .metrics_showing(&[r#"portcullis_trace_spans_total{outcome="exported"} 0"#.into()])
        .await;

    proxy.signal("TERM");
    assert!(proxy.wait_exit(Duration::from_secs(20)).await.success());
    let (_, span) = next_span(&mut spans).await;
    assert_eq!(span["spanId"], our_span.as_str());
    assert_eq!(attributes(&span)["url.path"], "/app/sampled");
    assert!(spans.try_recv().is_err(), "one span only");
}

#[tokio::test]
async fn a_collector_away_costs_spans_not_requests() {
    let app = upstream::echo("app").await;
    let yaml = format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - {{ name: collector, endpoints: ["http://127.0.0.1:{}"] }}
  - {{ name: app, endpoints: ["{}"] }}
routes:
  - {{ name: app, match: {{ path_prefix: /app }}, upstream: app }}
tracing: {{ upstream: collector, flush_every: 20ms }}
"#,
        crate::support::closed_port(),
        app.url(),
    );
    let mut proxy = ProxyProcess::start(&yaml, &[]).await;
    for _ in 0..3 {
        let a = client::get(&proxy.url("/app")).await;
        assert_eq!(a.status, 200);
        assert_eq!(traceparent(&a).2, "01");
    }
    proxy.wait_for_log("spans not exported").await;
    proxy
        .metrics_showing(&[
            r#"portcullis_trace_spans_total{outcome="failed"} 3"#.into(),
            r#"portcullis_trace_spans_total{outcome="exported"} 0"#.into(),
        ])
        .await;
    // One warning for the outage, not one per batch.
    for _ in 0..3 {
        assert_eq!(client::get(&proxy.url("/app")).await.status, 200);
    }
    proxy
        .metrics_showing(&[r#"portcullis_trace_spans_total{outcome="failed"} 6"#.into()])
        .await;
    assert_eq!(proxy.count_logs("spans not exported"), 1);
}

#[test]
fn check_names_bad_tracing() {
    let head = r#"
upstreams:
  - { name: per-host, url: "http://{h}.svc" }
  - { name: collector, endpoints: ["http://127.0.0.1:4318"] }
"#;
    assert_check_errors(
        &format!("{head}tracing: {{ upstream: nowhere }}\n"),
        &[(5, "unknown upstream `nowhere`")],
    );
    assert_check_errors(
        &format!("{head}tracing: {{ upstream: per-host }}\n"),
        &[(5, "tracing needs an upstream with `endpoints`")],
    );
    assert_check_errors(
        &format!(
            "{head}tracing:\n  upstream: collector\n  sample_percent: 101\n  flush_every: 0s\n  path: v1/traces\n"
        ),
        &[
            (7, "sample_percent `101` is not a share from 0 to 100"),
            (8, "flush_every 0s"),
            (9, "tracing path `v1/traces` does not start with `/`"),
        ],
    );
    assert_check_errors(
        &format!("{head}tracing: {{ upstream: collector, sampling: 5 }}\n"),
        &[(5, "unknown field `sampling`")],
    );
}

#[tokio::test]
async fn a_reload_changes_or_ends_tracing() {
    let (collector, mut spans) = collector().await;
    let app = upstream::echo("app").await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("policy.yaml");
    let write = |tracing: &str| {
        let yaml = policy(&collector, &app, tracing);
        // Without the section at all when `tracing` is empty.
        let yaml = yaml.replace("tracing: \n", "");
        std::fs::write(&file, yaml).unwrap();
    };
    let reload = async |proxy: &ProxyProcess| {
        let req = Request::post(proxy.admin_url("/reload"))
            .body(client::body(""))
            .unwrap();
        let answer = client::send(&client::http1(), req).await;
        assert_eq!(answer.json()["result"], "applied", "{:?}", answer.body);
    };
    write("{ upstream: collector, service_name: before, flush_every: 20ms }");
    let proxy = ProxyProcess::start_on(dir.path(), &["--watch", "false"]).await;
    assert_eq!(traceparent(&client::get(&proxy.url("/app")).await).2, "01");
    assert_eq!(next_span(&mut spans).await.0["service"], "before");

    // New settings: the next spans carry them, and new traces go unsampled.
    write("{ upstream: collector, service_name: after, flush_every: 20ms, sample_percent: 0 }");
    reload(&proxy).await;
    assert_eq!(traceparent(&client::get(&proxy.url("/app")).await).2, "00");
    let sampled = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
    get_with(proxy.url("/app"), &[("traceparent", sampled.clone())]).await;
    let (seen, span) = next_span(&mut spans).await;
    assert_eq!(
        (&seen["service"], &span["traceId"]),
        (&"after".into(), &CALLER_TRACE.into())
    );

    // Without `tracing`, the caller's traceparent passes as it came.
    write("");
    reload(&proxy).await;
    let a = get_with(proxy.url("/app"), &[("traceparent", sampled.clone())]).await;
    assert_eq!(a.json()["headers"]["traceparent"], sampled.as_str());
    let b = client::get(&proxy.url("/app")).await;
    assert!(
        b.json()["headers"].get("traceparent").is_none(),
        "{:?}",
        b.body
    );
}

#[tokio::test]
async fn the_default_policies_trace_when_an_otlp_endpoint_is_set() {
    let (collector, mut spans) = collector().await;
    let app = upstream::echo("app-proxy").await;
    let proxy = Proxy::start_default(&[
        ("APP_PROXY_URL", app.url()),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url()),
        ("OTEL_SERVICE_NAME", "runtime-routing".into()),
        ("OTEL_BSP_SCHEDULE_DELAY", "20".into()),
    ])
    .await;
    let a = client::get(&proxy.url("/app-proxy/api/version")).await;
    let (trace, our_span, _) = traceparent(&a);
    let (seen, span) = next_span(&mut spans).await;
    assert_eq!(
        (&seen["service"], &seen["path"]),
        (&"runtime-routing".into(), &"/v1/traces".into())
    );
    assert_eq!(
        (&span["traceId"], &span["spanId"]),
        (&trace.into(), &our_span.into())
    );
    assert_eq!(span["name"], "GET app-proxy");
}

#[tokio::test]
async fn an_untrusted_callers_trace_is_not_joined() {
    let (collector, _spans) = collector().await;
    let app = upstream::echo("app").await;
    let yaml = policy(
        &collector,
        &app,
        "{ upstream: collector, trust_incoming: false, sample_percent: 0 }",
    );
    let proxy = Proxy::start_yaml(&yaml).await;
    let sampled = format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01");
    let a = get_with(
        proxy.url("/app"),
        &[("traceparent", sampled), ("tracestate", "vendor=x".into())],
    )
    .await;
    // A trace of our own, unsampled (0%): the caller's flag decides nothing.
    let (trace, _, flags) = traceparent(&a);
    assert_ne!(trace, CALLER_TRACE);
    assert_eq!(flags, "00");
    assert!(
        a.json()["headers"].get("tracestate").is_none(),
        "{:?}",
        a.body
    );
}
