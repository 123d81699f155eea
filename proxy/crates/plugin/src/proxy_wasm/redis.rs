//! Higress's Redis calls, the host extension its filters (rate limits,
//! caches, quotas) import: `proxy_redis_init` readies a filter's calls
//! with a timeout, `proxy_redis_call` sends a RESP-encoded command, and
//! the reply comes through `proxy_on_redis_call_response` on the root
//! context (status 0, the reply in buffer 9; non-zero when none came).
//! Every call goes to the state store (`serve --state redis://…`), the
//! Redis the replicas share, whatever cluster the filter names: in a
//! cluster with one Redis for the proxy, that is the one. A call goes out
//! as an HTTP call does: a request that pauses waits for it.

use std::time::Duration;

use wasmtime::{Caller, Linker};

use super::VmState;
use super::guest::{Status, read, write_u32};
use crate::seam::{Callout, MAX_CALLOUT_TIMEOUT};

/// `proxy_get_buffer_bytes`' buffer of a Redis call's reply (Higress's).
pub const REDIS_CALL_RESPONSE_BUFFER: i32 = 9;

/// A call's timeout when the filter gave none in `proxy_redis_init`
/// (Higress's wasm-go SDK's default).
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);

/// A VM's Redis calls: the timeout `proxy_redis_init` set, and the tokens
/// of the calls in flight.
#[derive(Default)]
pub struct Calls {
    timeout: Option<Duration>,
    in_flight: Vec<u32>,
}

impl Calls {
    /// Whether `token` is a Redis call's; forgets it.
    pub fn take(&mut self, token: u32) -> bool {
        // Usually empty: no search then.
        if self.in_flight.is_empty() {
            return false;
        }
        match self.in_flight.iter().position(|t| *t == token) {
            Some(i) => {
                self.in_flight.swap_remove(i);
                true
            }
            None => false,
        }
    }
}

/// Adds `proxy_redis_init` and `proxy_redis_call` to `linker`.
pub fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    type C<'a> = Caller<'a, VmState>;
    linker.func_wrap(
        "env",
        "proxy_redis_init",
        |mut c: C<'_>,
         _cluster_ptr: i32,
         _cluster_len: i32,
         _user_ptr: i32,
         _user_len: i32,
         _password_ptr: i32,
         _password_len: i32,
         timeout_ms: i32|
         -> i32 {
            // The state store's own credentials are used: the filter's
            // are for a Redis of its cluster, which here is that one.
            let timeout = match timeout_ms {
                ms if ms > 0 => Duration::from_millis(ms as u64).min(MAX_CALLOUT_TIMEOUT),
                _ => DEFAULT_TIMEOUT,
            };
            c.data_mut().redis.timeout = Some(timeout);
            Status::Ok as i32
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_redis_call",
        |mut c: C<'_>,
         cluster_ptr: i32,
         cluster_len: i32,
         query_ptr: i32,
         query_len: i32,
         ret_token: i32|
         -> wasmtime::Result<i32> {
            let cluster = read(&mut c, cluster_ptr, cluster_len)?;
            let query = read(&mut c, query_ptr, query_len)?;
            let timeout = c.data().redis.timeout.unwrap_or(DEFAULT_TIMEOUT);
            let token = c.data_mut().take_token();
            c.data_mut().redis.in_flight.push(token);
            let callout = Callout {
                // For what a failure says; the state store answers.
                upstream: String::from_utf8_lossy(&cluster).into_owned(),
                method: http::Method::POST,
                path: "/".into(),
                authority: None,
                headers: http::HeaderMap::new(),
                body: query.into(),
                timeout,
                redis: true,
            };
            c.data_mut().call.callouts.push((token, callout));
            write_u32(&mut c, ret_token, token)?;
            Ok(Status::Ok as i32)
        },
    )?;
    Ok(())
}
