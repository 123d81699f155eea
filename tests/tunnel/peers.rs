//! Tunnel-server replicas sharing a registry in a real `redis-server`
//! (`--registry`, `--peer-listen`): a public request that reaches a
//! replica holding no tunnel of its runtime is served through the
//! replica that holds one, over the peer link (cleartext or mutual
//! TLS). Moves, crashes, takeovers and a Redis that goes away are in
//! `registry.rs`.

use super::*;
use crate::support::redis::Redis;

/// A Redis and the token the test's replicas share, in a file.
pub(super) struct Group {
    pub(super) redis: Redis,
    _dir: tempfile::TempDir,
    token: String,
}

impl Group {
    pub(super) async fn start() -> Group {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("peer-token");
        std::fs::write(&file, "peer-token-0123456789\n").unwrap();
        Group {
            redis: Redis::start().await,
            token: file.display().to_string(),
            _dir: dir,
        }
    }

    /// A replica in the group with `extra` arguments, returned once the
    /// registry is up for it.
    pub(super) async fn replica(&self, extra: &[&str]) -> TunnelServer {
        self.replica_via(&self.redis.url, extra).await
    }

    /// [`Group::replica`], reaching the group's Redis at `registry` (a
    /// relay in front of it, say).
    pub(super) async fn replica_via(&self, registry: &str, extra: &[&str]) -> TunnelServer {
        let any = "127.0.0.1:0".parse().unwrap();
        let mut args = vec!["--registry", registry, "--peer-token-file", &self.token];
        if !extra.contains(&"--peer-listen") {
            args.extend(["--peer-listen", "127.0.0.1:0"]);
        }
        args.extend_from_slice(extra);
        let server = TunnelServer::start_in_with(tokens_dir(), any, any, &args).await;
        server
            .process
            .wait_status("the registry up", |s| s["registry"]["state"] == "up")
            .await;
        server
    }

    /// Waits until `server`'s map shows `n` other servers holding a
    /// runtime (the tests give each holder one), and returns its status.
    pub(super) async fn sees(&self, server: &TunnelServer, n: usize) -> serde_json::Value {
        let _ = self;
        server
            .process
            .wait_status(&format!("{n} peers holding runtimes"), |s| {
                s["peers"].as_array().is_some_and(|p| {
                    p.len() == n && p.iter().all(|p| p["runtimes"].as_u64() > Some(0))
                })
            })
            .await
    }
}

