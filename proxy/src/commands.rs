//! The binary's subcommands as library functions (the binary's edge:
//! errors here are for people, so they are `anyhow`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;

use crate::reload::{Reloader, WatchOptions};
use portcullis_config::{self as config, Config, ConfigErrors};
use portcullis_http::server::{Drain, Server};
pub use portcullis_obs::admin_access::AdminAccess;

/// Loads the policies from `dir`, or the built-in default set.
pub fn load(dir: Option<&Path>) -> Result<Config, ConfigErrors> {
    config::load_policies(dir)
}

/// Loads the policies and compiles and configures their plugins, as
/// serving would, without binding anything. The plugins are checked even
/// when other parts of the policies have errors (those parts are left
/// out), so one run lists every error.
fn load_and_prepare(dir: Option<&Path>) -> Result<Config, ConfigErrors> {
    let sources = match dir {
        Some(dir) => config::read_dir(dir)?,
        None => config::default_sources(),
    };
    let env = |n: &str| std::env::var(n).ok();
    let (config, mut errors) = config::load_partial(&sources, &env);
    if !config.plugins.is_empty() {
        let prepared = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| {
                ConfigErrors(vec![portcullis_config::ConfigError {
                    pos: config.plugins[0].defined_at.clone(),
                    message: format!("cannot start a runtime to check plugins: {e}"),
                }])
            })
            .and_then(|runtime| runtime.block_on(portcullis_plugin::prepare(&config)));
        if let Err(ConfigErrors(more)) = prepared {
            errors.extend(more);
            config::sort_errors(&mut errors);
        }
    }
    if errors.is_empty() {
        Ok(config)
    } else {
        Err(ConfigErrors(errors))
    }
}

/// `portcullis check`: validates (plugins included: compiled, instantiated
/// and asked to validate their config) and prints every error as
/// `file:line:column: message`. Exit 0 when valid, 1 otherwise.
pub fn check(dir: Option<&Path>) -> ExitCode {
    let shown = dir.map_or_else(
        || "built-in default policies".to_owned(),
        |d| d.display().to_string(),
    );
    match load_and_prepare(dir) {
        Ok(config) => {
            // Whether tracing is on often hangs on the environment
            // (`enabled: "${OTEL_EXPORTER_OTLP_ENDPOINT:+true}"`): say so.
            let tracing = config.tracing.as_ref().map_or_else(String::new, |t| {
                format!(", tracing to {}", config.upstreams[t.upstream].name)
            });
            println!(
                "{shown}: ok ({} listeners, {} upstreams, {} routes, {} plugins{tracing})",
                config.listeners.len(),
                config.upstreams.len(),
                config.routes.len(),
                config.plugins.len()
            );
            ExitCode::SUCCESS
        }
        Err(errors) => {
            for e in &errors.0 {
                eprintln!("{e}");
            }
            eprintln!("{shown}: {} error(s)", errors.0.len());
            ExitCode::FAILURE
        }
    }
}

/// How `portcullis serve` runs.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Policy directory; the built-in default set when `None`.
    pub policies: Option<PathBuf>,
    /// Worker threads.
    pub workers: usize,
    /// How shutdown drains.
    pub drain: Drain,
    /// The admin listener's address; `None` turns it off.
    pub admin: Option<std::net::SocketAddr>,
    /// Who may use the admin listener.
    pub admin_access: AdminAccess,
    /// When the policies are reloaded.
    pub watch: WatchOptions,
    /// The state store replicas share (`--state`).
    pub state: Option<portcullis_net::redis_target::RedisTarget>,
}

