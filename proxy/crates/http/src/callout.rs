//! A plugin's callout sent to an upstream of the policies through its
//! pool (balancing, TLS, retries and metrics as for forwarded requests),
//! and its answer read whole for the plugin.

use std::time::Instant;

use http::header::{self, HeaderValue};
use http::uri::PathAndQuery;
use http_body_util::BodyExt;
use portcullis_plugin::seam::{Callout, CalloutAnswer, MAX_CALLOUT_BODY};

use crate::body::Body;
use crate::forward::{Outgoing, UpstreamPool};

/// Sends `c` through `pool` and reads the answer within its timeout.
pub async fn send(pool: &UpstreamPool, c: Callout) -> CalloutAnswer {
    let Ok(path) = PathAndQuery::try_from(c.path.as_str()) else {
        let why = format!("`{}` is not a request path", c.path);
        return CalloutAnswer::Failed {
            timed_out: false,
            why,
        };
    };
    // gRPC is HTTP/2 only: over an HTTP/1.1 upstream the call would
    // reach a server that cannot answer it, and fail obscurely.
    let grpc = c
        .headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|t| t.as_bytes().starts_with(b"application/grpc"));
    if grpc && !pool.spec.http2 {
        let why = format!(
            "upstream `{}` speaks HTTP/1.1; a gRPC call needs `http2: true` on it",
            pool.spec.name
        );
        return CalloutAnswer::Failed {
            timed_out: false,
            why,
        };
    }
    let mut headers = c.headers;
    if let Some(authority) = c.authority.and_then(|a| HeaderValue::from_str(&a).ok()) {
        headers.insert(header::HOST, authority);
    }
    if !c.body.is_empty() {
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from(c.body.len()));
    }
    let out = Outgoing {
        method: c.method,
        path,
        headers,
        body: Body::full(c.body),
        affinity: None,
        own_host: true,
    };
    let params = matchit::Params::new();
    let asked = Instant::now();
    let whole = async {
        let (resp, held) = pool
            .send(out, &params, c.timeout, None)
            .await
            .map_err(|e| {
                let why = e.upstream_error();
                if let Some(why) = why {
                    pool.stats.failed(why);
                }
                // The pool's own response timeout is the callout's.
                let timed_out = why == Some(portcullis_obs::metrics::UpstreamError::Timeout);
                (timed_out, e.to_string())
            })?;
        pool.stats.record(resp.status().as_u16(), asked.elapsed());
        let (parts, body) = resp.into_parts();
        let whole = http_body_util::Limited::new(body, MAX_CALLOUT_BODY)
            .collect()
            .await
            .map_err(|e| (false, format!("reading the answer: {e}")))?;
        let trailers = whole.trailers().cloned().map(Box::new);
        let body = whole.to_bytes();
        drop(held);
        Ok::<_, (bool, String)>(CalloutAnswer::Answered {
            status: parts.status.as_u16(),
            headers: parts.headers,
            body,
            trailers,
        })
    };
    match tokio::time::timeout(c.timeout, whole).await {
        Ok(Ok(answer)) => answer,
        Ok(Err((timed_out, why))) => CalloutAnswer::Failed { timed_out, why },
        Err(_) => {
            pool.stats
                .failed(portcullis_obs::metrics::UpstreamError::Timeout);
            CalloutAnswer::Failed {
                timed_out: true,
                why: format!("no answer within {:?}", c.timeout),
            }
        }
    }
}

/// The routing core's pools as a plugin's way out for callouts made
/// outside requests ([`portcullis_plugin::Callouts`]): a configuration's
/// upstreams by name, per worker.
pub struct PoolCallouts {
    pub config: std::sync::Arc<portcullis_config::Config>,
    /// `upstreams[worker][upstream]`, as the pipeline holds them.
    pub upstreams: Vec<Vec<std::sync::Arc<UpstreamPool>>>,
}

impl portcullis_plugin::Callouts for PoolCallouts {
    fn send(
        &self,
        shard: usize,
        callout: Callout,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = CalloutAnswer> + Send>> {
        let pool = self
            .config
            .upstream_index(&callout.upstream)
            .map(|i| self.upstreams[shard % self.upstreams.len()][i].clone());
        Box::pin(async move {
            match pool {
                Some(pool) => send(&pool, callout).await,
                None => CalloutAnswer::Failed {
                    timed_out: false,
                    why: format!("no upstream `{}` in the policies", callout.upstream),
                },
            }
        })
    }
}
