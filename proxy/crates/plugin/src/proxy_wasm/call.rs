//! What a call into a filter is lent of its request: the call's box is
//! swapped into the VM's store for the call, and back after; the
//! request's facts and heads are lent to it by reference.

use bytes::Bytes;
use http::HeaderMap;

use crate::RequestFacts;
use crate::seam::Forwarded;
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
    /// In a response call, the forwarding fields not yet in the request's
    /// map: added on the call's first read of it.
    request_later: *mut Forwarded,
    response_headers: *mut HeaderMap,
}

impl Default for Lent {
    fn default() -> Lent {
        Lent {
            facts: std::ptr::null_mut(),
            request_headers: std::ptr::null_mut(),
            request_later: std::ptr::null_mut(),
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
            request_later: std::ptr::null_mut(),
            response_headers: response_headers
                .map_or(std::ptr::null_mut(), |h| h as *mut HeaderMap),
        };
    }

    /// Lends, with the request's head [`Self::lend`] lent, the forwarding
    /// fields not yet in it (a response call's).
    pub(super) fn lend_later(&mut self, later: &mut Forwarded) {
        self.lent.request_later = later;
    }

    /// Adds the forwarding fields still apart to the request's map, once:
    /// before the first reference into the map is handed out.
    fn complete_request(&self) {
        // SAFETY: null or valid for the call, lent with the map (see
        // `Lent`). Fields are added only while some remain, which is
        // before this call's first read of the map: no reference into
        // the map is alive while it is changed here.
        unsafe {
            if let Some(later) = self.lent.request_later.as_mut()
                && !later.is_empty()
                && let Some(map) = self.lent.request_headers.as_mut()
            {
                later.add_to(map);
            }
        }
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
        self.complete_request();
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
        self.complete_request();
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

    /// The forwarding fields lent apart reach the request's map on the
    /// call's first read of it, once; a call that never reads the map
    /// leaves them apart.
    #[test]
    fn the_proxys_fields_join_the_request_on_its_first_read() {
        use portcullis_net::forwarded_fields::Fields;
        let fields = || {
            Forwarded::new(Fields {
                for_: Some("10.0.0.1".parse().unwrap()),
                proto: Some("http"),
                ..Fields::default()
            })
        };
        let (mut facts, mut request) = (None, HeaderMap::new());
        request.insert("x-a", "1".parse().unwrap());
        let mut later = fields();
        let mut call = Call::default();
        call.lend(&mut facts, &mut request, None);
        call.lend_later(&mut later);
        assert!(call.response_headers().is_empty());
        call.unlend();
        assert!(!later.is_empty(), "not read: still apart");
        assert_eq!(request.len(), 1);

        call.lend(&mut facts, &mut request, None);
        call.lend_later(&mut later);
        assert_eq!(
            call.request_headers().get("x-forwarded-proto").unwrap(),
            "http"
        );
        call.request_headers_mut().remove("x-forwarded-for");
        assert!(
            call.request_headers().get("x-forwarded-for").is_none(),
            "added once"
        );
        call.unlend();
        assert!(later.is_empty());
        let names: Vec<&str> = request.keys().map(|k| k.as_str()).collect();
        assert_eq!(names, ["x-a", "x-forwarded-proto"]);

        // Written to first: added before the edit.
        let mut request = HeaderMap::new();
        let mut later = fields();
        call.lend(&mut facts, &mut request, None);
        call.lend_later(&mut later);
        call.request_headers_mut()
            .insert("x-forwarded-proto", "https".parse().unwrap());
        call.unlend();
        assert_eq!(request["x-forwarded-proto"], "https");
        assert_eq!(request["x-forwarded-for"], "10.0.0.1");
    }
}
