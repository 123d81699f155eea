//! What a filter keeps of a request beside it, and the calls around it
//! that real filters make and Envoy answers:
//! - `proxy_set_property`: filter state, as Envoy keeps it for a stream
//!   (Istio filters and Higress's wasm-go, which sets `x_request_id` on
//!   every request, keep per-request values there); `proxy_get_property`
//!   reads it back (`properties::get` asks here for what is no attribute).
//!   Kept per HTTP context, dropped when its request ends; a root context
//!   has no stream, and gets `NotFound`, as in Envoy;
//! - `proxy_get_status`: the status of the HTTP or gRPC call whose
//!   outcome is being delivered.

use std::collections::HashMap;

use wasmtime::{Caller, Linker};

use super::VmState;
use super::guest::{Status, give, read, write_u32};

/// Values one context may keep, and bytes in all: a filter cannot grow a
/// request's state without end (past them, `BadArgument`).
const MAX_VALUES: usize = 256;
const MAX_BYTES: usize = 1 << 20;

/// The ABI's `BrokenConnection`, the status Envoy gives a failed call.
const BROKEN_CONNECTION: u32 = 11;

/// One context's state: `(path, value)` pairs.
type Values = Vec<(Vec<u8>, Vec<u8>)>;

/// Filter state by HTTP context id.
#[derive(Default)]
pub struct FilterState {
    by_context: HashMap<u32, Values>,
}

impl FilterState {
    /// The value context `id` set at `path`.
    pub fn get(&self, id: u32, path: &[u8]) -> Option<&[u8]> {
        let values = self.by_context.get(&id)?;
        values
            .iter()
            .find(|(p, _)| p == path)
            .map(|(_, v)| v.as_slice())
    }

    /// Sets `path` to `value` for context `id`; false past the bounds.
    fn set(&mut self, id: u32, path: Vec<u8>, value: Vec<u8>) -> bool {
        let values = self.by_context.entry(id).or_default();
        let bytes: usize = values
            .iter()
            .filter(|(p, _)| *p != path)
            .map(|(p, v)| p.len() + v.len())
            .sum();
        if bytes + path.len() + value.len() > MAX_BYTES {
            return false;
        }
        let count = values.len();
        match values.iter_mut().find(|(p, _)| *p == path) {
            Some((_, v)) => *v = value,
            None if count < MAX_VALUES => values.push((path, value)),
            None => return false,
        }
        true
    }

    /// Drops what context `id` kept: its request is over.
    pub fn end(&mut self, id: u32) {
        // Most requests keep nothing: no hashing then.
        if !self.by_context.is_empty() {
            self.by_context.remove(&id);
        }
    }
}

/// Adds the calls to `linker`.
pub fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    type C<'a> = Caller<'a, VmState>;
    type R = wasmtime::Result<i32>;
    linker.func_wrap(
        "env",
        "proxy_set_property",
        |mut c: C<'_>, path_ptr: i32, path_len: i32, ptr: i32, len: i32| -> R {
            let path = read(&mut c, path_ptr, path_len)?;
            let value = read(&mut c, ptr, len)?;
            let state = c.data_mut();
            let id = state.context;
            if id == state.root_context {
                return Ok(Status::NotFound as i32);
            }
            Ok(match state.filter_state.set(id, path, value) {
                true => Status::Ok as i32,
                false => Status::BadArgument as i32,
            })
        },
    )?;
    linker.func_wrap(
        "env",
        "proxy_get_status",
        |mut c: C<'_>, ret_code: i32, ret_ptr: i32, ret_len: i32| -> R {
            // A gRPC call's status as it closed; an HTTP call's answer
            // without headers is one that failed: Envoy's
            // BrokenConnection (reset), with its message.
            let call = &c.data().call;
            let (code, message): (u32, Vec<u8>) = match &call.grpc {
                Some(Err((code, message))) => (*code, message.clone().into_bytes()),
                Some(Ok(_)) => (0, Vec::new()),
                None if call.answer.as_ref().is_some_and(|(p, _)| p.is_empty()) => {
                    (BROKEN_CONNECTION, b"reset".to_vec())
                }
                None => (0, Vec::new()),
            };
            write_u32(&mut c, ret_code, code)?;
            if message.is_empty() {
                return Ok(Status::Ok as i32);
            }
            give(&mut c, &message, (ret_ptr, ret_len))
        },
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_contexts_state_is_its_own_bounded_and_ends_with_it() {
        let mut s = FilterState::default();
        assert!(s.set(2, b"x_request_id".to_vec(), b"abc".to_vec()));
        assert!(s.set(2, b"x_request_id".to_vec(), b"def".to_vec()));
        assert_eq!(s.get(2, b"x_request_id"), Some(&b"def"[..]));
        assert_eq!(s.get(3, b"x_request_id"), None);
        assert!(!s.set(3, b"big".to_vec(), vec![0; MAX_BYTES]));
        for i in 0..MAX_VALUES {
            assert!(s.set(4, i.to_string().into_bytes(), Vec::new()));
        }
        assert!(!s.set(4, b"one-more".to_vec(), Vec::new()));
        s.end(2);
        assert_eq!(s.get(2, b"x_request_id"), None);
    }
}
