//! Upstream connections: dialing (DNS at connect time unless `dns:
//! each_address` looked the host up already, TCP, optional TLS),
//! the HTTP handshake, and keep-alive reuse.
//!
//! A hand-rolled pool rather than hyper-util's legacy client: that client
//! clones its connector, boxes futures and hashes the destination for
//! every request, which measured as most of the proxy's per-request CPU
//! (see bench/). Here a fixed endpoint's idle connections sit in one slot
//! found by index, and a connection goes back to its slot when the
//! response body has been read to the end.
//!
//! An idle HTTP/1.1 connection is either a bare stream, for the in-task
//! exchange of bodiless requests (`h1`), or one hyper already drives; a
//! request that needs hyper (a body, an upgrade) turns a bare one into a
//! hyper connection, which stays one.

use portcullis_net::coarse_clock::{coarse_now, millis};

use super::worn::Worn;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::uri::Scheme;
use hyper::client::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use rustls_pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::TlsConnector;

use super::ForwardError;
use super::dial::{connect_to, dial};
use super::h1::{H1Conn, Io};
use crate::body::Body;
use portcullis_config::{Endpoint, Upstream};

/// Most idle connections kept per endpoint; more are closed when returned.
const MAX_IDLE_PER_ENDPOINT: usize = 512;

/// A connection checked out for one request.
pub enum Conn {
    /// An HTTP/1.1 connection used by this request alone (boxed: a
    /// response holds it, and inline it would make every response's
    /// `Held` larger, moved on every request, bodiless in-task ones too).
    H1(Box<Lease>),
    /// A handle on a shared, multiplexed HTTP/2 connection.
    H2(http2::SendRequest<Body>),
    /// A bare HTTP/1.1 connection for an in-task exchange, and the slot it
    /// returns to.
    InTask(Box<H1Conn>, Arc<Slot>),
}

impl Conn {
    /// Sends `req`; when the request never left, the error gives it back.
    pub async fn send(
        &mut self,
        req: http::Request<Body>,
    ) -> Result<
        http::Response<hyper::body::Incoming>,
        hyper::client::conn::TrySendError<http::Request<Body>>,
    > {
        match self {
            Conn::H1(lease) => lease.sender.try_send_request(req).await,
            Conn::H2(sender) => sender.try_send_request(req).await,
            Conn::InTask(..) => unreachable!("in-task connections are used by h1::exchange"),
        }
    }

    /// The lease to keep until the response body ends (HTTP/1.1 only).
    pub fn into_lease(self) -> Option<Box<dyn crate::held::Release>> {
        match self {
            Conn::H1(lease) => Some(lease),
            Conn::H2(_) | Conn::InTask(..) => None,
        }
    }
}

/// An idle HTTP/1.1 connection.
enum IdleConn {
    /// Driven by hyper, and its wear.
    Hyper(http1::SendRequest<Body>, Worn),
    /// A bare stream (its wear inside).
    Bare(Box<H1Conn>),
}

impl IdleConn {
    fn worn(&self) -> &Worn {
        match self {
            IdleConn::Hyper(_, worn) => worn,
            IdleConn::Bare(conn) => &conn.worn,
        }
    }
}

struct Idle {
    conn: IdleConn,
    /// When it was parked, by [`coarse_now`].
    since: Duration,
}

/// How long and for how many requests a connection is reused (nginx's
/// `keepalive_time` and `keepalive_requests`): past either, it is closed
/// once its request is done. Connections through a ClusterIP Service stay
/// on the pod kube-proxy picked when they were made; without an end,
/// pods that come up later get none of the pool's traffic.
#[derive(Clone, Copy, Default)]
pub struct Reuse {
    /// 0: no limit.
    max_requests: u32,
    /// Zero: no limit.
    max_age: Duration,
}

impl Reuse {
    /// The limits `spec` sets.
    pub fn of(spec: &Upstream) -> Reuse {
        Reuse {
            max_requests: spec.max_requests_per_connection,
            max_age: spec.timeouts.lifetime,
        }
    }

    /// The wear of a connection dialled now, its first request counted.
    fn fresh(&self) -> Worn {
        let deadline_ms = if self.max_age.is_zero() {
            u64::MAX
        } else {
            millis(coarse_now()).saturating_add(millis(self.max_age))
        };
        Worn::new(
            deadline_ms,
            match self.max_requests {
                0 => u32::MAX,
                n => n - 1,
            },
        )
    }
}

