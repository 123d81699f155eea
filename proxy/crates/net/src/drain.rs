//! Graceful shutdown of a listener's connections, at the cost of one atomic
//! load per wake-up of a connection.
//!
//! hyper-util's `GracefulShutdown` does the same job by polling a
//! `watch::Receiver::changed()` future beside every connection, and a
//! waiting `Notified` takes its `Notify`'s mutex on every poll: a lock and
//! the coop budget bookkeeping several times per request, for a signal that
//! comes once in a process's life. Here a connection hands its task's waker
//! over once and afterwards only reads a flag.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use hyper_util::server::graceful::GracefulConnection;
use tokio::sync::Notify;

use crate::coarse_clock::{coarse_now, millis};

/// A connection that can be asked to finish its requests and close:
/// hyper-util's (sealed, so not implementable here) and
/// [`crate::h1_or_h2::Connection`].
pub trait Graceful: Future {
    /// Starts closing: requests in flight finish, no new ones are taken.
    fn graceful_shutdown(self: Pin<&mut Self>);
}

impl<C: GracefulConnection> Graceful for C {
    fn graceful_shutdown(self: Pin<&mut Self>) {
        GracefulConnection::graceful_shutdown(self);
    }
}

/// One set of connections (one listener's on one worker) and the signal
/// that closes them.
#[derive(Default, Clone)]
pub struct Connections {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    draining: AtomicBool,
    /// Every connection still open, with the waker to call when draining
    /// starts (none until its first poll).
    open: Mutex<Open>,
    all_closed: Notify,
}

#[derive(Default)]
struct Open {
    next_id: u64,
    wakers: HashMap<u64, Option<Waker>>,
}

impl Shared {
    fn open(&self) -> MutexGuard<'_, Open> {
        // The map stays consistent whatever panicked while holding it.
        self.open.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Connections {
    pub fn new() -> Connections {
        Connections::default()
    }

    /// Wraps a connection so that [`Connections::shutdown`] asks it to finish its
    /// current requests and close.
    pub fn watch<C: Graceful>(&self, conn: C) -> Watched<C> {
        self.watch_retiring(conn, None)
    }

    /// [`Connections::watch`], the connection also closing gracefully
    /// once `retire` is due.
    pub fn watch_retiring<C: Graceful>(&self, conn: C, retire: Option<Arc<Retire>>) -> Watched<C> {
        let mut open = self.shared.open();
        let id = open.next_id;
        open.next_id += 1;
        open.wakers.insert(id, None);
        Watched {
            conn,
            shared: self.shared.clone(),
            id,
            waker: None,
            shutting_down: false,
            retire,
        }
    }

    /// Asks every watched connection to close once idle, and waits until
    /// all of them have ended.
    pub async fn shutdown(self) {
        self.shared.draining.store(true, Ordering::Release);
        let wakers: Vec<Waker> = {
            let mut open = self.shared.open();
            open.wakers.values_mut().filter_map(Option::take).collect()
        };
        wakers.into_iter().for_each(Waker::wake);
        loop {
            let closed = self.shared.all_closed.notified();
            tokio::pin!(closed);
            // Registered before the check, so a last close in between
            // still wakes this wait.
            closed.as_mut().enable();
            if self.shared.open().wakers.is_empty() {
                return;
            }
            closed.await;
        }
    }
}

pin_project_lite::pin_project! {
    /// A connection watched by [`Connections`].
    pub struct Watched<C> {
        #[pin]
        conn: C,
        shared: Arc<Shared>,
        id: u64,
        // The waker handed over, kept to notice a different one.
        waker: Option<Waker>,
        shutting_down: bool,
        retire: Option<Arc<Retire>>,
    }

    impl<C> PinnedDrop for Watched<C> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            let mut open = this.shared.open();
            open.wakers.remove(this.id);
            if open.wakers.is_empty() {
                drop(open);
                this.shared.all_closed.notify_waiters();
            }
        }
    }
}

