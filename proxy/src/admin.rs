//! The admin listener (`127.0.0.1:9901` by default for `serve`, like
//! Envoy's; 9902 for `tunnel-server`, 9903 for `tunnel-client`): status
//! of the configuration and its reloads, Prometheus metrics, and a reload
//! on demand. It is separate from the traffic listeners so it is never
//! exposed with them.
//!
//! - `GET /status`: JSON — active config fingerprint, generation, loaded
//!   at, reload counts, last error, listeners.
//! - `GET /metrics`: Prometheus text format: configuration, listeners,
//!   plugins, and requests by route and status with their latency.
//! - `POST /reload`: reload now; 200 when applied or unchanged, 422 with the
//!   errors when rejected.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use http::{Method, Request, StatusCode};
use hyper::body::Incoming;

use crate::reload::{Outcome, Reloader, Trigger};
use portcullis_forward::UpstreamPool;
use portcullis_obs::admin_answer::{Answer, json, method_not_allowed, metric, prometheus};
use portcullis_obs::admin_http::serve_with;

/// Binds the admin listener and serves it on the current runtime until the
/// process ends.
pub async fn serve(
    addr: SocketAddr,
    access: portcullis_obs::admin_access::AdminAccess,
    reloader: Arc<Reloader>,
) -> std::io::Result<SocketAddr> {
    serve_with(
        addr,
        access,
        Arc::new(move |req| {
            let reloader = reloader.clone();
            Box::pin(async move { handle(req, &reloader).await })
        }),
    )
    .await
}

async fn handle(req: Request<Incoming>, reloader: &Reloader) -> Answer {
    let path = req.uri().path();
    let allow = match path {
        "/" | "/status" | "/metrics" | "/readyz" | "/healthz" => "GET, HEAD",
        "/reload" => "POST",
        _ => {
            return json(
                StatusCode::NOT_FOUND,
                serde_json::json!({"error": "not found", "endpoints": ["GET / (status page)", "GET /status", "GET /metrics", "GET /readyz", "GET /healthz", "POST /reload"]}),
            );
        }
    };
    // HEAD is GET without the body (hyper leaves the body out), as a
    // probe or `curl -I` expects.
    let method = if req.method() == Method::HEAD {
        &Method::GET
    } else {
        req.method()
    };
    match (method, path) {
        (&Method::GET, "/") => portcullis_obs::status_page::answer(),
        (&Method::GET, "/status") => {
            json(StatusCode::OK, crate::admin_status::status_json(reloader))
        }
        (&Method::GET, "/metrics") => prometheus(metrics(reloader)),
        // Liveness: the process answers (draining included, unlike /readyz).
        (&Method::GET, "/healthz") => json(StatusCode::OK, serde_json::json!({ "alive": true })),
        (&Method::GET, "/readyz") => {
            let ready = reloader.control().shared().is_ready();
            json(
                if ready {
                    StatusCode::OK
                } else {
                    StatusCode::SERVICE_UNAVAILABLE
                },
                serde_json::json!({ "ready": ready }),
            )
        }
        (&Method::POST, "/reload") => {
            let outcome = reloader.reload(Trigger::Admin).await;
            let (status, result) = match &outcome {
                Outcome::Applied { .. } => (StatusCode::OK, "applied"),
                Outcome::Unchanged => (StatusCode::OK, "unchanged"),
                Outcome::Rejected { .. } => (StatusCode::UNPROCESSABLE_ENTITY, "rejected"),
            };
            let mut body = serde_json::json!({ "result": result, "status": crate::admin_status::status_json(reloader) });
            if let Outcome::Rejected { message } = outcome {
                body["errors"] = message.lines().collect::<Vec<_>>().into();
            }
            json(status, body)
        }
        _ => method_not_allowed(path, allow),
    }
}

