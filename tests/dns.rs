//! Hosts with several addresses (a headless Service's pods). With `dns:
//! each_address` each is an endpoint, balanced over and followed as they
//! change; with `dns: connect` new connections take them in turn and
//! pass over the ones that do not answer. The proxy runs as a process that sees the test's files as
//! /etc/hosts, /etc/resolv.conf and /etc/nsswitch.conf (a mount namespace
//! of its own), so the system resolver answers with the addresses the
//! test picks, as cluster DNS would, or fails, or says NXDOMAIN.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::path::Path;

use crate::support::client;
use crate::support::process::{Confine, ProxyProcess};
use crate::support::upstream::{self, Upstream};

/// Echo servers named a, b, c ... on 127.0.0.1, .2, .3 ..., all on one
/// port (as a Service's pods share their target port).
async fn pods(n: u8) -> (u16, Vec<Upstream>) {
    const NAMES: [&str; 4] = ["a", "b", "c", "d"];
    'port: for _ in 0..20 {
        let first = upstream::echo_at(NAMES[0], "127.0.0.1:0".parse().unwrap()).await;
        let port = first.addr.port();
        let mut all = vec![first];
        for i in 1..n {
            let addr = SocketAddr::from(([127, 0, 0, 1 + i], port));
            // The port may be taken on that address: try another one.
            if std::net::TcpListener::bind(addr).is_err() {
                continue 'port;
            }
            all.push(upstream::echo_at(NAMES[usize::from(i)], addr).await);
        }
        return (port, all);
    }
    panic!("no port free on every loopback address");
}

/// Writes /etc/hosts as the proxy sees it, with `pods.test` at `ips`
/// (in place: the proxy's bind mount shows the same file).
fn write_hosts(path: &Path, ips: &[&str]) {
    let mut text = String::from("127.0.0.1 localhost\n");
    for ip in ips {
        text.push_str(&format!("{ip} pods.test\n"));
    }
    std::fs::write(path, text).expect("write hosts");
}

/// Sends `n` requests one after another on one client connection (so one
/// proxy worker takes them all), and tells, per pod that answered, how
/// many it answered, and from which proxy connections (their ports).
async fn spread(
    client: &mut client::Connection,
    proxy: &ProxyProcess,
    port: u16,
    n: usize,
) -> BTreeMap<String, (usize, BTreeSet<u16>)> {
    let mut seen: BTreeMap<String, (usize, BTreeSet<u16>)> = BTreeMap::new();
    for _ in 0..n {
        let req = http::Request::get(proxy.url("/hello"))
            .body(client::body(""))
            .unwrap();
        let answer = client.send(req).await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        let v = answer.json();
        // The pod is named by its host, not by its address: in Host, or
        // in HTTP/2's :authority.
        let named = format!("pods.test:{port}");
        match v["version"].as_str() {
            Some("HTTP/2.0") => assert_eq!(v["target"], format!("http://{named}/hello")),
            _ => assert_eq!(v["headers"]["host"], named),
        }
        let peer: SocketAddr = v["peer"].as_str().unwrap().parse().unwrap();
        let entry = seen
            .entry(v["upstream"].as_str().unwrap().to_owned())
            .or_default();
        entry.0 += 1;
        entry.1.insert(peer.port());
    }
    seen
}

/// How the proxy's resolver answers a name missing from its /etc/hosts.
#[derive(Clone, Copy)]
enum Missing {
    /// It asks DNS, which cannot be reached (a server address where
    /// nothing listens): a failed lookup, as in a DNS outage.
    DnsDown,
    /// /etc/hosts is the only source: the name does not exist, as when
    /// cluster DNS answers NXDOMAIN for a headless Service with no pods.
    NoSuchName,
}

/// Writes the resolver configuration the proxy sees (in place, as
/// [`write_hosts`]); glibc reads both files again when they change.
fn write_resolver(dir: &Path, missing: Missing) {
    let sources = match missing {
        Missing::DnsDown => "hosts: files dns\n",
        Missing::NoSuchName => "hosts: files\n",
    };
    std::fs::write(dir.join("nsswitch.conf"), sources).expect("write nsswitch.conf");
    // Nothing listens on port 53 there: refused at once, no timeout.
    let resolv = "nameserver 127.0.0.254\noptions timeout:1 attempts:1\n";
    std::fs::write(dir.join("resolv.conf"), resolv).expect("write resolv.conf");
}

fn endpoints_gauge(n: usize) -> Vec<String> {
    vec![format!(
        r#"portcullis_upstream_endpoints{{upstream="pods"}} {n}"#
    )]
}

