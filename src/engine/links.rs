//! Who this rank exchanges with over the fabric, and the fabric itself: fixed
//! when the communicator is built.
//!
//! A rank writes to the ranks of its rail on other machines (hierarchical) and
//! to the next rank of the ring; it is written to by its rail and the previous rank
//! of the ring. With dedicated servers, every worker also writes to every
//! server of its rail group and every server to every worker of its group
//! (`algorithm/peers`); the rails stay linked, for the relay, the scatter and
//! the descriptor checks between machines. Those that
//! write into its inbox need credits; those on other machines (servers are on no
//! worker's machine) are the remote ends of the descriptor checks.

use std::time::Duration;

use fairring_core::topology::{Location, Topology};
use fairring_rdma::fabric::{
    Completion, CompletionEvent, Fabric, FabricError, RemoteRegion, WriteRequest,
};

use super::tags;
use crate::error::{Error, Result};
use crate::sync::{AtomicU64, Ordering};

/// Filler for completion buffers before a poll writes them.
pub(crate) const NO_COMPLETION: Completion = Completion {
    peer: 0,
    event: CompletionEvent::Sent { token: 0 },
};

/// The fabric and this rank's peers on it.
pub(crate) struct Links<F: Fabric> {
    pub(crate) fabric: F,
    /// This rank's registered staging buffers.
    pub(crate) region: F::Region,
    /// Per rank: its staging buffers, for the ranks this rank writes to.
    remote: Vec<Option<RemoteRegion>>,
    pub(crate) topology: Topology,
    pub(crate) location: Location,
    pub(crate) rank: u32,
    /// Ranks that write into this rank's inbox: they need credits.
    pub(crate) inbound: Vec<u32>,
    /// Every rank this rank is connected to.
    pub(crate) linked: Vec<u32>,
    /// Ranks on other machines this rank writes to, and that write to it: the
    /// remote ends of descriptor checks (a dedicated server receives them from
    /// every worker of its rail group and sends none).
    pub(crate) remote_out: Vec<u32>,
    pub(crate) remote_in: Vec<u32>,
    /// Per rank: whether it is in `remote_out`.
    is_remote_out: Vec<bool>,
    /// The data bytes moved so far.
    counted: Counters,
}

/// Data bytes a process's fabric has moved: the payloads of the one-sided
/// writes it posted and of the writes that landed in its memory. Control
/// messages (descriptors, credits, goodbyes) and the providers' frame headers are
/// not counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Bytes this process wrote into its peers.
    pub sent_bytes: u64,
    /// Bytes its peers wrote into this process.
    pub received_bytes: u64,
    /// Of those, bytes written straight into its callers' tensors, which it
    /// then did not copy out of staging (a message's, where the fabric lets
    /// a receiver open its tensor to its peer: see `engine/direct.rs`).
    pub received_in_place_bytes: u64,
}

/// The counts behind [`Traffic`]; read from any thread.
#[derive(Default)]
struct Counters {
    sent: AtomicU64,
    received: AtomicU64,
    in_place: AtomicU64,
}

impl<F: Fabric> Links<F> {
    /// The links of rank `rank` at `location`.
    #[expect(clippy::too_many_arguments, reason = "the links' complete inputs")]
    pub(crate) fn new(
        fabric: F,
        region: F::Region,
        remote: Vec<Option<RemoteRegion>>,
        topology: Topology,
        location: Location,
        rank: u32,
        world: u32,
        inbound: Vec<u32>,
        linked: Vec<u32>,
    ) -> Links<F> {
        // A dedicated server is on no worker's machine, and a server's location
        // is on none.
        let off_machine = |p: &u32| {
            topology
                .locate(*p)
                .ok()
                .is_none_or(|l| l.machine != location.machine)
        };
        // Descriptors travel from workers only: a dedicated server checks every
        // linked worker's against the first it got and sends none (its results
        // imply that every such worker's descriptor passed there).
        let workers = topology.world_size();
        let remote_out: Vec<u32> = (0..world)
            .filter(|_| rank < workers)
            .filter(|&p| remote.get(p as usize).is_some_and(Option::is_some))
            .filter(off_machine)
            .collect();
        let remote_in: Vec<u32> = inbound
            .iter()
            .copied()
            .filter(|&p| p < workers)
            .filter(off_machine)
            .collect();
        let mut is_remote_out = vec![false; world as usize];
        for &p in &remote_out {
            is_remote_out[p as usize] = true;
        }
        Links {
            fabric,
            region,
            remote,
            topology,
            location,
            rank,
            inbound,
            linked,
            remote_out,
            remote_in,
            is_remote_out,
            counted: Counters::default(),
        }
    }

