//! `balance: hash`: the endpoint a request's key (client address, a
//! header, a cookie) picks, by rendezvous hashing: each endpoint scores
//! the key, the highest score that is in the rotation wins. The same key
//! picks the same endpoint in every worker and every replica (the hash is
//! fixed, not keyed per process), and when an endpoint leaves (ejected,
//! failing its health check, or gone from the list) only its own keys
//! move; the others stay where their sessions are. Envoy's ring hash and
//! Maglev, and nginx's `hash ... consistent`, give the same guarantees
//! with a table; scoring every endpoint costs a few nanoseconds each,
//! nothing for the handful a Service or a pod list has.

use std::net::IpAddr;

use http::HeaderMap;

use portcullis_config::{Endpoint, HashOn};
use portcullis_net::request_key::{cookie, fnv1a, mix};

/// The hash of the key `hash_on` names in a request; `None` when the
/// request has none (no such header or cookie): it is then balanced
/// round robin.
pub fn key_hash(hash_on: &HashOn, peer: IpAddr, trust: bool, headers: &HeaderMap) -> Option<u64> {
    match hash_on {
        HashOn::Client => {
            let client = portcullis_net::client_addr::client_of(peer, trust, headers);
            let mut buf = [0u8; 16];
            Some(fnv1a(portcullis_net::request_key::ip_key(client, &mut buf)))
        }
        HashOn::Header(name) => headers.get(name).map(|v| fnv1a(v.as_bytes())),
        HashOn::Cookie(name) => cookie(headers, name).map(fnv1a),
    }
}

/// A new cookie `name` for a request that came without it: a random
/// value, the key its later requests will bring, and the `Set-Cookie`
/// that gives it to the client for `ttl`.
pub fn new_cookie(name: &str, ttl: std::time::Duration) -> (u64, Option<http::HeaderValue>) {
    let value = portcullis_obs::request_id::generate();
    let set = format!(
        "{name}={}; Path=/; Max-Age={}; HttpOnly",
        value.to_str().unwrap_or_default(),
        ttl.as_secs()
    );
    (
        fnv1a(value.as_bytes()),
        http::HeaderValue::from_str(&set).ok(),
    )
}

/// An endpoint's own seed: its authority (and address, for one of a
/// host's addresses: each pod its own keys, the same in every replica)
/// and base path, so it keeps its keys wherever it stands in the list.
pub fn endpoint_seed(ep: &Endpoint) -> u64 {
    let mut seed = fnv1a(ep.authority.as_str().as_bytes());
    if let Some(addr) = ep.address {
        seed ^= mix(fnv1a(addr.to_string().as_bytes()));
    }
    match ep.base_path.as_deref() {
        Some(base) => seed ^ mix(fnv1a(base.as_bytes())),
        None => seed,
    }
}

/// The endpoint `key` picks among those with `seeds` (and `weights`,
/// empty when all are equal), passing over those `is_out` says are out;
/// with every one out, the pick among all (a connect that may work beats
/// a certain 502, as elsewhere).
pub fn pick(key: u64, seeds: &[u64], weights: &[u32], is_out: impl Fn(usize) -> bool) -> usize {
    let best = |skip_out: bool| {
        let candidates = (0..seeds.len()).filter(|&i| !(skip_out && is_out(i)));
        if weights.is_empty() {
            candidates.max_by_key(|&i| mix(key ^ seeds[i]))
        } else {
            candidates.max_by(|&a, &b| {
                let (sa, sb) = (
                    weighted(key, seeds[a], weights[a]),
                    weighted(key, seeds[b], weights[b]),
                );
                sa.total_cmp(&sb)
            })
        }
    };
    best(true).or_else(|| best(false)).unwrap_or(0)
}

/// The order in which a request whose key is `key` (the header's or
/// cookie's value) prefers endpoints with these authorities (`host:port`,
/// equal weights), first choice first: where `balance: hash` sends it,
/// and where to when that one is out. For tools and tests that must know
/// the pick without sending requests.
pub fn preference(key: &[u8], authorities: &[&str]) -> Vec<usize> {
    let key = fnv1a(key);
    let mut order: Vec<usize> = (0..authorities.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(mix(key ^ fnv1a(authorities[i].as_bytes()))));
    order
}