/// The settings of an `each_address` upstream the tests follow closely.
const EACH: &str = "    dns: each_address\n    dns_refresh: 50ms";

/// The proxy, on one route to upstream `pods` (`http://pods.test:PORT`
/// with `settings`), seeing `hosts` as /etc/hosts; started once the
/// upstream lists `n` endpoints.
async fn proxy(dir: &Path, port: u16, settings: &str, n: usize) -> ProxyProcess {
    let policies = dir.join("policies");
    std::fs::create_dir(&policies).unwrap();
    std::fs::write(
        policies.join("policy.yaml"),
        format!(
            r#"
listeners: [{{ name: http, bind: "127.0.0.1:0" }}]
upstreams:
  - name: pods
    endpoints: ["http://pods.test:{port}"]
{settings}
routes:
  - {{ name: all, match: {{ path_prefix: / }}, upstream: pods }}
"#
        ),
    )
    .unwrap();
    let args = ["serve", "--policies", policies.to_str().unwrap()].map(String::from);
    if !dir.join("resolv.conf").exists() {
        write_resolver(dir, Missing::DnsDown);
    }
    let confine = Confine {
        system_files: vec![
            (dir.join("hosts"), "/etc/hosts"),
            (dir.join("resolv.conf"), "/etc/resolv.conf"),
            (dir.join("nsswitch.conf"), "/etc/nsswitch.conf"),
        ],
        ..Confine::default()
    };
    let proxy = ProxyProcess::launch_confined(&args, &[], "listening", confine).await;
    proxy.metrics_showing(&endpoints_gauge(n)).await;
    proxy
}

