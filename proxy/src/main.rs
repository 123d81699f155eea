//! The `portcullis` binary: parses arguments and calls the library.

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

mod cli;
mod reference;
use cli::{Cli, Command};

// The proxy allocates small, short-lived buffers per request from many
// threads; mimalloc's thread-local free lists cost measurably less than
// glibc's malloc there (see bench/).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Hands the pages an idle worker freed back to the system (see
/// `worker_idle`): mimalloc would keep them until that thread allocates.
/// `force`: every free range, not only those freed long enough ago.
fn release_freed_memory(force: bool) {
    // SAFETY: mi_collect takes no pointer; it collects the calling
    // thread's heap and purges the arenas' expired free ranges (all of
    // them when forced).
    unsafe { libmimalloc_sys::mi_collect(force) }
}

/// Runs `work` on a current-thread runtime (the serving workers run their
/// own), reporting an error the way every command does.
fn run<F: std::future::Future<Output = anyhow::Result<()>>>(work: impl FnOnce() -> F) -> ExitCode {
    run_on(tokio::runtime::Builder::new_current_thread(), work)
}

/// [`run`] on a runtime made by `builder`.
fn run_on<F: std::future::Future<Output = anyhow::Result<()>>>(
    mut builder: tokio::runtime::Builder,
    work: impl FnOnce() -> F,
) -> ExitCode {
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("portcullis: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(work());
    if let Err(e) = &result {
        // Logs go to stderr too: saying it twice would print every line
        // of a policy error twice. Plainly only when the log filter
        // (`RUST_LOG=off`) would hide it.
        if tracing::enabled!(tracing::Level::ERROR) {
            tracing::error!("{e:#}");
        } else {
            eprintln!("portcullis: {e:#}");
        }
    }
    // Every log and access line out before the process ends (the error
    // above included); a destination that blocks (a pipe nobody reads)
    // holds the exit up to this long.
    portcullis::telemetry::finish(Duration::from_secs(5));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(_) => ExitCode::FAILURE,
    }
}

/// The admin listener's access rules, with the token file when given;
/// `None` (after saying why) when the file cannot serve.
fn admin_access(
    token_file: Option<std::path::PathBuf>,
) -> Option<portcullis::commands::AdminAccess> {
    match token_file {
        None => Some(portcullis::commands::AdminAccess::open()),
        Some(file) => match portcullis::commands::AdminAccess::with_token_file(file) {
            Ok(access) => Some(access),
            Err(e) => {
                eprintln!("portcullis: {e}");
                None
            }
        },
    }
}

/// Turns transparent huge pages off for this process, before it holds
/// much memory. mimalloc asks for them on its arenas, and the kernel then
/// backs a sparse heap, such as many idle connections' small buffers, with
/// 2 MiB pages of which little is touched: an idle tunnel cost the server
/// 64 KiB of RSS with them and 46 without (`bench/idle-tunnels.sh`), at
/// the same CPU per request (`bench/core.sh`). Pages faulted before this
/// call keep their size; the flag is the kernel's, checked at each fault.
fn no_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_THP_DISABLE takes integers only, and changes
    // nothing but how this process's later page faults are served.
    unsafe {
        libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
    }
}

