//! Higress's Redis calls (`proxy_redis_init`, `proxy_redis_call`,
//! `proxy_on_redis_call_response`), as Higress's filters make them, to the
//! state store a real `redis-server` is: a request that waits on its
//! filter's Redis command, and what comes back (Envoy has no such calls
//! to compare with; Higress's wasm-go SDK defines them).

use super::*;
use crate::support::redis::Redis;

/// What the filter told the upstream of a request with `x-redis: command`.
async fn told(addr: std::net::SocketAddr, command: &str) -> (String, String) {
    let req = Request::get(format!("http://{addr}/r")).header("x-redis", command);
    let a = client::send(&client::http1(), req.body(body(Bytes::new())).unwrap()).await;
    assert_eq!(a.status, 200, "{command}: {:?}", a.body);
    let seen = a.json()["headers"].clone();
    let field = |name: &str| seen[name].as_str().unwrap_or_default().to_owned();
    (field("x-redis-reply"), field("x-redis-status"))
}

fn policy(app: &Upstream) -> tempfile::TempDir {
    policy_dir(
        &format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams: [{{ name: app, endpoints: ["{}"] }}]
plugins: [{{ name: redis, path: proxy-wasm-redis.wasm }}]
routes: [{{ name: r, match: {{ path_prefix: / }}, upstream: app, plugins: [{{ use: redis }}] }}]
"#,
            app.url()
        ),
        &["proxy-wasm-redis"],
    )
}

#[tokio::test]
pub(super) async fn a_filters_redis_calls_reach_the_state_store() {
    let redis = Redis::start().await;
    let app = upstream::echo("app").await;
    let dir = policy(&app);
    let proxy = ProxyProcess::start_on(dir.path(), &["--state", &redis.url]).await;
    // The store's connection comes up as the proxy starts; nothing says
    // when but an answer.
    let started = Instant::now();
    while told(proxy.addr, "PING").await.0 != "+PONG\\r\\n" {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "no PONG in 10 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let reply = |s: &str| (s.to_owned(), String::new());
    assert_eq!(told(proxy.addr, "INCR hits").await, reply(":1\\r\\n"));
    assert_eq!(told(proxy.addr, "INCR hits").await, reply(":2\\r\\n"));
    assert_eq!(told(proxy.addr, "SET k v").await, reply("+OK\\r\\n"));
    assert_eq!(told(proxy.addr, "GET k").await, reply("$1\\r\\nv\\r\\n"));
    assert_eq!(told(proxy.addr, "GET none").await, reply("$-1\\r\\n"));
    assert_eq!(
        told(proxy.addr, "MGET k none").await,
        reply("*2\\r\\n$1\\r\\nv\\r\\n$-1\\r\\n")
    );
    // An error reply is Redis's answer, as it sent it.
    let (error, _) = told(proxy.addr, "NOSUCHCOMMAND x").await;
    assert!(error.starts_with("-ERR unknown command"), "{error}");
    // Redis itself has what the filter wrote.
    let mut conn = redis.connection().await;
    let hits: i64 = redis::cmd("GET")
        .arg("hits")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert_eq!(hits, 2);
}

/// Without a state store the call fails (status 1 in the callback) and
/// the filter goes on as it chooses; the proxy says why in its log.
#[tokio::test]
pub(super) async fn a_redis_call_with_no_state_store_fails_to_the_filter() {
    let app = upstream::echo("app").await;
    let dir = policy(&app);
    let mut proxy = ProxyProcess::start_on(dir.path(), &[]).await;
    assert_eq!(
        told(proxy.addr, "INCR hits").await,
        (String::new(), "1".to_owned())
    );
    // Its log is read as it comes: wait for the line.
    let line = proxy.wait_for_log("a plugin's Redis call failed").await;
    assert!(line.contains("serve --state redis://"), "{line}");
}
