//! Host lookups through the system resolver that tell a name that does
//! not exist from a resolver that failed.
//!
//! `tokio::net::lookup_host` (std underneath) turns every `getaddrinfo`
//! error into one opaque message. `dns: each_address` needs the
//! difference: a DNS outage (SERVFAIL, a timeout) must keep a host's last
//! addresses, while NXDOMAIN, or a name with no address (a headless
//! Service scaled to zero), means its pods are gone, and dialing their
//! old addresses would only wait out connect timeouts. Envoy's
//! `STRICT_DNS` draws the same line.

use std::ffi::{CStr, CString};
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};

/// Why a lookup gave no address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LookupError {
    /// The name does not exist, or has no address (NXDOMAIN, NODATA):
    /// an answer, not a failure.
    NoSuchName,
    /// The resolver could not answer (SERVFAIL, no server reachable, a
    /// timeout): nothing is known about the name.
    Failed(String),
}

impl std::fmt::Display for LookupError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LookupError::NoSuchName => f.write_str("no such name, or no address for it"),
            LookupError::Failed(why) => f.write_str(why),
        }
    }
}

/// The TCP addresses of `host` (a name, not an IP literal) at `port`, in
/// the resolver's order, looked up on tokio's blocking pool as
/// `lookup_host` does.
pub async fn look_up(host: String, port: u16) -> Result<Vec<SocketAddr>, LookupError> {
    tokio::task::spawn_blocking(move || getaddrinfo(&host, port))
        .await
        .unwrap_or_else(|e| Err(LookupError::Failed(format!("lookup task: {e}"))))
}

/// Frees a `getaddrinfo` result however the walk over it ends.
struct AddrInfo(*mut libc::addrinfo);

impl Drop for AddrInfo {
    fn drop(&mut self) {
        // SAFETY: the pointer came from a successful getaddrinfo and is
        // freed once, here.
        unsafe { libc::freeaddrinfo(self.0) }
    }
}

fn getaddrinfo(host: &str, port: u16) -> Result<Vec<SocketAddr>, LookupError> {
    let name = CString::new(host)
        .map_err(|_| LookupError::Failed(format!("`{host}` holds a NUL byte")))?;
    // SAFETY: all-zero is a valid addrinfo (null pointers, no flags).
    let mut hints: libc::addrinfo = unsafe { std::mem::zeroed() };
    hints.ai_family = libc::AF_UNSPEC;
    hints.ai_socktype = libc::SOCK_STREAM;
    let mut found = std::ptr::null_mut();
    // SAFETY: `name` is NUL-terminated, `hints` and `found` outlive the
    // call; no service is given, the port is set below.
    let rc = unsafe { libc::getaddrinfo(name.as_ptr(), std::ptr::null(), &hints, &mut found) };
    match rc {
        0 => {}
        libc::EAI_NONAME | libc::EAI_NODATA => return Err(LookupError::NoSuchName),
        libc::EAI_SYSTEM => {
            return Err(LookupError::Failed(
                std::io::Error::last_os_error().to_string(),
            ));
        }
        _ => {
            // SAFETY: gai_strerror returns a static NUL-terminated string.
            let why = unsafe { CStr::from_ptr(libc::gai_strerror(rc)) };
            return Err(LookupError::Failed(why.to_string_lossy().into_owned()));
        }
    }
    let list = AddrInfo(found);
    let mut addrs = Vec::new();
    let mut next = list.0;
    while !next.is_null() {
        // SAFETY: `next` is an entry of the list `list` owns.
        let ai = unsafe { &*next };
        next = ai.ai_next;
        if ai.ai_addr.is_null() {
            continue;
        }
        match ai.ai_family {
            libc::AF_INET => {
                // SAFETY: an AF_INET entry's address is a sockaddr_in.
                let sin = unsafe { &*(ai.ai_addr as *const libc::sockaddr_in) };
                let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                addrs.push(SocketAddr::from((ip, port)));
            }
            libc::AF_INET6 => {
                // SAFETY: an AF_INET6 entry's address is a sockaddr_in6.
                let sin6 = unsafe { &*(ai.ai_addr as *const libc::sockaddr_in6) };
                let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
                addrs.push(SocketAddr::V6(SocketAddrV6::new(
                    ip,
                    port,
                    sin6.sin6_flowinfo,
                    sin6.sin6_scope_id,
                )));
            }
            _ => {}
        }
    }
    if addrs.is_empty() {
        return Err(LookupError::NoSuchName);
    }
    Ok(addrs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn localhost_resolves_with_the_port_given() {
        let addrs = look_up("localhost".into(), 8080).await.unwrap();
        assert!(!addrs.is_empty());
        assert!(
            addrs
                .iter()
                .all(|a| a.port() == 8080 && a.ip().is_loopback())
        );
    }

    #[tokio::test]
    async fn a_nul_byte_is_refused_before_the_resolver() {
        let e = look_up("a\0b".into(), 80).await.unwrap_err();
        assert!(
            matches!(e, LookupError::Failed(ref why) if why.contains("NUL")),
            "{e:?}"
        );
    }
}
