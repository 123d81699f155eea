//! `proxy_http_call` and its answer (and a gRPC call's outcome,
//! `grpc.rs`, which goes the same way): a filter's call to an upstream of
//! the policies (Envoy's cluster) becomes the seam's callout, and the
//! answer comes back through `proxy_on_http_call_response`, with the
//! answer's headers and body readable as Envoy offers them (header map 6,
//! buffer 4).

use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use wasmtime::{Caller, Linker};

use super::guest::{Status, read, write_u32};
use super::vm::Vm;
use super::{Call, ProxyWasm, VmState, map};
use crate::seam::{Callout, CalloutAnswer, MAX_CALLOUT_TIMEOUT, Steer, Verdict};
use crate::{PluginError, containment};

/// The most of a request body a filter that pauses for it gets (Envoy's
/// default buffer limit, `per_connection_buffer_limit_bytes`); more is
/// 413, as from Envoy.
const MAX_BUFFERED_BODY: u32 = 1 << 20;

/// The body of Envoy's answer to an HTTP call that reached no upstream.
const UNREACHABLE: &[u8] = b"upstream connect error or disconnect/reset before headers";

/// Adds `proxy_http_call` to `linker`.
pub fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    linker.func_wrap(
        "env",
        "proxy_http_call",
        |mut c: Caller<'_, VmState>,
         up_ptr: i32,
         up_len: i32,
         headers_ptr: i32,
         headers_len: i32,
         body_ptr: i32,
         body_len: i32,
         _trailers_ptr: i32,
         _trailers_len: i32,
         timeout_ms: i32,
         ret_token: i32|
         -> wasmtime::Result<i32> {
            let upstream = String::from_utf8_lossy(&read(&mut c, up_ptr, up_len)?).into_owned();
            let bytes = read(&mut c, headers_ptr, headers_len)?;
            let body = read(&mut c, body_ptr, body_len)?;
            // An unknown cluster, or a head without its pseudo-headers,
            // is refused as Envoy refuses them.
            let names = &c.data().upstreams;
            let Some((_, upstream)) = names.iter().find(|(called, _)| **called == *upstream) else {
                return Ok(Status::BadArgument as i32);
            };
            let upstream = upstream.to_string();
            let Some(pairs) = map::deserialize(&bytes) else {
                return Ok(Status::SerializationFailure as i32);
            };
            let Some(callout) = callout(upstream, &pairs, body, timeout_ms) else {
                return Ok(Status::BadArgument as i32);
            };
            let token = c.data_mut().take_token();
            c.data_mut().call.callouts.push((token, callout));
            write_u32(&mut c, ret_token, token)?;
            Ok(Status::Ok as i32)
        },
    )?;
    Ok(())
}

/// The callout a filter's serialized head describes: `None` without
/// `:method`, `:path` and `:authority`.
fn callout(upstream: String, pairs: &[(&[u8], &[u8])], body: Vec<u8>, ms: i32) -> Option<Callout> {
    let text = |v: &[u8]| String::from_utf8_lossy(v).into_owned();
    let (mut method, mut path, mut authority) = (None, None, None);
    let mut headers = http::HeaderMap::new();
    for (k, v) in pairs {
        match *k {
            b":method" => method = http::Method::from_bytes(v).ok(),
            b":path" => path = Some(text(v)),
            b":authority" => authority = Some(text(v)),
            k if k.starts_with(b":") => {}
            k => {
                if let (Ok(k), Ok(v)) = (
                    http::HeaderName::from_bytes(k),
                    http::HeaderValue::from_bytes(v),
                ) {
                    headers.append(k, v);
                }
            }
        }
    }
    Some(Callout {
        upstream,
        method: method?,
        path: path?,
        authority: Some(authority?),
        headers,
        body: body.into(),
        // None given (0): the ceiling, as Envoy's is none.
        timeout: match ms {
            ms if ms > 0 => Duration::from_millis(ms as u64).min(MAX_CALLOUT_TIMEOUT),
            _ => MAX_CALLOUT_TIMEOUT,
        },
        redis: false,
    })
}

/// Keeps what a call that goes on to another (a head call before a body
/// call) left: its callouts and path.
pub fn keep(vm: &mut Vm, id: u32, call: &mut Call) {
    // Most calls leave neither: no entry made, no id hashed.
    if call.callouts.is_empty() && call.path.is_none() {
        return;
    }
    let waiting = vm.waiting.entry(id).or_default();
    waiting
        .calls
        .extend(call.callouts.drain(..).map(|(t, c)| (t, Some(c))));
    if call.path.is_some() {
        waiting.path = call.path.take();
    }
}

