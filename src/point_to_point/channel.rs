//! One channel: a two-rank communicator from a sender (its rank 0) to a
//! receiver (its rank 1), met on a thread of its own, with the messages
//! posted before it was met.

use crate::sync::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{CHANNEL_MEMORY, ParentFailure, Posted};
use crate::communicator::{Call, Communicator};
use crate::config::{Config, Role};
use crate::error::{Error, Result};
use crate::store::{PrefixStore, Store};

pub(super) struct Channel {
    state: Mutex<State>,
    meeting: Mutex<Option<JoinHandle<()>>>,
    /// Lets the meeting stop waiting on the store when the channel closes.
    store: Arc<ChannelStore>,
    timeout: Duration,
    src: u32,
    dst: u32,
}

enum State {
    /// Being met; messages posted so far, in order.
    Meeting(Vec<Queued>),
    Met(Arc<Communicator>),
    Failed(Error),
    Closed,
}

/// A message waiting for its channel.
struct Queued {
    call: Call,
    posted: Arc<Posted>,
}

// SAFETY: a queued call's pointers are the poster's memory, which
// `Communicator::post_send`'s contract keeps valid and unshared until the
// message reports completion; the call is started (on whichever thread meets
// the channel) as it would have been on the poster's.
unsafe impl Send for Queued {}

impl Channel {
    /// Starts meeting the channel from `src` to `dst` of the job of `config`
    /// through `store`; `sending`: this rank is `src`.
    pub(super) fn meet(
        config: &Config,
        store: &Arc<dyn Store>,
        src: u32,
        dst: u32,
        sending: bool,
        parent: Option<ParentFailure>,
    ) -> Result<Arc<Channel>> {
        let own = channel_config(config, if sending { 0 } else { 1 });
        let scoped = PrefixStore::new(
            format!("fairring/{:016x}/p2p/{src}-{dst}", config.job_tag),
            Arc::clone(store),
        );
        let channel = Arc::new(Channel {
            state: Mutex::new(State::Meeting(Vec::new())),
            meeting: Mutex::new(None),
            store: Arc::new(ChannelStore {
                inner: Mutex::new(Some(Arc::new(scoped))),
                closed: AtomicBool::new(false),
                parent,
            }),
            timeout: config.timeout,
            src,
            dst,
        });
        let meeting = Arc::clone(&channel);
        let thread = std::thread::Builder::new()
            .name(format!("fairring-p2p-{src}-{dst}"))
            .spawn(move || {
                let store: Arc<dyn Store> = Arc::clone(&meeting.store) as Arc<dyn Store>;
                let met = Communicator::with_store(own, store).map(Arc::new);
                meeting.met(met.map_err(|e| in_job_ranks(e, src, dst)));
            })
            .map_err(|e| Error::io("starting a channel's meeting thread", e))?;
        *channel
            .meeting
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(thread);
        Ok(channel)
    }

    /// What the channel's communicator has moved, once it is met.
    pub(super) fn traffic(&self) -> Option<crate::engine::links::Traffic> {
        match &*self.state.lock().unwrap_or_else(PoisonError::into_inner) {
            State::Met(comm) => Some(comm.traffic()),
            _ => None,
        }
    }