fn main() -> ExitCode {
    no_transparent_huge_pages();
    let cli = Cli::parse();
    portcullis::worker_idle::set_hook(release_freed_memory);
    match cli.command {
        Command::Check {
            policies,
            plugin_cache,
        } => {
            if let Some(dir) = plugin_cache {
                portcullis_oci::set_cache_dir(dir.join("oci"));
                portcullis::plugin::use_disk_cache(dir);
            }
            portcullis::commands::check(policies.as_deref())
        }
        Command::HashToken => portcullis::commands::hash_token(),
        Command::Reference { what } => match what.as_str() {
            "commands" => {
                print!("{}", reference::commands());
                ExitCode::SUCCESS
            }
            _ => {
                eprintln!("portcullis reference: `{what}` is not a reference: commands");
                ExitCode::from(2)
            }
        },
        Command::NewPlugin { dir, name } => {
            portcullis::new_plugin::new_plugin(&dir, name.as_deref())
        }
        Command::DevCerts { dir, names } => {
            let names = if names.is_empty() {
                portcullis::dev_certs::DEFAULT_NAMES
                    .map(String::from)
                    .to_vec()
            } else {
                names
            };
            portcullis::dev_certs::dev_certs(&dir, &names)
        }
        Command::TunnelServer {
            public,
            public_cert,
            public_key,
            trust_forwarded_headers,
            proxy_protocol,
            http3,
            http3_advertised_port,
            tunnel_proxy_protocol,
            tunnel_listen,
            domain,
            tokens,
            cert,
            key,
            tunnel_quic,
            quic_congestion,
            admin,
            admin_token_file,
            shutdown_delay,
            workers,
            max_connections,
            peer_flags,
            access_log,
            public_rate_limit,
            public_rate_burst,
            otlp_endpoint,
            trace_sample_percent,
            trace_service_name,
            trace_trust_incoming,
            trace_flush_ms,
            public_max_requests_per_connection,
            public_connection_lifetime,
        } => {
            let Some(admin_access) = admin_access(admin_token_file) else {
                return ExitCode::from(2);
            };
            let peers = match peer_flags.options() {
                Ok(peers) => peers,
                Err(e) => {
                    eprintln!("portcullis tunnel-server: {e}");
                    return ExitCode::from(2);
                }
            };
            if let Err(e) = portcullis::telemetry::init(access_log.settings()) {
                eprintln!("portcullis: {e}");
                return ExitCode::from(2);
            }
            let options = portcullis::tunnel::server::ServerOptions {
                public,
                public_tls: public_cert.zip(public_key),
                trust_forwarded_headers,
                proxy_protocol,
                http3,
                http3_advertised_port,
                tunnel_proxy_protocol,
                tunnel: tunnel_listen,
                domain,
                tokens,
                tls: cert.zip(key),
                tunnel_quic,
                quic_congestion,
                admin: admin.0,
                admin_access,
                shutdown_delay,
                workers: workers.unwrap_or_else(portcullis::server::default_workers),
                max_connections,
                peers,
                public_rate_limit: public_rate_limit.map(|rate| (rate, public_rate_burst)),
                // Set but empty: off, as the OpenTelemetry SDKs take it.
                tracing: otlp_endpoint.filter(|e| !e.is_empty()).map(|endpoint| {
                    portcullis::tunnel::server::TraceOptions {
                        endpoint,
                        sample_percent: trace_sample_percent,
                        service_name: trace_service_name,
                        trust_incoming: trace_trust_incoming,
                        flush_every: std::time::Duration::from_millis(trace_flush_ms),
                    }
                }),
                public_connection_limits: (
                    public_max_requests_per_connection,
                    public_connection_lifetime,
                ),
            };
            // The control plane (signals, tunnel accepts, admin); workers
            // run their own event loops.
            run(|| portcullis::commands::tunnel_server(options))
        }
        Command::TunnelClient {
            server,
            runtime_id,
            token_file,
            policies,
            upstream,
            connections,
            transport,
            quic_retry_after,
            quic_congestion,
            ca,
            workers,
            grace_period,
            admin,
            admin_token_file,
            open_listeners,
            plugin_cache,
            access_log,
        } => {
            let Some(admin_access) = admin_access(admin_token_file) else {
                return ExitCode::from(2);
            };
            if let Some(dir) = plugin_cache {
                portcullis_oci::set_cache_dir(dir.join("oci"));
                portcullis::plugin::use_disk_cache(dir);
            }
            use portcullis::tunnel::client::{ClientOptions, Target, Token};
            let token = match (token_file, std::env::var("PORTCULLIS_TOKEN")) {
                (Some(file), _) => Token::File(file),
                (None, Ok(value)) => Token::Value(value),
                (None, Err(_)) => {
                    eprintln!(
                        "portcullis tunnel-client: give --token-file FILE or set PORTCULLIS_TOKEN"
                    );
                    return ExitCode::from(2);
                }
            };
            if !portcullis::tunnel::tokens::valid_runtime_id(&runtime_id) {
                eprintln!(
                    "portcullis tunnel-client: --runtime-id `{runtime_id}` must be a DNS label (a-z, 0-9, -)"
                );
                return ExitCode::from(2);
            }
            if let Err(e) = portcullis::telemetry::init(access_log.settings()) {
                eprintln!("portcullis: {e}");
                return ExitCode::from(2);
            }
            let options = portcullis::commands::TunnelClientOptions {
                client: ClientOptions {
                    servers: server,
                    runtime_id,
                    token,
                    target: match upstream {
                        Some(url) => Target::Upstream(url),
                        None => Target::Policies(policies),
                    },
                    connections,
                    transport,
                    quic_retry_after,
                    quic_congestion,
                    ca,
                },
                workers: workers.unwrap_or_else(portcullis::server::default_workers),
                drain: portcullis::server::Drain {
                    delay: Duration::ZERO,
                    grace: grace_period,
                },
                admin: admin.0,
                admin_access,
                watch: portcullis::reload::WatchOptions::default(),
                listen: open_listeners,
            };
            run(|| portcullis::commands::tunnel_client(options))
        }
        Command::Serve {
            policies,
            grace_period,
            shutdown_delay,
            workers,
            admin,
            admin_token_file,
            watch,
            watch_debounce,
            watch_poll,
            plugin_cache,
            state_flags,
            access_log,
        } => {
            let state = match state_flags.target() {
                Ok(state) => state,
                Err(e) => {
                    eprintln!("portcullis serve: {e}");
                    return ExitCode::from(2);
                }
            };
            let Some(admin_access) = admin_access(admin_token_file) else {
                return ExitCode::from(2);
            };
            if let Some(dir) = plugin_cache {
                portcullis_oci::set_cache_dir(dir.join("oci"));
                portcullis::plugin::use_disk_cache(dir);
            }
            let workers = workers.unwrap_or_else(portcullis::server::default_workers);
            let drain = portcullis::server::Drain {
                delay: shutdown_delay,
                grace: grace_period,
            };
            if let Err(e) = portcullis::telemetry::init(access_log.settings()) {
                eprintln!("portcullis: {e}");
                return ExitCode::from(2);
            }
            let options = portcullis::commands::ServeOptions {
                policies,
                workers,
                drain,
                admin: admin.0,
                admin_access,
                watch: portcullis::reload::WatchOptions {
                    events: watch,
                    debounce: watch_debounce,
                    poll: watch_poll,
                },
                state,
            };
            // The control plane (signals, drain, reloads) is light; the
            // worker threads run their own runtimes.
            run(|| portcullis::commands::serve(options))
        }
    }
}
