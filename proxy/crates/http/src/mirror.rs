//! A route's `mirror` (Envoy's `request_mirror_policies`, nginx's
//! `mirror`): a share of its requests is also sent to another upstream,
//! a new version taking real traffic before it serves any. The mirror's
//! answers are read and dropped; the client never waits for them, and a
//! slow or dead mirror costs the route nothing but a bounded number of
//! requests in flight to it.
//!
//! Bodies: one in hand (a known length up to 64 KiB, read before
//! forwarding, as for retries) is sent to both; a longer or streamed one
//! is copied frame by frame as the upstream reads it (`Body::tee`), and
//! the copy is cut (the mirror's request ends unfinished) if the
//! mirror falls 256 KiB behind: the client's upload never waits on it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use http::uri::PathAndQuery;
use http::{HeaderMap, Method};

use portcullis_forward::Body;
use portcullis_forward::{Outgoing, UpstreamPool};

/// Mirrored requests in flight per route beyond which more are skipped:
/// a mirror that stops answering must not pile up requests here.
const MAX_IN_FLIGHT: usize = 64;

/// One route's mirror and its counts.
#[derive(Debug)]
pub struct Mirror {
    /// The upstream mirrored to, by index.
    pub upstream: usize,
    /// Share of the route's requests mirrored, 1 to 100.
    pub percent: u32,
    /// Requests seen, to take every `100 / percent`th evenly.
    seen: AtomicU64,
    in_flight: Arc<AtomicUsize>,
    sent: AtomicU64,
    skipped: AtomicU64,
    /// Streamed copies that fell behind and were cut.
    cut: Arc<AtomicU64>,
}

impl Mirror {
    pub fn new(upstream: usize, percent: u32) -> Mirror {
        Mirror {
            upstream,
            percent,
            seen: AtomicU64::new(0),
            in_flight: Arc::default(),
            sent: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            cut: Arc::default(),
        }
    }

    /// Whether this request is in the mirrored share: spread evenly (with
    /// 10%, one in each ten), not by chance.
    pub fn takes(&self) -> bool {
        let n = self.seen.fetch_add(1, Ordering::Relaxed);
        (n * u64::from(self.percent)) % 100 + u64::from(self.percent) >= 100
    }

    /// Counts a request in the share that could not be mirrored (its body
    /// streams, or too many mirrored requests are in flight).
    pub fn skip(&self) {
        self.skipped.fetch_add(1, Ordering::Relaxed);
    }

    /// Requests mirrored, skipped, and mirrored but cut, for the metrics.
    pub fn totals(&self) -> [(&'static str, u64); 3] {
        [
            ("sent", self.sent.load(Ordering::Relaxed)),
            ("skipped", self.skipped.load(Ordering::Relaxed)),
            ("cut", self.cut.load(Ordering::Relaxed)),
        ]
    }

    /// Takes a place among the mirrored requests in flight; with too many
    /// there already, counts the request skipped.
    fn admit(&self) -> bool {
        if self.in_flight.fetch_add(1, Ordering::Relaxed) >= MAX_IN_FLIGHT {
            self.release();
            self.skip();
            return false;
        }
        true
    }

    /// Gives back a place taken for a copy that will not be sent.
    fn release(&self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }

    /// Sends an admitted copy of a request to `pool` on a task of its
    /// own; its answer is read and dropped.
    fn send(
        &self,
        pool: Arc<UpstreamPool>,
        (method, path, headers, body): (Method, PathAndQuery, HeaderMap, Body),
    ) {
        self.sent.fetch_add(1, Ordering::Relaxed);
        let in_flight = self.in_flight.clone();
        tokio::spawn(async move {
            let out = Outgoing {
                method,
                path,
                headers,
                forwarded: Default::default(),
                body,
                affinity: None,
                own_host: false,
                upgrade: false,
            };
            if let Err(error) = pool.side_request(out).await {
                tracing::debug!(upstream = %pool.spec.name, %error, "mirrored request failed");
            }
            in_flight.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

/// Sends a copy of a request in `mirror`'s share to `pool`: a small body
/// is read first (within `timeout`) so that both get it, a longer or
/// streamed one is copied as the upstream reads it; the body to forward
/// comes back. An upgrade, or a body that cannot be copied (HTTP/3's),
/// is not mirrored.
pub async fn copy(
    mirror: &Mirror,
    pool: Arc<UpstreamPool>,
    (method, path, headers): (&Method, &PathAndQuery, &HeaderMap),
    mut body: Body,
    timeout: Duration,
) -> Result<Body, portcullis_forward::ForwardError> {
    use portcullis_forward::{MAX_BUFFERED_BODY, is_websocket_upgrade, read_small_body};
    if is_websocket_upgrade(headers) {
        mirror.skip();
        return Ok(body);
    }
    // Before the body is read or copied: a skipped request costs nothing.
    if !mirror.admit() {
        return Ok(body);
    }
    let head = |copy| (method.clone(), path.clone(), headers.clone(), copy);
    if http_body::Body::is_end_stream(&body) {
        mirror.send(pool, head(Body::empty()));
        return Ok(body);
    }
    // Read whole already (a plugin verified it): shared, whatever its size.
    if let Some(bytes) = body.in_memory() {
        mirror.send(pool, head(Body::full(bytes)));
        return Ok(body);
    }
    match http_body::Body::size_hint(&body).exact() {
        Some(n) if n <= MAX_BUFFERED_BODY => match read_small_body(body, timeout).await {
            Ok(bytes) => {
                mirror.send(pool, head(Body::full(bytes.clone())));
                Ok(Body::full(bytes))
            }
            Err(e) => {
                mirror.release();
                Err(e)
            }
        },
        _ => {
            match body.tee(mirror.cut.clone()) {
                Some(copy) => mirror.send(pool, head(Body::boxed(copy))),
                None => {
                    mirror.release();
                    mirror.skip();
                }
            }
            Ok(body)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_share_is_spread_evenly() {
        for (percent, of_ten) in [(100, 10), (50, 5), (10, 1), (30, 3)] {
            let m = Mirror::new(0, percent);
            let taken: Vec<bool> = (0..10).map(|_| m.takes()).collect();
            assert_eq!(
                taken.iter().filter(|&&t| t).count(),
                of_ten,
                "{percent}%: {taken:?}"
            );
        }
        let half = Mirror::new(0, 50);
        let taken: Vec<bool> = (0..4).map(|_| half.takes()).collect();
        assert_eq!(taken, [false, true, false, true]);
    }
}
