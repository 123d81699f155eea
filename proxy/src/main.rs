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

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check { policies } => portcullis::commands::check(policies.as_deref()),
        Command::Serve {
            policies,
            grace_period,
            shutdown_delay,
            workers,
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
            match runtime.block_on(portcullis::commands::serve(policies, workers, drain)) {
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
