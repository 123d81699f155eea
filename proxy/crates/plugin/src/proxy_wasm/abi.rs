//! The host calls of the proxy-wasm ABI 0.2.1 (module `env`), as the
//! `proxy-wasm` SDKs import them: logs, clocks, the plugin's
//! configuration, the HTTP header maps (with their pseudo-headers) and
//! trailers, local responses and properties. A call the host does not
//! offer yet traps with its name when made (see `imports.rs`), so a
//! module that imports it but never calls it still runs.

use http::{HeaderMap, HeaderName, HeaderValue};
use portcullis_net::framing;
use wasmtime::{Caller, Linker};

use super::guest::{Status, give, read, viewed, write};
use super::{VmState, map};
use crate::containment::Edit;
use crate::seam::LocalAnswer;

pub(super) type C<'a> = Caller<'a, VmState>;
pub(super) type R = wasmtime::Result<i32>;

const REQUEST_HEADERS: i32 = 0;
const REQUEST_TRAILERS: i32 = 1;
const RESPONSE_HEADERS: i32 = 2;
const RESPONSE_TRAILERS: i32 = 3;
const HTTP_REQUEST_BODY: i32 = 0;
const HTTP_RESPONSE_BODY: i32 = 1;
const HTTP_CALL_RESPONSE_HEADERS: i32 = 6;
/// A gRPC stream's initial and trailing metadata: read, as an HTTP call's
/// answer's headers are, from the pairs the callback is given.
const GRPC_INITIAL_METADATA: i32 = 4;
const GRPC_TRAILING_METADATA: i32 = 5;

/// Whether map `kind` is an answer's, given whole with its callback.
fn answer_map(kind: i32) -> bool {
    matches!(
        kind,
        HTTP_CALL_RESPONSE_HEADERS | GRPC_INITIAL_METADATA | GRPC_TRAILING_METADATA
    )
}
const HTTP_CALL_RESPONSE_BODY: i32 = 4;
const PLUGIN_CONFIGURATION: i32 = 7;
const VM_CONFIGURATION: i32 = 6;

pub(super) fn ok(s: Status) -> R {
    Ok(s as i32)
}

