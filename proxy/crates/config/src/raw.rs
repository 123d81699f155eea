//! The policy files as written: serde structs that mirror the YAML one to one.
//!
//! Every leaf is a [`Text`] (a scalar with its source position) so that
//! `${ENV}` references can appear in any value and every later validation
//! error can point at `file:line:column`. Unknown keys are rejected here.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};
use serde_saphyr::Spanned;

/// Any YAML scalar (string, number or boolean) kept as its text, as
/// written, so that environment references expand the same way in every
/// kind of value and a value that looks like a number (`0777`, `1.10`, a
/// digits-only token) is not rewritten by YAML's number rules. Read with
/// `deserialize_str`, which hands plain scalars over as their source text.
#[derive(Debug, Clone)]
pub struct Scalar(pub String);

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ScalarVisitor;
        impl Visitor<'_> for ScalarVisitor {
            type Value = Scalar;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string, number or boolean")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Scalar, E> {
                Ok(Scalar(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Scalar, E> {
                Ok(Scalar(v))
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Scalar, E> {
                Ok(Scalar(v.to_string()))
            }
        }
        d.deserialize_str(ScalarVisitor)
    }
}

/// A scalar with the place it was written.
pub type Text = Spanned<Scalar>;

/// A string-to-string map (headers) with the map's own position.
pub type TextMap = Spanned<BTreeMap<String, Text>>;

/// One policy file. All sections are optional; files are merged.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyFile {
    #[serde(default)]
    pub listeners: Vec<Spanned<RawListener>>,
    #[serde(default)]
    pub upstreams: Vec<Spanned<RawUpstream>>,
    #[serde(default)]
    pub routes: Vec<Spanned<RawRoute>>,
    #[serde(default)]
    pub plugins: Vec<Spanned<RawPlugin>>,
    /// Plugins run for every route, before the route's own.
    #[serde(default)]
    pub global_plugins: Vec<Spanned<RawPluginUse>>,
    /// Spans to an OpenTelemetry collector; in one file at most.
    pub tracing: Option<Spanned<RawTracing>>,
}

/// Where spans go and which requests make one.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTracing {
    /// `false` (or empty) leaves tracing off.
    pub enabled: Option<Text>,
    /// The collector's OTLP/HTTP port, an upstream with endpoints.
    pub upstream: Text,
    /// Default `/v1/traces`.
    pub path: Option<Text>,
    /// Share of new traces sampled, 0 to 100 (default 100).
    pub sample_percent: Option<Text>,
    /// Default `portcullis`.
    pub service_name: Option<Text>,
    /// Default 5s.
    pub flush_every: Option<Text>,
    /// Join the trace a request brings (default true).
    pub trust_incoming: Option<Text>,
}

/// A plugin module: a WebAssembly component file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPlugin {
    pub name: Text,
    /// Relative to the policy file's directory.
    pub path: Text,
    /// Optional pin: the file's SHA-256, hex.
    pub sha256: Option<Text>,
    /// For `oci://` paths: `IfNotPresent` or `Always`.
    pub pull_policy: Option<Text>,
    /// For `oci://` paths: a Docker config file with the registry's
    /// credentials.
    pub pull_secret: Option<Text>,
    /// For `oci://` paths: a CA file for the registry's certificate.
    pub registry_ca: Option<Text>,
    /// For `oci://` paths: plain HTTP and unverified certificates allowed.
    pub insecure_registry: Option<Text>,
}

