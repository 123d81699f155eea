//! The one interface a kind of plugin implements, and all the phase
//! driver (`portcullis-http`'s `chain/`) sees of a plugin: the driver
//! runs every kind the same way and never names a kind's own types.
//!
//! Kinds: WebAssembly components against `wit/policy.wit` (`component.rs`,
//! over the instances of `binding.rs`), and Envoy's proxy-wasm filters
//! (`proxy_wasm/`). A new kind is a type implementing [`Plugin`] and a
//! branch in `chains::compile` that tells its files apart; nothing in the
//! driver changes.
//!
//! A call is lent the request (its facts and headers, moved in and back,
//! never copied) and edits the header maps in place; what is not a header
//! edit comes back as a verdict.

use std::sync::Arc;

use bytes::Bytes;
use portcullis_config::FailMode;
pub use portcullis_net::forwarded_fields::Forwarded;

use crate::{PluginError, RequestFacts};

/// Which calls a plugin wants; the driver skips the others (a plugin
/// with no response hook costs the response nothing).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Hooks {
    /// [`Plugin::on_request`].
    pub request: bool,
    /// [`Plugin::on_response`].
    pub response: bool,
    /// Whether its response hook also sees the answers plugins make
    /// (its own, and those of plugins after it), as Envoy passes a local
    /// reply through the filters the request went through.
    pub local_answers: bool,
    /// [`Plugin::on_response_body`] for each piece of every response
    /// body as it streams, as Envoy calls a filter's body callback; a
    /// plugin that wants a body whole asks from its head hook instead
    /// ([`ResponseVerdict::ReadBody`]); and [`Plugin::on_response_trailers`]
    /// for its trailers.
    pub response_body: bool,
    /// [`Plugin::on_request_body`] for each piece of a request body it has
    /// not been given whole, as it streams to the upstream, and
    /// [`Plugin::on_request_trailers`] for its trailers.
    pub request_body: bool,
}

/// What a request-side call decided; header edits are made already.
/// The verdicts that are rare on the way of a request (an answer, a
/// callout) are boxed: a verdict goes back through several closures and
/// matches, and at 248 bytes (a `Callout` inline) its copies cost ~10% of
/// a header-only proxy-wasm filter's added instructions.
#[derive(Debug)]
pub enum Verdict {
    /// Go on to the next plugin, then the upstream.
    Continue(Steer),
    /// Answer the request with this; it goes no further.
    Respond(Box<LocalAnswer>),
    /// Call again with the request body, read up to this many bytes
    /// (more: 413). The body the plugin then sees is what is forwarded.
    ReadBody(u32),
    /// Send this request to an upstream of the policies and give the
    /// plugin its answer ([`Plugin::on_callout`]) before it decides.
    Callout(Box<Callout>),
    /// Go on as if the plugin had not been there, and note this in the
    /// request's access line (a use in shadow mode that would have
    /// answered, or failed).
    Noted(Box<Noted>),
}

/// What a use in shadow mode would have done to a request, for its
/// access line: `plugin:what`, `what` the status of the answer it would
/// have made (444: a reset), or `failed`, `timed_out`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Noted {
    pub plugin: Arc<str>,
    pub what: String,
}

/// A request a plugin makes to an upstream of the policies while it
/// decides (token introspection, an external authorizer).
#[derive(Debug)]
pub struct Callout {
    /// The upstream, by its name in the policies (an unknown one fails
    /// the callout).
    pub upstream: String,
    /// Method, path (with query) and `Host`.
    pub method: http::Method,
    pub path: String,
    pub authority: Option<String>,
    /// Its other headers.
    pub headers: http::HeaderMap,
    pub body: Bytes,
    /// How long the whole answer may take.
    pub timeout: std::time::Duration,
    /// Not an HTTP request but a Redis command (`body`, RESP-encoded) for
    /// the state store (Higress's `proxy_redis_call`): answered 200 with
    /// Redis's reply (RESP) as the body.
    pub redis: bool,
}

