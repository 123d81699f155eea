//! The `portcullis` binary: parses arguments and calls the library.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

// The proxy allocates small, short-lived buffers per request from many
// threads; mimalloc's thread-local free lists cost measurably less than
// glibc's malloc there (see bench/).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "portcullis",
    version,
    about = "A WebAssembly-extensible edge proxy"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the routing core on the policies' listeners.
    Serve {
        /// Directory of *.yaml policy files (a mounted ConfigMap); the
        /// built-in default policies when not given.
        #[arg(long, env = "PORTCULLIS_POLICIES")]
        policies: Option<PathBuf>,
        /// How long in-flight requests may run after SIGTERM.
        #[arg(long, env = "PORTCULLIS_GRACE_PERIOD", default_value = "30s", value_parser = parse_duration)]
        grace_period: Duration,
        /// How long to keep accepting after SIGTERM while /readyz answers
        /// 503, so load balancers stop sending first.
        #[arg(long, env = "PORTCULLIS_SHUTDOWN_DELAY", default_value = "0s", value_parser = parse_duration)]
        shutdown_delay: Duration,
        /// Worker threads (each with its own event loop); default: one per CPU.
        #[arg(long, env = "PORTCULLIS_WORKERS")]
        workers: Option<usize>,
        /// Admin listener (status, metrics, reload); `off` turns it off.
        #[arg(long, env = "PORTCULLIS_ADMIN", default_value = "127.0.0.1:9901", value_parser = parse_admin)]
        admin: Admin,
        /// Reload when files in the policy directory change (SIGHUP and
        /// `POST /reload` on the admin listener reload either way).
        #[arg(long, env = "PORTCULLIS_WATCH", default_value_t = true, action = clap::ArgAction::Set)]
        watch: bool,
        /// Quiet time after a change before reloading.
        #[arg(long, env = "PORTCULLIS_WATCH_DEBOUNCE", default_value = "100ms", value_parser = parse_duration)]
        watch_debounce: Duration,
        /// How often to check the policies even without a change event
        /// (events can be lost); `0s` turns the check off.
        #[arg(long, env = "PORTCULLIS_WATCH_POLL", default_value = "10s", value_parser = parse_duration)]
        watch_poll: Duration,
    },
    /// Validate policies without serving; prints `file:line:column: message` per error.
    Check {
        /// Directory of *.yaml policy files; the built-in defaults when not given.
        #[arg(long, env = "PORTCULLIS_POLICIES")]
        policies: Option<PathBuf>,
    },
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    portcullis::config::parse_duration(s)
}

/// The admin listener's address, or none.
#[derive(Debug, Clone, Copy)]
struct Admin(Option<std::net::SocketAddr>);

fn parse_admin(s: &str) -> Result<Admin, String> {
    if s.eq_ignore_ascii_case("off") {
        return Ok(Admin(None));
    }
    s.parse()
        .map(|a| Admin(Some(a)))
        .map_err(|_| format!("`{s}` is not an address like 127.0.0.1:9901 (or `off`)"))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check { policies } => portcullis::commands::check(policies.as_deref()),
        Command::Serve {
            policies,
            grace_period,
            shutdown_delay,
            workers,
            admin,
            watch,
            watch_debounce,
            watch_poll,
        } => {
            let workers = workers.unwrap_or_else(portcullis::server::default_workers);
            let drain = portcullis::server::Drain {
                delay: shutdown_delay,
                grace: grace_period,
            };
            portcullis::telemetry::init();
            // The control plane (signals, drain) is light; the worker
            // threads run their own runtimes.
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build();
            let runtime = match runtime {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("portcullis: cannot start the async runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let options = portcullis::commands::ServeOptions {
                policies,
                workers,
                drain,
                admin: admin.0,
                watch: portcullis::reload::WatchOptions {
                    events: watch,
                    debounce: watch_debounce,
                    poll: watch_poll,
                },
            };
            match runtime.block_on(portcullis::commands::serve(options)) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!("{e:#}");
                    eprintln!("portcullis: {e:#}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
