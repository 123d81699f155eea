//! Authorisation on the client certificate of a mutual-TLS listener, as
//! Envoy's RBAC does on `authenticated.principal_name`: the listener's
//! `client_ca` says the certificate is genuine, this says which of the
//! genuine ones may use the route.
//!
//! A request passes when its certificate carries any listed name: a URI
//! alternative name (a SPIFFE ID; a pattern may end in `*`), a DNS name
//! (`*.suffix` matches any name below), the subject (RFC 4514 form, exact)
//! or the SHA-256 of the certificate (pinning one client). Anything else
//! gets a 403, as does a request without a certificate (a listener without
//! `client_ca`). With `identity_header`, the upstream learns the name that
//! matched in that header; a client-sent one is always removed.

use portcullis_sdk::{Certificate, Decision, HeaderEdits, Plugin, RequestHead, RouteInfo};
use serde::Deserialize;

/// The route's config.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    uris: Vec<String>,
    #[serde(default)]
    dns_names: Vec<String>,
    #[serde(default)]
    subjects: Vec<String>,
    #[serde(default)]
    sha256: Vec<String>,
    #[serde(default)]
    identity_header: Option<String>,
}

impl Config {
    fn check(&self) -> Result<(), String> {
        if self.uris.is_empty()
            && self.dns_names.is_empty()
            && self.subjects.is_empty()
            && self.sha256.is_empty()
        {
            return Err("give at least one of `uris`, `dns_names`, `subjects`, `sha256`".into());
        }
        for (i, uri) in self.uris.iter().enumerate() {
            if uri.is_empty() || uri.trim_end_matches('*').contains('*') {
                return Err(format!(
                    "uris[{i}] `{uri}`: a `*` may only end a pattern (`spiffe://cluster.local/ns/ci/*`)"
                ));
            }
        }
        for (i, name) in self.dns_names.iter().enumerate() {
            let rest = name.strip_prefix("*.").unwrap_or(name);
            if rest.is_empty() || rest.contains('*') {
                return Err(format!(
                    "dns_names[{i}] `{name}`: a name, or `*.` and a name for any below it"
                ));
            }
        }
        for (i, hash) in self.sha256.iter().enumerate() {
            if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(format!(
                    "sha256[{i}]: 64 hex digits (the certificate's SHA-256, as `openssl x509 -noout -fingerprint -sha256` prints without colons)"
                ));
            }
        }
        if let Some(h) = &self.identity_header
            && !portcullis_sdk::is_header_name(h)
        {
            return Err(format!("identity_header `{h}` is not a header name"));
        }
        Ok(())
    }
}

/// The name of `cert` the config lets in, if any: the first listed URI,
/// DNS name, subject or hash it carries, in that order.
pub fn allowed<'c>(config: &Config, cert: &'c Certificate) -> Option<&'c str> {
    let uri = cert
        .uris
        .iter()
        .find(|u| config.uris.iter().any(|p| uri_matches(p, u)));
    let dns = || {
        cert.dns_names
            .iter()
            .find(|n| config.dns_names.iter().any(|p| dns_matches(p, n)))
    };
    let subject = || {
        config
            .subjects
            .contains(&cert.subject)
            .then_some(&cert.subject)
    };
    let pinned = || {
        config
            .sha256
            .iter()
            .any(|h| h.eq_ignore_ascii_case(&cert.sha256))
            .then_some(&cert.sha256)
    };
    uri.or_else(dns)
        .or_else(subject)
        .or_else(pinned)
        .map(String::as_str)
}

fn uri_matches(pattern: &str, uri: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => uri.starts_with(prefix),
        None => pattern == uri,
    }
}

/// DNS names compare without case; `*.suffix` matches names below
/// `suffix` (any depth, as a listed parent domain is what is trusted).
fn dns_matches(pattern: &str, name: &str) -> bool {
    match pattern.strip_prefix('*') {
        Some(dot_suffix) => {
            name.len() > dot_suffix.len()
                && name.as_bytes()[name.len() - dot_suffix.len()..]
                    .eq_ignore_ascii_case(dot_suffix.as_bytes())
        }
        None => pattern.eq_ignore_ascii_case(name),
    }
}

struct ClientCertAllow;

