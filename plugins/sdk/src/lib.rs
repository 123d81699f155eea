//! Write a Portcullis policy plugin in a few lines.
//!
//! ```ignore
//! use portcullis_sdk::{Decision, Plugin, RequestHead, RouteInfo};
//!
//! #[derive(serde::Deserialize)]
//! struct Config { header: String }
//!
//! struct RequireHeader;
//!
//! impl Plugin for RequireHeader {
//!     type Config = Config;
//!     fn on_request(c: &Config, req: &RequestHead, _: &RouteInfo, _: Option<&[u8]>) -> Decision {
//!         match req.header(&c.header) {
//!             Some(_) => portcullis_sdk::forward(),
//!             None => portcullis_sdk::respond(403, "missing header"),
//!         }
//!     }
//! }
//!
//! portcullis_sdk::plugin!(RequireHeader);
//! ```
//!
//! A plugin that asks another service before it decides returns
//! [`Decision::Callout`] from `on_request` and decides in
//! [`Plugin::on_callout`] (the standard `token-introspection` plugin is
//! one); one that reads or rewrites response bodies returns
//! [`read_response_body`] from [`Plugin::on_response`] and decides in
//! [`Plugin::on_response_body`].
//!
//! Build with `cargo build --release --target wasm32-wasip2`; the `.wasm`
//! file is the component a policy names. This example is built and tested
//! as `plugins/examples/require-header`.

pub mod bearer;
pub mod recycling;

// The plugin's allocator: see `recycling`. Off with
// `default-features = false` (for a plugin that brings its own).
#[cfg(all(
    feature = "recycling-alloc",
    target_family = "wasm",
    not(target_feature = "atomics")
))]
#[global_allocator]
static ALLOCATOR: recycling::Recycling = recycling::Recycling::new();

/// The generated bindings. In a module of their own: generated at the crate
/// root, the exported macro and its re-export collide.
#[doc(hidden)]
pub mod bindings {
    // The crate's own copy of the contract (`wit/` at the repository's
    // top is the one source; a test keeps the two equal), so a plugin
    // outside this repository builds against the SDK wherever it is.
    wit_bindgen::generate!({
        path: "wit",
        world: "policy",
        pub_export_macro: true,
        default_bindings_module: "portcullis_sdk::bindings",
    });
}

#[doc(hidden)]
pub use bindings::Guest;
use bindings::portcullis;
pub use bindings::portcullis::policy::host::Level;
/// The fields of a request head (what [`RequestHead`] derefs to).
pub use bindings::portcullis::policy::types::RequestHead as RequestFields;
/// The fields of a route (what [`RouteInfo`] derefs to).
pub use bindings::portcullis::policy::types::RouteInfo as RouteFields;
pub use bindings::portcullis::policy::types::{
    Callout, CalloutResponse, CalloutResult, Certificate, Decision, Forward, Header, HeaderEdits,
    Hooks, LocalResponse, ResponseBodyDecision, ResponseDecision, ResponseEdits, ResponseHead,
};

use std::cell::OnceCell;
use std::ops::Deref;

/// Something of the current call the host hands out on request: fetched
/// the first time it is used, then kept for the rest of the call.
pub struct FromHost<T> {
    fields: OnceCell<T>,
    fetch: fn() -> T,
}

impl<T> FromHost<T> {
    fn new(fetch: fn() -> T) -> FromHost<T> {
        FromHost {
            fields: OnceCell::new(),
            fetch,
        }
    }
}

impl<T> Deref for FromHost<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.fields.get_or_init(self.fetch)
    }
}

/// The current request. Its fields (`method`, `path`, `client_addr`...)
/// read like a struct's, but are fetched from the host the first time one
/// is used: a plugin that only checks a header never pays for the rest.
pub type RequestHead = FromHost<RequestFields>;

/// The route the current request matched (`name`, `params`), fetched from
/// the host on first use like [`RequestHead`].
pub type RouteInfo = FromHost<RouteFields>;

impl RequestHead {
    #[doc(hidden)]
    pub fn current() -> RequestHead {
        FromHost::new(portcullis::policy::host::current_request)
    }
}

impl RouteInfo {
    #[doc(hidden)]
    pub fn current() -> RouteInfo {
        FromHost::new(portcullis::policy::host::current_route)
    }
}

/// A policy: parse a config once, then decide on requests.
pub trait Plugin {
    /// The per-route config, parsed from the policy's `config:` (as JSON).
    type Config: serde::de::DeserializeOwned + Send + Sync + 'static;

    /// The calls this plugin wants; the proxy skips the others.
    const HOOKS: Hooks = Hooks::REQUEST;

    /// Checks a parsed config beyond what its type says.
    fn validate(_config: &Self::Config) -> Result<(), String> {
        Ok(())
    }