/// `portcullis serve`: loads, binds, serves until SIGTERM or SIGINT (and
/// reloads the policies when they change, on SIGHUP and on the admin
/// endpoint's request), then drains as `options.drain` says.
pub async fn serve(options: ServeOptions) -> anyhow::Result<()> {
    let stop = shutdown_signal();
    let hangup = crate::reload::hangup_handler();
    // Before the policies: their shared limits need it.
    if let Some(state) = options.state.clone() {
        portcullis_http::shared_limit::connect(state).map_err(anyhow::Error::msg)?;
    }
    let config =
        load(options.policies.as_deref()).map_err(|e| anyhow::anyhow!("invalid policies:\n{e}"))?;
    let server = Server::bind(config, options.workers).await?;
    // Files a previous run compiled for plugins the policies no longer
    // name go now, not at the first reload.
    portcullis_plugin::forget_unused(server.control().pipeline().config());
    let reloader = Arc::new(Reloader::new(
        options.policies.clone(),
        server.control().clone(),
    ));
    let watching = control_plane(
        reloader,
        options.admin.map(|a| (a, options.admin_access)),
        options.watch,
        hangup,
    )
    .await?;
    let served = server.run(stop, options.drain).await;
    watching.abort();
    served?;
    Ok(())
}

/// How `portcullis tunnel-client` runs.
#[derive(Debug, Clone)]
pub struct TunnelClientOptions {
    /// The tunnel: server, identity, target.
    pub client: portcullis_tunnel::client::ClientOptions,
    /// Worker threads.
    pub workers: usize,
    /// How shutdown drains.
    pub drain: Drain,
    /// The admin listener; `None` turns it off.
    pub admin: Option<std::net::SocketAddr>,
    /// Who may use the admin listener.
    pub admin_access: AdminAccess,
    /// When the policies are reloaded.
    pub watch: WatchOptions,
    /// Whether the policies' listeners are opened too (`--open-listeners`).
    pub listen: bool,
}

/// `portcullis tunnel-client`: the routing core (policies, plugins, hot
/// reload, and with `listen` the listeners the policies define) fed by
/// tunnel connections to the server. Ends on SIGTERM/SIGINT after draining, or
/// with an error when another client takes over this runtime id.
pub async fn tunnel_client(options: TunnelClientOptions) -> anyhow::Result<()> {
    use portcullis_tunnel::client::{Dialer, Target, run_slot, upstream_policy};
    // A token that cannot work (empty, unreadable, a published
    // placeholder) stops the start, not a reconnect loop that looks alive.
    options
        .client
        .token
        .read()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let signalled = shutdown_signal();
    let hangup = crate::reload::hangup_handler();
    let (config, reloader_source) = match &options.client.target {
        Target::Policies(dir) => (
            load(dir.as_deref()).map_err(|e| anyhow::anyhow!("invalid policies:\n{e}"))?,
            Ok(dir.clone()),
        ),
        Target::Upstream(url) => {
            let sources = vec![upstream_policy(url)];
            let config = config::load_sources(&sources, &|n| std::env::var(n).ok())
                .map_err(|e| anyhow::anyhow!("--upstream {url}: {e}"))?;
            (config, Err(sources))
        }
    };
    let dialer = Arc::new(Dialer::new(options.client.clone())?);
    let listeners = if options.listen {
        portcullis_http::server::Listeners::Optional
    } else {
        portcullis_http::server::Listeners::Closed
    };
    let server = Server::bind_with(config, options.workers, listeners).await?;
    portcullis_plugin::forget_unused(server.control().pipeline().config());
    let control = server.control().clone();
    // Ready means requests can come through: a tunnel the server pings.
    let gate = dialer.clone();
    server
        .shared()
        .set_gate(Box::new(move || gate.tunnels_up() > 0));
    let report = dialer.clone();
    server
        .shared()
        .set_tunnel_report(Box::new(move || report.report()));
    let reloader = Arc::new(match reloader_source {
        Ok(dir) => Reloader::new(dir, control.clone()),
        Err(sources) => Reloader::with_sources(sources, control.clone()),
    });
    let watching = control_plane(
        reloader,
        options.admin.map(|a| (a, options.admin_access)),
        options.watch,
        hangup,
    )
    .await?;
    for slot in 0..dialer.slots() {
        let dialer = dialer.clone();
        control.spawn_on_worker(slot, move |ctx| Box::pin(run_slot(slot, dialer, ctx)));
    }
    let give_up = dialer.give_up.clone();
    let stop = async {
        tokio::select! {
            _ = signalled => {}
            _ = give_up.cancelled() => {}
        }
    };
    let served = server.run(stop, options.drain).await;
    watching.abort();
    served?;
    if dialer.was_replaced() {
        anyhow::bail!(
            "another tunnel client took over runtime `{}`",
            options.client.runtime_id
        );
    }
    Ok(())
}