/// A server's instance id, as its status shows it.
pub(super) async fn instance(server: &TunnelServer) -> String {
    server.process.status().await["instance"]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Peer certificates from one CA, written into `dir`: B's (the listener)
/// naming `localhost`, A's (the dialler) another name. Returns both
/// identities and each side's `--peer-cert/-key/-ca` arguments.
fn peer_tls(
    dir: &std::path::Path,
) -> (
    crate::support::tls::TestPki,
    crate::support::tls::TestPki,
    Vec<String>,
    Vec<String>,
) {
    let pki = crate::support::tls::TestPki::for_names(&["localhost"]);
    let a_pki = pki.renewed(&["tunnel-a.example"]);
    let path = |f: &str| dir.join(f).display().to_string();
    std::fs::write(dir.join("ca.crt"), &pki.ca_pem).unwrap();
    let args = |name: &str, who: &crate::support::tls::TestPki| {
        let (cert, key) = (format!("{name}.crt"), format!("{name}.key"));
        std::fs::write(dir.join(&cert), &who.leaf_pem).unwrap();
        std::fs::write(dir.join(&key), &who.leaf_key_pem).unwrap();
        [
            "--peer-cert",
            &path(&cert),
            "--peer-key",
            &path(&key),
            "--peer-ca",
            &path("ca.crt"),
        ]
        .map(str::to_owned)
        .to_vec()
    };
    let (b, a) = (args("b", &pki), args("a", &a_pki));
    (pki, a_pki, b, a)
}

/// A loopback port free now, for a listener whose address must be known
/// before it starts (to advertise another name for it).
fn free_port() -> u16 {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    probe.local_addr().unwrap().port()
}

/// Borrowed arguments, to join with others.
fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// Replica B holding rt-a's tunnel (to `upstream`) and replica A, which
/// holds none; returned once A has seen that B holds it (with rt-a's
/// client, to keep).
pub(super) async fn holding_for_a_peer(
    group: &Group,
    upstream: &str,
) -> (TunnelServer, TunnelServer, ProxyProcess) {
    let b = group.replica(&[]).await;
    let a = group.replica(&[]).await;
    let client = b
        .client("rt-a", TOKENS[0].1, &["--upstream", upstream])
        .await;
    group.sees(&a, 1).await;
    (a, b, client)
}

/// Three replicas; B holds rt-a's tunnel (an echo upstream) and C rt-b's
/// (a WebSocket echo). A public request to any replica reaches the right
/// runtime: through the holder, with the client's address and forwarding
/// headers as if the holder's own public side had taken them, a streamed
/// body whole, a WebSocket both ways, the access line naming the peer.
/// The registry holds one entry per runtime and holder; the peer port
/// takes nothing without the shared token.
#[tokio::test]
async fn a_public_request_to_any_replica_reaches_the_right_runtime() {
    let echo = upstream::echo("behind-b").await;
    let ws = upstream::websocket_echo().await;
    let group = Group::start().await;
    let mut a = group.replica(&[]).await;
    let mut b = group.replica(&[]).await;
    let c = group.replica(&[]).await;
    let b_peer = b.process.addrs["peer listening"];
    let _rt_a = b
        .client("rt-a", TOKENS[0].1, &["--upstream", &echo.url()])
        .await;
    let _rt_b = c
        .client("rt-b", TOKENS[1].1, &["--upstream", &ws.url()])
        .await;
    let status = group.sees(&a, 2).await;
    let b_status = status["peers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["address"] == b_peer.to_string())
        .cloned()
        .unwrap_or_default();
    assert_eq!(b_status["instance"], instance(&b).await, "{status:#}");
    assert_eq!(status["registry"]["url"], group.redis.url, "{status:#}");

    for (server, name) in [(&a, "a"), (&b, "b"), (&c, "c")] {
        let answer = server.get("rt-a", &format!("/via-{name}?x=1")).await;
        assert_eq!(answer.status, 200, "{name}: {:?}", answer.body);
        let seen = answer.json();
        assert_eq!(seen["upstream"], "behind-b");
        assert_eq!(seen["target"], format!("/via-{name}?x=1"));
        assert!(
            seen["headers"].get("x-portcullis-peer-token").is_none(),
            "the peer token must not reach the runtime: {seen:#}"
        );
    }
    let seen = a.streamed_post_with_forwarding_headers("rt-a").await;
    assert!(
        seen["headers"].get("x-portcullis-peer-token").is_none(),
        "{seen:#}"
    );
    a.websocket_echo("rt-b").await;
    b.websocket_echo("rt-b").await;
    // Found by path: each worker writes its own access lines in batches,
    // so lines of requests served by different workers may come in any
    // order.
    let line = a.process.wait_for_log("/via-a").await;
    assert!(
        line.contains(&format!("\"route\":\"peer {b_peer}\"")),
        "{line}"
    );
    let line = b.process.wait_for_log("/via-a").await;
    assert!(line.contains("\"route\":\"from peer 127.0.0.1:"), "{line}");
    // A GET and a POST went to B, a WebSocket to C.
    a.process
        .metrics_showing(&[
            format!("portcullis_tunnel_peer_forwarded_total{{peer=\"{b_peer}\"}} 2"),
            "portcullis_tunnel_registry_up 1".to_owned(),
            "portcullis_tunnel_peers 2".to_owned(),
        ])
        .await;
    let (b_id, c_id) = (instance(&b).await, instance(&c).await);
    assert_eq!(
        group.redis.holders().await,
        [("rt-a".to_owned(), b_id), ("rt-b".to_owned(), c_id)]
    );

    // Only peers with the token are answered; someone trying the port by
    // hand over HTTP/1.1 is told what it is.
    let by_hand = client::get(&format!("http://{b_peer}/")).await;
    assert_eq!(by_hand.status, 401);
    let error = by_hand.json()["error"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(error.contains("peer token"), "{error}");
    let forged = Request::get(format!("http://{b_peer}/"))
        .header("host", format!("rt-a.{DOMAIN}"))
        .header("x-portcullis-peer-token", "peer-token-0123456788")
        .body(body(Bytes::new()))
        .unwrap();
    assert_eq!(client::send(&client::h2c(), forged).await.status, 401);
    b.process.wait_for_log("wrong or missing peer token").await;
}

/// A holder that dies is left out at once, before its lease ends: A
/// cannot connect to it, answers as for a runtime with no tunnel
/// anywhere, and says so.
#[tokio::test]
async fn a_holder_that_cannot_be_reached_is_left_out_at_once() {
    let echo = upstream::echo("behind-b").await;
    let group = Group::start().await;
    let (mut a, mut b, _client) = holding_for_a_peer(&group, &echo.url()).await;
    b.process.signal("KILL");
    b.process.wait_exit(Duration::from_secs(10)).await;
    let answer = a.get("rt-a", "/after").await;
    assert_eq!(answer.status, 503, "{:?}", answer.body);
    assert_eq!(answer.json()["error"], "runtime is not connected");
    a.process.wait_for_log("peer unreachable").await;
}

/// Bad flags stop the server at start and say which: the removed
/// `--peers`, a registry without a peer listener or token, a short token,
/// a password in the URL.
#[tokio::test]
async fn bad_registry_flags_are_refused_at_start() {
    let dir = tokens_dir();
    let short = dir.path().join("short");
    std::fs::write(&short, "tiny\n").unwrap();
    let short = short.display().to_string();
    let listen = [
        "--registry",
        "redis://127.0.0.1:1",
        "--peer-listen",
        "127.0.0.1:0",
    ];
    for (args, message) in [
        (&["--peers", "127.0.0.1:1"][..], "--peers was removed"),
        (
            &["--registry", "redis://127.0.0.1:1"][..],
            "needs --peer-listen",
        ),
        (&listen[..], "needs the peers' token"),
        (
            &[&listen[..], &["--peer-token-file", &short]].concat()[..],
            "at least 16 characters",
        ),
        (
            &[
                "--registry",
                "redis://:pw@127.0.0.1:1",
                "--peer-listen",
                "127.0.0.1:0",
            ][..],
            "holds a password",
        ),
        (
            &[
                "--registry",
                "127.0.0.1:6379",
                "--peer-listen",
                "127.0.0.1:0",
            ][..],
            "not a Redis URL",
        ),
    ] {
        let out = server_command(&dir)
            .args(args)
            .env_remove("PORTCULLIS_PEER_TOKEN")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(message), "{args:?}: {stderr}");
    }
}

/// A rolling restart: the replica holding the tunnel is stopped while a
/// request a peer forwarded to it is in flight. It stops taking new
/// ones, finishes that one (through its tunnel, which closes only
/// after), withdraws from the registry and exits cleanly; the forwarding
/// replica's client gets the answer.
#[tokio::test]
async fn a_stopping_peer_finishes_the_requests_forwarded_to_it() {
    let (up, mut arrived, release) = upstream::holding().await;
    let group = Group::start().await;
    let (a, mut b, _client) = holding_for_a_peer(&group, &up.url()).await;
    let in_flight = a.slow_in_flight("rt-a", &mut arrived).await;
    b.process.signal("TERM");
    b.process.wait_for_log("shutting down").await;
    release.notify_one();
    let answer = in_flight.await.unwrap();
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    assert_eq!(answer.body, "done /slow");
    let status = b.process.wait_exit(Duration::from_secs(20)).await;
    assert!(status.success(), "{status:?}");
    // Withdrawn at once, not after the lease.
    assert_eq!(group.redis.holders().await, []);
}

/// A burst of public requests for a peer's runtime shares one connection
/// to the peer, made for the first of them (one per worker), not a dial
/// (and a TLS handshake) each. And when they are cancelled at once (a
/// page closed, a balancer's timeout, a load test ending) the link stays
/// up: the forwarding replica resets a stream on it for each, and when
/// the peer reads their openings and resets together (across a WAN; here
/// the peer is stopped while they are sent) h2 would take more than 20
/// for a rapid-reset attack and end the link, with every request on it,
/// unless told to expect them.
#[tokio::test]
async fn bursts_of_requests_share_the_peer_link_and_cancelling_them_leaves_it_up() {
    let (up, mut arrived, release) = upstream::holding().await;
    let group = Group::start().await;
    let (a, mut b, _client) = holding_for_a_peer(&group, &up.url()).await;

    // Fifty at once on a link not yet dialled: B sees them all come from
    // one connection.
    const BURST: u64 = 50;
    let mut burst = TunnelServer::h2_requests(&a.h2().await, "rt-a", BURST);
    while let Some(answer) = burst.join_next().await {
        assert_eq!(answer.unwrap().unwrap().status(), 200);
    }
    let mut links = std::collections::BTreeSet::new();
    for _ in 0..BURST {
        let line = b.process.wait_for_log("\"/h2/").await;
        let v: serde_json::Value = serde_json::from_str(&line).expect("a JSON log line");
        links.insert(v["route"].as_str().unwrap_or_default().to_owned());
    }
    assert_eq!(links.len(), 1, "{links:?}");

    // A request held by the upstream, then a hundred on the same public
    // connection (so the same worker's link) cancelled while B reads
    // nothing.
    let public = a.h2().await;
    let mut held = public.clone();
    let in_flight = tokio::spawn(async move {
        let req = Request::get(format!("http://rt-a.{DOMAIN}/slow"))
            .body(http_body_util::Empty::<Bytes>::new())
            .unwrap();
        let resp = held.send_request(req).await.unwrap();
        let status = resp.status();
        (status, resp.into_body().collect().await.unwrap().to_bytes())
    });
    tokio::time::timeout(Duration::from_secs(10), arrived.recv())
        .await
        .expect("request reached the upstream");
    let waiting_on_b = |n: u64| {
        let what = format!("{n} requests waiting on peer B");
        let a = &a.process;
        async move {
            a.wait_status(&what, |s| s["peers"][0]["active_requests"] == n)
                .await
        }
    };
    waiting_on_b(1).await;
    const LEAVING: u64 = 100;
    b.process.signal("STOP");
    let leaving = TunnelServer::h2_requests(&public, "rt-a", LEAVING);
    waiting_on_b(LEAVING + 1).await;
    drop(leaving);
    waiting_on_b(1).await;
    b.process.signal("CONT");

    // Once a request made after them has crossed, B has read every reset
    // before it; the held request is still on the link.
    let mut after = public.clone();
    let req = Request::get(format!("http://rt-a.{DOMAIN}/after"))
        .body(http_body_util::Empty::<Bytes>::new())
        .unwrap();
    let answer = after.send_request(req).await.expect("answered");
    assert_eq!(answer.status(), 200);
    release.notify_one();
    let (status, body) = in_flight.await.unwrap();
    assert_eq!(status, 200, "{body:?}");
    assert_eq!(body, "done /slow");
    a.process
        .metrics_showing(&[format!(
            "portcullis_tunnel_peer_active_requests{{peer=\"{}\"}} 0",
            b.process.addrs["peer listening"]
        )])
        .await;
}

/// Requests that waited on a dial to the peer that failed get its error:
/// they do not each dial again in turn, which against a peer that hangs
/// in the TLS handshake (2 s each) would hold the last of a burst for
/// the whole queue's time.
#[tokio::test]
async fn requests_waiting_on_a_failed_dial_to_a_peer_share_its_failure() {
    let echo = upstream::echo("behind-b").await;
    let group = Group::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (_, _, b_tls, a_tls) = peer_tls(dir.path());
    // B is reached through a relay, which it advertises by the name its
    // certificate carries.
    let b_listen = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let relay = super::Relay::start(b_listen).await;
    let (listen, advertise) = (
        b_listen.to_string(),
        format!("localhost:{}", relay.addr.port()),
    );
    let b = group
        .replica(
            &[
                &["--peer-listen", &listen, "--peer-advertise", &advertise][..],
                &strs(&b_tls),
            ]
            .concat(),
        )
        .await;
    let _rt = b
        .client("rt-a", TOKENS[0].1, &["--upstream", &echo.url()])
        .await;
    let mut a = group.replica(&strs(&a_tls)).await;
    group.sees(&a, 1).await;

    // From now on B takes connections and says nothing (a process that
    // hangs).
    relay.black_hole();
    const BURST: u64 = 10;
    let mut burst = TunnelServer::h2_requests(&a.h2().await, "rt-a", BURST);
    while let Some(answer) = burst.join_next().await {
        let answer = answer.unwrap().unwrap();
        assert_eq!(answer.status(), 503);
    }
    assert_eq!(relay.black_holed(), 1);
    a.process.wait_for_log("TLS handshake timed out").await;
}

/// Peers across a network they do not trust speak mutual TLS
/// (`--peer-cert`, `--peer-key`, `--peer-ca`). Requests cross as they do
/// over cleartext. Each side checks the other's certificate against the
/// peer CA, and the dialling side also checks the name the peer
/// advertises. The peer port refuses plain HTTP, a client without a
/// certificate, and one from another CA, and goes on serving.
#[tokio::test]
async fn peers_with_certificates_speak_mutual_tls() {
    use crate::support::tls::{self, TestPki};
    let echo = upstream::echo("behind-b").await;
    let group = Group::start().await;
    let dir = tempfile::tempdir().unwrap();
    // B's certificate names only `localhost`; A presents its own from the
    // same CA.
    let (pki, a_pki, b_tls, a_tls) = peer_tls(dir.path());
    let port = free_port();
    let (listen, by_name) = (format!("127.0.0.1:{port}"), format!("localhost:{port}"));
    let mut b = group
        .replica(
            &[
                &["--peer-listen", &listen, "--peer-advertise", &by_name][..],
                &strs(&b_tls),
            ]
            .concat(),
        )
        .await;
    let b_peer = b.process.addrs["peer listening"];
    let _rt = b
        .client("rt-a", TOKENS[0].1, &["--upstream", &echo.url()])
        .await;
    // Advertised by the name its certificate carries: forwarded to.
    let a = group.replica(&strs(&a_tls)).await;
    group.sees(&a, 1).await;
    let answer = a.get("rt-a", "/over-tls").await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    assert_eq!(answer.json()["upstream"], "behind-b");
    assert_eq!(answer.json()["target"], "/over-tls");

    // A replica advertising an address its certificate does not name:
    // never reached, and the status says why.
    let wrong = group
        .replica(&[&["--peer-advertise", "127.0.0.1:0"][..], &strs(&b_tls)].concat())
        .await;
    let _rt_b = wrong
        .client("rt-b", TOKENS[1].1, &["--upstream", &echo.url()])
        .await;
    group.sees(&a, 2).await;
    assert_eq!(a.get("rt-b", "/x").await.status, 503);
    let status = a.process.status().await;
    let errors: Vec<&str> = status["peers"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["error"].as_str())
        .collect();
    assert!(
        errors.len() == 1 && errors[0].contains("not valid for name"),
        "{status:#}"
    );

    // The port by hand: plain HTTP is told it speaks TLS; TLS without a
    // certificate, or with one from another CA, fails the handshake.
    let plain = client::raw(b_peer, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n").await;
    assert!(plain.starts_with("HTTP/1.1 400"), "{plain}");
    assert!(plain.contains("speaks TLS"), "{plain}");
    let none = tls::https_get(b_peer, "localhost", &pki.ca_pem, &[b"http/1.1"], "/").await;
    assert!(none.is_err(), "{none:?}");
    let stranger = TestPki::for_names(&["localhost"]);
    let other = tls::https_get_as(b_peer, "localhost", &pki.ca_pem, &stranger, "/", &[]).await;
    assert!(other.is_err(), "{other:?}");
    b.process.wait_for_log("peer connection refused").await;
    // A peer's certificate and the token: answered (not a peer endpoint,
    // but past the handshake and the token check).
    let token_header = [("x-portcullis-peer-token", "peer-token-0123456789")];
    let (_, answered) =
        tls::https_get_as(b_peer, "localhost", &pki.ca_pem, &a_pki, "/", &token_header)
            .await
            .unwrap();
    assert_eq!(answered.status, 404, "{:?}", answered.body);
}

/// Someone guessing the peer token: after ten wrong ones in a minute its
/// address is answered 429 (slowly, with `Retry-After`), and the log has
/// one line for its first and one for the lockout, not one a guess (it
/// had one each, at 25,000 guesses a second). A real peer, from the same
/// address, is served all along.
#[tokio::test]
async fn guessing_the_peer_token_is_slowed_and_logged_once() {
    let echo = upstream::echo("behind-b").await;
    let group = Group::start().await;
    let (a, mut b, _client) = holding_for_a_peer(&group, &echo.url()).await;
    let b_peer = b.process.addrs["peer listening"];
    let guess = |n: usize| {
        Request::get(format!("http://{b_peer}/"))
            .header("host", format!("rt-a.{DOMAIN}"))
            .header("x-portcullis-peer-token", format!("guess-{n:016}"))
            .body(body(Bytes::new()))
            .unwrap()
    };
    let h2 = client::h2c();
    for n in 0..10 {
        assert_eq!(client::send(&h2, guess(n)).await.status, 401, "guess {n}");
    }
    let locked = client::send(&h2, guess(10)).await;
    assert_eq!(locked.status, 429, "{:?}", locked.body);
    let retry: u64 = locked.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    b.process.wait_for_log("this address is refused for").await;
    assert_eq!(
        b.process
            .count_logs("peer request refused: wrong or missing peer token"),
        1
    );
    // A, a real peer on the same address, is still served through B.
    let answer = a.get("rt-a", "/still-served").await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    assert_eq!(answer.json()["upstream"], "behind-b");
}
