//! The registry replicas share, as its users meet it: a client that moves
//! or whose replica is killed, a takeover across replicas, Redis killed
//! mid-traffic, Redis over TLS with a password. The replicas and their
//! Redis are `peers.rs`'s [`Group`].

use super::peers::{Group, holding_for_a_peer, instance};
use super::*;
use crate::support::redis::Redis;

/// A public balancer in front of tunnel endpoints: each connection goes
/// to the next backend that takes it, as a Kubernetes Service sends a
/// client to a live pod.
struct Balancer {
    url: String,
    task: tokio::task::JoinHandle<()>,
}

impl Balancer {
    async fn start(backends: Vec<SocketAddr>) -> Balancer {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("ws://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let mut next = 0;
            while let Ok((mut public, _)) = listener.accept().await {
                let mut backend = None;
                for i in 0..backends.len() {
                    let to = backends[(next + i) % backends.len()];
                    if let Ok(stream) = tokio::net::TcpStream::connect(to).await {
                        next = (next + i + 1) % backends.len();
                        backend = Some(stream);
                        break;
                    }
                }
                let Some(mut backend) = backend else { continue };
                tokio::spawn(async move {
                    let _ = tokio::io::copy_bidirectional(&mut public, &mut backend).await;
                });
            }
        });
        Balancer { url, task }
    }
}

