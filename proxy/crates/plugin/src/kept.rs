//! Plugin uses kept across reloads. A use the new policies state exactly
//! as the running ones do — the same module (by digest), config, budgets,
//! route, and what its calls can name — is the running use itself in the
//! new chains: its VMs or idle instances, warm, and what its root context
//! holds (keys fetched when configured, counters), as Envoy keeps a root
//! context whose plugin configuration did not change. A reload that
//! touches one route then restarts nothing else, and the first request
//! through an untouched filter after it costs what the hundredth does.
//!
//! The running uses are found through weak references, held while some
//! pipeline holds the use; a use no pipeline holds any more is gone, and
//! the next policies with it start it afresh.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, Weak};

use sha2::{Digest, Sha256};

use crate::seam::Plugin;

/// What makes two uses the same: a digest of everything a use is built
/// from (secrets substituted into a config included, so kept hashed).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub struct Key([u8; 32]);

impl Key {
    /// The key of a use built from `parts`, each told apart from the next
    /// by its length, so no two lists of parts run together the same.
    pub fn of<'a>(parts: impl IntoIterator<Item = &'a [u8]>) -> Key {
        let mut hash = Sha256::new();
        for part in parts {
            hash.update((part.len() as u64).to_le_bytes());
            hash.update(part);
        }
        Key(hash.finalize().into())
    }

    /// The key of the `n`th use (from 0) with this key in one set of
    /// policies: two identical uses on one route stay two uses, as the
    /// policies wrote them.
    pub fn nth(self, n: u32) -> Key {
        match n {
            0 => self,
            n => Key::of([&self.0[..], &n.to_le_bytes()[..]]),
        }
    }
}

/// The key of use `u` of `module` on `route` (`None`: the global chain),
/// in policies with routes `routes` and, for a filter (whose calls may
/// name upstreams), upstream names `upstreams`. A use on a route names
/// its route by itself; a global one by the index of the request's route,
/// so every route's name counts.
pub fn key_of(
    module: &portcullis_config::PluginModule,
    u: &portcullis_config::PluginUse,
    (route, routes): (Option<&str>, &[Arc<str>]),
    upstreams: Option<&crate::proxy_wasm::UpstreamNames>,
) -> Key {
    let flags = [
        u.fail as u8,
        u8::from(u.fresh_instances),
        u8::from(u.root_id.is_some()),
        u8::from(u.vm_config_json.is_some()),
        u8::from(route.is_some()),
    ];
    let numbers = [
        u.timeout.as_nanos() as u64,
        u.start_timeout.as_nanos() as u64,
        u.memory.map_or(u64::MAX, |m| m as u64),
    ]
    .map(u64::to_le_bytes);
    let mut parts: Vec<&[u8]> = vec![
        module.name.as_bytes(),
        &module.sha256,
        u.config_json.as_bytes(),
        u.root_id.as_deref().map_or(&[][..], str::as_bytes),
        u.vm_config_json.as_deref().map_or(&[][..], str::as_bytes),
        &flags,
        &numbers[0],
        &numbers[1],
        &numbers[2],
    ];
    match route {
        Some(route) => parts.push(route.as_bytes()),
        None => parts.extend(routes.iter().map(|r| r.as_bytes())),
    }
    parts.push(b"upstreams");
    for (name, upstream) in upstreams.into_iter().flat_map(|u| u.iter()) {
        parts.extend([name.as_bytes(), upstream.as_bytes()]);
    }
    Key::of(parts)
}

fn running() -> &'static Mutex<HashMap<Key, Weak<dyn Plugin>>> {
    static RUNNING: OnceLock<Mutex<HashMap<Key, Weak<dyn Plugin>>>> = OnceLock::new();
    RUNNING.get_or_init(Default::default)
}

/// The running use with `key`, if a pipeline still holds one.
pub fn find(key: Key) -> Option<Arc<dyn Plugin>> {
    let running = running().lock().unwrap_or_else(|p| p.into_inner());
    running.get(&key).and_then(Weak::upgrade)
}

