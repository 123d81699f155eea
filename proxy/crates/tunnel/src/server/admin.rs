//! The tunnel server's own admin listener: its status page, `/status` and `/metrics`.

use super::*;

pub(super) fn admin(
    req: Request<Incoming>,
    shared: &Shared,
) -> portcullis_obs::admin_answer::Answer {
    let path = req.uri().path();
    // Both endpoints only read; HEAD is GET without the body.
    if matches!(path, "/" | "/status" | "/metrics" | "/readyz" | "/healthz")
        && !matches!(*req.method(), http::Method::GET | http::Method::HEAD)
    {
        return portcullis_obs::admin_answer::method_not_allowed(path, "GET, HEAD");
    }
    if path == "/healthz" {
        return portcullis_obs::admin_answer::json(
            StatusCode::OK,
            serde_json::json!({ "alive": true }),
        );
    }
    if path == "/readyz" {
        // Not draining, and every worker beating (a stalled one serves
        // none of its connections).
        let ready = !shared.draining.load(std::sync::atomic::Ordering::Relaxed)
            && shared.heartbeats.stalled().is_empty();
        let status = if ready {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        return portcullis_obs::admin_answer::json(status, serde_json::json!({ "ready": ready }));
    }
    let runtimes = shared.registry.snapshot();
    match path {
        "/" => portcullis_obs::status_page::answer(),
        "/status" => portcullis_obs::admin_answer::json(
            StatusCode::OK,
            serde_json::json!({
                "version": env!("CARGO_PKG_VERSION"),
                "domain": shared.suffix.trim_start_matches('.'),
                "public": {
                    "tls": shared.public_tls,
                    "trust_forwarded_headers": shared.trust_forwarded_headers,
                    "proxy_protocol": shared.proxy_protocol,
                    "http3": shared.alt_svc.is_some(),
                },
                "tunnel_endpoint": {
                    "proxy_protocol": shared.tunnel_proxy_protocol,
                    "quic": shared.tunnel_quic,
                },
                "quic_congestion": shared.quic_congestion.name(),
                "instance": shared.peers.as_ref().map(|p| p.instance.clone()),
                "registry": shared.peers.as_ref().map(|p| registry_status(p)),
                "peers": shared.peers.as_ref().map(|p| p.snapshot()),
                "runtimes": runtimes.iter().map(|r| serde_json::json!({
                    "id": r.id,
                    "connections": r.tunnels.len(),
                    "connected_since": r.tunnels.iter().map(|t| t.since).min().map(portcullis_obs::admin_answer::rfc3339),
                    "tunnels": r.tunnels.iter().map(|t| serde_json::json!({
                        "transport": t.transport,
                        "worker": t.worker,
                        "remote": t.remote.to_string(),
                        "since": portcullis_obs::admin_answer::rfc3339(t.since),
                        "rtt_ms": t.rtt.as_secs_f64() * 1e3,
                        "active_requests": t.active,
                    })).collect::<Vec<_>>(),
                })).collect::<Vec<_>>(),
            }),
        ),
        "/metrics" => {
            use portcullis_obs::admin_answer::metric;
            use portcullis_obs::metrics::label;
            let mut out = String::new();
            metric(
                &mut out,
                "portcullis_tunnel_runtimes",
                "gauge",
                "Runtimes with at least one tunnel connected.",
                &[(String::new(), runtimes.len() as f64)],
            );
            let per = |f: &dyn Fn(&RuntimeStatus) -> f64| -> Vec<(String, f64)> {
                runtimes
                    .iter()
                    .map(|r| (format!("{{runtime=\"{}\"}}", label(&r.id)), f(r)))
                    .collect()
            };
            metric(
                &mut out,
                "portcullis_tunnel_connections",
                "gauge",
                "Tunnel connections per runtime.",
                &per(&|r| r.tunnels.len() as f64),
            );
            metric(
                &mut out,
                "portcullis_tunnel_rtt_seconds",
                "gauge",
                "Smallest round trip measured among a runtime's tunnels.",
                &per(&|r| {
                    r.tunnels
                        .iter()
                        .map(|t| t.rtt.as_secs_f64())
                        .fold(f64::INFINITY, f64::min)
                }),
            );
            metric(
                &mut out,
                "portcullis_tunnel_active_requests",
                "gauge",
                "Public requests in flight per runtime.",
                &per(&|r| r.tunnels.iter().map(|t| t.active as f64).sum()),
            );
            if let Some(peers) = &shared.peers {
                let registry = peers.registry();
                metric(
                    &mut out,
                    "portcullis_tunnel_registry_up",
                    "gauge",
                    "1 while this server is connected to the shared registry (--registry), 0 while it serves from its last known map.",
                    &[(String::new(), if registry.up { 1.0 } else { 0.0 })],
                );
                metric(
                    &mut out,
                    "portcullis_tunnel_registry_lost_total",
                    "counter",
                    "Times the connection to the shared registry was lost.",
                    &[(String::new(), registry.lost as f64)],
                );
                let peers = peers.snapshot();
                metric(
                    &mut out,
                    "portcullis_tunnel_peers",
                    "gauge",
                    "Other servers holding runtimes, as the registry says.",
                    &[(String::new(), peers.len() as f64)],
                );
                let per_peer = |value: &dyn Fn(&crate::peers::PeerStatus) -> f64| {
                    peers
                        .iter()
                        .map(|p| (format!("{{peer=\"{}\"}}", label(&p.address)), value(p)))
                        .collect::<Vec<_>>()
                };
                metric(
                    &mut out,
                    "portcullis_tunnel_peer_forwarded_total",
                    "counter",
                    "Public requests passed to a peer holding the runtime's tunnel.",
                    &per_peer(&|p| p.forwarded as f64),
                );
                metric(
                    &mut out,
                    "portcullis_tunnel_peer_active_requests",
                    "gauge",
                    "Public requests passed to a peer and waiting for its answer.",
                    &per_peer(&|p| p.active_requests as f64),
                );
            }
            if shared.tracing.is_some() {
                metric(
                    &mut out,
                    "portcullis_trace_spans_total",
                    "counter",
                    "Spans for the collector (--otlp-endpoint): exported, failed (refused or not answered), dropped (too many exports in flight).",
                    &portcullis_obs::otlp::metric_samples(),
                );
            }
            portcullis_obs::metrics::render(&mut out);
            portcullis_obs::admin_answer::prometheus(out)
        }
        _ => portcullis_obs::admin_answer::json(
            StatusCode::NOT_FOUND,
            serde_json::json!({"error": "not found", "endpoints": ["GET / (status page)", "GET /status", "GET /metrics", "GET /readyz", "GET /healthz"]}),
        ),
    }
}

/// The shared registry as `/status` shows it.
fn registry_status(peers: &crate::peers::Peers) -> serde_json::Value {
    let state = peers.registry();
    serde_json::json!({
        "url": peers.registry.url,
        "state": if state.up { "up" } else { "down" },
        "since": state.since.map(portcullis_obs::admin_answer::rfc3339),
        "error": state.error,
        "lost": state.lost,
        "advertise": peers.advertise,
    })
}
