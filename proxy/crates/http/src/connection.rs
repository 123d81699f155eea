//! Serving one accepted connection (HTTP/1.1 or cleartext HTTP/2 by its
//! first bytes; any TLS already done), for the routing core's listeners
//! and the tunnel server's public side alike: the request head's
//! deadline, the connection's end by use (`max_requests_per_connection`,
//! `connection_lifetime`), the lingering close after a refused body, the
//! graceful drain, and the connection's errors in the metrics and log.
//! What each request gets is the caller's `respond` (the phase driver,
//! [`crate::phases`]).

use crate::answers::ResetStream;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use http::{Request, Response};
use hyper::body::Incoming;
use hyper::rt::bounds::Http2ServerConnExec;
use hyper::service::HttpService;
use hyper_util::rt::TokioExecutor;

use portcullis_forward::ResponseBody;
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

/// The connection's side of its requests, for the caller's service:
/// [`Requests::start`] as a request's head arrives, then the [`Finish`]
/// applied to its answer. The caller makes the service, and each
/// request's future in it, itself, wrapped in [`InPlace`]: a future
/// returned through a function of this module, and then moved into
/// hyper's slot, was copied whole (~600 instructions of memcpy per
/// request, `bench/instructions-diff.sh`) where one made in place is not.
#[derive(Clone)]
pub struct Requests(Arc<Served>);

/// What every request's answer on the connection touches; one reference
/// per request, not one per part.
struct Served {
    clock: Arc<HeadClock>,
    retire: Option<Arc<Retire>>,
}

impl Requests {
    /// A request of `version` arrived: what its answer needs done.
    #[inline]
    pub fn start(&self, version: http::Version) -> Finish {
        self.0.clock.request(version);
        Finish {
            served: self.0.clone(),
            version,
        }
    }
}

/// What is left to do with an answer before hyper writes it.
pub struct Finish {
    served: Arc<Served>,
    version: http::Version,
}

impl Finish {
    /// `resp` as it goes out: counted towards the connection's end, closing
    /// it when its read buffer grew or, lingering, after a refused body.
    #[inline]
    pub fn answer(
        self,
        mut resp: Response<ResponseBody>,
    ) -> Result<Response<ResponseBody>, ResetStream> {
        // Finished in place, the answer moved only into the result: passed
        // through by value it was copied twice more (~130 instructions).
        match self.finish(&mut resp) {
            Some(reset) => Err(reset),
            None => Ok(resp),
        }
    }

    /// [`Finish::answer`] on `resp` where it is; the stream's reset when
    /// the answer is one.
    #[inline]
    fn finish(self, resp: &mut Response<ResponseBody>) -> Option<ResetStream> {
        let Finish { served, version } = self;
        if let Some(retire) = &served.retire {
            retire.count(version, resp);
        }
        // The read buffer an upload grew goes with the connection.
        served.clock.close_if_grown(version, resp);
        // A refused body the client may still be sending: close after the
        // answer, lingering (`portcullis_net::linger`).
        if resp.extensions().get::<crate::answers::Linger>().is_some() {
            served.clock.linger();
        }
        resp.body_mut().set_ended(Ended::new(served.clock.clone()));
        resp.extensions().get::<ResetStream>().copied()
    }
}

/// A connection's service: hyper's `service_fn`, but with `call` always
/// inlined. Called out of line from hyper's HTTP/1 dispatcher, `call`
/// returned each request's future (~6 KiB) into a temporary that was
/// then copied whole into hyper's slot: +6,256 bytes of memcpy, ~600
/// instructions per request (`bench/instructions-diff.sh`, gdb on memcpy).
#[derive(Clone)]
pub struct InPlace<F>(pub F);

impl<F, Fut> hyper::service::Service<Request<Incoming>> for InPlace<F>
where
    F: Fn(Request<Incoming>) -> Fut,
    Fut: Future<Output = Result<Response<ResponseBody>, ResetStream>>,
{
    type Response = Response<ResponseBody>;
    type Error = ResetStream;
    type Future = Fut;

    #[inline(always)]
    fn call(&self, req: Request<Incoming>) -> Fut {
        (self.0)(req)
    }
}

