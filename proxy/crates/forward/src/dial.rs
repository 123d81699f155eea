//! Dialing an upstream: resolving its name and connecting to its
//! addresses in turn within the connect timeout.

use std::time::Duration;

use tokio::net::TcpStream;

use super::ForwardError;

/// The least time one of a name's addresses gets before the next is
/// tried, when the connect timeout has that much left (Go's dialer gives
/// 2 s; a cluster network answers a SYN in well under a millisecond).
const LEAST_PER_ADDRESS: Duration = Duration::from_secs(1);

/// Resolves `host` now (so DNS changes are seen on every new connection)
/// and connects to the first of its addresses that answers, within
/// `budget`.
///
/// Each dial (`turn`) starts one address further along, so a name with
/// several addresses spreads connections over them, as nginx does with
/// a name's addresses. An address that refuses passes on at once; one
/// that answers nothing (a host gone, SYNs dropped) gets an equal share
/// of the time left, at least [`LEAST_PER_ADDRESS`], before the next is
/// tried, so it cannot use the whole connect timeout (Go's dialer splits
/// it the same way).
pub(super) async fn dial(
    host: &str,
    port: u16,
    budget: Duration,
    turn: usize,
) -> Result<TcpStream, ForwardError> {
    let start = tokio::time::Instant::now();
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    let mut addrs: Vec<_> = match bare.parse::<std::net::IpAddr>() {
        Ok(ip) => vec![std::net::SocketAddr::new(ip, port)],
        // The same lookup as `dns: each_address`, so the error says
        // whether the name does not exist or the resolver failed.
        Err(_) => portcullis_net::resolve::look_up(bare.to_owned(), port)
            .await
            .map_err(|e| ForwardError::Unreachable(format!("cannot resolve `{host}`: {e}")))?,
    };
    let n = addrs.len();
    if n > 1 {
        addrs.rotate_left(turn % n);
    }
    let mut last = None;
    for (i, addr) in addrs.into_iter().enumerate() {
        let left = budget.saturating_sub(start.elapsed());
        let share = (left / (n - i) as u32).max(left.min(LEAST_PER_ADDRESS));
        match tokio::time::timeout(share, connect_to(addr)).await {
            Ok(Ok(s)) => return Ok(s),
            Ok(Err(e)) => last = Some(e),
            // The last address had all the time left: the connect timeout.
            Err(_) if i + 1 == n => return Err(ForwardError::ConnectTimeout),
            Err(_) => {
                tracing::debug!(%addr, host, "no answer to connect; trying the next address");
                last = Some(format!("connect to {addr}: no answer within {share:?}"));
            }
        }
    }
    Err(ForwardError::Unreachable(last.unwrap_or_else(|| {
        format!("`{host}` resolved to no address")
    })))
}

/// A TCP connection to `addr`, or why there is none.
pub(super) async fn connect_to(addr: std::net::SocketAddr) -> Result<TcpStream, String> {
    let s = TcpStream::connect(addr)
        .await
        .map_err(|e| format!("connect to {addr}: {e}"))?;
    let _ = s.set_nodelay(true);
    Ok(s)
}
