//! Route features as the policies state them: compression, rate limits,
//! mirrors, auth caches and tracing. Pure data: the counters, buckets and
//! caches that serve them are built with a pipeline from these (and the
//! previous pipeline's, across a reload), never held here.

use std::sync::Arc;
use std::time::Duration;

use http::uri::PathAndQuery;
use http::{HeaderName, HeaderValue};

/// A route's compression settings.
#[derive(Debug, Clone)]
pub struct Compression {
    /// Media types compressed: `type/subtype` exactly, or `type/*`.
    pub types: Vec<String>,
    /// Responses declaring a shorter `Content-Length` are sent as they are.
    pub min_size: u64,
    /// gzip level, 1 (fastest) to 9 (smallest).
    pub level: u32,
    /// brotli quality, 0 (fastest) to 11 (smallest); `None`: gzip only.
    pub brotli: Option<u32>,
}

/// Compressed unless a route lists its own: text and the structured
/// formats an API answers with (any `+json` or `+xml` type too). Not
/// `text/event-stream`: an event stream is flushed event by event anyway,
/// and some clients and proxies in between handle it compressed badly.
pub const DEFAULT_TYPES: &[&str] = &[
    "text/html",
    "text/plain",
    "text/css",
    "text/csv",
    "text/xml",
    "text/javascript",
    "text/markdown",
    "application/javascript",
    "application/json",
    "application/x-ndjson",
    "application/xml",
    "application/wasm",
    "image/svg+xml",
];

/// Below this, compressing saves little and costs a compressor's set-up.
pub const DEFAULT_MIN_SIZE: u64 = 1024;
/// nginx's default: on a 64 KiB workflow list (`bench/compress.sh`)
/// level 1 compressed 12.7x at 665 MB/s per core, level 5 15.4x at 225.
pub const DEFAULT_LEVEL: u32 = 1;
/// On the same workflow list, quality 2 compressed 22.9x at 362 MB/s
/// per core (gzip level 1 12.7x at 672 in that run); quality 4 did no
/// better (21.6x) at 156 MB/s.
pub const DEFAULT_BROTLI: u32 = 2;
impl Compression {
    /// Whether responses of this `Content-Type` are compressed.
    pub fn covers(&self, content_type: &HeaderValue) -> bool {
        let value = content_type.as_bytes();
        let media = value
            .split(|&b| b == b';')
            .next()
            .unwrap_or(b"")
            .trim_ascii();
        // Lowered once into a copy on the stack (not the heap: this runs
        // for every response of a compressing route), then compared byte
        // for byte with the types, which are lowercase (checked when the
        // policy is built): comparing each type ignoring case lowered the
        // same bytes over again, ~200 instructions a response.
        let mut lowered = [0u8; 128];
        let Some(copy) = lowered.get_mut(..media.len()) else {
            return self.covers_long(media);
        };
        for (to, from) in copy.iter_mut().zip(media) {
            *to = from.to_ascii_lowercase();
        }
        self.covers_lowered(copy)
    }

    /// [`Compression::covers`] for a lowercase media type.
    fn covers_lowered(&self, media: &[u8]) -> bool {
        let Some(slash) = media.iter().position(|&b| b == b'/') else {
            return false;
        };
        let (kind, sub) = (&media[..slash], &media[slash + 1..]);
        if sub.ends_with(b"+json") || sub.ends_with(b"+xml") {
            return true;
        }
        self.types.iter().any(|t| match t.strip_suffix("/*") {
            Some(prefix) => prefix.as_bytes() == kind,
            None => t.as_bytes() == media,
        })
    }

    /// [`Compression::covers`] for a media type too long to lower on the
    /// stack (no real one is).
    #[cold]
    fn covers_long(&self, media: &[u8]) -> bool {
        self.covers_lowered(&media.to_ascii_lowercase())
    }
}

/// What a rate limit counts requests by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LimitKey {
    /// The client's address: the connection's (or its PROXY header's),
    /// or on a listener that trusts forwarded headers, the last
    /// `X-Forwarded-For` entry, the address the proxy in front saw.
    Client,
    /// A request header's value (`X-Real-IP`, an API key); requests
    /// without it share one allowance.
    Header(HeaderName),
    /// All of the route's requests together.
    Route,
}

/// A route's `rate_limit`: `count` requests per `period`, `burst` more at
/// once, per `key`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimitSpec {
    /// Requests per period at the steady rate.
    pub count: u32,
    /// The period.
    pub period: Duration,
    /// Requests allowed at once beyond the steady rate.
    pub burst: u32,
    /// What is counted.
    pub key: LimitKey,
    /// The rate as written, for `/status`.
    pub described: String,
    /// Counted across every replica in the state store (`serve --state`),
    /// not by this process alone.
    pub shared: bool,
}

/// A route's `mirror`: the share of its requests also sent elsewhere.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MirrorSpec {
    /// The upstream mirrored to, by index.
    pub upstream: usize,
    /// Share of the route's requests mirrored, 1 to 100.
    pub percent: u32,
}

/// An `auth_request`'s `cache` of allowing answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthCacheSpec {
    /// How long an allowing answer stands.
    pub ttl: Duration,
    /// The headers whose values key an entry (the session).
    pub key: Vec<HeaderName>,
    /// Whether the request's path and query are part of the key.
    pub per_uri: bool,
}

/// The policies' `tracing`: where spans go and which requests make one.
#[derive(Debug, PartialEq, Eq)]
pub struct Tracing {
    /// The collector, an upstream by index.
    pub upstream: usize,
    /// Where on it: `/v1/traces` unless told.
    pub path: PathAndQuery,
    /// New traces are sampled when a 64-bit random draw falls below this
    /// (`1 << 64`: all of them).
    pub threshold: u128,
    /// The spans' `service.name`.
    pub service_name: Arc<str>,
    /// The longest a span waits in its batch.
    pub flush_every: Duration,
    /// Whether a request's own `traceparent` is joined (ingress-nginx's
    /// `opentelemetry-trust-incoming-span`); when not, every request
    /// starts a trace.
    pub trust_incoming: bool,
}

impl Tracing {
    /// The `threshold` of a sample share in percent (0 to 100; the caller
    /// checks the range).
    pub fn threshold_of(percent: f64) -> u128 {
        // Out of 2^64, which 100% reaches: every draw falls below it.
        (percent / 100.0 * 2f64.powi(64)) as u128
    }
}

/// What a listener does with request ids (its `request_id`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestIds {
    /// Log the id a request brings and pass it on; make none. The
    /// default: in front of Portcullis, ingress-nginx and the tunnel
    /// server both set one, and making one costs ~5% of a proxied
    /// request's instructions.
    Keep,
    /// Also make one for a request that brings none (or an unusable one),
    /// and return it on the response, as Envoy does at the edge.
    Make,
    /// Neither log nor make ids (the header passes like any other).
    Off,
}
