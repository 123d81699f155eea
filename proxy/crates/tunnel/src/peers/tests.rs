use super::*;

fn peers() -> Peers {
    let options = PeerOptions {
        listen: None,
        peers: Vec::new(),
        token: "a-peer-token-of-some-length".into(),
        tls: None,
    };
    Peers::new(&options, "1-self".into(), 2).unwrap()
}

#[test]
fn only_the_group_token_is_authentic() {
    let peers = peers();
    let mut headers = http::HeaderMap::new();
    assert!(!peers.authentic(&headers));
    headers.insert(
        PEER_TOKEN,
        HeaderValue::from_static("a-peer-token-of-some-lengtH"),
    );
    assert!(!peers.authentic(&headers));
    peers.stamp(&mut headers);
    assert!(peers.authentic(&headers));
}

#[test]
fn short_tokens_are_refused() {
    let options = PeerOptions {
        listen: None,
        peers: Vec::new(),
        token: "short".into(),
        tls: None,
    };
    let e = Peers::new(&options, "1-x".into(), 1).err().unwrap();
    assert!(e.to_string().contains("at least 16"), "{e}");
}

#[test]
fn a_peer_is_verified_by_the_host_it_was_listed_by() {
    use rustls_pki_types::ServerName;
    let name = |entry: &str| server_name(entry).to_str().into_owned();
    assert_eq!(name("tunnel-peers.ns.svc:7946"), "tunnel-peers.ns.svc");
    assert_eq!(name("10.0.0.7:7946"), "10.0.0.7");
    assert!(matches!(
        server_name("[fd00::7]:7946"),
        ServerName::IpAddress(_)
    ));
    assert_eq!(name("[fd00::7]:7946"), "fd00::7");
}

#[test]
fn a_server_never_forwards_to_itself_and_takes_turns_among_holders() {
    let peers = peers();
    {
        let mut table = peers.lock();
        for (port, instance) in [(1, "1-self"), (2, "2-other"), (3, "3-third")] {
            let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
            table.peers.insert(
                addr,
                Peer {
                    links: (0..3).map(|_| Arc::new(Link::new(addr, None))).collect(),
                    seen: Some(Seen {
                        instance: instance.into(),
                        generation: 1,
                        runtimes: ["rt-a".to_owned()].into_iter().collect(),
                        since: SystemTime::now(),
                    }),
                    error: None,
                },
            );
        }
    }
    let picked: HashSet<u16> = (0..4)
        .map(|i| peers.holders("rt-a", i)[0].addr.port())
        .collect();
    assert_eq!(picked, [2, 3].into_iter().collect());
    assert_eq!(peers.holders("rt-a", 0).len(), 2, "both, to try in turn");
    assert!(peers.holders("rt-b", 0).is_empty());
    // One that cannot be reached is left out until a poll answers.
    peers.lost("127.0.0.1:2".parse().unwrap(), "connect: refused");
    let left: Vec<u16> = peers
        .holders("rt-a", 0)
        .iter()
        .map(|l| l.addr.port())
        .collect();
    assert_eq!(left, [3]);
    // Each worker forwards on a connection of its own.
    for worker in 0..2 {
        let link = peers.holders("rt-a", worker)[0].clone();
        let table = peers.lock();
        let peer = &table.peers[&link.addr];
        assert!(Arc::ptr_eq(&link, &peer.links[worker]), "worker {worker}");
        assert!(
            !Arc::ptr_eq(&link, &peer.links[1 - worker]),
            "worker {worker}"
        );
    }
    let status = peers.snapshot();
    assert!(status[0].itself && !status[1].itself, "{status:?}");
}

#[tokio::test]
async fn an_unchanged_registry_is_answered_without_the_list() {
    let list = || vec!["rt-a".to_owned()];
    let runtimes = async |query| {
        let resp = presence(query, "9-me", (4, list));
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice::<Presence>(&bytes).unwrap().runtimes
    };
    assert_eq!(runtimes(None).await, Some(list()));
    let stale = Some("instance=9-me&generation=3");
    assert_eq!(runtimes(stale).await, Some(list()));
    let restarted = Some("instance=8-old&generation=4");
    assert_eq!(runtimes(restarted).await, Some(list()));
    let current = Some("instance=9-me&generation=4");
    assert_eq!(runtimes(current).await, None);
}
