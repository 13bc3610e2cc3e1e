//! The hierarchical all-reduce of one slice on one rank (DESIGN.md section 1).
//!
//! Staging buffer of rank (machine `m`, device `d`):
//!
//! ```text
//! [0, full_slice)          the slice: the rank's input, staged in; slot d of it
//!                          becomes the machine's partial sum, then the final value
//! [inbox, + (M-1) stride)  contribution areas, one per other machine
//! ```
//!
//! 1. the local reduce-scatter leaves the machine's partial sum of slot `d` in the
//!    buffer (`ReduceScatterDone`);
//! 2. `START_CONTRIBUTIONS`: each shard of the slot goes to device `d` of the
//!    machine serving it, into that machine's contribution area for `m`;
//! 3. `START_REDUCE` (every contribution in): the served shard is reduced in place;
//! 4. `START_SEND_BACK`: the reduced shard is written into the same range of every
//!    other machine's device `d` buffer (`Result`);
//! 5. `START_ALL_GATHER` (every result in): the slot is final; the local all-gather
//!    copies all slots into the caller's tensor;
//! 6. `RELEASE` once every send has completed.

use fairring_core::ReduceOp;
use fairring_core::reduce::finish_avg_bytes;
use fairring_core::staging::{Actions, Event};
use fairring_core::topology::Location;
use fairring_rdma::fabric::Fabric;

use super::tags::{self, Kind};
use super::{Active, Driver, Engine, PendingWrite, Phase};
use crate::error::{Error, Result};
use crate::local::reduce_into;

impl<F: Fabric> Engine<F> {
    pub(super) fn hierarchical_advance(&self, d: &mut Driver, b: u32, a: Active) -> Result<bool> {
        match a.phase {
            Phase::ReduceScatter => {
                let rec = self.record_of(d, &a)?;
                let (dtype, op) = (rec.sub.dtype, rec.sub.op);
                let single_machine = self.topology.machines() == 1;
                let Some(tensor) = self.output(d, b) else {
                    return Ok(false);
                };
                let final_world = single_machine.then_some(self.world);
                if !self.local.try_reduce_scatter(
                    b,
                    a.number,
                    &a.slice,
                    dtype,
                    op,
                    tensor,
                    final_world,
                )? {
                    return Ok(false);
                }
                self.set_phase(d, b, Phase::Exchange);
                self.staging_event(d, b, Event::ReduceScatterDone)?;
                Ok(true)
            }
            Phase::Exchange => {
                if a.contributing {
                    return self.post_contributions(d, b);
                }
                Ok(false)
            }
            Phase::AllGather => {
                let Some(output) = self.output(d, b) else {
                    return Ok(false);
                };
                let own_in_tensor = self.topology.machines() == 1;
                if !self
                    .local
                    .try_all_gather(b, a.number, &a.slice, output, own_in_tensor)
                {
                    return Ok(false);
                }
                self.set_phase(d, b, Phase::Draining);
                self.staging_event(d, b, Event::AllGatherDone)?;
                Ok(true)
            }
            Phase::Draining => Ok(false),
        }
    }

    fn set_phase(&self, d: &mut Driver, b: u32, phase: Phase) {
        if let Some(a) = d.slots[b as usize].active.as_mut() {
            a.phase = phase;
        }
    }

    pub(super) fn hierarchical_actions(
        &self,
        d: &mut Driver,
        b: u32,
        actions: Actions,
    ) -> Result<()> {
        if actions.contains(Actions::START_CONTRIBUTIONS) {
            if let Some(a) = d.slots[b as usize].active.as_mut() {
                a.contributing = true;
            }
            self.post_contributions(d, b)?;
        }
        if actions.contains(Actions::START_REDUCE) {
            self.reduce_served(d, b)?;
            // Reports `Reduced`, which hands out the send-back (and perhaps the
            // all-gather) in a nested call.
            return self.staging_event(d, b, Event::Reduced);
        }
        if actions.contains(Actions::START_SEND_BACK) {
            self.send_results(d, b)?;
        }
        if actions.contains(Actions::START_ALL_GATHER) {
            let a = d.slots[b as usize]
                .active
                .ok_or_else(|| Error::invalid("staging buffer", "all-gather on an idle buffer"))?;
            self.local.publish_slot(b, a.number);
            self.set_phase(d, b, Phase::AllGather);
        }
        Ok(())
    }

    /// The rank of device `d` of machine `machine`.
    fn rail_peer(&self, machine: u32) -> Result<u32> {
        self.topology
            .rank(Location {
                machine,
                device: self.location.device,
            })
            .map_err(|e| Error::invalid("machine", e.to_string()))
    }

