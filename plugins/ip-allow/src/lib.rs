//! CIDR allow and deny lists on the client address.
//!
//! The client is the TCP peer, or — behind `trusted_hops` proxies that
//! append to `X-Forwarded-For` — the entry the outermost trusted proxy
//! added (counting from the right), so a client cannot spoof its way in by
//! sending its own header. Deny wins over allow; with an allow list, only
//! listed addresses pass. Refusals answer 403.

use std::net::IpAddr;

use portcullis_sdk::{Decision, Plugin, RequestHead, RouteInfo};
use serde::Deserialize;

/// An address block such as `10.0.0.0/8` or `2001:db8::/32`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cidr {
    net: IpAddr,
    bits: u8,
}

impl Cidr {
    /// Parses `addr/bits` (or a bare address: one host).
    pub fn parse(s: &str) -> Result<Cidr, String> {
        let (addr, bits) = match s.split_once('/') {
            Some((a, b)) => (a, Some(b)),
            None => (s, None),
        };
        let net: IpAddr = addr
            .trim()
            .parse()
            .map_err(|_| format!("`{s}` is not an address or CIDR block"))?;
        let max = if net.is_ipv4() { 32 } else { 128 };
        let bits = match bits {
            Some(b) => b
                .trim()
                .parse::<u8>()
                .ok()
                .filter(|b| *b <= max)
                .ok_or_else(|| format!("`{s}` has a bad prefix length"))?,
            None => max,
        };
        Ok(Cidr { net, bits })
    }

    /// True when `ip` is inside the block (IPv4-mapped IPv6 counts as IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        let (a, b, width) = match (self.net, ip) {
            (IpAddr::V4(n), IpAddr::V4(i)) => (u32::from(n) as u128, u32::from(i) as u128, 32),
            (IpAddr::V6(n), IpAddr::V6(i)) => (u128::from(n), u128::from(i), 128),
            _ => return false,
        };
        let bits = u32::from(self.bits);
        if bits == 0 {
            return true;
        }
        let shift = width - bits;
        (a >> shift) == (b >> shift)
    }
}

/// The route's config.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    allow: Vec<String>,
    #[serde(default)]
    deny: Vec<String>,
    #[serde(default)]
    trusted_hops: usize,
}

fn blocks(list: &[String]) -> Result<Vec<Cidr>, String> {
    list.iter().map(|s| Cidr::parse(s)).collect()
}

/// The client address per the config's trust in `X-Forwarded-For`.
pub fn client_ip(peer: &str, xff: Option<&str>, trusted_hops: usize) -> Option<IpAddr> {
    if trusted_hops == 0 {
        return peer.parse().ok();
    }
    let entries: Vec<&str> = xff
        .unwrap_or("")
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .collect();
    // Each trusted proxy appended one entry; the outermost one's entry is
    // the client it saw. Fewer entries: the leftmost is all there is.
    let i = entries.len().saturating_sub(trusted_hops);
    entries
        .get(i)
        .or(entries.first())
        .and_then(|e| e.parse().ok())
        .or_else(|| peer.parse().ok())
}

/// The config's blocks, parsed once per instance (each instance has one
/// config, and `validate` already refused bad ones) rather than per request.
fn parsed(c: &Config) -> &'static (Vec<Cidr>, Vec<Cidr>) {
    static BLOCKS: std::sync::OnceLock<(Vec<Cidr>, Vec<Cidr>)> = std::sync::OnceLock::new();
    BLOCKS.get_or_init(|| {
        (
            blocks(&c.allow).unwrap_or_default(),
            blocks(&c.deny).unwrap_or_default(),
        )
    })
}

struct IpAllow;

impl Plugin for IpAllow {
    type Config = Config;

    fn validate(c: &Config) -> Result<(), String> {
        blocks(&c.allow)?;
        blocks(&c.deny)?;
        if c.allow.is_empty() && c.deny.is_empty() {
            return Err("give `allow` or `deny` (or both)".into());
        }
        Ok(())
    }

    fn on_request(
        c: &Config,
        req: &RequestHead,
        _route: &RouteInfo,
        _body: Option<&[u8]>,
    ) -> Decision {
        let (allow, deny) = parsed(c);
        let xff = if c.trusted_hops == 0 {
            None
        } else {
            // Every line: a proxy may add one of its own rather than append.
            req.header_joined("x-forwarded-for", ", ")
        };
        let Some(ip) = client_ip(&req.client_addr, xff.as_deref(), c.trusted_hops) else {
            return portcullis_sdk::respond(403, "client address unknown");
        };
        let denied = deny.iter().any(|b| b.contains(ip));
        let allowed = allow.is_empty() || allow.iter().any(|b| b.contains(ip));
        if denied || !allowed {
            portcullis_sdk::count("refused", 1);
            return portcullis_sdk::respond(403, "client address not allowed");
        }
        portcullis_sdk::forward()
    }
}

portcullis_sdk::plugin!(IpAllow);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidr_matching() {
        let b = Cidr::parse("10.1.0.0/16").unwrap();
        assert!(b.contains("10.1.200.3".parse().unwrap()));
        assert!(!b.contains("10.2.0.1".parse().unwrap()));
        assert!(b.contains("::ffff:10.1.0.9".parse().unwrap()));
        let v6 = Cidr::parse("2001:db8::/32").unwrap();
        assert!(v6.contains("2001:db8:1::1".parse().unwrap()));
        assert!(!v6.contains("2001:db9::1".parse().unwrap()));
        assert!(
            Cidr::parse("0.0.0.0/0")
                .unwrap()
                .contains("8.8.8.8".parse().unwrap())
        );
        assert!(Cidr::parse("10.0.0.0/33").is_err());
        assert!(Cidr::parse("ten").is_err());
    }

    #[test]
    fn forwarded_hops_are_counted_from_the_right() {
        // The client claims 1.1.1.1; the ingress appended the real peer.
        let xff = Some("1.1.1.1, 203.0.113.9");
        assert_eq!(
            client_ip("10.0.0.5", xff, 0),
            Some("10.0.0.5".parse().unwrap())
        );
        assert_eq!(
            client_ip("10.0.0.5", xff, 1),
            Some("203.0.113.9".parse().unwrap())
        );
        assert_eq!(
            client_ip("10.0.0.5", xff, 2),
            Some("1.1.1.1".parse().unwrap())
        );
        assert_eq!(
            client_ip("10.0.0.5", None, 1),
            Some("10.0.0.5".parse().unwrap())
        );
    }
}