/// A plugin attached to a route (or globally) with its config.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPluginUse {
    /// The plugin's name under `plugins:`.
    #[serde(rename = "use")]
    pub plugin: Text,
    /// Free-form; handed to the plugin as JSON.
    pub config: Option<Spanned<serde_json::Value>>,
    /// Whether `${ENV}` and `{from_file}` in `config`/`vm_config` are
    /// resolved: by default for a component, not for a proxy-wasm filter
    /// (whose config goes as written, as in Envoy).
    pub expand_config: Option<Text>,
    /// `closed` (default) or `open`.
    pub fail: Option<Text>,
    /// Deadline per call, in CPU time the call uses (default 10ms).
    pub timeout: Option<Text>,
    /// Deadline for starting an instance or VM (a filter's
    /// `_initialize`, `proxy_on_vm_start`, `proxy_on_configure`; a
    /// component's `configure`), in CPU time (default 1s).
    pub start_timeout: Option<Text>,
    /// Memory cap per instance (default 16MiB for a component, 128MiB for
    /// a proxy-wasm filter).
    pub memory: Option<Text>,
    /// `false` (or empty) leaves the plugin out.
    pub enabled: Option<Text>,
    /// `reuse` (default) or `per-request`.
    pub instances: Option<Text>,
    /// A proxy-wasm filter's root id (Envoy's `root_id`; default empty).
    pub root_id: Option<Text>,
    /// A proxy-wasm filter's VM configuration (Envoy's
    /// `vm_config.configuration`), given as `config` is.
    pub vm_config: Option<Spanned<serde_json::Value>>,
    /// `enforce` (default) or `shadow`: run it, but enforce nothing it
    /// decides (its answers and edits are counted, then dropped).
    pub mode: Option<Text>,
    /// The share of requests a shadow use runs on (default 100).
    pub shadow_percent: Option<Text>,
    /// A candidate version rolled out beside this one by share.
    pub rollout: Option<Spanned<RawRollout>>,
}

