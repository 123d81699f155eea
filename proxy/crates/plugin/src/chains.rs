//! Each route's plugin chain, prepared from a config: modules compiled, configs given to the plugins' `init`.

use super::*;
use crate::use_binding::Kind;

/// A request head with nothing in it (no allocation).
pub fn empty_head() -> RequestHead {
    RequestHead {
        method: String::new(),
        scheme: String::new(),
        authority: String::new(),
        path: String::new(),
        query: None,
        client_addr: String::new(),
        tls: false,
        sni: None,
    }
}

/// Route info with nothing in it (no allocation).
pub fn empty_route() -> RouteInfo {
    RouteInfo {
        name: String::new(),
        params: Vec::new(),
    }
}

/// Every route's plugin chain (global plugins first), ready to call.
#[derive(Debug, Default, Clone)]
pub struct Chains {
    /// By route index.
    pub routes: Vec<Arc<[Arc<dyn Plugin>]>>,
}

impl Chains {
    /// Starts every plugin use's instances for the slots of `workers`
    /// worker threads (see [`Plugin::warm`]), on a blocking thread; the
    /// first error, naming the plugin, when one cannot start.
    pub async fn warm(&self, workers: usize) -> Result<(), String> {
        let mut uses: Vec<Arc<dyn Plugin>> = Vec::new();
        for plugin in self.routes.iter().flat_map(|chain| chain.iter()) {
            if !uses.iter().any(|u| Arc::ptr_eq(u, plugin)) {
                uses.push(plugin.clone());
            }
        }
        let shards = portcullis_net::shard::of_workers(workers);
        let warmed = tokio::task::spawn_blocking(move || {
            uses.iter()
                .try_for_each(|u| u.warm(shards.clone()))
                .map_err(|e| e.to_string())
        });
        warmed
            .await
            .unwrap_or_else(|e| Err(format!("starting plugins crashed: {e}")))
    }

    /// Gives every plugin where to send the callouts it makes outside
    /// requests.
    pub fn set_callouts(&self, callouts: &Arc<dyn crate::seam::Callouts>) {
        for plugin in self.routes.iter().flat_map(|chain| chain.iter()) {
            plugin.set_callouts(callouts.clone());
        }
    }
}

/// Compiles every plugin the config uses, instantiates each use once and
/// asks the plugin to validate its config. Errors name the plugin, the
/// route and the place in the policy files.
pub async fn prepare(config: &Config) -> Result<Chains, ConfigErrors> {
    if config.plugins.is_empty() {
        return Ok(Chains {
            routes: config
                .routes
                .iter()
                .map(|_| Arc::from(Vec::new()))
                .collect(),
        });
    }
    let fail_at = |pos: &portcullis_config::Pos, message: String| {
        ConfigErrors(vec![ConfigError {
            pos: pos.clone(),
            message,
        }])
    };
    let host = host().map_err(|e| fail_at(&config.plugins[0].defined_at, e))?;

    // Compile (CPU-heavy) off the async workers.
    let modules = config.plugins.clone();
    let compiled = tokio::task::spawn_blocking(move || {
        modules.iter().map(|m| compile(host, m)).collect::<Vec<_>>()
    })
    .await
    .map_err(|e| {
        fail_at(
            &config.plugins[0].defined_at,
            format!("plugin compilation crashed: {e}"),
        )
    })?;
    let mut errors = Vec::new();
    let mut pres = Vec::with_capacity(compiled.len());
    for (module, result) in config.plugins.iter().zip(compiled) {
        match result {
            Ok(kind) => pres.push(Some(kind)),
            Err(message) => {
                errors.push(ConfigError {
                    pos: module.defined_at.clone(),
                    message,
                });
                pres.push(None);
            }
        }
    }
    // Uses of modules that failed to compile are skipped (their error is
    // reported); the others are still checked, so one run lists all.
    let binder = crate::use_binding::Binder::new(config, &pres, &host.engine);
    let mut global = Vec::new();
    for u in &config.global_plugins {
        match binder.bind_use(u, None) {
            Ok(Some(b)) => global.push(b),
            Ok(None) => {}
            Err(e) => errors.push(e),
        }
    }
    let mut routes = Vec::with_capacity(config.routes.len());
    for route in &config.routes {
        let mut chain = global.clone();
        for u in &route.plugins {
            match binder.bind_use(u, Some(&route.name)) {
                Ok(Some(b)) => chain.push(b),
                Ok(None) => {}
                Err(e) => errors.push(e),
            }
        }
        routes.push(Arc::from(chain));
    }
    if errors.is_empty() {
        Ok(Chains { routes })
    } else {
        Err(ConfigErrors(errors))
    }
}

/// Compiles `m` as the kind its file is: a core module exporting the
/// proxy-wasm ABI is a filter, anything else must be a component of the
/// `portcullis:policy` world.
fn compile(host: &PluginHost, m: &PluginModule) -> Result<Kind, String> {
    if file_kind::is_core_module(&m.bytes) {
        let module = host.compile_filter(m)?;
        if !crate::proxy_wasm::is_filter(&module) {
            return Err(format!(
                "plugin {}: a core WebAssembly module that exports no proxy_abi_version_0_2_1 \
                 (or _0_2_0, or Higress's _0_2_100): neither a proxy-wasm filter nor a \
                 component. Build a \
                 portcullis plugin for wasm32-wasip2 (plugins/build.sh does), or a proxy-wasm \
                 filter with a proxy-wasm SDK",
                m.path.display()
            ));
        }
        return Ok(Kind::Filter(module));
    }
    let c = host.compile(m)?;
    // A plugin importing more than the plugin WASI set (files, sockets) is
    // refused here, naming the import.
    let pre = host
        .linker
        .instantiate_pre(&c)
        .map_err(|e| format!("{} cannot be linked: {e:#}", m.path.display()))?;
    // The contract first; a component built against 0.2 has no
    // `on-callout` and fails that check, then passes 0.2's.
    let now = match PolicyPre::new(pre.clone()) {
        Ok(p) => return Ok(Kind::Component(Pre::Now(p))),
        Err(e) => e,
    };
    if let Ok(p) = bindings::v0_2::PolicyPre::new(pre) {
        return Ok(Kind::Component(Pre::V0_2(p)));
    }
    Err(format!(
        "{} does not export the portcullis:policy world (0.3, or 0.2): {now:#}",
        m.path.display()
    ))
}