/// What a request-side call that returned `action` decided.
pub fn verdict(
    filter: &ProxyWasm,
    vm: &mut Vm,
    id: u32,
    call: &mut Call,
    (action, body_to_come): (i32, bool),
) -> Result<Verdict, PluginError> {
    keep(vm, id, call);
    if let Some(local) = call.local.take() {
        return Ok(Verdict::Respond(Box::new(local)));
    }
    let body = |call: &mut Call| {
        call.body_changed
            .then(|| call.request_body.take())
            .flatten()
    };
    // The common case, a filter that goes on with no callout made or
    // path set before: nothing waits, nothing to look up.
    if (action == 0 || call.resumed) && vm.waiting.is_empty() {
        return Ok(Verdict::Continue(Steer {
            path: None,
            upstream: None,
            body: body(call),
        }));
    }
    let home = vm.home();
    let waiting = vm.waiting.entry(id).or_default();
    if action == 0 || call.resumed {
        // Callouts made by a filter that goes on (an audit record, say):
        // sent without the request waiting, each answered on this VM
        // when it comes, as Envoy answers them.
        let going: Vec<(u32, Callout)> = (waiting.calls.drain(..))
            .filter_map(|(token, c)| Some((token, c?)))
            .collect();
        if !going.is_empty() {
            send_from_root(filter, &home, going);
        }
        return Ok(Verdict::Continue(Steer {
            path: waiting.path.take(),
            upstream: None,
            body: body(call),
        }));
    }
    // Paused: on the next callout not yet sent.
    if let Some(next) = waiting.calls.iter_mut().find_map(|(_, c)| c.take()) {
        return Ok(Verdict::Callout(Box::new(next)));
    }
    // Paused on the headers of a request with a body: it wants the body,
    // which is read whole, up to Envoy's default buffer limit.
    if body_to_come {
        return Ok(Verdict::ReadBody(MAX_BUFFERED_BODY));
    }
    Err(PluginError::Trap {
        plugin: filter.name.clone(),
        message: "paused the request with nothing to resume it".into(),
    })
}

/// A callout's answer as `proxy_on_http_call_response` offers it: its
/// headers (`:status` first) and body. As Envoy's HTTP calls end: one
/// that found no upstream is the router's 503, one that timed out an
/// answer without headers.
fn answer_pairs(answer: CalloutAnswer) -> (super::Pairs, Bytes) {
    match answer {
        CalloutAnswer::Failed {
            timed_out: false, ..
        } => {
            let body = Bytes::from_static(UNREACHABLE);
            let pairs = vec![
                (b":status".to_vec(), b"503".to_vec()),
                (
                    b"content-length".to_vec(),
                    body.len().to_string().into_bytes(),
                ),
                (b"content-type".to_vec(), b"text/plain".to_vec()),
            ];
            (pairs, body)
        }
        CalloutAnswer::Answered {
            status,
            headers,
            body,
            ..
        } => {
            let mut pairs = vec![(b":status".to_vec(), status.to_string().into_bytes())];
            pairs.extend(
                headers
                    .iter()
                    .map(|(k, v)| (k.as_str().as_bytes().to_vec(), v.as_bytes().to_vec())),
            );
            (pairs, body)
        }
        CalloutAnswer::Failed { .. } => (Vec::new(), Bytes::new()),
    }
}

/// The most callouts one VM may have in flight that no request waits on
/// (a root context's, and those of requests that went on without their
/// answers); more fail at once, as a cluster's circuit breaker refuses
/// them in Envoy, and count as `callouts_refused`: a filter that fires a
/// call per request cannot take the proxy's sockets.
pub const MAX_BACKGROUND_CALLOUTS: usize = 100;