/// `portcullis tunnel-server`: serves until SIGTERM/SIGINT.
pub async fn tunnel_server(
    options: portcullis_tunnel::server::ServerOptions,
) -> anyhow::Result<()> {
    let stop = shutdown_signal();
    // Nothing to reload: the tokens file is read at each handshake and
    // checked at each keep-alive. But SIGHUP's default action would end
    // the process and drop every tunnel, for an operator used to sending
    // it to reload (as to nginx): say so instead.
    if let Some(mut hangup) = crate::reload::hangup_handler() {
        tokio::spawn(async move {
            while hangup.recv().await.is_some() {
                tracing::info!(
                    "SIGHUP received; nothing to reload (the tokens file is read at each handshake and checked at each keep-alive)"
                );
            }
        });
    }
    let server = portcullis_tunnel::server::TunnelServer::bind(&options).await?;
    if let Some(addr) = options.admin {
        server
            .serve_admin(addr, options.admin_access.clone())
            .await
            .with_context(|| {
                format!("cannot bind the admin listener on {addr} (--admin off turns it off)")
            })?;
    }
    server.run(stop).await
}

/// Shorter tokens could be guessed; 32 random bytes in base64 are 44.
const MIN_TOKEN_LEN: usize = 16;

/// `portcullis hash-token`: reads a token on stdin, prints its hash for
/// the tunnel server's tokens file.
pub fn hash_token() -> ExitCode {
    let mut token = String::new();
    if let Err(e) = std::io::Read::read_to_string(&mut std::io::stdin(), &mut token) {
        eprintln!("portcullis hash-token: cannot read stdin: {e}");
        return ExitCode::FAILURE;
    }
    if token.trim().is_empty() {
        eprintln!("portcullis hash-token: no token on stdin");
        return ExitCode::FAILURE;
    }
    // The server refuses these hashes anyway; say so before they are used.
    if portcullis_tunnel::tokens::is_placeholder(&token) || token.trim().len() < MIN_TOKEN_LEN {
        eprintln!(
            "portcullis hash-token: `{}` is a placeholder or shorter than {MIN_TOKEN_LEN} characters, not a secret: make a random one with `head -c 32 /dev/urandom | base64 > token`",
            token.trim()
        );
        return ExitCode::FAILURE;
    }
    println!("{}", portcullis_tunnel::tokens::hash_token(&token));
    ExitCode::SUCCESS
}

/// Starts the admin listener (unless `admin` is `None`) and the reload
/// triggers; returns the reload task, to stop when serving ends.
async fn control_plane(
    reloader: Arc<Reloader>,
    admin: Option<(std::net::SocketAddr, AdminAccess)>,
    watch: WatchOptions,
    hangup: Option<tokio::signal::unix::Signal>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    if let Some((addr, access)) = admin {
        crate::admin::serve(addr, access, reloader.clone())
            .await
            .with_context(|| {
                format!("cannot bind the admin listener on {addr} (--admin off turns it off)")
            })?;
    }
    let watch = crate::reload::watch(reloader, watch, hangup).await;
    Ok(tokio::spawn(watch.run()))
}

/// Completes on the first SIGTERM or SIGINT. The handlers are installed
/// by this call, not when the future is first polled: a SIGTERM between
/// the `listening` line and the server's run (a pod deleted as it
/// starts) would otherwise kill the process without a drain.
pub fn shutdown_signal() -> impl std::future::Future<Output = ()> + Send + 'static {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate()).context("installing the SIGTERM handler");
    let int = signal(SignalKind::interrupt()).context("installing the SIGINT handler");
    async move {
        match (term, int) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => tracing::info!("SIGTERM received"),
                    _ = int.recv() => tracing::info!("SIGINT received"),
                }
            }
            (term, int) => {
                let e = term.err().or(int.err()).map(|e| format!("{e:#}"));
                tracing::warn!(
                    error = e.as_deref(),
                    "no signal handling; stopping when killed"
                );
                std::future::pending::<()>().await;
            }
        }
    }
}
