//! Higress's prebuilt filters (PyPI `gpustack-higress-plugins` 0.5.1),
//! one in Go (`transformer`, wasm-go) and one in Rust (`ai-data-masking`),
//! side by side in Envoy 1.40 and in Portcullis: the same module, config
//! and requests, compared on what the client got (status, headers, body)
//! and what the upstream saw. Envoy refuses Higress's ABI marker
//! (`proxy_abi_version_0_2_100`), so its copy carries ABI 0.2.1's; the
//! rest of the module is the same bytes.

use std::collections::BTreeMap;

use super::third_party::higress_plugin;
use super::*;
use crate::support::envoy::{Envoy, renamed_marker};

/// One request of a case.
struct Ask {
    method: &'static str,
    path: &'static str,
    headers: &'static [(&'static str, &'static str)],
    body: &'static str,
}

/// What came of one request through one proxy, without what each proxy
/// adds of its own (its request id, forwarding headers, dates).
#[derive(Debug, PartialEq)]
struct Seen {
    status: u16,
    headers: BTreeMap<String, String>,
    /// The upstream's account of the request (method, path, headers and
    /// body digest) when it got there; the local answer's body otherwise.
    body: serde_json::Value,
}

/// Request headers one of the two proxies adds whatever the filter does.
const PROXIES_OWN_REQUEST_HEADERS: &[&str] = &[
    "x-request-id",
    "x-forwarded-proto",
    "x-forwarded-for",
    "x-forwarded-host",
    "x-envoy-expected-rq-timeout-ms",
    "forwarded",
    "via",
];

/// Response headers one of the two proxies adds or frames differently.
const PROXIES_OWN_RESPONSE_HEADERS: &[&str] = &[
    "date",
    "server",
    "via",
    "x-envoy-upstream-service-time",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
];

/// `asks` through `filter` configured with `config`, in Envoy and in
/// Portcullis (no settings but the config), in order: each side's
/// [`Seen`].
async fn side_by_side(
    filter: (&str, &str),
    config: &serde_json::Value,
    asks: &[Ask],
) -> Vec<(Seen, Seen)> {
    side_by_side_and_ours(filter, config, asks, &[]).await.0
}

/// [`side_by_side`], then `ours_only` through Portcullis alone: requests
/// Envoy 1.40 never answers (see
/// [`higress_data_masking_denies_and_masks_as_its_readme_says`]).
async fn side_by_side_and_ours(
    filter: (&str, &str),
    config: &serde_json::Value,
    asks: &[Ask],
    ours_only: &[Ask],
) -> (Vec<(Seen, Seen)>, Vec<Seen>) {
    let app = upstream::echo("app").await;
    let dir = tempfile::tempdir().unwrap();
    let module = higress_plugin(filter.0, filter.1);
    std::fs::copy(&module, dir.path().join("filter.wasm")).unwrap();
    let envoys = renamed_marker(
        &module,
        dir.path(),
        "proxy_abi_version_0_2_100",
        "proxy_abi_version_0_2_1",
    );
    let envoy = Envoy::with_filter(&envoys, &config.to_string(), app.addr).await;
    // JSON is YAML: the config goes in as Envoy got it. The client's
    // Host goes on, as from Envoy. The start budget is raised: these
    // tests compare answers, and a debug build on two loaded cores took
    // over the default 1 s of CPU to configure ai-data-masking (starting
    // with no settings is `third_party::higress_filters_start_with_no_settings_or_say_why_they_do_not`'s).
    let yaml = format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"], preserve_host: true }}]
plugins: [{{ name: filter, path: filter.wasm }}]
routes:
  - {{ name: app, match: {{ path_prefix: / }}, upstream: app, plugins: [{{ use: filter, start_timeout: 10s, config: {config} }}] }}
"#,
        app.url()
    );
    std::fs::write(dir.path().join("policy.yaml"), yaml).unwrap();
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let mut seen = Vec::new();
    for ask in asks {
        let theirs = through(envoy.addr, ask).await;
        let ours = through(proxy.addr, ask).await;
        seen.push((ours, theirs));
    }
    let mut ours = Vec::new();
    for ask in ours_only {
        ours.push(through(proxy.addr, ask).await);
    }
    (seen, ours)
}

