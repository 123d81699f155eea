//! One plugin use bound for a set of policies: the running use when the
//! policies state it as the running ones do ([`crate::kept`]), otherwise
//! a proxy-wasm filter or a component made and started from the use's
//! settings; then wrapped in its shadow and its rollout.

use super::*;
use crate::kept::{self, Key};
use crate::proxy_wasm::UpstreamNames;

/// A plugin module compiled: a component, or a proxy-wasm filter.
#[derive(Clone)]
pub(crate) enum Kind {
    Component(Pre),
    Filter(wasmtime::Module),
}

/// What binding the uses of one set of policies needs.
pub(crate) struct Binder<'a> {
    config: &'a Config,
    /// Each module compiled, by index (`None`: it failed to).
    pres: &'a [Option<Kind>],
    engine: &'a Engine,
    route_names: Arc<[Arc<str>]>,
    upstreams: UpstreamNames,
    /// How many uses with each key these policies have had so far.
    seen: Mutex<HashMap<Key, u32>>,
}

impl<'a> Binder<'a> {
    pub(crate) fn new(config: &'a Config, pres: &'a [Option<Kind>], engine: &'a Engine) -> Self {
        Binder {
            config,
            pres,
            engine,
            route_names: config.routes.iter().map(|r| r.name.clone()).collect(),
            upstreams: upstream_names(config),
            seen: Mutex::default(),
        }
    }

    /// `u` on `route` (`None`: the global chain), with its rollout's
    /// candidate when it has one (a candidate that could not be bound
    /// leaves the use unwrapped; its error is reported). `None`: its
    /// module did not compile (that error is reported).
    pub(crate) fn bind_use(
        &self,
        u: &PluginUse,
        route: Option<&str>,
    ) -> Result<Option<Arc<dyn Plugin>>, ConfigError> {
        let bound = self.bind(u, route)?;
        let (Some(current), Some(r)) = (bound.clone(), &u.rollout) else {
            return Ok(bound);
        };
        let candidate = match self.bind(&r.candidate, route)? {
            Some(c) => c,
            None => return Ok(Some(current)),
        };
        let state = rollout_state(self.config, route.unwrap_or(""), u, r);
        let rollout = crate::Rollout::new(current, candidate, r.key.clone(), state);
        Ok(Some(Arc::new(rollout)))
    }

    /// `u` alone: the running use with its key, or one made and started
    /// now; behind its shadow when it has one.
    fn bind(
        &self,
        u: &PluginUse,
        route: Option<&str>,
    ) -> Result<Option<Arc<dyn Plugin>>, ConfigError> {
        let module = &self.config.plugins[u.plugin];
        let Some(pre) = &self.pres[u.plugin] else {
            return Ok(None);
        };
        let key = self.key(u, route, matches!(pre, Kind::Filter(_)));
        let plugin = match kept::find(key) {
            Some(running) => running,
            None => {
                let made = match pre {
                    Kind::Filter(filter) => self.filter(filter, u, route),
                    Kind::Component(pre) => self.component(pre, u, route),
                };
                made.map_err(|message| {
                    let on = route
                        .map_or_else(|| "the global chain".to_owned(), |r| format!("route `{r}`"));
                    ConfigError {
                        pos: u.defined_at.clone(),
                        message: portcullis_config::envsubst::redact(
                            format!("plugin `{}` on {on}: {message}", module.name),
                            &u.substituted,
                        ),
                    }
                })?
            }
        };
        kept::note(key, &plugin);
        Ok(Some(match u.shadow {
            Some(percent) => Arc::new(crate::Shadow::new(plugin, percent)) as Arc<dyn Plugin>,
            None => plugin,
        }))
    }

    /// The key of `u` on `route`, told apart from the uses before it in
    /// these policies with the same key.
    fn key(&self, u: &PluginUse, route: Option<&str>, is_filter: bool) -> Key {
        let module = &self.config.plugins[u.plugin];
        // A filter's calls name upstreams; a component's do not.
        let names = is_filter.then_some(&self.upstreams);
        let key = kept::key_of(module, u, (route, &self.route_names), names);
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        let n = seen.entry(key).or_default();
        *n += 1;
        key.nth(*n - 1)
    }

    /// A proxy-wasm filter's use, started once (which `check` reports).
    fn filter(
        &self,
        module: &wasmtime::Module,
        u: &PluginUse,
        route: Option<&str>,
    ) -> Result<Arc<dyn Plugin>, String> {
        let settings = crate::proxy_wasm::Settings {
            name: self.config.plugins[u.plugin].name.clone(),
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
            route_names: self.route_names.clone(),
            upstreams: self.upstreams.clone(),
            route: route.map(Arc::from),
        };
        let filter = crate::proxy_wasm::ProxyWasm::new(self.engine, module, settings)?;
        Ok(filter)
    }

    /// A component's use: one instance made to validate its config and
    /// learn its hooks, then dropped.
    fn component(
        &self,
        pre: &Pre,
        u: &PluginUse,
        route: Option<&str>,
    ) -> Result<Arc<dyn Plugin>, String> {
        if u.root_id.is_some() || u.vm_config_json.is_some() {
            return Err(
                "`root_id` and `vm_config` are for proxy-wasm filters; this is a component".into(),
            );
        }
        let mut binding = Binding {
            plugin: self.config.plugins[u.plugin].name.clone(),
            fail: u.fail,
            hooks: seam::Hooks::default(),
            pre: pre.clone(),
            engine: self.engine.clone(),
            config_json: u.config_json.clone(),
            timeout: u.timeout,
            start_timeout: u.start_timeout,
            memory: u.memory.unwrap_or(crate::DEFAULT_COMPONENT_MEMORY),
            fresh: u.fresh_instances,
            idle: std::array::from_fn(|_| Shard::default()),
            route_names: self.route_names.clone(),
            route: route.map(Arc::from),
            memory_peak: Default::default(),
        };
        // Instantiating runs the plugin's start-up and `configure`,
        // which validates the config; a plugin that cannot start is
        // refused here rather than on the first request.
        let mut inst = match binding.instantiate() {
            Ok(i) => i,
            Err(PluginError::Setup { message, .. }) => return Err(message),
            Err(e) => return Err(e.to_string()),
        };
        Binding::arm(&mut inst.store);
        match inst.policy.validate_config(&mut inst.store, &u.config_json) {
            Ok(Ok(())) => {}
            Ok(Err(m)) => return Err(format!("invalid config: {m}")),
            Err(e) => {
                return Err(binding
                    .classify(e, &inst.store, "validate-config")
                    .to_string());
            }
        }
        Binding::arm(&mut inst.store);
        let (request, response) = match inst.policy.hooks(&mut inst.store) {
            Ok(h) => h,
            Err(e) => return Err(binding.classify(e, &inst.store, "hooks").to_string()),
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
        Ok(Arc::new(binding))
    }
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
