//! Outbound-only tunnels: a runtime in a closed cluster dials out to a
//! public tunnel server, which sends public traffic for that runtime back
//! through the tunnel into the routing core.
//!
//! The transport is a WebSocket (over TLS in production) carrying one
//! HTTP/2 connection, with the tunnel server as the HTTP/2 client: every
//! public request is one HTTP/2 stream, so many run at once over one
//! tunnel with HTTP/2's per-stream and per-connection flow control, and a
//! slow stream never stalls the others. Windows are sized for long, fat
//! paths ([`STREAM_WINDOW`], [`CONNECTION_WINDOW`]). Both sides send
//! HTTP/2 pings, so a dead peer is noticed within [`KEEPALIVE_TIMEOUT`]
//! after the last [`KEEPALIVE_INTERVAL`].
//!
//! Or the transport is QUIC ([`quic`]): a QUIC stream per public request,
//! each carrying one HTTP/1.1 exchange, so a lost packet stalls one
//! request rather than all of the tunnel's.
//!
//! The server talks to the client with a few requests of its own, marked
//! by the [`CONTROL`] header (stripped from public requests): `ping`
//! measures the round trip, `replaced` tells a client another one took
//! over its runtime id.

// Public: the tunnel client the binary's `tunnel-client` runs (bin).
pub mod client;
// Public: the tunnel servers' peer registry the binary sets up (bin).
pub mod peers;
mod quic;
// Public: the tunnel server the binary's `tunnel-server` runs, and its tests
// (bin, tests).
pub mod server;
// Public: tunnel tokens the binary issues and checks (bin).
pub mod tokens;
mod websocket;
mod ws_io;

/// The QUIC congestion controller a tunnel side uses (`--quic-congestion`),
/// and the tunnel hello's parser (for its fuzz target).
pub use quic::{Congestion, parse_hello};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};

/// A tunnel's byte stream, whatever carries it.
pub trait Io: AsyncRead + AsyncWrite + Send + Unpin + 'static {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin + 'static> Io for T {}

/// A boxed [`Io`]: the one type the HTTP/2 side sees.
pub type BoxIo = Box<dyn Io>;

/// What a client presents when it opens a tunnel.
#[derive(Clone)]
pub struct Hello {
    /// The runtime id it claims.
    pub runtime: String,
    /// Its process instance (see [`INSTANCE_HEADER`]).
    pub instance: String,
    /// Which of its connections this is (see [`SLOT_HEADER`]).
    pub slot: u32,
    /// Its token.
    pub token: String,
}

/// When a client instance started: the number its instance id begins with
/// (`<unix-ms>-<random>`); 0 when absent. The most recently started
/// instance of a runtime's client wins its tunnels.
pub(crate) fn instance_started(instance: &str) -> u128 {
    instance
        .split('-')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0)
}

impl Hello {
    /// The hello in a handshake's header fields, looked up by `field`
    /// (lower-case name → value, empty when absent).
    pub fn from_fields(field: impl Fn(&str) -> String) -> Hello {
        Hello {
            runtime: field(RUNTIME_HEADER),
            instance: field(INSTANCE_HEADER),
            slot: field(SLOT_HEADER).parse().unwrap_or(0),
            token: field(http::header::AUTHORIZATION.as_str())
                .strip_prefix("Bearer ")
                .unwrap_or("")
                .to_owned(),
        }
    }
}

/// Why the server turned a tunnel away.
#[derive(Debug)]
pub struct Refused {
    /// Status sent to the client.
    pub status: http::StatusCode,
    /// Short message sent to the client.
    pub message: &'static str,
    /// What the server logs.
    pub reason: String,
}