    /// Decides on a request; `body` is `Some` after asking with [`read_body`].
    fn on_request(
        config: &Self::Config,
        request: &RequestHead,
        route: &RouteInfo,
        body: Option<&[u8]>,
    ) -> Decision;

    /// Decides again with what came of the [`Callout`] the last decision
    /// made ([`Decision::Callout`]); may call out again. Instances serve
    /// many requests: read what the decision needs from `request` again
    /// rather than keep it between the calls.
    fn on_callout(
        _config: &Self::Config,
        _request: &RequestHead,
        _route: &RouteInfo,
        _result: CalloutResult,
    ) -> Decision {
        respond(500, "plugin made a callout it does not handle")
    }

    /// Decides on the response head (needs [`Hooks::RESPONSE`] in
    /// `HOOKS`): edit it ([`edit_response`]), answer instead, or read its
    /// body first ([`read_response_body`]).
    fn on_response(
        _config: &Self::Config,
        _request: &RequestHead,
        _route: &RouteInfo,
        _response: &ResponseHead,
    ) -> ResponseDecision {
        edit_response(no_edits())
    }

    /// Decides on the response with its whole body, after
    /// [`Plugin::on_response`] asked for it: keep it ([`keep_body`]),
    /// replace it ([`replace_body`]), edit the head, or answer instead.
    fn on_response_body(
        _config: &Self::Config,
        _request: &RequestHead,
        _route: &RouteInfo,
        _response: &ResponseHead,
        _body: Vec<u8>,
    ) -> ResponseBodyDecision {
        keep_body()
    }
}

/// Parses a config, naming the problem for `portcullis check`: where in
/// the config (`cors.allow_origins[0]`) and what, without serde_json's
/// "at line 1 column 7", which counts in the JSON the proxy made of the
/// policy's YAML, text the user never wrote.
pub fn parse_config<T: serde::de::DeserializeOwned>(json: &str) -> Result<T, String> {
    let plain = |e: &serde_json::Error| {
        let text = e.to_string();
        let at = format!(" at line {} column {}", e.line(), e.column());
        let text = text.strip_suffix(&at).unwrap_or(&text);
        // The config was YAML: an unquoted 0123, 1.10 or yes-like value
        // arrived as a number or a boolean, where the user meant text.
        let unquoted = [
            "invalid type: integer",
            "invalid type: floating point",
            "invalid type: boolean",
        ]
        .iter()
        .any(|t| text.starts_with(t));
        if unquoted && text.ends_with("expected a string") {
            format!("{text} (YAML reads an unquoted number or true/false as such: quote the value)")
        } else {
            text.to_owned()
        }
    };
    let mut de = serde_json::Deserializer::from_str(json);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        match e.path().to_string().as_str() {
            "." => format!("invalid config: {}", plain(e.inner())),
            path => format!("invalid config at `{path}`: {}", plain(e.inner())),
        }
    })?;
    de.end()
        .map_err(|e| format!("invalid config: {}", plain(&e)))?;
    Ok(value)
}

/// No header changes.
pub fn no_edits() -> HeaderEdits {
    HeaderEdits {
        remove: Vec::new(),
        set: Vec::new(),
        add: Vec::new(),
    }
}

/// Forward the request unchanged.
pub fn forward() -> Decision {
    Decision::Forward(Forward {
        headers: no_edits(),
        path: None,
        upstream: None,
    })
}

/// Forward with header changes.
pub fn forward_with(headers: HeaderEdits) -> Decision {
    Decision::Forward(Forward {
        headers,
        path: None,
        upstream: None,
    })
}

/// Send the request to another named upstream.
pub fn route_to(upstream: impl Into<String>) -> Decision {
    Decision::Forward(Forward {
        headers: no_edits(),
        path: None,
        upstream: Some(upstream.into()),
    })
}

/// Ask for the request body, up to `max` bytes.
pub fn read_body(max: u32) -> Decision {
    Decision::ReadBody(max)
}

/// Send the response on with these header changes.
pub fn edit_response(headers: HeaderEdits) -> ResponseDecision {
    ResponseDecision::Forward(headers)
}

/// Hold the response until its body is read, up to `max` bytes (at most
/// 1 MiB; a larger body is answered 500), then decide in
/// [`Plugin::on_response_body`].
pub fn read_response_body(max: u32) -> ResponseDecision {
    ResponseDecision::ReadBody(max)
}

/// Send the response body as it came.
pub fn keep_body() -> ResponseBodyDecision {
    ResponseBodyDecision::Forward(ResponseEdits {
        headers: no_edits(),
        body: None,
    })
}

