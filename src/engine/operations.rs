//! The operation table: every operation the driver has accepted and not yet
//! completed, in sequence order, and where slicing it has got to.
//!
//! Operation `seq` lives in entry `seq % WORK_CAPACITY` (the [`WorkTable`] bounds
//! how many are outstanding). Its slices start in order, one per free staging
//! buffer; when the last one is released the operation is *finished*, and it
//! completes once its descriptor checks have passed too.
//!
//! [`WorkTable`]: super::work_table::WorkTable

use fairring_core::plan::{Plan, Slice};

use super::algorithm::Resolved;
use super::planner::{Accepted, Program};
use super::work_table::{Submission, WORK_CAPACITY, slot_of};
use crate::error::{Error, Result};
use crate::memory::MemorySpace;

/// One operation, as the driver tracks it.
pub(crate) struct Record<M: MemorySpace> {
    pub(crate) sub: Submission<M>,
    pub(crate) plan: Plan,
    /// The number of its first slice, fixed when it was submitted.
    pub(crate) first_slice: u64,
    /// Its device program, where it runs one.
    pub(crate) device: Option<Program>,
    slices_done: u64,
    /// Every slice is done; completion waits for the descriptor checks.
    finished: bool,
    /// The delivery of a reduce-scatter's share, once started (through
    /// [`Operations::hold_delivery`], which counts it).
    delivering: Option<M::Fence>,
}

impl<M: MemorySpace> Record<M> {
    /// Whether every slice is done.
    pub(crate) fn finished(&self) -> bool {
        self.finished
    }
}

/// The next slice to start.
pub(crate) struct NextSlice {
    pub(crate) seq: u64,
    pub(crate) slice: Slice,
    pub(crate) algorithm: Resolved,
    /// Its number, as numbered when its operation was submitted.
    pub(crate) number: u64,
}

/// Every operation accepted and not completed.
pub(crate) struct Operations<M: MemorySpace> {
    records: Vec<Option<Record<M>>>,
    /// The next sequence number to accept.
    accepted: u64,
    /// The operation whose slices are being started, and its next slice index.
    start_seq: u64,
    start_index: u64,
    /// Operations finished and waiting for their checks.
    finished_waiting: u32,
    /// The oldest operation not completed (or `accepted`).
    oldest_open: u64,
    /// Operations whose delivery (a reduce-scatter's share) is running.
    delivering: u32,
}

impl<M: MemorySpace> Operations<M> {
    pub(crate) fn new() -> Operations<M> {
        Operations {
            records: (0..WORK_CAPACITY).map(|_| None).collect(),
            accepted: 0,
            start_seq: 0,
            start_index: 0,
            finished_waiting: 0,
            oldest_open: 0,
            delivering: 0,
        }
    }

    /// Operations below this have been accepted.
    pub(crate) fn accepted(&self) -> u64 {
        self.accepted
    }

    /// The oldest operation not completed.
    pub(crate) fn oldest_open(&self) -> u64 {
        self.oldest_open
    }

    /// The operation whose slices start next.
    pub(crate) fn starting(&self) -> u64 {
        self.start_seq
    }

    /// Whether any operation is accepted and not completed.
    pub(crate) fn in_flight(&self) -> bool {
        self.start_seq < self.accepted || self.finished_waiting > 0
    }

    /// Whether some operation's delivery is running (a fence that rings no
    /// doorbell when it passes).
    pub(crate) fn delivering(&self) -> bool {
        self.delivering > 0
    }

    /// Holds operation `seq`'s running delivery until it passes.
    pub(crate) fn hold_delivery(&mut self, seq: u64, fence: M::Fence) {
        if let Some(rec) = self.get_mut(seq) {
            if rec.delivering.is_none() {
                self.delivering += 1;
            }
            // Borrowed again: `self.delivering` was updated above.
            if let Some(rec) = self.get_mut(seq) {
                rec.delivering = Some(fence);
            }
        }
    }