/// A response body gives its connection back to the endpoint's slot.
impl super::h1::Home for Slot {
    fn put_h1(&self, conn: Box<H1Conn>) {
        Slot::put_h1(self, conn);
    }
}

/// The connections of one endpoint.
#[derive(Default)]
pub struct Slot {
    idle: Mutex<Vec<Idle>>,
    /// The shared HTTP/2 connection, and its wear.
    h2: Mutex<Option<(http2::SendRequest<Body>, Worn)>>,
    /// One HTTP/2 dial at a time, its failure shared with those waiting.
    h2_dial: portcullis_net::shared_dial::SharedDial<ForwardError>,
}

impl Slot {
    /// Parks a connection whose exchange is over, or closes it (by
    /// dropping it) when it is spent.
    fn put(&self, conn: IdleConn) {
        let now = coarse_now();
        if conn.worn().spent(millis(now)) {
            return;
        }
        if let Ok(mut idle) = self.idle.lock()
            && idle.len() < MAX_IDLE_PER_ENDPOINT
        {
            idle.push(Idle { conn, since: now });
        }
    }

    /// Returns a bare connection whose last response was read whole.
    pub fn put_h1(&self, conn: Box<H1Conn>) {
        self.put(IdleConn::Bare(conn));
    }

    /// Idle HTTP/1.1 connections parked here.
    #[cfg(test)]
    pub fn idle_count(&self) -> usize {
        self.idle.lock().map_or(0, |i| i.len())
    }

    /// The last bare connection parked here, taken out.
    #[cfg(test)]
    pub fn take_bare(&self) -> Option<Box<H1Conn>> {
        match self.idle.lock().ok()?.pop()?.conn {
            IdleConn::Bare(c) => Some(c),
            IdleConn::Hyper(..) => None,
        }
    }
}

/// An HTTP/1.1 connection checked out of a slot. [`Lease::release`] puts it
/// back for reuse; dropping it closes the connection once its last
/// exchange is over.
pub struct Lease {
    sender: http1::SendRequest<Body>,
    slot: Arc<Slot>,
    worn: Worn,
}

impl crate::held::Release for Lease {
    /// Returns the connection to its slot (the response has been read).
    fn release(self: Box<Self>) {
        if self.sender.is_closed() {
            return;
        }
        let Lease { sender, slot, worn } = *self;
        slot.put(IdleConn::Hyper(sender, worn));
    }
}

/// Dials and reuses connections for one upstream.
pub struct ConnPool {
    /// One slot per fixed endpoint, by index.
    fixed: Box<[Arc<Slot>]>,
    /// Slots of URL-template destinations, by scheme and authority.
    dynamic: Mutex<HashMap<(bool, http::uri::Authority), Arc<Slot>>>,
    tls: TlsConnector,
    server_name: Option<ServerName<'static>>,
    connect_timeout: Duration,
    idle_timeout: Duration,
    reuse: Reuse,
    http2: bool,
    /// Connections dialed by name: where in the name's addresses the
    /// next dial starts.
    dials: AtomicUsize,
}

/// Which slot a request uses.
pub enum Dest<'a> {
    /// `Target::Endpoints[i]`.
    Fixed(usize, &'a Endpoint),
    /// A destination rendered from a URL template.
    Dynamic(&'a Endpoint),
}

impl Dest<'_> {
    fn endpoint(&self) -> &Endpoint {
        match self {
            Dest::Fixed(_, e) | Dest::Dynamic(e) => e,
        }
    }
}

impl ConnPool {
    /// A pool for `spec` with `fixed` endpoint slots.
    pub fn new(spec: &Upstream, fixed: usize) -> ConnPool {
        let mut tls = super::tls::client_config(&spec.tls);
        tls.alpn_protocols = if spec.http2 {
            vec![b"h2".to_vec()]
        } else {
            vec![b"http/1.1".to_vec()]
        };
        let server_name = spec
            .tls
            .server_name
            .as_ref()
            .and_then(|n| ServerName::try_from(n.clone()).ok());
        let reuse = Reuse::of(spec);
        ConnPool {
            fixed: (0..fixed).map(|_| Arc::default()).collect(),
            dynamic: Mutex::new(HashMap::new()),
            tls: TlsConnector::from(Arc::new(tls)),
            server_name,
            connect_timeout: spec.timeouts.connect,
            idle_timeout: spec.timeouts.idle,
            reuse,
            http2: spec.http2,
            dials: AtomicUsize::new(0),
        }
    }

