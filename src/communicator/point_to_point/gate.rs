//! The gate: messages that start only once an operation of the communicator
//! has finished. A gather or a scatter on host memory moves its bytes as
//! messages, but first runs a check on the engine (the call's descriptor,
//! compared across ranks like any collective's). Its messages wait at the
//! gate until the check passes, so that ranks that disagree on the root, the
//! size or the type fail with the check's [`Error::Mismatch`] naming both,
//! and no message is ever matched against another call's.
//!
//! A reduce moved as a chain of messages (`chain`) waits here too, and its
//! chain runs here: each chunk received is reduced before it is sent on.
//!
//! Messages keep the order they were issued in, as NCCL's do: a point-to-point
//! message issued while the gate holds calls (or runs one) queues behind them
//! and starts after theirs ([`Gate::post_in_order`]), so that every peer
//! sees each rank's messages in issue order.
//!
//! One thread per communicator, made when the first such call is issued,
//! waits for the checks in the order they were queued and hands each call's
//! messages to the engine (or fails them with the check's error). It
//! allocates nothing per call once warm: the lists it is handed come back to
//! it, and a chain's scratch is kept.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::thread::JoinHandle;

use super::chain::Chain;
use super::hand_over::{GatedPosts, closed, hand_over_list};
use super::{PointToPoint, Posted};
use crate::communicator::Call;
use crate::error::{Error, Result};

/// Waits for the communicator's operation of this sequence number: its
/// failure, or a timeout, if it does not finish.
pub(crate) type CheckWait = Box<dyn Fn(u64) -> Result<()> + Send + Sync>;

/// The gate of one communicator (see the module's documentation).
pub(super) struct Gate {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

struct Shared {
    queue: Mutex<Queue>,
    wake: Condvar,
}

struct Queue {
    /// Cleared when the communicator closes; the thread then ends.
    open: bool,
    /// Calls waiting for their check, in the order they were issued.
    waiting: VecDeque<Gated>,
    /// The thread is running a call (it has left `waiting`).
    busy: bool,
    /// Emptied lists, for the next calls.
    free: Vec<GatedPosts>,
}

/// One call's messages, waiting for the check `check` (none: a message
/// issued behind gated calls).
struct Gated {
    check: Option<u64>,
    job: Job,
}

/// What a call's messages are: posts handed to their p2p as they are,
/// or a chained reduce's, which the gate runs.
enum Job {
    Posts(GatedPosts),
    Chain(Chain),
}

impl Gate {
    pub(super) fn new() -> Gate {
        Gate {
            shared: Arc::new(Shared {
                queue: Mutex::new(Queue {
                    open: true,
                    waiting: VecDeque::new(),
                    busy: false,
                    free: Vec::new(),
                }),
                wake: Condvar::new(),
            }),
            thread: Mutex::new(None),
        }
    }

    /// Starts the gate's thread unless it runs: it waits with `wait` (made
    /// only the first time) and posts on `p2p`. Refused once closed.
    pub(super) fn open(
        &self,
        p2p: &Arc<PointToPoint>,
        wait: impl FnOnce() -> CheckWait,
    ) -> Result<()> {
        let mut thread = self.thread.lock().unwrap_or_else(PoisonError::into_inner);
        if !self.shared.lock().open {
            return Err(Error::invalid("comm", "the communicator is closing"));
        }
        if thread.is_none() {
            let (shared, p2p, wait) = (Arc::clone(&self.shared), Arc::downgrade(p2p), wait());
            let rank = p2p.upgrade().map_or(0, |c| c.rank);
            let spawned = std::thread::Builder::new()
                .name(format!("fairring-gate-{rank}"))
                .spawn(move || run(&shared, &p2p, &wait))
                .map_err(|e| Error::io("starting the gate of gathers, scatters and reduces", e))?;
            *thread = Some(spawned);
        }
        Ok(())
    }

