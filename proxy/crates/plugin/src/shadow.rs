//! A plugin use in shadow mode (`mode: shadow`): it runs on its share of
//! requests as it would enforced, but nothing it decides is enforced.
//! It is called on copies of the heads, so its edits go nowhere; its
//! answers (a deny, a local reply) and its failures and timeouts are
//! counted and noted for the request's access line, and the request goes
//! on as if it had not been there. What it would have done is what a
//! change to it should be judged by before it is enforced.
//!
//! A wrapper over any kind through the [`Plugin`] seam: the driver runs it
//! like any plugin and only sees [`Verdict::Noted`] come back.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use portcullis_config::FailMode;

use crate::seam::{
    BodyVerdict, CalloutAnswer, Callouts, Hooks, LocalAnswer, Noted, Plugin, RequestLent,
    ResponseLent, ResponseVerdict, Steer, Stream, Verdict,
};
use crate::use_reports::ShadowReport;
use crate::{PluginError, RequestFacts};

/// Set in a stream once the use has decided whether a request is in its
/// share: it ran on it (the plugin's own stream below it). Kinds keep
/// their streams below bit 62 ([`Stream`]).
const RAN: u64 = 1 << 63;
/// Set once it decided to leave the request alone (not in its share, or
/// it needed a body it could not be given without changing the request).
const SKIPPED: u64 = 1 << 62;

/// A use in shadow mode over `inner`.
#[derive(Debug)]
pub struct Shadow {
    inner: Arc<dyn Plugin>,
    /// Its share of requests, 1-100.
    percent: u32,
    seen: AtomicU64,
    counts: Counts,
}

/// What a shadow use did and would have done.
#[derive(Debug, Default)]
struct Counts {
    ran: AtomicU64,
    skipped: AtomicU64,
    failed: AtomicU64,
    timed_out: AtomicU64,
    /// Answers it would have made, by status (444: a reset).
    would_answer: Mutex<Vec<(u16, u64)>>,
}

impl Shadow {
    /// `inner` in shadow mode on `percent` of requests.
    pub fn new(inner: Arc<dyn Plugin>, percent: u32) -> Shadow {
        Shadow {
            inner,
            percent: percent.clamp(1, 100),
            seen: AtomicU64::new(0),
            counts: Counts::default(),
        }
    }

    /// Whether the next request is in the share: spread evenly (with
    /// 10%, one in each ten), as a mirror's.
    fn takes(&self) -> bool {
        if self.percent >= 100 {
            return true;
        }
        let n = self.seen.fetch_add(1, Ordering::Relaxed);
        let p = u64::from(self.percent);
        (n * p) % 100 + p >= 100
    }

    /// Whether it runs on the request `stream` belongs to, deciding on
    /// the request's first call.
    fn runs(&self, stream: &mut Stream) -> bool {
        if stream.0 & RAN != 0 {
            return true;
        }
        if stream.0 & SKIPPED != 0 {
            return false;
        }
        if self.takes() {
            self.counts.ran.fetch_add(1, Ordering::Relaxed);
            stream.0 |= RAN;
            true
        } else {
            stream.0 |= SKIPPED;
            false
        }
    }

    /// Leaves a request in the share alone from now on.
    fn skip(&self, stream: &mut Stream) {
        self.counts.skipped.fetch_add(1, Ordering::Relaxed);
        stream.0 = (stream.0 & !RAN) | SKIPPED;
    }

    /// What an answer it made would have been, counted; the note for the
    /// access line.
    fn would_answer(&self, answer: &LocalAnswer) -> Box<Noted> {
        let status = if answer.reset { 444 } else { answer.status };
        let mut by_status = self
            .counts
            .would_answer
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match by_status.iter_mut().find(|(s, _)| *s == status) {
            Some((_, n)) => *n += 1,
            None => {
                by_status.push((status, 1));
                by_status.sort_unstable();
            }
        }
        self.note(format!("{status}"))
    }

    /// A failed call, counted and logged; the request goes on.
    fn failed(&self, e: &PluginError) -> Box<Noted> {
        let what = if matches!(e, PluginError::Timeout { .. }) {
            self.counts.timed_out.fetch_add(1, Ordering::Relaxed);
            "timed_out"
        } else {
            self.counts.failed.fetch_add(1, Ordering::Relaxed);
            "failed"
        };
        if crate::containment::may_log(self.inner.name()) {
            tracing::warn!(plugin = %self.inner.name(), error = %e, "shadow plugin failed; request let through (mode: shadow)");
        }
        self.note(what.to_owned())
    }

    fn note(&self, what: String) -> Box<Noted> {
        Box::new(Noted {
            plugin: self.inner.name().clone(),
            what,
        })
    }

