//! Long waits (a request's upstream timeout, 60 s by default) kept in a
//! worker's own list and looked at on the worker's anchor tick, instead of
//! tokio's timer. Such a wait is set on every forwarded request and almost
//! never reached; a tokio timer cost ~600 instructions a request (made,
//! registered in the driver's wheel under its lock on the first wait,
//! taken out again when dropped), a slot here ~190: ~350 less on the
//! default app-proxy route (bench/versus-nginx.sh).
//!
//! The price is precision: a deadline is seen at the first tick after it
//! ([`TICK`], half a second) or at the wait's next wake, so only waits of
//! [`LONG`] or more are kept here, where that is within 5%. nginx's own
//! timers are exact to the millisecond; its `proxy_read_timeout` of 60 s
//! ending at 60.5 s is no difference a client sees.
//!
//! Only threads that tick keep a list ([`keep_here`]: the routing core's
//! workers, whose runtimes run on one thread each); elsewhere
//! [`Deadline::new`] gives `None` and the caller uses tokio's timer.

use std::cell::RefCell;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use crate::coarse_clock::{coarse_now, millis};

/// How often a keeping thread must call [`tick`].
pub const TICK: Duration = crate::worker_beat::BEAT_EVERY;

/// The shortest wait kept here: [`TICK`] is 5% of it.
pub const LONG: Duration = Duration::from_secs(10);

thread_local! {
    /// This thread's waits, when it keeps them.
    static LIST: RefCell<Option<List>> = const { RefCell::new(None) };
}

/// Waits by slot; a free slot's time is 0.
#[derive(Default)]
struct List {
    slots: Vec<Slot>,
    free: Vec<usize>,
}

struct Slot {
    /// When it ends, in the coarse clock's milliseconds; 0 when free.
    at: u64,
    /// Who waits, once it has waited.
    waker: Option<Waker>,
}

/// Makes this thread keep long waits: its runtime calls [`tick`] every
/// [`TICK`] from now on.
pub fn keep_here() {
    LIST.with(|l| {
        l.borrow_mut().get_or_insert_default();
    });
}

/// Wakes the waits whose time has passed: every [`TICK`], on a thread
/// that keeps them.
pub fn tick() {
    let now = millis(coarse_now());
    // Woken once the list is let go: a waker may make a wait of its own.
    let ended: Vec<Waker> = LIST.with(|l| {
        let mut list = l.borrow_mut();
        let Some(list) = list.as_mut() else {
            return Vec::new();
        };
        (list.slots.iter_mut())
            .filter(|slot| slot.at != 0 && slot.at <= now)
            .filter_map(|slot| slot.waker.take())
            .collect()
    });
    ended.into_iter().for_each(Waker::wake);
}

/// A wait's end, kept in this thread's list while the wait is polled.
/// Dropped, it leaves the list. It belongs to the thread that made it (a
/// worker's tasks never move): polled on another, it panics, rather than
/// take a slot of another thread's list.
#[derive(Debug)]
pub struct Deadline {
    /// When it ends, in the coarse clock's milliseconds.
    at: u64,
    /// Its slot in the list, once polled.
    slot: Option<usize>,
    /// The list's thread: the address of its thread-local.
    home: usize,
}

/// This thread's list's address, which no other live thread's shares.
fn here() -> usize {
    LIST.with(|l| l as *const RefCell<Option<List>> as usize)
}

impl Deadline {
    /// For a wait of `wait` in all, its end set `first` from now (a first
    /// stage of it; [`Self::extend`] moves on): `None` when the wait is
    /// shorter than [`LONG`] or this thread keeps no list (tokio's timer
    /// then).
    pub fn new(wait: Duration, first: Duration) -> Option<Deadline> {
        if wait < LONG || !LIST.with(|l| l.borrow().is_some()) {
            return None;
        }
        Some(Deadline {
            at: millis(coarse_now() + first),
            slot: None,
            home: here(),
        })
    }

    /// Moves its end to `after` from now.
    pub fn reset(&mut self, after: Duration) {
        self.set(millis(coarse_now() + after));
    }