    /// Makes fixed slot `i` the slot `j` of `old` (the same endpoint in
    /// the upstream's earlier pool), with its connections.
    pub fn take_slot(&mut self, i: usize, old: &ConnPool, j: usize) {
        self.fixed[i] = old.fixed[j].clone();
    }

    fn slot(&self, dest: &Dest) -> Arc<Slot> {
        match dest {
            Dest::Fixed(i, _) => self.fixed[*i].clone(),
            Dest::Dynamic(ep) => {
                let key = (ep.scheme == Scheme::HTTPS, ep.authority.clone());
                let mut map = self.dynamic.lock().unwrap_or_else(|p| p.into_inner());
                // Forget destinations whose connections are all gone, so a
                // template over many hosts does not grow without bound.
                if map.len() > 1024 {
                    map.retain(|_, s| {
                        Arc::strong_count(s) > 1 || s.idle.lock().is_ok_and(|i| !i.is_empty())
                    });
                }
                map.entry(key).or_default().clone()
            }
        }
    }

    /// An idle HTTP/1.1 connection of `slot` that is ready for a request.
    fn idle_h1(&self, slot: &Slot) -> Option<IdleConn> {
        let mut idle = slot.idle.lock().unwrap_or_else(|p| p.into_inner());
        let now = coarse_now();
        // The oldest are first: drop those idle too long.
        let expired = idle
            .iter()
            .take_while(|c| now.saturating_sub(c.since) > self.idle_timeout)
            .count();
        idle.drain(..expired);
        let mut busy = Vec::new();
        let mut found = None;
        while let Some(mut c) = idle.pop() {
            // It may have grown too old while parked.
            if c.conn.worn().spent(millis(now)) {
                continue;
            }
            let usable = match &mut c.conn {
                IdleConn::Hyper(sender, _) if sender.is_closed() => continue,
                IdleConn::Hyper(sender, _) => sender.is_ready(),
                IdleConn::Bare(conn) => {
                    if !conn.is_reusable() {
                        continue;
                    }
                    true
                }
            };
            if usable {
                found = Some(c.conn);
                break;
            }
            busy.push(c);
        }
        idle.extend(busy);
        found
    }

    /// A connection for `dest`: a reused one when one is idle (then the
    /// flag is `true`), else a new one. With `in_task`, an HTTP/1.1
    /// connection comes bare when it can (an idle one hyper already drives
    /// is used as it is).
    pub async fn checkout(
        &self,
        dest: &Dest<'_>,
        fresh: bool,
        in_task: bool,
    ) -> Result<(Conn, bool), ForwardError> {
        let slot = self.slot(dest);
        if self.http2 {
            if !fresh && let Some(s) = self.shared_h2(&slot) {
                return Ok((Conn::H2(s), true));
            }
            // Boxed, as dialling below: kept out of every request's future.
            let (sender, reused) = Box::pin(self.checkout_h2(dest, &slot, fresh)).await?;
            return Ok((Conn::H2(sender), reused));
        } else if !fresh && let Some(idle) = self.idle_h1(&slot) {
            let conn = match idle {
                IdleConn::Hyper(sender, mut worn) => {
                    worn.used();
                    Conn::H1(Box::new(Lease { sender, slot, worn }))
                }
                IdleConn::Bare(mut conn) if in_task => {
                    conn.worn.used();
                    Conn::InTask(conn, slot)
                }
                IdleConn::Bare(conn) => {
                    let mut worn = conn.worn;
                    worn.used();
                    let sender = Box::pin(handshake_h1(conn.into_io())).await?;
                    Conn::H1(Box::new(Lease { sender, slot, worn }))
                }
            };
            return Ok((conn, true));
        }
        // Boxed: dialing (DNS, TCP, TLS, handshake) is a large future, and
        // keeping it inline would make every request's future that large,
        // copied on every move, even when a pooled connection is reused.
        let (io, _) = Box::pin(self.connect(dest.endpoint())).await?;
        let worn = self.reuse.fresh();
        if in_task {
            let mut conn = H1Conn::new(io);
            conn.worn = worn;
            return Ok((Conn::InTask(conn, slot), false));
        }
        let sender = Box::pin(handshake_h1(io)).await?;
        Ok((Conn::H1(Box::new(Lease { sender, slot, worn })), false))
    }

