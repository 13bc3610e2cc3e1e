//! What a stalled engine waits for, in words: the timeout error names the slice,
//! where it is, and the ranks it waits on.

use fairring_rdma::fabric::Fabric;

use super::links::list;
use super::{Driver, Engine};
use crate::memory::MemorySpace;

impl<F: Fabric, M: MemorySpace> Engine<F, M> {
    /// Whether anything is accepted and not completed.
    pub(super) fn in_flight(&self, d: &Driver<M>) -> bool {
        d.operations.in_flight() || d.slices.any_active()
    }

    /// Whether the only work in flight is an operation whose caller's stream
    /// has not reached its start: no slice holds a buffer, and nothing
    /// finished waits to complete.
    pub(super) fn waits_only_for_a_start(&self, d: &Driver<M>) -> bool {
        d.slices.awaits_start && !d.slices.any_active() && !d.operations.any_finished()
    }

    /// What the oldest work in flight waits for.
    pub(super) fn describe_stall(&self, d: &Driver<M>) -> String {
        if let Some((b, slot, a)) = d.slices.oldest() {
            let lagging: Vec<u32> = if slot.local.is_some() {
                self.local
                    .laggards(b, a.number)
                    .into_iter()
                    .filter(|&r| r != self.links.location.device)
                    .map(|r| self.links.local_to_global(r))
                    .collect()
            } else {
                Vec::new()
            };
            let waits = if lagging.is_empty() {
                format!(
                    "no data from the ranks it exchanges with (rank(s) {} write to this one)",
                    list(&self.links.inbound)
                )
            } else {
                format!("local rank(s) {} to do their part", list(&lagging))
            };
            return format!(
                "slice {} of operation #{} ({}) to leave its {}: {waits}",
                a.number,
                a.seq,
                a.resolved,
                a.algorithm.phase()
            );
        }
        let seq = if d.checks.local_checked() < d.operations.accepted() {
            d.checks.local_checked()
        } else {
            d.operations.oldest_open()
        };
        let missing = d.checks.not_issued(seq, &self.machine, &self.links);
        if missing.is_empty() {
            format!(
                "a staging buffer for operation #{}",
                d.operations.starting()
            )
        } else {
            format!(
                "rank(s) {} to issue operation #{seq} (or a peer skipped a call)",
                list(&missing)
            )
        }
    }
}