impl Plugin for ClientCertAllow {
    type Config = Config;

    fn validate(c: &Config) -> Result<(), String> {
        c.check()
    }

    fn on_request(
        c: &Config,
        req: &RequestHead,
        _route: &RouteInfo,
        _body: Option<&[u8]>,
    ) -> Decision {
        let Some(cert) = req.client_certificate() else {
            portcullis_sdk::count("refused", 1);
            return portcullis_sdk::respond(403, "client certificate required");
        };
        let Some(name) = allowed(c, &cert) else {
            portcullis_sdk::count("refused", 1);
            portcullis_sdk::log(
                portcullis_sdk::Level::Info,
                &format!("client certificate not allowed: {}", cert.subject),
            );
            return portcullis_sdk::respond(403, "client certificate not allowed");
        };
        match &c.identity_header {
            Some(h) => portcullis_sdk::forward_with(HeaderEdits {
                remove: Vec::new(),
                // `set` replaces every client-sent field of that name.
                set: vec![portcullis_sdk::header(h, name)],
                add: Vec::new(),
            }),
            None => portcullis_sdk::forward(),
        }
    }
}

portcullis_sdk::plugin!(ClientCertAllow);

#[cfg(test)]
mod tests {
    use super::*;

    fn cert() -> Certificate {
        Certificate {
            sha256: "ab".repeat(32),
            subject: "CN=ci,O=Example".into(),
            dns_names: vec!["runner.ci.example".into()],
            uris: vec!["spiffe://cluster.local/ns/ci/sa/runner".into()],
            emails: vec![],
            ip_addresses: vec![],
            der: vec![],
        }
    }

    fn config(json: &str) -> Config {
        let c: Config = portcullis_sdk::parse_config(json).unwrap();
        c.check().unwrap();
        c
    }

    #[test]
    fn any_listed_name_lets_in_and_says_which() {
        let c = cert();
        let by_uri = config(r#"{"uris": ["spiffe://cluster.local/ns/ci/*"]}"#);
        assert_eq!(
            allowed(&by_uri, &c),
            Some("spiffe://cluster.local/ns/ci/sa/runner")
        );
        let by_dns = config(r#"{"dns_names": ["*.CI.example"]}"#);
        assert_eq!(allowed(&by_dns, &c), Some("runner.ci.example"));
        let by_subject = config(r#"{"subjects": ["CN=ci,O=Example"]}"#);
        assert_eq!(allowed(&by_subject, &c), Some("CN=ci,O=Example"));
        let pinned = config(&format!(r#"{{"sha256": ["{}"]}}"#, "AB".repeat(32)));
        assert_eq!(allowed(&pinned, &c), Some(c.sha256.as_str()));
    }

    #[test]
    fn near_misses_stay_out() {
        let c = cert();
        for json in [
            r#"{"uris": ["spiffe://cluster.local/ns/ci/sa/other"]}"#,
            r#"{"uris": ["spiffe://cluster.local/ns/cd/*"]}"#,
            r#"{"dns_names": ["ci.example"]}"#,
            r#"{"dns_names": ["*.runner.ci.example"]}"#,
            r#"{"subjects": ["CN=ci"]}"#,
        ] {
            assert_eq!(allowed(&config(json), &c), None, "{json}");
        }
        // `*.example` must not match a name that merely ends in "example".
        assert!(!dns_matches("*.example", "badexample"));
        assert!(!dns_matches("*.example", ".example"));
    }

    #[test]
    fn bad_configs_say_what_is_wrong() {
        let err = |json: &str| {
            portcullis_sdk::parse_config::<Config>(json)
                .and_then(|c| c.check())
                .unwrap_err()
        };
        assert!(err("{}").contains("at least one"));
        assert!(err(r#"{"uris": ["spiffe://*/ns"]}"#).contains("uris[0]"));
        assert!(err(r#"{"dns_names": ["a.*.example"]}"#).contains("dns_names[0]"));
        assert!(err(r#"{"sha256": ["abc"]}"#).contains("sha256[0]"));
        assert!(
            err(r#"{"subjects": ["CN=a"], "identity_header": "x y"}"#).contains("identity_header")
        );
        assert!(err(r#"{"subject": ["CN=a"]}"#).contains("unknown field"));
    }
}
