//! The OpenTelemetry collector as an upstream: span batches are posted
//! through the proxy's own forwarding, so the collector gets the
//! upstreams' TLS, DNS and timeouts.

use std::future::Future;
use std::pin::Pin;

use http::header::{self, HeaderMap, HeaderValue};
use http::uri::PathAndQuery;
use http::{Method, StatusCode};

use crate::{Body, Outgoing, UpstreamPool};
use portcullis_obs::otlp::Collector;

impl Collector for UpstreamPool {
    fn post(
        &self,
        path: PathAndQuery,
        body: String,
    ) -> Pin<Box<dyn Future<Output = Result<StatusCode, String>> + Send + '_>> {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        let out = Outgoing {
            forwarded: Default::default(),
            method: Method::POST,
            path,
            headers,
            body: Body::full(body),
            affinity: None,
            own_host: false,
            upgrade: false,
        };
        Box::pin(self.side_request(out))
    }

    fn name(&self) -> &str {
        &self.spec.name
    }
}
