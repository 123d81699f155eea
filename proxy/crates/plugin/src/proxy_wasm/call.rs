//! What a call into a filter is lent of its request: moved into the
//! VM's store for the call, and back after.

use bytes::Bytes;

use crate::RequestFacts;
use crate::seam::LocalAnswer;

/// What a call is lent, swapped into the store for it and back after.
#[derive(Default)]
pub(super) struct Call {
    pub(super) facts: Option<RequestFacts>,
    pub(super) request_headers: http::HeaderMap,
    pub(super) response_headers: http::HeaderMap,
    /// The response's status, in a response call.
    pub(super) status: Option<u16>,
    /// The answer the filter sent (`proxy_send_local_response`).
    pub(super) local: Option<LocalAnswer>,
    /// The `:path` the filter set.
    pub(super) path: Option<String>,
    /// Callouts the filter made in this call (`proxy_http_call`), by
    /// token.
    pub(super) callouts: Vec<(u32, crate::seam::Callout)>,
    /// Whether it resumed the request (`proxy_continue_stream`).
    pub(super) resumed: bool,
    /// The callout answer being delivered: its headers (`:status` among
    /// them) and body.
    pub(super) answer: Option<(Pairs, Bytes)>,
    /// The outcome of a gRPC call being delivered.
    pub(super) grpc: Option<super::grpc::Outcome>,
    /// The request or response body, in a body call; and whether the
    /// filter changed it.
    pub(super) request_body: Option<Bytes>,
    pub(super) response_body: Option<Bytes>,
    pub(super) body_changed: bool,
    /// The request's or response's trailers, in a trailers call (boxed:
    /// rare).
    pub(super) trailers: Option<Box<http::HeaderMap>>,
    /// Whether the response head has gone (a body or trailers call on a
    /// streamed body): the filter's calls on it fail, as Envoy's do once
    /// it has let the head go.
    pub(super) head_sent: bool,
}

impl Call {
    /// Empties it for the next call, field by field (writing a whole
    /// `Call::default()` over it moves ~800 bytes); the callouts keep
    /// their capacity.
    pub(super) fn clear(&mut self) {
        self.facts = None;
        self.request_headers.clear();
        self.response_headers.clear();
        self.status = None;
        self.local = None;
        self.path = None;
        self.callouts.clear();
        self.resumed = false;
        self.answer = None;
        self.grpc = None;
        self.request_body = None;
        self.response_body = None;
        self.body_changed = false;
        self.trailers = None;
        self.head_sent = false;
    }
}

/// Header fields as the ABI hands them over: name and value bytes.
pub(super) type Pairs = Vec<(Vec<u8>, Vec<u8>)>;
