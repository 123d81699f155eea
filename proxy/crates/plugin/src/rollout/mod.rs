//! A plugin use rolled out to a candidate version by share (`rollout:`):
//! each request goes to the current version or the candidate by a stable
//! hash of its key (the client's address, a header, a cookie), so a
//! client sees one version; the candidate's share grows through the
//! rollout's steps while it does as well as the current one, and falls
//! to nothing — rolled back, by itself — when it does worse.
//!
//! Each version's outcomes are counted apart: answered, denied (an answer
//! of 400 or above, a reset), failed, timed out, and the upstream's 5xx
//! behind it. The rollout's state lives beside the pipelines, keyed by
//! what the policies say of it, so a reload that leaves it alone keeps
//! it (a rolled-back rollout stays rolled back until the policy changes).
//!
//! A wrapper over both versions through the [`Plugin`] seam.

mod state;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use portcullis_config::{FailMode, RolloutKey};
use portcullis_net::request_key::{cookie, fnv1a, mix};

use crate::seam::{
    BodyVerdict, CalloutAnswer, Callouts, Hooks, LocalAnswer, Plugin, RequestLent, ResponseLent,
    ResponseVerdict, Steer, Stream, Verdict,
};
use crate::{PluginError, RequestFacts};

/// Set in a request's stream: the candidate serves it.
const CANDIDATE: u64 = 1 << 63;
/// Set once the version is picked.
const PICKED: u64 = 1 << 62;
/// Set once its outcome is counted.
const COUNTED: u64 = 1 << 61;

use state::Outcome;
pub use state::{OUTCOMES, Spec, State, VERSIONS};

use crate::use_reports::RolloutReport;

/// A use rolled out from `current` to `candidate`.
#[derive(Debug)]
pub struct Rollout {
    current: Arc<dyn Plugin>,
    candidate: Arc<dyn Plugin>,
    key: RolloutKey,
    state: Arc<State>,
}

impl Rollout {
    pub fn new(
        current: Arc<dyn Plugin>,
        candidate: Arc<dyn Plugin>,
        key: RolloutKey,
        state: Arc<State>,
    ) -> Rollout {
        Rollout {
            current,
            candidate,
            key,
            state,
        }
    }

    fn names(&self) -> (&str, &str) {
        (self.current.name(), self.candidate.name())
    }

    /// The version a request goes to: the candidate when its key hashes
    /// into the candidate's share. A request without its key (no such
    /// header or cookie) goes to the current version.
    fn pick(&self, facts: &Option<RequestFacts>, headers: &http::HeaderMap) -> bool {
        self.state.tick(self.current.name());
        let percent = self.state.percent.load(Ordering::Relaxed);
        if percent == 0 {
            return false;
        }
        if percent >= 100 {
            return true;
        }
        let hash = match &self.key {
            RolloutKey::Client => facts.as_ref().map(|f| match f.client {
                std::net::IpAddr::V4(a) => spread(&a.octets()),
                std::net::IpAddr::V6(a) => spread(&a.octets()),
            }),
            RolloutKey::Header(name) => headers.get(name.as_str()).map(|v| spread(v.as_bytes())),
            RolloutKey::Cookie(name) => cookie(headers, name).map(spread),
        };
        hash.is_some_and(|h| h % 10_000 < u64::from(percent) * 100)
    }

    /// The version serving the request `stream` belongs to, picked on its
    /// first call.
    fn version(
        &self,
        stream: &mut Stream,
        facts: &Option<RequestFacts>,
        headers: &http::HeaderMap,
    ) -> usize {
        if stream.0 & PICKED == 0 {
            let candidate = self.pick(facts, headers);
            stream.0 |= PICKED | if candidate { CANDIDATE } else { 0 };
        }
        usize::from(stream.0 & CANDIDATE != 0)
    }

    fn plugin(&self, version: usize) -> &Arc<dyn Plugin> {
        if version == 1 {
            &self.candidate
        } else {
            &self.current
        }
    }

    /// Counts the request's outcome, once.
    fn count(&self, stream: &mut Stream, version: usize, outcome: Outcome) {
        if stream.0 & COUNTED == 0 {
            stream.0 |= COUNTED;
            self.state.record(self.names(), version, outcome);
        }
    }

    /// The outcome a request-side result settles, if it settles one.
    fn request_outcome(
        &self,
        stream: &mut Stream,
        version: usize,
        result: &Result<Verdict, PluginError>,
    ) {
        match result {
            Ok(Verdict::Respond(a)) => self.count(stream, version, answered(a)),
            Err(e) => self.count(stream, version, failed(e)),
            Ok(_) => {}
        }
    }

    /// Its state now.
    pub fn report(&self) -> RolloutReport {
        self.state.tick(self.current.name());
        self.state.report(self.candidate.name().clone())
    }
}

/// An answer's outcome: a deny (400 and above, a reset) or an answer.
fn answered(a: &LocalAnswer) -> Outcome {
    if a.reset || a.status >= 400 {
        Outcome::Denied
    } else {
        Outcome::Answered
    }
}

fn failed(e: &PluginError) -> Outcome {
    if matches!(e, PluginError::Timeout { .. }) {
        Outcome::TimedOut
    } else {
        Outcome::Failed
    }
}

/// A key's place, evenly spread (FNV alone leaves nearby addresses' low
/// digits alike).
fn spread(key: &[u8]) -> u64 {
    mix(fnv1a(key))
}

