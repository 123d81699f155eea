//! What a call into a filter is lent of its request: the call's box is
//! swapped into the VM's store for the call, and back after; the
//! request's facts and heads are lent to it by reference.

use bytes::Bytes;
use http::HeaderMap;

use crate::RequestFacts;
use crate::seam::LocalAnswer;

/// What a call is lent, swapped into the store for it and back after.
#[derive(Default)]
pub(super) struct Call {
    /// The request's facts and heads, where the request keeps them.
    lent: Lent,
    /// Where a head the call was not lent is edited (and dropped): a
    /// filter's edit of the response head in a request call succeeds and
    /// changes nothing, as before heads were lent by address.
    scratch: HeaderMap,
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
        self.lent = Lent::default();
        if !self.scratch.is_empty() {
            self.scratch.clear();
        }
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

/// The request's facts and heads lent to one call by address, not moved
/// into it: moving them in and back (a `RequestFacts` is ~250 bytes, a
/// header map ~100) and dropping the empty values left behind cost ~250
/// instructions a call, ~1,000 a request of a header-only filter
/// (bench/instructions.sh, `/pw`).
///
/// Sound because the addresses are only read through [`Call`]'s
/// accessors, by host calls, which run only inside the export call that
/// [`Call::lend`]'s caller makes while it holds the `&mut` borrows the
/// addresses came from; the caller clears them ([`Call::clear`] or
/// [`Call::unlend`]) before those borrows end. A call left in the store
/// by a panic keeps stale addresses, but is never current again: every
/// export call swaps in a call of its own, lent afresh or blank.
pub(super) struct Lent {
    facts: *mut Option<RequestFacts>,
    request_headers: *mut HeaderMap,
    response_headers: *mut HeaderMap,
}

impl Default for Lent {
    fn default() -> Lent {
        Lent {
            facts: std::ptr::null_mut(),
            request_headers: std::ptr::null_mut(),
            response_headers: std::ptr::null_mut(),
        }
    }
}

// SAFETY: the addresses are set and read on the thread making the call
// (see `Lent`); between calls they are null or never read.
unsafe impl Send for Lent {}

/// Where host calls read a head the call was not lent: empty.
static NO_HEADERS: std::sync::LazyLock<HeaderMap> = std::sync::LazyLock::new(HeaderMap::new);

impl Call {
    /// Lends the call the request's facts and head, and the response's
    /// head in a response call, for the export call about to be made;
    /// [`Self::unlend`] before the borrows end.
    pub(super) fn lend(
        &mut self,
        facts: &mut Option<RequestFacts>,
        request_headers: &mut HeaderMap,
        response_headers: Option<&mut HeaderMap>,
    ) {
        self.lent = Lent {
            facts,
            request_headers,
            response_headers: response_headers
                .map_or(std::ptr::null_mut(), |h| h as *mut HeaderMap),
        };
    }

    /// Ends what [`Self::lend`] lent.
    pub(super) fn unlend(&mut self) {
        self.lent = Lent::default();
    }

    /// The request's facts, when lent.
    pub(super) fn facts(&self) -> Option<&RequestFacts> {
        // SAFETY: null or valid for the call (see `Lent`).
        unsafe { self.lent.facts.as_ref()?.as_ref() }
    }

    /// The request's head (empty when not lent).
    pub(super) fn request_headers(&self) -> &HeaderMap {
        // SAFETY: null or valid for the call (see `Lent`).
        unsafe { self.lent.request_headers.as_ref() }.unwrap_or(&NO_HEADERS)
    }

    /// The response's head (empty when not lent).
    pub(super) fn response_headers(&self) -> &HeaderMap {
        // SAFETY: null or valid for the call (see `Lent`).
        unsafe { self.lent.response_headers.as_ref() }.unwrap_or(&NO_HEADERS)
    }

    /// The request's head to edit (the scratch map when not lent);
    /// borrowed from the call, so no two can be held at once.
    pub(super) fn request_headers_mut(&mut self) -> &mut HeaderMap {
        // SAFETY: null or valid and not otherwise borrowed for the call
        // (see `Lent`); `&mut self` keeps this borrow unique.
        unsafe { self.lent.request_headers.as_mut() }.unwrap_or(&mut self.scratch)
    }

    /// The response's head to edit, likewise.
    pub(super) fn response_headers_mut(&mut self) -> &mut HeaderMap {
        // SAFETY: as for `request_headers_mut`.
        unsafe { self.lent.response_headers.as_mut() }.unwrap_or(&mut self.scratch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call sees the request's own head while lent it, edits land
    /// there, and once unlent it sees (and edits) nothing of it.
    #[test]
    fn a_lent_head_is_the_requests_own_and_only_while_lent() {
        let mut facts = None;
        let mut request = HeaderMap::new();
        request.insert("x-a", "1".parse().unwrap());
        let mut call = Call::default();
        call.lend(&mut facts, &mut request, None);
        assert_eq!(call.request_headers().get("x-a").unwrap(), "1");
        call.request_headers_mut()
            .insert("x-b", "2".parse().unwrap());
        // Not lent a response head: edits go to the scratch map.
        call.response_headers_mut()
            .insert("x-c", "3".parse().unwrap());
        assert!(call.facts().is_none());
        call.unlend();
        assert!(call.request_headers().is_empty());
        call.request_headers_mut()
            .insert("x-d", "4".parse().unwrap());
        call.clear();
        assert!(call.response_headers_mut().is_empty());
        assert_eq!(request.get("x-b").unwrap(), "2");
        assert!(request.get("x-c").is_none() && request.get("x-d").is_none());
    }
}
