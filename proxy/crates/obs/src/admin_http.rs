//! The admin listeners' HTTP plumbing, shared by the routing core's
//! (the binary's `admin` module) and the tunnel server's: binding one
//! and serving a handler behind its access check. The answers themselves
//! are [`crate::admin_answer`]'s.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;

use http::Request;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// An admin endpoint's request handler.
pub type Handler = Arc<
    dyn Fn(Request<Incoming>) -> Pin<Box<dyn Future<Output = crate::admin_answer::Answer> + Send>>
        + Send
        + Sync,
>;

/// Binds an admin listener on `addr` and answers with `handler` the
/// requests `access` lets through, until the process ends.
pub async fn serve_with(
    addr: SocketAddr,
    access: crate::admin_access::AdminAccess,
    handler: Handler,
) -> std::io::Result<SocketAddr> {
    let access = Arc::new(access);
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tracing::info!(addr = %local, "admin listening");
    tokio::spawn(async move {
        loop {
            let (stream, _) = portcullis_net::sockets::accept(&listener, "admin").await;
            let (handler, access) = (handler.clone(), access.clone());
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<Incoming>| {
                    let answer = match access.check(req.method(), req.uri().path(), req.headers()) {
                        Ok(()) => handler(req),
                        Err(refused) => Box::pin(std::future::ready(*refused)),
                    };
                    async move { Ok::<_, Infallible>(answer.await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Ok(local)
}
