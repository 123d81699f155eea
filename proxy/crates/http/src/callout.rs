//! A plugin's callout sent to an upstream of the policies through its
//! pool (balancing, TLS, retries and metrics as for forwarded requests),
//! and its answer read whole for the plugin; or opened as a stream (a
//! gRPC stream), its messages going and coming as they are made.

use std::time::Instant;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::uri::PathAndQuery;
use http_body_util::BodyExt;
use portcullis_plugin::seam::{Callout, CalloutAnswer, MAX_CALLOUT_BODY, StreamEvent};
use tokio::sync::mpsc::Sender;

use portcullis_forward::Body;
use portcullis_forward::{Outgoing, UpstreamPool};

/// The request `c` is (its body `streamed`, if given); why not, when it
/// cannot be sent through `pool`.
fn outgoing(pool: &UpstreamPool, c: Callout, streamed: Option<Body>) -> Result<Outgoing, String> {
    let Ok(path) = PathAndQuery::try_from(c.path.as_str()) else {
        return Err(format!("`{}` is not a request path", c.path));
    };
    // gRPC is HTTP/2 only: over an HTTP/1.1 upstream the call would
    // reach a server that cannot answer it, and fail obscurely.
    let grpc = c
        .headers
        .get(header::CONTENT_TYPE)
        .is_some_and(|t| t.as_bytes().starts_with(b"application/grpc"));
    if grpc && !pool.spec.http2 {
        return Err(format!(
            "upstream `{}` speaks HTTP/1.1; a gRPC call needs `http2: true` on it",
            pool.spec.name
        ));
    }
    let mut headers = c.headers;
    if let Some(authority) = c.authority.and_then(|a| HeaderValue::from_str(&a).ok()) {
        headers.insert(header::HOST, authority);
    }
    let body = match streamed {
        Some(body) => body,
        None => {
            if !c.body.is_empty() {
                headers.insert(header::CONTENT_LENGTH, HeaderValue::from(c.body.len()));
            }
            Body::full(c.body)
        }
    };
    Ok(Outgoing {
        method: c.method,
        path,
        headers,
        forwarded: Default::default(),
        body,
        affinity: None,
        own_host: true,
        upgrade: false,
    })
}

/// Sends `c` through `pool` and reads the answer within its timeout.
pub async fn send(pool: &UpstreamPool, c: Callout) -> CalloutAnswer {
    let timeout = c.timeout;
    let out = match outgoing(pool, c, None) {
        Ok(out) => out,
        Err(why) => {
            return CalloutAnswer::Failed {
                timed_out: false,
                why,
            };
        }
    };
    let params = matchit::Params::new();
    let asked = Instant::now();
    let whole = async {
        let (resp, held) = pool
            .send(out, &params, timeout, None, None)
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
    match tokio::time::timeout(timeout, whole).await {
        Ok(Ok(answer)) => answer,
        Ok(Err((timed_out, why))) => CalloutAnswer::Failed { timed_out, why },
        Err(_) => {
            pool.stats
                .failed(portcullis_obs::metrics::UpstreamError::Timeout);
            CalloutAnswer::Failed {
                timed_out: true,
                why: format!("no answer within {timeout:?}"),
            }
        }
    }
}

/// Opens `c` through `pool` as a stream: its body is what arrives on
/// `body`, and the answer is told on `events` as it comes. `c.timeout`
/// bounds the wait for the answer's head; a stream then lasts as long
/// as both sides keep it open (as Envoy's gRPC streams: no timeout).
pub async fn stream(
    pool: &UpstreamPool,
    c: Callout,
    body: portcullis_plugin::stream_body::StreamBody,
    events: Sender<StreamEvent>,
) {
    let timeout = c.timeout;
    let failed = async |timed_out, why| {
        let _ = events.send(StreamEvent::Failed { timed_out, why }).await;
    };
    let out = match outgoing(pool, c, Some(Body::boxed(Sent(body)))) {
        Ok(out) => out,
        Err(why) => return failed(false, why).await,
    };
    let params = matchit::Params::new();
    let asked = Instant::now();
    let (resp, held) =
        match tokio::time::timeout(timeout, pool.send(out, &params, timeout, None, None)).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(e)) => {
                let why = e.upstream_error();
                if let Some(why) = why {
                    pool.stats.failed(why);
                }
                let timed_out = why == Some(portcullis_obs::metrics::UpstreamError::Timeout);
                return failed(timed_out, e.to_string()).await;
            }
            Err(_) => {
                pool.stats
                    .failed(portcullis_obs::metrics::UpstreamError::Timeout);
                return failed(true, format!("no answer within {timeout:?}")).await;
            }
        };
    pool.stats.record(resp.status().as_u16(), asked.elapsed());
    let (parts, mut answer) = resp.into_parts();
    let head = StreamEvent::Head {
        status: parts.status.as_u16(),
        headers: parts.headers,
    };
    // Each event waits for room: what the VM has not taken holds the
    // answer back (HTTP/2 flow control), not the proxy's memory.
    if events.send(head).await.is_err() {
        return;
    }
    while let Some(frame) = answer.frame().await {
        let event = match frame {
            Ok(frame) => match frame.into_data() {
                Ok(data) => StreamEvent::Data(data),
                Err(frame) => match frame.into_trailers() {
                    Ok(trailers) => StreamEvent::Trailers(trailers),
                    Err(_) => continue,
                },
            },
            Err(e) => return failed(false, format!("reading the answer: {e}")).await,
        };
        // The other side gone (the stream cancelled): stop reading.
        if events.send(event).await.is_err() {
            return;
        }
    }
    drop(held);
    let _ = events.send(StreamEvent::End).await;
}

/// A stream's request body: each message as the plugin sends it, until
/// it half-closes (drops its sender). Polled only as HTTP/2 flow control
/// lets data go, so what the upstream does not read waits in the
/// plugin's bounded queue.
struct Sent(portcullis_plugin::stream_body::StreamBody);

impl http_body::Body for Sent {
    type Data = Bytes;
    type Error = portcullis_forward::BodyError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|sent| sent.map(|data| Ok(http_body::Frame::data(data))))
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

impl PoolCallouts {
    /// Worker `shard`'s pool of the upstream `name`.
    fn pool(&self, shard: usize, name: &str) -> Option<std::sync::Arc<UpstreamPool>> {
        let i = self.config.upstream_index(name)?;
        Some(self.upstreams[shard % self.upstreams.len()][i].clone())
    }
}

impl portcullis_plugin::Callouts for PoolCallouts {
    fn send(
        &self,
        shard: usize,
        callout: Callout,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = CalloutAnswer> + Send>> {
        let pool = self.pool(shard, &callout.upstream);
        Box::pin(async move {
            if callout.redis {
                return crate::redis_calls::send(&callout.body, callout.timeout).await;
            }
            match pool {
                Some(pool) => send(&pool, callout).await,
                None => CalloutAnswer::Failed {
                    timed_out: false,
                    why: format!("no upstream `{}` in the policies", callout.upstream),
                },
            }
        })
    }

    fn stream(
        &self,
        shard: usize,
        callout: Callout,
        body: portcullis_plugin::stream_body::StreamBody,
        events: Sender<StreamEvent>,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> {
        let pool = self.pool(shard, &callout.upstream);
        Box::pin(async move {
            match pool {
                Some(pool) => stream(&pool, callout, body, events).await,
                None => {
                    let why = format!("no upstream `{}` in the policies", callout.upstream);
                    let _ = events
                        .send(StreamEvent::Failed {
                            timed_out: false,
                            why,
                        })
                        .await;
                }
            }
        })
    }
}
