//! Plugin rollouts (`rollout:`): a candidate version given a share of
//! requests by a stable key, rolled back by itself when it does worse,
//! promoted when its steps complete; its state kept across reloads that
//! leave it alone.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use super::*;

/// `GET path` from the client address `source` (any of 127/8 is this
/// machine's), on a connection of its own: the status and, for a 200,
/// the `x-version` header the upstream (an echo) saw.
async fn get_from(source: IpAddr, proxy: SocketAddr, path: &str) -> (u16, Option<String>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(source, 0)).unwrap();
    let mut conn = socket.connect(proxy).await.unwrap();
    let head = format!("GET {path} HTTP/1.1\r\nhost: app\r\nconnection: close\r\n\r\n");
    conn.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).await.unwrap();
    let text = String::from_utf8_lossy(&answer);
    let (status, body) = client::status_and_body(&text);
    let version = serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|j| j["headers"]["x-version"].as_str().map(str::to_owned));
    (status, version)
}

/// The `n`th of the distinct client addresses used here.
fn client(n: u32) -> IpAddr {
    IpAddr::V4(Ipv4Addr::from(u32::from(Ipv4Addr::new(127, 1, 0, 1)) + n))
}

/// The rollout of the use of `plugin` on `route`, from `/status`.
async fn rollout_of(proxy: &ProxyProcess, route: &str) -> serde_json::Value {
    let status = proxy.status().await;
    status["config"]["plugin_uses"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["route"] == route)
        .map(|u| u["rollout"].clone())
        .unwrap_or_else(|| panic!("no use on {route}: {status:#}"))
}

fn versions_policy(app: &str, rollout: &str) -> String {
    format!(
        r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{app}"] }}]
plugins:
  - {{ name: hdr, path: header-rules.wasm }}
  - {{ name: hdr-v2, path: header-rules.wasm }}
  - {{ name: gate, path: example-require-header.wasm }}
routes:
  - name: app
    match: {{ path: /app }}
    upstream: app
    plugins:
      - use: hdr
        config: {{ request: {{ set: {{ x-version: v1 }} }} }}
        rollout: {rollout}
"#
    )
}

/// At 20 %, about a fifth of 1,000 clients get the candidate, and each
/// client gets the same version every time; keyed by a header, so does
/// each user.
#[tokio::test]
pub(super) async fn a_rollout_sends_its_share_of_clients_to_the_candidate_each_always_the_same() {
    let app = upstream::echo("app").await;
    let rollout = "{ to: hdr-v2, percent: 20, config: { request: { set: { x-version: v2 } } } }";
    let mut yaml = versions_policy(&app.url(), rollout);
    yaml.push_str(
        r#"  - name: by-user
    match: { path: /by-user }
    upstream: app
    plugins:
      - use: hdr
        config: { request: { set: { x-version: v1 } } }
        rollout: { to: hdr-v2, percent: 20, key: "header:x-user", config: { request: { set: { x-version: v2 } } } }
"#,
    );
    let dir = policy_dir(&yaml, &["header-rules", "example-require-header"]);
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let mut first = Vec::new();
    for n in 0..1000 {
        let (status, version) = get_from(client(n), proxy.addr, "/app").await;
        assert_eq!(status, 200);
        first.push(version.expect("x-version"));
    }
    let candidates = first.iter().filter(|v| *v == "v2").count();
    assert!(
        (150..=250).contains(&candidates),
        "{candidates} of 1,000 clients got the candidate at 20%"
    );
    for n in (0..1000).step_by(7) {
        let (_, again) = get_from(client(n), proxy.addr, "/app").await;
        assert_eq!(
            again.as_deref(),
            Some(first[n as usize].as_str()),
            "client {n}"
        );
    }
    // Keyed by a header: the same user from any address, the same version.
    let mut by_user = Vec::new();
    for user in 0..200 {
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..3 {
            let req = Request::get(proxy.url("/by-user"))
                .header("x-user", format!("user-{user}"))
                .body(body(Bytes::new()))
                .unwrap();
            let a = client::send(&client::http1(), req).await;
            seen.insert(
                a.json()["headers"]["x-version"]
                    .as_str()
                    .unwrap()
                    .to_owned(),
            );
        }
        assert_eq!(seen.len(), 1, "user-{user} saw {seen:?}");
        by_user.extend(seen);
    }
    let candidates = by_user.iter().filter(|v| *v == "v2").count();
    assert!((15..=65).contains(&candidates), "{candidates} of 200 users");

    let r = rollout_of(&proxy, "app").await;
    assert_eq!(
        (&r["state"], &r["percent"]),
        (&serde_json::json!("holding"), &serde_json::json!(20)),
        "{r:#}"
    );
    assert_eq!(r["candidate"], "hdr-v2");
    let served = |version: &str| r["outcomes"][version]["answered"].as_u64().unwrap();
    assert_eq!(served("current") + served("candidate"), 1000 + 143, "{r:#}");
}