    /// An empty list for one call's messages, with room for `n`.
    pub(super) fn list(&self, n: usize) -> GatedPosts {
        let mut list = self
            .shared
            .lock()
            .free
            .pop()
            .unwrap_or(GatedPosts(Vec::new()));
        list.0.reserve(n);
        list
    }

    /// Queues `posts` to start once operation `check` has finished. Never
    /// refused: the posts fail if the gate closes first.
    pub(super) fn queue(&self, check: u64, posts: GatedPosts) {
        self.enqueue(Some(check), Job::Posts(posts));
    }

    /// Queues `chain` to run once operation `check` has finished. Never
    /// refused: its posts fail if the gate closes first.
    pub(super) fn queue_chain(&self, check: u64, chain: Chain) {
        self.enqueue(Some(check), Job::Chain(chain));
    }

    /// Starts `call` on `p2p` at once if the gate holds no call;
    /// otherwise queues it behind them, so that it starts after every
    /// message issued before it.
    ///
    /// # Safety
    ///
    /// `call`'s memory must stay valid and unshared until `posted` reports
    /// completion.
    pub(super) unsafe fn post_in_order(&self, p2p: &PointToPoint, call: Call, posted: Arc<Posted>) {
        let mut queue = self.shared.lock();
        if queue.open && (queue.busy || !queue.waiting.is_empty()) {
            let mut list = queue.free.pop().unwrap_or(GatedPosts(Vec::new()));
            list.0.push((call, posted));
            queue.waiting.push_back(Gated {
                check: None,
                job: Job::Posts(list),
            });
            drop(queue);
            self.shared.wake.notify_one();
        } else {
            // Every call issued before this one has been handed over (the
            // gate is idle); one issued after it, by this thread, is issued
            // once this returns.
            drop(queue);
            // SAFETY: forwarded.
            unsafe { p2p.start(call, posted) };
        }
    }

    fn enqueue(&self, check: Option<u64>, job: Job) {
        let mut queue = self.shared.lock();
        if queue.open {
            queue.waiting.push_back(Gated { check, job });
            drop(queue);
            self.shared.wake.notify_one();
        } else {
            drop(queue);
            let mut lost = |_: GatedPosts| {};
            match job {
                Job::Posts(posts) => fail(posts, &closed()),
                Job::Chain(chain) => chain.run(&Err(closed()), None, &mut Vec::new(), &mut lost),
            }
        }
    }

    /// Ends the thread once it has settled every call queued so far (each
    /// waits at most for its check's timeout), and joins it.
    pub(super) fn close(&self) {
        self.shared.lock().open = false;
        self.shared.wake.notify_all();
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The gate's thread: each queued call in turn, until closed and drained.
fn run(shared: &Shared, p2p: &Weak<PointToPoint>, wait: &CheckWait) {
    // A chained reduce's landing slots, made by the first and kept.
    let mut scratch: Vec<u64> = Vec::new();
    loop {
        let next = {
            let mut queue = shared.lock();
            queue.busy = false;
            loop {
                if let Some(g) = queue.waiting.pop_front() {
                    queue.busy = true;
                    break g;
                }
                if !queue.open {
                    return;
                }
                queue = shared
                    .wake
                    .wait(queue)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        };
        let outcome = next.check.map_or(Ok(()), wait);
        let p2p = p2p.upgrade();
        let mut give_back = |list: GatedPosts| {
            let mut queue = shared.lock();
            if queue.open && list.0.capacity() > 0 {
                queue.free.push(list);
            }
        };
        match next.job {
            Job::Posts(posts) => hand_over_list(posts, &outcome, p2p.as_ref(), &mut give_back),
            Job::Chain(chain) => chain.run(&outcome, p2p.as_ref(), &mut scratch, &mut give_back),
        }
    }
}

/// Fails every post of `posts` with `error`.
fn fail(posts: GatedPosts, error: &Error) {
    for (_, posted) in posts.0 {
        posted.settle(Err(error.clone()));
    }
}
