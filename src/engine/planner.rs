//! What the caller's thread fixes for each operation, in submission order:
//! its plan, the numbers of its slices, and, on device tensors, its device
//! program, enqueued whole before the operation reaches the driver.
//!
//! Slice `n` takes staging buffer `n % B`, so numbering an operation's
//! slices when it is submitted fixes which buffer and generation each takes,
//! and with them the stream and the stage values of its device program
//! ([`crate::memory::program`]). Submissions are serialised by the
//! planner's lock, and queued for the driver under it: the driver takes
//! them in the order their slices were numbered, and starts slices in that
//! order.

use fairring_core::plan::Plan;
use fairring_rdma::fabric::Fabric;

use super::Engine;
use super::algorithm::Resolved;
use super::work_table::Submission;
use crate::error::{Error, Result};
use crate::memory::MemorySpace;
use crate::memory::program::ProgramItem;

/// The caller's side of planning, behind the engine's planner lock.
pub(crate) struct Planner<M: MemorySpace> {
    /// Where the next hierarchical operation's plan starts rotating its
    /// servers (the machines' own plan beside dedicated servers and small
    /// tensors in groups turn it too).
    rotation: u64,
    /// The number of the next operation's first slice.
    next_slice: u64,
    /// A device program's items, kept from one operation to the next so
    /// that a warm submission allocates nothing.
    items: Vec<ProgramItem<M::Tensor>>,
}

impl<M: MemorySpace> Planner<M> {
    pub(crate) fn new() -> Planner<M> {
        Planner {
            rotation: 0,
            next_slice: 0,
            items: Vec::new(),
        }
    }
}

/// An operation as the driver takes it from the queue: planned, its slices
/// numbered, its device program enqueued.
pub(crate) struct Accepted<M: MemorySpace> {
    pub(crate) sub: Submission<M>,
    pub(crate) plan: Plan,
    /// The number of its first slice.
    pub(crate) first_slice: u64,
    /// Its device program, where it runs one.
    pub(crate) device: Option<Program>,
}

/// An operation's device program, as enqueued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Program {
    /// Whether every slice's end and the delivery were enqueued: once the
    /// gates open, the streams reach them, and the engine can tell when
    /// the device is done with the tensor. Otherwise (a CUDA call failed
    /// part way) it cannot.
    pub(crate) ends: bool,
}

impl<F: Fabric, M: MemorySpace> Engine<F, M> {
    /// Plans `sub` and, on device tensors, enqueues its program; returns the
    /// operation to queue and, if its program could not be enqueued whole,
    /// why (the engine then fails). Refused before anything is enqueued
    /// only where its plan cannot be made.
    pub(super) fn plan(
        &self,
        planner: &mut Planner<M>,
        sub: Submission<M>,
    ) -> Result<(Accepted<M>, Option<Error>)> {
        let geometry = self.geometry_of(sub.algorithm()).map_err(|f| f.error)?;
        // One machine whose local step works in the tensor, or the job's
        // NCCL all-reduce: no staging buffer bounds the slice, so one slice
        // takes the whole tensor.
        let in_tensor = self
            .local
            .works_in_tensor(&sub.tensor, sub.dtype(), sub.op());
        // A dedicated server plans the workers' NCCL all-reduce as they do
        // (one slice, which it does not serve), so that its slices keep
        // their numbers.
        if sub.algorithm() == Resolved::Nccl && !in_tensor && self.server.is_none() {
            return Err(Error::internal(
                "the job's NCCL all-reduce is chosen only where the machine's collectives \
                 work in the tensor",
                format!("{}", sub.descriptor),
            ));
        }
        // (The machines' own plan beside servers is never whole: a server,
        // which has no tensor, plans it slice by slice as the workers do.)
        let whole = sub.algorithm() == Resolved::Nccl
            || (sub.algorithm() == Resolved::Hierarchical
                && geometry.topology().machines() == 1
                && self.servers == 0
                && in_tensor);
        let plan = if whole {
            Plan::whole(geometry, sub.dtype(), sub.elements())
        } else {
            Plan::new(geometry, sub.dtype(), sub.elements(), planner.rotation)
        }
        .map_err(|e| {
            Error::internal(
                "submitted tensors plan (the communicator checked their size)",
                e.to_string(),
            )
        })?;
        let first_slice = planner.next_slice;
        let mut refused = None;
        let device = if self.memory.on_device(&sub.tensor) {
            let items = &mut planner.items;
            items.clear();
            self.program(&sub, &plan, first_slice, &mut |item| {
                items.push(item);
                Ok(())
            })?;
            let enqueued = self.local.enqueue(&sub.tensor, sub.seq, &planner.items);
            let ends = match enqueued {
                Ok(()) => true,
                Err(unfinished) => {
                    refused = Some(unfinished.error);
                    unfinished.ends
                }
            };
            Some(Program { ends })
        } else {
            None
        };
        planner.next_slice += plan.slice_count();
        if matches!(
            sub.algorithm(),
            Resolved::Hierarchical | Resolved::Colocated | Resolved::Grouped
        ) {
            planner.rotation = plan.next_rotation();
        }
        let accepted = Accepted {
            sub,
            plan,
            first_slice,
            device,
        };
        Ok((accepted, refused))
    }
}
