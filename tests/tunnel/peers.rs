//! Tunnel-server replicas forwarding to each other (`--peers`,
//! `--peer-listen`): a public request that reaches a replica holding no
//! tunnel of its runtime is served through a peer that holds one.

use super::*;

/// The token the test's replicas share, in a file.
fn peer_token_file() -> (tempfile::TempDir, String) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("peer-token");
    std::fs::write(&file, "peer-token-0123456789\n").unwrap();
    let path = file.display().to_string();
    (dir, path)
}

/// A plain tunnel server with `extra` arguments.
async fn replica(extra: &[&str]) -> TunnelServer {
    let any = "127.0.0.1:0".parse().unwrap();
    TunnelServer::start_in_with(tokens_dir(), any, any, extra).await
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

/// Borrowed arguments, to join with others.
fn strs(args: &[String]) -> Vec<&str> {
    args.iter().map(String::as_str).collect()
}

/// Replica A with peer certificates (`a_tls`), listing its peer as
/// `localhost:port` (the name B's certificate carries); returned once
/// that peer is up over TLS, holding one runtime.
async fn listing_by_name(port: u16, token: &str, a_tls: &[String]) -> TunnelServer {
    let by_name = format!("localhost:{port}");
    let peers = ["--peers", &by_name, "--peer-token-file", token];
    let a = replica(&[&peers[..], &strs(a_tls)].concat()).await;
    a.process
        .wait_status("peer B up over TLS with its runtime", |s| {
            s["peers"]
                .as_array()
                .is_some_and(|peers| peers.iter().any(|p| p["up"] == true && p["runtimes"] == 1))
        })
        .await;
    a
}

/// Replica B, listening for peers, holding rt-a's tunnel (to `upstream`),
/// and replica A listing B as its peer; returned once A has seen that B
/// holds it (with rt-a's client, to keep).
async fn holding_for_a_peer(
    upstream: &str,
    token: &str,
) -> (TunnelServer, TunnelServer, ProxyProcess) {
    let b = replica(&["--peer-listen", "127.0.0.1:0", "--peer-token-file", token]).await;
    let b_peer = b.process.addrs["peer listening"].to_string();
    let a = replica(&["--peers", &b_peer, "--peer-token-file", token]).await;
    let client = b
        .client("rt-a", TOKENS[0].1, &["--upstream", upstream])
        .await;
    a.process
        .wait_status("peer B holding rt-a", |s| s["peers"][0]["runtimes"] == 1)
        .await;
    (a, b, client)
}

/// `/runtimes` on a peer listener, with `token` (none when `None`).
async fn ask_peer(peer: SocketAddr, token: Option<&str>) -> Answer {
    let mut req = Request::get(format!("http://{peer}/runtimes"));
    if let Some(token) = token {
        req = req.header("x-portcullis-peer-token", token);
    }
    client::send(&client::h2c(), req.body(body(Bytes::new())).unwrap()).await
}

/// Replica A has no tunnels; B holds rt-a's (an echo upstream) and rt-b's
/// (a WebSocket echo). Requests to A for either runtime reach them
/// through B: the client's address and forwarding headers as if B's own
/// public side had taken them, a streamed body whole, a WebSocket both
/// ways, the access line naming the peer. The peer port takes nothing
/// without the shared token. When B goes away, A answers 503 again.
#[tokio::test]
async fn a_replica_without_the_runtimes_tunnel_serves_it_through_a_peer() {
    let echo = upstream::echo("behind-b").await;
    let ws = upstream::websocket_echo().await;
    let (_token_dir, token) = peer_token_file();
    let mut b = replica(&["--peer-listen", "127.0.0.1:0", "--peer-token-file", &token]).await;
    let b_peer = b.process.addrs["peer listening"];
    let mut a = replica(&["--peers", &b_peer.to_string(), "--peer-token-file", &token]).await;
    let url = echo.url();
    let _rt_a = b.client("rt-a", TOKENS[0].1, &["--upstream", &url]).await;
    let url = ws.url();
    let _rt_b = b.client("rt-b", TOKENS[1].1, &["--upstream", &url]).await;

    // Before A has heard of B's runtimes (or with no peers at all) this
    // is a 503; the status shows when it has.
    let status = a
        .process
        .wait_status("peer B holding two runtimes", |s| {
            s["peers"][0]["runtimes"] == 2 && s["peers"][0]["up"] == true
        })
        .await;
    assert_eq!(
        status["peers"][0]["address"],
        b_peer.to_string(),
        "{status:#}"
    );
    assert_eq!(status["peers"][0]["self"], false, "{status:#}");

    let answer = a.get("rt-a", "/via-a?x=1").await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    let seen = answer.json();
    assert_eq!(seen["upstream"], "behind-b");
    assert_eq!(seen["target"], "/via-a?x=1");
    assert!(
        seen["headers"].get("x-portcullis-peer-token").is_none(),
        "the peer token must not reach the runtime: {seen:#}"
    );
    let seen = a.streamed_post_with_forwarding_headers("rt-a").await;
    assert!(
        seen["headers"].get("x-portcullis-peer-token").is_none(),
        "{seen:#}"
    );
    a.websocket_echo("rt-b").await;
    let line = a.process.wait_for_log(&format!("peer {b_peer}")).await;
    assert!(line.contains("/via-a"), "{line}");
    let line = b.process.wait_for_log("from peer 127.0.0.1:").await;
    assert!(line.contains("/via-a"), "{line}");
    // A GET, a POST and a WebSocket went through the peer.
    a.process
        .metrics_showing(&[format!(
            "portcullis_tunnel_peer_forwarded_total{{peer=\"{b_peer}\"}} 3"
        )])
        .await;
    assert_eq!(a.process.status().await["peers"][0]["forwarded"], 3);

    // Only peers with the token are answered; someone trying the port
    // by hand over HTTP/1.1 is told what it is.
    assert_eq!(ask_peer(b_peer, None).await.status, 401);
    let by_hand = client::get(&format!("http://{b_peer}/runtimes")).await;
    assert_eq!(by_hand.status, 401);
    let error = by_hand.json()["error"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(error.contains("peer token"), "{error}");
    assert_eq!(
        ask_peer(b_peer, Some("peer-token-0123456788")).await.status,
        401
    );
    let listed = ask_peer(b_peer, Some("peer-token-0123456789")).await;
    assert_eq!(listed.status, 200, "{:?}", listed.body);
    assert_eq!(
        listed.json()["runtimes"],
        serde_json::json!(["rt-a", "rt-b"])
    );
    let forged = Request::get(format!("http://{b_peer}/"))
        .header("host", format!("rt-a.{DOMAIN}"))
        .body(body(Bytes::new()))
        .unwrap();
    assert_eq!(client::send(&client::h2c(), forged).await.status, 401);
    b.process.wait_for_log("wrong or missing peer token").await;

    // Gone: at once, before A's next poll has noticed, B cannot take a
    // connection, so A leaves it out and answers as for a runtime with
    // no tunnel anywhere.
    b.process.signal("KILL");
    b.process.wait_exit(Duration::from_secs(10)).await;
    let answer = a.get("rt-a", "/after").await;
    assert_eq!(answer.status, 503, "{:?}", answer.body);
    assert_eq!(answer.json()["error"], "runtime is not connected");
    a.process.wait_for_log("peer unreachable").await;
}

/// Two peers hold the runtime and one dies: requests go on through the
/// other from the first, since a peer that takes no connection has been
/// sent nothing and the next can be tried.
#[tokio::test]
async fn when_one_of_two_holding_peers_dies_the_other_serves_at_once() {
    let echo = upstream::echo("two-holders").await;
    let (_token_dir, token) = peer_token_file();
    let listen = ["--peer-listen", "127.0.0.1:0", "--peer-token-file", &token];
    let mut b = replica(&listen).await;
    let c = replica(&listen).await;
    let (b_peer, c_peer) = (
        b.process.addrs["peer listening"],
        c.process.addrs["peer listening"],
    );
    let peers = format!("{b_peer},{c_peer}");
    let a = replica(&["--peers", &peers, "--peer-token-file", &token]).await;
    let url = echo.url();
    let _client = b
        .client_via(
            &format!("{},{}", b.url, c.url),
            "rt-a",
            TOKENS[0].1,
            &["--upstream", &url, "--connections", "1"],
        )
        .await;
    b.wait_connections("rt-a", 1).await;
    c.wait_connections("rt-a", 1).await;
    a.process
        .wait_status("both peers holding rt-a", |s| {
            s["peers"]
                .as_array()
                .is_some_and(|p| p.len() == 2 && p.iter().all(|p| p["runtimes"] == 1))
        })
        .await;

    b.process.signal("KILL");
    b.process.wait_exit(Duration::from_secs(10)).await;
    for i in 0..6 {
        let answer = a.get("rt-a", &format!("/n{i}")).await;
        assert_eq!(answer.status, 200, "request {i}: {:?}", answer.body);
        assert_eq!(answer.json()["upstream"], "two-holders");
    }
    let status = a.process.status().await;
    let listed = |addr: SocketAddr| {
        status["peers"]
            .as_array()
            .and_then(|p| p.iter().find(|p| p["address"] == addr.to_string()))
            .cloned()
            .unwrap_or_default()
    };
    assert_eq!(listed(b_peer)["up"], false, "{status:#}");
    assert_eq!(listed(c_peer)["up"], true, "{status:#}");
}

/// A replica listed among its own peers (a headless Service's name
/// resolves to every pod, itself included) knows itself by its instance
/// id and does not forward to itself.
#[tokio::test]
async fn a_replica_among_its_own_peers_leaves_itself_out() {
    let (_token_dir, token) = peer_token_file();
    // The peer port is known only once bound, so the replica names
    // itself through a port taken for it first.
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        probe.local_addr().unwrap().port()
    };
    let listen = format!("127.0.0.1:{port}");
    let a = replica(&[
        "--peer-listen",
        &listen,
        "--peers",
        &listen,
        "--peer-token-file",
        &token,
    ])
    .await;
    let status = a
        .process
        .wait_status("itself among its peers", |s| s["peers"][0]["up"] == true)
        .await;
    assert_eq!(status["peers"][0]["self"], true, "{status:#}");
    assert_eq!(
        status["peers"][0]["instance"], status["instance"],
        "{status:#}"
    );
    a.process
        .metrics_showing(&["portcullis_tunnel_peers{state=\"up\"} 0".to_owned()])
        .await;
}

/// A short or missing peer token stops the server at start, naming it.
#[tokio::test]
async fn a_missing_or_short_peer_token_is_refused_at_start() {
    let dir = tokens_dir();
    let short = dir.path().join("short");
    std::fs::write(&short, "tiny\n").unwrap();
    let short = short.display().to_string();
    for (extra, message) in [
        (&[][..], "need the peers' token"),
        (&["--peer-token-file", &short][..], "at least 16 characters"),
    ] {
        let out = server_command(&dir)
            .args(["--peers", "127.0.0.1:1"])
            .args(extra)
            .env_remove("PORTCULLIS_PEER_TOKEN")
            .output()
            .unwrap();
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(message), "{stderr}");
    }
}