/// Adds the ABI's calls to `linker`.
pub fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    let env = "env";
    linker.func_wrap(
        env,
        "proxy_get_current_time_nanoseconds",
        |mut c: C<'_>, ret: i32| -> R {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            write(&mut c, ret, &now.to_le_bytes())?;
            ok(Status::Ok)
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_get_buffer_bytes",
        |mut c: C<'_>, kind: i32, start: i32, max: i32, ret_ptr: i32, ret_len: i32| -> R {
            let buffer = match kind {
                PLUGIN_CONFIGURATION => c.data().config.clone(),
                VM_CONFIGURATION => c.data().vm_config.clone(),
                HTTP_REQUEST_BODY | HTTP_RESPONSE_BODY => match body_mut(c.data_mut(), kind) {
                    Some(body) => body.clone(),
                    None => return ok(Status::NotFound),
                },
                HTTP_CALL_RESPONSE_BODY => match &c.data().call.answer {
                    Some((_, body)) => body.clone(),
                    None => return ok(Status::NotFound),
                },
                super::redis::REDIS_CALL_RESPONSE_BUFFER => match &c.data().call.answer {
                    Some((_, body)) => body.clone(),
                    None => return ok(Status::NotFound),
                },
                super::grpc::GRPC_RECEIVE_BUFFER => match &c.data().call.grpc {
                    Some(Ok(message)) => message.clone(),
                    _ => return ok(Status::NotFound),
                },
                _ => return ok(Status::NotFound),
            };
            let start = (start as u32 as usize).min(buffer.len());
            let end = start.saturating_add(max as u32 as usize).min(buffer.len());
            // Nothing to give: the return pointers stay null, which the
            // SDKs read as an empty buffer, as from Envoy.
            if start == end {
                return ok(Status::Ok);
            }
            give(&mut c, &buffer[start..end], (ret_ptr, ret_len))
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_set_buffer_bytes",
        |mut c: C<'_>, kind: i32, start: i32, size: i32, ptr: i32, len: i32| -> R {
            let data = read(&mut c, ptr, len)?;
            let state = c.data_mut();
            let Some(body) = body_mut(state, kind) else {
                return ok(Status::NotFound);
            };
            // As Envoy edits a buffer: replace it whole, prepend, or append.
            let (start, size) = (start as u32 as usize, size as u32 as usize);
            let new = match (start, size) {
                (0, n) if n >= body.len() => data,
                (0, 0) => [data.as_slice(), &body[..]].concat(),
                (s, _) if s >= body.len() => [&body[..], data.as_slice()].concat(),
                _ => return ok(Status::BadArgument),
            };
            *body = new.into();
            state.call.body_changed = true;
            ok(Status::Ok)
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_get_header_map_pairs",
        |mut c: C<'_>, kind: i32, ret_ptr: i32, ret_len: i32| -> R {
            let pairs = match gone(c.data(), kind) {
                true => Vec::new(),
                false => match pairs(c.data(), kind) {
                    Some(pairs) => pairs,
                    None => return ok(Status::NotFound),
                },
            };
            let bytes = map::serialize(pairs.iter().map(|(k, v)| (k.as_slice(), v.as_slice())));
            give(&mut c, &bytes, (ret_ptr, ret_len))
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_set_header_map_pairs",
        |mut c: C<'_>, kind: i32, ptr: i32, len: i32| -> R {
            if gone(c.data(), kind) {
                return ok(Status::BadArgument);
            }
            let bytes = read(&mut c, ptr, len)?;
            let Some(pairs) = map::deserialize(&bytes) else {
                return ok(Status::SerializationFailure);
            };
            let Some(headers) = headers_mut(c.data_mut(), kind) else {
                return ok(Status::NotFound);
            };
            // The fields that frame the message stay as the proxy has
            // them, whatever the new set says of them (but for a
            // `content-length` it leaves out: removed).
            let dropped = !pairs
                .iter()
                .any(|(k, _)| k.eq_ignore_ascii_case(b"content-length"));
            let framing: Vec<(HeaderName, HeaderValue)> = headers
                .iter()
                .filter(|(k, _)| framing::is_framing(k.as_str()))
                .filter(|(k, _)| !(dropped && *k == http::header::CONTENT_LENGTH))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            headers.clear();
            if !same_framing(&framing, &pairs) {
                crate::containment::count(&c.data().plugin, "framing_edits_refused");
            }
            for (k, v) in &pairs {
                if !k.starts_with(b":") && !is_framing(k) {
                    append(c.data_mut(), kind, k, v);
                }
            }
            if let Some(headers) = headers_mut(c.data_mut(), kind) {
                for (k, v) in framing {
                    headers.append(k, v);
                }
            }
            for (k, v) in pairs.iter().filter(|(k, _)| k.starts_with(b":")) {
                set_pseudo(c.data_mut(), kind, k, v);
            }
            ok(Status::Ok)
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_get_header_map_value",
        |mut c: C<'_>, kind: i32, key_ptr: i32, key_len: i32, ret_ptr: i32, ret_len: i32| -> R {
            if gone(c.data(), kind) {
                return ok(Status::BadArgument);
            }
            // The name read in place, and a header's value shared, not
            // copied: this is the call filters make most.
            let value = viewed(&mut c, (key_ptr, key_len), |key, state| {
                header_value(state, kind, key)
            })?;
            match value {
                Some(value) if value.as_ref().is_empty() => ok(Status::Ok),
                Some(value) => give(&mut c, value.as_ref(), (ret_ptr, ret_len)),
                None => ok(Status::NotFound),
            }
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_replace_header_map_value",
        |mut c: C<'_>, kind: i32, key_ptr: i32, key_len: i32, ptr: i32, len: i32| -> R {
            if gone(c.data(), kind) {
                return ok(Status::BadArgument);
            }
            let key = read(&mut c, key_ptr, key_len)?;
            let value = read(&mut c, ptr, len)?;
            if key.starts_with(b":") {
                set_pseudo(c.data_mut(), kind, &key, &value);
                return ok(Status::Ok);
            }
            if !editable(c.data(), &key, Edit::Set) {
                return ok(Status::Ok);
            }
            if let Some(h) = headers_mut(c.data_mut(), kind)
                && let Ok(name) = HeaderName::from_bytes(&key)
            {
                h.remove(&name);
            }
            append(c.data_mut(), kind, &key, &value);
            ok(Status::Ok)
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_add_header_map_value",
        |mut c: C<'_>, kind: i32, key_ptr: i32, key_len: i32, ptr: i32, len: i32| -> R {
            if gone(c.data(), kind) {
                return ok(Status::BadArgument);
            }
            let key = read(&mut c, key_ptr, key_len)?;
            let value = read(&mut c, ptr, len)?;
            if key.starts_with(b":") {
                set_pseudo(c.data_mut(), kind, &key, &value);
            } else {
                append(c.data_mut(), kind, &key, &value);
            }
            ok(Status::Ok)
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_remove_header_map_value",
        |mut c: C<'_>, kind: i32, key_ptr: i32, key_len: i32| -> R {
            if gone(c.data(), kind) {
                return ok(Status::BadArgument);
            }
            let key = read(&mut c, key_ptr, key_len)?;
            if !editable(c.data(), &key, Edit::Remove) {
                return ok(Status::Ok);
            }
            if let Some(h) = headers_mut(c.data_mut(), kind)
                && let Ok(name) = HeaderName::from_bytes(&key)
            {
                h.remove(&name);
            }
            ok(Status::Ok)
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_send_local_response",
        |mut c: C<'_>,
         status: i32,
         _details_ptr: i32,
         _details_len: i32,
         body_ptr: i32,
         body_len: i32,
         headers_ptr: i32,
         headers_len: i32,
         grpc_status: i32|
         -> R {
            // Only a final answer's status: a 1xx is no answer (a client
            // that asked for no upgrade would wait on a 101 for ever), and
            // anything past 599 is no status. Envoy hands the number to
            // its local reply unchecked; refused here, as a call the
            // filter can see failed.
            let Some(status) = u16::try_from(status)
                .ok()
                .filter(|s| (200..=599).contains(s))
            else {
                tracing::debug!(plugin = %c.data().plugin, status, "plugin answered with a status outside 200-599; refused");
                return ok(Status::BadArgument);
            };
            // The first answer stands, as in Envoy, which sends the first
            // local reply of a stream and ignores the rest.
            if c.data().call.local.is_some() {
                return ok(Status::Ok);
            }
            let body = read(&mut c, body_ptr, body_len)?;
            let bytes = read(&mut c, headers_ptr, headers_len)?;
            let Some(pairs) = map::deserialize(&bytes) else {
                return ok(Status::SerializationFailure);
            };
            let mut headers = HeaderMap::new();
            for (k, v) in pairs {
                if !editable(c.data(), k, Edit::Set) {
                    continue;
                }
                match (HeaderName::from_bytes(k), HeaderValue::from_bytes(v)) {
                    (Ok(k), Ok(v)) => {
                        headers.append(k, v);
                    }
                    _ => tracing::warn!(plugin = %c.data().plugin, "plugin set an invalid header; skipped"),
                }
            }
            // As Envoy's local replies: a body without a type is text.
            if !body.is_empty() && !headers.contains_key(http::header::CONTENT_TYPE) {
                headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
            }
            // A gRPC client gets it as from Envoy: with the filter's gRPC
            // status (-1: none, the HTTP status's mapping).
            let code = u16::try_from(grpc_status).ok();
            c.data_mut().call.local = Some(LocalAnswer {
                status,
                headers,
                body: body.into(),
                error_shape: false,
                grpc: crate::seam::GrpcReply::TrailersOnly(code),
                reset: false,
            });
            ok(Status::Ok)
        },
    )?;
    linker.func_wrap(
        env,
        "proxy_get_property",
        |mut c: C<'_>, path_ptr: i32, path_len: i32, ret_ptr: i32, ret_len: i32| -> R {
            let path = read(&mut c, path_ptr, path_len)?;
            match super::properties::get(c.data(), &path) {
                Some(value) if value.is_empty() => ok(Status::Ok),
                Some(value) => give(&mut c, &value, (ret_ptr, ret_len)),
                None => ok(Status::NotFound),
            }
        },
    )?;
    // The context to act for (a root context answering for the HTTP
    // context whose call it got): its filter state, say.
    linker.func_wrap(
        env,
        "proxy_set_effective_context",
        |mut c: C<'_>, id: i32| {
            c.data_mut().context = id as u32;
            ok(Status::Ok)
        },
    )?;
    // Resuming the request (stream 0) lets it go on once the call returns.
    linker.func_wrap(env, "proxy_continue_stream", |mut c: C<'_>, kind: i32| {
        if kind == 0 {
            c.data_mut().call.resumed = true;
        }
        ok(Status::Ok)
    })?;
    // Closing the request or the response resets the stream, as Envoy
    // does; a connection's streams (2, 3) are a network filter's.
    linker.func_wrap(env, "proxy_close_stream", |mut c: C<'_>, kind: i32| {
        if !(0..=1).contains(&kind) {
            return ok(Status::BadArgument);
        }
        c.data_mut().call.local = Some(LocalAnswer {
            status: 444,
            headers: HeaderMap::new(),
            body: bytes::Bytes::new(),
            error_shape: false,
            grpc: crate::seam::GrpcReply::AsMade,
            reset: true,
        });
        ok(Status::Ok)
    })?;
    linker.func_wrap(env, "proxy_continue_request", |mut c: C<'_>| {
        c.data_mut().call.resumed = true;
        ok(Status::Ok)
    })?;
    linker.func_wrap(env, "proxy_continue_response", |_: C<'_>| ok(Status::Ok))?;
    linker.func_wrap(env, "proxy_done", |_: C<'_>| ok(Status::Ok))?;
    Ok(())
}

/// Every header of `kind`'s map with its pseudo-headers first, as Envoy
/// lists them; `None` for a map the call has none of.
fn pairs(state: &VmState, kind: i32) -> Option<Vec<(Vec<u8>, Vec<u8>)>> {
    if answer_map(kind) {
        return state.call.answer.as_ref().map(|(pairs, _)| pairs.clone());
    }
    let names: &[&[u8]] = match kind {
        REQUEST_HEADERS => &[b":authority", b":path", b":method", b":scheme"],
        RESPONSE_HEADERS => &[b":status"],
        _ => &[],
    };
    let headers = headers(state, kind)?;
    let mut out: Vec<(Vec<u8>, Vec<u8>)> = names
        .iter()
        .filter_map(|n| Some((n.to_vec(), pseudo(state, kind, n)?)))
        .collect();
    out.extend(
        headers
            .iter()
            .map(|(k, v)| (k.as_str().as_bytes().to_vec(), v.as_bytes().to_vec())),
    );
    Some(out)
}

/// A header's value as `proxy_get_header_map_value` gives it.
enum Value {
    Bytes(Vec<u8>),
    Header(HeaderValue),
}

impl AsRef<[u8]> for Value {
    fn as_ref(&self) -> &[u8] {
        match self {
            Value::Bytes(b) => b,
            Value::Header(h) => h.as_bytes(),
        }
    }
}

/// The value of header `key` in map `kind`: a callout answer's, a
/// pseudo-header, or a head's.
fn header_value(state: &mut VmState, kind: i32, key: &[u8]) -> Option<Value> {
    if answer_map(kind) {
        let answer = state.call.answer.as_ref();
        let pairs = answer.map_or(&[][..], |(pairs, _)| pairs.as_slice());
        return pairs
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| Value::Bytes(v.clone()));
    }
    if key.starts_with(b":") {
        return pseudo(state, kind, key).map(Value::Bytes);
    }
    let name = state.names.parsed(key)?;
    headers(state, kind)?.get(name).cloned().map(Value::Header)
}

