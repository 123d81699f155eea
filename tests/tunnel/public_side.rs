//! The public side's protocols and limits: HTTPS, balancers in front, HTTP/3, large heads.

use super::*;

/// With `--public-cert`/`--public-key` the public side is HTTPS with a
/// wildcard certificate for the domain: HTTP/1.1 and HTTP/2 (ALPN), the
/// routing core told `X-Forwarded-Proto: https`; a client speaking plain
/// HTTP to it, or not trusting it, is refused, counted, and disturbs
/// nothing.
#[tokio::test]
pub(super) async fn the_public_side_serves_https_with_a_wildcard_certificate() {
    let echo = upstream::echo("https").await;
    let (server, pki) = TunnelServer::start_https(&[]).await;
    let status = server.process.status().await;
    assert_eq!(status["public"]["tls"], true, "{status}");
    assert_eq!(status["domain"], DOMAIN);
    let url = echo.url();
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    let host = format!("rt-a.{DOMAIN}");
    let https = |alpn: &'static [&'static [u8]]| {
        crate::support::tls::https_get(server.public, &host, &pki.ca_pem, alpn, "/secure?q=1")
    };

    const H1: &[&[u8]] = &[b"http/1.1"];
    const H2: &[&[u8]] = &[b"h2", b"http/1.1"];
    for (alpn, version) in [(H1, http::Version::HTTP_11), (H2, http::Version::HTTP_2)] {
        let (got, a) = https(alpn).await.expect("HTTPS exchange");
        assert_eq!(got, version);
        assert_eq!(a.status, 200, "{:?}", a.body);
        let seen = a.json();
        assert_eq!(seen["upstream"], "https");
        assert_eq!(seen["path"], "/secure?q=1");
        assert_eq!(seen["headers"]["x-forwarded-proto"], "https", "{seen}");
        assert_eq!(seen["headers"]["x-forwarded-host"], host.as_str(), "{seen}");
    }

    // Plain HTTP on the HTTPS port is told to use https (as nginx does);
    // a client that does not trust the certificate fails its handshake.
    // Both are counted, and the next client is served.
    let plain = client::raw(
        server.public,
        format!("GET /app HTTP/1.1\r\nhost: {host}\r\n\r\n").as_bytes(),
    )
    .await;
    assert!(plain.starts_with("HTTP/1.1 400 "), "{plain:?}");
    assert!(plain.contains("use https://"), "{plain:?}");
    let other = crate::support::tls::TestPki::new();
    let refused =
        crate::support::tls::https_get(server.public, &host, &other.ca_pem, H2, "/").await;
    assert!(refused.is_err_and(|e| e.starts_with("TLS")));
    server
        .process
        .metrics_showing(&[
            crate::support::process::connection_errors("public", "plain_http", 1),
            crate::support::process::connection_errors("public", "tls_handshake", 1),
        ])
        .await;
    assert_eq!(https(H2).await.expect("HTTPS").1.status, 200);
    // The access line gives the TLS version, as the routing core's does.
    let mut server = server;
    let line = server
        .process
        .wait_for_log("\"path\":\"/secure?q=1\"")
        .await;
    assert!(line.contains("\"tls\":\"TLSv1.3\""), "{line}");
}

/// Behind a TLS-terminating balancer (`--trust-forwarded-headers`), the
/// balancer's `X-Forwarded-Proto` and `-Host` reach the runtime; a request
/// without them gets the server's own.
#[tokio::test]
pub(super) async fn a_balancer_in_front_is_trusted_for_the_scheme_when_told() {
    let echo = upstream::echo("behind").await;
    let any = "127.0.0.1:0".parse().unwrap();
    let server =
        TunnelServer::start_in_with(tokens_dir(), any, any, &["--trust-forwarded-headers"]).await;
    let url = echo.url();
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    let req = server
        .request("rt-a", "GET", "/")
        .header("x-forwarded-proto", "https")
        .header("x-forwarded-host", "app.example.com")
        .body(body(Bytes::new()))
        .unwrap();
    let seen = client::send(&client::http1(), req).await.json();
    assert_eq!(seen["headers"]["x-forwarded-proto"], "https", "{seen}");
    assert_eq!(seen["headers"]["x-forwarded-host"], "app.example.com");
    let seen = server.get("rt-a", "/").await.json();
    assert_eq!(seen["headers"]["x-forwarded-proto"], "http", "{seen}");
    assert_eq!(
        seen["headers"]["x-forwarded-host"],
        format!("rt-a.{DOMAIN}")
    );
}