/// `ask` sent to a proxy at `addr`, and what came of it.
async fn through(addr: std::net::SocketAddr, ask: &Ask) -> Seen {
    let mut req = Request::builder()
        .method(ask.method)
        .uri(format!("http://{addr}{}", ask.path));
    for (k, v) in ask.headers {
        req = req.header(*k, *v);
    }
    // One Host for both (else each proxy's own port).
    if !ask.headers.iter().any(|(k, _)| *k == "host") {
        req = req.header("host", "app.example");
    }
    let req = req.body(body(Bytes::from_static(ask.body.as_bytes())));
    let answer = client::send(&client::http1(), req.unwrap()).await;
    let mut headers = BTreeMap::new();
    for (k, v) in &answer.headers {
        if PROXIES_OWN_RESPONSE_HEADERS.contains(&k.as_str()) {
            continue;
        }
        let v = String::from_utf8_lossy(v.as_bytes()).into_owned();
        headers
            .entry(k.as_str().to_owned())
            .and_modify(|all: &mut String| *all = format!("{all}, {v}"))
            .or_insert(v);
    }
    let body = match serde_json::from_slice::<serde_json::Value>(&answer.body) {
        Ok(mut echo) if echo.get("upstream").is_some() => {
            // Not the filter's doing: how each proxy reached the upstream.
            for own in ["peer", "version", "target"] {
                echo.as_object_mut().unwrap().remove(own);
            }
            let seen = echo["headers"].as_object_mut().unwrap();
            seen.retain(|k, _| !PROXIES_OWN_REQUEST_HEADERS.contains(&k.as_str()));
            echo
        }
        _ => serde_json::Value::String(String::from_utf8_lossy(&answer.body).into_owned()),
    };
    Seen {
        status: answer.status.as_u16(),
        headers,
        body,
    }
}

/// Higress's `transformer` (Go) on headers and query parameters of the
/// request, and headers of the response, by its README's rules: the
/// same request and response in both, and the rules did apply.
#[tokio::test]
pub(super) async fn higress_transformer_rewrites_headers_and_query_as_in_envoy() {
    let config = serde_json::json!({
        "reqRules": [
            {"operate": "remove", "headers": [{"key": "X-remove"}], "querys": [{"key": "k1"}]},
            {"operate": "rename", "headers": [{"oldKey": "X-not-renamed", "newKey": "X-renamed"}],
             "querys": [{"oldKey": "k2", "newKey": "k2-new"}]},
            {"operate": "replace", "headers": [{"key": "X-replace", "newValue": "replaced"}],
             "querys": [{"key": "k4", "newValue": "v4-new"}]},
            {"operate": "add", "headers": [{"key": "X-add-append", "value": "host-$1", "host_pattern": "^(.*)\\.com$"}],
             "querys": [{"key": "k3", "value": "v31"}]},
            {"operate": "append", "headers": [{"key": "X-add-append", "appendValue": "path-$1", "path_pattern": "^.*?\\/(\\w+)[\\?]{0,1}.*$"}]},
            {"operate": "map", "headers": [{"fromKey": "X-add-append", "toKey": "X-map"}]},
            {"operate": "dedupe", "headers": [{"key": "X-dedupe-first", "strategy": "RETAIN_FIRST"},
                                              {"key": "X-dedupe-last", "strategy": "RETAIN_LAST"}]}
        ],
        "respRules": [
            {"operate": "add", "headers": [{"key": "X-resp-added", "value": "yes"}]},
            {"operate": "rename", "headers": [{"oldKey": "content-type", "newKey": "X-was-content-type"}]}
        ]
    });
    let asks = [
        Ask {
            method: "GET",
            path: "/get?k1=v1&k2=v2&k4=v4&kept=yes",
            headers: &[
                ("host", "foo.bar.com"),
                ("x-remove", "exist"),
                ("x-not-renamed", "test"),
                ("x-replace", "not-replaced"),
                ("x-dedupe-first", "1"),
                ("x-dedupe-first", "2"),
                ("x-dedupe-last", "a"),
                ("x-dedupe-last", "b"),
            ],
            body: "",
        },
        // None of the rules' headers: only the additions apply.
        Ask {
            method: "POST",
            path: "/post",
            headers: &[("host", "plain.example"), ("content-type", "text/plain")],
            body: "untouched",
        },
    ];
    let seen = side_by_side(("transformer", "2.0.0"), &config, &asks).await;
    for (ask, (ours, theirs)) in asks.iter().zip(&seen) {
        assert_eq!(ours, theirs, "{} {}", ask.method, ask.path);
    }
    // Both did what the rules say, not merely the same.
    let (first, _) = &seen[0];
    let upstream = &first.body;
    assert_eq!(
        upstream["path"], "/get?k2-new=v2&k3=v31&k4=v4-new&kept=yes",
        "{upstream:#}"
    );
    assert_eq!(upstream["headers"]["x-map"], "host-foo.bar, path-get");
    assert_eq!(upstream["headers"]["x-renamed"], "test");
    assert_eq!(upstream["headers"]["x-dedupe-last"], "b");
    assert!(upstream["headers"].get("x-remove").is_none());
    assert_eq!(first.headers["x-resp-added"], "yes", "{first:#?}");
    assert_eq!(first.headers["x-was-content-type"], "application/json");
    assert!(!first.headers.contains_key("content-type"));
}