/// What came of a [`Callout`].
#[derive(Debug)]
pub enum CalloutAnswer {
    /// The upstream's answer, its body read whole (up to
    /// [`MAX_CALLOUT_BODY`]).
    Answered {
        status: u16,
        headers: http::HeaderMap,
        body: Bytes,
        /// Its trailers (a gRPC answer's `grpc-status`), if it had any
        /// (boxed: rare, and a map is large).
        trailers: Option<Box<http::HeaderMap>>,
    },
    /// No answer: unreachable, too large, an unknown upstream; or, with
    /// `timed_out`, none within the callout's timeout.
    Failed {
        /// Whether the timeout ran out.
        timed_out: bool,
        /// What happened, for the log.
        why: String,
    },
}

/// Sends callouts a plugin makes outside any request (a proxy-wasm
/// filter's root context, from a tick, say), through the upstreams of
/// the configuration the plugin serves; given to each plugin when its
/// pipeline is made ([`Plugin::set_callouts`]).
pub trait Callouts: Send + Sync {
    /// Sends `callout` through the pools of worker `shard`.
    fn send(
        &self,
        shard: usize,
        callout: Callout,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = CalloutAnswer> + Send>>;

    /// Opens `callout` as a stream (a gRPC stream): its body is what
    /// arrives on `body` until that closes, and what comes back is told
    /// on `events` as it comes, ending with [`StreamEvent::End`] or
    /// [`StreamEvent::Failed`]; `events` is bounded, and what the plugin
    /// has not taken holds the answer back. The future drives it;
    /// dropping it ends it.
    /// `callout.timeout` bounds the wait for the answer's head only.
    fn stream(
        &self,
        _shard: usize,
        callout: Callout,
        _body: crate::stream_body::StreamBody,
        events: tokio::sync::mpsc::Sender<StreamEvent>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        let why = format!("no streams to upstream `{}` here", callout.upstream);
        let _ = events.try_send(StreamEvent::Failed {
            timed_out: false,
            why,
        });
        Box::pin(std::future::ready(()))
    }
}

/// What comes back on a [`Callouts::stream`], in order: a head, data,
/// perhaps trailers, then its end (or a failure at any point).
#[derive(Debug)]
pub enum StreamEvent {
    Head {
        status: u16,
        headers: http::HeaderMap,
    },
    Data(Bytes),
    Trailers(http::HeaderMap),
    /// The answer ended (after its trailers, if it had any).
    End,
    /// No answer, or the stream broke: unreachable, reset, or with
    /// `timed_out`, no head within the callout's timeout.
    Failed {
        timed_out: bool,
        why: String,
    },
}

/// The largest callout answer body read; a larger one fails the callout.
pub const MAX_CALLOUT_BODY: usize = 1 << 20;

/// The longest a callout may take, whatever its plugin asks (a longer
/// timeout is cut to this): a request waiting on one is bounded by its
/// route's timeout too, and a background call holds its upstream socket
/// no longer than this.
pub const MAX_CALLOUT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Where the request goes, when a plugin changed it.
#[derive(Debug, Default)]
pub struct Steer {
    /// A new path (with `?query` perhaps); it replaces the route's rewrite.
    pub path: Option<String>,
    /// Another upstream of the policies, by name.
    pub upstream: Option<String>,
    /// A new request body, from a call given the body: later plugins
    /// and the upstream get it instead.
    pub body: Option<Bytes>,
}

/// What a response head call decided; header edits are made already.
#[derive(Debug)]
pub enum ResponseVerdict {
    /// Send the upstream's response on (as edited).
    Continue,
    /// Send this instead.
    Respond(Box<LocalAnswer>),
    /// Hold the head until the body is read whole, up to this many bytes
    /// (more: 500), then call [`Plugin::on_response_body`] with all of it.
    ReadBody(u32),
    /// Send it on unchanged, noting this ([`Verdict::Noted`]).
    Noted(Box<Noted>),
}

/// What a response body call decided.
#[derive(Debug)]
pub enum BodyVerdict {
    /// Send on what it was given, or this in its place.
    Continue(Option<Bytes>),
    /// Keep what it was given and call again with it and the next piece
    /// (Envoy's `StopIterationAndBuffer`); at the end of the body, the
    /// same as `Continue(None)`.
    Pause,
    /// Send this answer instead; once the head has gone, the response is
    /// cut off instead (as Envoy resets the stream).
    Respond(Box<LocalAnswer>),
    /// Send on what it was given, noting this ([`Verdict::Noted`]).
    Noted(Box<Noted>),
}

/// What [`Plugin::on_response_whole`] decided.
#[derive(Debug)]
pub struct WholeVerdicts {
    /// The head call's.
    pub head: Result<ResponseVerdict, PluginError>,
    /// The body call's, made only when the head call let the head go on
    /// ([`ResponseVerdict::Continue`]).
    pub body: Option<Result<BodyVerdict, PluginError>>,
}

/// What a request body call is lent: the request as forwarded.
pub struct RequestLent<'a> {
    pub facts: &'a mut Option<RequestFacts>,
    pub headers: &'a mut http::HeaderMap,
    /// Whether this is the body's last piece.
    pub end_of_stream: bool,
}