/// Behind a TCP balancer that passes TLS through (an AWS NLB), the
/// server reads the PROXY header the balancer puts before the handshake
/// (`--proxy-protocol`), and the runtime sees the client's address in
/// `X-Forwarded-For`; the balancer's health checks (version 2 LOCAL) keep
/// the connection's. A connection without a header is closed and counted,
/// and the next is served.
#[tokio::test]
pub(super) async fn a_tcp_balancer_in_front_gives_the_client_address() {
    let echo = upstream::echo("behind").await;
    let (server, pki) = TunnelServer::start_https(&["--proxy-protocol"]).await;
    assert_eq!(
        server.process.status().await["public"]["proxy_protocol"],
        true
    );
    let url = echo.url();
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    let host = format!("rt-a.{DOMAIN}");
    const H2: &[&[u8]] = &[b"h2", b"http/1.1"];
    let https = |before: &'static [u8]| {
        crate::support::tls::https_get_after(server.public, before, &host, &pki.ca_pem, H2, "/")
    };

    let (_, a) = https(b"PROXY TCP4 203.0.113.7 10.0.0.1 51234 443\r\n")
        .await
        .expect("HTTPS after a PROXY header");
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert_eq!(a.json()["headers"]["x-forwarded-for"], "203.0.113.7");
    let health_check = b"\r\n\r\n\0\r\nQUIT\n\x20\x00\x00\x00";
    let (_, a) = https(health_check).await.expect("HTTPS after LOCAL");
    assert_eq!(a.json()["headers"]["x-forwarded-for"], "127.0.0.1");

    assert!(https(b"").await.is_err(), "served without a PROXY header");
    server
        .process
        .metrics_showing(&[crate::support::process::connection_errors(
            "public",
            "proxy_protocol",
            1,
        )])
        .await;
    let (_, a) = https(b"PROXY TCP6 2001:db8::9 2001:db8::1 4000 443\r\n")
        .await
        .expect("HTTPS after a PROXY header");
    assert_eq!(a.json()["headers"]["x-forwarded-for"], "2001:db8::9");
}

/// With `--http3` the public side also serves HTTP/3 on the public port's
/// UDP twin, with the same certificate, and HTTPS responses advertise it
/// (`Alt-Svc`). A request over HTTP/3 reaches the runtime as one over
/// TCP does: path and query kept, an upload streamed through intact, the
/// routing core told `https`. A request in flight at shutdown finishes.
#[tokio::test]
pub(super) async fn the_public_side_serves_http3_and_advertises_it() {
    let echo = upstream::echo("h3").await;
    let (server, pki) = TunnelServer::start_https(&["--http3"]).await;
    assert_eq!(server.process.status().await["public"]["http3"], true);
    let url = echo.url();
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    let host = format!("rt-a.{DOMAIN}");

    const H2: &[&[u8]] = &[b"h2", b"http/1.1"];
    let (_, a) = crate::support::tls::https_get(server.public, &host, &pki.ca_pem, H2, "/over-tcp")
        .await
        .expect("HTTPS");
    let advertised = format!("h3=\":{}\"; ma=86400", server.public.port());
    assert_eq!(a.header("alt-svc"), Some(advertised.as_str()));

    let h3 = |method: &'static str, path: &'static str, body: Vec<u8>| {
        let (host, ca) = (host.clone(), pki.ca_pem.clone());
        let addr = server.public;
        async move {
            crate::support::tls::h3_request(addr, &host, &ca, method, path, body.into())
                .await
                .expect("HTTP/3 exchange")
        }
    };
    let a = h3("GET", "/over-quic?q=1", Vec::new()).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    assert!(
        a.header("alt-svc").is_none(),
        "HTTP/3 answers need no Alt-Svc"
    );
    let seen = a.json();
    assert_eq!(seen["upstream"], "h3");
    assert_eq!(seen["target"], "/over-quic?q=1");
    assert_eq!(seen["headers"]["x-forwarded-proto"], "https", "{seen}");
    assert_eq!(seen["headers"]["x-forwarded-host"], host.as_str());

    let data: Vec<u8> = (0..(3 << 20) / 4)
        .flat_map(|i: u32| i.to_le_bytes())
        .collect();
    let a = h3("POST", "/upload", data.clone()).await;
    assert_eq!(a.status, 200, "{:?}", a.body);
    let seen = a.json();
    assert_eq!(seen["method"], "POST");
    assert_eq!(seen["body_len"], data.len());
    assert_eq!(seen["body_fnv"], upstream::fnv(&data));
    let mut server = server;
    let line = server.process.wait_for_log("\"path\":\"/upload\"").await;
    assert!(line.contains("\"tls\":\"TLSv1.3\""), "{line}");

    // A request in flight when the server is told to stop still gets its
    // answer (the connection is sent a GOAWAY, not closed).
    let (up, mut arrived, release) = upstream::holding().await;
    let url = up.url();
    let _slow_client = server
        .client("rt-b", TOKENS[1].1, &["--upstream", &url])
        .await;
    let slow = {
        let (host, ca, addr) = (format!("rt-b.{DOMAIN}"), pki.ca_pem.clone(), server.public);
        tokio::spawn(async move {
            crate::support::tls::h3_request(addr, &host, &ca, "GET", "/slow", Bytes::new()).await
        })
    };
    tokio::time::timeout(Duration::from_secs(10), arrived.recv())
        .await
        .expect("the HTTP/3 request reached the upstream");
    server.process.signal("TERM");
    server.process.wait_for_log("shutting down").await;
    release.notify_one();
    let answer = slow
        .await
        .unwrap()
        .expect("HTTP/3 exchange across shutdown");
    assert_eq!(answer.status, 200);
    assert_eq!(answer.body, "done /slow");
    assert!(
        server
            .process
            .wait_exit(Duration::from_secs(20))
            .await
            .success()
    );
}

