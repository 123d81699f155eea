//! A QUIC tunnel whose client's address changes (a NAT rebinding) goes
//! on over the same connection.

use super::*;

/// A UDP relay in front of the tunnel endpoint's QUIC side: one client's
/// datagrams go to the server from the relay's own socket, and
/// [`UdpRelay::rebind`] moves them to a new one, so the server sees the
/// client come from a new port, as after a NAT rebinding.
struct UdpRelay {
    addr: SocketAddr,
    rebind: mpsc::Sender<tokio::sync::oneshot::Sender<SocketAddr>>,
    task: tokio::task::JoinHandle<()>,
}

impl UdpRelay {
    pub(super) async fn start(to: SocketAddr) -> UdpRelay {
        async fn towards(to: SocketAddr) -> tokio::net::UdpSocket {
            let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
            socket.connect(to).await.unwrap();
            socket
        }
        let front = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = front.local_addr().unwrap();
        let (rebind, mut rebinds) = mpsc::channel::<tokio::sync::oneshot::Sender<SocketAddr>>(1);
        let task = tokio::spawn(async move {
            let mut back = towards(to).await;
            let mut client = None;
            let (mut up, mut down) = (vec![0u8; 65536], vec![0u8; 65536]);
            loop {
                tokio::select! {
                    r = front.recv_from(&mut up) => if let Ok((n, from)) = r {
                        client = Some(from);
                        let _ = back.send(&up[..n]).await;
                    },
                    r = back.recv(&mut down) => if let (Ok(n), Some(client)) = (r, client) {
                        let _ = front.send_to(&down[..n], client).await;
                    },
                    Some(done) = rebinds.recv() => {
                        back = towards(to).await;
                        let _ = done.send(back.local_addr().unwrap());
                    }
                }
            }
        });
        UdpRelay { addr, rebind, task }
    }

    /// Sends the client's datagrams from a new socket from now on (the old
    /// one is closed); returns its address.
    pub(super) async fn rebind(&self) -> SocketAddr {
        let (done, moved) = tokio::sync::oneshot::channel();
        self.rebind.send(done).await.unwrap();
        moved.await.unwrap()
    }
}

impl Drop for UdpRelay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A client whose address changes (a NAT rebinding: its datagrams come
/// from a new port) keeps its QUIC tunnel: the server follows the
/// connection to the new address, requests go on through it, and the
/// client does not dial again. Over TCP (WebSocket) the tunnel would be
/// lost and dialled again.
#[tokio::test]
async fn a_quic_tunnel_follows_its_client_to_a_new_address() {
    let echo = upstream::echo("moved").await;
    let server = TunnelServer::start_quic().await;
    let relay = UdpRelay::start(server.tunnel).await;
    let url = echo.url();
    let via = format!("wss://localhost:{}", relay.addr.port());
    let _client = server
        .client_via(
            &via,
            "rt-a",
            TOKENS[0].1,
            &quic_upstream(&url, &["--connections", "1"]),
        )
        .await;
    server.wait_connections("rt-a", 1).await;
    let tunnel = |status: serde_json::Value| status["runtimes"][0]["tunnels"][0].clone();
    let before = tunnel(server.process.status().await);
    assert_eq!(server.get("rt-a", "/before").await.status, 200);

    let moved_to = relay.rebind().await;
    assert_ne!(before["remote"], moved_to.to_string());
    for path in ["/after", "/and-again"] {
        let answer = server.get("rt-a", path).await;
        assert_eq!(answer.status, 200, "{:?}", answer.body);
        assert_eq!(answer.json()["upstream"], "moved");
    }
    let status = server.process.status().await;
    assert_eq!(status["runtimes"][0]["connections"], 1, "{status}");
    let after = tunnel(status);
    assert_eq!(after["remote"], moved_to.to_string());
    assert_eq!(after["since"], before["since"], "the client dialled again");
    assert_eq!(server.process.count_logs("\"tunnel connected\""), 1);
    assert_eq!(server.process.count_logs("\"tunnel lost"), 0);
}
