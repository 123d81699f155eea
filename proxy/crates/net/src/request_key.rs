//! What splits requests by a key of theirs (upstream affinity, a plugin
//! rollout, a rate limit): a cookie's value, a client address's key
//! bytes, and a stable hash of a key spread over 64 bits, the same in
//! every replica and every run.

use std::net::IpAddr;

use http::HeaderMap;

/// The value of cookie `name` in the request's Cookie headers.
pub fn cookie<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h [u8]> {
    headers
        .get_all(http::header::COOKIE)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b';'))
        .find_map(|pair| {
            let pair = pair.trim_ascii();
            let eq = pair.iter().position(|&b| b == b'=')?;
            (pair[..eq].trim_ascii() == name.as_bytes()).then(|| pair[eq + 1..].trim_ascii())
        })
}

/// FNV-1a of `bytes`: stable across runs and replicas (a `HashMap`'s
/// hasher is seeded per process).
pub fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// SplitMix64's finalizer: spreads a key (and seed combined) over all 64
/// bits, so that nearby keys land far apart.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The key bytes of the client address `ip`.
pub fn ip_key(ip: IpAddr, buf: &mut [u8; 16]) -> &[u8] {
    match ip.to_canonical() {
        IpAddr::V4(v4) => {
            buf[..4].copy_from_slice(&v4.octets());
            &buf[..4]
        }
        IpAddr::V6(v6) => {
            *buf = v6.octets();
            &buf[..]
        }
    }
}
