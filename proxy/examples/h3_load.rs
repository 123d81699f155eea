//! A load generator for the tunnel server's public side over HTTPS with
//! HTTP/2 or over HTTP/3, with the same request loop for both, so
//! `bench/h3.sh` compares the protocols and not two tools (wrk speaks
//! neither; no packaged tool here speaks HTTP/3).
//!
//! ```text
//! h3_load ADDR HOST CA_PEM PATH h2|h3 CONNECTIONS STREAMS SECONDS
//! ```
//!
//! CONNECTIONS connections, each with STREAMS requests in flight at all
//! times (a GET of PATH, body read whole), on one thread as `wrk -t1`.
//! Prints `requests/s p50_us p99_us`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes};
use http_body_util::{BodyExt, Empty};

type Latencies = Vec<u32>;

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [addr, host, ca, path, proto, connections, streams, seconds] = &args[..] else {
        anyhow::bail!("usage: h3_load ADDR HOST CA_PEM PATH h2|h3 CONNECTIONS STREAMS SECONDS");
    };
    let addr: SocketAddr = addr.parse()?;
    let (connections, streams): (usize, usize) = (connections.parse()?, streams.parse()?);
    let duration = Duration::from_secs(seconds.parse()?);
    let roots = roots(&std::fs::read_to_string(ca)?)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (count, mut latencies) = runtime.block_on(async move {
        let until = Instant::now() + duration;
        let mut loops = Vec::new();
        for _ in 0..connections {
            let uri: http::Uri = format!("https://{host}{path}").parse()?;
            match proto.as_str() {
                "h2" => {
                    let send = h2_connect(addr, host, roots.clone()).await?;
                    for _ in 0..streams {
                        let (send, uri) = (send.clone(), uri.clone());
                        loops.push(tokio::spawn(h2_loop(send, uri, until)));
                    }
                }
                "h3" => {
                    let send = h3_connect(addr, host, roots.clone()).await?;
                    for _ in 0..streams {
                        let (send, uri) = (send.clone(), uri.clone());
                        loops.push(tokio::spawn(h3_loop(send, uri, until)));
                    }
                }
                other => anyhow::bail!("protocol {other}: h2 or h3"),
            }
        }
        let mut all = Latencies::new();
        for l in loops {
            all.extend(l.await??);
        }
        anyhow::Ok((all.len(), all))
    })?;
    latencies.sort_unstable();
    let at = |q: f64| {
        latencies
            .get(((latencies.len() as f64 * q) as usize).min(latencies.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    println!(
        "{:.0} {} {}",
        count as f64 / duration.as_secs_f64(),
        at(0.5),
        at(0.99)
    );
    Ok(())
}

fn roots(ca_pem: &str) -> anyhow::Result<rustls::RootCertStore> {
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert?)?;
    }
    Ok(roots)
}

fn tls(roots: rustls::RootCertStore, alpn: &[u8]) -> anyhow::Result<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![alpn.to_vec()];
    Ok(config)
}

async fn h2_connect(
    addr: SocketAddr,
    host: &str,
    roots: rustls::RootCertStore,
) -> anyhow::Result<hyper::client::conn::http2::SendRequest<Empty<Bytes>>> {
    let connector = tokio_rustls::TlsConnector::from(Arc::new(tls(roots, b"h2")?));
    let tcp = tokio::net::TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let name = rustls_pki_types::ServerName::try_from(host.to_owned())?;
    let stream = connector.connect(name, tcp).await?;
    let (send, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await?;
    tokio::spawn(conn);
    Ok(send)
}

async fn h2_loop(
    mut send: hyper::client::conn::http2::SendRequest<Empty<Bytes>>,
    uri: http::Uri,
    until: Instant,
) -> anyhow::Result<Latencies> {
    let mut latencies = Latencies::new();
    while Instant::now() < until {
        let start = Instant::now();
        let req = http::Request::get(uri.clone()).body(Empty::new())?;
        let resp = send.send_request(req).await?;
        anyhow::ensure!(resp.status() == 200, "status {}", resp.status());
        resp.into_body().collect().await?;
        latencies.push(start.elapsed().as_micros() as u32);
    }
    Ok(latencies)
}

type H3Send = h3::client::SendRequest<h3_quinn::OpenStreams, Bytes>;

async fn h3_connect(
    addr: SocketAddr,
    host: &str,
    roots: rustls::RootCertStore,
) -> anyhow::Result<H3Send> {
    let mut config = tls(roots, b"h3")?;
    config.enable_early_data = false;
    let quic = quinn::crypto::rustls::QuicClientConfig::try_from(config)?;
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse()?)?;
    endpoint.set_default_client_config(quinn::ClientConfig::new(Arc::new(quic)));
    let conn = endpoint.connect(addr, host)?.await?;
    let (mut driver, send) = h3::client::new(h3_quinn::Connection::new(conn)).await?;
    tokio::spawn(async move {
        let _endpoint = endpoint;
        futures_util::future::poll_fn(|cx| driver.poll_close(cx)).await
    });
    Ok(send)
}

async fn h3_loop(mut send: H3Send, uri: http::Uri, until: Instant) -> anyhow::Result<Latencies> {
    let mut latencies = Latencies::new();
    while Instant::now() < until {
        let start = Instant::now();
        let req = http::Request::get(uri.clone()).body(())?;
        let mut stream = send.send_request(req).await?;
        stream.finish().await?;
        let resp = stream.recv_response().await?;
        anyhow::ensure!(resp.status() == 200, "status {}", resp.status());
        while let Some(mut chunk) = stream.recv_data().await? {
            chunk.advance(chunk.remaining());
        }
        latencies.push(start.elapsed().as_micros() as u32);
    }
    Ok(latencies)
}
