//! Completions: what a fabric reports, and the queue it reports them through.

use std::sync::{Arc, OnceLock, PoisonError};
use std::time::{Duration, Instant};

use crossbeam_queue::ArrayQueue;
use fairring_core::wire::MAX_MESSAGE_PAYLOAD;

use super::error::PeerFailure;
use crate::sync::{AtomicUsize, Condvar, Mutex, Ordering, fence};

/// The largest payload of a control message, in bytes.
pub const MESSAGE_CAPACITY: usize = MAX_MESSAGE_PAYLOAD as usize;

/// One completion: something that happened with one peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The peer concerned.
    pub peer: u32,
    /// What happened.
    pub event: CompletionEvent,
}

/// What a completion reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum CompletionEvent {
    /// A write or message posted with `token` has left this process: its source
    /// range may be reused. (It says nothing about the peer having received it;
    /// the peer's own `Landed` completion does.)
    Sent {
        /// The token given when posting.
        token: u64,
    },
    /// A peer's write landed, whole, in a local region.
    ///
    /// Like an RDMA receive completion, it does not say where: the writer encodes
    /// what the receiver needs to know in the immediate data.
    Landed {
        /// Bytes written.
        len: u64,
        /// The immediate data sent with the write.
        immediate: u32,
    },
    /// A peer's control message arrived.
    Message(Message),
    /// A write or message posted with `token` will never be sent, because its
    /// peer failed. Its source range may be reused.
    SendFailed {
        /// The token given when posting.
        token: u64,
        /// Why the peer failed.
        failure: PeerFailure,
    },
    /// The peer failed. Reported once per peer; nothing more arrives from it and
    /// nothing more can be sent to it.
    PeerFailed {
        /// Why.
        failure: PeerFailure,
    },
}

/// A control message, carried inline in its completion.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Message {
    /// The immediate data sent with the message.
    pub immediate: u32,
    len: u8,
    bytes: [u8; MESSAGE_CAPACITY],
}

impl Message {
    /// A message of `payload` (at most [`MESSAGE_CAPACITY`] bytes), or `None` if it
    /// is longer.
    pub fn new(immediate: u32, payload: &[u8]) -> Option<Message> {
        let len = u8::try_from(payload.len())
            .ok()
            .filter(|&l| usize::from(l) <= MESSAGE_CAPACITY)?;
        let mut bytes = [0; MESSAGE_CAPACITY];
        bytes[..payload.len()].copy_from_slice(payload);
        Some(Message {
            immediate,
            len,
            bytes,
        })
    }

    /// The message's payload.
    pub fn payload(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

impl core::fmt::Debug for Message {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Message")
            .field("immediate", &self.immediate)
            .field("payload", &self.payload())
            .finish()
    }
}

/// A bounded multi-producer queue of completions with a blocking wait.
///
/// Providers' I/O threads push; the user polls into a slice of its own, so
/// neither side allocates once the queue exists. A full queue holds its
/// producers back (they retry) rather than drop a completion. A push takes the
/// lock only when a consumer is asleep in `wait`.
pub(crate) struct CompletionQueue {
    queue: ArrayQueue<Completion>,
    /// Consumers inside `wait`. A push stores, fences, then reads this; a waiter
    /// increments it, fences, then checks the queue: of two such threads at least
    /// one sees the other (Dekker), so a push never misses a sleeper.
    sleepers: AtomicUsize,
    /// Held by a waiter from its last check until it sleeps, and taken by a push
    /// that wakes it, so the wake-up cannot fall between the two.
    lock: Mutex<()>,
    wakeup: Condvar,
    /// Called after every push, once the user has set it.
    notifier: OnceLock<CompletionNotifier>,
}

/// What a provider calls each time it queues a completion (see
/// [`Fabric::notify_completions`](super::Fabric::notify_completions)).
pub type CompletionNotifier = Arc<dyn Fn() + Send + Sync>;

impl CompletionQueue {
    pub(crate) fn new(capacity: usize) -> CompletionQueue {
        CompletionQueue {
            queue: ArrayQueue::new(capacity.max(1)),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wakeup: Condvar::new(),
            notifier: OnceLock::new(),
        }
    }

    /// Sets the notifier; returns `false` if one was set before.
    pub(crate) fn set_notifier(&self, notify: CompletionNotifier) -> bool {
        self.notifier.set(notify).is_ok()
    }

    /// Pushes a completion; `Err` gives it back when the queue is full.
    pub(crate) fn push(&self, completion: Completion) -> Result<(), Completion> {
        self.queue.push(completion)?;
        fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::Relaxed) > 0 {
            let _guard = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
            self.wakeup.notify_all();
        }
        if let Some(notify) = self.notifier.get() {
            notify();
        }
        Ok(())
    }

    /// Moves up to `out.len()` completions into `out`; returns how many.
    pub(crate) fn poll(&self, out: &mut [Completion]) -> usize {
        let mut n = 0;
        while n < out.len() {
            match self.queue.pop() {
                Some(c) => {
                    out[n] = c;
                    n += 1;
                }
                None => break,
            }
        }
        n
    }

    /// Like `poll`, but waits up to `timeout` for the first completion.
    pub(crate) fn wait(&self, out: &mut [Completion], timeout: Duration) -> usize {
        if out.is_empty() {
            return 0;
        }
        let n = self.poll(out);
        if n > 0 {
            return n;
        }
        let deadline = Instant::now() + timeout;
        let mut guard = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        self.sleepers.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        let n = loop {
            // Checked under the lock: a push after this check notifies us.
            let n = self.poll(out);
            let now = Instant::now();
            if n > 0 || now >= deadline {
                break n;
            }
            guard = self
                .wakeup
                .wait_timeout(guard, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        };
        self.sleepers.fetch_sub(1, Ordering::Relaxed);
        drop(guard);
        n
    }
}