/// A plugin use's rollout: a candidate plugin given a growing share of
/// requests, rolled back when it does worse than the current one.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRollout {
    /// The candidate, by its name under `plugins:`.
    pub to: Text,
    /// The candidate's config (default: the use's).
    pub config: Option<Spanned<serde_json::Value>>,
    /// One share, held; or `steps`.
    pub percent: Option<Text>,
    /// Shares taken in turn, each held for `interval` while healthy.
    pub steps: Option<Spanned<Vec<Text>>>,
    pub interval: Option<Text>,
    /// What splits requests: `client` (default), `header:NAME`,
    /// `cookie:NAME`.
    pub key: Option<Text>,
    /// The outcomes compared: the last `window` of them, once the
    /// candidate has `min_requests`, by `margin` percentage points.
    pub window: Option<Text>,
    pub min_requests: Option<Text>,
    pub margin: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawListener {
    pub name: Text,
    pub bind: Text,
    pub max_connections: Option<Text>,
    pub header_read_timeout: Option<Text>,
    pub keepalive_timeout: Option<Text>,
    pub max_requests_per_connection: Option<Text>,
    pub connection_lifetime: Option<Text>,
    pub max_request_header_size: Option<Text>,
    pub trust_forwarded_headers: Option<Text>,
    pub proxy_protocol: Option<Text>,
    pub request_id: Option<Text>,
    pub tls: Option<Spanned<RawListenerTls>>,
    pub redirect_https: Option<Text>,
    pub http3: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawListenerTls {
    pub cert: Option<Text>,
    pub key: Option<Text>,
    pub certificates: Option<Spanned<Vec<Spanned<RawCertPair>>>>,
    pub client_ca: Option<Text>,
    pub client_auth: Option<Text>,
    pub session_ticket_keys: Option<Vec<Text>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCertPair {
    pub cert: Text,
    pub key: Text,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawUpstream {
    pub name: Text,
    #[serde(default)]
    pub endpoints: Vec<Text>,
    /// An upstream URL template such as `http://{name}.{namespace}.svc`.
    pub url: Option<Text>,
    pub balance: Option<Text>,
    pub hash_on: Option<Text>,
    pub hash_cookie_ttl: Option<Text>,
    pub timeouts: Option<RawTimeouts>,
    pub retries: Option<Text>,
    pub eject_for: Option<Text>,
    pub eject_after_5xx: Option<Text>,
    pub max_requests: Option<Text>,
    pub max_requests_per_connection: Option<Text>,
    #[serde(default)]
    pub retry_on: Vec<Text>,
    pub per_try_timeout: Option<Text>,
    pub retry_budget: Option<Spanned<RawRetryBudget>>,
    pub health_check: Option<Spanned<RawHealthCheck>>,
    pub tls: Option<RawTls>,
    pub http2: Option<Text>,
    pub preserve_host: Option<Text>,
    pub dns: Option<Text>,
    pub dns_refresh: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRetryBudget {
    pub percent: Option<Text>,
    pub min_concurrent: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHealthCheck {
    pub path: Text,
    pub interval: Option<Text>,
    pub timeout: Option<Text>,
    pub unhealthy_after: Option<Text>,
    pub healthy_after: Option<Text>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTimeouts {
    pub connect: Option<Text>,
    pub request: Option<Text>,
    pub read: Option<Text>,
    pub idle: Option<Text>,
    pub lifetime: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTls {
    pub ca_file: Option<Text>,
    pub server_name: Option<Text>,
    pub insecure_skip_verify: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    pub name: Text,
    #[serde(rename = "match")]
    pub matcher: Spanned<RawMatch>,
    pub upstream: Option<Text>,
    pub url: Option<Text>,
    pub respond: Option<Spanned<RawRespond>>,
    pub redirect: Option<Spanned<RawRedirect>>,
    pub health: Option<Text>,
    pub strip_prefix: Option<Text>,
    pub rewrite: Option<Text>,
    pub request_headers: Option<RawHeaderEdits>,
    pub response_headers: Option<RawHeaderEdits>,
    pub timeout: Option<Text>,
    pub websocket: Option<Text>,
    pub error_cors: Option<Spanned<RawCors>>,
    pub compress: Option<Spanned<RawCompress>>,
    pub rate_limit: Option<Spanned<RawRateLimit>>,
    pub max_request_body: Option<Text>,
    pub access_log: Option<Text>,
    pub auth_request: Option<Spanned<RawAuthRequest>>,
    pub mirror: Option<Spanned<RawMirror>>,
    #[serde(default)]
    pub plugins: Vec<Spanned<RawPluginUse>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAuthRequest {
    pub upstream: Text,
    pub path: Text,
    #[serde(default)]
    pub copy_headers: Vec<Text>,
    pub signin: Option<Text>,
    pub timeout: Option<Text>,
    pub cache: Option<Spanned<RawAuthCache>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMirror {
    pub upstream: Text,
    pub percent: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAuthCache {
    pub ttl: Text,
    pub key: Option<Vec<Text>>,
    pub per_uri: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRateLimit {
    pub rate: Text,
    pub burst: Option<Text>,
    pub key: Option<Text>,
    pub shared: Option<Text>,
}

/// A route's `compress`: `true`/`false` (or a `${VAR}` giving one), or
/// the settings, which turn it on.
#[derive(Debug)]
pub enum RawCompress {
    Flag(Scalar),
    /// Boxed: a map of five fields next to one scalar.
    Settings(Box<RawCompressSettings>),
}

impl<'de> Deserialize<'de> for RawCompress {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct CompressVisitor;
        impl<'de> Visitor<'de> for CompressVisitor {
            type Value = RawCompress;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("true, false, or a map of types, min_size, level and brotli")
            }
            fn visit_bool<E: de::Error>(self, v: bool) -> Result<RawCompress, E> {
                Ok(RawCompress::Flag(Scalar(v.to_string())))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<RawCompress, E> {
                Ok(RawCompress::Flag(Scalar(v.to_owned())))
            }
            fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<RawCompress, A::Error> {
                RawCompressSettings::deserialize(de::value::MapAccessDeserializer::new(map))
                    .map(|settings| RawCompress::Settings(Box::new(settings)))
            }
        }
        d.deserialize_any(CompressVisitor)
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCompressSettings {
    pub types: Option<Vec<Text>>,
    pub min_size: Option<Text>,
    pub level: Option<Text>,
    pub brotli: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMatch {
    pub host: Option<Text>,
    pub path: Option<Text>,
    #[serde(default)]
    pub paths: Vec<Text>,
    pub path_prefix: Option<Text>,
    #[serde(default)]
    pub methods: Vec<Text>,
    pub headers: Option<TextMap>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRedirect {
    pub to: Text,
    pub status: Option<Text>,
    pub strip_query: Option<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRespond {
    pub status: Text,
    pub body: Option<Text>,
    pub headers: Option<TextMap>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawHeaderEdits {
    pub add: Option<TextMap>,
    pub set: Option<TextMap>,
    #[serde(default)]
    pub remove: Vec<Text>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCors {
    #[serde(default)]
    pub allow_origins: Vec<Text>,
    pub allow_credentials: Option<Text>,
}
