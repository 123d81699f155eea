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
    use super::Key;

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