impl<C: Graceful> Future for Watched<C> {
    type Output = C::Output;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<C::Output> {
        let mut this = self.project();
        if !*this.shutting_down {
            let mut draining = this.shared.draining.load(Ordering::Acquire);
            if !draining && !this.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                let waker = cx.waker().clone();
                let mut open = this.shared.open();
                if let Some(slot) = open.wakers.get_mut(this.id) {
                    *slot = Some(waker.clone());
                }
                // Read again under the lock: draining may have started
                // after the first read and taken the wakers before this
                // one was in.
                draining = this.shared.draining.load(Ordering::Acquire);
                *this.waker = Some(waker);
            }
            if draining || this.retire.as_ref().is_some_and(|r| r.is_due()) {
                *this.shutting_down = true;
                this.conn.as_mut().graceful_shutdown();
            }
        }
        this.conn.poll(cx)
    }
}

/// A client connection's end by use: nginx's `keepalive_requests` and
/// `keepalive_time`, Envoy's downstream `max_requests_per_connection` and
/// `max_connection_duration`. Behind a TCP balancer that keeps client
/// connections open for good, replicas added later would otherwise get
/// none of them. The connection's service counts each request and says
/// when the answer is the last: an HTTP/1.1 one then carries `Connection:
/// close`, and for HTTP/2 the connection is marked due, which its
/// [`Watched`] turns into a GOAWAY when it next writes (the answer's
/// frames), in-flight streams finishing.
#[derive(Debug)]
pub struct Retire {
    served: AtomicU32,
    /// 0: no limit.
    max_requests: u32,
    /// By `coarse_now`, in milliseconds; `u64::MAX`: never.
    deadline_ms: u64,
    due: AtomicBool,
}

impl Retire {
    /// Limits for a connection accepted now; `None` when there are none.
    pub fn new(max_requests: u32, lifetime: Duration) -> Option<Arc<Retire>> {
        if max_requests == 0 && lifetime.is_zero() {
            return None;
        }
        let deadline_ms = if lifetime.is_zero() {
            u64::MAX
        } else {
            millis(coarse_now()).saturating_add(millis(lifetime))
        };
        Some(Arc::new(Retire {
            served: AtomicU32::new(0),
            max_requests,
            deadline_ms,
            due: AtomicBool::new(false),
        }))
    }

    /// Counts one request; true when its answer is to be the connection's
    /// last.
    fn served(&self) -> bool {
        let n = self
            .served
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        (self.max_requests != 0 && n >= self.max_requests)
            || millis(coarse_now()) >= self.deadline_ms
    }

    /// Counts the request whose answer is `resp` (it came as `version`),
    /// and when that answer is to be the connection's last, says so: an
    /// HTTP/1 answer with `Connection: close` (not a 101, whose connection
    /// goes on as another protocol), HTTP/2 by a GOAWAY once it is out.
    pub fn count<B>(&self, version: http::Version, resp: &mut http::Response<B>) {
        if !self.served() {
            return;
        }
        if version >= http::Version::HTTP_2 {
            self.due.store(true, Ordering::Relaxed);
        } else if resp.status() != http::StatusCode::SWITCHING_PROTOCOLS {
            resp.headers_mut().insert(
                http::header::CONNECTION,
                http::HeaderValue::from_static("close"),
            );
        }
    }

    fn is_due(&self) -> bool {
        self.due.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::time::Duration;

    use http_body_util::Full;
    use hyper::body::{Bytes, Incoming};
    use hyper::service::service_fn;
    use hyper::{Request, Response};
    use hyper_util::rt::TokioIo;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};
    use tokio::sync::{mpsc, oneshot};

    use super::*;

    /// A bound on waits that should end at once; reaching it fails the test.
    const BOUND: Duration = Duration::from_secs(5);

