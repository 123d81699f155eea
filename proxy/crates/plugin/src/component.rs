//! Component plugins (`wit/policy.wit`) as the driver sees every plugin
//! ([`crate::seam::Plugin`]): the world's decisions turned into verdicts,
//! its header edits made on the lent maps.

use super::*;
use crate::seam::{self, LocalAnswer, ResponseVerdict, Steer, Verdict};

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
        Ok(match self.call_on_request(facts, headers, body)? {
            Decision::Forward(f) => {
                // Later plugins read the request as edited.
                apply_edits(headers, &f.headers, &self.plugin);
                Verdict::Continue(Steer {
                    path: f.path,
                    upstream: f.upstream,
                    body: None,
                })
            }
            Decision::Respond(local) => Verdict::Respond(self.answer(local)),
            Decision::ReadBody(max) => Verdict::ReadBody(max),
        })
    }

    fn on_response(
        &self,
        _stream: &mut seam::Stream,
        lent: seam::ResponseLent<'_>,
    ) -> Result<ResponseVerdict, PluginError> {
        let head = ResponseHead {
            status: lent.status,
        };
        let edits = self.call_on_response(lent.facts, lent.request_headers, head, lent.headers)?;
        apply_edits(lent.headers, &edits, &self.plugin);
        Ok(ResponseVerdict::Continue)
    }
}

impl Binding {
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
        }
    }
}