    /// Posts `request` to `peer`, counting its bytes once posted.
    pub(crate) fn write(
        &self,
        peer: u32,
        request: WriteRequest<'_, F::Region>,
    ) -> std::result::Result<(), FabricError> {
        let len = request.len as u64;
        let posted = self.fabric.write(peer, request);
        if posted.is_ok() {
            self.counted.sent.fetch_add(len, Ordering::Relaxed);
        }
        posted
    }

    /// Takes the completions ready now into `out`, counting the landings.
    pub(crate) fn poll(&self, out: &mut [Completion]) -> usize {
        let n = self.fabric.poll(out);
        self.count_landed(&out[..n]);
        n
    }

    /// Waits up to `timeout` for completions into `out`, counting the landings.
    pub(crate) fn wait(&self, out: &mut [Completion], timeout: Duration) -> usize {
        let n = self.fabric.wait(out, timeout);
        self.count_landed(&out[..n]);
        n
    }

    /// The data bytes moved so far.
    pub(crate) fn traffic(&self) -> Traffic {
        Traffic {
            sent_bytes: self.counted.sent.load(Ordering::Relaxed),
            received_bytes: self.counted.received.load(Ordering::Relaxed),
            received_in_place_bytes: self.counted.in_place.load(Ordering::Relaxed),
        }
    }

    /// Counts the landings among `completions`.
    fn count_landed(&self, completions: &[Completion]) {
        let (mut landed, mut in_place) = (0, 0);
        for c in completions {
            if let CompletionEvent::Landed { len, immediate } = c.event {
                landed += len;
                if tags::lands_in_tensor(immediate) {
                    in_place += len;
                }
            }
        }
        if landed > 0 {
            self.counted.received.fetch_add(landed, Ordering::Relaxed);
        }
        if in_place > 0 {
            self.counted.in_place.fetch_add(in_place, Ordering::Relaxed);
        }
    }

    /// Whether `peer` is on another machine and this rank writes to it.
    pub(crate) fn is_remote_out(&self, peer: u32) -> bool {
        self.is_remote_out
            .get(peer as usize)
            .copied()
            .unwrap_or(false)
    }

    /// `peer`'s staging buffers.
    pub(crate) fn remote(&self, peer: u32) -> Result<RemoteRegion> {
        self.remote
            .get(peer as usize)
            .copied()
            .flatten()
            .ok_or_else(|| {
                Error::internal(
                    "a rank writes only to peers whose staging region it knows",
                    format!("rank {peer}"),
                )
            })
    }

    /// Every rank's index on this machine if it is another worker of this
    /// machine and this rank is a worker (a dedicated server is on no worker's
    /// machine); `None` for the rest, `world` entries.
    pub(crate) fn local_indices(&self, world: u32) -> Vec<Option<u32>> {
        let workers = self.topology.world_size();
        (0..world)
            .map(|p| {
                let l = self.topology.locate(p).ok()?;
                (self.rank < workers && p != self.rank && l.machine == self.location.machine)
                    .then_some(l.device)
            })
            .collect()
    }

    /// The global rank of local rank `device` of this machine.
    pub(crate) fn local_to_global(&self, device: u32) -> u32 {
        self.topology
            .rank(Location {
                machine: self.location.machine,
                device,
            })
            .unwrap_or(u32::MAX)
    }
}

/// `ranks` as a list for messages: `1, 4, 7`.
pub(crate) fn list(ranks: &[u32]) -> String {
    ranks
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}