impl Plugin for Rollout {
    /// The current version's: failures are logged and counted under it
    /// (a failure's error names the plugin that failed).
    fn name(&self) -> &Arc<str> {
        self.current.name()
    }

    fn fail(&self) -> FailMode {
        self.current.fail()
    }

    /// Both versions' hooks, and always the request's (to pick) and the
    /// response's (to count the upstream's answer).
    fn hooks(&self) -> Hooks {
        let (a, b) = (self.current.hooks(), self.candidate.hooks());
        Hooks {
            request: true,
            response: true,
            local_answers: a.local_answers || b.local_answers,
            response_body: a.response_body || b.response_body,
            request_body: a.request_body || b.request_body,
        }
    }

    fn memory_use(&self) -> (Option<&str>, usize, usize) {
        self.current.memory_use()
    }

    fn calls(&self) -> u64 {
        self.current.calls() + self.candidate.calls()
    }

    fn runs_anywhere(&self) -> bool {
        self.current.runs_anywhere() && self.candidate.runs_anywhere()
    }

    fn on_request(
        &self,
        stream: &mut Stream,
        facts: &mut Option<RequestFacts>,
        headers: &mut http::HeaderMap,
        body: Option<&[u8]>,
    ) -> Result<Verdict, PluginError> {
        let version = self.version(stream, facts, headers);
        let plugin = self.plugin(version);
        if !plugin.hooks().request {
            return Ok(Verdict::Continue(Steer::default()));
        }
        let result = stream.with_inner(|s| plugin.on_request(s, facts, headers, body));
        self.request_outcome(stream, version, &result);
        result
    }

    fn on_callout(
        &self,
        stream: &mut Stream,
        facts: &mut Option<RequestFacts>,
        headers: &mut http::HeaderMap,
        answer: CalloutAnswer,
    ) -> Result<Verdict, PluginError> {
        let version = usize::from(stream.0 & CANDIDATE != 0);
        let plugin = self.plugin(version);
        let result = stream.with_inner(|s| plugin.on_callout(s, facts, headers, answer));
        self.request_outcome(stream, version, &result);
        result
    }

    fn on_response(
        &self,
        stream: &mut Stream,
        lent: ResponseLent<'_>,
    ) -> Result<ResponseVerdict, PluginError> {
        let version = usize::from(stream.0 & CANDIDATE != 0);
        let plugin = self.plugin(version);
        let status = lent.status;
        let result = if plugin.hooks().response {
            stream.with_inner(|s| plugin.on_response(s, lent))
        } else {
            Ok(ResponseVerdict::Continue)
        };
        let outcome = match &result {
            Ok(ResponseVerdict::Respond(a)) => answered(a),
            Err(e) => failed(e),
            Ok(_) if status >= 500 => Outcome::Upstream5xx,
            Ok(_) => Outcome::Answered,
        };
        self.count(stream, version, outcome);
        result
    }

    fn on_request_body(
        &self,
        stream: &mut Stream,
        lent: RequestLent<'_>,
        body: &Bytes,
    ) -> Result<BodyVerdict, PluginError> {
        let plugin = self.plugin(usize::from(stream.0 & CANDIDATE != 0));
        if !plugin.hooks().request_body {
            return Ok(BodyVerdict::Continue(None));
        }
        stream.with_inner(|s| plugin.on_request_body(s, lent, body))
    }

    fn on_response_body(
        &self,
        stream: &mut Stream,
        lent: ResponseLent<'_>,
        body: &Bytes,
    ) -> Result<BodyVerdict, PluginError> {
        let plugin = self.plugin(usize::from(stream.0 & CANDIDATE != 0));
        stream.with_inner(|s| plugin.on_response_body(s, lent, body))
    }

    fn on_request_trailers(
        &self,
        stream: &mut Stream,
        lent: RequestLent<'_>,
        trailers: &mut http::HeaderMap,
    ) -> Result<Option<LocalAnswer>, PluginError> {
        let plugin = self.plugin(usize::from(stream.0 & CANDIDATE != 0));
        if !plugin.hooks().request_body {
            return Ok(None);
        }
        stream.with_inner(|s| plugin.on_request_trailers(s, lent, trailers))
    }

    fn on_response_trailers(
        &self,
        stream: &mut Stream,
        lent: ResponseLent<'_>,
        trailers: &mut http::HeaderMap,
    ) -> Result<Option<LocalAnswer>, PluginError> {
        let plugin = self.plugin(usize::from(stream.0 & CANDIDATE != 0));
        if !plugin.hooks().response_body {
            return Ok(None);
        }
        stream.with_inner(|s| plugin.on_response_trailers(s, lent, trailers))
    }

    fn set_callouts(&self, callouts: Arc<dyn Callouts>) {
        self.current.set_callouts(callouts.clone());
        self.candidate.set_callouts(callouts);
    }

    fn warm(&self, shards: std::ops::Range<usize>) -> Result<(), PluginError> {
        self.current.warm(shards.clone())?;
        self.candidate.warm(shards)
    }

    fn ready(&self) -> usize {
        self.current.ready()
    }

    fn end(&self, stream: Stream) {
        let own = stream.inner();
        if own != Stream::NONE {
            self.plugin(usize::from(stream.0 & CANDIDATE != 0)).end(own);
        }
    }

    fn rollout(&self) -> Option<RolloutReport> {
        Some(self.report())
    }
}