/// The largest response body buffered for a plugin that pauses on it
/// (Envoy's default buffer limit); more fails the response.
pub const MAX_BUFFERED_BODY: u32 = 1 << 20;

/// What a response call is lent: the request as forwarded, and the
/// response head (edited in place by a head call, and by a body call
/// while the head is held for the body).
pub struct ResponseLent<'a> {
    pub facts: &'a mut Option<RequestFacts>,
    /// The request's head as forwarded, but for the forwarding fields in
    /// `request_later`: a reader adds them first
    /// ([`Forwarded::add_to`]), which completes it.
    pub request_headers: &'a mut http::HeaderMap,
    /// The proxy's `X-Forwarded-*` fields not yet in `request_headers`:
    /// added on the first read, so a call that never reads the request
    /// costs nothing for them.
    pub request_later: &'a mut Forwarded,
    pub status: u16,
    pub headers: &'a mut http::HeaderMap,
    /// Whether the response has no body (in a head call), or this is its
    /// last piece (in a body call).
    pub end_of_stream: bool,
    /// Whether the head has gone (a body or trailers call on a body that
    /// streams): `headers` is then empty, and a proxy-wasm filter's calls
    /// on the head fail as in Envoy, which lets go of a head once the
    /// filter lets it go on.
    pub head_sent: bool,
}

/// An answer a plugin made itself.
#[derive(Debug)]
pub struct LocalAnswer {
    /// Its status (an invalid one is answered 500).
    pub status: u16,
    /// Its headers.
    pub headers: http::HeaderMap,
    /// Its body.
    pub body: Bytes,
    /// Whether an error answer with no body (or the component SDK's
    /// `{"error": ...}` alone) takes the shape of the proxy's own errors;
    /// otherwise it goes exactly as made (a proxy-wasm filter's, as in
    /// Envoy).
    pub error_shape: bool,
    /// How it reaches a gRPC client.
    pub grpc: GrpcReply,
    /// No answer: the stream is reset instead (a proxy-wasm filter's
    /// `proxy_close_stream`, as Envoy resets it): an HTTP/1.1 connection
    /// closes with nothing sent, an HTTP/2 or HTTP/3 stream is reset; one
    /// whose answer has begun is cut off. Logged as 444, nginx's status
    /// for a connection closed with no answer.
    pub reset: bool,
}

/// How a plugin's answer reaches a gRPC client (a `POST` of
/// `application/grpc...`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrpcReply {
    /// As made: its status and body (a component's, whose error answers
    /// take the proxy's error shape, which gRPC clients get in gRPC's
    /// terms anyway).
    AsMade,
    /// In gRPC's terms, as Envoy sends a filter's local reply: HTTP 200,
    /// "trailers-only", `grpc-status` this code or, without one, the HTTP
    /// status's mapping, and the body as `grpc-message`.
    TrailersOnly(Option<u16>),
}

