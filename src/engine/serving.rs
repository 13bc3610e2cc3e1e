//! A dedicated server's operations: it has no caller, so it learns each operation
//! from the first worker's descriptor of it, and it is done once every worker of
//! its rail group (the workers it is linked to) has left.
//!
//! Workers send their descriptor of operation `s` to every server of their rail
//! group before any data
//! of `s` (the descriptor checks, `checks`). The first descriptor of `s` to reach
//! a server becomes the server's own: the server plans the same all-reduce from it
//! ([`Descriptor::runs_as`]) and takes its slices in turn like any rank, and every
//! other worker's descriptor of `s` is compared with it, so a worker that issued a
//! different operation fails the job with [`Error::Mismatch`](crate::Error) here
//! too. The server sends no descriptors: a worker's cell is reduced only after
//! that worker's descriptor passed here (it comes first on the same ordered
//! connection), so a result coming back from the server says as much.

use fairring_rdma::fabric::Fabric;

use super::algorithm::Resolved;
use super::choice::{NCCL_ACROSS_UP_TO_MACHINES, nccl_over_workers_may_run};
use super::descriptor::{Descriptor, Words};
use super::failure::Fault;
use super::work_table::Submission;
use super::{Driver, Engine};
use crate::error::Error;
use crate::memory::MemorySpace;

impl<F: Fabric, M: MemorySpace> Engine<F, M> {
    /// On a dedicated server, accepts operation `seq` from `peer`'s descriptor if
    /// it is the next one and no worker described it first.
    pub(super) fn accept_described(
        &self,
        d: &mut Driver<M>,
        peer: u32,
        seq: u64,
        words: Words,
    ) -> Result<(), Fault> {
        if self.server.is_none() || seq != d.operations.accepted() {
            return Ok(());
        }
        let descriptor = Descriptor::from_words(words).ok_or_else(|| {
            Error::peer(
                peer,
                format!("sent a descriptor of operation #{seq} this server cannot decode"),
            )
        })?;
        if !descriptor.wire.carries(descriptor.dtype) {
            return Err(Error::peer(
                peer,
                format!(
                    "described operation #{seq} as {descriptor}: the {} wire carries f32 \
                     values only",
                    descriptor.wire
                ),
            )
            .into());
        }
        // The workers' NCCL all-reduce, which a server plans and serves none
        // of, runs beside servers only where one can run over the workers
        // (one machine of several ranks, or two to seven such machines):
        // elsewhere the servers would let a step between machines pass
        // unserved.
        let topology = self.geometry.topology();
        let servers = self.geometry.servers().unwrap_or(0);
        if descriptor.algorithm == Resolved::Nccl && !nccl_over_workers_may_run(topology, servers) {
            return Err(Error::peer(
                peer,
                format!(
                    "described operation #{seq} as {descriptor}: NCCL's all-reduce runs beside \
                     dedicated servers only on one to {NCCL_ACROSS_UP_TO_MACHINES} machines of \
                     several ranks"
                ),
            )
            .into());
        }
        // The machines' own plan, which a server plans and serves none of,
        // needs the geometry of the job without servers.
        if descriptor.algorithm == Resolved::Colocated && self.second_geometry.is_none() {
            return Err(Error::peer(
                peer,
                format!(
                    "described operation #{seq} as {descriptor}: the machines cannot serve \
                     their own shards in this job (it plans only with dedicated servers)"
                ),
            )
            .into());
        }
        // Small tensors in groups run only in jobs without servers.
        if descriptor.algorithm == Resolved::Grouped {
            return Err(Error::peer(
                peer,
                format!(
                    "described operation #{seq} as {descriptor}: small tensors run in groups \
                     only in a job without dedicated servers"
                ),
            )
            .into());
        }
        let world = topology.world_size();
        let sub = Submission::new(seq, self.memory.no_tensor(), descriptor, None, world)
            .ok_or_else(|| {
                Error::peer(
                    peer,
                    format!("described operation #{seq} as {descriptor}, which overflows"),
                )
            })?;
        // Planned as a worker's is, in the order the workers numbered it.
        let (accepted, _) = self.plan(&mut self.lock_planner(), sub)?;
        self.accept(d, accepted)?;
        // A mismatch with it names the two workers. (No other worker's descriptor
        // of `seq` came before: each worker's arrive in order, so the first of any
        // of them to arrive is accepted at once.)
        d.checks.described_by(seq, peer);
        Ok(())
    }

    /// Whether a dedicated server is done: every worker of its rail group (all
    /// the workers it is linked to) has said goodbye and nothing is in
    /// flight. The servers of its rail group it is linked to in groups are
    /// not waited for: each leaves once its workers have, and every
    /// operation a worker finished needed every exchange between servers.
    pub(crate) fn served_everyone(&self) -> bool {
        let d = self.lock_driver();
        let workers = self.links.topology.world_size();
        self.links
            .linked
            .iter()
            .filter(|&&p| p < workers)
            .all(|&w| d.departures.departed(w))
            && !self.in_flight(&d)
    }

    /// Operations accepted so far (a server's count for its goodbye).
    pub(crate) fn accepted_operations(&self) -> u64 {
        self.lock_driver().operations.accepted()
    }
}