    pub(super) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Starts the messages queued so far, in order, or fails them.
    fn met(&self, outcome: Result<Arc<Communicator>>) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let queued = match &mut *state {
            State::Meeting(q) => std::mem::take(q),
            // Closed meanwhile: the communicator (if any) is dropped here.
            _ => return,
        };
        *state = match outcome {
            Ok(c) => State::Met(c),
            Err(e) => State::Failed(e),
        };
        for q in queued {
            self.start(&state, q);
        }
    }

    /// Starts `call` once the channel is met (at once, if it is), after every
    /// message posted before it.
    ///
    /// # Safety
    ///
    /// `call`'s memory stays valid and unshared until `posted` reports
    /// completion (its `Message` waits for that when dropped).
    pub(super) unsafe fn post(&self, call: Call, posted: Arc<Posted>) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let q = Queued { call, posted };
        if let State::Meeting(queue) = &mut *state {
            queue.push(q);
        } else {
            self.start(&state, q);
        }
    }

    /// Starts `q` in `state` (locked by the caller, so that messages start in
    /// the order they were posted), or fails it.
    fn start(&self, state: &State, q: Queued) {
        let outcome = match state {
            State::Met(comm) => {
                // SAFETY: the poster's contract (`Channel::post`) covers the
                // call's memory until its message completes.
                unsafe { comm.start(&q.call) }
                    .and_then(|w| comm.own(w))
                    .map_err(|e| in_job_ranks(e, self.src, self.dst))
            }
            State::Failed(e) => Err(e.clone()),
            State::Closed => Err(Error::invalid("comm", "the communicator was closed")),
            State::Meeting(_) => Err(Error::internal(
                "a channel starts messages only once met",
                format!("the channel {}->{}", self.src, self.dst),
            )),
        };
        q.posted.settle(outcome);
    }

    /// Aborts the channel: a met channel's communicator fails what it runs
    /// and will run; a channel still meeting stops, and what waits for it
    /// fails with [`Error::Aborted`].
    pub(super) fn abort(&self) {
        let queued = {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            match &mut *state {
                State::Met(comm) => Err(Arc::clone(comm)),
                State::Meeting(q) => {
                    let q = std::mem::take(q);
                    *state = State::Failed(Error::Aborted);
                    Ok(q)
                }
                State::Failed(_) | State::Closed => return,
            }
        };
        // Outside the channel's lock: what the abort wakes may post here.
        let queued = match queued {
            Err(comm) => return comm.abort(),
            Ok(q) => q,
        };
        self.store.close();
        for q in queued {
            q.posted.settle(Err(Error::Aborted));
        }
    }

    /// Fails the messages still waiting, stops the meeting and lets go of the
    /// store (joining the meeting thread).
    pub(super) fn close(&self) {
        self.store.close();
        let queued = {
            let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            match std::mem::replace(&mut *state, State::Closed) {
                State::Meeting(q) => q,
                _ => Vec::new(),
            }
        };
        for q in queued {
            q.posted
                .settle(Err(Error::invalid("comm", "the communicator was closed")));
        }
        let thread = self
            .meeting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

/// `e`, from the communicator of the channel from `src` to `dst`, in the
/// job's ranks: the channel's rank 0 is `src` and its rank 1 is `dst`.
pub(super) fn in_job_ranks(e: Error, src: u32, dst: u32) -> Error {
    let job = |r: u32| if r == 0 { src } else { dst };
    let on = format!("the channel {src}->{dst}");
    match e {
        Error::Peer { rank, reason } => Error::Peer {
            rank: job(rank),
            reason: format!("{reason} (on {on})"),
        },
        Error::Mismatch {
            sequence,
            rank,
            called,
            peer,
            peer_called,
        } => Error::Mismatch {
            sequence,
            rank: job(rank),
            called: format!(
                "{called} (on {on}, whose rank 0 is rank {src} and rank 1 is rank {dst})"
            ),
            peer: job(peer),
            peer_called,
        },
        // The rank that did not take part is the other end: name both.
        Error::Timeout { what, after } => Error::Timeout {
            what: format!("{what} on {on}, from rank {src} to rank {dst}"),
            after,
        },
        Error::Store { operation, reason } => Error::Store {
            operation,
            reason: format!("{reason} (meeting {on})"),
        },
        Error::Failed { first } => Error::Failed {
            first: Box::new(in_job_ranks(*first, src, dst)),
        },
        other => other,
    }
}

/// A channel's own configuration: a job of two ranks, `rank` of them, of the
/// communicator's settings (its algorithm and wire aside), with no dedicated
/// servers, whose machines its meeting finds.
fn channel_config(config: &Config, rank: u32) -> Config {
    let mut own = config.clone();
    own.rank = rank;
    own.world_size = 2;
    own.local_rank = None;
    own.local_world_size = None;
    own.servers = 0;
    own.role = Role::Worker;
    own.agent_store = None;
    // The communicator's algorithm and wire are for its collectives; a
    // message is a broadcast, which `auto` runs best.
    own.algorithm = crate::config::Algorithm::Auto;
    own.wire = fairring_core::WireFormat::Exact;
    own.total_memory = own.total_memory.min(CHANNEL_MEMORY);
    own.slice_bytes = own.slice_bytes.map(|s| s.min(CHANNEL_MEMORY / 2));
    own
}

/// The job's store as a channel's meeting sees it: a wait polls, so that
/// closing the channel ends it, and so does the communicator's failure (the
/// peer may be the rank that failed or was aborted, and would never answer);
/// once closed the store is let go of.
struct ChannelStore {
    inner: Mutex<Option<Arc<dyn Store>>>,
    closed: AtomicBool,
    parent: Option<ParentFailure>,
}

impl ChannelStore {
    fn inner(&self) -> Result<Arc<dyn Store>> {
        self.inner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| Error::store("meet", "the communicator was closed"))
    }

    /// The communicator's failure, as an error, if it has failed.
    fn parent_failed(&self) -> Result<()> {
        match self.parent.as_ref().and_then(|failure| failure()) {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        drop(
            self.inner
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take(),
        );
    }
}

impl Store for ChannelStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.inner()?.set(key, value)
    }

    fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_micros(200);
        loop {
            let store = self.inner()?;
            if store.check(&[key])? {
                return store.get(key, deadline.saturating_duration_since(Instant::now()));
            }
            drop(store);
            if self.closed.load(Ordering::Acquire) {
                return Err(Error::store("meet", "the communicator was closed"));
            }
            self.parent_failed()?;
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::timeout(format!("store key {key}"), timeout));
            }
            std::thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(Duration::from_millis(10));
        }
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        // What polls the store (a meeting's wait for its peer) stops here.
        self.parent_failed()?;
        self.inner()?.check(keys)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn channel_errors_name_the_jobs_ranks() {
        let peer = in_job_ranks(
            Error::Peer {
                rank: 1,
                reason: "closed".into(),
            },
            2,
            0,
        );
        assert!(matches!(peer, Error::Peer { rank: 0, .. }), "{peer:?}");
        assert!(peer.to_string().contains("the channel 2->0"), "{peer}");
        // A timeout names no rank of its own: the message names both ends.
        let timeout = in_job_ranks(
            Error::Timeout {
                what: "operation #12".into(),
                after: Duration::from_secs(2),
            },
            2,
            0,
        )
        .to_string();
        assert!(timeout.contains("from rank 2 to rank 0"), "{timeout}");
        let nested = in_job_ranks(
            Error::Failed {
                first: Box::new(Error::Peer {
                    rank: 0,
                    reason: "gone".into(),
                }),
            },
            3,
            1,
        );
        match nested {
            Error::Failed { first } => assert!(matches!(*first, Error::Peer { rank: 3, .. })),
            other => panic!("{other:?}"),
        }
    }
}