/// What a plugin keeps of one request between its calls (a proxy-wasm
/// filter's HTTP context), as an opaque number the driver holds for the
/// request and gives back to every call; [`Stream::NONE`] for kinds that
/// keep nothing, which never make the driver allocate for it. A kind
/// keeps its number below 2^61: the three top bits are for uses that
/// wrap a plugin (`shadow.rs`, `rollout.rs`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stream(pub u64);

impl Stream {
    /// Nothing kept.
    pub const NONE: Stream = Stream(0);
    /// The bits a wrapping use (`shadow.rs`, `rollout.rs`) may keep its
    /// own flags in; a kind keeps its number below them.
    pub const WRAPPER_BITS: u64 = 0b111 << 61;

    /// The wrapped plugin's own stream: the wrapper's flags off.
    pub fn inner(self) -> Stream {
        Stream(self.0 & !Self::WRAPPER_BITS)
    }

    /// Runs `f` on the wrapped plugin's own stream, keeping the wrapper's
    /// flags as they were around it.
    pub fn with_inner<T>(&mut self, f: impl FnOnce(&mut Stream) -> T) -> T {
        let flags = self.0 & Self::WRAPPER_BITS;
        let mut own = self.inner();
        let out = f(&mut own);
        debug_assert!(own == own.inner(), "a kind's stream uses bits 61-63");
        *self = Stream(own.0 | flags);
        out
    }
}

/// A plugin attached with one config (a "use" of it on a route or the
/// global chain), as the driver calls it.
pub trait Plugin: Send + Sync + std::fmt::Debug {
    /// The plugin's name, for logs, errors and metrics.
    fn name(&self) -> &Arc<str>;
    /// What a failed call does to its request.
    fn fail(&self) -> FailMode;
    /// Which calls it wants.
    fn hooks(&self) -> Hooks;
    /// The route the use is on (`None`: the global chain), the largest
    /// memory it has reached, and its cap, in bytes.
    fn memory_use(&self) -> (Option<&str>, usize, usize);
    /// The calls made to it since its configuration was loaded.
    fn calls(&self) -> u64;
    /// Whether a call may run on another thread than the request's (a
    /// large body's call then runs on a plugin thread, [`crate::offload`]);
    /// a kind whose state lives on its worker thread says no.
    fn runs_anywhere(&self) -> bool;

    /// The request head, and its body once the plugin asked for it
    /// ([`Verdict::ReadBody`]). `facts` and `headers` are lent for the
    /// call; `facts` is `None` only for a use that never reads them.
    fn on_request(
        &self,
        stream: &mut Stream,
        facts: &mut Option<RequestFacts>,
        headers: &mut http::HeaderMap,
        body: Option<&[u8]>,
    ) -> Result<Verdict, PluginError>;

    /// The upstream's response head (edited in place), with the request
    /// as forwarded.
    fn on_response(
        &self,
        stream: &mut Stream,
        lent: ResponseLent<'_>,
    ) -> Result<ResponseVerdict, PluginError>;

    /// A piece of the request body as it streams to the upstream, for a
    /// plugin whose [`Hooks::request_body`] is set and that was not given
    /// the body whole. Its head has gone: an answer (or a failure, closed)
    /// stops the upstream request and is the client's answer.
    fn on_request_body(
        &self,
        _stream: &mut Stream,
        _lent: RequestLent<'_>,
        _body: &bytes::Bytes,
    ) -> Result<BodyVerdict, PluginError> {
        Ok(BodyVerdict::Continue(None))
    }

    /// A piece of the response body (all of it, when the head call asked
    /// to read it whole), for a plugin whose [`Hooks::response_body`] is
    /// set or whose head call returned [`ResponseVerdict::ReadBody`].
    fn on_response_body(
        &self,
        _stream: &mut Stream,
        _lent: ResponseLent<'_>,
        _body: &bytes::Bytes,
    ) -> Result<BodyVerdict, PluginError> {
        Ok(BodyVerdict::Continue(None))
    }