impl Drop for Balancer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A client that moves from B to C (its old process gone, a new one
/// dialling C) is served through C from every replica within a second
/// of C holding it: the registry's change reaches A at once, not at a
/// poll.
#[tokio::test]
async fn a_client_that_moves_is_served_on_its_new_replica_within_a_second() {
    let echo = upstream::echo("moving").await;
    let group = Group::start().await;
    let (mut a, b, client) = holding_for_a_peer(&group, &echo.url()).await;
    let c = group.replica(&[]).await;
    assert_eq!(a.get("rt-a", "/before").await.status, 200);
    drop(client);
    b.process
        .wait_status("rt-a gone from B", |s| {
            s["runtimes"] == serde_json::json!([])
        })
        .await;
    let _moved = c
        .client("rt-a", TOKENS[0].1, &["--upstream", &echo.url()])
        .await;
    c.wait_connections("rt-a", 2).await;
    let held = Instant::now();
    loop {
        let answer = a.get("rt-a", "/after-move").await;
        if answer.status == 200 {
            assert_eq!(answer.json()["upstream"], "moving");
            break;
        }
        assert!(
            held.elapsed() < Duration::from_secs(1),
            "A still answers {} a second after C holds rt-a: {:?}",
            answer.status,
            answer.body
        );
    }
    let c_peer = c.process.addrs["peer listening"];
    a.process.wait_for_log(&format!("peer {c_peer}")).await;
}

/// SIGKILL of the replica holding a runtime: its client reconnects
/// through the balancer to another replica and is served there within
/// its backoff, by every replica; the dead replica's registry entries
/// are gone once its lease ends, deleted by a survivor.
#[tokio::test]
async fn a_killed_replicas_runtimes_are_served_elsewhere_and_its_entries_expire() {
    let echo = upstream::echo("survivor").await;
    let group = Group::start().await;
    let mut b = group.replica(&[]).await;
    let c = group.replica(&[]).await;
    let a = group.replica(&[]).await;
    // The balancer sends the client to B first.
    let balancer = Balancer::start(vec![b.tunnel, c.tunnel]).await;
    let _client = b
        .client_via(
            &balancer.url,
            "rt-a",
            TOKENS[0].1,
            &["--upstream", &echo.url(), "--connections", "1"],
        )
        .await;
    b.wait_connections("rt-a", 1).await;
    let b_id = instance(&b).await;
    assert_eq!(
        group.redis.holders().await,
        [("rt-a".to_owned(), b_id.clone())]
    );
    b.process.signal("KILL");
    b.process.wait_exit(Duration::from_secs(10)).await;
    c.wait_connections("rt-a", 1).await;
    // A learns of C's tunnel from the registry, a moment later.
    let c_id = instance(&c).await;
    a.process
        .wait_status("C holding rt-a in A's map", |s| {
            s["peers"].as_array().is_some_and(|p| {
                p.iter()
                    .any(|p| p["instance"] == c_id.as_str() && p["runtimes"] == 1)
            })
        })
        .await;
    for server in [&a, &c] {
        let answer = server.get("rt-a", "/after-kill").await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        assert_eq!(answer.json()["upstream"], "survivor");
    }
    // B's entry outlives it only until its lease ends.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let holders = group.redis.holders().await;
        if holders == [("rt-a".to_owned(), c_id.clone())] {
            break;
        }
        assert!(Instant::now() < deadline, "B's entries stay: {holders:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = a
        .process
        .wait_status("B gone from A's map", |s| {
            s["peers"]
                .as_array()
                .is_some_and(|p| p.iter().all(|p| p["instance"] != b_id.as_str()))
        })
        .await;
    assert_eq!(
        status["peers"].as_array().map(Vec::len),
        Some(1),
        "{status:#}"
    );
}

/// Redis killed mid-traffic: requests for the runtime held locally never
/// fail, forwarding goes on by the last known map, and `/status` and
/// `/metrics` say the registry is down. When Redis comes back (empty)
/// every replica re-registers what it holds, so a replica started after
/// finds both runtimes.
#[tokio::test]
async fn when_redis_goes_away_local_runtimes_are_served_and_the_registry_catches_up() {
    let echo_a = upstream::echo("local-a").await;
    let echo_b = upstream::echo("remote-b").await;
    let mut group = Group::start().await;
    let a = group.replica(&[]).await;
    let b = group.replica(&[]).await;
    let _rt_a = a
        .client("rt-a", TOKENS[0].1, &["--upstream", &echo_a.url()])
        .await;
    let _rt_b = b
        .client("rt-b", TOKENS[1].1, &["--upstream", &echo_b.url()])
        .await;
    group.sees(&a, 1).await;

    let public = a.public;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic = {
        let stop = stop.clone();
        tokio::spawn(async move {
            let mut answered = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let req = Request::get(format!("http://{public}/during"))
                    .header("host", format!("rt-a.{DOMAIN}"))
                    .body(body(Bytes::new()))
                    .unwrap();
                let answer = client::send(&client::http1(), req).await;
                assert_eq!(answer.status, 200, "request {answered}: {:?}", answer.body);
                answered += 1;
            }
            answered
        })
    };
    group.redis.kill().await;
    a.process
        .wait_status("the registry down", |s| s["registry"]["state"] == "down")
        .await;
    a.process
        .metrics_showing(&[
            "portcullis_tunnel_registry_up 0".to_owned(),
            "portcullis_tunnel_registry_lost_total 1".to_owned(),
        ])
        .await;
    let forwarded = a.get("rt-b", "/by-the-last-map").await;
    assert_eq!(forwarded.status, 200, "{:?}", forwarded.body);
    assert_eq!(forwarded.json()["upstream"], "remote-b");

    group.redis.restart().await;
    for server in [&a, &b] {
        server
            .process
            .wait_status("the registry up again", |s| s["registry"]["state"] == "up")
            .await;
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let answered = traffic.await.unwrap();
    assert!(answered > 0);
    let late = group.replica(&[]).await;
    group.sees(&late, 2).await;
    for (runtime, upstream) in [("rt-a", "local-a"), ("rt-b", "remote-b")] {
        let answer = late.get(runtime, "/late").await;
        assert_eq!(answer.status, 200, "{runtime}: {:?}", answer.body);
        assert_eq!(answer.json()["upstream"], upstream);
    }
}

/// A takeover across replicas: a newer client of rt-a connects to C
/// while an older one holds it on B. B learns it from the registry and
/// closes the older client's tunnel, telling it it was replaced, as one
/// server does; every replica then serves rt-a through C.
#[tokio::test]
async fn a_takeover_across_replicas_closes_the_stale_tunnel() {
    let old = upstream::echo("old-client").await;
    let new = upstream::echo("new-client").await;
    let group = Group::start().await;
    let (a, mut b, mut old_client) = holding_for_a_peer(&group, &old.url()).await;
    let c = group.replica(&[]).await;
    assert_eq!(a.get("rt-a", "/x").await.json()["upstream"], "old-client");
    let _new_client = c
        .client("rt-a", TOKENS[0].1, &["--upstream", &new.url()])
        .await;
    b.process
        .wait_for_log("another client took over this runtime")
        .await;
    let line = old_client.wait_for_log("another client took over").await;
    assert!(line.contains("rt-a"), "{line}");
    let exited = old_client.wait_exit(Duration::from_secs(20)).await;
    assert!(
        !exited.success(),
        "the replaced client must exit with an error"
    );
    b.process
        .wait_status("rt-a gone from B", |s| {
            s["runtimes"] == serde_json::json!([])
        })
        .await;
    let c_id = instance(&c).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while group.redis.holders().await != [("rt-a".to_owned(), c_id.clone())] {
        assert!(
            Instant::now() < deadline,
            "{:?}",
            group.redis.holders().await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for server in [&a, &b, &c] {
        let answer = server.get("rt-a", "/after").await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        assert_eq!(answer.json()["upstream"], "new-client");
    }
}

/// A registry over TLS (`rediss://` with `--registry-ca`) that wants a
/// password (`--registry-password-file`): replicas share it as over
/// cleartext; a wrong password keeps the registry down and says why.
#[tokio::test]
async fn the_registry_speaks_tls_with_a_password_from_a_file() {
    let echo = upstream::echo("over-tls").await;
    let pki = crate::support::tls::TestPki::for_names(&["localhost"]);
    let redis = Redis::start_tls(&pki, "registry-password-0123").await;
    let dir = tempfile::tempdir().unwrap();
    let (token, right, wrong) = (
        dir.path().join("token"),
        dir.path().join("password"),
        dir.path().join("wrong"),
    );
    std::fs::write(&token, "peer-token-0123456789\n").unwrap();
    std::fs::write(&right, "registry-password-0123\n").unwrap();
    std::fs::write(&wrong, "not-the-password\n").unwrap();
    let ca = redis.ca().display().to_string();
    let (token, right, wrong) = (
        token.display().to_string(),
        right.display().to_string(),
        wrong.display().to_string(),
    );
    let replica = |password: &str| {
        let args = [
            "--registry",
            &redis.url,
            "--registry-ca",
            &ca,
            "--registry-password-file",
            password,
            "--peer-listen",
            "127.0.0.1:0",
            "--peer-token-file",
            &token,
        ]
        .map(str::to_owned);
        async move {
            let any = "127.0.0.1:0".parse().unwrap();
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            TunnelServer::start_in_with(tokens_dir(), any, any, &args).await
        }
    };
    let b = replica(&right).await;
    let a = replica(&right).await;
    for server in [&a, &b] {
        server
            .process
            .wait_status("the registry up over TLS", |s| {
                s["registry"]["state"] == "up"
            })
            .await;
    }
    let _client = b
        .client("rt-a", TOKENS[0].1, &["--upstream", &echo.url()])
        .await;
    let status = a
        .process
        .wait_status("B holding rt-a", |s| s["peers"][0]["runtimes"] == 1)
        .await;
    assert_eq!(status["registry"]["url"], redis.url, "{status:#}");
    assert_eq!(a.get("rt-a", "/tls").await.json()["upstream"], "over-tls");

    let locked_out = replica(&wrong).await;
    let status = locked_out
        .process
        .wait_status("the registry refusing the password", |s| {
            s["registry"]["error"]
                .as_str()
                .is_some_and(|e| !e.is_empty())
        })
        .await;
    assert_eq!(status["registry"]["state"], "down", "{status:#}");
    let error = status["registry"]["error"]
        .as_str()
        .unwrap()
        .to_ascii_lowercase();
    assert!(error.contains("pass") || error.contains("auth"), "{error}");
    assert!(
        !format!("{status}").contains("not-the-password"),
        "the password must not show: {status:#}"
    );
}

/// A relay between a replica and Redis that the test can stall: the
/// replica's registry connections then carry nothing (as when it is cut
/// off from Redis), while its peers and its tunnels carry on.
struct Relay {
    url: String,
    stalled: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn to(redis: &Redis) -> Relay {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("redis://{}", listener.local_addr().unwrap());
        let port = redis.port;
        let (stalled, watch) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
                    continue;
                };
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                tokio::spawn(Self::pipe(cr, sw, watch.clone()));
                tokio::spawn(Self::pipe(sr, cw, watch.clone()));
            }
        });
        Relay { url, stalled, task }
    }

    /// Copies `from` to `to`, holding what it read while stalled; ends
    /// with either side.
    async fn pipe(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        mut stalled: tokio::sync::watch::Receiver<bool>,
    ) {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            while *stalled.borrow_and_update() {
                if stalled.changed().await.is_err() {
                    return;
                }
            }
            if to.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    }

    fn stall(&self, stalled: bool) {
        let _ = self.stalled.send(stalled);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Requests for a runtime whose tunnel stays connected throughout, sent
/// to replica A, which forwards them to B, the holder, while the registry
/// loses everything (`FLUSHALL`), drops every connection (`CLIENT
/// KILL`), and B is cut off from it for longer than its lease: none
/// fails. A used to forget B's runtimes when a reload of the registry
/// came back without them or it found B's lease gone, and answered 503
/// until B published again.
#[tokio::test]
async fn a_registry_that_loses_its_data_or_connections_drops_no_request() {
    let echo = upstream::echo("steady").await;
    let group = Group::start().await;
    let relay = Relay::to(&group.redis).await;
    let mut b = group.replica_via(&relay.url, &[]).await;
    let mut a = group.replica(&[]).await;
    let _client = b
        .client("rt-a", TOKENS[0].1, &["--upstream", &echo.url()])
        .await;
    group.sees(&a, 1).await;
    let b_id = instance(&b).await;
    let holders = || async { group.redis.holders().await == [("rt-a".to_owned(), b_id.clone())] };
    let public = a.public;
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let traffic: Vec<_> = (0..4)
        .map(|_| {
            let stop = stop.clone();
            tokio::spawn(async move {
                let (mut answered, mut failed) = (0u64, Vec::new());
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let req = Request::get(format!("http://{public}/steady"))
                        .header("host", format!("rt-a.{DOMAIN}"))
                        .body(body(Bytes::new()))
                        .unwrap();
                    let answer = client::send(&client::http1(), req).await;
                    if answer.status != 200 {
                        failed.push((answer.status, answer.body.clone()));
                    }
                    answered += 1;
                }
                (answered, failed)
            })
        })
        .collect();

    // Everything lost: both replicas find their leases gone and publish
    // what they hold again.
    let mut redis = group.redis.connection().await;
    let _: () = redis::cmd("FLUSHALL")
        .query_async(&mut redis)
        .await
        .unwrap();
    for server in [&mut a, &mut b] {
        server
            .process
            .wait_for_log("this server's registry lease had ended")
            .await;
    }
    while !holders().await {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // Every connection dropped: both reconnect.
    for kind in ["normal", "pubsub"] {
        let _: Result<u64, _> = redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg(kind)
            .query_async(&mut group.redis.connection().await)
            .await;
    }
    for server in [&a, &b] {
        server
            .process
            .metrics_showing(&["portcullis_tunnel_registry_lost_total 1".to_owned()])
            .await;
        server
            .process
            .wait_status("the registry up again", |s| s["registry"]["state"] == "up")
            .await;
    }

    // B cut off from Redis until its lease lapses: A finds the lease gone
    // while B lives, and keeps forwarding to it.
    relay.stall(true);
    a.process
        .wait_for_log("peer's registry lease is gone but it answers")
        .await;
    relay.stall(false);
    b.process
        .wait_status("the registry up again", |s| s["registry"]["state"] == "up")
        .await;
    while !holders().await {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut total = 0;
    for t in traffic {
        let (answered, failed) = t.await.unwrap();
        let some = &failed[..failed.len().min(3)];
        assert!(
            failed.is_empty(),
            "{} of {answered} failed: {some:?}",
            failed.len()
        );
        total += answered;
    }
    assert!(total > 100, "{total}");
    // Past the carrying time, what B still holds is held as before.
    a.process
        .wait_status("rt-a held through B, no longer carried", |s| {
            let peers = s["peers"].as_array();
            peers.is_some_and(|p| p.len() == 1 && p[0]["runtimes"] == 1 && p[0]["carried"] == 0)
        })
        .await;
    assert_eq!(a.get("rt-a", "/after").await.status, 200);
}