    /// Takes operation `seq`'s running delivery, if any.
    pub(crate) fn take_delivery(&mut self, seq: u64) -> Option<M::Fence> {
        let fence = self.get_mut(seq)?.delivering.take()?;
        self.delivering -= 1;
        Some(fence)
    }

    /// Takes every running delivery (the engine failed).
    pub(crate) fn take_deliveries(&mut self) -> Vec<M::Fence> {
        self.delivering = 0;
        self.records
            .iter_mut()
            .filter_map(|r| r.as_mut().and_then(|rec| rec.delivering.take()))
            .collect()
    }

    /// Whether some finished operation waits for its checks.
    pub(crate) fn any_finished(&self) -> bool {
        self.finished_waiting > 0
    }

    /// Accepts `accepted`, the next operation in sequence, as its caller
    /// planned it; one it cannot record is handed back with the reason (its
    /// device program may be enqueued: it must still be settled).
    pub(crate) fn accept(
        &mut self,
        accepted: Accepted<M>,
    ) -> std::result::Result<(), (Error, Box<Accepted<M>>)> {
        let seq = accepted.sub.seq;
        if seq != self.accepted {
            let error = Error::internal(
                "operations reach the driver in sequence",
                format!("#{seq} arrived, #{} expected", self.accepted),
            );
            return Err((error, Box::new(accepted)));
        }
        let slot = slot_of(seq);
        if self.records[slot].is_some() {
            let error = Error::internal(
                "at most one operation per table entry is open",
                format!(
                    "#{seq} arrived while #{} is open",
                    seq - WORK_CAPACITY as u64
                ),
            );
            return Err((error, Box::new(accepted)));
        }
        let Accepted {
            sub,
            plan,
            first_slice,
            device,
        } = accepted;
        self.accepted += 1;
        self.records[slot] = Some(Record {
            sub,
            plan,
            first_slice,
            device,
            slices_done: 0,
            finished: false,
            delivering: None,
        });
        Ok(())
    }

    /// The operation `seq`, while it is open.
    pub(crate) fn get(&self, seq: u64) -> Option<&Record<M>> {
        self.records[slot_of(seq)]
            .as_ref()
            .filter(|r| r.sub.seq == seq)
    }

    /// The operation `seq`, while it is open.
    pub(crate) fn get_mut(&mut self, seq: u64) -> Option<&mut Record<M>> {
        self.records[slot_of(seq)]
            .as_mut()
            .filter(|r| r.sub.seq == seq)
    }

    /// The next slice to start, if an accepted operation has one left. Operations
    /// with no slices (empty tensors) are finished on the way.
    pub(crate) fn next_slice(&mut self) -> Result<Option<NextSlice>> {
        loop {
            if self.start_seq >= self.accepted {
                return Ok(None);
            }
            let seq = self.start_seq;
            let Some(rec) = self.get(seq) else {
                self.start_seq += 1;
                self.start_index = 0;
                continue;
            };
            let count = rec.plan.slice_count();
            if self.start_index >= count {
                self.start_seq += 1;
                self.start_index = 0;
                if count == 0 {
                    self.finish(seq);
                }
                continue;
            }
            let slice = rec.plan.slice(self.start_index).map_err(|e| {
                Error::internal("every slice index below the count plans", e.to_string())
            })?;
            return Ok(Some(NextSlice {
                seq,
                slice,
                algorithm: rec.sub.algorithm(),
                number: rec.first_slice + self.start_index,
            }));
        }
    }

    /// The slice [`next_slice`](Operations::next_slice) returned has started.
    pub(crate) fn started(&mut self) {
        self.start_index += 1;
    }

    /// A slice of `seq` released its buffer; returns whether that finished `seq`.
    pub(crate) fn slice_done(&mut self, seq: u64) -> Result<bool> {
        let rec = self.get_mut(seq).ok_or_else(|| {
            Error::internal(
                "a slice belongs to an open operation",
                format!("operation #{seq}"),
            )
        })?;
        rec.slices_done += 1;
        if rec.slices_done == rec.plan.slice_count() {
            self.finish(seq);
            return Ok(true);
        }
        Ok(false)
    }

