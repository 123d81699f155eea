//! Serving one accepted connection (HTTP/1.1 or cleartext HTTP/2 by its
//! first bytes; any TLS already done), for the routing core's listeners
//! and the tunnel server's public side alike: the request head's
//! deadline, the connection's end by use (`max_requests_per_connection`,
//! `connection_lifetime`), the lingering close after a refused body, the
//! graceful drain, and the connection's errors in the metrics and log.
//! What each request gets is the caller's `respond` (the phase driver,
//! [`crate::phases`]).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::service::service_fn;

use crate::body::ResponseBody;
use portcullis_net::drain::{Connections, Retire};
use portcullis_net::h1_or_h2::Builder;
use portcullis_net::head_deadline::{self, Ended, HeadClock, Watched};

/// A connection to serve, and the listener's settings for it.
pub struct Accepted<'a, N> {
    /// The listener's HTTP settings.
    pub builder: &'a Arc<Builder>,
    /// The listener's open connections, for the graceful drain.
    pub connections: &'a Connections,
    /// The listener's name, for the connection metrics and log lines.
    pub listener: N,
    /// The client (the peer, or the address its PROXY header gave).
    pub client: SocketAddr,
    /// The worker serving it.
    pub worker: usize,
    /// Its end by use, if the listener sets one.
    pub retire: Option<Arc<Retire>>,
    /// How long a request head may take to arrive.
    pub header_read_timeout: Duration,
}

/// What is left to do with an answer before hyper writes it: given to
/// `respond` with each request, and applied by it to its answer
/// ([`Finish::answer`]). The caller's future does it, rather than a
/// future of this module around the caller's: that one would move the
/// whole request's future (kilobytes) once more per request.
pub struct Finish {
    clock: Arc<HeadClock>,
    retire: Option<Arc<Retire>>,
    version: http::Version,
}

impl Finish {
    /// `resp` as it goes out: counted towards the connection's end, closing
    /// it when its read buffer grew or, lingering, after a refused body.
    #[inline]
    pub fn answer(
        self,
        mut resp: Response<ResponseBody>,
    ) -> Result<Response<ResponseBody>, Infallible> {
        let Finish {
            clock,
            retire,
            version,
        } = self;
        if let Some(retire) = &retire {
            retire.count(version, &mut resp);
        }
        // The read buffer an upload grew goes with the connection.
        clock.close_if_grown(version, &mut resp);
        // A refused body the client may still be sending: close after the
        // answer, lingering (`portcullis_net::linger`).
        if resp.extensions().get::<crate::answers::Linger>().is_some() {
            clock.linger();
        }
        resp.body_mut().set_ended(Ended::new(clock));
        Ok(resp)
    }
}

/// Serves HTTP on `stream` until it closes, answering each request with
/// `respond`, which applies the [`Finish`] it is given to its answer. The
/// future holds the connection; the caller spawns it.
pub fn serve<S, N, F, Fut>(
    stream: S,
    accepted: Accepted<'_, N>,
    respond: F,
) -> impl Future<Output = ()> + Send + use<S, N, F, Fut>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    N: AsRef<str> + Send + 'static,
    F: Fn(Request<Incoming>, Finish) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Response<ResponseBody>, Infallible>> + Send + 'static,
{
    let Accepted {
        builder,
        connections,
        listener,
        client,
        worker,
        retire,
        header_read_timeout,
    } = accepted;
    let clock = Arc::new(HeadClock::default());
    let service_clock = clock.clone();
    let service_retire = retire.clone();
    let service = service_fn(move |req: Request<Incoming>| {
        let version = req.version();
        service_clock.request(version);
        let finish = Finish {
            clock: service_clock.clone(),
            retire: service_retire.clone(),
            version,
        };
        respond(req, finish)
    });
    let io = Watched::new(stream, clock.clone());
    let served = connections.watch_retiring(builder.serve(io, service), retire);
    // A combinator, not an async block: one would hold the connection
    // twice (see `head_deadline::Within`).
    let served = head_deadline::within(served, clock.clone(), header_read_timeout);
    served.map(move |outcome| {
        let listener = listener.as_ref();
        match outcome {
            Some(Ok(())) => {}
            Some(Err(e)) => {
                let reason = portcullis_obs::metrics::connection_error(listener, &*e);
                if let Some(e) = portcullis_net::unparsed_head::refused(&*e) {
                    let status = clock.refused();
                    portcullis_net::unparsed_head::log(listener, client, worker, status, e);
                } else {
                    tracing::debug!(%client, error = %e, reason, "connection ended with an error");
                }
            }
            None => {
                portcullis_obs::metrics::connection_timed_out(listener);
                tracing::debug!(%client, "no request head within the header-read timeout; closed");
            }
        }
    })
}