/// A pseudo-header's value, from the request's facts or the response's
/// status.
fn pseudo(state: &VmState, kind: i32, name: &[u8]) -> Option<Vec<u8>> {
    let call = &state.call;
    if kind == RESPONSE_HEADERS {
        return (name == b":status")
            .then(|| call.status.map(|s| s.to_string().into_bytes()))
            .flatten();
    }
    if kind != REQUEST_HEADERS {
        return None;
    }
    let facts = call.facts()?;
    let value = match name {
        b":method" => facts.method.as_str().to_owned(),
        b":scheme" => if facts.tls { "https" } else { "http" }.to_owned(),
        b":path" => match (&call.path, &facts.rewritten) {
            (Some(p), _) => p.clone(),
            (None, Some(pq)) => pq.as_str().to_owned(),
            (None, None) => facts
                .uri
                .path_and_query()
                .map_or("/", |p| p.as_str())
                .to_owned(),
        },
        b":authority" => match facts.uri.authority() {
            Some(a) => a.as_str().to_owned(),
            None => {
                let host = call.request_headers().get(http::header::HOST)?;
                return Some(host.as_bytes().to_vec());
            }
        },
        _ => return None,
    };
    Some(value.into_bytes())
}

/// A pseudo-header set by the plugin on the request head: `:path`
/// changes where the request goes, `:authority` its `Host`; the others
/// (and any on another map) are the proxy's to keep.
fn set_pseudo(state: &mut VmState, kind: i32, name: &[u8], value: &[u8]) {
    match name {
        _ if kind != REQUEST_HEADERS => {
            tracing::debug!(plugin = %state.plugin, name = %String::from_utf8_lossy(name), "plugin set a pseudo-header outside the request head; ignored")
        }
        b":path" => state.call.path = Some(String::from_utf8_lossy(value).into_owned()),
        b":authority" => {
            if let Ok(v) = HeaderValue::from_bytes(value) {
                state
                    .call
                    .request_headers_mut()
                    .insert(http::header::HOST, v);
            }
        }
        _ => {
            tracing::debug!(plugin = %state.plugin, name = %String::from_utf8_lossy(name), "plugin set a pseudo-header the proxy keeps; ignored")
        }
    }
}