/// Weighted rendezvous: `weight / -ln(u)` for the endpoint's uniform draw
/// `u` in (0, 1) wins with probability in proportion to its weight, and
/// keeps the property that an endpoint leaving moves only its own keys.
/// With equal weights it orders endpoints as the plain score does.
fn weighted(key: u64, seed: u64, weight: u32) -> f64 {
    // 53 bits of the score, shifted off zero: ln(0) would be -inf.
    let u = ((mix(key ^ seed) >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
    f64::from(weight) / -u.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seeds(n: usize) -> Vec<u64> {
        (0..n)
            .map(|i| fnv1a(format!("pod-{i}.svc:8080").as_bytes()))
            .collect()
    }

    #[test]
    fn the_preference_order_is_the_pick_order() {
        let names: Vec<String> = (0..4).map(|i| format!("pod-{i}.svc:8080")).collect();
        let authorities: Vec<&str> = names.iter().map(String::as_str).collect();
        let seeds = seeds(4);
        for k in 0..200u32 {
            let key = k.to_string();
            let order = preference(key.as_bytes(), &authorities);
            let hash = fnv1a(key.as_bytes());
            assert_eq!(order[0], pick(hash, &seeds, &[], |_| false));
            assert_eq!(order[1], pick(hash, &seeds, &[], |i| i == order[0]));
        }
    }

    #[test]
    fn keys_spread_evenly_and_stay_put() {
        let seeds = seeds(4);
        let mut counts = [0; 4];
        for k in 0..4000u32 {
            let key = fnv1a(&k.to_be_bytes());
            let i = pick(key, &seeds, &[], |_| false);
            assert_eq!(pick(key, &seeds, &[], |_| false), i);
            counts[i] += 1;
        }
        assert!(
            counts.iter().all(|&c| (800..1200).contains(&c)),
            "{counts:?}"
        );
    }

    #[test]
    fn only_the_keys_of_an_endpoint_that_leaves_move() {
        let seeds = seeds(5);
        for k in 0..2000u32 {
            let key = fnv1a(&k.to_be_bytes());
            let before = pick(key, &seeds, &[], |_| false);
            let after = pick(key, &seeds, &[], |i| i == 2);
            assert_ne!(after, 2);
            if before != 2 {
                assert_eq!(after, before, "key {k} moved");
            }
            // Every endpoint out: the pick among all.
            assert_eq!(pick(key, &seeds, &[], |_| true), before);
        }
    }

    #[test]
    fn weights_share_the_keys_in_proportion() {
        let seeds = seeds(3);
        let weights = [1, 1, 2];
        let mut counts = [0; 3];
        for k in 0..8000u32 {
            let key = fnv1a(&k.to_be_bytes());
            let i = pick(key, &seeds, &weights, |_| false);
            counts[i] += 1;
            // Equal weights pick as unweighted.
            assert_eq!(
                pick(key, &seeds, &[5, 5, 5], |_| false),
                pick(key, &seeds, &[], |_| false)
            );
            // The heavy one leaving moves only its keys.
            if i != 2 {
                assert_eq!(pick(key, &seeds, &weights, |j| j == 2), i);
            }
        }
        assert!((1700..2300).contains(&counts[0]), "{counts:?}");
        assert!((1700..2300).contains(&counts[1]), "{counts:?}");
        assert!((3600..4400).contains(&counts[2]), "{counts:?}");
    }

    #[test]
    fn a_cookie_is_found_among_others() {
        let mut h = HeaderMap::new();
        h.append("cookie", "a=1; session=abc ; b=2".parse().unwrap());
        h.append("cookie", "other=3".parse().unwrap());
        assert_eq!(cookie(&h, "session"), Some(&b"abc"[..]));
        assert_eq!(cookie(&h, "other"), Some(&b"3"[..]));
        assert_eq!(cookie(&h, "sess"), None);
        let peer: IpAddr = "10.0.0.1".parse().unwrap();
        let by_cookie = HashOn::Cookie("session".into());
        assert!(key_hash(&by_cookie, peer, false, &h).is_some());
        assert_eq!(key_hash(&by_cookie, peer, false, &HeaderMap::new()), None);
        // The client key is the address, whatever the headers.
        assert_eq!(
            key_hash(&HashOn::Client, peer, false, &h),
            key_hash(&HashOn::Client, peer, false, &HeaderMap::new())
        );
    }
}
