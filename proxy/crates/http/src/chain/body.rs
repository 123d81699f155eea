//! The request body a plugin asked for: read into memory up to the
//! plugin's bound, then the rest of the chain run with it.

use std::future::Future;
use std::task::Poll;

use http_body_util::BodyExt;

use super::*;

/// Reads the request body into memory, up to `max` bytes. A client that
/// sends none of it for `timeout` is answered 408 (nginx's
/// client_body_timeout): a webhook trickled in byte by byte must not hold
/// its connection for ever.
async fn read_body(
    mut body: Body,
    headers: &http::HeaderMap,
    max: u32,
    timeout: Duration,
) -> Result<Bytes, (StatusCode, &'static str)> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > u64::from(max)) {
        return Err((StatusCode::PAYLOAD_TOO_LARGE, FOR_THE_PLUGIN));
    }
    let progress = body.track();
    let mut collect = std::pin::pin!(http_body_util::Limited::new(body, max as usize).collect());
    let mut sleep = std::pin::pin!(tokio::time::sleep(timeout));
    let collected = std::future::poll_fn(|cx| {
        loop {
            if let Poll::Ready(collected) = collect.as_mut().poll(cx) {
                return Poll::Ready(Some(collected));
            }
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            // The body moved since the timer was set: wait on from then.
            match progress.as_deref().and_then(|p| p.wait_ends(timeout)) {
                Some(later) => sleep.as_mut().reset(later),
                None => return Poll::Ready(None),
            }
        }
    })
    .await;
    match collected {
        Some(Ok(collected)) => Ok(collected.to_bytes()),
        Some(Err(e)) if e.is::<http_body_util::LengthLimitError>() => {
            Err((StatusCode::PAYLOAD_TOO_LARGE, FOR_THE_PLUGIN))
        }
        // The route's own limit, below the plugin's.
        Some(Err(e)) if e.is::<portcullis_forward::TooLarge>() => {
            Err((StatusCode::PAYLOAD_TOO_LARGE, "request body too large"))
        }
        Some(Err(_)) => Err((StatusCode::BAD_REQUEST, "request body could not be read")),
        None => Err((StatusCode::REQUEST_TIMEOUT, "request body timeout")),
    }
}

const FOR_THE_PLUGIN: &str = "request body too large for the route's plugin";

impl<'a> PendingBody<'a> {
    /// Reads the request body (up to the plugin's bound) into memory,
    /// forwards exactly those bytes, and runs the rest of the chain with
    /// them, starting again at the plugin that asked. Calls given a large
    /// body run on a plugin thread ([`plugin::offload`]).
    pub async fn read(
        mut self,
        body: &mut Body,
        headers: &mut http::HeaderMap,
        route: &Route,
        config: &Config,
    ) -> Step<'a> {
        let taken = std::mem::replace(body, Body::empty());
        let timeout = config.request_timeout(route);
        let mut bytes = match read_body(taken, headers, self.max, timeout).await {
            Ok(bytes) => bytes,
            Err((status, message)) => {
                let plugin = request_hooks(self.chain)
                    .nth(self.at)
                    .map(|(_, b)| b.name().clone());
                let resp = json_error(status, message, route, plugin.as_deref());
                return Step::Done(RequestOutcome::Answer(self.progress.noted(resp)));
            }
        };
        *body = Body::full(bytes.clone());
        let mut progress = self.progress;
        progress.whole_from = request_hooks(self.chain)
            .nth(self.at)
            .map(|(place, _)| place);
        for (i, (place, binding)) in request_hooks(self.chain).enumerate().skip(self.at) {
            // The plugin that asked for the body has had its one ask; a
            // later one may ask once (the body is in hand: it is called
            // again with it).
            let mut asked = i == self.at;
            loop {
                let mut stream = progress.streams.get(place);
                let facts = &mut progress.facts;
                let called = plugin::offload::on_request_with_body(
                    binding,
                    &mut stream,
                    facts,
                    headers,
                    &bytes,
                )
                .await;
                progress.streams.set(place, stream);
                let result = match called {
                    Ok(result) => result,
                    Err(plugin::Lost) => {
                        tracing::error!(plugin = %binding.name(), route = %route.name, "plugin call lost before it ran");
                        let resp = json_error(
                            StatusCode::SERVICE_UNAVAILABLE,
                            "plugin call lost",
                            route,
                            Some(binding.name()),
                        );
                        return Step::Done(RequestOutcome::Answer(progress.noted(resp)));
                    }
                };
                let flow = after_call(&**binding, result, &mut progress, route, config);
                // A plugin's new body: what later plugins and the upstream get.
                if let Some(new) = progress.body.take() {
                    headers.insert(header::CONTENT_LENGTH, new.len().into());
                    headers.remove(header::TRANSFER_ENCODING);
                    *body = Body::full(new.clone());
                    bytes = new;
                }
                match flow {
                    Flow::Next => break,
                    Flow::Answer(resp) => {
                        return Step::Done(RequestOutcome::Answer(progress.noted(resp)));
                    }
                    Flow::Local(resp) => {
                        let resp =
                            local_through(self.chain, place, &mut progress, headers, route, resp);
                        return Step::Done(RequestOutcome::Answer(progress.noted(resp)));
                    }
                    Flow::Callout(request) => {
                        let at = (self.chain, i, place);
                        let bytes = Some(bytes);
                        let pending = PendingCallout::new(at, progress, request, bytes);
                        return Step::Callout(Box::new(pending));
                    }
                    Flow::WantsBody(_) if !asked => asked = true,
                    Flow::WantsBody(_) => {
                        let e = PluginError::Trap {
                            plugin: binding.name().clone(),
                            message: "asked for the body twice".into(),
                        };
                        match fail(&**binding, route, &e) {
                            Some(resp) => {
                                return Step::Done(RequestOutcome::Answer(progress.noted(resp)));
                            }
                            None => break,
                        }
                    }
                }
            }
        }
        Step::Done(finish(self.chain, progress))
    }
}
