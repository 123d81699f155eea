//! One dial at a time for a connection many requests share (an HTTP/2
//! upstream's, a tunnel server's link to a peer).
//!
//! Requests that find the connection missing together wait for one dial
//! instead of each making its own: a burst on a cold pool (at start, after
//! the upstream or peer restarted) would otherwise open as many
//! connections, TLS handshakes included, as it has requests, and keep
//! only one. Those that waited on a dial that failed get its error rather
//! than dialling again in turn: against an address that hangs, each would
//! wait out the connect timeout after the one before it.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};

/// The dial in progress, and what the last one to finish left behind.
#[derive(Debug)]
pub struct SharedDial<E> {
    /// Held while dialling, with the last finished dial's error.
    dialling: tokio::sync::Mutex<Option<E>>,
    /// Dials finished, so a request that waited knows one ended meanwhile.
    finished: AtomicU64,
}

impl<E> Default for SharedDial<E> {
    fn default() -> Self {
        SharedDial {
            dialling: tokio::sync::Mutex::new(None),
            finished: AtomicU64::new(0),
        }
    }
}

impl<E: Clone> SharedDial<E> {
    /// Returns what `reuse` finds once the dial in progress (if any) is
    /// over, else that dial's error if it failed while this request
    /// waited, else the result of `dial`, which must leave a connection it
    /// made where `reuse` finds it. A dial given up half way (its caller's
    /// timeout dropped it) leaves nothing: those waiting then dial.
    pub async fn get<T, Fut>(
        &self,
        reuse: impl Fn() -> Option<T>,
        dial: impl FnOnce() -> Fut,
    ) -> Result<T, E>
    where
        Fut: Future<Output = Result<T, E>>,
    {
        let before = self.finished.load(Ordering::Acquire);
        let mut failed = self.dialling.lock().await;
        if let Some(found) = reuse() {
            return Ok(found);
        }
        if self.finished.load(Ordering::Acquire) != before
            && let Some(error) = failed.as_ref()
        {
            return Err(error.clone());
        }
        let dialled = dial().await;
        *failed = dialled.as_ref().err().cloned();
        self.finished.fetch_add(1, Ordering::Release);
        dialled
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::Mutex;
    use std::sync::atomic::AtomicUsize;

    /// A connection store and a dialler that counts its dials and fails
    /// while `fail` is set, each dial taking until `go` lets it finish.
    struct Fixture {
        shared: SharedDial<String>,
        made: Mutex<Option<u32>>,
        dials: AtomicUsize,
        /// Requests that reached the shared dial (parked on it at once).
        arrived: AtomicUsize,
        fail: std::sync::atomic::AtomicBool,
        go: tokio::sync::Notify,
    }

    impl Fixture {
        fn new(fail: bool) -> Arc<Fixture> {
            Arc::new(Fixture {
                shared: SharedDial::default(),
                made: Mutex::new(None),
                dials: AtomicUsize::new(0),
                arrived: AtomicUsize::new(0),
                fail: fail.into(),
                go: tokio::sync::Notify::new(),
            })
        }

        async fn get(self: Arc<Self>) -> Result<u32, String> {
            let reuse = || *self.made.lock().unwrap();
            if let Some(found) = reuse() {
                return Ok(found);
            }
            // Nothing awaits between this and waiting for the lock (or
            // dialling), so the count says who is parked there.
            self.arrived.fetch_add(1, Ordering::SeqCst);
            self.shared
                .get(reuse, || async {
                    let n = self.dials.fetch_add(1, Ordering::SeqCst) as u32;
                    self.go.notified().await;
                    if self.fail.load(Ordering::SeqCst) {
                        return Err(format!("dial {n} failed"));
                    }
                    *self.made.lock().unwrap() = Some(n);
                    Ok(n)
                })
                .await
        }
    }

    /// Starts `n` requests and lets the first dial finish once all wait.
    async fn burst(f: &Arc<Fixture>, n: usize) -> Vec<Result<u32, String>> {
        let before = f.arrived.load(Ordering::SeqCst);
        let tasks: Vec<_> = (0..n).map(|_| tokio::spawn(f.clone().get())).collect();
        // All are parked: one in the dial, the rest on the lock.
        while f.arrived.load(Ordering::SeqCst) < before + n {
            tokio::task::yield_now().await;
        }
        f.go.notify_one();
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    }

    #[tokio::test]
    async fn a_burst_shares_one_dial() {
        let f = Fixture::new(false);
        let got = burst(&f, 20).await;
        assert!(got.iter().all(|r| r == &Ok(0)), "{got:?}");
        assert_eq!(f.dials.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn those_waiting_on_a_failed_dial_get_its_error_and_the_next_dials_again() {
        let f = Fixture::new(true);
        let got = burst(&f, 20).await;
        assert!(
            got.iter().all(|r| r == &Err("dial 0 failed".to_owned())),
            "{got:?}"
        );
        assert_eq!(f.dials.load(Ordering::SeqCst), 1);
        // A request after the failure dials again.
        f.fail.store(false, Ordering::SeqCst);
        let got = burst(&f, 3).await;
        assert!(got.iter().all(|r| r == &Ok(1)), "{got:?}");
        assert_eq!(f.dials.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_dial_given_up_half_way_leaves_the_next_to_dial() {
        let f = Fixture::new(false);
        let first = tokio::spawn(f.clone().get());
        while f.dials.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        let waiting = tokio::spawn(f.clone().get());
        while f.arrived.load(Ordering::SeqCst) < 2 {
            tokio::task::yield_now().await;
        }
        first.abort();
        // The waiter takes the lock and dials for itself.
        while f.dials.load(Ordering::SeqCst) < 2 {
            tokio::task::yield_now().await;
        }
        f.go.notify_one();
        assert_eq!(waiting.await.unwrap(), Ok(1));
    }
}