/// Send `body` in place of the upstream's (its length set to match).
pub fn replace_body(body: Vec<u8>) -> ResponseBodyDecision {
    ResponseBodyDecision::Forward(ResponseEdits {
        headers: no_edits(),
        body: Some(body),
    })
}

/// Answer with a small JSON error body: `{"error": message}`, which the
/// proxy gives the shape of its own errors (adding `status`, `route` and
/// `plugin`) for an error status.
pub fn respond(status: u16, message: &str) -> Decision {
    Decision::Respond(error_response(status, message))
}

/// The answer [`respond`] makes, for [`ResponseDecision::Respond`] and
/// [`ResponseBodyDecision::Respond`].
pub fn error_response(status: u16, message: &str) -> LocalResponse {
    LocalResponse {
        status,
        headers: vec![header("content-type", "application/json")],
        body: serde_json::json!({ "error": message })
            .to_string()
            .into_bytes(),
    }
}

/// Whether `name` can be a header name (an RFC 9110 token), for checking
/// a config that names a header the plugin will set.
pub fn is_header_name(name: &str) -> bool {
    let token = |b: u8| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b);
    !name.is_empty() && name.bytes().all(token)
}

/// A header from a name and a text value.
pub fn header(name: &str, value: &str) -> Header {
    Header {
        name: name.to_ascii_lowercase(),
        value: value.as_bytes().to_vec(),
    }
}

/// Logs through the proxy's log.
pub fn log(level: Level, message: &str) {
    portcullis::policy::host::log(level, message);
}

/// Wall-clock milliseconds since the Unix epoch, from the host.
pub fn now_unix_ms() -> u64 {
    portcullis::policy::host::now_unix_ms()
}

/// Adds to one of the plugin's counters.
pub fn count(name: &str, delta: u64) {
    portcullis::policy::host::count(name, delta);
}

// Headers are fetched from the host on demand (one host call per header
// asked for), rather than copied into the plugin with every request.
impl RequestHead {
    /// The request's first value of a header (name in any case), as edited
    /// by the plugins that ran before this one.
    pub fn header(&self, name: &str) -> Option<Vec<u8>> {
        portcullis::policy::host::request_header(name)
    }

    /// [`RequestHead::header`] as text.
    pub fn header_str(&self, name: &str) -> Option<String> {
        self.header(name).and_then(|v| String::from_utf8(v).ok())
    }

    /// All of the request's headers.
    pub fn headers(&self) -> Vec<Header> {
        portcullis::policy::host::request_headers()
    }

    /// The client's certificate, verified against the listener's
    /// `client_ca` (mutual TLS); `None` on a listener without one.
    pub fn client_certificate(&self) -> Option<Certificate> {
        portcullis::policy::host::client_certificate()
    }

    /// Every field called `name`, joined with `separator`: see
    /// [`join_fields`]. Use it where a client or a proxy may split the
    /// header over fields; [`RequestHead::header`] gives only the first.
    pub fn header_joined(&self, name: &str, separator: &str) -> Option<String> {
        join_fields(&self.headers(), name, separator)
    }
}

/// Every field of `headers` called `name` (any case), in order, joined
/// with `separator`; `None` when there is none. A header sent over several
/// fields is one list (RFC 9110 5.3), and the first field alone can be the
/// wrong one: a proxy may add an `X-Forwarded-For` line of its own rather
/// than append to the client's (HAProxy does), and HTTP/2 clients send
/// each cookie as a field of its own (join those with "; ").
pub fn join_fields(headers: &[Header], name: &str, separator: &str) -> Option<String> {
    let fields: Vec<&str> = headers
        .iter()
        .filter(|h| h.name.eq_ignore_ascii_case(name))
        .filter_map(|h| std::str::from_utf8(&h.value).ok())
        .collect();
    (!fields.is_empty()).then(|| fields.join(separator))
}

impl ResponseHead {
    /// The response's first value of a header (name in any case).
    pub fn header(&self, name: &str) -> Option<Vec<u8>> {
        portcullis::policy::host::response_header(name)
    }

    /// All of the response's headers.
    pub fn headers(&self) -> Vec<Header> {
        portcullis::policy::host::response_headers()
    }
}

impl CalloutResponse {
    /// The answer's first value of a header (name in any case).
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        self.headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
            .map(|h| h.value.as_slice())
    }
}

