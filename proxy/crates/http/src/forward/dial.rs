//! Opening an upstream connection: resolving and dialing its addresses
//! in turn within the connect timeout, and starting hyper's HTTP/1.1 or
//! HTTP/2 client on it (the pool's dials, and the health checks').

use std::time::Duration;

use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use super::ForwardError;
use crate::body::Body;

fn handshake_failed(e: hyper::Error) -> ForwardError {
    ForwardError::Unreachable(format!("HTTP handshake: {e}"))
}

/// Starts hyper's HTTP/2 client on `io`, driven by a task of its own.
pub(super) async fn handshake_h2<T>(io: T) -> Result<http2::SendRequest<Body>, ForwardError>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        // Fat windows keep a long, fast path full (the default is 64 KiB).
        .initial_stream_window_size(4 << 20)
        .initial_connection_window_size(8 << 20)
        // Response heads as large as an HTTP/1.1 upstream's may be (h2's
        // default of 16 KiB turned a large Set-Cookie into a 502); h2
        // counts 32 bytes more per field.
        .max_header_list_size((super::h1::MAX_HEAD * 2) as u32)
        .keep_alive_interval(Duration::from_secs(20))
        .handshake(TokioIo::new(io))
        .await
        .map_err(handshake_failed)?;
    tokio::spawn(async move {
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "upstream HTTP/2 connection closed");
        }
    });
    Ok(sender)
}

/// Starts hyper's HTTP/1.1 client on `io` (for requests with a body or an
/// upgrade), driven by a task of its own.
pub(super) async fn handshake_h1<T>(io: T) -> Result<http1::SendRequest<Body>, ForwardError>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (sender, conn) = http1::Builder::new()
        // Queued: each chunk of a streamed body goes out as it is, in one
        // writev with the head or the chunk framing. Flattened, hyper
        // copied every chunk into its write buffer: a third of the CPU
        // of a chunked upload (bench/HISTORY.md, "Large bodies"). Small
        // requests without a body take the proxy's own writer (h1.rs).
        .writev(true)
        // As many fields, and as large a head, as the in-task reader
        // takes: an answer must not pass or fail by whether the request's
        // body was streamed. (Its read buffer stays hyper's ~400 KiB: cut
        // to 64 KiB, large answers came 13-25% slower.)
        .max_headers(super::h1::MAX_HEADERS)
        .max_header_size(super::h1::MAX_HEAD)
        .handshake(TokioIo::new(io))
        .await
        .map_err(handshake_failed)?;
    tokio::spawn(async move {
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "upstream connection closed");
        }
    });
    Ok(sender)
}

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
