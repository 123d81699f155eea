//! What a filter is lent for its body and trailers calls, and what those
//! calls decided.

use bytes::Bytes;

use super::vm::Vm;
use super::{Call, ProxyWasm};
use crate::PluginError;
use crate::seam::{self, LocalAnswer};

/// What a body call that returned `action` decided; `body` takes the
/// body the call holds.
pub(super) fn body_verdict(
    call: &mut Call,
    action: i32,
    end_of_stream: bool,
    body: impl FnOnce(&mut Call) -> Option<Bytes>,
) -> seam::BodyVerdict {
    match call.local.take() {
        Some(local) => seam::BodyVerdict::Respond(Box::new(local)),
        None if action == 1 && !end_of_stream => seam::BodyVerdict::Pause,
        None if call.body_changed => seam::BodyVerdict::Continue(body(call)),
        None => seam::BodyVerdict::Continue(None),
    }
}

/// Runs `f` with a call lent `lent` (and `body`, a response body), and
/// gives what it lent back: the call (with what the filter left in it)
/// and `f`'s result.
pub(super) fn lend<T>(
    vm: &mut Vm,
    lent: seam::ResponseLent<'_>,
    body: Option<Bytes>,
    f: impl FnOnce(&mut Vm, Box<Call>) -> (Box<Call>, T),
) -> (Box<Call>, T) {
    let mut call = vm.blank();
    call.lend(lent.facts, lent.request_headers, Some(lent.headers));
    call.status = Some(lent.status);
    call.response_body = body;
    call.head_sent = lent.head_sent;
    let (mut call, out) = f(vm, call);
    call.unlend();
    (call, out)
}

/// `proxy_on_request_trailers` with `trailers` (edited in place) and the
/// request lent; the filter's answer, if it made one. A pause on the
/// trailers waits for nothing here (no call is pending): they go on.
pub(super) fn request_trailers(
    filter: &ProxyWasm,
    vm: &mut Vm,
    id: u32,
    lent: seam::RequestLent<'_>,
    trailers: &mut http::HeaderMap,
) -> Result<Option<LocalAnswer>, PluginError> {
    let mut call = vm.blank();
    call.lend(lent.facts, lent.headers, None);
    call.trailers = Some(Box::new(std::mem::take(trailers)));
    let (mut call, action) = vm.trailers(filter, id, call, false);
    call.unlend();
    *trailers = call.trailers.take().map(|t| *t).unwrap_or_default();
    let local = call.local.take();
    vm.recycle(call);
    action?;
    Ok(local)
}

/// `proxy_on_response_trailers`, likewise.
pub(super) fn response_trailers(
    filter: &ProxyWasm,
    vm: &mut Vm,
    id: u32,
    lent: seam::ResponseLent<'_>,
    trailers: &mut http::HeaderMap,
) -> Result<Option<LocalAnswer>, PluginError> {
    let given = std::mem::take(trailers);
    let (mut call, action) = lend(vm, lent, None, |vm, mut call| {
        call.trailers = Some(Box::new(given));
        vm.trailers(filter, id, call, true)
    });
    *trailers = call.trailers.take().map(|t| *t).unwrap_or_default();
    let local = call.local.take();
    vm.recycle(call);
    action?;
    Ok(local)
}
