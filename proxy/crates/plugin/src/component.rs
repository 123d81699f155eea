//! Component plugins (`wit/policy.wit`) as the driver sees every plugin
//! ([`crate::seam::Plugin`]): the world's decisions turned into verdicts,
//! its header edits made on the lent maps, its callouts into the seam's.

use super::*;
use crate::seam::{self, BodyVerdict, CalloutAnswer, LocalAnswer, ResponseVerdict, Steer, Verdict};

/// The longest a callout may wait for its answer, whatever it asks.
const MAX_CALLOUT_TIMEOUT_MS: u32 = seam::MAX_CALLOUT_TIMEOUT.as_millis() as u32;

impl seam::Plugin for Binding {
    fn name(&self) -> &Arc<str> {
        &self.plugin
    }

    fn fail(&self) -> FailMode {
        self.fail
    }

    fn hooks(&self) -> seam::Hooks {
        self.hooks
    }

    /// Its image and `configure` included.
    fn memory_use(&self) -> (Option<&str>, usize, usize) {
        (
            self.route.as_deref(),
            self.memory_peak.load(std::sync::atomic::Ordering::Relaxed),
            self.memory,
        )
    }

    fn calls(&self) -> u64 {
        self.idle
            .iter()
            .map(|s| s.calls.load(std::sync::atomic::Ordering::Relaxed))
            .sum()
    }

    /// An instance holds nothing of a request between calls.
    fn runs_anywhere(&self) -> bool {
        true
    }

    fn on_request(
        &self,
        _stream: &mut seam::Stream,
        facts: &mut Option<RequestFacts>,
        headers: &mut http::HeaderMap,
        body: Option<&[u8]>,
    ) -> Result<Verdict, PluginError> {
        let decision = self.call_on_request(facts, headers, body)?;
        self.verdict(decision, headers)
    }

    fn on_callout(
        &self,
        _stream: &mut seam::Stream,
        facts: &mut Option<RequestFacts>,
        headers: &mut http::HeaderMap,
        answer: CalloutAnswer,
    ) -> Result<Verdict, PluginError> {
        let result = match answer {
            CalloutAnswer::Answered {
                status,
                headers,
                body,
                ..
            } => CalloutResult::Answered(bindings::CalloutResponse {
                status,
                headers: to_wit_headers(&headers),
                body: body.into(),
            }),
            CalloutAnswer::Failed {
                timed_out: true, ..
            } => CalloutResult::TimedOut,
            CalloutAnswer::Failed { why, .. } => CalloutResult::Failed(why),
        };
        let decision = self.call_on_callout(facts, headers, result)?;
        self.verdict(decision, headers)
    }

    fn on_response(
        &self,
        _stream: &mut seam::Stream,
        lent: seam::ResponseLent<'_>,
    ) -> Result<ResponseVerdict, PluginError> {
        let head = ResponseHead {
            status: lent.status,
        };
        let parts = (head, &mut *lent.headers);
        // The hook's request is the whole head as forwarded.
        lent.request_later.add_to(lent.request_headers);
        Ok(
            match self.call_on_response(lent.facts, lent.request_headers, parts)? {
                ResponseDecision::Forward(edits) => {
                    apply_edits(lent.headers, &edits, &self.plugin);
                    ResponseVerdict::Continue
                }
                ResponseDecision::Respond(local) => {
                    ResponseVerdict::Respond(Box::new(self.answer(local)))
                }
                ResponseDecision::ReadBody(max) => {
                    ResponseVerdict::ReadBody(max.min(seam::MAX_BUFFERED_BODY))
                }
            },
        )
    }

    /// Called only with a whole body, after `on-response` asked for it
    /// (the hooks never ask for pieces).
    fn on_response_body(
        &self,
        _stream: &mut seam::Stream,
        lent: seam::ResponseLent<'_>,
        body: &bytes::Bytes,
    ) -> Result<BodyVerdict, PluginError> {
        let head = ResponseHead {
            status: lent.status,
        };
        let parts = (head, &mut *lent.headers);
        lent.request_later.add_to(lent.request_headers);
        Ok(
            match self.call_on_response_body(lent.facts, lent.request_headers, parts, body)? {
                ResponseBodyDecision::Forward(edits) => {
                    apply_edits(lent.headers, &edits.headers, &self.plugin);
                    BodyVerdict::Continue(edits.body.map(bytes::Bytes::from))
                }
                ResponseBodyDecision::Respond(local) => {
                    BodyVerdict::Respond(Box::new(self.answer(local)))
                }
            },
        )
    }