/// A rolling restart: the replica holding the tunnel is stopped while a
/// request a peer forwarded to it is in flight. It stops taking new
/// ones, finishes that one (through its tunnel, which closes only
/// after), and exits cleanly; the forwarding replica's client gets the
/// answer.
#[tokio::test]
async fn a_stopping_peer_finishes_the_requests_forwarded_to_it() {
    let (up, mut arrived, release) = upstream::holding().await;
    let (_token_dir, token) = peer_token_file();
    let (a, mut b, _client) = holding_for_a_peer(&up.url(), &token).await;
    let in_flight = a.slow_in_flight("rt-a", &mut arrived).await;
    b.process.signal("TERM");
    b.process.wait_for_log("shutting down").await;
    release.notify_one();
    let answer = in_flight.await.unwrap();
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    assert_eq!(answer.body, "done /slow");
    let status = b.process.wait_exit(Duration::from_secs(20)).await;
    assert!(status.success(), "{status:?}");
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
    let (_token_dir, token) = peer_token_file();
    let (a, mut b, _client) = holding_for_a_peer(&up.url(), &token).await;

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
    let (token_dir, token) = peer_token_file();
    let (_, _, b_tls, a_tls) = peer_tls(token_dir.path());
    let listen = ["--peer-listen", "127.0.0.1:0", "--peer-token-file", &token];
    let b = replica(&[&listen[..], &strs(&b_tls)].concat()).await;
    let relay = super::Relay::start(b.process.addrs["peer listening"]).await;
    let _rt = b
        .client("rt-a", TOKENS[0].1, &["--upstream", &echo.url()])
        .await;
    let mut a = listing_by_name(relay.addr.port(), &token, &a_tls).await;

    // From now on B takes connections and says nothing (a process that
    // hangs); A's polls go on over the connection it has.
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
/// peer CA, and the dialling side also checks the name it listed the
/// peer by. The peer port refuses plain HTTP, a client without a
/// certificate, and one from another CA, and goes on serving.
#[tokio::test]
async fn peers_with_certificates_speak_mutual_tls() {
    use crate::support::tls::{self, TestPki};
    let echo = upstream::echo("behind-b").await;
    let (token_dir, token) = peer_token_file();
    // B's certificate names only `localhost`; A presents its own from the
    // same CA.
    let (pki, a_pki, b_tls, a_tls) = peer_tls(token_dir.path());
    let mut b = replica(
        &[
            &["--peer-listen", "127.0.0.1:0", "--peer-token-file", &token][..],
            &strs(&b_tls),
        ]
        .concat(),
    )
    .await;
    let b_peer = b.process.addrs["peer listening"];
    let _rt = b
        .client("rt-a", TOKENS[0].1, &["--upstream", &echo.url()])
        .await;
    // Listed by the name its certificate carries: up, and forwarded to.
    let a = listing_by_name(b_peer.port(), &token, &a_tls).await;
    let answer = a.get("rt-a", "/over-tls").await;
    assert_eq!(answer.status, 200, "{:?}", answer.body);
    assert_eq!(answer.json()["upstream"], "behind-b");
    assert_eq!(answer.json()["target"], "/over-tls");

    // Listed by an address its certificate does not name: never up, and
    // the status says why.
    let by_address = b_peer.to_string();
    let wrong = replica(
        &[
            &["--peers", &by_address, "--peer-token-file", &token][..],
            &strs(&a_tls),
        ]
        .concat(),
    )
    .await;
    let status = wrong
        .process
        .wait_status("peer B refused for its name", |s| {
            s["peers"][0]["error"]
                .as_str()
                .is_some_and(|e| e.contains("TLS handshake"))
        })
        .await;
    assert_eq!(status["peers"][0]["up"], false, "{status:#}");
    let error = status["peers"][0]["error"].as_str().unwrap();
    assert!(error.contains("not valid for name"), "{error}");
    assert_eq!(wrong.get("rt-a", "/x").await.status, 503);

    // The port by hand: plain HTTP is told it speaks TLS; TLS without a
    // certificate, or with one from another CA, fails the handshake.
    let plain = client::raw(b_peer, b"GET /runtimes HTTP/1.1\r\nhost: x\r\n\r\n").await;
    assert!(plain.starts_with("HTTP/1.1 400"), "{plain}");
    assert!(plain.contains("speaks TLS"), "{plain}");
    let none = tls::https_get(
        b_peer,
        "localhost",
        &pki.ca_pem,
        &[b"http/1.1"],
        "/runtimes",
    )
    .await;
    assert!(none.is_err(), "{none:?}");
    let stranger = TestPki::for_names(&["localhost"]);
    let other = tls::https_get_as(
        b_peer,
        "localhost",
        &pki.ca_pem,
        &stranger,
        "/runtimes",
        &[],
    )
    .await;
    assert!(other.is_err(), "{other:?}");
    b.process.wait_for_log("peer connection refused").await;
    // A peer's certificate and the token: listed, after all that.
    let token_header = [("x-portcullis-peer-token", "peer-token-0123456789")];
    let (_, listed) = tls::https_get_as(
        b_peer,
        "localhost",
        &pki.ca_pem,
        &a_pki,
        "/runtimes",
        &token_header,
    )
    .await
    .unwrap();
    assert_eq!(listed.status, 200, "{:?}", listed.body);
    assert_eq!(listed.json()["runtimes"], serde_json::json!(["rt-a"]));
}