/// A GET over a new HTTP/3 connection to the public side at `addr`.
pub(super) async fn h3_get(addr: SocketAddr, host: &str, ca_pem: &str, path: &str) -> Answer {
    crate::support::tls::h3_request(addr, host, ca_pem, "GET", path, Bytes::new())
        .await
        .expect("HTTP/3 exchange")
}

/// An upstream that answers the first request on each connection, keeps
/// it alive, and closes it as the next request arrives (as one whose
/// keep-alive timeout fires just then); it counts the connections.
pub(super) async fn closing_reused_connections() -> (SocketAddr, Arc<std::sync::atomic::AtomicUsize>)
{
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = accepted.clone();
    tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                let mut answered = false;
                while let Ok(n) = conn.read(&mut chunk).await {
                    if n == 0 {
                        return;
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                        buf.drain(..end + 4);
                        if answered {
                            return;
                        }
                        answered = true;
                        let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                        if conn.write_all(answer).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    (addr, accepted)
}

/// A bodiless HTTP/3 request is whole in hand, as over HTTP/1.1 and
/// HTTP/2: a GET that meets a pooled upstream connection closing under
/// it goes again on a new connection, and every one succeeds.
#[tokio::test]
pub(super) async fn http3_gets_are_retried_when_a_pooled_upstream_connection_closes() {
    let (up, accepted) = closing_reused_connections().await;
    let (server, pki) = TunnelServer::start_https(&["--http3"]).await;
    let url = format!("http://{up}");
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url, "--workers", "1"])
        .await;
    let host = format!("rt-a.{DOMAIN}");
    for i in 0..8 {
        let path = format!("/get-{i}");
        let a = h3_get(server.public, &host, &pki.ca_pem, &path).await;
        assert_eq!(
            (a.status.as_u16(), &a.body[..]),
            (200, &b"ok"[..]),
            "{path}"
        );
    }
    // The pooled connections were met closing, and replaced.
    assert!(accepted.load(std::sync::atomic::Ordering::SeqCst) >= 8);
}