/// The path the tunnel endpoint accepts WebSocket handshakes on.
pub const TUNNEL_PATH: &str = "/_portcullis/tunnel";
/// Handshake header: the runtime id the client claims.
pub const RUNTIME_HEADER: &str = "x-portcullis-runtime";
/// Handshake header: identifies one client process (`<start unix ms>-<random>`),
/// so a second process for the same runtime is told apart from another
/// connection of the first, and the newer one wins.
pub const INSTANCE_HEADER: &str = "x-portcullis-instance";
/// Handshake header: which of the client's `--connections` this is. A
/// tunnel dialled again for the same slot replaces the old one at once,
/// which the server may not yet know is dead (a half-open connection).
pub const SLOT_HEADER: &str = "x-portcullis-slot";
/// Server → client: a control request rather than public traffic.
pub const CONTROL: &str = "x-portcullis-control";
/// Server → client: the public client's address.
pub const CLIENT_ADDR: &str = "x-portcullis-client";
/// Close code sent to a client whose runtime id another client took over.
pub const REPLACED: &str = "replaced";

/// HTTP/2 window per stream: several MiB, so one transfer fills a path
/// with a large bandwidth-delay product.
pub const STREAM_WINDOW: u32 = 4 << 20;
/// HTTP/2 window per tunnel connection, shared by its streams.
pub const CONNECTION_WINDOW: u32 = 16 << 20;

/// Largest request head the public side takes (HTTP/2's header list,
/// HTTP/3's field section): twice the routing core's default limit, so
/// that limit, and its JSON 431, decides. The h2 and hyper default of
/// 16 KiB refused heads with large cookies that HTTP/1.1 let through.
pub const MAX_PUBLIC_HEAD: u32 = 64 << 10;

/// Largest head either end takes from the tunnel: for requests, the most
/// a routing-core listener may be set to (`max_request_header_size` is at
/// most 1 MiB; the routing core applies its own limit); for responses,
/// above what the routing core takes from its upstreams. Both ends are
/// authenticated to each other.
pub const MAX_TUNNELED_HEAD: u32 = 1 << 20;
/// Requests one tunnel carries at once (its HTTP/2 streams, or QUIC's).
///
/// A tunnel's HTTP/2 server (and a peer link's, with its own bound) also
/// bears as many streams the peer opened and reset before they were
/// taken: h2's default is 20, beyond which it takes the peer for a
/// rapid-reset attacker (CVE-2023-44487) and ends the connection. Here
/// the peer is a tunnel server, which resets a stream for every public
/// request whose client leaves (a page closed, a balancer's timeout, a
/// load test ending), and across a WAN a stream's opening and its reset
/// arrive together: a burst of such requests ended the tunnel and every
/// request on it. All the streams in flight may be cancelled together,
/// and no more can be opened to be reset.
pub const MAX_TUNNELED_STREAMS: u32 = 4096;

/// A request counted in a tunnel's (or a peer link's) gauge of requests
/// in flight while it waits for its answer: a guard, because a request
/// whose public client leaves is dropped in that wait and must stop
/// counting too.
struct Active<'a>(&'a AtomicUsize);

impl<'a> Active<'a> {
    fn count(active: &'a AtomicUsize) -> Active<'a> {
        active.fetch_add(1, Ordering::Relaxed);
        Active(active)
    }
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// How often each side pings the other.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// How long a ping may go unanswered before the tunnel counts as dead.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);
/// Time allowed for TCP + TLS + WebSocket handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The HTTP/2 client the tunnel server speaks, to a tunnel client over
/// its tunnel and to a peer server: the tunnel's windows, heads and pings.
pub fn h2_client() -> hyper::client::conn::http2::Builder<hyper_util::rt::TokioExecutor> {
    let mut builder =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new());
    builder
        .timer(hyper_util::rt::TokioTimer::new())
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .max_concurrent_reset_streams(1024)
        // The runtime's response heads, as large as its routing core takes
        // from its upstreams.
        .max_header_list_size(MAX_TUNNELED_HEAD)
        .keep_alive_interval(KEEPALIVE_INTERVAL)
        .keep_alive_timeout(KEEPALIVE_TIMEOUT);
    builder
}
