use super::*;
use std::collections::HashSet;

fn options(token: &str) -> PeerOptions {
    PeerOptions {
        listen: "127.0.0.1:0".parse().unwrap(),
        advertise: "127.0.0.1:1".into(),
        registry: portcullis_net::redis_target::RedisTarget::new(
            "--registry",
            "redis://127.0.0.1:1",
            None,
            None,
        )
        .unwrap(),
        token: token.into(),
        tls: None,
    }
}

fn peers() -> Peers {
    let options = options("a-peer-token-of-some-length");
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
    let options = options("short");
    let e = Peers::new(&options, "1-x".into(), 1).err().unwrap();
    assert!(e.to_string().contains("at least 16"), "{e}");
}

#[test]
fn a_peer_is_verified_by_the_host_it_advertises() {
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

fn holding(client: &str, port: u16) -> directory::Holding {
    directory::Holding {
        client: client.into(),
        conns: 1,
        since: 0,
        addr: format!("127.0.0.1:{port}"),
    }
}

fn ports(links: &[Arc<Link>]) -> Vec<String> {
    links.iter().map(|l| l.addr.clone()).collect()
}

#[test]
fn holders_take_turns_and_each_worker_has_its_own_link() {
    let peers = peers();
    peers.held("2-other".into(), "rt-a".into(), holding("5-c", 2));
    peers.held("3-third".into(), "rt-a".into(), holding("5-c", 3));
    let picked: HashSet<String> = (0..4)
        .map(|i| peers.holders("rt-a", i)[0].addr.clone())
        .collect();
    assert_eq!(picked.len(), 2, "{picked:?}");
    assert_eq!(peers.holders("rt-a", 0).len(), 2, "both, to try in turn");
    assert!(peers.holders("rt-b", 0).is_empty());
    // One that cannot be reached is left out for a while.
    peers.lost("127.0.0.1:2", "connect: refused");
    assert_eq!(ports(&peers.holders("rt-a", 0)), ["127.0.0.1:3"]);
    let status = peers.snapshot();
    assert_eq!(status[0].error.as_deref(), Some("connect: refused"));
    // Each worker forwards on a connection of its own.
    let (a, b) = (peers.holders("rt-a", 0), peers.holders("rt-a", 1));
    assert!(!Arc::ptr_eq(&a[0], &b[0]));
    assert!(Arc::ptr_eq(&peers.holders("rt-a", 0)[0], &a[0]));
}

#[test]
fn released_and_forgotten_servers_leave_the_map() {
    let peers = peers();
    peers.held("2-other".into(), "rt-a".into(), holding("5-c", 2));
    peers.held("2-other".into(), "rt-b".into(), holding("5-c", 2));
    peers.held("3-third".into(), "rt-b".into(), holding("5-c", 3));
    peers.released("2-other", "rt-a");
    assert!(peers.holders("rt-a", 0).is_empty());
    assert_eq!(peers.snapshot().len(), 2);
    peers.forget("2-other");
    assert_eq!(ports(&peers.holders("rt-b", 0)), ["127.0.0.1:3"]);
    assert_eq!(peers.servers(), ["3-third"]);
    let none_alive = HashSet::new();
    peers.replace(
        vec![("4-new".into(), "rt-c".into(), holding("5-c", 4))],
        &none_alive,
    );
    assert!(peers.holders("rt-b", 0).is_empty());
    assert_eq!(ports(&peers.holders("rt-c", 0)), ["127.0.0.1:4"]);
    assert_eq!(peers.servers(), ["4-new"]);
}

#[test]
fn a_live_server_missing_from_the_registry_keeps_its_runtimes_until_it_publishes_them() {
    let peers = peers();
    peers.held("2-other".into(), "rt-a".into(), holding("5-c", 2));
    peers.held("2-other".into(), "rt-b".into(), holding("5-c", 2));
    // The registry came back empty; 2-other is alive.
    let alive: HashSet<String> = ["2-other".to_owned()].into();
    peers.replace(Vec::new(), &alive);
    assert_eq!(ports(&peers.holders("rt-a", 0)), ["127.0.0.1:2"]);
    assert_eq!(ports(&peers.holders("rt-b", 0)), ["127.0.0.1:2"]);
    // It publishes rt-a again, not rt-b (let go meanwhile): once the
    // carrying time is out, rt-b goes and rt-a stays.
    peers.held("2-other".into(), "rt-a".into(), holding("5-c", 2));
    let run_out = |peers: &Peers| {
        let mut table = peers.lock();
        table
            .carried
            .values_mut()
            .for_each(|until| *until = Instant::now());
    };
    run_out(&peers);
    assert_eq!(
        peers.carried_due(),
        [("2-other".to_owned(), "rt-b".to_owned())]
    );
    peers.settle("2-other", "rt-b", false);
    assert_eq!(ports(&peers.holders("rt-a", 0)), ["127.0.0.1:2"]);
    assert!(peers.holders("rt-b", 0).is_empty());
    // A lease that lapsed while its entries stayed listed: carried, then
    // held as any once the registry still lists them.
    assert!(peers.carry("2-other"));
    assert!(!peers.carry("2-other"), "carried already");
    run_out(&peers);
    peers.settle("2-other", "rt-a", true);
    assert!(peers.carried_due().is_empty());
    assert_eq!(ports(&peers.holders("rt-a", 0)), ["127.0.0.1:2"]);
    // A server that is not alive is not carried.
    peers.replace(Vec::new(), &HashSet::new());
    assert!(peers.holders("rt-a", 0).is_empty());
}

#[test]
fn the_newest_client_wins_wherever_it_connected() {
    let peers = peers();
    peers.held(
        "2-other".into(),
        "rt-a".into(),
        holding("1700000000500-x", 2),
    );
    assert!(peers.newer_elsewhere("rt-a", "1700000000000-y"));
    assert!(!peers.newer_elsewhere("rt-a", "1700000000900-z"));
    assert!(!peers.newer_elsewhere("rt-b", "1-y"));
}

#[test]
fn the_registry_state_counts_losses() {
    let peers = peers();
    assert!(!peers.registry().up);
    peers.registry_state(None);
    assert!(peers.registry().up);
    peers.registry_state(Some("connection refused".into()));
    let state = peers.registry();
    assert!(!state.up);
    assert_eq!(state.lost, 1);
    assert_eq!(state.error.as_deref(), Some("connection refused"));
}
