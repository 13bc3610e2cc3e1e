//! Which peers messages may reach: the fabric connections a communicator
//! makes when it is built (its collectives' peers), and those it makes later,
//! when a message first names a peer it has none to.
//!
//! Each peer is `UNLINKED`, `WANTED` (a message named it; the linker has yet
//! to connect), `LINKED` or `FAILED`. Posting a message to or from an
//! unlinked peer marks it wanted and hands it to the linker
//! (`bootstrap::late_links`, one thread per communicator, started the first
//! time a peer is wanted), which publishes this rank's endpoint for the peer
//! in the job's store, waits for the peer's (it publishes one when a message
//! of its own names this rank), connects, and says how that went
//! ([`LateLinks::settle`]). The driver starts a peer's messages once it is
//! linked, and fails them if it is not.
//!
//! Publishing when named, not when connecting, is what keeps ranks that name
//! each other in a circle (each sending to the next) from waiting for each
//! other: every endpoint a rank waits for is published without waiting.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::Duration;

use crate::error::Error;
use crate::sync::{AtomicU32, Ordering};

const UNLINKED: u32 = 0;
const WANTED: u32 = 1;
const LINKED: u32 = 2;
const FAILED: u32 = 3;

/// Where a peer's connection stands, for messages.
#[derive(Clone, Debug)]
pub(crate) enum LinkState {
    /// Not yet connected (the linker is on it, if a message named it).
    Pending,
    Linked,
    /// Could not be connected; why.
    Failed(Error),
}

/// The peers' link states, and the linker's queue.
pub(crate) struct LateLinks {
    state: Box<[AtomicU32]>,
    failures: Mutex<Vec<Option<Error>>>,
    wanted: Mutex<Wanted>,
    changed: Condvar,
}

struct Wanted {
    peers: VecDeque<u32>,
    closed: bool,
    /// Whether the linker has been asked for before (it starts then).
    asked: bool,
}

impl LateLinks {
    /// Link states for a job of `world` ranks, this one `rank`, connected at
    /// construction to `linked`.
    pub(crate) fn new(world: u32, rank: u32, linked: &[u32]) -> LateLinks {
        let state: Box<[AtomicU32]> = (0..world)
            .map(|p| {
                AtomicU32::new(if linked.contains(&p) {
                    LINKED
                } else if p == rank {
                    FAILED
                } else {
                    UNLINKED
                })
            })
            .collect();
        LateLinks {
            state,
            failures: Mutex::new(vec![None; world as usize]),
            wanted: Mutex::new(Wanted {
                peers: VecDeque::new(),
                closed: false,
                asked: false,
            }),
            changed: Condvar::new(),
        }
    }

    /// Where `peer` stands.
    pub(crate) fn state(&self, peer: u32) -> LinkState {
        match self
            .state
            .get(peer as usize)
            .map(|s| s.load(Ordering::Acquire))
        {
            Some(LINKED) => LinkState::Linked,
            Some(FAILED) => LinkState::Failed(
                self.failures
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get(peer as usize)
                    .cloned()
                    .flatten()
                    .unwrap_or_else(|| {
                        Error::invalid("peer", format!("rank {peer} is not a peer of this rank"))
                    }),
            ),
            Some(_) => LinkState::Pending,
            None => LinkState::Failed(Error::invalid(
                "peer",
                format!("rank {peer} is not in the job"),
            )),
        }
    }

    /// Every linked peer, in rank order.
    pub(crate) fn linked(&self) -> impl Iterator<Item = u32> + '_ {
        (0u32..)
            .zip(self.state.iter())
            .filter_map(|(p, s)| (s.load(Ordering::Acquire) == LINKED).then_some(p))
    }

    /// Marks `peer` wanted if it is unlinked, queueing it for the linker;
    /// returns whether the linker is to be started (the first want).
    pub(crate) fn want(&self, peer: u32) -> bool {
        let Some(s) = self.state.get(peer as usize) else {
            return false;
        };
        if s.compare_exchange(UNLINKED, WANTED, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        let mut w = self.wanted.lock().unwrap_or_else(PoisonError::into_inner);
        w.peers.push_back(peer);
        let first = !w.asked;
        w.asked = true;
        self.changed.notify_all();
        first
    }

    /// The linker's next peers: waits up to `nap` for one, and returns none
    /// once closed.
    pub(crate) fn take_wanted(&self, into: &mut Vec<u32>, nap: Duration) -> bool {
        let mut w = self.wanted.lock().unwrap_or_else(PoisonError::into_inner);
        if w.peers.is_empty() && !w.closed && !nap.is_zero() {
            w = self
                .changed
                .wait_timeout(w, nap)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        into.extend(w.peers.drain(..));
        !w.closed
    }

    /// Says how linking `peer` went.
    pub(crate) fn settle(&self, peer: u32, outcome: Result<(), Error>) {
        let Some(s) = self.state.get(peer as usize) else {
            return;
        };
        match outcome {
            Ok(()) => s.store(LINKED, Ordering::Release),
            Err(e) => {
                if let Some(f) = self
                    .failures
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get_mut(peer as usize)
                {
                    *f = Some(e);
                }
                s.store(FAILED, Ordering::Release);
            }
        }
    }

    /// Stops the linker: it returns from [`take_wanted`](Self::take_wanted).
    pub(crate) fn close(&self) {
        let mut w = self.wanted.lock().unwrap_or_else(PoisonError::into_inner);
        w.closed = true;
        self.changed.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_is_wanted_once_and_settles_either_way() {
        let links = LateLinks::new(4, 1, &[0]);
        assert!(matches!(links.state(0), LinkState::Linked));
        assert!(matches!(links.state(1), LinkState::Failed(_)));
        assert!(matches!(links.state(9), LinkState::Failed(_)));
        assert!(matches!(links.state(2), LinkState::Pending));
        assert!(links.want(2), "the first want starts the linker");
        assert!(!links.want(2), "a peer is queued once");
        assert!(!links.want(3), "the linker runs already");
        assert!(!links.want(0), "a linked peer needs no linker");
        let mut peers = Vec::new();
        assert!(links.take_wanted(&mut peers, Duration::ZERO));
        assert_eq!(peers, [2, 3]);
        links.settle(2, Ok(()));
        links.settle(3, Err(Error::peer(3, "never named this rank")));
        assert_eq!(links.linked().collect::<Vec<_>>(), [0, 2]);
        match links.state(3) {
            LinkState::Failed(e) => assert!(e.to_string().contains("never named"), "{e}"),
            other => panic!("{other:?}"),
        }
        links.close();
        assert!(!links.take_wanted(&mut peers, Duration::from_secs(5)));
    }
}
