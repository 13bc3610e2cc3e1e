//! [`Message`]: posted messages, waited on, tested and dropped; what each is
//! before the engine has it ([`Posted`]); and the [`Pool`] that recycles
//! both, so that a warm message allocates nothing.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use crate::communicator::WorkerEngine;
use crate::error::{Error, Result};

/// Messages in flight, a [`Work`](crate::Work)'s: its sends and receives
/// (an all-to-all's among them), or the messages of its gathers, scatters
/// and reduces, from when they are posted (perhaps still waiting at the gate
/// behind a gather's) to when they have finished.
///
/// Dropping it waits for them to finish.
#[must_use = "a message runs until waited on or dropped"]
pub(crate) struct Message {
    posts: Posts,
    pool: Arc<Pool>,
}

/// One message, or several (an all-to-all's): one needs no list.
enum Posts {
    One(Arc<Posted>),
    Many(Vec<Arc<Posted>>),
}

impl Posts {
    fn as_slice(&self) -> &[Arc<Posted>] {
        match self {
            Posts::One(p) => std::slice::from_ref(p),
            Posts::Many(v) => v,
        }
    }
}

/// What a posted message is, shared by its [`Message`] and, until it starts,
/// the gate's queue.
pub(crate) struct Posted {
    state: Mutex<Phase>,
    changed: Condvar,
    /// Threads waiting on `changed`, read and written only under `state`'s
    /// lock (which orders them): a change wakes them only if there are
    /// any, sparing a message that nobody waits on to start a system call.
    waiting: AtomicU32,
    /// How long a wait may take: the communicator's timeout.
    timeout: Duration,
    /// The peer, whether this rank sends to it (else receives from it), and
    /// the tag.
    peer: u32,
    sending: bool,
    tag: u32,
}

enum Phase {
    /// Not yet handed to the engine (at the gate).
    Queued,
    /// The engine's message `id`.
    Started(Arc<WorkerEngine>, u64),
    /// Finished on the host, by the gate (a chained reduce's last step).
    Finished,
    Failed(Error),
}

/// How long a finished message waits for its settler to let go of it before
/// it is let go of instead of reused.
const SETTLER_LETS_GO: Duration = Duration::from_millis(1);

/// Recycled messages and lists of them. Once closed (with the
/// communicator), what comes back is let go of.
pub(crate) struct Pool {
    free: Mutex<Free>,
}

struct Free {
    open: bool,
    posted: Vec<Arc<Posted>>,
    lists: Vec<Vec<Arc<Posted>>>,
}

impl Pool {
    pub(super) fn new() -> Arc<Pool> {
        Arc::new(Pool {
            free: Mutex::new(Free {
                open: true,
                posted: Vec::new(),
                lists: Vec::new(),
            }),
        })
    }

    /// A queued message to or from `peer` (`sending`: to it), of `tag`.
    pub(super) fn posted(
        &self,
        peer: u32,
        sending: bool,
        tag: u32,
        timeout: Duration,
    ) -> Arc<Posted> {
        let recycled = self.lock().posted.pop();
        let fresh = Posted {
            state: Mutex::new(Phase::Queued),
            changed: Condvar::new(),
            waiting: AtomicU32::new(0),
            timeout,
            peer,
            sending,
            tag,
        };
        match recycled {
            // Only the pool held it: reset in place.
            Some(mut p) => match Arc::get_mut(&mut p) {
                Some(slot) => {
                    slot.timeout = timeout;
                    (slot.peer, slot.sending, slot.tag) = (peer, sending, tag);
                    *slot.state.get_mut().unwrap_or_else(PoisonError::into_inner) = Phase::Queued;
                    p
                }
                None => Arc::new(fresh),
            },
            None => Arc::new(fresh),
        }
    }

    /// An empty list with room for `n`.
    pub(super) fn list(&self, n: usize) -> Vec<Arc<Posted>> {
        let mut list = self.lock().lists.pop().unwrap_or_default();
        list.reserve(n);
        list
    }

