//! A response body streamed through the body hooks of the plugins that
//! see every body ([`plugin::Hooks::response_body`]), piece by piece, as
//! Envoy runs a filter's body callback: each plugin, last first, gets
//! each piece and may pass it on, replace it, or keep it to see with the
//! next (up to [`plugin::seam::MAX_BUFFERED_BODY`]: past it the response
//! is cut off, the head having gone). A plugin's failure closed, or an
//! answer it makes once the head has gone, cuts the response off too.

use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::BytesMut;
use http_body::Frame;

use super::*;
use crate::body::BodyError;

/// `body` through the body hooks of `ctx`'s plugins that see every body;
/// `body` itself (no allocation) when none does. Their streams are ended
/// with the body, as Envoy logs a stream once its response is sent.
pub fn filter_body(
    ctx: &mut PluginContext<'_>,
    route: &Route,
    resp: &http::response::Parts,
    body: Body,
) -> Body {
    let chain = ctx.chain;
    let seeing = |b: &Arc<dyn Plugin>| b.hooks().response_body;
    if !chain.iter().any(seeing) || http_body::Body::is_end_stream(&body) {
        return body;
    }
    let stages = (chain.iter().enumerate().rev())
        .filter(|(_, b)| seeing(b))
        .map(|(place, b)| Stage {
            plugin: b.clone(),
            stream: ctx.streams.take(place),
            kept: None,
        })
        .collect();
    Body::boxed(Filtered {
        inner: body,
        stages,
        facts: ctx.facts.take(),
        request_headers: std::mem::take(&mut ctx.request_headers),
        head: http::response::Parts::clone_head(resp),
        route: route.name.clone(),
        ended: false,
        after: None,
    })
}

/// One plugin's place in the body's way.
struct Stage {
    plugin: Arc<dyn Plugin>,
    stream: plugin::Stream,
    /// What it kept to see with the next piece.
    kept: Option<BytesMut>,
}

struct Filtered {
    inner: Body,
    /// Last plugin first.
    stages: Vec<Stage>,
    facts: Option<RequestFacts>,
    request_headers: http::HeaderMap,
    /// The head as sent, for the calls to read.
    head: http::response::Parts,
    route: Arc<str>,
    /// Whether the plugins have seen the end of the body.
    ended: bool,
    /// The trailers, held while the last data goes.
    after: Option<Frame<Bytes>>,
}

trait CloneHead {
    fn clone_head(&self) -> Self;
}

impl CloneHead for http::response::Parts {
    /// The status and headers (a response head's extensions are not for
    /// plugins).
    fn clone_head(&self) -> Self {
        let mut head = Response::new(()).into_parts().0;
        head.status = self.status;
        head.headers = self.headers.clone();
        head
    }
}

impl Filtered {
    /// `piece` through every stage: what comes out the end.
    fn run(&mut self, mut piece: Bytes, end_of_stream: bool) -> Result<Bytes, BodyError> {
        for stage in &mut self.stages {
            let given = match stage.kept.take() {
                Some(mut kept) => {
                    kept.extend_from_slice(&piece);
                    kept.freeze()
                }
                None => piece,
            };
            let lent = lend(
                &mut self.facts,
                &mut self.request_headers,
                &mut self.head,
                end_of_stream,
            );
            let called = stage
                .plugin
                .on_response_body(&mut stage.stream, lent, &given);
            piece = match called {
                Ok(plugin::BodyVerdict::Continue(new)) => new.unwrap_or(given),
                Ok(plugin::BodyVerdict::Pause) if end_of_stream => given,
                Ok(plugin::BodyVerdict::Pause) => {
                    if given.len() > plugin::seam::MAX_BUFFERED_BODY as usize {
                        let name = stage.plugin.name();
                        tracing::warn!(plugin = %name, route = %self.route, "response body too large for the plugin; response cut off");
                        return Err("response body too large for the route's plugin".into());
                    }
                    stage.kept = Some(BytesMut::from(given));
                    return Ok(Bytes::new());
                }
                Ok(plugin::BodyVerdict::Respond(_)) => {
                    let name = stage.plugin.name();
                    tracing::warn!(plugin = %name, route = %self.route, "plugin answered after the response head went; response cut off");
                    return Err("plugin answered after the response head".into());
                }
                Err(e) => {
                    count_failure(&*stage.plugin, &e);
                    let name = stage.plugin.name();
                    if stage.plugin.fail() == FailMode::Closed {
                        tracing::warn!(plugin = %name, route = %self.route, error = %e, "plugin failed on the response body; response cut off (fail: closed)");
                        return Err(e.to_string().into());
                    }
                    tracing::warn!(plugin = %name, route = %self.route, error = %e, "plugin failed on the response body; body let through (fail: open)");
                    given
                }
            };
        }
        Ok(piece)
    }
}

impl Drop for Filtered {
    fn drop(&mut self) {
        for stage in self.stages.drain(..) {
            if stage.stream != plugin::Stream::NONE {
                stage.plugin.end(stage.stream);
            }
        }
    }
}

impl http_body::Body for Filtered {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        loop {
            if this.ended {
                return Poll::Ready(this.after.take().map(Ok));
            }
            let frame = ready!(Pin::new(&mut this.inner).poll_frame(cx));
            let (piece, end_of_stream) = match frame {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => (data, http_body::Body::is_end_stream(&this.inner)),
                    // Trailers end the body: the plugins see its end first.
                    Err(trailers) => {
                        this.after = Some(trailers);
                        (Bytes::new(), true)
                    }
                },
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                None => (Bytes::new(), true),
            };
            this.ended = end_of_stream;
            let out = this.run(piece, end_of_stream)?;
            if !out.is_empty() {
                return Poll::Ready(Some(Ok(Frame::data(out))));
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.after.is_none()
    }
}