    /// The byte range of cell (this device, `shard`) from the start of the slice.
    fn cell_range(&self, a: &Active, shard: u32) -> Result<std::ops::Range<usize>> {
        let cell = a
            .slice
            .cell(self.location.device, shard)
            .map_err(|e| Error::invalid("shard", e.to_string()))?;
        let base = a.slice.span().byte_offset();
        let start = usize::try_from(cell.span().byte_offset() - base).unwrap_or(usize::MAX);
        let len = usize::try_from(cell.span().byte_len()).unwrap_or(usize::MAX);
        Ok(start..start + len)
    }

    /// Offset of machine `from`'s contribution area in a buffer of machine `own`.
    fn contribution_offset(&self, from: u32, own: u32) -> Result<usize> {
        let layout = self.geometry.staging_layout();
        let area = layout
            .contribution(from, own)
            .map_err(|e| Error::invalid("machine", e.to_string()))?;
        let rel = area.offset() - layout.slot().len();
        Ok(self.layout.inbox + usize::try_from(rel).unwrap_or(usize::MAX))
    }

    /// Queues the contributions not yet queued; they go out as credit allows.
    fn post_contributions(&self, d: &mut Driver, b: u32) -> Result<bool> {
        let Some(a) = d.slots[b as usize].active else {
            return Ok(false);
        };
        let me = self.location.machine;
        let shards = a.slice.shards();
        let mut queued = false;
        for j in a.next_contribution..shards {
            let server = a
                .slice
                .server(j)
                .map_err(|e| Error::invalid("shard", e.to_string()))?;
            if server == me {
                continue;
            }
            let range = self.cell_range(&a, j)?;
            let peer = self.rail_peer(server)?;
            let base = self.buffer_offset(b);
            let w = PendingWrite {
                peer,
                source: base + range.start,
                len: range.len(),
                target: (base + self.contribution_offset(me, server)?) as u64,
                immediate: tags::immediate(Kind::Contribution, b, a.generation),
                token: tags::token(Kind::Contribution, b, a.generation),
                credit_for: Some(a.number),
            };
            self.post(d, b, w)?;
            queued = true;
        }
        if let Some(x) = d.slots[b as usize].active.as_mut() {
            x.next_contribution = shards;
            x.contributing = false;
        }
        Ok(queued)
    }

    /// Reduces the shard this machine serves, in place, over the contributions.
    fn reduce_served(&self, d: &mut Driver, b: u32) -> Result<()> {
        let (a, rec) = self.active_record(d, b)?;
        let me = self.location.machine;
        let shard = a
            .slice
            .shard_served_by(me)
            .map_err(|e| Error::invalid("machine", e.to_string()))?
            .ok_or_else(|| {
                Error::invalid("machine", "reduce handed to a machine serving nothing")
            })?;
        let range = self.cell_range(&a, shard)?;
        let len = range.len();
        let machines = self.topology.machines();
        let dst = self.staging(b, range);
        let mut srcs = (0..machines).filter(|&m| m != me).map(|m| {
            let off = self.contribution_offset(m, me).unwrap_or(0);
            &*self.staging(b, off..off + len)
        });
        reduce_into(rec.sub.dtype, rec.sub.op, dst, &mut srcs)?;
        if rec.sub.op == ReduceOp::Avg {
            finish_avg_bytes(rec.sub.dtype, dst, self.world)
                .map_err(|e| Error::invalid("reduction", e.to_string()))?;
        }
        Ok(())
    }

    /// Writes the reduced shard to device `d` of every other machine.
    fn send_results(&self, d: &mut Driver, b: u32) -> Result<()> {
        let a = d.slots[b as usize]
            .active
            .ok_or_else(|| Error::invalid("staging buffer", "send-back on an idle buffer"))?;
        let me = self.location.machine;
        let shard = a
            .slice
            .shard_served_by(me)
            .map_err(|e| Error::invalid("machine", e.to_string()))?
            .ok_or_else(|| Error::invalid("machine", "send-back by a machine serving nothing"))?;
        let range = self.cell_range(&a, shard)?;
        let base = self.buffer_offset(b);
        for m in (0..self.topology.machines()).filter(|&m| m != me) {
            let w = PendingWrite {
                peer: self.rail_peer(m)?,
                source: base + range.start,
                len: range.len(),
                target: (base + range.start) as u64,
                immediate: tags::immediate(Kind::Result, b, a.generation),
                token: tags::token(Kind::Result, b, a.generation),
                credit_for: None,
            };
            self.post(d, b, w)?;
        }
        Ok(())
    }
}
