//! Point-to-point messages in the simulation: what a seed draws (pairs,
//! tags, sizes, the order each rank posts its own in), a stand-in for the
//! communicator's linker, and the checks.
//!
//! Every rank posts its messages in an order of its own: by a priority it
//! draws per tag, then in the seed's order. So within a tag (and pair) both
//! ranks post in the same order, which is what the engine matches by, while
//! across tags a sender and its receiver post in different orders. Messages
//! between ranks of one machine go through its mailboxes where its ranks copy
//! between tensors (half the jobs of several ranks per machine), over the
//! network otherwise, linking a pair when both its ranks have named each
//! other, as the communicator's linker does.

use std::collections::BTreeSet;
use std::time::Duration;

use fairring_rdma::fabric::Fabric;

use super::Rank;
use super::scenario::Rng;
use crate::engine::messages::Post;
use crate::error::Error;

/// Tags a seed draws from.
const TAGS: u32 = 3;

/// One message of a seed.
#[derive(Clone, Copy, Debug)]
pub(super) struct SimMessage {
    pub(super) src: u32,
    pub(super) dst: u32,
    pub(super) tag: u32,
    /// `u32` elements.
    pub(super) words: usize,
}

/// A seed's messages, and the order each rank posts its ends of them in.
#[derive(Debug, Default)]
pub(super) struct Script {
    pub(super) messages: Vec<SimMessage>,
    /// Per rank: (message, sending) in posting order.
    pub(super) order: Vec<Vec<(usize, bool)>>,
}

impl Script {
    /// Half the seeds draw up to 16 messages among `world` ranks, from a
    /// side stream of `rng`'s (the rest of the seed stays as it was).
    pub(super) fn draw(rng: &Rng, world: u32) -> Script {
        let mut rng = rng.side(0x6d65_7373_6167_6573);
        if world < 2 || rng.below(2) == 0 {
            return Script::default();
        }
        let count = 1 + rng.below(16) as usize;
        let messages: Vec<SimMessage> = (0..count)
            .map(|_| {
                let src = rng.below(u64::from(world)) as u32;
                let dst = (src + 1 + rng.below(u64::from(world - 1)) as u32) % world;
                SimMessage {
                    src,
                    dst,
                    tag: rng.below(u64::from(TAGS)) as u32,
                    words: [0, 1, 7, 300, 70_000][rng.below(5) as usize],
                }
            })
            .collect();
        let order = (0..world)
            .map(|r| {
                let priority: Vec<u64> = (0..TAGS).map(|_| rng.below(4)).collect();
                let mut mine: Vec<(usize, bool)> = messages
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| m.src == r || m.dst == r)
                    .map(|(i, m)| (i, m.src == r))
                    .collect();
                mine.sort_by_key(|&(i, _)| (priority[messages[i].tag as usize], i));
                mine
            })
            .collect();
        Script { messages, order }
    }
}

/// What the `i`-th element of message `k` holds.
pub(super) fn value(k: usize, i: usize) -> u32 {
    (k as u32).wrapping_mul(0x9e37_79b9) ^ (i as u32).wrapping_mul(0x85eb_ca6b) ^ 0x5bd1_e995
}

/// One rank's ends of the seed's messages.
pub(super) struct RankMessages {
    /// Per entry of the rank's order: the buffer, the message id once
    /// posted, and how it settled.
    buffers: Vec<Vec<u32>>,
    ids: Vec<Option<u64>>,
    pub(super) settled: Vec<Option<bool>>,
    /// Why the ends that failed did.
    pub(super) failures: Vec<String>,
    /// Entries posted so far.
    pub(super) posted: usize,
}

impl RankMessages {
    pub(super) fn new(script: &Script, rank: u32) -> RankMessages {
        let order = script
            .order
            .get(rank as usize)
            .map_or(&[][..], Vec::as_slice);
        let buffers = order
            .iter()
            .map(|&(k, sending)| {
                let m = script.messages[k];
                if sending {
                    (0..m.words).map(|i| value(k, i)).collect()
                } else {
                    vec![0xdead_beef; m.words]
                }
            })
            .collect();
        RankMessages {
            buffers,
            ids: vec![None; order.len()],
            settled: vec![None; order.len()],
            failures: Vec::new(),
            posted: 0,
        }
    }

    /// Whether every end has been posted and has settled.
    pub(super) fn all_settled(&self) -> bool {
        self.posted == self.settled.len() && self.settled.iter().all(Option::is_some)
    }

    /// The next end to post, as a post (its id is the engine's to give).
    pub(super) fn next_post(&mut self, script: &Script, rank: u32) -> Option<Post> {
        let &(k, sending) = script.order[rank as usize].get(self.posted)?;
        let m = script.messages[k];
        let buffer = &mut self.buffers[self.posted];
        Some(Post {
            id: 0,
            peer: if sending { m.dst } else { m.src },
            tag: m.tag,
            sending,
            data: buffer.as_mut_ptr() as usize,
            bytes: (m.words * 4) as u64,
            dtype: fairring_core::DataType::I32,
        })
    }