    /// Lets go of everything pooled, and of everything that comes back later.
    pub(super) fn close(&self) {
        let mut free = self.lock();
        free.open = false;
        free.posted = Vec::new();
        free.lists = Vec::new();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Free> {
        self.free.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Takes back `p` (a finished message's), if nothing else holds it,
    /// once its message has finished (see [`Posted::let_go`]), outside the
    /// pool's lock.
    fn give_back(&self, mut p: Arc<Posted>) {
        p.let_go();
        // Whoever settled it (the gate, a poster) lets go of it right after
        // waking its waiters: a moment's wait keeps it for reuse.
        let deadline = Instant::now() + SETTLER_LETS_GO;
        while Arc::strong_count(&p) > 1 && Instant::now() < deadline {
            std::thread::yield_now();
        }
        let Some(slot) = Arc::get_mut(&mut p) else {
            return;
        };
        *slot.state.get_mut().unwrap_or_else(PoisonError::into_inner) = Phase::Queued;
        let mut free = self.lock();
        if free.open {
            free.posted.push(p);
        }
    }

    /// Takes back an emptied list.
    pub(super) fn give_back_list(&self, list: Vec<Arc<Posted>>) {
        let mut free = self.lock();
        if free.open && list.capacity() > 0 {
            free.lists.push(list);
        }
    }
}

impl Posted {
    /// "a send to rank 3" or "a receive from rank 1", for errors.
    fn what(&self) -> String {
        if self.sending {
            format!("a send to rank {}", self.peer)
        } else {
            format!("a receive from rank {}", self.peer)
        }
    }

    /// The peer, whether this rank sends to it, and the tag.
    pub(super) fn route(&self) -> (u32, bool, u32) {
        (self.peer, self.sending, self.tag)
    }

    /// Records how the start went (the engine and its message) and wakes
    /// the waiters.
    pub(super) fn settle(&self, outcome: Result<(Arc<WorkerEngine>, u64)>) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        *state = match outcome {
            Ok((engine, id)) => Phase::Started(engine, id),
            Err(e) => Phase::Failed(e),
        };
        self.wake_waiters();
    }

    /// Once started, waits for the message to finish (up to the timeout;
    /// past it, the communicator is failed, so that nothing touches the
    /// caller's memory afterwards) and gives its entry back to the engine.
    fn let_go(&self) {
        let started = {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            match std::mem::replace(&mut *state, Phase::Finished) {
                Phase::Started(engine, id) => Some((engine, id)),
                other => {
                    *state = other;
                    None
                }
            }
        };
        let Some((engine, id)) = started else {
            return;
        };
        if !matches!(
            engine.wait_message(id, Some(self.timeout)),
            Ok(true) | Err(_)
        ) {
            engine.fail(Error::timeout(
                format!("{} dropped unfinished", self.what()),
                self.timeout,
            ));
            let _ = engine.wait_message(id, Some(self.timeout));
        }
        if engine.message_pending(id) {
            // Still running after the engine failed: its entry stays taken,
            // and the memory is the caller's problem no longer only if the
            // fabric let go of it, which dropping its registration waits for.
            log::warn!(
                "fairring: {} still pending after the engine failed",
                self.what()
            );
            return;
        }
        engine.release_message(id);
    }

    /// Records that the gate finished it on the host (or failed it), and
    /// wakes the waiters.
    pub(super) fn finish(&self, outcome: Result<()>) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        *state = match outcome {
            Ok(()) => Phase::Finished,
            Err(e) => Phase::Failed(e),
        };
        self.wake_waiters();
    }

    /// Wakes the threads waiting for a change; called under `state`'s lock.
    fn wake_waiters(&self) {
        if self.waiting.load(Ordering::Relaxed) > 0 {
            self.changed.notify_all();
        }
    }

    /// Waits on `changed` with `state`'s lock held by `guard`, for at most
    /// `timeout`, counted among the waiters meanwhile.
    fn wait_for_change<'a>(
        &self,
        guard: MutexGuard<'a, Phase>,
        timeout: Option<Duration>,
    ) -> MutexGuard<'a, Phase> {
        self.waiting.fetch_add(1, Ordering::Relaxed);
        let guard = match timeout {
            Some(t) => {
                self.changed
                    .wait_timeout(guard, t)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0
            }
            None => self
                .changed
                .wait(guard)
                .unwrap_or_else(PoisonError::into_inner),
        };
        self.waiting.fetch_sub(1, Ordering::Relaxed);
        guard
    }

    /// Waits up to `timeout` for it to start and, from then, up to `timeout`
    /// for it to finish.
    pub(super) fn wait(&self, timeout: Duration) -> Result<()> {
        match self.started(Some(Instant::now() + timeout)) {
            Some(Ok(Some((engine, id)))) => match engine.wait_message(id, Some(timeout))? {
                true => Ok(()),
                false => Err(Error::timeout(self.what(), timeout)),
            },
            Some(Ok(None)) => Ok(()),
            Some(Err(e)) => Err(e),
            None => Err(Error::timeout(self.what(), timeout)),
        }
    }

    /// The engine and its message, once the message has started (waiting
    /// up to `deadline`), or `None` if it finished on the host; its failure
    /// to start; `None` at the deadline.
    #[expect(clippy::type_complexity, reason = "one use, spelled out")]
    fn started(
        &self,
        deadline: Option<Instant>,
    ) -> Option<Result<Option<(Arc<WorkerEngine>, u64)>>> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            match &*state {
                Phase::Started(engine, id) => return Some(Ok(Some((Arc::clone(engine), *id)))),
                Phase::Finished => return Some(Ok(None)),
                Phase::Failed(e) => return Some(Err(e.clone())),
                Phase::Queued => {}
            }
            match deadline {
                None => return None,
                Some(d) => {
                    let left = d.checked_duration_since(Instant::now())?;
                    state = self.wait_for_change(state, Some(left));
                }
            }
        }
    }

    /// Waits until the message is no longer queued.
    fn wait_started(&self) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        while matches!(*state, Phase::Queued) {
            state = self.wait_for_change(state, None);
        }
    }
}

