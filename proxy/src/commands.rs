//! The binary's subcommands as library functions (the binary's edge:
//! errors here are for people, so they are `anyhow`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;

use crate::config::{self, Config, ConfigErrors};
use crate::reload::{Reloader, WatchOptions};
use crate::server::{Drain, Server};

/// Loads the policies from `dir`, or the built-in default set.
pub fn load(dir: Option<&Path>) -> Result<Config, ConfigErrors> {
    match dir {
        Some(dir) => config::load_dir(dir),
        None => config::load_sources(&config::default_sources(), &|n| std::env::var(n).ok()),
    }
}

/// Loads the policies and compiles and configures their plugins, as
/// serving would, without binding anything.
fn load_and_prepare(dir: Option<&Path>) -> Result<Config, ConfigErrors> {
    let config = load(dir)?;
    if config.plugins.is_empty() {
        return Ok(config);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| {
            ConfigErrors(vec![crate::config::ConfigError {
                pos: config.plugins[0].defined_at.clone(),
                message: format!("cannot start a runtime to check plugins: {e}"),
            }])
        })?;
    runtime.block_on(crate::plugin::prepare(&config))?;
    Ok(config)
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
            println!(
                "{shown}: ok ({} listeners, {} upstreams, {} routes, {} plugins)",
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
    /// When the policies are reloaded.
    pub watch: WatchOptions,
}

/// `portcullis serve`: loads, binds, serves until SIGTERM or SIGINT (and
/// reloads the policies when they change, on SIGHUP and on the admin
/// endpoint's request), then drains as `options.drain` says.
pub async fn serve(options: ServeOptions) -> anyhow::Result<()> {
    let config =
        load(options.policies.as_deref()).map_err(|e| anyhow::anyhow!("invalid policies:\n{e}"))?;
    let server = Server::bind(config, options.workers).await?;
    let reloader = Arc::new(Reloader::new(
        options.policies.clone(),
        server.control().clone(),
    ));
    if let Some(addr) = options.admin {
        crate::admin::serve(addr, reloader.clone())
            .await
            .with_context(|| {
                format!("cannot bind the admin listener on {addr} (--admin off turns it off)")
            })?;
    }
    let watch = crate::reload::watch(reloader, options.watch).await;
    let watching = tokio::spawn(watch.run());
    let served = server.run(shutdown_signal(), options.drain).await;
    watching.abort();
    served?;
    Ok(())
}

/// Completes on the first SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let term = signal(SignalKind::terminate()).context("installing the SIGTERM handler");
    match term {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => tracing::info!("SIGTERM received"),
                _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received"),
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "no SIGTERM handling; stopping on SIGINT only");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
