//! An upstream's endpoints shared by the workers' pools: their
//! ejections, health and balancing schedule, carried over a reload for
//! the endpoints both configs list.

use super::*;

/// What the workers' pools of an upstream share about its endpoints.
#[derive(Clone)]
pub struct SharedEndpoints {
    /// Requests in flight per endpoint (least-requests reads them).
    pub(super) in_flight: crate::held::InFlightCounts,
    /// Endpoints out of the rotation after a failed connect.
    pub(super) ejections: Arc<Ejections>,
    /// Requests in flight to the whole upstream, counted only when it
    /// has `max_requests` or `retry_on` (the retry budget's base).
    pub(super) requests: Arc<AtomicUsize>,
    /// `retry_on`'s retries.
    pub(super) retries: Arc<RetryCounts>,
}

/// A fresh [`SharedEndpoints`] for `spec`, made once per upstream. With
/// `previous`, the same upstream before its endpoints changed, the
/// endpoints both list stay out of the rotation if they were.
pub fn shared_endpoints(spec: &Upstream, previous: Option<&UpstreamPool>) -> SharedEndpoints {
    let n = match &spec.target {
        Target::Endpoints(e) => e.len(),
        Target::Template(_) => 1,
    };
    let ejections = Ejections::new(n, spec.eject_for, spec.eject_after_5xx.unwrap_or(0));
    if let Some(old) = previous {
        for (i, j) in kept_endpoints(spec, &old.spec) {
            ejections.take_over(i, &old.ejections, j);
        }
    }
    SharedEndpoints {
        in_flight: Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect()),
        ejections: Arc::new(ejections),
        requests: Arc::new(AtomicUsize::new(0)),
        retries: Arc::default(),
    }
}

/// The endpoints `new` and `old` both list, as pairs of their indices.
pub(super) fn kept_endpoints(new: &Upstream, old: &Upstream) -> Vec<(usize, usize)> {
    let (Target::Endpoints(new), Target::Endpoints(old)) = (&new.target, &old.target) else {
        return Vec::new();
    };
    new.iter()
        .enumerate()
        .filter_map(|(i, ep)| Some((i, old.iter().position(|o| o == ep)?)))
        .collect()
}

/// nginx's smooth weighted round robin, run once over a whole cycle:
/// each endpoint index as often as its weight, spread out (3, 1 gives
/// 0 0 1 0, not 0 0 0 1).
pub(super) fn smooth_schedule(weights: &[u32]) -> Vec<u16> {
    let total: i64 = weights.iter().map(|&w| i64::from(w)).sum();
    let mut current = vec![0i64; weights.len()];
    (0..total)
        .map(|_| {
            for (c, &w) in current.iter_mut().zip(weights) {
                *c += i64::from(w);
            }
            let mut best = 0;
            for i in 1..current.len() {
                if current[i] > current[best] {
                    best = i;
                }
            }
            current[best] -= total;
            best as u16
        })
        .collect()
}