    /// A request-side verdict made harmless: edits and answers dropped,
    /// a body asked for given only when that changes nothing for the
    /// client, a callout made (the plugin decides on its answer).
    fn request_verdict(
        &self,
        stream: &mut Stream,
        result: Result<Verdict, PluginError>,
        headers: &http::HeaderMap,
    ) -> Verdict {
        match result {
            Ok(Verdict::Continue(_)) => Verdict::Continue(Steer::default()),
            Ok(Verdict::Noted(n)) => Verdict::Noted(n),
            Ok(Verdict::Respond(answer)) => Verdict::Noted(self.would_answer(&answer)),
            Ok(Verdict::Callout(c)) => Verdict::Callout(c),
            // Read whole only when it is known to fit: a body over the
            // plugin's bound would otherwise be refused (413), and one of
            // unknown length held back from the upstream until it ends.
            Ok(Verdict::ReadBody(max)) if fits(headers, max) => Verdict::ReadBody(max),
            Ok(Verdict::ReadBody(_)) => {
                self.skip(stream);
                Verdict::Continue(Steer::default())
            }
            Err(e) => Verdict::Noted(self.failed(&e)),
        }
    }

    /// A response body verdict made harmless.
    fn body_verdict(&self, result: Result<BodyVerdict, PluginError>) -> BodyVerdict {
        match result {
            Ok(BodyVerdict::Continue(_) | BodyVerdict::Pause) => BodyVerdict::Continue(None),
            Ok(BodyVerdict::Noted(n)) => BodyVerdict::Noted(n),
            Ok(BodyVerdict::Respond(answer)) => BodyVerdict::Noted(self.would_answer(&answer)),
            Err(e) => BodyVerdict::Noted(self.failed(&e)),
        }
    }

    /// An answer a trailers call made, or its failure, counted.
    fn trailers_outcome(&self, result: Result<Option<LocalAnswer>, PluginError>) {
        match result {
            Ok(Some(answer)) => drop(self.would_answer(&answer)),
            Ok(None) => {}
            Err(e) => drop(self.failed(&e)),
        }
    }

    /// Its counts so far.
    pub fn report(&self) -> ShadowReport {
        let c = &self.counts;
        ShadowReport {
            percent: self.percent,
            ran: c.ran.load(Ordering::Relaxed),
            skipped: c.skipped.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
            timed_out: c.timed_out.load(Ordering::Relaxed),
            would_answer: c
                .would_answer
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        }
    }
}

/// Copies of what a response call is lent, for the plugin to edit.
struct Copies {
    facts: Option<RequestFacts>,
    request: http::HeaderMap,
    /// Empty: the copy of the request has the proxy's fields in it.
    later: crate::seam::Forwarded,
    response: http::HeaderMap,
}

impl Copies {
    fn of(lent: &ResponseLent<'_>) -> Copies {
        let mut request = lent.request_headers.clone();
        lent.request_later.clone().add_to(&mut request);
        Copies {
            facts: lent.facts.clone(),
            request,
            later: Default::default(),
            response: lent.headers.clone(),
        }
    }

    /// The copies, lent as `lent` is.
    fn lend<'a>(&'a mut self, lent: &ResponseLent<'_>) -> ResponseLent<'a> {
        ResponseLent {
            facts: &mut self.facts,
            request_headers: &mut self.request,
            request_later: &mut self.later,
            status: lent.status,
            headers: &mut self.response,
            end_of_stream: lent.end_of_stream,
            head_sent: lent.head_sent,
        }
    }
}

/// Whether a request body is known to be at most `max` bytes (none, or
/// a `Content-Length` within it).
fn fits(headers: &http::HeaderMap, max: u32) -> bool {
    if headers.contains_key(http::header::TRANSFER_ENCODING) {
        return false;
    }
    match headers.get(http::header::CONTENT_LENGTH) {
        Some(v) => v
            .to_str()
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
            .is_some_and(|n| n <= u64::from(max)),
        None => true,
    }
}

/// A response's declared length, when it is known to be at most `max`.
fn response_fits(headers: &http::HeaderMap, max: u32) -> bool {
    headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|s| s.trim().parse::<u64>().ok())
        .is_some_and(|n| n <= u64::from(max))
}

impl Plugin for Shadow {
    fn name(&self) -> &Arc<str> {
        self.inner.name()
    }

    /// Never closed: a shadow use's failure never fails its request.
    fn fail(&self) -> FailMode {
        FailMode::Open
    }

    fn hooks(&self) -> Hooks {
        self.inner.hooks()
    }

    fn memory_use(&self) -> (Option<&str>, usize, usize) {
        self.inner.memory_use()
    }

    fn calls(&self) -> u64 {
        self.inner.calls()
    }

    fn runs_anywhere(&self) -> bool {
        self.inner.runs_anywhere()
    }

    fn on_request(
        &self,
        stream: &mut Stream,
        facts: &mut Option<RequestFacts>,
        headers: &mut http::HeaderMap,
        body: Option<&[u8]>,
    ) -> Result<Verdict, PluginError> {
        if !self.runs(stream) {
            return Ok(Verdict::Continue(Steer::default()));
        }
        let mut copy = headers.clone();
        let mut seen = facts.clone();
        let result = stream.with_inner(|s| self.inner.on_request(s, &mut seen, &mut copy, body));
        Ok(self.request_verdict(stream, result, headers))
    }

