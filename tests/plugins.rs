//! Policy plugins in the real proxy: the built components from
//! plugins/dist, against real upstreams.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use hyper::header::HeaderValue;
use hyper::{Request, Response};

use crate::support::client::{self, Answer, body};
use crate::support::process::{Confine, ProxyProcess};
use crate::support::upstream::{self, Upstream};
use crate::support::{Proxy, plugin_file, policy_dir};

mod checks;
mod contract;
mod header_rules;
mod host_limits;
mod introspection;
mod isolation;
mod oci;
mod packaging;
mod proxy_wasm;
mod proxy_wasm_bodies;
mod proxy_wasm_foreign;
mod proxy_wasm_grpc;
mod proxy_wasm_grpc_stream;
mod proxy_wasm_isolation;
mod proxy_wasm_redis;
mod proxy_wasm_reload;
mod proxy_wasm_reset;
mod proxy_wasm_settings;
mod rollout;
mod shadow;
mod standard;
mod third_party;
mod third_party_envoy;
mod webhooks;

pub(crate) fn hmac_sha256_hex(secret: &[u8], body: &[u8]) -> String {
    use hmac::{Hmac, Mac};
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(secret).unwrap();
    mac.update(body);
    hex::encode(mac.finalize().into_bytes())
}
