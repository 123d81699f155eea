//! Picks the route for a request: host first (exact, then the longest
//! `*.suffix`, then routes without a host), then the path through a matchit
//! tree, then method and header conditions among routes that share a path.
//!
//! As in nginx server blocks and Envoy virtual hosts, once a host's table is
//! chosen there is no fall-through to less specific hosts.

use std::collections::HashMap;
use std::sync::Arc;

use http::{HeaderMap, Method};

use super::Route;

/// Which hosts a route answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostMatch {
    /// Any host (no `host` in the match).
    Any,
    /// One host, lower case, without port.
    Exact(String),
    /// Every subdomain of a domain: holds `.example.com` for `*.example.com`.
    Suffix(String),
}

impl std::fmt::Display for HostMatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HostMatch::Any => f.write_str("any host"),
            HostMatch::Exact(h) => write!(f, "host `{h}`"),
            HostMatch::Suffix(s) => write!(f, "host `*{s}`"),
        }
    }
}

/// The routes of one host, by path.
#[derive(Debug, Default, Clone)]
struct PathTable {
    tree: matchit::Router<usize>,
    /// Routes that share one path pattern, most specific first.
    groups: Vec<Vec<usize>>,
    /// Pattern text → group, to find which route a matchit conflict is with.
    patterns: HashMap<String, usize>,
}

/// The lookup structure over a config's routes.
#[derive(Debug, Default, Clone)]
pub struct Router {
    exact: HashMap<Box<str>, PathTable>,
    /// Sorted longest suffix first.
    suffix: Vec<(Box<str>, PathTable)>,
    any: PathTable,
}

/// A successful lookup.
#[derive(Debug)]
pub struct Matched<'r, 'p> {
    /// Index into `Config::routes`.
    pub route: usize,
    /// Path parameters captured by the pattern.
    pub params: matchit::Params<'r, 'p>,
}

fn methods_overlap(a: &Option<Vec<Method>>, b: &Option<Vec<Method>>) -> bool {
    match (a, b) {
        (Some(a), Some(b)) => a.iter().any(|m| b.contains(m)),
        _ => true,
    }
}

fn same_headers(a: &Route, b: &Route) -> bool {
    a.headers.len() == b.headers.len() && a.headers.iter().all(|h| b.headers.contains(h))
}

impl Router {
    /// Adds `pattern` on `host` for `routes[route]`; the error says which
    /// existing route it conflicts with.
    pub fn insert(
        &mut self,
        host: &HostMatch,
        pattern: &str,
        route: usize,
        routes: &[Arc<Route>],
    ) -> Result<(), String> {
        let table = match host {
            HostMatch::Any => &mut self.any,
            HostMatch::Exact(h) => self.exact.entry(h.as_str().into()).or_default(),
            HostMatch::Suffix(s) => match self.suffix.iter().position(|(k, _)| **k == **s) {
                Some(i) => &mut self.suffix[i].1,
                None => {
                    self.suffix.push((s.as_str().into(), PathTable::default()));
                    self.suffix
                        .sort_by_key(|entry| std::cmp::Reverse(entry.0.len()));
                    let i = self
                        .suffix
                        .iter()
                        .position(|(k, _)| **k == **s)
                        .unwrap_or(0);
                    &mut self.suffix[i].1
                }
            },
        };
        let new = &routes[route];
        if let Some(&g) = table.patterns.get(pattern) {
            for &other in &table.groups[g] {
                let old = &routes[other];
                if methods_overlap(&old.methods, &new.methods) && same_headers(old, new) {
                    return Err(format!(
                        "route `{}` conflicts with route `{}` ({}): both match {host}, path `{pattern}`, \
                         the same methods and headers; give one of them a different host, path, \
                         `methods` or `headers`",
                        new.name, old.name, old.defined_at
                    ));
                }
            }
            table.groups[g].push(route);
            // Routes with more conditions are tried first; the sort is stable
            // so equally specific routes keep file order.
            table.groups[g].sort_by_key(|&r| {
                std::cmp::Reverse(
                    routes[r].headers.len() * 2 + routes[r].methods.is_some() as usize,
                )
            });
            return Ok(());
        }
        let g = table.groups.len();
        match table.tree.insert(pattern, g) {
            Ok(()) => {
                table.groups.push(vec![route]);
                table.patterns.insert(pattern.to_owned(), g);
                Ok(())
            }
            Err(matchit::InsertError::Conflict { with }) => {
                let other = table
                    .patterns
                    .get(&with)
                    .and_then(|&og| table.groups[og].first())
                    .map(|&r| format!(" of route `{}` ({})", routes[r].name, routes[r].defined_at))
                    .unwrap_or_default();
                Err(format!(
                    "path `{pattern}` conflicts with path `{with}`{other} on {host}: the router \
                     cannot tell them apart; use one pattern for both"
                ))
            }
            Err(e) => Err(format!("path `{pattern}` is not a valid pattern: {e}")),
        }
    }

    /// Finds the route for a request. `host` is lower case without port.
    pub fn lookup<'r, 'p>(
        &'r self,
        host: &str,
        path: &'p str,
        method: &Method,
        headers: &HeaderMap,
        routes: &[Arc<Route>],
    ) -> Option<Matched<'r, 'p>> {
        let table = self
            .exact
            .get(host)
            .or_else(|| {
                self.suffix
                    .iter()
                    .find(|(s, _)| host.len() > s.len() && host.ends_with(&**s))
                    .map(|(_, t)| t)
            })
            .unwrap_or(&self.any);
        let found = table.tree.at(path).ok()?;
        let route = table.groups[*found.value].iter().copied().find(|&r| {
            let route = &routes[r];
            route.methods.as_ref().is_none_or(|ms| ms.contains(method))
                && route.headers.iter().all(|(n, v)| headers.get(n) == Some(v))
        })?;
        Some(Matched {
            route,
            params: found.params,
        })
    }
}