    fn finish(&mut self, seq: u64) {
        if let Some(rec) = self.get_mut(seq)
            && !rec.finished
        {
            rec.finished = true;
            self.finished_waiting += 1;
        }
    }

    /// Removes finished operation `seq`, completing it.
    pub(crate) fn complete(&mut self, seq: u64) -> Option<Record<M>> {
        let slot = &mut self.records[slot_of(seq)];
        if !slot
            .as_ref()
            .is_some_and(|r| r.sub.seq == seq && r.finished)
        {
            return None;
        }
        self.finished_waiting -= 1;
        let rec = slot.take();
        while self.oldest_open < self.accepted && self.records[slot_of(self.oldest_open)].is_none()
        {
            self.oldest_open += 1;
        }
        rec
    }

    /// Takes every open operation (the engine failed).
    pub(crate) fn drain(&mut self) -> impl Iterator<Item = Record<M>> + '_ {
        self.finished_waiting = 0;
        self.delivering = 0;
        self.start_seq = self.accepted;
        self.oldest_open = self.accepted;
        self.records.iter_mut().filter_map(Option::take)
    }
}

#[cfg(test)]
mod tests {
    use fairring_core::plan::{Geometry, PlanConfig};
    use fairring_core::topology::{RankLayout, Topology};
    use fairring_core::{DataType, ReduceOp, WireFormat};

    use super::*;
    use crate::engine::descriptor::{Collective, Descriptor};
    use crate::memory::{Host, HostTensor, MemoryKind};

    /// A running delivery counts until it is taken, so the progress thread
    /// naps as for a fence meanwhile (no doorbell rings when it passes).
    #[test]
    fn a_running_delivery_counts_until_taken() {
        let topology = Topology::new(1, 1, RankLayout::Contiguous).unwrap();
        let geometry = Geometry::new(topology, PlanConfig::new(4096, 64).unwrap()).unwrap();
        let mut ops: Operations<Host> = Operations::new();
        let descriptor = Descriptor {
            collective: Collective::AllReduce,
            dtype: DataType::F32,
            op: ReduceOp::Sum,
            algorithm: Resolved::Hierarchical,
            wire: WireFormat::Exact,
            memory: MemoryKind::Host,
            by_messages: false,
            root: 0,
            elements: 16,
        };
        let sub = |seq| Accepted {
            plan: Plan::new(&geometry, DataType::F32, 16, 0).unwrap(),
            first_slice: seq,
            device: None,
            sub: Submission::new(
                seq,
                HostTensor::new(std::ptr::null_mut(), 0),
                descriptor,
                None,
                geometry.topology().world_size(),
            )
            .unwrap(),
        };
        let refused = ops.accept(sub(1)).unwrap_err();
        assert!(
            refused.0.to_string().contains("#1 arrived, #0 expected"),
            "{}",
            refused.0
        );
        assert_eq!(
            refused.1.sub.seq, 1,
            "an operation out of sequence is handed back"
        );
        ops.accept(sub(0)).map_err(|(e, _)| e).unwrap();
        ops.accept(sub(1)).map_err(|(e, _)| e).unwrap();
        assert!(!ops.delivering());
        ops.hold_delivery(0, ());
        ops.hold_delivery(0, ());
        ops.hold_delivery(1, ());
        assert!(ops.delivering());
        assert!(ops.take_delivery(0).is_some());
        assert!(ops.take_delivery(0).is_none());
        assert!(ops.delivering(), "operation 1's still runs");
        assert!(ops.take_delivery(1).is_some());
        assert!(!ops.delivering());
        ops.hold_delivery(1, ());
        assert_eq!(ops.drain().count(), 2);
        assert!(!ops.delivering(), "a failed engine holds none");
        // No open operation: nothing is held.
        ops.hold_delivery(7, ());
        assert!(!ops.delivering());
    }
}
