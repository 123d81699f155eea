//! Each route's plugin chain, prepared from a config: modules compiled, configs given to the plugins' `init`.

use super::*;

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
    let route_names: Arc<[Arc<str>]> = config.routes.iter().map(|r| r.name.clone()).collect();
    let upstreams = upstream_names(config);
    let bind = |u: &PluginUse, route: Option<&str>| {
        let module = &config.plugins[u.plugin];
        let pre = pres[u.plugin].clone();
        let engine = host.engine.clone();
        let u = u.clone();
        let name = module.name.clone();
        let route_names = route_names.clone();
        let upstreams = upstreams.clone();
        let on = route.map_or_else(|| "the global chain".to_owned(), |r| format!("route `{r}`"));
        let route: Option<Arc<str>> = route.map(Arc::from);
        let shadow = u.shadow;
        let bound = async move {
            let pre = match pre {
                None => return Ok(None),
                Some(Kind::Filter(module)) => {
                    let settings = crate::proxy_wasm::Settings {
                        name: name.clone(),
                        fail: u.fail,
                        root_id: u.root_id.clone().unwrap_or_else(|| Arc::from("")),
                        config: filter_config(&u.config_json),
                        vm_config: u
                            .vm_config_json
                            .as_deref()
                            .map_or_else(bytes::Bytes::new, filter_config),
                        timeout: u.timeout,
                        start_timeout: u.start_timeout,
                        memory: u.memory.unwrap_or(crate::proxy_wasm::DEFAULT_MEMORY),
                        route_names,
                        upstreams: upstreams.clone(),
                        route,
                    };
                    return match crate::proxy_wasm::ProxyWasm::new(&engine, &module, settings) {
                        Ok(filter) => Ok(Some(filter as Arc<dyn Plugin>)),
                        Err(message) => Err(ConfigError {
                            pos: u.defined_at.clone(),
                            message: portcullis_config::envsubst::redact(
                                format!("plugin `{name}` on {on}: {message}"),
                                &u.substituted,
                            ),
                        }),
                    };
                }
                Some(Kind::Component(_)) if u.root_id.is_some() || u.vm_config_json.is_some() => {
                    return Err(ConfigError {
                        pos: u.defined_at.clone(),
                        message: format!(
                            "plugin `{name}` on {on}: `root_id` and `vm_config` are for proxy-wasm filters; this is a component"
                        ),
                    });
                }
                Some(Kind::Component(pre)) => pre,
            };
            let mut binding = Binding {
                plugin: name.clone(),
                fail: u.fail,
                hooks: seam::Hooks::default(),
                pre,
                engine,
                config_json: u.config_json.clone(),
                timeout: u.timeout,
                start_timeout: u.start_timeout,
                memory: u.memory.unwrap_or(crate::DEFAULT_COMPONENT_MEMORY),
                fresh: u.fresh_instances,
                idle: std::array::from_fn(|_| Shard::default()),
                route_names,
                route,
                memory_peak: Default::default(),
            };
            let at = |message: String| ConfigError {
                pos: u.defined_at.clone(),
                message: portcullis_config::envsubst::redact(
                    format!("plugin `{name}` on {on}: {message}"),
                    &u.substituted,
                ),
            };
            // Instantiating runs the plugin's start-up and `configure`,
            // which validates the config; a plugin that cannot start is
            // refused here rather than on the first request.
            let mut inst = match binding.instantiate() {
                Ok(i) => i,
                Err(PluginError::Setup { message, .. }) => return Err(at(message)),
                Err(e) => return Err(at(e.to_string())),
            };
            Binding::arm(&mut inst.store);
            match inst.policy.validate_config(&mut inst.store, &u.config_json) {
                Ok(Ok(())) => {}
                Ok(Err(m)) => return Err(at(format!("invalid config: {m}"))),
                Err(e) => {
                    let e = binding.classify(e, &inst.store, "validate-config");
                    return Err(at(e.to_string()));
                }
            }
            Binding::arm(&mut inst.store);
            let (request, response) = match inst.policy.hooks(&mut inst.store) {
                Ok(h) => h,
                Err(e) => return Err(at(binding.classify(e, &inst.store, "hooks").to_string())),
            };
            binding.hooks = seam::Hooks {
                request,
                response,
                // `on-response` is the upstream's response's, by contract.
                local_answers: false,
                response_body: false,
                request_body: false,
            };
            // Not kept: idle instances are per thread, and this is not a
            // worker's; kept, it would hold a pool slot for nothing.
            drop(inst);
            Ok(Some(Arc::new(binding) as Arc<dyn Plugin>))
        };
        async move {
            let plugin = bound.await?;
            Ok(match (plugin, shadow) {
                (Some(p), Some(percent)) => {
                    Some(Arc::new(crate::Shadow::new(p, percent)) as Arc<dyn Plugin>)
                }
                (plugin, _) => plugin,
            })
        }
    };

    let mut global = Vec::new();
    for u in &config.global_plugins {
        match bind_use(&bind, config, u, None).await {
            Ok(Some(b)) => global.push(b),
            Ok(None) => {}
            Err(e) => errors.push(e),
        }
    }
    let mut routes = Vec::with_capacity(config.routes.len());
    for route in &config.routes {
        let mut chain = global.clone();
        for u in &route.plugins {
            match bind_use(&bind, config, u, Some(&route.name)).await {
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

/// `u` bound with `bind`, and with its rollout's candidate when it has
/// one (a candidate that could not be bound leaves the use unwrapped; its
/// error is reported).
async fn bind_use<F, Fut>(
    bind: &F,
    config: &Config,
    u: &PluginUse,
    route: Option<&str>,
) -> Result<Option<Arc<dyn Plugin>>, ConfigError>
where
    F: Fn(&PluginUse, Option<&str>) -> Fut,
    Fut: std::future::Future<Output = Result<Option<Arc<dyn Plugin>>, ConfigError>>,
{
    let bound = bind(u, route).await?;
    let (Some(current), Some(r)) = (bound.clone(), &u.rollout) else {
        return Ok(bound);
    };
    let candidate = match bind(&r.candidate, route).await? {
        Some(c) => c,
        None => return Ok(Some(current)),
    };
    let state = rollout_state(config, route.unwrap_or(""), u, r);
    let rollout = crate::Rollout::new(current, candidate, r.key.clone(), state);
    Ok(Some(Arc::new(rollout)))
}

/// The state of `u`'s rollout on `route`: kept from the pipeline that
/// has it when the policies say the same of it (the route, both versions'
/// modules and configs, the schedule), so a reload that leaves it alone
/// leaves it where it is, rolled back included.
fn rollout_state(
    config: &Config,
    route: &str,
    u: &PluginUse,
    r: &portcullis_config::Rollout,
) -> Arc<crate::rollout::State> {
    let version = |u: &PluginUse| {
        let m = &config.plugins[u.plugin];
        format!("{}@{}:{}", m.name, hex::encode(m.sha256), u.config_json)
    };
    let spec = crate::rollout::Spec {
        steps: r.steps.clone(),
        interval: r.interval,
        window: r.window,
        min_requests: r.min_requests,
        margin: r.margin,
    };
    let key = format!(
        "{route}\n{}\n{}\n{spec:?}\n{:?}",
        version(u),
        version(&r.candidate),
        r.key
    );
    crate::rollout::State::for_key(key, spec)
}

/// A plugin module compiled: a component, or a proxy-wasm filter.
#[derive(Clone)]
enum Kind {
    Component(Pre),
    Filter(wasmtime::Module),
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

/// Every name a filter's HTTP call may give an upstream of `config`: its
/// own, and `outbound|PORT||HOST` for each of its endpoints (Istio's and
/// Higress's cluster names; the first upstream with an endpoint there
/// takes the name).
fn upstream_names(config: &Config) -> crate::proxy_wasm::UpstreamNames {
    let mut names: Vec<(Arc<str>, Arc<str>)> = (config.upstreams.iter())
        .map(|u| (u.name.clone(), u.name.clone()))
        .collect();
    for u in &config.upstreams {
        let portcullis_config::Target::Endpoints(endpoints) = &u.target else {
            continue;
        };
        for e in endpoints.iter() {
            let default = if e.scheme == http::uri::Scheme::HTTPS {
                443
            } else {
                80
            };
            let port = e.authority.port_u16().unwrap_or(default);
            let alias: Arc<str> = format!("outbound|{port}||{}", e.authority.host()).into();
            if !names.iter().any(|(n, _)| *n == alias) {
                names.push((alias, u.name.clone()));
            }
        }
    }
    names.into()
}

/// A filter's configuration bytes from the use's `config`: a string as
/// its text, any other value as its JSON, none as nothing (Envoy's
/// `configuration`, which is bytes).
fn filter_config(json: &str) -> bytes::Bytes {
    match serde_json::from_str::<serde_json::Value>(json) {
        Ok(serde_json::Value::String(text)) => text.into(),
        Ok(serde_json::Value::Null) => bytes::Bytes::new(),
        _ => bytes::Bytes::copy_from_slice(json.as_bytes()),
    }
}