/// How many endpoints each upstream lists, as samples labelled by upstream.
fn counted_by_upstream<T>(lists: Vec<(Arc<str>, Vec<T>)>) -> Vec<(String, f64)> {
    lists
        .iter()
        .map(|(upstream, eps)| {
            (
                format!("{{upstream=\"{}\"}}", label(upstream)),
                eps.len() as f64,
            )
        })
        .collect()
}

fn unix_secs(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

use portcullis_obs::metrics::label;

fn metrics(reloader: &Reloader) -> String {
    let s = reloader.status();
    let control = reloader.control();
    let mut out = String::with_capacity(2048);
    let mut metric = |name: &str, kind: &str, help: &str, samples: &[(String, f64)]| {
        metric(&mut out, name, kind, help, samples)
    };
    metric(
        "portcullis_info",
        "gauge",
        "Build and active configuration.",
        &[(
            format!(
                "{{version=\"{}\",config_fingerprint=\"{}\"}}",
                env!("CARGO_PKG_VERSION"),
                s.fingerprint
            ),
            1.0,
        )],
    );
    metric(
        "portcullis_ready",
        "gauge",
        "1 while /readyz answers 200.",
        &[(
            String::new(),
            f64::from(u8::from(control.shared().is_ready())),
        )],
    );
    metric(
        "portcullis_config_generation",
        "gauge",
        "Generation of the active configuration (1 at start, +1 per applied reload).",
        &[(String::new(), s.generation as f64)],
    );
    metric(
        "portcullis_config_loaded_timestamp_seconds",
        "gauge",
        "When the active configuration was applied.",
        &[(String::new(), unix_secs(s.loaded_at))],
    );
    metric(
        "portcullis_config_reloads_total",
        "counter",
        "Reload attempts by result.",
        &[
            ("{result=\"applied\"}".into(), s.applied as f64),
            ("{result=\"rejected\"}".into(), s.rejected as f64),
            ("{result=\"unchanged\"}".into(), s.unchanged as f64),
        ],
    );
    metric(
        "portcullis_config_files_match_active",
        "gauge",
        "0 while the policy files hold a rejected change.",
        &[(String::new(), f64::from(u8::from(!s.pending_error)))],
    );
    if let Some(at) = s.last_rejected_at {
        metric(
            "portcullis_config_last_rejected_timestamp_seconds",
            "gauge",
            "When a reload was last rejected.",
            &[(String::new(), unix_secs(at))],
        );
    }
    let listeners = control.listeners();
    let conns: Vec<_> = listeners
        .iter()
        .map(|l| {
            (
                format!("{{listener=\"{}\"}}", label(&l.name)),
                l.connections as f64,
            )
        })
        .collect();
    metric(
        "portcullis_listener_connections",
        "gauge",
        "Client connections open.",
        &conns,
    );
    let expiries: Vec<_> = listeners
        .iter()
        .filter_map(|l| Some((l, &l.tls.as_ref()?.1)))
        .flat_map(|(l, certs)| {
            certs.iter().filter_map(move |(cert, expiry)| {
                Some((
                    format!(
                        "{{listener=\"{}\",cert=\"{}\"}}",
                        label(&l.name),
                        label(&cert.display().to_string())
                    ),
                    (*expiry)? as f64,
                ))
            })
        })
        .collect();
    if !expiries.is_empty() {
        metric(
            "portcullis_tls_certificate_expiry_timestamp_seconds",
            "gauge",
            "When each listener certificate being served expires (notAfter); alert well before.",
            &expiries,
        );
    }
    let pipeline = control.pipeline();
    metric(
        "portcullis_upstream_endpoints",
        "gauge",
        "Endpoints each upstream balances over (with dns: each_address, its hosts' addresses).",
        &counted_by_upstream(pipeline.upstream_facts(|p| match &p.spec.target {
            portcullis_config::Target::Endpoints(eps) => Some(vec![(); eps.len()]),
            portcullis_config::Target::Template(_) => None,
        })),
    );
    metric(
        "portcullis_upstream_endpoints_ejected",
        "gauge",
        "Endpoints out of the rotation after a failed connect, by upstream.",
        &counted_by_upstream(pipeline.upstream_facts(|p| Some(p.ejected()))),
    );
    let in_flight: Vec<_> = pipeline
        .upstream_facts(UpstreamPool::requests_in_flight)
        .iter()
        .map(|(upstream, (n, _))| (format!("{{upstream=\"{}\"}}", label(upstream)), *n as f64))
        .collect();
    metric(
        "portcullis_upstream_requests_in_flight",
        "gauge",
        "Requests in flight to each upstream with max_requests (its circuit breaker's count).",
        &in_flight,
    );
    let retries: Vec<_> = pipeline
        .upstream_facts(UpstreamPool::retry_totals)
        .iter()
        .flat_map(|(upstream, (retried, refused))| {
            let upstream = label(upstream);
            [
                (
                    format!("{{upstream=\"{upstream}\",outcome=\"retried\"}}"),
                    *retried as f64,
                ),
                (
                    format!("{{upstream=\"{upstream}\",outcome=\"budget_exhausted\"}}"),
                    *refused as f64,
                ),
            ]
        })
        .collect();
    let mirrored: Vec<_> = (pipeline.config().routes.iter())
        .zip(pipeline.route_states())
        .filter_map(|(r, state)| Some((label(&r.name), state.mirror.as_ref()?.totals())))
        .flat_map(|(route, totals)| {
            totals.map(|(outcome, n)| {
                (
                    format!("{{route=\"{route}\",outcome=\"{outcome}\"}}"),
                    n as f64,
                )
            })
        })
        .collect();
    metric(
        "portcullis_route_mirrored_total",
        "counter",
        "Requests in a route's mirror share: sent to the mirror, skipped (too many in flight, an upgrade), or sent and cut (the mirror fell behind a streamed body).",
        &mirrored,
    );
    if pipeline.config().tracing.is_some() {
        let spans = portcullis_obs::otlp::metric_samples();
        metric(
            "portcullis_trace_spans_total",
            "counter",
            "Spans for the collector (tracing): exported, failed (refused or not answered), dropped (too many exports in flight).",
            &spans,
        );
    }
    metric(
        "portcullis_upstream_retries_total",
        "counter",
        "retry_on's retries by upstream: made, or refused by its retry_budget (the answer at hand passed on).",
        &retries,
    );
    metric(
        "portcullis_upstream_endpoints_unhealthy",
        "gauge",
        "Endpoints failing their active health check, by upstream with a health_check.",
        &counted_by_upstream(pipeline.upstream_facts(UpstreamPool::unhealthy)),
    );
    let mut counters: Vec<_> = portcullis_plugin::counters()
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .map(|((plugin, name), v)| {
            (
                format!("{{plugin=\"{}\",name=\"{}\"}}", label(plugin), label(name)),
                *v as f64,
            )
        })
        .collect();
    counters.sort_by(|a, b| a.0.cmp(&b.0));
    metric(
        "portcullis_plugin_counter_total",
        "counter",
        "Counters plugins keep through host.count, and each plugin's failures (name=\"failures\").",
        &counters,
    );
    let gauges: Vec<_> = portcullis_plugin::filter_gauges()
        .into_iter()
        .map(|((plugin, name), v)| {
            let labels = format!(
                "{{plugin=\"{}\",name=\"{}\"}}",
                label(&plugin),
                label(&name)
            );
            (labels, v as f64)
        })
        .collect();
    if !gauges.is_empty() {
        metric(
            "portcullis_plugin_gauge",
            "gauge",
            "Gauges proxy-wasm filters define and set (proxy_define_metric), by plugin and name.",
            &gauges,
        );
    }
    let histograms = plugin_histograms();
    if !histograms.is_empty() {
        metric(
            "portcullis_plugin_histogram",
            "histogram",
            "Histograms proxy-wasm filters define and record into (proxy_define_metric), by plugin and name, in Envoy's default buckets.",
            &histograms,
        );
    }
    if let Some([loaded, compiled, refused]) = portcullis_plugin::disk_cache_outcomes() {
        metric(
            "portcullis_plugin_cache_total",
            "counter",
            "Plugin modules since start, by how the plugin cache (--plugin-cache) served them: loaded from it, compiled (the file not there, or refused), refused (there, but damaged, another user's or another module's).",
            &[
                ("{outcome=\"loaded\"}".to_owned(), loaded as f64),
                ("{outcome=\"compiled\"}".to_owned(), compiled as f64),
                ("{outcome=\"refused\"}".to_owned(), refused as f64),
            ],
        );
    }
    let bindings = crate::admin_status::plugin_bindings(&pipeline);
    let (mut peaks, mut caps, mut calls) = (Vec::new(), Vec::new(), Vec::new());
    let (mut shadow_ran, mut would_answer) = (Vec::new(), Vec::new());
    let (mut rollout_percent, mut rollout_outcomes, mut rolled_back) =
        (Vec::new(), Vec::new(), Vec::new());
    for b in bindings {
        if let Some(r) = b.rollout() {
            use portcullis_plugin::rollout::{OUTCOMES, VERSIONS};
            let labels = format!(
                "{{plugin=\"{}\",route=\"{}\",candidate=\"{}\"",
                label(b.name()),
                label(b.memory_use().0.unwrap_or("")),
                label(&r.candidate)
            );
            rollout_percent.push((format!("{labels}}}"), f64::from(r.percent)));
            let back = f64::from(u8::from(r.state == "rolled_back"));
            rolled_back.push((format!("{labels}}}"), back));
            for (version, counts) in VERSIONS.iter().zip(&r.outcomes) {
                for (outcome, n) in OUTCOMES.iter().zip(counts) {
                    let more = format!(",version=\"{version}\",outcome=\"{outcome}\"}}");
                    rollout_outcomes.push((format!("{labels}{more}"), *n as f64));
                }
            }
        }
        if let Some(s) = b.shadow() {
            let labels = |more: String| {
                let route = b.memory_use().0.unwrap_or("");
                format!(
                    "{{plugin=\"{}\",route=\"{}\"{more}}}",
                    label(b.name()),
                    label(route)
                )
            };
            shadow_ran.push((labels(",outcome=\"ran\"".into()), s.ran as f64));
            shadow_ran.push((labels(",outcome=\"skipped\"".into()), s.skipped as f64));
            shadow_ran.push((labels(",outcome=\"failed\"".into()), s.failed as f64));
            shadow_ran.push((labels(",outcome=\"timed_out\"".into()), s.timed_out as f64));
            for (status, n) in &s.would_answer {
                would_answer.push((labels(format!(",status=\"{status}\"")), *n as f64));
            }
        }
        let (route, peak, cap) = b.memory_use();
        let labels = format!(
            "{{plugin=\"{}\",route=\"{}\"}}",
            label(b.name()),
            label(route.unwrap_or(""))
        );
        peaks.push((labels.clone(), peak as f64));
        calls.push((labels.clone(), b.calls() as f64));
        caps.push((labels, cap as f64));
    }
    metric(
        "portcullis_plugin_calls_total",
        "counter",
        "Calls to the plugin on the route (route=\"\": the global chain), both hooks, since the configuration was loaded.",
        &calls,
    );
    metric(
        "portcullis_plugin_memory_peak_bytes",
        "gauge",
        "The largest memory an instance of the plugin has reached on the route (route=\"\": the global chain) since the configuration was loaded; compare with portcullis_plugin_memory_limit_bytes.",
        &peaks,
    );
    metric(
        "portcullis_plugin_memory_limit_bytes",
        "gauge",
        "The plugin's memory cap per instance on the route (its `memory`).",
        &caps,
    );
    if !rollout_percent.is_empty() {
        metric(
            "portcullis_plugin_rollout_percent",
            "gauge",
            "The share of requests a rollout (a use's `rollout`) sends to its candidate now: 0 once rolled back.",
            &rollout_percent,
        );
        metric(
            "portcullis_plugin_rollout_rolled_back",
            "gauge",
            "1 when the rollout rolled itself back (the candidate did worse than the current version), 0 otherwise.",
            &rolled_back,
        );
        metric(
            "portcullis_plugin_rollout_requests_total",
            "counter",
            "A rollout's requests since it began, by version (current, candidate) and outcome (answered, denied, failed, timed_out, upstream_5xx).",
            &rollout_outcomes,
        );
    }
    if !shadow_ran.is_empty() {
        metric(
            "portcullis_plugin_shadow_requests_total",
            "counter",
            "Requests a use in shadow mode (mode: shadow) ran on, left alone (skipped: it asked for a body it could not be given unchanged), failed or timed out on, since the configuration was loaded.",
            &shadow_ran,
        );
        metric(
            "portcullis_plugin_shadow_would_answer_total",
            "counter",
            "Answers a use in shadow mode would have made (a deny: 4xx; 444: a reset), by status; none of them sent.",
            &would_answer,
        );
    }
    if let Some(tunnels) = control.shared().tunnels() {
        // Per server, in the order given: the tunnels kept, and those up.
        let mut per_server: Vec<(String, usize, usize)> = Vec::new();
        for t in &tunnels {
            match per_server.iter_mut().find(|(s, ..)| *s == t.server) {
                Some(entry) => {
                    entry.1 += 1;
                    entry.2 += usize::from(t.up);
                }
                None => per_server.push((t.server.clone(), 1, usize::from(t.up))),
            }
        }
        let samples = |pick: fn(&(String, usize, usize)) -> usize| -> Vec<(String, f64)> {
            per_server
                .iter()
                .map(|e| (format!("{{server=\"{}\"}}", label(&e.0)), pick(e) as f64))
                .collect()
        };
        metric(
            "portcullis_tunnel_client_tunnels",
            "gauge",
            "Tunnels the client keeps to each server (--connections).",
            &samples(|e| e.1),
        );
        metric(
            "portcullis_tunnel_client_tunnels_up",
            "gauge",
            "Tunnels to each server that the server pings through.",
            &samples(|e| e.2),
        );
    }
    if let Some(state) = portcullis_http::shared_limit::state() {
        use std::sync::atomic::Ordering::Relaxed;
        metric(
            "portcullis_state_store_up",
            "gauge",
            "1 while the state store (--state) is connected; 0 while shared rate limits count locally.",
            &[(String::new(), f64::from(u8::from(state.status().up)))],
        );
        metric(
            "portcullis_rate_limit_shared_total",
            "counter",
            "Requests of shared rate limits, by where they were counted: `store` (across replicas), `local` (the store down, slow or failing).",
            &[
                (
                    "{counted=\"store\"}".to_owned(),
                    state.counted.load(Relaxed) as f64,
                ),
                (
                    "{counted=\"local\"}".to_owned(),
                    state.fell_back.load(Relaxed) as f64,
                ),
            ],
        );
    }
    portcullis_obs::metrics::render(&mut out);
    out
}

/// The samples of the filters' histograms: each one's cumulative buckets,
/// sum and count (suffixes before the labels, under the family's name).
fn plugin_histograms() -> Vec<(String, f64)> {
    let mut samples = Vec::new();
    for ((plugin, name), h) in portcullis_plugin::filter_histograms() {
        let labels = format!("plugin=\"{}\",name=\"{}\"", label(&plugin), label(&name));
        let mut cumulative = 0;
        for (le, n) in portcullis_plugin::FILTER_HISTOGRAM_BUCKETS
            .iter()
            .zip(h.buckets)
        {
            cumulative += n;
            samples.push((
                format!("_bucket{{{labels},le=\"{le}\"}}"),
                cumulative as f64,
            ));
        }
        samples.push((format!("_bucket{{{labels},le=\"+Inf\"}}"), h.count as f64));
        samples.push((format!("_sum{{{labels}}}"), h.sum));
        samples.push((format!("_count{{{labels}}}"), h.count as f64));
    }
    samples
}
