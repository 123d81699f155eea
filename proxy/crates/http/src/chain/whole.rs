//! A response whose body came whole with its head, through the one
//! plugin of the route that sees responses: its head and body calls made
//! in one visit ([`plugin::Plugin::on_response_whole`]). The usual answer
//! on a route with one proxy-wasm filter; the calls, and what their
//! verdicts do, are those of [`on_response`] then
//! [`filter_response_body`].

// The answers are unboxed as everywhere on this path.
#![allow(clippy::result_large_err)]

use super::body_stream::{after_whole_body, through_now, whole_sent};
use super::*;

/// What the plugin made of a response whose body came whole.
pub enum Whole {
    /// Send this body, or (`Err`) this answer instead.
    Sent(Result<Body, Response<Body>>),
    /// The plugin holds the head for the body: read it with
    /// [`read_whole`] (it is at hand).
    Held(HeldHead, Body),
}

/// The response's head and body hooks on `resp` and `body` in one visit,
/// when one plugin alone sees the response and the whole body came with
/// its head; `None`, nothing taken from `body`, otherwise.
pub fn whole_response(
    ctx: &mut PluginContext<'_>,
    route: &Route,
    resp: &mut http::response::Parts,
    body: &mut Body,
) -> Option<Whole> {
    let chain = ctx.chain;
    let place = sole_responder(chain)?;
    if http_body::Body::is_end_stream(body) {
        return None;
    }
    let mut whole = body.take_whole()?;
    let binding = &*chain[place];
    let mut stream = ctx.streams.take(place);
    let lent = lend(
        &mut ctx.facts,
        (&mut ctx.request_headers, &mut ctx.request_later),
        resp,
        false,
    );
    let called = binding.on_response_whole(&mut stream, lent, &whole);
    // Left out when the plugin ended it with the body.
    ctx.streams.set(place, stream);
    match called.head {
        Ok(ResponseVerdict::Continue) => {}
        Ok(ResponseVerdict::Noted(noted)) => ctx.note(*noted),
        Ok(ResponseVerdict::ReadBody(max)) => {
            let held = HeldHead { place, max };
            return Some(Whole::Held(held, Body::full(whole)));
        }
        Ok(ResponseVerdict::Respond(local)) => {
            return Some(Whole::Sent(Err(local_answer(binding, route, *local))));
        }
        Err(e) => {
            if let Some(answer) = fail(binding, route, &e) {
                return Some(Whole::Sent(Err(answer)));
            }
        }
    }
    let Some(called) = called.body else {
        // Noted, or failed open: the body call as a lone one.
        return Some(Whole::Sent(through_now(ctx, route, resp, whole)));
    };
    let mut changed = false;
    let at = (&mut whole, &mut changed);
    if let Some(stop) = after_whole_body(ctx, binding, route, called, at) {
        return Some(Whole::Sent(stop));
    }
    Some(Whole::Sent(Ok(whole_sent(resp, whole, changed))))
}

/// The place of the one plugin in `chain` that sees the response, when
/// one alone does and it sees both head and body.
fn sole_responder(chain: &[Arc<dyn Plugin>]) -> Option<usize> {
    let seeing = |b: &Arc<dyn Plugin>| {
        let hooks = b.hooks();
        (hooks.response || hooks.response_body).then_some(hooks)
    };
    let mut responders = (chain.iter().enumerate()).filter_map(|(at, b)| Some((at, seeing(b)?)));
    let (place, hooks) = responders.next()?;
    (hooks.response && hooks.response_body && responders.next().is_none()).then_some(place)
}
