//! Everything this rank sends: data writes waiting for their turn, and control
//! messages.
//!
//! A data write of a slice goes into its buffer's queue and leaves, in posting
//! order, once the peer has credited the slice (if it lands in the peer's inbox),
//! the peer has this operation's descriptor (if it is on another machine), and the
//! fabric's queue has room. Control messages (credits, descriptors, goodbyes,
//! failures) go through [`send_control`], the one place that tells a full queue
//! from a refusal; each caller decides what a full queue means for it (credits
//! and descriptors go again on a later pass, a failure report retries for a
//! while).

use std::time::Instant;

use fairring_rdma::fabric::{Fabric, FabricError, RemoteRegion, WriteRequest};

use super::links::Links;
use super::tags::{self, Kind};
use crate::error::{Error, Result};

/// A write waiting for credit, its descriptor or room in the fabric's queue.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PendingWrite {
    pub(crate) peer: u32,
    /// Offset in this rank's registered staging memory, or in the operation's
    /// tensor if `from_tensor`.
    pub(crate) source: usize,
    /// The bytes are the tensor's, registered for the operation (`direct`).
    pub(crate) from_tensor: bool,
    pub(crate) len: usize,
    /// Offset in the peer's registered staging memory.
    pub(crate) target: u64,
    pub(crate) immediate: u32,
    /// Where it lands instead if the peer opened a window for the operation
    /// (`direct`); it then waits for the peer's descriptor, which says.
    pub(crate) window: Option<WindowTarget>,
    pub(crate) token: u64,
    /// The operation the write belongs to.
    pub(crate) seq: u64,
    /// The slice the peer must have credited, if the write lands in its inbox.
    pub(crate) credit_for: Option<u64>,
}

/// Where a write lands in the peer's window, and what it says there.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WindowTarget {
    /// Offset in the window (the peer's tensor).
    pub(crate) offset: u64,
    /// The immediate it carries there (its kind says it landed in place).
    pub(crate) immediate: u32,
}

/// What became of a control message.
pub(crate) enum Sent {
    /// Posted.
    Posted,
    /// The fabric's queue to the peer is full; nothing was posted.
    Full,
    /// The fabric refused it (the peer failed or left).
    Refused(FabricError),
}

/// Posts a control message of `kind` to `peer`.
pub(crate) fn send_control<F: Fabric>(fabric: &F, peer: u32, kind: Kind, payload: &[u8]) -> Sent {
    match fabric.send_message(
        peer,
        tags::immediate(kind, 0, 0, 0),
        payload,
        tags::token(kind, 0, 0, 0),
    ) {
        Ok(()) => Sent::Posted,
        Err(FabricError::QueueFull { .. }) => Sent::Full,
        Err(e) => Sent::Refused(e),
    }
}

/// [`send_control`], retrying while the queue is full until `deadline`; returns
/// whether it was posted.
pub(crate) fn send_control_until<F: Fabric>(
    fabric: &F,
    peer: u32,
    kind: Kind,
    payload: &[u8],
    deadline: Instant,
) -> bool {
    loop {
        match send_control(fabric, peer, kind, payload) {
            Sent::Posted => return true,
            Sent::Full if Instant::now() < deadline => std::thread::yield_now(),
            Sent::Full | Sent::Refused(_) => return false,
        }
    }
}

/// The data writes waiting, per staging buffer, in posting order.
pub(crate) struct Outbox {
    queues: Vec<Vec<PendingWrite>>,
}

impl Outbox {
    /// Queues for `buffers` buffers of up to `writes` writes each (more allocate).
    pub(crate) fn new(buffers: u32, writes: usize) -> Outbox {
        Outbox {
            queues: (0..buffers).map(|_| Vec::with_capacity(writes)).collect(),
        }
    }

    /// Queues `w` behind buffer `buffer`'s waiting writes.
    pub(crate) fn queue(&mut self, buffer: u32, w: PendingWrite) {
        self.queues[buffer as usize].push(w);
    }

    /// Posts buffer `buffer`'s writes, in order, while `may_go` allows them (the
    /// peer's credit, its descriptor: see `credits` and `checks`) and the fabric
    /// takes them; returns whether any went. `tensor` is the registration of the
    /// slice's tensor, where its writes leave from it; `window_of` says the
    /// peer's window for a write's operation, if it opened one.
    pub(crate) fn flush<F: Fabric>(
        &mut self,
        buffer: u32,
        links: &Links<F>,
        tensor: Option<&F::Region>,
        may_go: impl Fn(&PendingWrite) -> bool,
        window_of: impl Fn(&PendingWrite) -> Option<RemoteRegion>,
    ) -> Result<bool> {
        let queue = &mut self.queues[buffer as usize];
        let mut posted = 0;
        for w in queue.iter() {
            if !may_go(w) {
                break;
            }
            let source = match (w.from_tensor, tensor) {
                (false, _) => &links.region,
                (true, Some(region)) => region,
                (true, None) => {
                    return Err(Error::internal(
                        "a write from a tensor leaves while the tensor is registered",
                        format!("operation #{} to rank {}", w.seq, w.peer),
                    ));
                }
            };
            let (target, target_offset, immediate) = match w.window.zip(window_of(w)) {
                Some((at, window)) => (window, at.offset, at.immediate),
                None => (links.remote(w.peer)?, w.target, w.immediate),
            };
            let request = WriteRequest {
                source,
                source_offset: w.source,
                len: w.len,
                target,
                target_offset,
                immediate,
                token: w.token,
            };
            match links.write(w.peer, request) {
                Ok(()) => posted += 1,
                Err(FabricError::QueueFull { .. }) => break,
                // The peer's failure also arrives as a completion, after whatever it
                // sent before failing (a failure report, a goodbye): the engine fails
                // there, with the peer's reason, and not here first.
                Err(FabricError::PeerFailed { .. }) => break,
                Err(e) => return Err(Error::from(e)),
            }
        }
        queue.drain(..posted);
        Ok(posted > 0)
    }

    /// Whether writes of buffer `buffer` wait.
    pub(crate) fn waiting(&self, buffer: u32) -> bool {
        !self.queues[buffer as usize].is_empty()
    }

    /// Drops every waiting write (the engine failed).
    pub(crate) fn clear(&mut self) {
        for q in &mut self.queues {
            q.clear();
        }
    }
}
