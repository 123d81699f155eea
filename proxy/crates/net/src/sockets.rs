//! Listening sockets: one per worker on a shared address, and an accept
//! that survives errors.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};

/// The next connection on `listener`. Accept errors (out of file
/// descriptors and the like) are logged as `what` and retried after a short
/// pause rather than in a spin; the listener stays up.
pub async fn accept(listener: &TcpListener, what: &str) -> (TcpStream, SocketAddr) {
    loop {
        match listener.accept().await {
            Ok(pair) => return pair,
            Err(e) => {
                tracing::warn!(listener = what, error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

/// One listening socket per worker on `addr`, all joined by
/// `SO_REUSEPORT`, and the address they hold (port 0 picks one).
///
/// `SO_REUSEPORT` lets any process of the same user join the group, so a
/// second copy started by mistake would silently take half the traffic.
/// The address is first bound once without it: that fails with "address
/// in use" while any other process listens there (as nginx refuses
/// without `reuseport`), yet, with `SO_REUSEADDR`, not for connections of
/// a process that just exited (`TIME_WAIT`), so a restart binds at once.
pub fn worker_sockets(
    addr: SocketAddr,
    workers: usize,
) -> std::io::Result<(SocketAddr, Vec<std::net::TcpListener>)> {
    if addr.port() != 0 {
        held_elsewhere(addr)?;
    }
    let first = reuseport_socket(addr)?;
    let addr = first.local_addr()?;
    let mut sockets = vec![first];
    for _ in 1..workers.max(1) {
        sockets.push(reuseport_socket(addr)?);
    }
    Ok((addr, sockets))
}

/// Fails with `AddrInUse` when a socket of another group listens on
/// `addr` (see [`worker_sockets`]).
fn held_elsewhere(addr: SocketAddr) -> std::io::Result<()> {
    use socket2::{Domain, Protocol, Socket, Type};
    let probe = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    probe.set_reuse_address(true)?;
    probe.bind(&addr.into()).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AddrInUse {
            std::io::Error::new(e.kind(), format!("{e}: another process is listening there"))
        } else {
            e
        }
    })
}

/// A listening socket others can join on the same address (one per worker).
fn reuseport_socket(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(4096)?;
    Ok(socket.into())
}

#[cfg(test)]
mod tests {
    use super::worker_sockets;

    #[test]
    fn a_held_address_is_refused_and_a_free_one_gets_every_worker() {
        let (addr, sockets) = worker_sockets("127.0.0.1:0".parse().unwrap(), 3).expect("bind");
        assert_eq!(sockets.len(), 3);
        // What another process would meet: the group holds the address.
        let e = worker_sockets(addr, 2).expect_err("joined a held address");
        assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
        assert!(e.to_string().contains("another process"), "{e}");
        drop(sockets);
        let (again, sockets) = worker_sockets(addr, 2).expect("rebind once released");
        assert_eq!((again, sockets.len()), (addr, 2));
    }

    #[test]
    fn a_connection_left_in_time_wait_does_not_hold_the_address() {
        use std::io::Read;
        let (addr, sockets) = worker_sockets("127.0.0.1:0".parse().unwrap(), 1).expect("bind");
        let mut client = std::net::TcpStream::connect(addr).expect("connect");
        sockets[0].set_nonblocking(false).unwrap();
        let (served, _) = sockets[0].accept().expect("accept");
        // The server's end closes first, so it is the one in TIME_WAIT.
        drop(sockets);
        drop(served);
        assert_eq!(client.read(&mut [0u8; 1]).expect("EOF"), 0);
        drop(client);
        worker_sockets(addr, 1).expect("a restart binds at once");
    }
}
