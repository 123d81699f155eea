//! The routing core's `/status` JSON: the configuration, its reloads,
//! listeners, upstreams and their endpoints, plugins and their uses, and
//! a tunnel client's tunnels (what the status page at `/` shows).

use std::sync::Arc;

use crate::reload::Reloader;
use portcullis_forward::UpstreamPool;
use portcullis_obs::admin_answer::rfc3339;

/// The `/status` answer.
pub fn status_json(reloader: &Reloader) -> serde_json::Value {
    let s = reloader.status();
    let control = reloader.control();
    let pipeline = control.pipeline();
    let config = pipeline.config();
    let listeners: Vec<_> = control
        .listeners()
        .into_iter()
        .map(|l| {
            serde_json::json!({
                "name": l.name,
                "addr": l.addr.to_string(),
                "connections": l.connections,
                "max_connections": l.max_connections,
                "http3": l.http3,
                "tls": l.tls.as_ref().map(|(client_auth, certs)| serde_json::json!({
                    "client_certificates": client_auth.as_str(),
                    "certificates": certs.iter().map(|(cert, expiry)| serde_json::json!({
                        "cert": cert.display().to_string(),
                        "not_after": expiry,
                    })).collect::<Vec<_>>(),
                })),
            })
        })
        .collect();
    let mut status = serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "policies": reloader.dir().map_or_else(|| "built-in".to_owned(), |d| d.display().to_string()),
        "ready": control.shared().is_ready(),
        // Workers not heard from for 5 s: something blocks them.
        "stalled_workers": control.shared().heartbeats.stalled(),
        "draining": control.shared().is_draining(),
        "state": state_store(),
        "config": {
            "generation": s.generation,
            "fingerprint": s.fingerprint,
            "loaded_at": rfc3339(s.loaded_at),
            "listeners": listeners,
            "upstreams": config.upstreams.iter().map(|u| &*u.name).collect::<Vec<_>>(),
            // What `dns: each_address` hosts resolved to: the pods seen.
            "discovered_endpoints": config.upstreams.iter().filter(|u| u.dns != portcullis_config::Dns::Connect).map(|u| serde_json::json!({
                "upstream": &*u.name,
                "endpoints": match &u.target {
                    portcullis_config::Target::Endpoints(eps) => eps.iter().map(ToString::to_string).collect(),
                    portcullis_config::Target::Template(_) => Vec::new(),
                },
            })).collect::<Vec<_>>(),
            "ejected_endpoints": pipeline.upstream_facts(|p| Some(p.ejected())).iter().flat_map(|(upstream, eps)| {
                eps.iter().map(move |(endpoint, left)| serde_json::json!({
                    "upstream": &**upstream,
                    "endpoint": endpoint,
                    "for_ms": left.as_millis() as u64,
                }))
            }).collect::<Vec<_>>(),
            "upstream_requests": pipeline.upstream_facts(UpstreamPool::requests_in_flight).iter().map(|(upstream, (in_flight, max))| serde_json::json!({
                "upstream": &**upstream,
                "in_flight": in_flight,
                "max_requests": max,
            })).collect::<Vec<_>>(),
            "unhealthy_endpoints": pipeline.upstream_facts(UpstreamPool::unhealthy).iter().flat_map(|(upstream, eps)| {
                eps.iter().map(move |endpoint| serde_json::json!({
                    "upstream": &**upstream,
                    "endpoint": endpoint,
                }))
            }).collect::<Vec<_>>(),
            "routes": config.routes.iter().map(|r| &*r.name).collect::<Vec<_>>(),
            "rate_limits": config.routes.iter().filter_map(|r| {
                let mut limit = portcullis_http::rate_limit::describe(r.rate_limit.as_ref()?);
                limit["route"] = serde_json::json!(&*r.name);
                Some(limit)
            }).collect::<Vec<_>>(),
            "plugins": config.plugins.iter().map(|p| serde_json::json!({
                "name": &*p.name,
                "path": p.path.display().to_string(),
                "sha256": hex::encode(p.sha256),
                "failures": plugin_count(&p.name, "failures"),
                "deadline_hits": plugin_count(&p.name, "deadline_hits"),
                // What its proxy-wasm filters hold in shared data, of
                // their share (SHARED_BYTES_PER_PLUGIN).
                "shared_data_bytes": portcullis_plugin::shared_bytes(&p.name),
            })).collect::<Vec<_>>(),
            // Each use of a plugin: on a route, or the global chain.
            "plugin_uses": plugin_uses(&pipeline),
            // Each upstream's endpoints; a URL template's are made per request.
            "upstream_endpoints": config.upstreams.iter().map(|u| serde_json::json!({
                "upstream": &*u.name,
                "endpoints": match &u.target {
                    portcullis_config::Target::Endpoints(eps) => eps.iter().map(ToString::to_string).collect::<Vec<_>>(),
                    portcullis_config::Target::Template(_) => Vec::new(),
                },
                "template": matches!(u.target, portcullis_config::Target::Template(_)),
            })).collect::<Vec<_>>(),
        },
        "reloads": {
            "applied": s.applied,
            "rejected": s.rejected,
            "unchanged": s.unchanged,
            "last_duration_ms": s.last_duration.map(|d| d.as_secs_f64() * 1e3),
            "watched": s.watched.iter().map(|p| p.display().to_string()).collect::<Vec<_>>(),
        },
        "files_match_active": !s.pending_error,
        "last_error": s.last_error.as_ref().map(|f| serde_json::json!({
            "at": rfc3339(f.at),
            "trigger": f.trigger.as_str(),
            "message": f.message,
        })),
    });
    // A tunnel client's own tunnels, by slot.
    if let Some(tunnels) = control.shared().tunnels() {
        status["tunnels"] = tunnels
            .iter()
            .map(|t| {
                serde_json::json!({
                    "server": t.server,
                    "slot": t.slot,
                    "up": t.up,
                    "transport": t.transport,
                    "since": t.since.map(rfc3339),
                    "last_ping_ms_ago": t.last_ping.map(|d| d.as_millis() as u64),
                })
            })
            .collect::<Vec<_>>()
            .into();
    }
    status
}