/// Sends the callouts a root context made (in a tick, say: outside any
/// request), or a request's context made and did not wait for, through
/// `filter`'s callouts, each answered on the VM at `home` if it still
/// runs; past [`MAX_BACKGROUND_CALLOUTS`] in flight, each is answered
/// as failed instead.
pub fn send_from_root(filter: &ProxyWasm, home: &super::queue::Home, calls: Vec<(u32, Callout)>) {
    let (Some(callouts), Ok(runtime)) = (filter.callouts(), tokio::runtime::Handle::try_current())
    else {
        if !calls.is_empty() {
            tracing::warn!(plugin = %filter.name, "an HTTP call from a root context outside a worker is not sent");
        }
        return;
    };
    let in_flight = &filter.background[home.shard].0;
    let mut refused = Vec::new();
    for (token, callout) in calls {
        if in_flight.fetch_add(1, Ordering::Relaxed) >= MAX_BACKGROUND_CALLOUTS as u64 {
            in_flight.fetch_sub(1, Ordering::Relaxed);
            refused.push(token);
            continue;
        }
        let (callouts, home) = (callouts.clone(), home.clone());
        runtime.spawn(async move {
            let answer = callouts.send(home.shard, callout).await;
            let Some(filter) = home.filter.upgrade() else {
                return;
            };
            filter.background[home.shard]
                .0
                .fetch_sub(1, Ordering::Relaxed);
            answer_on_home(&filter, &home, token, answer);
        });
    }
    if refused.is_empty() {
        return;
    }
    for _ in &refused {
        containment::count(&filter.name, "callouts_refused");
    }
    if containment::may_log(&filter.name) {
        tracing::warn!(plugin = %filter.name, refused = refused.len(), "plugin made more calls than {MAX_BACKGROUND_CALLOUTS} in flight without waiting for them; these fail at once");
    }
    // Answered once the call that made them returns (its VM is in use
    // until then).
    let home = home.clone();
    runtime.spawn(async move {
        let Some(filter) = home.filter.upgrade() else {
            return;
        };
        for token in refused {
            let why = format!("over {MAX_BACKGROUND_CALLOUTS} calls in flight");
            let answer = CalloutAnswer::Failed {
                timed_out: false,
                why,
            };
            answer_on_home(&filter, &home, token, answer);
        }
    });
}

/// Gives the VM at `home` (if it still runs) `answer` to its call `token`.
fn answer_on_home(
    filter: &ProxyWasm,
    home: &super::queue::Home,
    token: u32,
    answer: CalloutAnswer,
) {
    filter.on_home(home, |vm, filter| {
        let call = vm.blank();
        let (call, result) = deliver(filter, vm, token, call, answer);
        vm.root_calls(call);
        result
    });
}

/// Gives the VM the outcome of its call `token`, lent `call`: an HTTP
/// call's answer, or a gRPC call's (dropped for one the filter
/// cancelled).
fn deliver(
    filter: &ProxyWasm,
    vm: &mut Vm,
    token: u32,
    mut call: Box<Call>,
    answer: CalloutAnswer,
) -> (Box<Call>, Result<(), PluginError>) {
    if vm.take_redis(token) {
        let status = match answer {
            CalloutAnswer::Answered { body, .. } => {
                call.answer = Some((Vec::new(), body));
                0
            }
            CalloutAnswer::Failed { why, .. } => {
                if containment::may_log(&filter.name) {
                    tracing::warn!(plugin = %filter.name, error = %why, "a plugin's Redis call failed");
                }
                1
            }
        };
        return vm.redis_response(filter, token, status, call);
    }
    match vm.take_grpc(token) {
        Some(true) => (call, Ok(())),
        Some(false) => {
            call.grpc = Some(super::grpc::outcome(answer));
            vm.grpc_outcome(filter, token, call)
        }
        None => {
            call.answer = Some(answer_pairs(answer));
            vm.http_call_response(filter, token, call)
        }
    }
}

/// Gives context `id` the answer to its oldest callout; what it decides.
pub fn answer(
    filter: &ProxyWasm,
    vm: &mut Vm,
    id: u32,
    (facts, headers): (&mut Option<crate::RequestFacts>, &mut http::HeaderMap),
    answer: CalloutAnswer,
) -> Result<Verdict, PluginError> {
    let token = vm
        .waiting
        .get_mut(&id)
        .and_then(|w| w.calls.pop_front())
        .map(|(token, _)| token)
        .ok_or_else(|| PluginError::Trap {
            plugin: filter.name.clone(),
            message: "answered a callout it never made".into(),
        })?;
    let mut call = vm.blank();
    call.lend(facts, headers, None);
    let (mut call, result) = deliver(filter, vm, token, call, answer);
    call.unlend();
    // Still paused unless it resumed the request.
    let verdict = result.and_then(|()| verdict(filter, vm, id, &mut call, (1, false)));
    vm.recycle(call);
    verdict
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_calls_timeout_is_cut_to_the_ceiling() {
        let head: [(&[u8], &[u8]); 3] = [
            (b":method", b"GET"),
            (b":path", b"/keys"),
            (b":authority", b"keys"),
        ];
        let timeout = |ms| callout("keys".into(), &head, Vec::new(), ms).map(|c| c.timeout);
        // 100,000 s, as a filter asked: the ceiling.
        assert_eq!(timeout(i32::MAX), Some(MAX_CALLOUT_TIMEOUT));
        assert_eq!(timeout(1_500), Some(Duration::from_millis(1_500)));
        // None given: Envoy sets none; here the ceiling.
        assert_eq!(timeout(0), Some(MAX_CALLOUT_TIMEOUT));
        assert_eq!(timeout(-5), Some(MAX_CALLOUT_TIMEOUT));
    }
}
