//! Why forwarding failed, and the status and words a client gets for it.

use super::*;

/// Why a request could not be forwarded; each maps to one status code.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ForwardError {
    /// TCP or TLS connection to the upstream failed (refused, DNS, handshake).
    #[error("upstream unreachable: {0}")]
    Unreachable(String),
    /// Connecting took longer than the connect timeout.
    #[error("upstream connect timeout")]
    ConnectTimeout,
    /// The response head did not arrive within the request timeout.
    #[error("upstream timeout after {0:?}")]
    Timeout(Duration),
    /// The connection failed after the request was sent.
    #[error("upstream failed: {0}")]
    Failed(String),
    /// A path parameter cannot be used to build the upstream URL.
    #[error("{0}")]
    BadTarget(String),
    /// The client's request body could not be read (it went away, or sent
    /// something broken).
    #[error("reading the request body: {0}")]
    RequestBody(String),
    /// The client took longer than the request timeout to send its body.
    #[error("request body not received within {0:?}")]
    RequestBodyTimeout(Duration),
    /// The client went away while the upstream was working.
    #[error("client closed the connection")]
    ClientGone,
    /// The client's streamed body went over the route's
    /// `max_request_body`; the upstream got the start of it and a cut.
    #[error("request body larger than the route's max_request_body")]
    BodyTooLarge,
    /// The upstream already has its `max_requests` in flight.
    #[error("upstream has its max_requests ({0}) in flight")]
    Overloaded(usize),
}

impl ForwardError {
    /// The status the client gets.
    pub fn status(&self) -> StatusCode {
        match self {
            ForwardError::Unreachable(_) | ForwardError::Failed(_) => StatusCode::BAD_GATEWAY,
            ForwardError::ConnectTimeout | ForwardError::Timeout(_) => StatusCode::GATEWAY_TIMEOUT,
            ForwardError::BadTarget(_) | ForwardError::RequestBody(_) => StatusCode::BAD_REQUEST,
            ForwardError::RequestBodyTimeout(_) => StatusCode::REQUEST_TIMEOUT,
            ForwardError::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ForwardError::Overloaded(_) => StatusCode::SERVICE_UNAVAILABLE,
            // nginx's "client closed request": never sent, but logged and
            // counted.
            ForwardError::ClientGone => {
                StatusCode::from_u16(portcullis_obs::metrics::CLIENT_CLOSED_REQUEST)
                    .unwrap_or(StatusCode::BAD_REQUEST)
            }
        }
    }

    /// The upstream's failure, as its metrics count it; `None` when the
    /// upstream is not to blame (the client's body, a bad path parameter,
    /// a client that left).
    pub fn upstream_error(&self) -> Option<portcullis_obs::metrics::UpstreamError> {
        use portcullis_obs::metrics::UpstreamError as E;
        match self {
            ForwardError::Unreachable(_) => Some(E::Connect),
            ForwardError::ConnectTimeout => Some(E::ConnectTimeout),
            ForwardError::Timeout(_) => Some(E::Timeout),
            ForwardError::Failed(_) => Some(E::Failed),
            ForwardError::Overloaded(_) => Some(E::Overloaded),
            ForwardError::BadTarget(_)
            | ForwardError::RequestBody(_)
            | ForwardError::RequestBodyTimeout(_)
            | ForwardError::ClientGone
            | ForwardError::BodyTooLarge => None,
        }
    }

    /// The short text put in the JSON error body.
    pub fn public_message(&self) -> &'static str {
        match self {
            ForwardError::Unreachable(_) => "upstream unreachable",
            ForwardError::ConnectTimeout => "upstream connect timeout",
            ForwardError::Timeout(_) => "upstream timeout",
            ForwardError::Failed(_) => "upstream connection failed",
            ForwardError::BadTarget(_) => "invalid path parameter",
            ForwardError::RequestBody(_) => "request body could not be read",
            ForwardError::RequestBodyTimeout(_) => "request body timeout",
            ForwardError::ClientGone => "client closed request",
            ForwardError::BodyTooLarge => "request body too large",
            ForwardError::Overloaded(_) => "upstream overloaded",
        }
    }
}

/// An error and its sources on one line: hyper's own message alone
/// ("connection error") does not say what happened.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(inner) = src {
        s.push_str(": ");
        s.push_str(&inner.to_string());
        src = inner.source();
    }
    s
}
