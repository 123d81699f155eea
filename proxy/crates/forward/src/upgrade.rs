//! HTTP Upgrade (WebSocket) passthrough: after both sides agreed on 101,
//! the two connections are spliced and bytes copied both ways.

use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio_util::task::TaskTracker;

/// Splices the client's and the upstream's upgraded connections on a task
/// the server's drain waits for; `what` names them in the logs (the
/// route, or on the tunnel server's public side the runtime). The routing
/// core's upgrades and the tunnel server's both splice here.
pub fn splice(
    tracker: &TaskTracker,
    client: OnUpgrade,
    upstream: OnUpgrade,
    what: std::sync::Arc<str>,
) {
    tracker.spawn(async move {
        let (client, upstream) = match tokio::try_join!(client, upstream) {
            Ok(pair) => pair,
            Err(e) => {
                tracing::warn!(upgrade = %what, error = %e, "upgrade failed");
                return;
            }
        };
        let mut client = TokioIo::new(client);
        let mut upstream = TokioIo::new(upstream);
        match tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
            Ok((up, down)) => tracing::debug!(upgrade = %what, bytes_up = up, bytes_down = down, "upgraded connection closed"),
            Err(e) => tracing::debug!(upgrade = %what, error = %e, "upgraded connection ended with an error"),
        }
    });
}