/// The request or response body a body call holds.
fn body_mut(state: &mut VmState, kind: i32) -> Option<&mut bytes::Bytes> {
    match kind {
        HTTP_REQUEST_BODY => state.call.request_body.as_mut(),
        HTTP_RESPONSE_BODY => state.call.response_body.as_mut(),
        _ => None,
    }
}

/// The header map `kind` names, if the call has it.
fn headers(state: &VmState, kind: i32) -> Option<&HeaderMap> {
    match kind {
        REQUEST_HEADERS => Some(state.call.request_headers()),
        RESPONSE_HEADERS => Some(state.call.response_headers()),
        REQUEST_TRAILERS | RESPONSE_TRAILERS => state.call.trailers.as_deref(),
        _ => None,
    }
}

fn headers_mut(state: &mut VmState, kind: i32) -> Option<&mut HeaderMap> {
    match kind {
        REQUEST_HEADERS => Some(state.call.request_headers_mut()),
        RESPONSE_HEADERS => Some(state.call.response_headers_mut()),
        REQUEST_TRAILERS | RESPONSE_TRAILERS => state.call.trailers.as_deref_mut(),
        _ => None,
    }
}

/// Whether `kind` is a response head that has gone: Envoy drops its hold
/// on the head once a filter lets it go, and answers every call on it
/// but a listing (empty) with `BadArgument` (which the SDKs panic on).
fn gone(state: &VmState, kind: i32) -> bool {
    kind == RESPONSE_HEADERS && state.call.head_sent
}

