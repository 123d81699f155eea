//! `dns: each_address`: every address an upstream's host resolves to is an
//! endpoint of its own, looked up again every `dns_refresh`.
//!
//! A ClusterIP Service has one address, and kube-proxy balances behind it.
//! A headless Service (gRPC's usual choice, a StatefulSet's) has one per
//! pod, and connecting to the first address that answers sends everything
//! to one pod; an HTTP/2 upstream's one connection carries all requests
//! there. As with Envoy's `STRICT_DNS` clusters and nginx's `server ...
//! resolve`, each address becomes an endpoint, balanced, health-checked
//! and ejected on its own.
//!
//! Lookups use the system resolver, as the proxy's other lookups do, so
//! search domains and `/etc/hosts` work as in the pod. The answers live
//! in an [`AddressBook`]. A change swaps in a pipeline whose upstreams
//! list the new addresses. Connections and ejections of the addresses that
//! stayed are kept (see `Pipeline::new`). The request path never looks
//! anything up: an address is a plain endpoint there.
//!
//! A failed lookup (SERVFAIL, no answer) keeps the last addresses: a DNS
//! outage must not empty an upstream. A name that no longer exists or has
//! no address (NXDOMAIN: a headless Service scaled to zero) drops them, as
//! Envoy's `STRICT_DNS` does: its pods are gone, and dialing their old
//! addresses would wait out a connect timeout per request. A host without
//! addresses, never resolved or dropped, is one endpoint looked up at
//! connect time, so its requests get the usual 502 naming the lookup.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::uri::Scheme;

use portcullis_config::{Config, Dns, Endpoint, Target, Upstream};
use portcullis_net::resolve::{self, LookupError};

/// The longest one lookup may take before it counts as failed (glibc's
/// resolver alone may retry for longer).
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);

/// A host and port to look up.
pub type HostPort = (String, u16);

/// What each looked-up host resolved to last, sorted (DNS servers shuffle
/// their answers: order is no change).
#[derive(Default)]
pub struct AddressBook {
    known: Mutex<HashMap<HostPort, Vec<SocketAddr>>>,
    /// Hosts whose last lookup failed, so an outage is logged once.
    failing: Mutex<HashSet<HostPort>>,
    /// Told of every configuration applied, so the refresher, asleep while
    /// no upstream looks hosts up, sees one that does.
    applied: Arc<tokio::sync::Notify>,
}

/// The host and port `ep` connects to, when the host is a name (an IP
/// literal needs no lookup).
fn host_port(ep: &Endpoint) -> Option<HostPort> {
    let host = ep.authority.host();
    let bare = host.trim_start_matches('[').trim_end_matches(']');
    if bare.parse::<IpAddr>().is_ok() {
        return None;
    }
    let default = if ep.scheme == Scheme::HTTPS { 443 } else { 80 };
    Some((
        bare.to_ascii_lowercase(),
        ep.authority.port_u16().unwrap_or(default),
    ))
}

/// The hosts `config`'s `each_address` upstreams look up, each with its
/// upstream's refresh interval (the shortest, when several share it).
pub fn hosts(config: &Config) -> HashMap<HostPort, Duration> {
    let mut hosts = HashMap::new();
    for u in &config.upstreams {
        if let Dns::EachAddress { refresh, declared } = &u.dns {
            for hp in declared.iter().filter_map(host_port) {
                let every = hosts.entry(hp).or_insert(*refresh);
                *every = (*every).min(*refresh);
            }
        }
    }
    hosts
}

impl AddressBook {
    fn known(&self) -> std::sync::MutexGuard<'_, HashMap<HostPort, Vec<SocketAddr>>> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `host` has been resolved (successfully) before.
    pub fn knows(&self, host: &HostPort) -> bool {
        self.known().contains_key(host)
    }

    /// Looks `hosts` up, all at once; true when any host's addresses
    /// changed. `upstreams` names who uses each host, for the logs.
    pub async fn look_up(&self, hosts: Vec<HostPort>, config: &Config) -> bool {
        let lookups = hosts.into_iter().map(|hp| async move {
            let found = tokio::time::timeout(LOOKUP_TIMEOUT, resolve::look_up(hp.0.clone(), hp.1))
                .await
                .unwrap_or_else(|_| {
                    Err(LookupError::Failed(format!(
                        "no answer within {LOOKUP_TIMEOUT:?}"
                    )))
                });
            (hp, found)
        });
        let results = futures_util::future::join_all(lookups).await;
        let mut changed = false;
        for (hp, found) in results {
            changed |= self.note(hp, found, config);
        }
        changed
    }