impl RouteInfo {
    /// A path parameter.
    pub fn param(&self, name: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Exports a [`Plugin`] as the component's `policy` world.
#[macro_export]
macro_rules! plugin {
    ($plugin:ty) => {
        struct __PortcullisGuest;

        static __PORTCULLIS_CONFIG: ::std::sync::OnceLock<<$plugin as $crate::Plugin>::Config> =
            ::std::sync::OnceLock::new();

        impl $crate::Guest for __PortcullisGuest {
            fn hooks() -> $crate::Hooks {
                <$plugin as $crate::Plugin>::HOOKS
            }

            fn validate_config(config: String) -> Result<(), String> {
                let parsed = $crate::parse_config::<<$plugin as $crate::Plugin>::Config>(&config)?;
                <$plugin as $crate::Plugin>::validate(&parsed)
            }

            fn configure(config: String) -> Result<(), String> {
                let parsed = $crate::parse_config::<<$plugin as $crate::Plugin>::Config>(&config)?;
                <$plugin as $crate::Plugin>::validate(&parsed)?;
                __PORTCULLIS_CONFIG
                    .set(parsed)
                    .map_err(|_| "configure called twice".to_string())
            }

            fn on_request(body: Option<Vec<u8>>) -> $crate::Decision {
                match __PORTCULLIS_CONFIG.get() {
                    Some(c) => <$plugin as $crate::Plugin>::on_request(
                        c,
                        &$crate::RequestHead::current(),
                        &$crate::RouteInfo::current(),
                        body.as_deref(),
                    ),
                    None => $crate::respond(500, "plugin called before configure"),
                }
            }

            fn on_callout(outcome: $crate::CalloutResult) -> $crate::Decision {
                match __PORTCULLIS_CONFIG.get() {
                    Some(c) => <$plugin as $crate::Plugin>::on_callout(
                        c,
                        &$crate::RequestHead::current(),
                        &$crate::RouteInfo::current(),
                        outcome,
                    ),
                    None => $crate::respond(500, "plugin called before configure"),
                }
            }

            fn on_response(response: $crate::ResponseHead) -> $crate::ResponseDecision {
                match __PORTCULLIS_CONFIG.get() {
                    Some(c) => <$plugin as $crate::Plugin>::on_response(
                        c,
                        &$crate::RequestHead::current(),
                        &$crate::RouteInfo::current(),
                        &response,
                    ),
                    None => $crate::edit_response($crate::no_edits()),
                }
            }

            fn on_response_body(
                response: $crate::ResponseHead,
                body: Vec<u8>,
            ) -> $crate::ResponseBodyDecision {
                match __PORTCULLIS_CONFIG.get() {
                    Some(c) => <$plugin as $crate::Plugin>::on_response_body(
                        c,
                        &$crate::RequestHead::current(),
                        &$crate::RouteInfo::current(),
                        &response,
                        body,
                    ),
                    None => $crate::keep_body(),
                }
            }
        }

        $crate::bindings::export!(__PortcullisGuest);
    };
}

#[cfg(test)]
mod tests {
    use super::parse_config;

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Config {
        #[allow(dead_code)]
        cors: Cors,
    }

    #[derive(Debug, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Cors {
        #[allow(dead_code)]
        allow_origins: Vec<String>,
    }

    #[test]
    fn a_header_split_over_fields_is_one_list() {
        use super::{Header, join_fields};
        let h = |name: &str, value: &str| Header {
            name: name.into(),
            value: value.as_bytes().to_vec(),
        };
        // The client's X-Forwarded-For line first, then the one a proxy
        // added; HTTP/2 cookie crumbs.
        let headers = [
            h("x-forwarded-for", "10.0.0.1"),
            h("cookie", "a=1"),
            h("X-Forwarded-For", "203.0.113.9"),
            h("cookie", "canary=yes"),
        ];
        assert_eq!(
            join_fields(&headers, "x-forwarded-for", ", ").as_deref(),
            Some("10.0.0.1, 203.0.113.9")
        );
        assert_eq!(
            join_fields(&headers, "Cookie", "; ").as_deref(),
            Some("a=1; canary=yes")
        );
        assert_eq!(join_fields(&headers, "accept", ", "), None);
    }

    #[test]
    fn config_errors_say_where_in_the_config_and_not_in_the_json() {
        let err = parse_config::<Config>(r#"{"cors":{"allow_origins":["a",2]}}"#).unwrap_err();
        assert_eq!(
            err,
            "invalid config at `cors.allow_origins[1]`: invalid type: integer `2`, expected a string (YAML reads an unquoted number or true/false as such: quote the value)"
        );
        let err = parse_config::<Config>(r#"{"cors":{"allow_origin":[]}}"#).unwrap_err();
        assert!(
            err.starts_with("invalid config at `cors.allow_origin`: unknown field `allow_origin`"),
            "{err}"
        );
        let err = parse_config::<Config>(r#""text""#).unwrap_err();
        assert_eq!(
            err,
            "invalid config: invalid type: string \"text\", expected struct Config"
        );
        assert!(parse_config::<Config>(r#"{"cors":{"allow_origins":["a"]}}"#).is_ok());
    }
}