/// Whether a header name's bytes name a field that frames the message.
fn is_framing(key: &[u8]) -> bool {
    std::str::from_utf8(key).is_ok_and(framing::is_framing)
}

/// Whether the filter may make `edit` to the header `key`: not to a
/// framing field, but for removing `content-length` (see
/// `containment::may_edit`). A refused edit is ignored and counted, and
/// the call still succeeds, as the filter would otherwise fail its
/// request over something the proxy takes care of anyway.
fn editable(state: &VmState, key: &[u8], edit: Edit) -> bool {
    match std::str::from_utf8(key) {
        Ok(name) => crate::containment::may_edit(&state.plugin, name, edit),
        // Not a field name at all: `append` refuses it.
        Err(_) => true,
    }
}

/// Whether a new set of pairs says of the framing fields what the map
/// has (in any order, names in any case).
fn same_framing(has: &[(HeaderName, HeaderValue)], pairs: &[(&[u8], &[u8])]) -> bool {
    let mut said: Vec<(Vec<u8>, &[u8])> = (pairs.iter())
        .filter(|(k, _)| is_framing(k))
        .map(|(k, v)| (k.to_ascii_lowercase(), *v))
        .collect();
    let mut kept: Vec<(Vec<u8>, &[u8])> = (has.iter())
        .map(|(k, v)| (k.as_str().as_bytes().to_vec(), v.as_bytes()))
        .collect();
    said.sort();
    kept.sort();
    said == kept
}

fn append(state: &mut VmState, kind: i32, key: &[u8], value: &[u8]) {
    if !editable(state, key, Edit::Set) {
        return;
    }
    let plugin = state.plugin.clone();
    let Some(headers) = headers_mut(state, kind) else {
        return;
    };
    match (HeaderName::from_bytes(key), HeaderValue::from_bytes(value)) {
        (Ok(k), Ok(v)) => {
            headers.append(k, v);
        }
        _ => {
            tracing::warn!(plugin = %plugin, header = %String::from_utf8_lossy(key), "plugin set an invalid header; skipped")
        }
    }
}
