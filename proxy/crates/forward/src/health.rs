//! Active health checks: a task per upstream with `health_check` asks each
//! endpoint for the check's path every interval, on a new connection
//! made as requests' are (the same DNS, the upstream's TLS and
//! HTTP version), and marks the endpoint down after `unhealthy_after`
//! failures in a row, up again after `healthy_after` passes (2xx or 3xx).
//!
//! Passive ejection only learns of a dead endpoint from a request's
//! failed connect, and never of one that accepts connections but answers
//! 503 (a pod that lost its database, a server draining). Endpoints start
//! in: a reload or start must not wait a round of probes before serving.
//!
//! The task holds its upstream's pool weakly and ends when a reload has
//! replaced the upstream and the last request using the old pool is done.

use std::sync::{Arc, Weak};

use http::uri::PathAndQuery;
use http::{Request, StatusCode, Version, header};

use super::{UpstreamPool, pool};
use crate::body::Body;
use portcullis_config::{Endpoint, HealthCheck, Target};

/// Starts checking `pool`'s endpoints, when its upstream asks for it.
/// Called once per upstream (not per worker's pool) when a config makes
/// it, on the runtime current then.
pub fn start(pool: &Arc<UpstreamPool>) {
    let Some(check) = pool.spec.health_check.clone() else {
        return;
    };
    if !matches!(pool.spec.target, Target::Endpoints(_)) {
        return;
    }
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return;
    };
    runtime.spawn(run(Arc::downgrade(pool), check));
}

/// One endpoint's probes in a row that passed (positive) or failed.
#[derive(Clone, Copy, Default)]
struct Streak(i64);

async fn run(pool: Weak<UpstreamPool>, check: HealthCheck) {
    let mut streaks = Vec::new();
    let mut tick = tokio::time::interval(check.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let Some(pool) = pool.upgrade() else { return };
        let Target::Endpoints(eps) = &pool.spec.target else {
            return;
        };
        streaks.resize(eps.len(), Streak::default());
        let probes = eps.iter().map(|ep| probe(&pool, ep, &check));
        let results = futures_util::future::join_all(probes).await;
        for (i, result) in results.into_iter().enumerate() {
            note(&pool, &eps[i], i, result, &check, &mut streaks[i]);
        }
    }
}

/// Counts one probe's result and moves the endpoint in or out when its
/// streak reaches the threshold.
fn note(
    pool: &UpstreamPool,
    ep: &Endpoint,
    i: usize,
    result: Result<StatusCode, String>,
    check: &HealthCheck,
    streak: &mut Streak,
) {
    let passed = matches!(&result, Ok(s) if s.is_success() || s.is_redirection());
    streak.0 = match (passed, streak.0) {
        (true, n) if n > 0 => n + 1,
        (true, _) => 1,
        (false, n) if n < 0 => n - 1,
        (false, _) => -1,
    };
    let down = pool.ejections.is_down(i);
    let upstream = &*pool.spec.name;
    let endpoint = ep.to_string();
    if !down && -streak.0 >= i64::from(check.unhealthy_after) {
        pool.ejections.set_down(i, true);
        let reason = match &result {
            Ok(status) => format!("answered {}", status.as_u16()),
            Err(e) => e.clone(),
        };
        tracing::warn!(upstream, endpoint, path = %check.path, failures = -streak.0, reason, "endpoint failed its health check; out of the rotation");
    } else if down && streak.0 >= i64::from(check.healthy_after) {
        pool.ejections.set_down(i, false);
        tracing::info!(
            upstream,
            endpoint,
            passes = streak.0,
            "endpoint passed its health check; back in the rotation"
        );
    } else if !passed {
        tracing::debug!(upstream, endpoint, result = ?result, "health check failed");
    }
}

/// Asks `ep` for the check's path on a connection of its own: the
/// answer's status, or why there was none within the timeout.
async fn probe(
    pool: &UpstreamPool,
    ep: &Endpoint,
    check: &HealthCheck,
) -> Result<StatusCode, String> {
    let attempt = async {
        let (io, h2) = pool.conns.connect(ep).await.map_err(|e| e.to_string())?;
        let version = if h2 {
            Version::HTTP_2
        } else {
            Version::HTTP_11
        };
        let path = PathAndQuery::try_from(check.path.as_str()).map_err(|e| e.to_string())?;
        let mut req = Request::new(Body::empty());
        *req.uri_mut() = UpstreamPool::uri(ep, &path, version).map_err(|e| e.to_string())?;
        *req.version_mut() = version;
        let headers = req.headers_mut();
        headers.insert(
            header::USER_AGENT,
            http::HeaderValue::from_static("portcullis-health-check"),
        );
        let status = if h2 {
            let mut sender = pool::handshake_h2(io).await.map_err(|e| e.to_string())?;
            sender.send_request(req).await.map(|r| r.status())
        } else {
            headers.insert(header::HOST, ep.host_header.clone());
            headers.insert(header::CONNECTION, http::HeaderValue::from_static("close"));
            let mut sender = pool::handshake_h1(io).await.map_err(|e| e.to_string())?;
            sender.send_request(req).await.map(|r| r.status())
        };
        status.map_err(|e| super::error_chain(&e))
    };
    match tokio::time::timeout(check.timeout, attempt).await {
        Ok(result) => result,
        Err(_) => Err(format!("no answer within {:?}", check.timeout)),
    }
}
