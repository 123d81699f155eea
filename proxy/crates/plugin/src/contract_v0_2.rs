//! Components built against the 0.2 contract (wit/v0.2/), run by the 0.3
//! host: their host calls served by 0.3's (the records are the same, under
//! other names), their answers turned into 0.3's. 0.2 has no callouts, no
//! response body and no answer from `on-response`, so its answers are each
//! one of 0.3's.

use super::bindings::{self as now, v0_2::portcullis::policy::host as old_host};
use super::bindings::{
    portcullis::policy::host as now_host, v0_2::portcullis::policy::types as old,
};
use super::state::State;

/// A 0.2 `decision` as 0.3's.
pub fn decision(d: old::Decision) -> now::Decision {
    match d {
        old::Decision::Forward(f) => now::Decision::Forward(now::Forward {
            headers: edits(f.headers),
            path: f.path,
            upstream: f.upstream,
        }),
        old::Decision::Respond(r) => now::Decision::Respond(now::LocalResponse {
            status: r.status,
            headers: headers(r.headers),
            body: r.body,
        }),
        old::Decision::ReadBody(max) => now::Decision::ReadBody(max),
    }
}

/// 0.2's header edits as 0.3's.
pub fn edits(e: old::HeaderEdits) -> now::HeaderEdits {
    now::HeaderEdits {
        remove: e.remove,
        set: headers(e.set),
        add: headers(e.add),
    }
}

fn headers(list: Vec<old::Header>) -> Vec<now::Header> {
    list.into_iter()
        .map(|h| now::Header {
            name: h.name,
            value: h.value,
        })
        .collect()
}

fn old_headers(list: Vec<now::Header>) -> Vec<old::Header> {
    list.into_iter()
        .map(|h| old::Header {
            name: h.name,
            value: h.value,
        })
        .collect()
}

impl old_host::Host for State {
    fn log(&mut self, level: old_host::Level, message: String) {
        let level = match level {
            old_host::Level::Trace => now::Level::Trace,
            old_host::Level::Debug => now::Level::Debug,
            old_host::Level::Info => now::Level::Info,
            old_host::Level::Warn => now::Level::Warn,
            old_host::Level::Error => now::Level::Error,
        };
        now_host::Host::log(self, level, message);
    }

    fn now_unix_ms(&mut self) -> u64 {
        now_host::Host::now_unix_ms(self)
    }

    fn count(&mut self, name: String, delta: u64) {
        now_host::Host::count(self, name, delta);
    }

    fn current_request(&mut self) -> old::RequestHead {
        let h = now_host::Host::current_request(self);
        old::RequestHead {
            method: h.method,
            scheme: h.scheme,
            authority: h.authority,
            path: h.path,
            query: h.query,
            client_addr: h.client_addr,
            tls: h.tls,
            sni: h.sni,
        }
    }

    fn current_route(&mut self) -> old::RouteInfo {
        let r = now_host::Host::current_route(self);
        old::RouteInfo {
            name: r.name,
            params: r.params,
        }
    }

    fn client_certificate(&mut self) -> Option<old::Certificate> {
        let c = now_host::Host::client_certificate(self)?;
        Some(old::Certificate {
            sha256: c.sha256,
            subject: c.subject,
            dns_names: c.dns_names,
            uris: c.uris,
            emails: c.emails,
            ip_addresses: c.ip_addresses,
            der: c.der,
        })
    }

    // Served by `header_call`'s shortcuts, as 0.3's are.
    fn request_header(&mut self, name: String) -> Option<Vec<u8>> {
        now_host::Host::request_header(self, name)
    }

    fn request_headers(&mut self) -> Vec<old::Header> {
        old_headers(now_host::Host::request_headers(self))
    }

    fn response_header(&mut self, name: String) -> Option<Vec<u8>> {
        now_host::Host::response_header(self, name)
    }

    fn response_headers(&mut self) -> Vec<old::Header> {
        old_headers(now_host::Host::response_headers(self))
    }
}

impl old::Host for State {}