    /// Moves its end `by` later.
    pub fn extend(&mut self, by: Duration) {
        self.set(self.at + millis(by));
    }

    fn set(&mut self, at: u64) {
        self.at = at;
        if let Some(i) = self.slot
            && self.home == here()
        {
            LIST.with(|l| {
                if let Some(list) = l.borrow_mut().as_mut() {
                    list.slots[i].at = self.at;
                }
            });
        }
    }

    /// Ready once its time has passed; else the wait is woken by the tick
    /// after it (or sooner, by whatever else it waits on).
    pub fn poll_passed(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if millis(coarse_now()) >= self.at {
            return Poll::Ready(());
        }
        assert_eq!(
            self.home,
            here(),
            "a coarse deadline was polled off the thread that made it"
        );
        LIST.with(|l| {
            let mut list = l.borrow_mut();
            // Kept since `new`: the list is never taken away.
            let Some(list) = list.as_mut() else { return };
            match self.slot {
                Some(i) => {
                    let slot = &mut list.slots[i];
                    match &slot.waker {
                        Some(w) if w.will_wake(cx.waker()) => {}
                        _ => slot.waker = Some(cx.waker().clone()),
                    }
                }
                None => {
                    let slot = Slot {
                        at: self.at,
                        waker: Some(cx.waker().clone()),
                    };
                    let i = match list.free.pop() {
                        Some(i) => {
                            list.slots[i] = slot;
                            i
                        }
                        None => {
                            list.slots.push(slot);
                            list.slots.len() - 1
                        }
                    };
                    self.slot = Some(i);
                }
            }
        });
        Poll::Pending
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        let Some(i) = self.slot else { return };
        // `try_with`: a deadline dropped as the thread ends. Dropped on
        // another thread (only ever polled on its own), its slot stays
        // taken, woken once in vain.
        let _ = LIST.try_with(|l| {
            if l as *const RefCell<Option<List>> as usize != self.home {
                return;
            }
            if let Some(list) = l.borrow_mut().as_mut() {
                list.slots[i] = Slot { at: 0, waker: None };
                list.free.push(i);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn waker() -> (Arc<Count>, Waker) {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        (count.clone(), Waker::from(count))
    }

    fn slots_in_use() -> usize {
        LIST.with(|l| {
            let l = l.borrow();
            let list = l.as_ref().unwrap();
            list.slots.len() - list.free.len()
        })
    }

    /// Short waits and threads that keep no list get none; a long wait is
    /// pending, woken by the tick once its time has passed (moved back
    /// here to make it so), and its slot freed and reused after it.
    #[test]
    fn a_long_wait_is_woken_by_the_tick_after_its_time() {
        std::thread::spawn(|| {
            let minute = Duration::from_secs(60);
            assert!(Deadline::new(minute, minute).is_none(), "no list");
            keep_here();
            let second = Duration::from_secs(1);
            assert!(Deadline::new(second, second).is_none(), "short");
            let (woken, w) = waker();
            let mut cx = Context::from_waker(&w);
            let mut d = Deadline::new(minute, second).unwrap();
            d.extend(minute - second);
            assert!(d.poll_passed(&mut cx).is_pending());
            assert!(d.poll_passed(&mut cx).is_pending());
            assert_eq!(slots_in_use(), 1, "one slot, however often polled");
            tick();
            assert_eq!(woken.0.load(Ordering::Relaxed), 0, "woken early");
            // Its time passes: the slot says so, as the clock would.
            LIST.with(|l| l.borrow_mut().as_mut().unwrap().slots[0].at = 1);
            tick();
            assert_eq!(woken.0.load(Ordering::Relaxed), 1);
            tick();
            assert_eq!(woken.0.load(Ordering::Relaxed), 1, "woken once");
            d.reset(Duration::ZERO);
            assert!(d.poll_passed(&mut cx).is_ready());
            drop(d);
            assert_eq!(slots_in_use(), 0);
            let mut again = Deadline::new(minute, minute).unwrap();
            assert!(again.poll_passed(&mut cx).is_pending());
            assert_eq!(LIST.with(|l| l.borrow().as_ref().unwrap().slots.len()), 1);
        })
        .join()
        .unwrap();
    }
}
