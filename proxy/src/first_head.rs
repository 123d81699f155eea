//! The deadline for a new client connection's first request head.
//!
//! hyper has one clock for request heads: it starts when hyper waits for
//! a head, which on a keep-alive connection is as soon as the previous
//! response is sent. A short value there is a slowloris cut-off but also
//! closes idle keep-alive connections early, and a balancer in front that
//! keeps its idle connections longer (60 s for AWS ALB and ingress-nginx)
//! then reuses one just as the proxy closes it: a 502 at the balancer.
//! So hyper's clock gets the keep-alive timeout (nginx's 75 s by
//! default), and this module bounds the first head of a connection with
//! the short header-read timeout, as nginx's `client_header_timeout` and
//! Envoy's `request_headers_timeout` do for a new connection.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// Set when a connection's first request head has arrived.
#[derive(Debug, Default)]
pub struct FirstRequest(AtomicBool);

impl FirstRequest {
    /// Notes that a request head arrived (called for every request: a
    /// load, and a store only the first time).
    pub fn arrived(&self) {
        if !self.0.load(Ordering::Relaxed) {
            self.0.store(true, Ordering::Relaxed);
        }
    }

    fn has_arrived(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// Drives `served` (a connection) to its end, unless no request head has
/// arrived on it (`first`) within `limit`: then the connection is dropped,
/// which closes it, and the answer is `None`.
pub async fn within<F: Future>(
    served: F,
    first: &FirstRequest,
    limit: Duration,
) -> Option<F::Output> {
    let mut served = std::pin::pin!(served);
    tokio::select! {
        biased;
        out = &mut served => return Some(out),
        () = tokio::time::sleep(limit) => {}
    }
    if first.has_arrived() {
        Some(served.await)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_connection_without_a_request_is_dropped_at_the_deadline() {
        let first = FirstRequest::default();
        let never = std::future::pending::<()>();
        let start = tokio::time::Instant::now();
        assert_eq!(within(never, &first, Duration::from_secs(10)).await, None);
        assert_eq!(start.elapsed(), Duration::from_secs(10));
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_with_a_request_lives_past_the_deadline() {
        let first = FirstRequest::default();
        first.arrived();
        let long = tokio::time::sleep(Duration::from_secs(60));
        assert_eq!(
            within(long, &first, Duration::from_secs(10)).await,
            Some(())
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_connection_that_ends_first_gives_its_output() {
        let first = FirstRequest::default();
        let quick = async { 7 };
        assert_eq!(
            within(quick, &first, Duration::from_secs(10)).await,
            Some(7)
        );
    }
}