/// Errors from the runtime's side come back over HTTP/3 as they are, and
/// a connection that sends no request is closed after 10 s, as a TCP one
/// that sends no head.
#[tokio::test]
pub(super) async fn http3_answers_errors_as_the_other_versions_do() {
    let (server, pki) = TunnelServer::start_https(&["--http3"]).await;
    let idle = {
        let (addr, host, ca) = (server.public, format!("rt-a.{DOMAIN}"), pki.ca_pem.clone());
        tokio::spawn(async move { crate::support::tls::h3_idle(addr, &host, &ca).await })
    };
    let get = |runtime: &str| {
        let host = format!("{runtime}.{DOMAIN}");
        let (addr, ca) = (server.public, pki.ca_pem.clone());
        async move {
            crate::support::tls::h3_request(addr, &host, &ca, "GET", "/", Bytes::new())
                .await
                .expect("HTTP/3 exchange")
        }
    };
    let unknown = get("nobody").await;
    assert_eq!(unknown.status, 502);
    assert_eq!(unknown.json()["error"], "unknown runtime");
    let offline = get("rt-a").await;
    assert_eq!(offline.status, 503);
    assert_eq!(offline.json()["runtime"], "rt-a");
    let kept = idle.await.unwrap().expect("an idle HTTP/3 connection");
    // The first-request deadline, well before either side's idle timeout
    // (the client's 30 s, the server's 75 s) would close it.
    assert!(kept < Duration::from_secs(20), "kept {kept:?}");
    server
        .process
        .metrics_showing(&[crate::support::process::connection_errors(
            "public",
            "header_timeout",
            1,
        )])
        .await;
}

/// Behind a TCP balancer that hides the clients' addresses, the tunnel
/// endpoint reads them from PROXY headers (`--tunnel-proxy-protocol`): the
/// failed-token rate limit then counts per client, so a client retrying a
/// stale token locks out itself and not every runtime behind the same
/// balancer; `/status` shows the clients' own addresses.
#[tokio::test]
pub(super) async fn the_tunnel_endpoint_behind_a_balancer_limits_each_client_on_its_own() {
    use tokio::io::AsyncWriteExt;
    let echo = upstream::echo("behind-nlb").await;
    let any = "127.0.0.1:0".parse().unwrap();
    let server =
        TunnelServer::start_in_with(tokens_dir(), any, any, &["--tunnel-proxy-protocol"]).await;
    assert_eq!(
        server.process.status().await["tunnel_endpoint"]["proxy_protocol"],
        true
    );
    let attempt = |source: &str, token: &str| {
        let raw = format!(
            "PROXY TCP4 {source} 10.0.0.1 40000 443\r\n\
             GET /_portcullis/tunnel HTTP/1.1\r\nhost: tunnel\r\nupgrade: websocket\r\n\
             connection: upgrade\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
             sec-websocket-version: 13\r\nauthorization: Bearer {token}\r\n\
             x-portcullis-runtime: rt-a\r\nx-portcullis-instance: stale\r\n\
             x-portcullis-slot: 0\r\n\r\n"
        );
        let addr = server.tunnel;
        async move { client::raw(addr, raw.as_bytes()).await }
    };
    // A client with a stale token, retrying from one address.
    for _ in 0..10 {
        let answer = attempt("198.51.100.66", "stale-token").await;
        assert!(answer.starts_with("HTTP/1.1 401 "), "{answer}");
    }
    let answer = attempt("198.51.100.66", TOKENS[0].1).await;
    assert!(answer.starts_with("HTTP/1.1 429 "), "{answer}");

    // Another client through the same balancer still gets in: a relay
    // standing in for the balancer puts its address in a PROXY header.
    let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay_url = format!("ws://{}", relay.local_addr().unwrap());
    let tunnel = server.tunnel;
    let relaying = tokio::spawn(async move {
        loop {
            let Ok((mut inbound, _)) = relay.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut out = tokio::net::TcpStream::connect(tunnel).await.unwrap();
                out.write_all(b"PROXY TCP4 203.0.113.7 10.0.0.1 40001 443\r\n")
                    .await
                    .unwrap();
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
            });
        }
    });
    let url = echo.url();
    let _client = server
        .client_via(
            &relay_url,
            "rt-a",
            TOKENS[0].1,
            &["--upstream", &url, "--connections", "1"],
        )
        .await;
    assert_eq!(server.get("rt-a", "/").await.status, 200);
    let status = server.process.status().await;
    let remote = &status["runtimes"][0]["tunnels"][0]["remote"];
    assert!(
        remote
            .as_str()
            .is_some_and(|r| r.starts_with("203.0.113.7:")),
        "{status}"
    );

    // Without a header, a connection is refused and counted.
    let bare =
        client::raw_until_closed(server.tunnel, b"GET /healthz HTTP/1.1\r\nhost: t\r\n\r\n").await;
    assert_eq!(bare, "");
    server
        .process
        .metrics_showing(&[crate::support::process::connection_errors(
            "tunnel",
            "proxy_protocol",
            1,
        )])
        .await;
    relaying.abort();
}