    /// Records one lookup's result; true when the host's addresses changed.
    fn note(
        &self,
        hp: HostPort,
        found: Result<Vec<SocketAddr>, LookupError>,
        config: &Config,
    ) -> bool {
        let host = format!("{}:{}", hp.0, hp.1);
        let upstreams = users(config, &hp);
        let found = found.and_then(|mut addrs| {
            addrs.sort_unstable();
            addrs.dedup();
            if addrs.is_empty() {
                Err(LookupError::NoSuchName)
            } else {
                Ok(addrs)
            }
        });
        let mut failing = self.failing.lock().unwrap_or_else(|p| p.into_inner());
        let addrs = match found {
            Ok(addrs) => addrs,
            Err(LookupError::NoSuchName) => {
                let dropped = self.known().remove(&hp);
                if failing.insert(hp) || dropped.is_some() {
                    let dropped = dropped.unwrap_or_default();
                    let ips: Vec<_> = dropped.iter().map(|a| a.ip().to_string()).collect();
                    tracing::warn!(
                        host,
                        upstreams,
                        dropped = ?ips,
                        "upstream host does not resolve (no such name, or no address): \
                         its addresses are dropped, and it is looked up at connect time"
                    );
                    return !dropped.is_empty();
                }
                return false;
            }
            Err(LookupError::Failed(error)) => {
                if failing.insert(hp.clone()) {
                    let kept = self.known().get(&hp).map_or(0, Vec::len);
                    tracing::warn!(
                        host,
                        upstreams,
                        error,
                        kept,
                        "cannot look up an upstream host; its last addresses are kept"
                    );
                }
                return false;
            }
        };
        if failing.remove(&hp) {
            tracing::info!(host, upstreams, "upstream host resolves again");
        }
        drop(failing);
        let mut known = self.known();
        let before = known.get(&hp);
        if before == Some(&addrs) {
            return false;
        }
        let ips = |list: &[SocketAddr]| list.iter().map(|a| a.ip().to_string()).collect::<Vec<_>>();
        let added: Vec<_> = addrs
            .iter()
            .filter(|a| before.is_none_or(|b| !b.contains(a)))
            .map(|a| a.ip().to_string())
            .collect();
        let removed: Vec<_> = before
            .map(|b| {
                b.iter()
                    .filter(|a| !addrs.contains(a))
                    .copied()
                    .collect::<Vec<_>>()
            })
            .unwrap_or_default();
        tracing::info!(
            host,
            upstreams,
            addresses = ?ips(&addrs),
            added = ?added,
            removed = ?ips(&removed),
            "upstream host's addresses changed"
        );
        known.insert(hp, addrs);
        true
    }

    /// Wakes the refresher: a new configuration is being served.
    pub fn config_applied(&self) {
        self.applied.notify_one();
    }

    /// What [`AddressBook::config_applied`] notifies: the refresher,
    /// asleep while no upstream asks for lookups, waits on it.
    pub fn applied(&self) -> Arc<tokio::sync::Notify> {
        self.applied.clone()
    }

    /// Forgets hosts no upstream of `config` looks up any more.
    pub fn retain(&self, hosts: &HashMap<HostPort, Duration>) {
        self.known().retain(|hp, _| hosts.contains_key(hp));
        self.failing
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|hp| hosts.contains_key(hp));
    }

    /// `config` with each `each_address` upstream listing the addresses
    /// known now; `None` when it lists them already.
    pub fn expanded(&self, config: &Config) -> Option<Config> {
        let known = self.known();
        let mut changed = false;
        let upstreams = config
            .upstreams
            .iter()
            .map(|u| match expand(u, &known) {
                Some(new) => {
                    changed = true;
                    Arc::new(new)
                }
                None => u.clone(),
            })
            .collect();
        changed.then(|| Config {
            upstreams,
            ..config.clone()
        })
    }

    /// [`AddressBook::expanded`], for a config about to be served.
    pub fn expand(&self, config: Config) -> Config {
        self.expanded(&config).unwrap_or(config)
    }
}

/// The names of the upstreams that look `hp` up, for logs.
fn users(config: &Config, hp: &HostPort) -> String {
    let names: Vec<&str> = config
        .upstreams
        .iter()
        .filter(|u| match &u.dns {
            Dns::EachAddress { declared, .. } => {
                declared.iter().any(|ep| host_port(ep).as_ref() == Some(hp))
            }
            Dns::Connect => false,
        })
        .map(|u| &*u.name)
        .collect();
    names.join(",")
}

/// `u` with its declared endpoints expanded into the addresses in
/// `known`; `None` when that is what it lists already (or it is not an
/// `each_address` upstream).
fn expand(u: &Upstream, known: &HashMap<HostPort, Vec<SocketAddr>>) -> Option<Upstream> {
    let Dns::EachAddress { declared, .. } = &u.dns else {
        return None;
    };
    let endpoints = endpoints(declared, known);
    if matches!(&u.target, Target::Endpoints(now) if *now == endpoints) {
        return None;
    }
    Some(Upstream {
        target: Target::Endpoints(endpoints),
        ..u.clone()
    })
}

