//! HTTP Upgrade (WebSocket) passthrough: after both sides agreed on 101,
//! the two connections are spliced and bytes copied both ways.

use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio_util::task::TaskTracker;

/// Splices the client's and the upstream's upgraded connections on a task
/// the server's drain waits for.
pub fn splice(
    tracker: &TaskTracker,
    client: OnUpgrade,
    upstream: OnUpgrade,
    route: std::sync::Arc<str>,
) {
    tracker.spawn(async move {
        let (client, upstream) = match tokio::try_join!(client, upstream) {
            Ok(pair) => pair,
            Err(e) => {
                tracing::warn!(route = %route, error = %e, "upgrade failed");
                return;
            }
        };
        let mut client = TokioIo::new(client);
        let mut upstream = TokioIo::new(upstream);
        match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
            Ok((up, down)) => tracing::debug!(route = %route, bytes_up = up, bytes_down = down, "upgraded connection closed"),
            Err(e) => tracing::debug!(route = %route, error = %e, "upgraded connection ended with an error"),
        }
    });
}