/// Higress's `transformer` on a JSON request body (it pauses the head,
/// reads the body whole, rewrites it): the same body reaches the
/// upstream from both, changed as the rules say.
#[tokio::test]
pub(super) async fn higress_transformer_rewrites_a_json_body_as_in_envoy() {
    let config = serde_json::json!({
        "reqRules": [
            {"operate": "remove", "body": [{"key": "gone"}]},
            {"operate": "add", "body": [{"key": "added", "value": "yes"}]}
        ]
    });
    let asks = [
        Ask {
            method: "POST",
            path: "/json",
            headers: &[("content-type", "application/json")],
            body: r#"{"gone":1,"kept":2}"#,
        },
        // Not JSON: the body rules leave it alone.
        Ask {
            method: "POST",
            path: "/text",
            headers: &[("content-type", "text/plain")],
            body: "gone",
        },
    ];
    let seen = side_by_side(("transformer", "2.0.0"), &config, &asks).await;
    for (ask, (ours, theirs)) in asks.iter().zip(&seen) {
        assert_eq!(ours, theirs, "{} {}", ask.method, ask.path);
    }
    // Re-serialized, indented as Go's json.MarshalIndent does.
    let changed = &seen[0].0.body;
    let expected = "{\n  \"kept\": 2,\n  \"added\": \"yes\"\n}\n";
    assert_eq!(
        changed["body_fnv"],
        upstream::fnv(expected.as_bytes()),
        "{changed:#}"
    );
    assert_eq!(seen[1].0.body["body_fnv"], upstream::fnv(b"gone"));
}

/// Higress's `ai-data-masking` (Rust, Higress's fork of the proxy-wasm
/// Rust SDK; ~200 ms and more than 96 MiB to start) by its
/// README: a raw body with a denied word is answered by the filter with
/// its message; an OpenAI request's e-mail address is masked before the
/// upstream sees it (`$domain` in the config is the filter's own
/// reference, passed as written); a request without a body passes.
///
/// Envoy is not the reference for requests with a body here: the filter
/// pauses the head to read the body (`HeaderStopIteration`), which
/// proxy-wasm-cpp-host turns into `StopAllIterationAndWatermark`, so
/// Envoy 1.40 never calls it with the body and never answers (checked:
/// no answer in 10 s, for a denied body and a fine one alike). Higress's
/// Envoy, which the filter is built for, answers as its README says, and
/// so does Portcullis; Envoy is compared on what it does answer.
#[tokio::test]
pub(super) async fn higress_data_masking_denies_and_masks_as_its_readme_says() {
    let config = serde_json::json!({
        "deny_openai": true,
        "deny_raw": true,
        "system_deny": false,
        "deny_words": ["forbidden"],
        "deny_code": 403,
        "deny_raw_message": "{\"errmsg\":\"denied\"}",
        "replace_roles": [
            {"regex": "%{EMAILLOCALPART}@%{HOSTNAME:domain}", "type": "replace", "value": "****@$domain"}
        ]
    });
    let bodiless = [Ask {
        method: "GET",
        path: "/models",
        headers: &[],
        body: "",
    }];
    let with_bodies = [
        Ask {
            method: "POST",
            path: "/raw",
            headers: &[("content-type", "text/plain")],
            body: "a forbidden word",
        },
        Ask {
            method: "POST",
            path: "/v1/chat/completions",
            headers: &[("content-type", "application/json")],
            body: r#"{"model":"m","messages":[{"role":"user","content":"mail bob@example.com"}]}"#,
        },
        Ask {
            method: "POST",
            path: "/raw",
            headers: &[("content-type", "text/plain")],
            body: "a fine word",
        },
    ];
    let filter = ("ai-data-masking", "2.0.3");
    let (seen, ours) = side_by_side_and_ours(filter, &config, &bodiless, &with_bodies).await;
    let (passed, theirs) = &seen[0];
    assert_eq!(passed, theirs);
    assert_eq!(passed.body["path"], "/models", "{passed:#?}");
    let (denied, masked, fine) = (&ours[0], &ours[1], &ours[2]);
    assert_eq!(denied.status, 403, "{denied:#?}");
    assert_eq!(denied.body, r#"{"errmsg":"denied"}"#);
    // Re-serialized by serde_json, keys sorted.
    let expected =
        r#"{"messages":[{"content":"mail ****@example.com","role":"user"}],"model":"m"}"#;
    assert_eq!(
        masked.body["body_fnv"],
        upstream::fnv(expected.as_bytes()),
        "{masked:#?}"
    );
    assert_eq!(
        fine.body["body_fnv"],
        upstream::fnv(b"a fine word"),
        "{fine:#?}"
    );
}