    /// Records the id of the end just posted (`None`: refused).
    pub(super) fn posted(&mut self, id: Option<u64>) {
        let at = self.posted;
        self.ids[at] = id;
        if id.is_none() {
            self.settled[at] = Some(false);
        }
        self.posted += 1;
    }

    /// Settles the ends the engine has finished (`test` says how, `release`
    /// gives the entry back), checking every receive that succeeded; returns
    /// how many succeeded, and of them how many with a peer `local` says is
    /// reached through the machine's mailboxes.
    pub(super) fn settle(
        &mut self,
        script: &Script,
        rank: u32,
        test: impl Fn(u64) -> crate::Result<bool>,
        release: impl Fn(u64),
        local: impl Fn(u32) -> bool,
    ) -> Result<(usize, usize), String> {
        let (mut done, mut done_local) = (0, 0);
        for at in 0..self.posted {
            let (Some(id), None) = (self.ids[at], self.settled[at]) else {
                continue;
            };
            let ok = match test(id) {
                Ok(false) => continue,
                Ok(true) => true,
                Err(e) => {
                    self.failures.push(e.to_string());
                    false
                }
            };
            release(id);
            self.settled[at] = Some(ok);
            let (k, sending) = script.order[rank as usize][at];
            if ok && !sending {
                let wrong = self.buffers[at]
                    .iter()
                    .enumerate()
                    .find(|&(i, &v)| v != value(k, i));
                if let Some((i, v)) = wrong {
                    return Err(format!(
                        "rank {rank}: message {k} (tag {}) holds {v:#x} at element {i}",
                        script.messages[k].tag
                    ));
                }
            }
            let m = script.messages[k];
            done += usize::from(ok);
            done_local += usize::from(ok && local(if sending { m.dst } else { m.src }));
        }
        Ok((done, done_local))
    }
}

/// The pairs that want a link, both ways: what the communicator's linker
/// connects once both ranks of a pair have named each other.
#[derive(Default)]
pub(super) struct Linker {
    wanted: BTreeSet<(u32, u32)>,
}

impl Linker {
    /// Takes what rank `rank` wants.
    pub(super) fn take(&mut self, rank: u32, peers: &[u32]) {
        for &p in peers {
            self.wanted.insert((rank, p));
        }
    }

    /// The pairs both of whose ranks want each other, each once (`a < b`),
    /// taken out.
    pub(super) fn met(&mut self) -> Vec<(u32, u32)> {
        let met: Vec<(u32, u32)> = self
            .wanted
            .iter()
            .filter(|&&(a, b)| a < b && self.wanted.contains(&(b, a)))
            .copied()
            .collect();
        for &(a, b) in &met {
            self.wanted.remove(&(a, b));
            self.wanted.remove(&(b, a));
        }
        met
    }

    /// The ranks that want `dead`, taken out: their links never come.
    pub(super) fn wanting(&mut self, dead: u32) -> Vec<u32> {
        let wanting: Vec<u32> = self
            .wanted
            .iter()
            .filter(|&&(_, p)| p == dead)
            .map(|&(r, _)| r)
            .collect();
        self.wanted.retain(|&(r, p)| p != dead && r != dead);
        wanting
    }
}

/// The communicator's linker, for every rank of the seed: takes what each
/// live rank wants, links each pair both of whose ranks want the other (both
/// ways, as the tcp fabric's one connection is), and fails the links wanted
/// with a rank that was killed.
pub(super) fn link(ranks: &[Rank], linker: &mut Linker, wanted: &mut Vec<u32>) {
    for (r, rank) in (0u32..).zip(ranks) {
        if rank.dead {
            continue;
        }
        wanted.clear();
        rank.engine.late_links.take_wanted(wanted, Duration::ZERO);
        linker.take(r, wanted);
    }
    for (a, b) in linker.met() {
        let (ra, rb) = (&ranks[a as usize], &ranks[b as usize]);
        for (from, to, peer) in [(ra, rb, b), (rb, ra, a)] {
            if from.dead {
                continue;
            }
            let outcome = if to.dead {
                Err(Error::peer(peer, "was killed before the link was made"))
            } else {
                from.engine
                    .links
                    .fabric
                    .endpoint(peer)
                    .and_then(|ep| from.engine.links.fabric.connect(peer, &ep))
                    .map_err(|e| Error::peer(peer, e.to_string()))
            };
            from.engine.late_links.settle(peer, outcome);
            from.engine.ring();
        }
    }
    for (dead, _) in (0u32..).zip(ranks).filter(|(_, r)| r.dead) {
        for r in linker.wanting(dead) {
            let rank = &ranks[r as usize];
            if !rank.dead {
                rank.engine.late_links.settle(
                    dead,
                    Err(Error::peer(dead, "was killed before the link was made")),
                );
                rank.engine.ring();
            }
        }
    }
}