    /// The slot's HTTP/2 connection once a dial in progress is over, or a
    /// new one (`fresh`: a new one, whatever the slot has).
    async fn checkout_h2(
        &self,
        dest: &Dest<'_>,
        slot: &Slot,
        fresh: bool,
    ) -> Result<(http2::SendRequest<Body>, bool), ForwardError> {
        if fresh {
            return Ok((self.dial_h2(dest, slot).await?, false));
        }
        let dial = || async { self.dial_h2(dest, slot).await.map(|s| (s, false)) };
        let reuse = || self.shared_h2(slot).map(|s| (s, true));
        slot.h2_dial.get(reuse, dial).await
    }

    /// A new HTTP/2 connection for `dest`, which becomes the slot's shared
    /// one.
    async fn dial_h2(
        &self,
        dest: &Dest<'_>,
        slot: &Slot,
    ) -> Result<http2::SendRequest<Body>, ForwardError> {
        let (io, _) = Box::pin(self.connect(dest.endpoint())).await?;
        let worn = self.reuse.fresh();
        let sender = Box::pin(handshake_h2(io)).await?;
        *slot.h2.lock().unwrap_or_else(|p| p.into_inner()) = Some((sender.clone(), worn));
        Ok(sender)
    }

    /// The slot's HTTP/2 connection for one more request, unless it is
    /// closed or spent (then it is let go: its streams in flight finish,
    /// and it closes when the last is done).
    fn shared_h2(&self, slot: &Slot) -> Option<http2::SendRequest<Body>> {
        let mut h2 = slot.h2.lock().unwrap_or_else(|p| p.into_inner());
        let (sender, worn) = h2.as_mut()?;
        if sender.is_closed() || worn.spent(millis(coarse_now())) {
            *h2 = None;
            return None;
        }
        worn.used();
        Some(sender.clone())
    }

    /// Dials `ep`: the stream, and whether it is to speak HTTP/2.
    pub(super) async fn connect(&self, ep: &Endpoint) -> Result<(Io, bool), ForwardError> {
        let https = ep.scheme == Scheme::HTTPS;
        let host = ep.authority.host();
        let port = ep
            .authority
            .port_u16()
            .unwrap_or(if https { 443 } else { 80 });
        let dial = async {
            let tcp = match ep.address {
                // One of the host's addresses, looked up by `dns: each_address`.
                Some(addr) => connect_to(addr).await.map_err(ForwardError::Unreachable)?,
                None => {
                    let turn = self.dials.fetch_add(1, Ordering::Relaxed);
                    dial(host, port, self.connect_timeout, turn).await?
                }
            };
            if !https {
                return Ok((Io::Tcp(tcp), self.http2));
            }
            let name = match &self.server_name {
                Some(n) => n.clone(),
                None => ServerName::try_from(
                    host.trim_start_matches('[')
                        .trim_end_matches(']')
                        .to_owned(),
                )
                .map_err(|_| {
                    ForwardError::Unreachable(format!("`{host}` is not a valid TLS server name"))
                })?,
            };
            let tls = self.tls.connect(name, tcp).await.map_err(|e| {
                ForwardError::Unreachable(portcullis_net::tls_errors::explain(format!(
                    "TLS handshake with {host}:{port}: {e}"
                )))
            })?;
            let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
            if self.http2 && !h2 {
                return Err(ForwardError::Unreachable(format!(
                    "{host}:{port} did not agree to HTTP/2 (ALPN)"
                )));
            }
            Ok((Io::Tls(Box::new(tls)), h2))
        };
        match tokio::time::timeout(self.connect_timeout, dial).await {
            Ok(r) => r,
            Err(_) => Err(ForwardError::ConnectTimeout),
        }
    }
}

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