/// A candidate that denies every request is rolled back by itself once
/// it has its minimum of requests in the window: every later request
/// goes to the current version. The rollback survives a reload that
/// does not touch the rollout; a change to the rollout starts it again.
#[tokio::test]
pub(super) async fn a_candidate_that_denies_everyone_is_rolled_back_by_itself() {
    let app = upstream::echo("app").await;
    let rollout = "{ to: gate, percent: 50, config: { header: x-api-key }, window: 60s, min_requests: 10, margin: 10 }";
    let dir = policy_dir(
        &versions_policy(&app.url(), rollout),
        &["header-rules", "example-require-header"],
    );
    let file = dir.path().join("policy.yaml");
    let proxy =
        ProxyProcess::start_on(dir.path(), &["--watch", "false", "--watch-poll", "0s"]).await;
    let mut n = 0;
    let mut denied = 0;
    while rollout_of(&proxy, "app").await["state"] != "rolled_back" {
        let (status, _) = get_from(client(n), proxy.addr, "/app").await;
        denied += usize::from(status == 403);
        n += 1;
        assert!(
            n < 200,
            "not rolled back after {n} requests ({denied} denied)"
        );
    }
    // Judged after each of the candidate's answers: rolled back at its
    // tenth denial, in the window.
    assert_eq!(denied, 10, "{n} requests");
    let r = rollout_of(&proxy, "app").await;
    assert_eq!(r["percent"], 0, "{r:#}");
    assert_eq!(r["outcomes"]["candidate"]["denied"], 10, "{r:#}");
    let reason = r["reason"].as_str().unwrap();
    assert!(
        reason.starts_with("`gate` did worse than `hdr`: 10 of 10 requests denied"),
        "{reason}"
    );
    proxy
        .find_log("plugin rollout rolled back: every request goes to the current version")
        .await;
    proxy
        .metrics_showing(&[
            r#"portcullis_plugin_rollout_rolled_back{plugin="hdr",route="app",candidate="gate"} 1"#.into(),
            r#"portcullis_plugin_rollout_percent{plugin="hdr",route="app",candidate="gate"} 0"#.into(),
            r#"portcullis_plugin_rollout_requests_total{plugin="hdr",route="app",candidate="gate",version="candidate",outcome="denied"} 10"#.into(),
        ])
        .await;
    let after_rollback = |from: u32| async move {
        for c in from..from + 100 {
            let (status, version) = get_from(client(c), proxy.addr, "/app").await;
            assert_eq!(
                (status, version.as_deref()),
                (200, Some("v1")),
                "client {c}"
            );
        }
    };
    after_rollback(n).await;
    let reload = || async {
        let req = Request::post(proxy.admin_url("/reload"))
            .body(body(Bytes::new()))
            .unwrap();
        let answer = client::send(&client::http1(), req).await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        answer.json()["result"].as_str().unwrap().to_owned()
    };
    // A reload that leaves the rollout alone leaves it rolled back.
    let mut yaml = versions_policy(&app.url(), rollout);
    yaml.push_str("  - { name: other, match: { path: /other }, respond: { status: 204 } }\n");
    std::fs::write(&file, &yaml).unwrap();
    assert_eq!(reload().await, "applied");
    assert_eq!(client::get(&proxy.url("/other")).await.status, 204);
    let r = rollout_of(&proxy, "app").await;
    assert_eq!(
        (&r["state"], &r["percent"]),
        (&serde_json::json!("rolled_back"), &serde_json::json!(0)),
        "{r:#}"
    );
    after_rollback(n + 100).await;
    assert_eq!(
        rollout_of(&proxy, "app").await["outcomes"]["candidate"]["denied"],
        10,
        "no request after the rollback reached the candidate"
    );
    // A change to the rollout is a new one.
    let changed = rollout.replace("percent: 50", "percent: 40");
    std::fs::write(&file, versions_policy(&app.url(), &changed)).unwrap();
    assert_eq!(reload().await, "applied");
    let r = rollout_of(&proxy, "app").await;
    assert_eq!(
        (&r["state"], &r["percent"]),
        (&serde_json::json!("holding"), &serde_json::json!(40)),
        "{r:#}"
    );
    assert_eq!(r["outcomes"]["candidate"]["denied"], 0, "{r:#}");
}