    /// Serves one accepted connection under `connections`; each request
    /// reports on `arrived` and is answered when the test sends on the
    /// oneshot it carries.
    async fn serve_one(
        listener: &TcpListener,
        connections: &Connections,
        arrived: mpsc::UnboundedSender<oneshot::Sender<()>>,
    ) -> tokio::task::JoinHandle<()> {
        let (stream, _) = listener.accept().await.unwrap();
        let service = service_fn(move |_req: Request<Incoming>| {
            let arrived = arrived.clone();
            async move {
                let (answer, wait) = oneshot::channel();
                let _ = arrived.send(answer);
                let _ = wait.await;
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
            }
        });
        let conn = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(stream), service);
        let watched = connections.watch(conn);
        tokio::spawn(async move {
            let _ = watched.await;
        })
    }

    async fn read_response(client: &mut TcpStream) -> String {
        let mut buf = vec![0; 1024];
        let mut got = String::new();
        while !got.ends_with("done") {
            let n = tokio::time::timeout(BOUND, client.read(&mut buf))
                .await
                .expect("response within the bound")
                .unwrap();
            assert!(n > 0, "connection closed before the response: {got:?}");
            got.push_str(std::str::from_utf8(&buf[..n]).unwrap());
        }
        got
    }

    async fn expect_eof(client: &mut TcpStream) {
        let mut buf = [0; 64];
        let n = tokio::time::timeout(BOUND, client.read(&mut buf))
            .await
            .expect("close within the bound")
            .unwrap();
        assert_eq!(n, 0, "expected the connection closed");
    }

    const GET: &[u8] = b"GET / HTTP/1.1\r\nhost: t\r\n\r\n";

    /// A listener and a client connected to it.
    async fn connected() -> (TcpListener, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        (listener, client)
    }

    async fn finished(shutdown: tokio::task::JoinHandle<()>) {
        tokio::time::timeout(BOUND, shutdown)
            .await
            .expect("shutdown ends with the last connection")
            .unwrap();
    }

    #[tokio::test]
    async fn shutdown_with_nothing_open_returns_at_once() {
        tokio::time::timeout(BOUND, Connections::new().shutdown())
            .await
            .expect("no connection to wait for");
    }

    #[tokio::test]
    async fn idle_keep_alive_connection_is_closed() {
        let (listener, mut client) = connected().await;
        let connections = Connections::new();
        let (tx, mut arrived) = mpsc::unbounded_channel();
        let served = serve_one(&listener, &connections, tx).await;
        client.write_all(GET).await.unwrap();
        arrived.recv().await.unwrap().send(()).unwrap();
        let first = read_response(&mut client).await;
        assert!(first.starts_with("HTTP/1.1 200"), "{first}");
        assert!(!first.contains("connection: close"), "{first}");

        tokio::time::timeout(BOUND, connections.shutdown())
            .await
            .expect("shutdown ends once the idle connection closed");
        expect_eof(&mut client).await;
        served.await.unwrap();
    }

    #[tokio::test]
    async fn request_in_flight_finishes_then_the_connection_closes() {
        let (listener, mut client) = connected().await;
        let connections = Connections::new();
        let shared = connections.shared.clone();
        let (tx, mut arrived) = mpsc::unbounded_channel();
        let _served = serve_one(&listener, &connections, tx).await;
        client.write_all(GET).await.unwrap();
        let answer = arrived.recv().await.unwrap();

        let shutdown = tokio::spawn(connections.shutdown());
        while !shared.draining.load(Ordering::Acquire) {
            tokio::task::yield_now().await;
        }
        assert!(!shutdown.is_finished(), "a request is still in flight");
        answer.send(()).unwrap();
        let response = read_response(&mut client).await;
        assert!(response.starts_with("HTTP/1.1 200"), "{response}");
        assert!(response.contains("connection: close"), "{response}");
        expect_eof(&mut client).await;
        finished(shutdown).await;
    }

    #[tokio::test]
    async fn connection_not_yet_polled_still_closes() {
        let (listener, mut client) = connected().await;
        let connections = Connections::new();
        let (stream, _) = listener.accept().await.unwrap();
        let service = service_fn(|_req: Request<Incoming>| async {
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from_static(b"done"))))
        });
        let watched = connections.watch(
            hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service),
        );
        // Draining starts before the connection's first poll, so it never
        // handed over a waker; it must see the flag when first polled.
        let shutdown = tokio::spawn(connections.shutdown());
        tokio::task::yield_now().await;
        let served = tokio::spawn(watched);
        expect_eof(&mut client).await;
        served.await.unwrap().unwrap();
        finished(shutdown).await;
    }
}