/// Serves HTTP on `stream` until it closes, with the service `make`
/// returns for the connection's [`Requests`] (each of its answers given
/// the [`Finish`] of its request). The future holds the connection; the
/// caller spawns it.
pub fn serve<S, N, M, Svc>(
    stream: S,
    accepted: Accepted<'_, N>,
    make: M,
) -> impl Future<Output = ()> + Send + use<S, N, M, Svc>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    N: AsRef<str> + Send + 'static,
    M: FnOnce(Requests) -> Svc,
    Svc: HttpService<Incoming, ResBody = ResponseBody, Error = ResetStream> + Send + 'static,
    Svc::Future: Send + 'static,
    TokioExecutor: Http2ServerConnExec<Svc::Future, ResponseBody>,
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
    let service = make(Requests(Arc::new(Served {
        clock: clock.clone(),
        retire: retire.clone(),
    })));
    let io = Watched::new(stream, clock.clone());
    let served = connections.watch_retiring(builder.serve(io, service), retire);
    // A combinator, not an async block: one would hold the connection
    // twice (see `head_deadline::Within`).
    let served = head_deadline::within(served, clock.clone(), header_read_timeout)
        .parking(head_deadline::PARK_AFTER);
    served.map(move |outcome| {
        let listener = listener.as_ref();
        match outcome {
            Some(Ok(())) => {}
            Some(Err(e)) => {
                let reason = portcullis_obs::metrics::connection_error(listener, &*e);
                if let Some(e) = portcullis_net::unparsed_head::refused(&*e) {
                    let status = clock.refused();
                    portcullis_obs::access_log::refused_head(listener, (client, worker), status, e);
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

/// How an accepted connection opens: its listener's name (for metrics and
/// logs), whether a PROXY header comes first, and the TLS acceptor with
/// the answer to plain HTTP sent to it.
pub struct Opening<'a> {
    pub listener: &'a str,
    pub proxy_protocol: bool,
    pub tls: Option<(&'a tokio_rustls::TlsAcceptor, &'a str)>,
}

/// Reads an accepted connection's PROXY header and TLS handshake within
/// `limit` (or until `stop`): the stream and the client it names, or
/// `None` once a refusal is counted in the listener's connection errors
/// and logged. The routing core's listeners and the tunnel server's
/// public side open their connections here, in each connection's task.
pub async fn open_accepted(
    stream: tokio::net::TcpStream,
    peer: SocketAddr,
    how: Opening<'_>,
    limit: Duration,
    stop: &tokio_util::sync::CancellationToken,
) -> Option<(portcullis_net::tls_listen::Opened, SocketAddr)> {
    use portcullis_net::tls_listen::NotOpened;
    let opened = portcullis_net::tls_listen::open(stream, peer, how.proxy_protocol, how.tls);
    let opened = tokio::select! {
        opened = tokio::time::timeout(limit, opened) => opened,
        _ = stop.cancelled() => return None,
    };
    let name = how.listener;
    match opened {
        Ok(Ok(opened)) => return Some(opened),
        Ok(Err(NotOpened::ProxyHeader(e))) => {
            portcullis_obs::metrics::count_connection_error(name, "proxy_protocol");
            tracing::debug!(peer = %peer, listener = name, error = %e, "connection closed");
        }
        Ok(Err(NotOpened::Tls(refused))) => {
            portcullis_obs::metrics::count_connection_error(name, refused.reason());
            tracing::debug!(peer = %peer, listener = name, "connection closed: {refused}");
        }
        Err(_) => {
            portcullis_obs::metrics::connection_timed_out(name);
            tracing::debug!(peer = %peer, listener = name, "no PROXY protocol header or TLS handshake within the header-read timeout; closed");
        }
    }
    None
}