    fn on_callout(
        &self,
        stream: &mut Stream,
        facts: &mut Option<RequestFacts>,
        headers: &mut http::HeaderMap,
        answer: CalloutAnswer,
    ) -> Result<Verdict, PluginError> {
        let mut copy = headers.clone();
        let mut seen = facts.clone();
        let result = stream.with_inner(|s| self.inner.on_callout(s, &mut seen, &mut copy, answer));
        Ok(self.request_verdict(stream, result, headers))
    }

    fn on_response(
        &self,
        stream: &mut Stream,
        lent: ResponseLent<'_>,
    ) -> Result<ResponseVerdict, PluginError> {
        if !self.runs(stream) {
            return Ok(ResponseVerdict::Continue);
        }
        let mut copies = Copies::of(&lent);
        let copy = copies.lend(&lent);
        let result = stream.with_inner(|s| self.inner.on_response(s, copy));
        Ok(match result {
            Ok(ResponseVerdict::Continue) => ResponseVerdict::Continue,
            Ok(ResponseVerdict::Noted(n)) => ResponseVerdict::Noted(n),
            Ok(ResponseVerdict::Respond(answer)) => {
                ResponseVerdict::Noted(self.would_answer(&answer))
            }
            // Held for the body only when it is known to fit: over the
            // plugin's bound, the response would fail (500).
            Ok(ResponseVerdict::ReadBody(max)) if response_fits(lent.headers, max) => {
                ResponseVerdict::ReadBody(max)
            }
            Ok(ResponseVerdict::ReadBody(_)) => {
                self.skip(stream);
                ResponseVerdict::Continue
            }
            Err(e) => ResponseVerdict::Noted(self.failed(&e)),
        })
    }

    fn on_request_body(
        &self,
        stream: &mut Stream,
        lent: RequestLent<'_>,
        body: &Bytes,
    ) -> Result<BodyVerdict, PluginError> {
        if !self.runs(stream) {
            return Ok(BodyVerdict::Continue(None));
        }
        let mut headers = lent.headers.clone();
        let mut seen = lent.facts.clone();
        let copy = RequestLent {
            facts: &mut seen,
            headers: &mut headers,
            end_of_stream: lent.end_of_stream,
        };
        let result = stream.with_inner(|s| self.inner.on_request_body(s, copy, body));
        Ok(self.body_verdict(result))
    }

    fn on_response_body(
        &self,
        stream: &mut Stream,
        lent: ResponseLent<'_>,
        body: &Bytes,
    ) -> Result<BodyVerdict, PluginError> {
        if !self.runs(stream) {
            return Ok(BodyVerdict::Continue(None));
        }
        let mut copies = Copies::of(&lent);
        let copy = copies.lend(&lent);
        let result = stream.with_inner(|s| self.inner.on_response_body(s, copy, body));
        Ok(self.body_verdict(result))
    }

    fn on_request_trailers(
        &self,
        stream: &mut Stream,
        lent: RequestLent<'_>,
        trailers: &mut http::HeaderMap,
    ) -> Result<Option<LocalAnswer>, PluginError> {
        if !self.runs(stream) {
            return Ok(None);
        }
        let (mut headers, mut copy) = (lent.headers.clone(), trailers.clone());
        let mut seen = lent.facts.clone();
        let lent = RequestLent {
            facts: &mut seen,
            headers: &mut headers,
            end_of_stream: lent.end_of_stream,
        };
        let result = stream.with_inner(|s| self.inner.on_request_trailers(s, lent, &mut copy));
        self.trailers_outcome(result);
        Ok(None)
    }

    fn on_response_trailers(
        &self,
        stream: &mut Stream,
        lent: ResponseLent<'_>,
        trailers: &mut http::HeaderMap,
    ) -> Result<Option<LocalAnswer>, PluginError> {
        if !self.runs(stream) {
            return Ok(None);
        }
        let (mut copies, mut copy) = (Copies::of(&lent), trailers.clone());
        let lent = copies.lend(&lent);
        let result = stream.with_inner(|s| self.inner.on_response_trailers(s, lent, &mut copy));
        self.trailers_outcome(result);
        Ok(None)
    }

    fn set_callouts(&self, callouts: Arc<dyn Callouts>) {
        self.inner.set_callouts(callouts);
    }

    fn warm(&self, shards: std::ops::Range<usize>) -> Result<(), PluginError> {
        self.inner.warm(shards)
    }

    fn ready(&self) -> usize {
        self.inner.ready()
    }

    fn end(&self, stream: Stream) {
        let own = stream.inner();
        if own != Stream::NONE {
            self.inner.end(own);
        }
    }

    fn shadow(&self) -> Option<ShadowReport> {
        Some(self.report())
    }
}