/// One endpoint per known address of each declared endpoint's host, in
/// declared order; an IP literal, or a host not resolved yet, stays as
/// declared.
pub fn endpoints(
    declared: &[Endpoint],
    known: &HashMap<HostPort, Vec<SocketAddr>>,
) -> Vec<Endpoint> {
    let mut out = Vec::with_capacity(declared.len());
    for ep in declared {
        match host_port(ep).and_then(|hp| known.get(&hp)) {
            Some(addrs) => out.extend(addrs.iter().map(|&a| Endpoint {
                address: Some(a),
                ..ep.clone()
            })),
            None => out.push(ep.clone()),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(url: &str) -> Endpoint {
        Endpoint::from_uri(&url.parse().unwrap()).unwrap()
    }

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn no_upstreams() -> Config {
        let source = portcullis_config::Source {
            name: "t.yaml".into(),
            text: "upstreams: []".into(),
        };
        portcullis_config::load_sources(&[source], &|_| None).unwrap()
    }

    #[test]
    fn each_known_address_is_an_endpoint_named_by_its_host() {
        let declared = [
            ep("https://API.ns.svc:8443/base"),
            ep("http://10.0.0.9:80"),
            ep("http://unresolved"),
        ];
        let mut known = HashMap::new();
        known.insert(
            ("api.ns.svc".to_owned(), 8443),
            vec![addr("10.0.0.1:8443"), addr("10.0.0.2:8443")],
        );
        let eps = endpoints(&declared, &known);
        assert_eq!(eps.len(), 4);
        assert_eq!(eps[0].address, Some(addr("10.0.0.1:8443")));
        assert_eq!(eps[1].address, Some(addr("10.0.0.2:8443")));
        for e in &eps[..2] {
            // Host header, SNI and base path stay the declared endpoint's.
            assert_eq!(e.authority, declared[0].authority);
            assert_eq!(e.host_header, declared[0].host_header);
            assert_eq!(e.base_path.as_deref(), Some("/base"));
        }
        assert_eq!(eps[1].to_string(), "API.ns.svc:8443 (10.0.0.2)");
        assert_eq!(eps[2], declared[1]);
        assert_eq!(eps[3], declared[2]);
        assert_eq!(eps[3].to_string(), "unresolved");
    }

    #[test]
    fn only_names_are_looked_up_with_the_scheme_default_port() {
        assert_eq!(host_port(&ep("http://10.1.2.3:8080")), None);
        assert_eq!(host_port(&ep("http://[::1]:8080")), None);
        assert_eq!(
            host_port(&ep("https://Svc.ns")),
            Some(("svc.ns".to_owned(), 443))
        );
        assert_eq!(
            host_port(&ep("http://svc.ns")),
            Some(("svc.ns".to_owned(), 80))
        );
    }

    #[tokio::test]
    async fn a_failed_lookup_keeps_the_last_addresses_and_order_is_no_change() {
        let config = no_upstreams();
        let book = AddressBook::default();
        let hp = ("svc".to_owned(), 80);
        let two = vec![addr("10.0.0.1:80"), addr("10.0.0.2:80")];
        let shuffled = vec![two[1], two[0], two[1]];
        assert!(book.note(hp.clone(), Ok(shuffled), &config));
        assert!(!book.note(hp.clone(), Ok(two.clone()), &config));
        let servfail = || Err(LookupError::Failed("SERVFAIL".into()));
        assert!(!book.note(hp.clone(), servfail(), &config));
        assert_eq!(book.known().get(&hp), Some(&two));
        assert!(book.note(hp.clone(), Ok(vec![addr("10.0.0.2:80")]), &config));
        assert!(book.knows(&hp));
    }

    #[tokio::test]
    async fn no_such_name_drops_the_addresses_once() {
        let config = no_upstreams();
        let book = AddressBook::default();
        let hp = ("svc".to_owned(), 80);
        assert!(book.note(hp.clone(), Ok(vec![addr("10.0.0.1:80")]), &config));
        assert!(book.note(hp.clone(), Err(LookupError::NoSuchName), &config));
        assert!(!book.knows(&hp));
        // Still gone, or an empty answer: no change to swap in.
        assert!(!book.note(hp.clone(), Err(LookupError::NoSuchName), &config));
        assert!(!book.note(hp.clone(), Ok(Vec::new()), &config));
        // A resolver failure now has nothing to keep.
        let servfail = Err(LookupError::Failed("SERVFAIL".into()));
        assert!(!book.note(hp.clone(), servfail, &config));
        assert!(book.note(hp.clone(), Ok(vec![addr("10.0.0.3:80")]), &config));
        assert_eq!(book.known().get(&hp), Some(&vec![addr("10.0.0.3:80")]));
    }
}