/// A plugin's count `name` of the counters the proxy keeps for it.
fn plugin_count(plugin: &str, name: &str) -> u64 {
    portcullis_plugin::counters()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get(plugin, name)
}

/// Each plugin use once: the global chain's bindings are in every
/// route's chain.
pub fn plugin_bindings(
    pipeline: &portcullis_http::pipeline::Pipeline,
) -> Vec<&Arc<dyn portcullis_plugin::Plugin>> {
    let mut bindings: Vec<&Arc<dyn portcullis_plugin::Plugin>> = Vec::new();
    for chain in &pipeline.chains().routes {
        for b in chain.iter() {
            if !bindings.iter().any(|seen| Arc::ptr_eq(seen, b)) {
                bindings.push(b);
            }
        }
    }
    bindings
}

/// Each plugin use with its calls and memory.
fn plugin_uses(pipeline: &portcullis_http::pipeline::Pipeline) -> Vec<serde_json::Value> {
    plugin_bindings(pipeline)
        .iter()
        .map(|b| {
            let (route, peak, cap) = b.memory_use();
            serde_json::json!({
                "plugin": &**b.name(),
                "route": route,
                "calls": b.calls(),
                // Instances (a filter's VMs, a component's idle ones)
                // ready for calls: started with the workers, not on
                // their first requests.
                "instances_ready": b.ready(),
                "memory_peak_bytes": peak,
                "memory_limit_bytes": cap,
                // `rollout`: where it is, and each version's outcomes.
                "rollout": b.rollout().map(|r| rollout_json(&r)),
                // `mode: shadow`: what it ran on and would have done.
                "shadow": b.shadow().map(|s| serde_json::json!({
                    "percent": s.percent,
                    "ran": s.ran,
                    "skipped": s.skipped,
                    "failed": s.failed,
                    "timed_out": s.timed_out,
                    "would_answer": s.would_answer.iter()
                        .map(|(status, n)| serde_json::json!({"status": status, "requests": n}))
                        .collect::<Vec<_>>(),
                })),
            })
        })
        .collect()
}

/// A rollout as `/status` shows it.
fn rollout_json(r: &portcullis_plugin::RolloutReport) -> serde_json::Value {
    use portcullis_plugin::rollout::{OUTCOMES, VERSIONS};
    let outcomes: serde_json::Map<_, _> = VERSIONS
        .iter()
        .zip(&r.outcomes)
        .map(|(version, counts)| {
            let by: serde_json::Map<_, _> = OUTCOMES
                .iter()
                .zip(counts)
                .map(|(o, n)| (o.to_string(), serde_json::json!(n)))
                .collect();
            (version.to_string(), serde_json::Value::Object(by))
        })
        .collect();
    serde_json::json!({
        "candidate": &*r.candidate,
        "state": r.state,
        "percent": r.percent,
        "steps": r.steps,
        "step": r.step,
        "reason": r.reason,
        "rolled_back_at": r.rolled_back_at.map(rfc3339),
        "outcomes": outcomes,
    })
}

/// The state store (`--state`) as `/status` shows it; null without one.
fn state_store() -> serde_json::Value {
    let Some(state) = portcullis_http::shared_limit::state() else {
        return serde_json::Value::Null;
    };
    let status = state.status();
    serde_json::json!({
        "url": state.target.url,
        "state": if status.up { "up" } else { "down" },
        "since": status.since.map(rfc3339),
        "error": status.error,
        "counted": state.counted.load(std::sync::atomic::Ordering::Relaxed),
        "counted_locally": state.fell_back.load(std::sync::atomic::Ordering::Relaxed),
    })
}
