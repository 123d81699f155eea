//! Spreading one listener's connections evenly over the workers.
//!
//! Each worker accepts on its own `SO_REUSEPORT` socket, and the kernel
//! picks the socket by a hash of the connection's addresses, not by how
//! busy each worker is. With many short connections that evens out; with
//! a few long-lived ones — an ingress controller's keep-alive pool, a
//! tunnel client, wrk's 64 — it does not: 39 and 26 of 64 connections
//! were measured on two workers, and a pool of 4 can land 3 and 1, leaving
//! one worker the bottleneck and its connections the slow tail. So, like
//! Envoy's `exact_balance`, a worker that accepts a connection while
//! another worker holds fewer hands it over to that one; the open
//! connections per worker then never differ by more than one as they
//! arrive. A hand-over costs the move of one socket between two threads'
//! event loops, once per connection, nothing per request.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;

/// A connection on its way to another worker, with the slot it took
/// under the listener's connection cap.
pub struct Handoff {
    /// The accepted socket (non-blocking, registered with no event loop).
    pub stream: std::net::TcpStream,
    /// The client's address.
    pub client: SocketAddr,
    /// Its slot under the listener's connection cap.
    pub permit: OwnedSemaphorePermit,
    /// Its place in the worker's count.
    pub counted: Counted,
}

/// One listener's open connections per worker, and a way to hand a
/// connection to each worker.
pub struct Balance {
    open: Box<[Count]>,
    inboxes: Box<[mpsc::UnboundedSender<Handoff>]>,
}

/// One worker's count, alone on its cache line: each worker updates its
/// own on every connection, and all read them all.
#[derive(Default)]
#[repr(align(128))]
struct Count(AtomicUsize);

/// A connection counted against a worker; the count drops with it.
pub struct Counted {
    balance: Arc<Balance>,
    worker: usize,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.balance.open[self.worker]
            .0
            .fetch_sub(1, Ordering::Relaxed);
    }
}

impl Balance {
    /// A balance over `workers` workers, and each worker's inbox.
    pub fn new(workers: usize) -> (Arc<Balance>, Vec<mpsc::UnboundedReceiver<Handoff>>) {
        let (inboxes, receivers): (Vec<_>, Vec<_>) =
            (0..workers).map(|_| mpsc::unbounded_channel()).unzip();
        let balance = Balance {
            open: (0..workers).map(|_| Count::default()).collect(),
            inboxes: inboxes.into_boxed_slice(),
        };
        (Arc::new(balance), receivers)
    }

    /// Where a connection `worker` just accepted is served, counted there:
    /// the worker holding the fewest open connections when that is fewer
    /// than `worker` holds, otherwise `worker` itself (ties stay, so
    /// evenly spread connections never move).
    pub fn place(self: &Arc<Self>, worker: usize) -> Counted {
        let mine = self.open[worker].0.load(Ordering::Relaxed);
        let (least, fewest) = self
            .open
            .iter()
            .map(|c| c.0.load(Ordering::Relaxed))
            .enumerate()
            .min_by_key(|&(_, n)| n)
            .unwrap_or((worker, mine));
        let to = if fewest < mine { least } else { worker };
        self.open[to].0.fetch_add(1, Ordering::Relaxed);
        Counted {
            balance: self.clone(),
            worker: to,
        }
    }

    /// Sends a connection counted elsewhere to its worker; gives it back
    /// if that worker has stopped listening.
    pub fn hand_over(&self, handoff: Handoff) -> Result<(), Handoff> {
        self.inboxes[handoff.counted.worker]
            .send(handoff)
            .map_err(|e| e.0)
    }

    /// Counts a connection against `worker` whatever the others hold
    /// (one handed back by a worker that stopped).
    pub fn count_on(self: &Arc<Self>, worker: usize) -> Counted {
        self.open[worker].0.fetch_add(1, Ordering::Relaxed);
        Counted {
            balance: self.clone(),
            worker,
        }
    }
}

impl Counted {
    /// The worker this connection is counted against.
    pub fn worker(&self) -> usize {
        self.worker
    }
}

/// A connection a worker serves: the socket, the client's address, its
/// slot under the connection cap and its place in the worker's count.
pub type Arrival = (TcpStream, SocketAddr, OwnedSemaphorePermit, Counted);

/// One worker's socket of a listener, its inbox and the listener's balance.
pub struct Accepting<'a> {
    /// This worker's `SO_REUSEPORT` socket.
    pub socket: &'a TcpListener,
    /// The listener's name, for logs.
    pub name: &'a str,
    /// The balance over the listener's workers.
    pub balance: &'a Arc<Balance>,
    /// This worker.
    pub worker: usize,
    /// Connections other workers hand to this one.
    pub inbox: &'a mut mpsc::UnboundedReceiver<Handoff>,
}

