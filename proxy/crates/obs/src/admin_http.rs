//! The admin listeners' HTTP plumbing, shared by the routing core's
//! (`portcullis_portcullis::admin`) and the tunnel server's: binding one and serving a
//! handler, JSON and Prometheus answers, 405s, times and metric families.

use std::convert::Infallible;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// An admin endpoint's request handler.
pub type Handler =
    Arc<dyn Fn(Request<Incoming>) -> Pin<Box<dyn Future<Output = Answer> + Send>> + Send + Sync>;

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

/// An admin answer.
pub type Answer = Response<Full<Bytes>>;

/// 405 for `path`, which takes `allow`. RFC 9110 15.5.6: a 405 says which
/// methods the resource takes, in `Allow`.
pub fn method_not_allowed(path: &str, allow: &'static str) -> Answer {
    let mut resp = json(
        StatusCode::METHOD_NOT_ALLOWED,
        serde_json::json!({"error": format!("{path} takes {allow}")}),
    );
    resp.headers_mut()
        .insert(header::ALLOW, header::HeaderValue::from_static(allow));
    resp
}

/// A Prometheus text answer.
pub fn prometheus(text: String) -> Answer {
    let mut resp = Response::new(Full::new(Bytes::from(text)));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; version=0.0.4"),
    );
    resp
}

/// Writes one metric family in Prometheus text format.
pub fn metric(out: &mut String, name: &str, kind: &str, help: &str, samples: &[(String, f64)]) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (labels, value) in samples {
        let _ = writeln!(out, "{name}{labels} {value}");
    }
}

/// A JSON answer.
pub fn json(status: StatusCode, value: serde_json::Value) -> Answer {
    let mut resp = Response::new(Full::new(Bytes::from(value.to_string())));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    resp
}

/// A time as RFC 3339 with milliseconds.
pub fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_millis(t).to_string()
}
