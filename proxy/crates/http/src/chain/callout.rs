//! A plugin waiting on its callout: the request it made, and the rest of
//! the chain run once the answer is in.

use super::*;

/// A chain stopped at the plugin that made a callout.
pub struct PendingCallout<'a> {
    chain: &'a [Arc<dyn Plugin>],
    /// The plugin's index among the request hooks, and place in the chain.
    at: usize,
    place: usize,
    progress: Progress<'a>,
    request: Option<Box<plugin::Callout>>,
    /// The request body, when it was read for a plugin before.
    body: Option<Bytes>,
}

impl<'a> PendingCallout<'a> {
    pub(super) fn new(
        (chain, at, place): (&'a [Arc<dyn Plugin>], usize, usize),
        progress: Progress<'a>,
        request: Box<plugin::Callout>,
        body: Option<Bytes>,
    ) -> Self {
        PendingCallout {
            chain,
            at,
            place,
            progress,
            request: Some(request),
            body,
        }
    }

    /// The request to send (taken: asked once).
    pub fn request(&mut self) -> Option<plugin::Callout> {
        self.request.take().map(|request| *request)
    }

    /// The plugin that made it, for logs.
    pub fn plugin(&self) -> &str {
        self.chain[self.place].name()
    }

    /// Gives the plugin `answer`, then runs the rest of the chain.
    pub fn answered(
        self,
        answer: plugin::CalloutAnswer,
        headers: &mut http::HeaderMap,
        route: &Route,
        config: &Config,
    ) -> Step<'a> {
        let PendingCallout {
            chain,
            at,
            place,
            mut progress,
            body,
            ..
        } = self;
        let binding = &chain[place];
        let mut stream = progress.streams.get(place);
        let result = binding.on_callout(&mut stream, &mut progress.facts, headers, answer);
        progress.streams.set(place, stream);
        let flow = after_call(&**binding, result, &mut progress, route, config);
        let waiting = Waiting {
            chain,
            at,
            place,
            body: body.clone(),
        };
        match waiting.step(flow, &mut progress, headers, route) {
            None => run_from(chain, at + 1, progress, headers, body, route, config),
            Some(step) => step,
        }
    }
}