impl Accepting<'_> {
    /// The next connection this worker serves: one it accepts and keeps,
    /// or one another worker hands it. A connection accepted here while
    /// another worker holds fewer goes to that worker. None once `stop` is
    /// cancelled or the cap's semaphore is closed.
    ///
    /// The cap is shared by the workers, so a slot is taken after
    /// accepting: a worker that held one while waiting on its own socket
    /// would starve the others. Each worker holds at most one accepted
    /// connection waiting for a slot; the rest stay queued in the kernel.
    pub async fn next(
        &mut self,
        limit: impl Fn() -> Arc<Semaphore>,
        stop: &CancellationToken,
    ) -> Option<Arrival> {
        loop {
            tokio::select! {
                pair = crate::sockets::accept(self.socket, self.name) => {
                    let (stream, client) = pair;
                    let permit = tokio::select! {
                        p = limit().acquire_owned() => p.ok()?,
                        _ = stop.cancelled() => return None,
                    };
                    let counted = self.balance.place(self.worker);
                    if counted.worker() == self.worker {
                        return Some((stream, client, permit, counted));
                    }
                    if let Some(back) = self.hand_over((stream, client, permit, counted)) {
                        return Some(back);
                    }
                }
                Some(h) = self.inbox.recv() => match TcpStream::from_std(h.stream) {
                    Ok(stream) => return Some((stream, h.client, h.permit, h.counted)),
                    Err(e) => {
                        tracing::warn!(listener = %self.name, error = %e, "cannot take over a connection from another worker");
                    }
                },
                _ = stop.cancelled() => return None,
            }
        }
    }

    /// Sends a connection this worker accepted to the worker `counted`
    /// names. If that worker has stopped listening (the listener is
    /// closing), gives it back to be served here.
    fn hand_over(&self, (stream, client, permit, counted): Arrival) -> Option<Arrival> {
        let stream = match stream.into_std() {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(client = %client, error = %e, "cannot hand a connection to another worker");
                return None;
            }
        };
        let Handoff {
            stream,
            client,
            permit,
            counted,
        } = self
            .balance
            .hand_over(Handoff {
                stream,
                client,
                permit,
                counted,
            })
            .err()?;
        drop(counted);
        match TcpStream::from_std(stream) {
            Ok(stream) => Some((stream, client, permit, self.balance.count_on(self.worker))),
            Err(e) => {
                tracing::warn!(client = %client, error = %e, "cannot take a connection back");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_go_to_the_worker_holding_the_fewest() {
        let (balance, _inboxes) = Balance::new(3);
        // Every connection lands on worker 0's socket, as the kernel's
        // hash can do with a few long-lived ones.
        let held: Vec<Counted> = (0..7).map(|_| balance.place(0)).collect();
        let mut per_worker = [0; 3];
        for c in &held {
            per_worker[c.worker()] += 1;
        }
        assert_eq!(per_worker, [3, 2, 2]);

        // Ties stay where they were accepted: no move for nothing.
        let (even, _inboxes) = Balance::new(2);
        let a = even.place(1);
        assert_eq!(a.worker(), 1);
        let b = even.place(0);
        assert_eq!(b.worker(), 0);

        // A closed connection frees its worker's place for the next.
        let (on_2, _kept): (Vec<_>, Vec<_>) = held.into_iter().partition(|c| c.worker() == 2);
        drop(on_2);
        assert_eq!(balance.place(1).worker(), 2);
    }

    #[test]
    fn a_connection_reaches_its_worker_or_comes_back() {
        let (balance, mut inboxes) = Balance::new(2);
        let busy = balance.place(0);
        assert_eq!(busy.worker(), 0);
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let handoff = |counted: Counted| {
            let _client = std::net::TcpStream::connect(addr).unwrap();
            let (stream, client) = listener.accept().unwrap();
            let permit = Arc::new(tokio::sync::Semaphore::new(1))
                .try_acquire_owned()
                .unwrap();
            Handoff {
                stream,
                client,
                permit,
                counted,
            }
        };
        let moved = balance.place(0);
        assert_eq!(moved.worker(), 1);
        assert!(balance.hand_over(handoff(moved)).is_ok());
        let arrived = inboxes[1].try_recv().unwrap();
        assert_eq!(arrived.counted.worker(), 1);

        // Worker 1 stops listening: the next one comes back to the sender.
        drop(inboxes.remove(1));
        drop(arrived);
        let moved = balance.place(0);
        assert_eq!(moved.worker(), 1);
        let back = balance.hand_over(handoff(moved)).unwrap_err();
        assert_eq!(back.counted.worker(), 1);
    }
}