/// Steps are taken one after another, each held for its interval while
/// the candidate does well; after the last (100) the rollout completes
/// and the candidate serves everyone.
#[tokio::test]
pub(super) async fn a_healthy_rollout_takes_its_steps_and_completes() {
    let app = upstream::echo("app").await;
    let rollout = "{ to: hdr-v2, steps: [10, 50, 100], interval: 300ms, config: { request: { set: { x-version: v2 } } } }";
    let dir = policy_dir(
        &versions_policy(&app.url(), rollout),
        &["header-rules", "example-require-header"],
    );
    let proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    let r = rollout_of(&proxy, "app").await;
    assert_eq!(
        (&r["state"], &r["percent"]),
        (&serde_json::json!("rolling"), &serde_json::json!(10)),
        "{r:#}"
    );
    let mut seen = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut n = 0;
    loop {
        // Each step is looked at as requests come (and as /status asks).
        let (status, _) = get_from(client(n), proxy.addr, "/app").await;
        assert_eq!(status, 200);
        n += 1;
        let r = rollout_of(&proxy, "app").await;
        let at = r["percent"].as_u64().unwrap();
        if seen.last() != Some(&at) {
            seen.push(at);
        }
        if r["state"] == "complete" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not complete: {r:#}, saw {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(seen, [10, 50, 100]);
    for c in n..n + 50 {
        let (_, version) = get_from(client(c), proxy.addr, "/app").await;
        assert_eq!(version.as_deref(), Some("v2"), "client {c}");
    }
    proxy
        .find_log("plugin rollout complete: the candidate serves every request")
        .await;
}

/// What `check` says of rollouts written wrong, each at its place.
#[test]
pub(super) fn check_names_each_mistake_in_a_rollout() {
    let yaml = r#"
upstreams: [{ name: app, endpoints: ["http://127.0.0.1:1"] }]
plugins: [{ name: hdr, path: "builtin:header-rules" }, { name: hdr2, path: "builtin:header-rules" }]
routes:
  - { name: a, match: { path: /a }, upstream: app, plugins: [{ use: hdr, rollout: { to: nope, percent: 5 } }] }
  - { name: b, match: { path: /b }, upstream: app, plugins: [{ use: hdr, rollout: { to: hdr, percent: 5 } }] }
  - { name: c, match: { path: /c }, upstream: app, plugins: [{ use: hdr, rollout: { to: hdr2, steps: [5, 50, 25] } }] }
  - { name: d, match: { path: /d }, upstream: app, plugins: [{ use: hdr, rollout: { to: hdr2, percent: 5, steps: [5] } }] }
  - { name: e, match: { path: /e }, upstream: app, plugins: [{ use: hdr, rollout: { to: hdr2, percent: 5, key: "ip" } }] }
  - { name: f, match: { path: /f }, upstream: app, plugins: [{ use: hdr, mode: shadow, rollout: { to: hdr2, percent: 5 } }] }
  - { name: g, match: { path: /g }, upstream: app, plugins: [{ use: hdr, rollout: { to: hdr2 } }] }
"#;
    crate::support::assert_check_errors(
        yaml,
        &[
            (
                5,
                "unknown plugin `nope` to roll out; defined under `plugins:`: hdr, hdr2",
            ),
            (6, "`hdr` is the plugin the use runs already"),
            (7, "rollout steps rise: `25` comes after 50"),
            (
                8,
                "a rollout has `percent` (one share, held) or `steps`, not both",
            ),
            (
                9,
                "`ip` is not a rollout key; use client, header:NAME or cookie:NAME",
            ),
            (10, "a use in `mode: shadow` cannot have a `rollout`"),
            (11, "a rollout needs `percent` (one share, held) or `steps`"),
        ],
    );
}