impl Message {
    /// One message.
    pub(super) fn one(posted: Arc<Posted>, pool: &Arc<Pool>) -> Message {
        Message {
            posts: Posts::One(posted),
            pool: Arc::clone(pool),
        }
    }

    /// Several messages (a list from [`Pool::list`]).
    pub(super) fn many(posted: Vec<Arc<Posted>>, pool: &Arc<Pool>) -> Message {
        Message {
            posts: Posts::Many(posted),
            pool: Arc::clone(pool),
        }
    }

    /// Waits up to `timeout` in all: an error if a message failed or is
    /// still running then.
    pub(crate) fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        for p in self.posts.as_slice() {
            match p.started(Some(start + timeout)) {
                Some(Ok(Some((engine, id)))) => {
                    let left = timeout.saturating_sub(start.elapsed());
                    if !engine.wait_message(id, Some(left))? {
                        return Err(Error::timeout(p.what(), timeout));
                    }
                }
                Some(Ok(None)) => {}
                Some(Err(e)) => return Err(e),
                None => return Err(Error::timeout(p.what(), timeout)),
            }
        }
        Ok(())
    }

    /// Whether the messages have finished, without waiting; an error if one
    /// failed.
    pub(crate) fn test(&self) -> Result<bool> {
        for p in self.posts.as_slice() {
            let done = match p.started(None) {
                Some(Ok(Some((engine, id)))) => engine.test_message(id)?,
                Some(Ok(None)) => true,
                Some(Err(e)) => return Err(e),
                None => false,
            };
            if !done {
                return Ok(false);
            }
        }
        Ok(true)
    }
}

impl Drop for Message {
    fn drop(&mut self) {
        // A queued message holds the caller's memory: the gate starts or
        // fails it once the call ahead of it is settled, or when the
        // communicator closes. Once started, `give_back` waits for it.
        for p in self.posts.as_slice() {
            p.wait_started();
        }
        match std::mem::replace(&mut self.posts, Posts::Many(Vec::new())) {
            Posts::One(p) => self.pool.give_back(p),
            Posts::Many(mut list) => {
                for p in list.drain(..) {
                    self.pool.give_back(p);
                }
                self.pool.give_back_list(list);
            }
        }
    }
}

impl std::fmt::Debug for Message {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what: Vec<String> = self.posts.as_slice().iter().map(|p| p.what()).collect();
        f.debug_struct("Message")
            .field("what", &what)
            .finish_non_exhaustive()
    }
}
