//! The response hooks on the upstream's response head, last plugin
//! first; and a body read whole for a plugin that holds the head for it
//! (Envoy's filter pausing on response headers).

// The answers are unboxed as everywhere on this path (a response's
// answer is made once; boxing it would only add an allocation).
#![allow(clippy::result_large_err)]

use std::ops::Range;

use http_body_util::BodyExt;

use super::*;

/// What the response hooks decided on the head.
pub enum ResponseStep {
    /// Send the response on (its body through the plugins' body hooks:
    /// [`super::filter_body`]).
    Go,
    /// Send this instead.
    Answer(Response<Body>),
    /// A plugin holds the head until the body is read whole
    /// ([`read_whole`]).
    ReadBody(HeldHead),
}

/// The plugin holding the response head for its body.
pub struct HeldHead {
    /// Its place in the chain.
    pub(super) place: usize,
    /// The most it reads.
    pub max: u32,
}

/// Runs the response hooks, last plugin first, on an upstream response
/// head (`end_of_stream`: it has no body).
pub fn on_response(
    ctx: &mut PluginContext<'_>,
    route: &Route,
    resp: &mut http::response::Parts,
    end_of_stream: bool,
) -> ResponseStep {
    heads(ctx, route, resp, end_of_stream, ctx.chain.len())
}

/// The response hooks of the plugins placed before `below`, last first.
fn heads(
    ctx: &mut PluginContext<'_>,
    route: &Route,
    resp: &mut http::response::Parts,
    end_of_stream: bool,
    below: usize,
) -> ResponseStep {
    let chain = ctx.chain;
    let responders = chain[..below].iter().enumerate().rev();
    for (place, binding) in responders.filter(|(_, b)| b.hooks().response) {
        let mut stream = ctx.streams.get(place);
        let lent = lend(
            &mut ctx.facts,
            (&mut ctx.request_headers, &mut ctx.request_later),
            resp,
            end_of_stream,
        );
        let called = binding.on_response(&mut stream, lent);
        ctx.streams.set(place, stream);
        match called {
            Ok(ResponseVerdict::Continue) => {}
            Ok(ResponseVerdict::Noted(noted)) => ctx.note(*noted),
            Ok(ResponseVerdict::ReadBody(max)) => {
                return ResponseStep::ReadBody(HeldHead { place, max });
            }
            Ok(ResponseVerdict::Respond(local)) => {
                return ResponseStep::Answer(local_answer(&**binding, route, *local));
            }
            Err(e) => {
                if let Some(answer) = fail(&**binding, route, &e) {
                    return ResponseStep::Answer(answer);
                }
            }
        }
    }
    ResponseStep::Go
}

/// Reads the response body whole for the plugin holding its head (up to
/// its bound: more is a 500, as from Envoy; none of it within `timeout`
/// a 504), gives it to that plugin and to the plugins after it that see
/// bodies, then runs the rest of the response hooks (any of which may
/// hold the head again: the body is in hand) and their body hooks. The
/// body to send, its `Content-Length` set; or the answer to send instead.
pub async fn read_whole(
    ctx: &mut PluginContext<'_>,
    route: &Route,
    resp: &mut http::response::Parts,
    (body, timeout): (Body, Duration),
    held: HeldHead,
) -> Result<Bytes, Response<Body>> {
    let name = ctx.chain[held.place].name().clone();
    let error = |status, message| Err(json_error(status, message, route, Some(&name)));
    let declared = resp
        .headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > u64::from(held.max)) {
        return error(StatusCode::INTERNAL_SERVER_ERROR, TOO_LARGE);
    }
    let collect = http_body_util::Limited::new(body, held.max as usize).collect();
    let mut bytes = match tokio::time::timeout(timeout, collect).await {
        Ok(Ok(collected)) => collected.to_bytes(),
        Ok(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            return error(StatusCode::INTERNAL_SERVER_ERROR, TOO_LARGE);
        }
        Ok(Err(_)) => {
            let message = "upstream response body could not be read";
            return error(StatusCode::BAD_GATEWAY, message);
        }
        Err(_) => {
            let message = "upstream response body timeout";
            return error(StatusCode::GATEWAY_TIMEOUT, message);
        }
    };
    // Given to the plugins the head has passed, then to the one holding
    // it; then on to the heads before it.
    let mut asked = held.place;
    let mut passed = asked..ctx.chain.len();
    loop {
        bodies(ctx, route, resp, (passed.clone(), asked), &mut bytes)?;
        match heads(ctx, route, resp, bytes.is_empty(), passed.start) {
            ResponseStep::Go => break,
            ResponseStep::Answer(answer) => return Err(answer),
            ResponseStep::ReadBody(again) => {
                passed = again.place..passed.start;
                asked = again.place;
            }
        }
    }
    bodies(ctx, route, resp, (0..passed.start, usize::MAX), &mut bytes)?;
    resp.headers
        .insert(header::CONTENT_LENGTH, bytes.len().into());
    resp.headers.remove(header::TRANSFER_ENCODING);
    Ok(bytes)
}

const TOO_LARGE: &str = "response body too large for the route's plugin";

/// The body hooks of the plugins placed in `places` (last first) that
/// see bodies, and of the one at `asked`, given the whole body.
fn bodies(
    ctx: &mut PluginContext<'_>,
    route: &Route,
    resp: &mut http::response::Parts,
    (places, asked): (Range<usize>, usize),
    bytes: &mut Bytes,
) -> Result<(), Response<Body>> {
    let chain = ctx.chain;
    for place in places.rev() {
        let binding = &chain[place];
        if !(place == asked || binding.hooks().response_body) {
            continue;
        }
        let mut stream = ctx.streams.get(place);
        let lent = lend(
            &mut ctx.facts,
            (&mut ctx.request_headers, &mut ctx.request_later),
            resp,
            true,
        );
        let called = binding.on_response_body(&mut stream, lent, bytes);
        ctx.streams.set(place, stream);
        match called {
            Ok(plugin::BodyVerdict::Continue(Some(new))) => *bytes = new,
            Ok(plugin::BodyVerdict::Continue(None) | plugin::BodyVerdict::Pause) => {}
            Ok(plugin::BodyVerdict::Noted(noted)) => ctx.note(*noted),
            Ok(plugin::BodyVerdict::Respond(local)) => {
                return Err(local_answer(&**binding, route, *local));
            }
            Err(e) => {
                if let Some(answer) = fail(&**binding, route, &e) {
                    return Err(answer);
                }
            }
        }
    }
    Ok(())
}