/// Notes `plugin` as the use with `key`, for the next policies to find.
pub fn note(key: Key, plugin: &Arc<dyn Plugin>) {
    let mut running = running().lock().unwrap_or_else(|p| p.into_inner());
    running.retain(|_, p| p.strong_count() > 0);
    running.insert(key, Arc::downgrade(plugin));
}

#[cfg(test)]
mod tests {
    use super::{Key, key_of};
    use portcullis_config::Config;

    /// Policies with `routes` (YAML list items) over one upstream and
    /// the module `p` (its bytes `module`).
    fn policies(routes: &str, module: &[u8], global: &str) -> Config {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("p.wasm"), module).unwrap();
        let yaml = format!(
            "listeners: [{{ name: l, bind: \"127.0.0.1:0\" }}]\n\
             upstreams: [{{ name: app, endpoints: [\"http://127.0.0.1:9\"] }}]\n\
             plugins: [{{ name: p, path: p.wasm }}]\n{global}\
             routes:\n{routes}"
        );
        std::fs::write(dir.path().join("policy.yaml"), yaml).unwrap();
        portcullis_config::load_dir(dir.path()).unwrap()
    }

    /// The key of the use on route `route` (`None`: the first global use).
    fn key(config: &Config, route: Option<&str>, filter: bool) -> Key {
        let u = match route {
            Some(name) => {
                &config
                    .routes
                    .iter()
                    .find(|r| &*r.name == name)
                    .unwrap()
                    .plugins[0]
            }
            None => &config.global_plugins[0],
        };
        let routes: Vec<std::sync::Arc<str>> =
            config.routes.iter().map(|r| r.name.clone()).collect();
        let upstreams: crate::proxy_wasm::UpstreamNames = config
            .upstreams
            .iter()
            .map(|u| (u.name.clone(), u.name.clone()))
            .collect();
        let module = &config.plugins[u.plugin];
        key_of(module, u, (route, &routes), filter.then_some(&upstreams))
    }

    const WASM: &[u8] = b"\0asm\x01\0\0\0";
    const USE: &str = "  - { name: a, match: { path: /a }, upstream: app, plugins: [{ use: p, config: { x: 1 } }] }\n";
    const OTHER: &str = "  - { name: b, match: { path: /b }, upstream: app }\n";

    /// What keeps a use across a reload, and what does not.
    #[test]
    fn a_use_is_kept_by_what_it_is_built_from() {
        let base = key(&policies(USE, WASM, ""), Some("a"), true);
        // A route added before it: the same use.
        let moved = policies(&format!("{OTHER}{USE}"), WASM, "");
        assert_eq!(key(&moved, Some("a"), true), base);
        // Its config, budget, fail mode or module changed: another.
        for (routes, module) in [
            (USE.replace("x: 1", "x: 2"), WASM.to_vec()),
            (
                USE.replace("config:", "timeout: 7ms, config:"),
                WASM.to_vec(),
            ),
            (
                USE.replace("config:", "start_timeout: 3s, config:"),
                WASM.to_vec(),
            ),
            (
                USE.replace("config:", "memory: 3MiB, config:"),
                WASM.to_vec(),
            ),
            (USE.replace("config:", "fail: open, config:"), WASM.to_vec()),
            (USE.to_owned(), [WASM, b"\0"].concat()),
        ] {
            assert_ne!(
                key(&policies(&routes, &module, ""), Some("a"), true),
                base,
                "{routes}"
            );
        }
        // A global use names a request's route by index: every route counts.
        let global = "global_plugins: [{ use: p }]\n";
        let one = key(&policies(OTHER, WASM, global), None, false);
        let two = key(
            &policies(&format!("{OTHER}{USE}"), WASM, global),
            None,
            false,
        );
        assert_ne!(one, two);
    }

    #[test]
    fn parts_are_told_apart_by_their_lengths() {
        let a = Key::of([&b"ab"[..], b"c"]);
        let b = Key::of([&b"a"[..], b"bc"]);
        assert_ne!(a, b);
        assert_eq!(a, Key::of([&b"ab"[..], b"c"]));
        assert_eq!(a.nth(0), a);
        assert_ne!(a.nth(1), a);
        assert_ne!(a.nth(1), a.nth(2));
    }
}