/// Request heads as large as the routing core takes (32 KiB by default;
/// large cookies are common) cross the tunnel whole, over each public
/// HTTP version, and so do large response heads.
#[tokio::test]
pub(super) async fn large_heads_cross_the_tunnel_both_ways() {
    let big_set_cookie = format!("session={}", "s".repeat(24 * 1024));
    let echo = {
        let big = big_set_cookie.clone();
        upstream::serve(move |req: Request<hyper::body::Incoming>| {
            let big = big.clone();
            async move {
                let other = req
                    .headers()
                    .get("x-other")
                    .map_or(0, |v| v.len())
                    .to_string();
                Response::builder()
                    .header("set-cookie", big)
                    .body(full(other))
                    .unwrap()
            }
        })
        .await
    };
    let (server, pki) = TunnelServer::start_https(&[]).await;
    let url = echo.url();
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    let cookie = "c".repeat(12 * 1024);
    for version in [http::Version::HTTP_11, http::Version::HTTP_2] {
        let alpn: &[&[u8]] = if version == http::Version::HTTP_2 {
            &[b"h2"]
        } else {
            &[b"http/1.1"]
        };
        let answer = crate::support::tls::https_get_with(
            server.public,
            &format!("rt-a.{DOMAIN}"),
            &pki.ca_pem,
            alpn,
            "/",
            &[("cookie", &cookie), ("x-other", &cookie)],
        )
        .await
        .expect("HTTPS exchange");
        assert_eq!(answer.0, version);
        assert_eq!(answer.1.status, 200, "{version:?}: {:?}", answer.1.body);
        assert_eq!(answer.1.body, cookie.len().to_string());
        assert_eq!(answer.1.header("set-cookie"), Some(big_set_cookie.as_str()));
    }
}

/// An HTTP/1.1 head on the public side is held to the bound HTTP/2's
/// header list has (64 KiB), refused as soon as it passes it, even while
/// it is still arriving.
#[tokio::test]
pub(super) async fn a_public_http1_head_past_the_bound_is_refused_at_once() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let server = TunnelServer::start().await;
    let mut conn = tokio::net::TcpStream::connect(server.public).await.unwrap();
    let mut head = format!("GET / HTTP/1.1\r\nhost: rt-a.{DOMAIN}\r\nx-big: ").into_bytes();
    head.resize(100 * 1024, b'x');
    conn.write_all(&head).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(60), conn.read_to_end(&mut answer))
        .await
        .expect("closed")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 431 "), "{answer:?}");
    assert!(
        answer.ends_with(r#""error":"request head too large","status":431,"route":null}"#),
        "{answer:?}"
    );
}

/// A public client whose chunked body breaks its framing (a chunk size
/// line `zz`) gets the routing core's answer for it at the edge, a 400
/// "request body could not be read", not a 502 blaming the tunnel; the
/// runtime's upstream, which had the head and the start of the body,
/// sees the request cut rather than completed.
#[tokio::test]
pub(super) async fn a_malformed_chunked_body_is_the_public_clients_400() {
    let (tx, mut seen) = tokio::sync::mpsc::unbounded_channel();
    let reporting = upstream::serve(move |req: Request<hyper::body::Incoming>| {
        let tx = tx.clone();
        async move {
            let _ = tx.send(None);
            let read = req.into_body().collect().await.ok();
            let _ = tx.send(Some(read.map(|b| b.to_bytes().len())));
            Response::new(full("read"))
        }
    })
    .await;
    let server = TunnelServer::start().await;
    let url = reporting.url();
    let _client = server
        .client("rt-a", TOKENS[0].1, &["--upstream", &url])
        .await;
    let host = format!("rt-a.{DOMAIN}");
    let arrived = async { assert_eq!(seen.recv().await, Some(None), "the head came first") };
    let answer = crate::support::client::broken_chunked_post(
        server.public,
        (&host, "/up"),
        b"zz\r\n",
        arrived,
    )
    .await;
    assert!(
        crate::support::client::is_unreadable_body_400(&answer),
        "{answer}"
    );
    let ended = tokio::time::timeout(Duration::from_secs(10), seen.recv()).await;
    assert_eq!(
        ended.expect("the upstream's read ended"),
        Some(Some(None)),
        "the upstream's request was cut, not completed"
    );
}
