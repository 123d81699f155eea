//! What a filter is lent for its body and trailers calls, and what those
//! calls decided.

use bytes::Bytes;

use super::vm::Vm;
use super::{Call, ProxyWasm, parts};
use crate::PluginError;
use crate::seam::{self, LocalAnswer, ResponseVerdict, Stream};

/// What a response head call that returned `action` decided, given the
/// answer the filter made (`local`), if it made one.
pub(super) fn head_verdict(
    local: Option<LocalAnswer>,
    action: i32,
    end_of_stream: bool,
) -> ResponseVerdict {
    match local {
        Some(local) => ResponseVerdict::Respond(Box::new(local)),
        // Paused on the head of a response with a body: the body is read
        // whole, then given to the filter (as Envoy buffers it while the
        // head waits).
        None if action == 1 && !end_of_stream => ResponseVerdict::ReadBody(seam::MAX_BUFFERED_BODY),
        None => ResponseVerdict::Continue,
    }
}

/// `proxy_on_response_headers` and, when the filter lets the head go on,
/// `proxy_on_response_body` on the whole body that came with it (the
/// head then gone, as for a streamed body), in one visit to the VM; then
/// the request's end (`proxy_on_done`, `_log`, `_delete`), as nothing of
/// it comes after. The calls Envoy makes for such a response, one lock,
/// set-up and hand-back fewer than making them apart.
pub(super) fn whole(
    filter: &ProxyWasm,
    stream: &mut Stream,
    lent: seam::ResponseLent<'_>,
    body: &Bytes,
) -> seam::WholeVerdicts {
    let mut head = None;
    let mut end = None;
    let visited = filter.on_vm(stream, |vm, stream| {
        let id = parts(*stream).2;
        let status = lent.status;
        let (facts, request_headers) = (lent.facts, lent.request_headers);
        let later = lent.request_later;
        let mut call = vm.blank();
        call.lend(facts, request_headers, Some(lent.headers));
        call.lend_later(later);
        call.status = Some(status);
        let (mut call, action) = vm.response_headers(filter, id, call, false);
        call.unlend();
        let local = call.local.take();
        let verdict = action.map(|action| head_verdict(local, action, false));
        let verdict = match verdict {
            Ok(ResponseVerdict::Continue) => ResponseVerdict::Continue,
            other => {
                vm.recycle(call);
                head = Some(other?);
                return Ok(None);
            }
        };
        head = Some(verdict);
        filter.count_call(*stream);
        // The body with the head gone: the filter's calls on the head
        // fail, and a listing of it is empty, as on a streamed body.
        call.clear();
        call.lend(facts, request_headers, None);
        call.lend_later(later);
        call.status = Some(status);
        call.response_body = Some(body.clone());
        call.head_sent = true;
        let (mut call, action) = vm.body(filter, id, call, (true, true));
        call.unlend();
        let taken = |c: &mut Call| c.response_body.take();
        let verdict = action.map(|action| body_verdict(&mut call, action, true, taken));
        vm.recycle(call);
        let verdict = verdict?;
        if matches!(verdict, seam::BodyVerdict::Continue(_)) {
            end = Some(vm.end(filter, id));
        }
        Ok(Some(verdict))
    });
    match (visited, head) {
        // The head call failed (or there was no VM to make it on).
        (Err(e), None) => seam::WholeVerdicts {
            head: Err(e),
            body: None,
        },
        (Err(e), Some(head)) => seam::WholeVerdicts {
            head: Ok(head),
            body: Some(Err(e)),
        },
        (Ok(body), head) => {
            match end {
                Some(Ok(())) => *stream = Stream::NONE,
                Some(Err(e)) => {
                    filter.ending_failed(*stream, &e);
                    *stream = Stream::NONE;
                }
                None => {}
            }
            seam::WholeVerdicts {
                head: Ok(head.unwrap_or(ResponseVerdict::Continue)),
                body: body.map(Ok),
            }
        }
    }
}

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
    call.lend_later(lent.request_later);
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
