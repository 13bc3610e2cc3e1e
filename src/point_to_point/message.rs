//! [`Message`]: posted messages, waited on, tested and dropped; and what
//! each is while its channel meets ([`Posted`]).

use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use super::channel;
use crate::communicator::OwnedWork;
use crate::error::{Error, Result};

/// Messages in flight: a send, a receive, or the messages of an all-to-all,
/// from when they are posted (their channels perhaps still meeting) to when
/// they have finished.
///
/// Dropping it waits for them to finish, as dropping a [`Work`](crate::Work)
/// does.
#[must_use = "a message runs until waited on or dropped"]
pub struct Message {
    posted: Vec<Arc<Posted>>,
}

/// What a posted message is, shared by its [`Message`] and its channel's queue.
pub(crate) struct Posted {
    state: Mutex<Phase>,
    changed: Condvar,
    /// How long a wait may take: the communicator's timeout.
    timeout: Duration,
    /// "a send to rank 3" or "a receive from rank 1", for errors.
    what: String,
    /// The channel's sender and receiver, whose ranks its errors name.
    src: u32,
    dst: u32,
}

enum Phase {
    /// Waiting for its channel to be met.
    Queued,
    Started(Arc<OwnedWork>),
    Failed(Error),
}

impl Posted {
    pub(super) fn new(what: String, timeout: Duration, src: u32, dst: u32) -> Arc<Posted> {
        Arc::new(Posted {
            state: Mutex::new(Phase::Queued),
            changed: Condvar::new(),
            timeout,
            what,
            src,
            dst,
        })
    }

    /// `e`, from the channel's communicator, in the job's ranks.
    fn in_job_ranks(&self, e: Error) -> Error {
        channel::in_job_ranks(e, self.src, self.dst)
    }

    /// Records how the start went and wakes the waiters.
    pub(super) fn settle(&self, outcome: Result<OwnedWork>) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        *state = match outcome {
            Ok(w) => Phase::Started(Arc::new(w)),
            Err(e) => Phase::Failed(e),
        };
        self.changed.notify_all();
    }

    /// The started work, once the message has started (waiting up to
    /// `deadline`); its failure to start; `None` at the deadline.
    fn started(&self, deadline: Option<Instant>) -> Option<Result<Arc<OwnedWork>>> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            match &*state {
                Phase::Started(w) => return Some(Ok(Arc::clone(w))),
                Phase::Failed(e) => return Some(Err(e.clone())),
                Phase::Queued => {}
            }
            match deadline {
                None => return None,
                Some(d) => {
                    let left = d.checked_duration_since(Instant::now())?;
                    state = self
                        .changed
                        .wait_timeout(state, left)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                }
            }
        }
    }
}

impl Message {
    pub(super) fn of(posted: Vec<Arc<Posted>>) -> Message {
        Message { posted }
    }

    /// Waits for the messages to finish, each up to the communicator's
    /// timeout (counted from here, once for its channel's meeting and once
    /// for the message).
    pub fn wait(&self) -> Result<()> {
        let mut first_error = None;
        for p in &self.posted {
            let timeout = p.timeout;
            let deadline = Instant::now() + timeout;
            let outcome = match p.started(Some(deadline)) {
                Some(Ok(w)) => w.wait_timeout(timeout).map_err(|e| p.in_job_ranks(e)),
                Some(Err(e)) => Err(e),
                None => Err(Error::timeout(p.what.clone(), timeout)),
            };
            if let Err(e) = outcome {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Waits up to `timeout` in all: an error if a message failed or is
    /// still running then.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        for p in &self.posted {
            match p.started(Some(start + timeout)) {
                Some(w) => w?
                    .wait_timeout(timeout.saturating_sub(start.elapsed()))
                    .map_err(|e| p.in_job_ranks(e))?,
                None => return Err(Error::timeout(p.what.clone(), timeout)),
            }
        }
        Ok(())
    }

    /// Whether the messages have finished, without waiting; an error if one
    /// failed.
    pub fn test(&self) -> Result<bool> {
        for p in &self.posted {
            let done = match p.started(None) {
                Some(w) => w?.test().map_err(|e| p.in_job_ranks(e))?,
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
        // A queued message holds the caller's memory: its channel starts or
        // fails it within the meeting's timeout, or when the communicator
        // closes. Once started, dropping the work (the last reference to
        // it, unless another thread is waiting on it) waits for it.
        for p in &self.posted {
            let mut state = p.state.lock().unwrap_or_else(PoisonError::into_inner);
            while matches!(*state, Phase::Queued) {
                state = p
                    .changed
                    .wait(state)
                    .unwrap_or_else(PoisonError::into_inner);
            }
        }
    }
}

impl std::fmt::Debug for Message {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what: Vec<&str> = self.posted.iter().map(|p| p.what.as_str()).collect();
        f.debug_struct("Message")
            .field("what", &what)
            .finish_non_exhaustive()
    }
}