#[tokio::test]
async fn each_address_of_a_host_is_an_endpoint_followed_as_it_changes() {
    let (port, _pods) = pods(3).await;
    let dir = tempfile::tempdir().unwrap();
    let hosts = dir.path().join("hosts");
    write_hosts(&hosts, &["127.0.0.1", "127.0.0.2", "127.0.0.3"]);
    let mut proxy = proxy(dir.path(), port, EACH, 3).await;
    let mut client = client::Connection::open(proxy.addr).await;

    // Round robin over the three addresses, from the first request on.
    let before = spread(&mut client, &proxy, port, 9).await;
    let counts: Vec<_> = before.iter().map(|(n, (c, _))| (n.as_str(), *c)).collect();
    assert_eq!(counts, [("a", 3), ("b", 3), ("c", 3)]);
    // The access lines say which pod answered each request.
    let line = proxy.wait_for_log(r#""target":"access""#).await;
    let line: serde_json::Value = serde_json::from_str(&line).unwrap();
    let endpoint = line["endpoint"].as_str().unwrap();
    let pods = ["127.0.0.1", "127.0.0.2", "127.0.0.3"].map(|ip| format!("pods.test:{port} ({ip})"));
    assert!(pods.iter().any(|p| p == endpoint), "{line}");
    let status = proxy.status().await;
    let host = format!("pods.test:{port}");
    assert_eq!(
        status["config"]["discovered_endpoints"],
        serde_json::json!([{ "upstream": "pods", "endpoints": [
            format!("{host} (127.0.0.1)"), format!("{host} (127.0.0.2)"), format!("{host} (127.0.0.3)"),
        ]}])
    );

    // A pod goes away: its address leaves the rotation; the others keep
    // the connections they had.
    write_hosts(&hosts, &["127.0.0.1", "127.0.0.2"]);
    proxy.metrics_showing(&endpoints_gauge(2)).await;
    let line = proxy.find_log(r#"removed":"[\"127.0.0.3\"]"#).await;
    assert!(line.contains("upstream host's addresses changed"), "{line}");
    assert!(line.contains(r#""upstreams":"pods""#), "{line}");
    let after = spread(&mut client, &proxy, port, 8).await;
    let counts: Vec<_> = after.iter().map(|(n, (c, _))| (n.as_str(), *c)).collect();
    assert_eq!(counts, [("a", 4), ("b", 4)]);
    for pod in ["a", "b"] {
        assert!(
            after[pod].1.is_subset(&before[pod].1),
            "{pod}: connections {:?} after, {:?} before",
            after[pod].1,
            before[pod].1
        );
    }

    // DNS stops answering for the host: its last addresses are kept.
    write_hosts(&hosts, &[]);
    let line = proxy.wait_for_log("cannot look up an upstream host").await;
    assert!(line.contains("pods.test"), "{line}");
    let during = spread(&mut client, &proxy, port, 4).await;
    assert_eq!(during.keys().collect::<Vec<_>>(), ["a", "b"]);

    // The name stops existing (the Service scaled to zero): its addresses
    // are dropped, and requests get a prompt 502 naming the lookup
    // instead of waiting on pods that are gone.
    write_resolver(dir.path(), Missing::NoSuchName);
    let line = proxy.wait_for_log("upstream host does not resolve").await;
    assert!(line.contains("pods.test"), "{line}");
    assert!(
        line.contains(r#""dropped":"[\"127.0.0.1\", \"127.0.0.2\"]""#),
        "{line}"
    );
    proxy.metrics_showing(&endpoints_gauge(1)).await;
    let gone = client::get(&proxy.url("/hello")).await;
    assert_eq!(gone.status, 502, "{:?}", gone.body);
    assert_eq!(gone.json()["error"], "upstream unreachable");
    // The lookup at connect time failed, not a dial to an old address.
    let line = proxy.wait_for_log("cannot resolve `pods.test`").await;
    assert!(line.contains("no such name"), "{line}");
    // No endpoint answered, and the access line says so. It may come
    // before or after the lookup's warning (two threads write the log),
    // so it is looked for among the lines seen too.
    let answered = r#""status":502"#;
    let line = match proxy.count_logs(answered) {
        0 => proxy.wait_for_log(answered).await,
        _ => proxy.find_log(answered).await,
    };
    let line: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(line["endpoint"], "-", "{line}");
    assert!(line.get("upstream_header_ms").is_none(), "{line}");
    assert_eq!(
        proxy.status().await["config"]["discovered_endpoints"][0]["endpoints"],
        serde_json::json!([format!("pods.test:{port}")])
    );

    // It answers again, with the pod back.
    write_resolver(dir.path(), Missing::DnsDown);
    write_hosts(&hosts, &["127.0.0.3", "127.0.0.1", "127.0.0.2"]);
    proxy.wait_for_log("upstream host resolves again").await;
    proxy.metrics_showing(&endpoints_gauge(3)).await;
    let back = spread(&mut client, &proxy, port, 6).await;
    let counts: Vec<_> = back.iter().map(|(n, (c, _))| (n.as_str(), *c)).collect();
    assert_eq!(counts, [("a", 2), ("b", 2), ("c", 2)]);
}

#[tokio::test]
async fn an_http2_upstream_gets_a_connection_per_address() {
    // The case that needs each_address most: one HTTP/2 connection would
    // carry every request to one pod.
    let (port, _pods) = pods(3).await;
    let dir = tempfile::tempdir().unwrap();
    write_hosts(
        &dir.path().join("hosts"),
        &["127.0.0.1", "127.0.0.2", "127.0.0.3"],
    );
    let proxy = proxy(dir.path(), port, &format!("{EACH}\n    http2: true"), 3).await;
    let mut client = client::Connection::open(proxy.addr).await;
    let seen = spread(&mut client, &proxy, port, 6).await;
    let version = client::get(&proxy.url("/")).await.json()["version"].clone();
    assert_eq!(version, "HTTP/2.0");
    let counts: Vec<_> = seen.iter().map(|(n, (c, _))| (n.as_str(), *c)).collect();
    assert_eq!(counts, [("a", 2), ("b", 2), ("c", 2)]);
    // One multiplexed connection to each pod.
    assert!(seen.values().all(|(_, conns)| conns.len() == 1), "{seen:?}");
}

#[tokio::test]
async fn a_reload_that_adds_each_address_spreads_at_once_and_follows_changes() {
    let (port, _pods) = pods(2).await;
    let dir = tempfile::tempdir().unwrap();
    let hosts = dir.path().join("hosts");
    write_hosts(&hosts, &["127.0.0.1", "127.0.0.2"]);
    // Reloaded to look the host up at connect time: one pod gets all.
    let mut proxy = proxy(dir.path(), port, EACH, 2).await;
    let policy = dir.path().join("policies/policy.yaml");
    let each = std::fs::read_to_string(&policy).unwrap();
    let connect = each.replace("dns: each_address", "dns: connect");
    let connect = connect.replace("dns_refresh: 50ms", "");
    std::fs::write(&policy, &connect).unwrap();
    proxy.signal("HUP");
    proxy.wait_for_log("reload: configuration applied").await;
    let mut client = client::Connection::open(proxy.addr).await;
    let one = spread(&mut client, &proxy, port, 4).await;
    assert_eq!(one.len(), 1, "{one:?}");

    // A reload back to each_address: both pods from its first request.
    std::fs::write(&policy, &each).unwrap();
    proxy.signal("HUP");
    proxy.wait_for_log("reload: configuration applied").await;
    let both = spread(&mut client, &proxy, port, 4).await;
    let counts: Vec<_> = both.iter().map(|(n, (c, _))| (n.as_str(), *c)).collect();
    assert_eq!(counts, [("a", 2), ("b", 2)]);
    // And its host is looked up again from then on.
    write_hosts(&hosts, &["127.0.0.2"]);
    proxy.metrics_showing(&endpoints_gauge(1)).await;
    let left = spread(&mut client, &proxy, port, 2).await;
    assert_eq!(left.keys().collect::<Vec<_>>(), ["b"]);
}

#[tokio::test]
async fn each_address_is_health_checked_on_its_own() {
    let (port, _pods) = pods(1).await;
    // A second pod of the name that fails its health check.
    let sick = SocketAddr::from(([127, 0, 0, 2], port));
    let _sick = upstream::serve_at(
        |req: http::Request<hyper::body::Incoming>| async move {
            let status = if req.uri().path() == "/healthz" {
                503
            } else {
                200
            };
            let mut resp = http::Response::new(upstream::full(r#"{"upstream":"sick"}"#));
            *resp.status_mut() = http::StatusCode::from_u16(status).unwrap();
            resp
        },
        sick,
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    write_hosts(&dir.path().join("hosts"), &["127.0.0.1", "127.0.0.2"]);
    let check =
        "    health_check: { path: /healthz, interval: 100ms, timeout: 100ms, unhealthy_after: 1 }";
    let proxy = proxy(dir.path(), port, &format!("{EACH}\n{check}"), 2).await;
    proxy
        .metrics_showing(&[r#"portcullis_upstream_endpoints_unhealthy{upstream="pods"} 1"#.into()])
        .await;
    let status = proxy.status().await;
    assert_eq!(
        status["config"]["unhealthy_endpoints"],
        serde_json::json!([{ "upstream": "pods", "endpoint": format!("pods.test:{port} (127.0.0.2)") }])
    );
    // The healthy address takes every request.
    let seen = spread(
        &mut client::Connection::open(proxy.addr).await,
        &proxy,
        port,
        4,
    )
    .await;
    assert_eq!(seen.keys().collect::<Vec<_>>(), ["a"]);
}

/// A listener on `addr` that answers no SYN: its accept queue (of one)
/// is full and never accepted from, so the kernel drops new SYNs, as for
/// a pod that is gone.
fn black_hole(addr: SocketAddr) -> (socket2::Socket, std::net::TcpStream) {
    let hole = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    hole.bind(&addr.into()).unwrap();
    hole.listen(0).unwrap();
    let filler = std::net::TcpStream::connect(addr).unwrap();
    (hole, filler)
}

#[tokio::test]
async fn dns_connect_spreads_new_connections_and_passes_over_dead_addresses() {
    let (port, _pods) = pods(2).await;
    let dir = tempfile::tempdir().unwrap();
    let hosts = dir.path().join("hosts");
    // a, b, and an address where nothing listens (refused at once).
    write_hosts(&hosts, &["127.0.0.1", "127.0.0.2", "127.0.0.3"]);
    let _hole = black_hole(SocketAddr::from(([127, 0, 0, 4], port)));
    // A new connection per request, so each request dials; a connect
    // timeout of 2 s gives the first of two addresses 1 s.
    let settings =
        "    dns: connect\n    max_requests_per_connection: 1\n    timeouts: { connect: 2s }";
    let proxy = proxy(dir.path(), port, settings, 1).await;
    let mut client = client::Connection::open(proxy.addr).await;
    let seen = spread(&mut client, &proxy, port, 6).await;
    // Each dial starts one address further: both pods get connections,
    // and the refused address costs nothing but a try.
    assert_eq!(seen.keys().collect::<Vec<_>>(), ["a", "b"], "{seen:?}");
    assert!(seen.values().all(|(n, _)| *n >= 2), "{seen:?}");

    // The first of two addresses drops SYNs: requests that start there
    // wait out its share of the connect timeout and go on to the next,
    // instead of spending all of it and getting a 504.
    write_hosts(&hosts, &["127.0.0.4", "127.0.0.1"]);
    let seen = spread(&mut client, &proxy, port, 2).await;
    assert_eq!(seen.keys().collect::<Vec<_>>(), ["a"], "{seen:?}");
    assert_eq!(seen["a"].0, 2);
}
