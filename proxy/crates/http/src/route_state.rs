//! Each route's live state: its rate limit's due times, its mirror's
//! counts, its auth service's cache of allowing answers. The policies
//! only state these features ([`portcullis_config`] is data); this builds
//! what serves them, once per pipeline.
//!
//! A reload (a ConfigMap edit elsewhere) hands a route whose feature is
//! stated as before the previous pipeline's state, so limited clients get
//! no fresh burst (as nginx keeps its zones over a reload), sessions keep
//! their cached answers and the mirror's totals keep counting. A changed
//! feature starts afresh.

use std::sync::Arc;

use crate::auth_cache::AuthCache;
use crate::mirror::Mirror;
use crate::rate_limit::RateLimit;
use portcullis_config::{Config, Route};

/// One route's live state; `None` where the route has no such feature.
#[derive(Debug, Default, Clone)]
pub struct RouteState {
    /// The rate limit's due times.
    pub rate_limit: Option<Arc<RateLimit>>,
    /// The mirror's share and counts.
    pub mirror: Option<Arc<Mirror>>,
    /// The auth request's allowing answers.
    pub auth_cache: Option<Arc<AuthCache>>,
}

/// The state of each of `config`'s routes, by route index: carried from
/// `previous` (its config and states) where the route of the same name
/// states the feature the same way, else new.
pub fn build(config: &Config, previous: Option<(&Config, &[RouteState])>) -> Vec<RouteState> {
    config
        .routes
        .iter()
        .map(|route| {
            let earlier = previous.and_then(|(old, states)| {
                let i = old.routes.iter().position(|r| r.name == route.name)?;
                Some((old, &*old.routes[i], states.get(i)?))
            });
            state_of(config, route, earlier)
        })
        .collect()
}

fn state_of(
    config: &Config,
    route: &Route,
    earlier: Option<(&Config, &Route, &RouteState)>,
) -> RouteState {
    let rate_limit = route.rate_limit.as_ref().map(|spec| {
        earlier
            .filter(|(_, old, _)| old.rate_limit.as_ref() == Some(spec))
            .and_then(|(_, _, state)| state.rate_limit.clone())
            .unwrap_or_else(|| {
                if spec.shared && crate::shared_limit::state().is_none() {
                    tracing::warn!(route = %route.name, "rate_limit is shared, but serve has no --state: each replica counts for itself");
                }
                Arc::new(RateLimit::from_spec(&route.name, spec))
            })
    });
    // An index names the same upstream only when the names agree.
    let same_upstream = |old: &Config, i: usize| {
        old.upstreams.get(i).map(|u| &u.name) == config.upstreams.get(i).map(|u| &u.name)
    };
    let mirror = route.mirror.as_ref().map(|spec| {
        earlier
            .filter(|(old, r, _)| {
                r.mirror.as_ref() == Some(spec) && same_upstream(old, spec.upstream)
            })
            .and_then(|(_, _, state)| state.mirror.clone())
            .unwrap_or_else(|| Arc::new(Mirror::new(spec.upstream, spec.percent)))
    });
    let auth_cache =
        route.auth_request.as_ref().and_then(|auth| {
            let spec = auth.cache.as_ref()?;
            // Answers are kept only while they are the same service's to the
            // same question.
            let kept = earlier
                .filter(|(old, r, _)| {
                    r.auth_request.as_deref() == Some(&**auth) && same_upstream(old, auth.upstream)
                })
                .and_then(|(_, _, state)| state.auth_cache.clone());
            Some(kept.unwrap_or_else(|| {
                Arc::new(AuthCache::new(spec.ttl, spec.key.clone(), spec.per_uri))
            }))
        });
    RouteState {
        rate_limit,
        mirror,
        auth_cache,
    }
}