    /// The response head, and then, when the head call lets it go on,
    /// the whole body that came with it (`body`, its only and last piece)
    /// with the head counted as gone: the two calls
    /// [`Self::on_response`] and [`Self::on_response_body`] make, for a
    /// plugin that is the only one to see the response, in one visit (a
    /// proxy-wasm VM is entered once for both). Nothing of the request
    /// comes after the body: a plugin may end what it keeps of it here,
    /// leaving `stream` as [`Stream::NONE`].
    fn on_response_whole(
        &self,
        stream: &mut Stream,
        lent: ResponseLent<'_>,
        body: &bytes::Bytes,
    ) -> WholeVerdicts {
        let ResponseLent {
            facts,
            request_headers,
            request_later,
            status,
            headers,
            ..
        } = lent;
        let head = self.on_response(
            stream,
            ResponseLent {
                facts: &mut *facts,
                request_headers: &mut *request_headers,
                request_later: &mut *request_later,
                status,
                headers,
                end_of_stream: false,
                head_sent: false,
            },
        );
        if !matches!(head, Ok(ResponseVerdict::Continue)) {
            return WholeVerdicts { head, body: None };
        }
        let mut gone = http::HeaderMap::new();
        let lent = ResponseLent {
            facts,
            request_headers,
            request_later,
            status,
            headers: &mut gone,
            end_of_stream: true,
            head_sent: true,
        };
        let body = self.on_response_body(stream, lent, body);
        WholeVerdicts {
            head,
            body: Some(body),
        }
    }

    /// The request's trailers, after the last piece of its body, for a
    /// plugin whose [`Hooks::request_body`] is set (edited in place). An
    /// answer (or a failure, closed) stops the upstream request as a body
    /// call's does.
    fn on_request_trailers(
        &self,
        _stream: &mut Stream,
        _lent: RequestLent<'_>,
        _trailers: &mut http::HeaderMap,
    ) -> Result<Option<LocalAnswer>, PluginError> {
        Ok(None)
    }

    /// The response's trailers, after the last piece of its body, for a
    /// plugin whose [`Hooks::response_body`] is set (edited in place). The
    /// head has gone: an answer cuts the response off.
    fn on_response_trailers(
        &self,
        _stream: &mut Stream,
        _lent: ResponseLent<'_>,
        _trailers: &mut http::HeaderMap,
    ) -> Result<Option<LocalAnswer>, PluginError> {
        Ok(None)
    }

    /// The answer to the [`Verdict::Callout`] the last request-side call
    /// returned; decides as `on_request` does.
    fn on_callout(
        &self,
        _stream: &mut Stream,
        _facts: &mut Option<RequestFacts>,
        _headers: &mut http::HeaderMap,
        _answer: CalloutAnswer,
    ) -> Result<Verdict, PluginError> {
        Err(PluginError::Trap {
            plugin: self.name().clone(),
            message: "answered a callout it never made".into(),
        })
    }

    /// Where to send the callouts it makes outside requests; kinds that
    /// make none ignore it.
    fn set_callouts(&self, _callouts: Arc<dyn Callouts>) {}

    /// Makes what the workers of thread slots `shards` will call (a
    /// filter's VMs, a component's first instances) now, before they
    /// serve, so no request waits for a start; blocking work (a start
    /// may take a second of CPU), for a blocking thread.
    fn warm(&self, _shards: std::ops::Range<usize>) -> Result<(), PluginError> {
        Ok(())
    }

    /// Instances (a filter's VMs, a component's idle instances) ready to
    /// take a call now.
    fn ready(&self) -> usize {
        0
    }

    /// The request is over (answered, failed or left): what `stream`
    /// holds is freed. Called once for each stream a call set, on the
    /// request's thread.
    fn end(&self, _stream: Stream) {}

    /// A use in shadow mode: what it ran on and would have done.
    fn shadow(&self) -> Option<crate::use_reports::ShadowReport> {
        None
    }

    /// A use rolled out to a candidate: where the rollout is.
    fn rollout(&self) -> Option<crate::use_reports::RolloutReport> {
        None
    }
}