    /// One instance a worker slot, made and configured before it serves
    /// (a per-request use makes its instances as requests come).
    fn warm(&self, shards: std::ops::Range<usize>) -> Result<(), PluginError> {
        if self.fresh {
            return Ok(());
        }
        for shard in shards {
            let empty = self.idle[shard]
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty();
            if empty {
                let instance = self.instantiate()?;
                self.idle[shard]
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(instance);
            }
        }
        Ok(())
    }

    fn ready(&self) -> usize {
        (self.idle.iter())
            .map(|s| s.lock().unwrap_or_else(|p| p.into_inner()).len())
            .sum()
    }
}

impl Binding {
    /// A request-side decision as a verdict, its header edits made.
    fn verdict(
        &self,
        decision: Decision,
        headers: &mut http::HeaderMap,
    ) -> Result<Verdict, PluginError> {
        Ok(match decision {
            Decision::Forward(f) => {
                // Later plugins read the request as edited.
                apply_edits(headers, &f.headers, &self.plugin);
                Verdict::Continue(Steer {
                    path: f.path,
                    upstream: f.upstream,
                    body: None,
                })
            }
            Decision::Respond(local) => Verdict::Respond(Box::new(self.answer(local))),
            Decision::ReadBody(max) => Verdict::ReadBody(max),
            Decision::Callout(c) => Verdict::Callout(Box::new(self.callout(c)?)),
        })
    }

    /// The world's `callout` as the seam's. One the proxy cannot send (no
    /// method, a path that is no path) fails the call, naming what.
    fn callout(&self, c: bindings::Callout) -> Result<seam::Callout, PluginError> {
        let bad = |message: String| PluginError::Trap {
            plugin: self.plugin.clone(),
            message,
        };
        let method = http::Method::from_bytes(c.method.as_bytes())
            .map_err(|_| bad(format!("callout method `{}` is not a method", c.method)))?;
        if !c.path.starts_with('/') || c.path.parse::<http::uri::PathAndQuery>().is_err() {
            return Err(bad(format!(
                "callout path `{}` is not an absolute path",
                c.path
            )));
        }
        // `host` names the authority; the other headers go as they are.
        let mut authority = None;
        let mut headers = http::HeaderMap::new();
        let (host, others): (Vec<_>, Vec<_>) = c
            .headers
            .into_iter()
            .partition(|h| h.name.eq_ignore_ascii_case("host"));
        if let Some(h) = host.into_iter().next_back() {
            authority = String::from_utf8(h.value).ok();
        }
        let add = HeaderEdits {
            remove: Vec::new(),
            set: Vec::new(),
            add: others,
        };
        apply_edits(&mut headers, &add, &self.plugin);
        let ms = c.timeout_ms.clamp(1, MAX_CALLOUT_TIMEOUT_MS);
        Ok(seam::Callout {
            upstream: c.upstream,
            method,
            path: c.path,
            authority,
            headers,
            body: c.body.into(),
            timeout: std::time::Duration::from_millis(u64::from(ms)),
            redis: false,
        })
    }

    /// The world's `local-response` as an answer; a header that is no
    /// valid field is skipped (and logged), as in an edit.
    fn answer(&self, local: LocalResponse) -> LocalAnswer {
        let mut headers = http::HeaderMap::new();
        let add = HeaderEdits {
            remove: Vec::new(),
            set: Vec::new(),
            add: local.headers,
        };
        apply_edits(&mut headers, &add, &self.plugin);
        LocalAnswer {
            status: local.status,
            headers,
            body: local.body.into(),
            error_shape: true,
            grpc: seam::GrpcReply::AsMade,
            reset: false,
        }
    }
}
