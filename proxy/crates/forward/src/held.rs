//! What a response holds until its body ends: the upstream connection's
//! lease, the upstream's request cap, its count in flight.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// An HTTP/1.1 connection lent to a response until its body ends
/// ([`crate::pool`]'s lease), behind a trait so the body type, which holds
/// a [`Held`], needs nothing of the pool, which sends bodies: the box is
/// the one the lease already had.
pub trait Release: Send {
    /// The body was read to its end: the connection serves the next
    /// request.
    fn release(self: Box<Self>);
}

/// An upstream's requests in flight, by endpoint. Its slice boxed behind
/// the `Arc`: a thin pointer keeps [`InFlight`], in every response body,
/// 8 bytes smaller (see [`Held`]).
pub type InFlightCounts = Arc<Box<[AtomicUsize]>>;

/// Counts a request against an endpoint until dropped.
#[derive(Debug)]
pub struct InFlight(pub(super) InFlightCounts, pub(super) u32);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0[self.1 as usize].fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counts a request against its upstream's `max_requests` until dropped.
#[derive(Debug)]
pub struct Admitted(pub(super) Arc<AtomicUsize>);

impl Admitted {
    /// Counts one more request on `count`, unless `max` are in flight.
    pub(super) fn take(count: &Arc<AtomicUsize>, max: usize) -> Option<Admitted> {
        // An optimistic add, taken back when over: one atomic operation
        // for a request that is let in.
        if count.fetch_add(1, Ordering::Relaxed) >= max {
            count.fetch_sub(1, Ordering::Relaxed);
            return None;
        }
        Some(Admitted(count.clone()))
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What a forwarded response holds on to until its body ends: the
/// endpoint's in-flight count, the upstream's under `max_requests`, and,
/// for HTTP/1.1, the connection.
#[derive(Default)]
pub struct Held {
    pub(super) in_flight: Option<InFlight>,
    pub(super) admitted: Option<Admitted>,
    /// Boxed twice, a thin pointer: only exchanges through hyper's
    /// HTTP/1.1 client have a lease, and they pay one more allocation.
    pub(super) lease: Option<Box<Box<dyn Release>>>,
    /// The upstream's read timeout in milliseconds (zero: none); not a
    /// `Duration`, which would make every response's `Held` 16 bytes
    /// larger.
    pub(super) read_timeout_ms: u32,
    /// Which of the upstream's endpoints answered, plus one (0: none, or
    /// a URL template's), for the access line; it fits beside
    /// `read_timeout_ms` at no size.
    pub(super) endpoint: u32,
}

impl Held {
    /// Cuts the response body when the upstream sends nothing for
    /// `limit` while it is waited on (zero: never).
    pub fn with_read_timeout(mut self, limit: Duration) -> Held {
        self.read_timeout_ms = limit.as_millis().try_into().unwrap_or(u32::MAX);
        self
    }

    /// See [`Held::with_read_timeout`].
    pub fn read_timeout(&self) -> Duration {
        Duration::from_millis(self.read_timeout_ms.into())
    }

    /// The index of the endpoint that answered, in the upstream's
    /// endpoints; `None` for a URL template's destination.
    pub fn endpoint(&self) -> Option<usize> {
        (self.endpoint as usize).checked_sub(1)
    }

    /// The response body was read to its end: the connection can serve
    /// the next request.
    pub fn finish(&mut self) {
        if let Some(lease) = self.lease.take() {
            (*lease).release();
        }
        self.in_flight = None;
        self.admitted = None;
    }
}
