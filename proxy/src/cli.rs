//! The command line: the commands, their flags (each with its
//! `PORTCULLIS_*` variable) and the parsers of their values.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "portcullis",
    version,
    about = "A WebAssembly-extensible edge proxy"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

// Parsed once at start and matched at once: the size of the largest
// variant (the tunnel server's many flags) costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
pub(crate) enum Command {
    /// Serve the routing core on the policies' listeners.
    #[command(after_help = "Example:\n  \
        portcullis serve --policies ./policies --admin 127.0.0.1:9901\n  \
        curl localhost:8080/healthz")]
    Serve {
        /// Directory of *.yaml policy files (a mounted ConfigMap); the
        /// built-in default policies when not given.
        #[arg(long, value_name = "DIR", env = "PORTCULLIS_POLICIES")]
        policies: Option<PathBuf>,
        /// How long in-flight requests may run after SIGTERM.
        #[arg(long, value_name = "DURATION", env = "PORTCULLIS_GRACE_PERIOD", default_value = "30s", value_parser = parse_duration)]
        grace_period: Duration,
        /// How long to keep accepting after SIGTERM while /readyz answers
        /// 503, so load balancers stop sending first.
        #[arg(long, value_name = "DURATION", env = "PORTCULLIS_SHUTDOWN_DELAY", default_value = "0s", value_parser = parse_duration)]
        shutdown_delay: Duration,
        /// Worker threads (each with its own event loop); default: one per CPU.
        #[arg(long, value_name = "N", env = "PORTCULLIS_WORKERS")]
        workers: Option<usize>,
        /// Admin listener (status, metrics, reload); `off` turns it off.
        #[arg(long, value_name = "ADDR|off", env = "PORTCULLIS_ADMIN", default_value = "127.0.0.1:9901", value_parser = parse_admin)]
        admin: Admin,
        /// File holding a bearer token (a mounted Secret, 16 characters or
        /// more) that `GET /status` and `POST /reload` on the admin
        /// listener then require (`Authorization: Bearer TOKEN`);
        /// `/metrics` and `/readyz` stay open. Read at each request.
        #[arg(long, value_name = "FILE", env = "PORTCULLIS_ADMIN_TOKEN_FILE")]
        admin_token_file: Option<PathBuf>,
        /// Reload when files in the policy directory change (SIGHUP and
        /// `POST /reload` on the admin listener reload either way).
        #[arg(long, value_name = "BOOL", env = "PORTCULLIS_WATCH", default_value_t = true, action = clap::ArgAction::Set)]
        watch: bool,
        /// Quiet time after a change before reloading.
        #[arg(long, value_name = "DURATION", env = "PORTCULLIS_WATCH_DEBOUNCE", default_value = "100ms", value_parser = parse_duration)]
        watch_debounce: Duration,
        /// How often to check the policies even without a change event
        /// (events can be lost); `0s` turns the check off.
        #[arg(long, value_name = "DURATION", env = "PORTCULLIS_WATCH_POLL", default_value = "10s", value_parser = parse_duration)]
        watch_poll: Duration,
        /// Keep compiled plugins in this directory (made if missing; an
        /// emptyDir volume in Kubernetes), so a restart loads their machine
        /// code instead of compiling them again (seconds for a Python or
        /// JavaScript plugin). Without it, plugins compile at every start.
        #[arg(long, value_name = "DIR", env = "PORTCULLIS_PLUGIN_CACHE")]
        plugin_cache: Option<PathBuf>,
        /// The state store replicas share.
        #[command(flatten)]
        state_flags: portcullis::state_flags::StateFlags,
        /// Where access lines go, and how they are batched.
        #[command(flatten)]
        access_log: portcullis::log_flags::AccessLogFlags,
    },
    /// The public side of outbound tunnels: forwards requests for
    /// `<runtime-id>.<domain>` through that runtime's tunnel.
    #[command(after_help = "Example:\n  \
        echo \"rt-a: $(portcullis hash-token < token)\" > tokens.yaml\n  \
        portcullis tunnel-server --public 0.0.0.0:80 --tunnel-listen 0.0.0.0:443 \\\n    \
        --domain tunnel.example.com --tokens tokens.yaml --cert tls.crt --key tls.key")]
    TunnelServer {
        /// Public listener (HTTPS with --public-cert and --public-key,
        /// plain HTTP without).
        #[arg(long, value_name = "ADDR", env = "PORTCULLIS_PUBLIC")]
        public: std::net::SocketAddr,
        /// Certificate chain (PEM) for the public listener: one that covers
        /// `*.<domain>`. Read again when the file changes.
        #[arg(
            long,
            value_name = "FILE",
            env = "PORTCULLIS_PUBLIC_CERT",
            requires = "public_key"
        )]
        public_cert: Option<PathBuf>,
        /// Private key (PEM) for the public listener.
        #[arg(
            long,
            value_name = "FILE",
            env = "PORTCULLIS_PUBLIC_KEY",
            requires = "public_cert"
        )]
        public_key: Option<PathBuf>,
        /// Keep the X-Forwarded-Proto and -Host that public requests bring
        /// (set by a TLS-terminating balancer in front) instead of setting
        /// them from the connection. Only behind such a balancer: a client
        /// reaching the listener directly could claim anything.
        #[arg(long, env = "PORTCULLIS_TRUST_FORWARDED_HEADERS")]
        trust_forwarded_headers: bool,
        /// Every public connection starts with a PROXY protocol header
        /// (version 1 or 2, as an AWS NLB or HAProxy sends it) giving the
        /// client's address; connections without one are closed. Only
        /// behind such a balancer: a direct client could claim any address.
        #[arg(long, env = "PORTCULLIS_PROXY_PROTOCOL")]
        proxy_protocol: bool,
        /// Serve HTTP/3 too, on the public port's UDP twin, and advertise
        /// it to HTTPS clients with Alt-Svc (needs --public-cert).
        #[arg(long, env = "PORTCULLIS_HTTP3", requires = "public_cert")]
        http3: bool,
        /// The UDP port Alt-Svc advertises for HTTP/3, when a balancer in
        /// front publishes it under another number than --public's.
        #[arg(
            long,
            value_name = "PORT",
            env = "PORTCULLIS_HTTP3_ADVERTISED_PORT",
            requires = "http3"
        )]
        http3_advertised_port: Option<u16>,
        /// Every tunnel connection starts with a PROXY protocol header
        /// (version 1 or 2) giving the client's address: behind a TCP
        /// balancer, so the failed-token rate limit counts per client and
        /// not per balancer.
        #[arg(long, env = "PORTCULLIS_TUNNEL_PROXY_PROTOCOL")]
        tunnel_proxy_protocol: bool,
        /// Tunnel endpoint (WebSocket; TLS with --cert and --key).
        #[arg(long, value_name = "ADDR", env = "PORTCULLIS_TUNNEL_LISTEN")]
        tunnel_listen: std::net::SocketAddr,
        /// Runtimes are reached as `<runtime-id>.<domain>`.
        #[arg(long, value_name = "DOMAIN", env = "PORTCULLIS_DOMAIN")]
        domain: String,
        /// YAML map of runtime id → token hash (`portcullis hash-token`);
        /// re-read when it changes.
        #[arg(long, value_name = "FILE", env = "PORTCULLIS_TOKENS")]
        tokens: PathBuf,
        /// Certificate chain (PEM) for the tunnel endpoint. Read again
        /// when the file changes.
        #[arg(long, value_name = "FILE", env = "PORTCULLIS_CERT", requires = "key")]
        cert: Option<PathBuf>,
        /// Private key (PEM) for the tunnel endpoint.
        #[arg(long, value_name = "FILE", env = "PORTCULLIS_KEY", requires = "cert")]
        key: Option<PathBuf>,
        /// Take QUIC tunnels (`tunnel-client --transport quic`) too, on
        /// the tunnel port's UDP twin, with the same certificate (needs
        /// --cert).
        #[arg(long, env = "PORTCULLIS_TUNNEL_QUIC", requires = "cert")]
        tunnel_quic: bool,
        /// How the server sends on QUIC (tunnels' uploads, HTTP/3
        /// answers): `cubic`, or `bbr`, which keeps its rate through
        /// random loss (experimental in quinn; see docs/tunnels.md).
        #[arg(long, value_name = "cubic|bbr", env = "PORTCULLIS_QUIC_CONGESTION", default_value = "cubic", value_parser = portcullis::tunnel::Congestion::parse)]
        quic_congestion: portcullis::tunnel::Congestion,
        /// How long to keep serving after SIGTERM while /readyz on the
        /// admin listener answers 503, so balancers stop sending first.
        #[arg(long, value_name = "DURATION", env = "PORTCULLIS_SHUTDOWN_DELAY", default_value = "0s", value_parser = parse_duration)]
        shutdown_delay: Duration,
        /// Admin listener (connected runtimes, metrics); `off` turns it off.
        /// 9902, not serve's 9901: a server, a client and a routing core
        /// started on one host (a local try) do not collide.
        #[arg(long, value_name = "ADDR|off", env = "PORTCULLIS_ADMIN", default_value = "127.0.0.1:9902", value_parser = parse_admin)]
        admin: Admin,
        /// File holding a bearer token (a mounted Secret, 16 characters or
        /// more) that `GET /status` and `POST /reload` on the admin
        /// listener then require (`Authorization: Bearer TOKEN`);
        /// `/metrics` and `/readyz` stay open. Read at each request.
        #[arg(long, value_name = "FILE", env = "PORTCULLIS_ADMIN_TOKEN_FILE")]
        admin_token_file: Option<PathBuf>,
        /// Worker threads (each with its own event loop); default: one per CPU.
        #[arg(long, value_name = "N", env = "PORTCULLIS_WORKERS")]
        workers: Option<usize>,
        /// Public connections served at once; more wait in the accept queue.
        #[arg(
            long,
            value_name = "N",
            env = "PORTCULLIS_MAX_CONNECTIONS",
            default_value_t = 16384
        )]
        max_connections: usize,
        /// The registry shared with other replicas and the peer link.
        #[command(flatten)]
        peer_flags: portcullis::peer_flags::PeerFlags,
        /// Where access lines go, and how they are batched.
        #[command(flatten)]
        access_log: portcullis::log_flags::AccessLogFlags,
        /// Public requests per client (`100/s`, `600/m`, `COUNT/h`) beyond
        /// which they are answered 429 with Retry-After. The client is the
        /// connection's (or PROXY header's) address, or with
        /// --trust-forwarded-headers the last X-Forwarded-For entry.
        #[arg(long, value_name = "RATE", env = "PORTCULLIS_PUBLIC_RATE_LIMIT")]
        public_rate_limit: Option<String>,
        /// Requests a client may make at once beyond the rate.
        #[arg(
            long,
            value_name = "N",
            env = "PORTCULLIS_PUBLIC_RATE_BURST",
            default_value_t = 0,
            requires = "public_rate_limit"
        )]
        public_rate_burst: u32,
        /// Send a span per public request to this OpenTelemetry collector
        /// (OTLP/HTTP: `http://otel-collector:4318`, spans POSTed to
        /// /v1/traces), the trace's first; the runtime's routing core, with
        /// its own `tracing`, records its span as a child of it.
        #[arg(long, value_name = "URL", env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
        otlp_endpoint: Option<String>,
        /// Share of new traces recorded, 0 to 100 (decimals allowed).
        #[arg(
            long,
            value_name = "PERCENT",
            env = "TRACE_SAMPLE_PERCENT",
            default_value_t = 100.0
        )]
        trace_sample_percent: f64,
        /// The spans' service.name.
        #[arg(
            long,
            value_name = "NAME",
            env = "OTEL_SERVICE_NAME",
            default_value = "portcullis-tunnel-server"
        )]
        trace_service_name: String,
        /// Join the traceparent a public request brings (and follow its
        /// sampled flag); without it every public request starts a trace,
        /// so public clients cannot pick trace ids or force sampling.
        #[arg(long, env = "TRACE_TRUST_INCOMING")]
        trace_trust_incoming: bool,
        /// The longest a span waits to go out, in milliseconds (512 go at
        /// once); the OpenTelemetry SDKs' batch delay variable.
        #[arg(long, value_name = "MS", env = "OTEL_BSP_SCHEDULE_DELAY", default_value_t = 5000, value_parser = clap::value_parser!(u64).range(1..))]
        trace_flush_ms: u64,
        /// Requests a public connection carries before it is closed (the
        /// last HTTP/1.1 answer says Connection: close, HTTP/2 gets a
        /// GOAWAY), so clients a TCP balancer keeps on one replica move
        /// on; nginx's keepalive_requests. 0: no limit.
        #[arg(
            long,
            value_name = "N",
            env = "PORTCULLIS_PUBLIC_MAX_REQUESTS_PER_CONNECTION",
            default_value_t = 1000
        )]
        public_max_requests_per_connection: u32,
        /// How long a public connection is kept from its accept before
        /// the next answer closes it the same way (nginx's keepalive_time);
        /// 0s: no limit.
        #[arg(long, value_name = "DURATION", env = "PORTCULLIS_PUBLIC_CONNECTION_LIFETIME", default_value = "1h", value_parser = parse_duration)]
        public_connection_lifetime: std::time::Duration,
    },
    /// The cluster side of a tunnel: dials out to the tunnel server and
    /// serves what comes through with the routing core.
    #[command(after_help = "Example:\n  \
        portcullis tunnel-client --server wss://tunnel.example.com --runtime-id rt-a \\\n    \
        --token-file /var/run/secrets/tunnel/token --policies /etc/portcullis/policies")]
    TunnelClient {
        /// Tunnel server URL: `wss://host[:port]` (`ws://` for testing).
        /// Repeat it (or give a comma-separated list) to keep tunnels to
        /// several servers, `--connections` to each: replicas of one
        /// tunnel service, so that any of them can carry the public
        /// requests and one can go down.
        #[arg(
            long,
            value_name = "URL",
            env = "PORTCULLIS_SERVER",
            required = true,
            value_delimiter = ','
        )]
        server: Vec<http::Uri>,
        /// This runtime's id (a DNS label).
        #[arg(long, value_name = "ID", env = "PORTCULLIS_RUNTIME_ID")]
        runtime_id: String,
        /// File holding the token (a mounted Secret); otherwise the
        /// PORTCULLIS_TOKEN environment variable.
        #[arg(long, value_name = "FILE", env = "PORTCULLIS_TOKEN_FILE")]
        token_file: Option<PathBuf>,
        /// Policy directory for the routing core (the built-in policies
        /// when neither this nor --upstream is given).
        #[arg(
            long,
            value_name = "DIR",
            env = "PORTCULLIS_POLICIES",
            conflicts_with = "upstream"
        )]
        policies: Option<PathBuf>,
        /// Send everything to this one upstream URL instead.
        #[arg(long, value_name = "URL", env = "PORTCULLIS_UPSTREAM")]
        upstream: Option<String>,
        /// Also open the listeners the policies define. Off by default:
        /// requests arrive through the tunnel alone, so nothing that can
        /// reach this pod gets past the tunnel server (the default
        /// policies' listener trusts X-Forwarded-* headers).
        #[arg(long, env = "PORTCULLIS_OPEN_LISTENERS")]
        open_listeners: bool,
        /// Tunnel connections kept open to each server.
        #[arg(
            long,
            value_name = "N",
            env = "PORTCULLIS_CONNECTIONS",
            default_value_t = 2
        )]
        connections: usize,
        /// How tunnels reach the server: `websocket` (HTTP/2 over a
        /// WebSocket over TCP), `quic` (UDP to the same host and port, a
        /// QUIC stream per request; needs a wss:// server run with
        /// --tunnel-quic), or `auto` (QUIC, falling back to WebSocket
        /// once a QUIC handshake fails, until --quic-retry-after).
        #[arg(long, value_name = "websocket|quic|auto", env = "PORTCULLIS_TRANSPORT", default_value = "websocket", value_parser = parse_transport)]
        transport: portcullis::tunnel::client::Transport,
        /// With `--transport auto`: how long after falling back to
        /// WebSocket a new dial (a tunnel lost, a restarted server) tries
        /// QUIC again.
        #[arg(long, value_name = "DURATION", env = "PORTCULLIS_QUIC_RETRY_AFTER", default_value = "10m", value_parser = parse_duration)]
        quic_retry_after: Duration,
        /// How QUIC tunnels send answers (downloads): `cubic`, or `bbr`,
        /// which keeps its rate through random loss (experimental in
        /// quinn; see docs/tunnels.md).
        #[arg(long, value_name = "cubic|bbr", env = "PORTCULLIS_QUIC_CONGESTION", default_value = "cubic", value_parser = portcullis::tunnel::Congestion::parse)]
        quic_congestion: portcullis::tunnel::Congestion,
        /// Extra CA certificate (PEM) trusted for the server.
        #[arg(long, value_name = "FILE", env = "PORTCULLIS_CA")]
        ca: Option<PathBuf>,
        /// Worker threads; default: one per CPU.
        #[arg(long, value_name = "N", env = "PORTCULLIS_WORKERS")]
        workers: Option<usize>,
        /// How long in-flight requests may run after SIGTERM.
        #[arg(long, value_name = "DURATION", env = "PORTCULLIS_GRACE_PERIOD", default_value = "30s", value_parser = parse_duration)]
        grace_period: Duration,
        /// Admin listener (status, metrics, reload); `off` turns it off.
        /// 9903: apart from serve's 9901 and tunnel-server's 9902.
        #[arg(long, value_name = "ADDR|off", env = "PORTCULLIS_ADMIN", default_value = "127.0.0.1:9903", value_parser = parse_admin)]
        admin: Admin,
        /// File holding a bearer token (a mounted Secret, 16 characters or
        /// more) that `GET /status` and `POST /reload` on the admin
        /// listener then require (`Authorization: Bearer TOKEN`);
        /// `/metrics` and `/readyz` stay open. Read at each request.
        #[arg(long, value_name = "FILE", env = "PORTCULLIS_ADMIN_TOKEN_FILE")]
        admin_token_file: Option<PathBuf>,
        /// Keep compiled plugins in this directory (made if missing; an
        /// emptyDir volume in Kubernetes), so a restart loads their machine
        /// code instead of compiling them again (seconds for a Python or
        /// JavaScript plugin). Without it, plugins compile at every start.
        #[arg(long, value_name = "DIR", env = "PORTCULLIS_PLUGIN_CACHE")]
        plugin_cache: Option<PathBuf>,
        /// Where access lines go, and how they are batched.
        #[command(flatten)]
        access_log: portcullis::log_flags::AccessLogFlags,
    },
    /// Read a token on stdin and print its hash for the tokens file.
    #[command(after_help = "Example:\n  \
        head -c 32 /dev/urandom | base64 > token\n  \
        echo \"rt-a: $(portcullis hash-token < token)\" >> tokens.yaml")]
    HashToken,
    /// Make a private CA and a certificate it signed, for trying HTTPS and
    /// tunnels on loopback (a self-signed certificate is refused by TLS
    /// clients as a server's).
    #[command(after_help = "Example:\n  \
        portcullis dev-certs ./certs\n  \
        portcullis tunnel-server --public 127.0.0.1:8443 --public-cert certs/tls.crt --public-key certs/tls.key \\\n    \
        --tunnel-listen 127.0.0.1:9443 --cert certs/tls.crt --key certs/tls.key --domain tunnels.localhost --tokens tokens.yaml")]
    DevCerts {
        /// Directory for ca.crt, tls.crt and tls.key (made if missing;
        /// existing files are never overwritten).
        dir: PathBuf,
        /// A name (or IP address) the certificate covers; repeat it. By
        /// default: localhost, *.tunnels.localhost, 127.0.0.1 and ::1.
        #[arg(long = "name", value_name = "NAME")]
        names: Vec<String>,
    },
    /// Write a policy plugin crate to start from (Rust, the SDK beside it):
    /// it builds with one cargo command, anywhere.
    #[command(after_help = "Example:\n  \
        portcullis new-plugin ./edge-auth\n  \
        cd edge-auth && cargo build --release --target wasm32-wasip2\n  \
        portcullis check --policies .")]
    NewPlugin {
        /// Directory to write (made; must be missing or empty).
        dir: PathBuf,
        /// The plugin's package name; by default the directory's name.
        #[arg(long, value_name = "NAME")]
        name: Option<String>,
    },
    /// Print reference documentation made from the code: `commands`, the
    /// Markdown of docs/commands.md's reference.
    #[command(hide = true)]
    Reference {
        /// What to print: `commands`.
        what: String,
    },
    /// Validate policies without serving; prints `file:line:column: message` per error.
    #[command(after_help = "Example:\n  portcullis check --policies ./policies")]
    Check {
        /// Directory of *.yaml policy files; the built-in defaults when not given.
        #[arg(long, value_name = "DIR", env = "PORTCULLIS_POLICIES")]
        policies: Option<PathBuf>,
        /// Use (and fill) this plugin cache, as `serve --plugin-cache`
        /// does: a pipeline that keeps the directory between runs checks
        /// a Python or JavaScript plugin in milliseconds, not seconds.
        #[arg(long, value_name = "DIR", env = "PORTCULLIS_PLUGIN_CACHE")]
        plugin_cache: Option<PathBuf>,
    },
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    portcullis::config::parse_duration(s)
}

fn parse_transport(s: &str) -> Result<portcullis::tunnel::client::Transport, String> {
    use portcullis::tunnel::client::Transport;
    match s {
        "websocket" => Ok(Transport::WebSocket),
        "quic" => Ok(Transport::Quic),
        "auto" => Ok(Transport::Auto),
        _ => Err(format!("`{s}` is not a transport: websocket, quic or auto")),
    }
}

/// The admin listener's address, or none.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Admin(pub(crate) Option<std::net::SocketAddr>);

fn parse_admin(s: &str) -> Result<Admin, String> {
    if s.eq_ignore_ascii_case("off") {
        return Ok(Admin(None));
    }
    s.parse()
        .map(|a| Admin(Some(a)))
        .map_err(|_| format!("`{s}` is not an address like 127.0.0.1:9901 (or `off`)"))
}
