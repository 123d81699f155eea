//! The client a request counts as (for rate limits, `hash_on: client`
//! and spans): the connection's address, or behind a trusted proxy the
//! address that proxy saw.

use std::net::IpAddr;

use http::HeaderMap;

/// The client a request is counted as: the connection's address
/// (`peer`, or its PROXY header's), or behind a proxy that is trusted
/// (`trust_forwarded`), the last `X-Forwarded-For` entry, the one that
/// proxy appended. Earlier entries are the client's to make up.
pub fn client_of(peer: IpAddr, trust_forwarded: bool, headers: &HeaderMap) -> IpAddr {
    trust_forwarded
        .then(|| last_forwarded_for(headers))
        .flatten()
        .unwrap_or(peer)
}

/// The last address in `X-Forwarded-For` (over all its fields): the
/// client as the nearest proxy saw it, which that proxy appended. Earlier
/// entries are the client's to make up. An entry with a port (Azure's
/// `ip:port`) counts by its address.
pub fn last_forwarded_for(headers: &HeaderMap) -> Option<IpAddr> {
    let field = headers.get_all("x-forwarded-for").iter().next_back()?;
    let entry = field.to_str().ok()?.rsplit(',').next()?.trim();
    entry
        .parse::<IpAddr>()
        .ok()
        .or_else(|| entry.parse::<std::net::SocketAddr>().ok().map(|s| s.ip()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_forwarded_entry_is_the_nearest_proxys() {
        let mut h = HeaderMap::new();
        assert_eq!(last_forwarded_for(&h), None);
        h.append("x-forwarded-for", "9.9.9.9, 203.0.113.7".parse().unwrap());
        assert_eq!(last_forwarded_for(&h), Some("203.0.113.7".parse().unwrap()));
        // A proxy that adds a field of its own rather than appending.
        h.append("x-forwarded-for", "198.51.100.1:4711".parse().unwrap());
        assert_eq!(
            last_forwarded_for(&h),
            Some("198.51.100.1".parse().unwrap())
        );
        h.append("x-forwarded-for", "unknown".parse().unwrap());
        assert_eq!(last_forwarded_for(&h), None);
    }
}
