//! The tunnel server's options (its command line) and its spans' collector.

use super::*;

/// How the tunnel server runs.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Public listener.
    pub public: SocketAddr,
    /// Certificate chain and key (PEM) for HTTPS on the public listener
    /// (a wildcard certificate for `*.domain`); plain HTTP without.
    pub public_tls: Option<(PathBuf, PathBuf)>,
    /// Keep the `X-Forwarded-Proto` and `-Host` a public request brings
    /// (set by a balancer in front that terminates TLS) instead of
    /// setting them from the connection.
    pub trust_forwarded_headers: bool,
    /// Public connections start with a PROXY protocol header giving the
    /// client's address (behind a TCP balancer).
    pub proxy_protocol: bool,
    /// HTTP/3 on the public port's UDP twin (needs `public_tls`),
    /// advertised by `Alt-Svc` on HTTPS responses.
    pub http3: bool,
    /// The port `Alt-Svc` names for HTTP/3 (a balancer in front may
    /// publish it under another number); the public port by default.
    pub http3_advertised_port: Option<u16>,
    /// Tunnel connections start with a PROXY protocol header (behind a TCP
    /// balancer that would otherwise hide the clients' addresses, which the
    /// failed-token rate limit is kept by).
    pub tunnel_proxy_protocol: bool,
    /// Tunnel endpoint listener.
    pub tunnel: SocketAddr,
    /// Runtimes are reached as `<runtime-id>.<domain>`.
    pub domain: String,
    /// The tokens file (runtime id → token hash).
    pub tokens: PathBuf,
    /// Certificate chain and key (PEM) for `wss://`; plain `ws://` without.
    pub tls: Option<(PathBuf, PathBuf)>,
    /// Take QUIC tunnels too, on the tunnel port's UDP twin (needs `tls`).
    pub tunnel_quic: bool,
    /// How this server sends on its QUIC connections (tunnels, HTTP/3).
    pub quic_congestion: crate::quic::Congestion,
    /// Admin listener; `None` turns it off.
    pub admin: Option<SocketAddr>,
    /// Who may use the admin listener.
    pub admin_access: portcullis_obs::admin_access::AdminAccess,
    /// How long after SIGTERM the server keeps serving with `/readyz`
    /// answering 503, so balancers stop sending first.
    pub shutdown_delay: Duration,
    /// Worker threads, each with its own event loop.
    pub workers: usize,
    /// Public connections served at once (all workers together); more
    /// wait in the kernel's accept queue.
    pub max_connections: usize,
    /// The registry shared with other replicas, and where they forward
    /// to this one (`--registry`, `--peer-listen`, `--peer-advertise`).
    pub peers: Option<crate::peers::PeerOptions>,
    /// Public requests per client beyond which they are answered 429
    /// (`--public-rate-limit`, `COUNT/s|m|h`), and how many more at once.
    pub public_rate_limit: Option<(String, u32)>,
    /// Spans of public requests for an OpenTelemetry collector.
    pub tracing: Option<TraceOptions>,
    /// Requests a public connection carries before it is closed (0: no
    /// limit), and how long it is kept from its accept (zero: no limit):
    /// nginx's `keepalive_requests` and `keepalive_time`.
    pub public_connection_limits: (u32, Duration),
}

/// Where the tunnel server's spans go and which requests make one (the
/// routing core's `tracing`, from flags).
#[derive(Debug, Clone)]
pub struct TraceOptions {
    /// The collector's OTLP/HTTP base URL (`http://otel-collector:4318`).
    pub endpoint: String,
    /// Share of new traces recorded, 0 to 100.
    pub sample_percent: f64,
    /// The spans' `service.name`.
    pub service_name: String,
    /// Join the `traceparent` a public request brings; off, every public
    /// request starts a trace (a public client should not pick trace ids
    /// or force sampling). A peer's request is always joined.
    pub trust_incoming: bool,
    /// The longest a span waits in its batch.
    pub flush_every: Duration,
}

/// The collector's settings and pool, from `options`.
pub(super) fn tracing_from(
    options: &TraceOptions,
) -> anyhow::Result<(Arc<Tracing>, Arc<UpstreamPool>)> {
    if !(0.0..=100.0).contains(&options.sample_percent) {
        anyhow::bail!(
            "--trace-sample-percent {}: a share from 0 to 100",
            options.sample_percent
        );
    }
    let spec = portcullis_config::upstream_at("otel-collector", &options.endpoint)
        .map_err(|e| anyhow::anyhow!("--otlp-endpoint: {e}"))?;
    let spec = Arc::new(spec);
    let shared = portcullis_forward::shared_endpoints(&spec, None);
    let pool = Arc::new(UpstreamPool::new(spec, shared, None));
    let tracing = Tracing {
        upstream: 0,
        path: PathAndQuery::from_static("/v1/traces"),
        threshold: Tracing::threshold_of(options.sample_percent),
        service_name: options.service_name.as_str().into(),
        flush_every: options.flush_every,
        trust_incoming: options.trust_incoming,
    };
    Ok((Arc::new(tracing), pool))
}
