//! One pass of the driver: what happens, in order, each time a thread drives.
//!
//! 1. a failure another local rank published fails this rank too;
//! 2. new submissions are accepted (planned, described to the local ranks);
//! 3. the local ranks' descriptors are checked;
//! 4. the fabric's completions are dispatched (`dispatch`);
//! 5. credits and descriptors go out (`credits`, `checks`): a credit only if its
//!    peer is short of slices, or the pass accepted an operation or found nothing
//!    to do;
//! 6. finished operations whose checks passed complete;
//! 7. slices start while buffers are free (`slices`);
//! 8. every slice in flight moves on where it waits (`steps`).
//!
//! Nothing here blocks; a pass returns whether anything moved, and the progress
//! loop (`progress`) decides whether to drive again, spin or sleep.

use fairring_core::plan::Geometry;
use fairring_rdma::fabric::{Fabric, LocalRegion, RemoteRegion};

use super::credits::Due;
use super::failure::{FailureRecord, Fault};
use super::planner::Accepted;
use super::work_table::{DONE, Submission};
use super::{Driver, Engine, POLL_BATCH};
use super::{Resolved, direct};
use crate::error::Error;
use crate::memory::MemorySpace;

impl<F: Fabric, M: MemorySpace> Engine<F, M> {
    /// One pass; returns whether anything moved.
    pub(super) fn drive(&self, d: &mut Driver<M>) -> Result<bool, Fault> {
        if let Some((device, words)) = self.machine.failure()
            && device != self.machine.local_rank()
        {
            let record = FailureRecord::from_words(words);
            let error = record.decode(self.links.local_to_global(device), self.rank());
            return Err(Fault::with_record(error, record));
        }
        let mut progressed = false;
        while let Some(sub) = self.submissions.pop() {
            progressed = true;
            self.accept(d, sub)?;
        }
        progressed |= self.drive_messages()?;
        let checked = d
            .checks
            .check_local(d.operations.accepted(), &self.machine, &self.links)?;
        if !checked.is_empty() {
            progressed = true;
            for seq in checked {
                self.try_complete(d, seq)?;
            }
        }
        if self.uses_fabric {
            loop {
                let mut batch = std::mem::take(&mut d.scratch.completions);
                let n = self.links.poll(&mut batch);
                let result = batch[..n]
                    .iter()
                    .try_for_each(|c| self.on_completion(d, *c));
                d.scratch.completions = batch;
                result?;
                progressed |= n > 0;
                if n < POLL_BATCH {
                    break;
                }
            }
        }
        // A local rank that finished reading this rank's buffers since the last
        // pass moves the window.
        self.advance_vacated(d);
        d.credits
            .send(&self.links, &d.departures, Due::Short, &self.machine);
        d.checks
            .send(d.operations.accepted(), &self.links, &d.departures);
        if d.operations.any_finished() {
            for seq in d.operations.oldest_open()..d.operations.accepted() {
                if !d.operations.any_finished() {
                    break;
                }
                self.try_complete(d, seq)?;
            }
        }
        while self.try_start(d)? {
            progressed = true;
        }
        for b in 0..self.buffers {
            progressed |= self.advance(d, b)?;
        }
        if !progressed {
            // This rank waits: withheld credits cost nothing now.
            d.credits
                .send(&self.links, &d.departures, Due::Any, &self.machine);
        }
        Ok(progressed)
    }

    /// Accepts the next submission, as its caller planned it: records it,
    /// describes it to the local ranks and sends its descriptor to the
    /// remote ones. Recorded first, so that an operation that cannot run
    /// fails with the rest.
    pub(super) fn accept(&self, d: &mut Driver<M>, accepted: Accepted<M>) -> Result<(), Fault> {
        let (seq, words) = (accepted.sub.seq, accepted.sub.descriptor.words());
        let window = self.open_window(&accepted.sub);
        if let Err((error, refused)) = d.operations.accept(accepted) {
            // Not recorded: it fails with the rest all the same, once its
            // device program has ended.
            self.settle_refused(d, &refused);
            return Err(error.into());
        }
        if let Some((peer, after)) = d.departures.before(seq) {
            return Err(Error::peer(
                peer,
                format!("left the job after {after} operations; operation {seq} cannot run"),
            )
            .into());
        }
        d.checks
            .accepted(seq, words, window, &self.machine, &self.links)?;
        d.credits
            .send(&self.links, &d.departures, Due::Any, &self.machine);
        d.checks
            .send(d.operations.accepted(), &self.links, &d.departures);
        Ok(())
    }

    /// Opens operation `sub`'s tensor as a window for its peer's writes where
    /// it may land there (`direct::opens_window`): its registration, kept or
    /// new, opened if no other operation in flight holds it open. Returns what
    /// goes beside the descriptor: the window, one of no bytes where it could
    /// not open one (the peer then writes into staging), or `None` where the
    /// operation lands in staging anyway.
    fn open_window(&self, sub: &Submission<M>) -> Option<RemoteRegion> {
        let fabric = &self.links.fabric;
        let algorithm = sub.algorithm();
        if !fabric.registers_windows()
            || !direct::opens_window(
                &self.context_for(algorithm),
                sub,
                algorithm,
                self.direct_from,
            )
        {
            return None;
        }
        let none = RemoteRegion {
            key: 0,
            address: 0,
            len: 0,
        };
        // An all-reduce that staged its tensor would copy its slots back over
        // the results landed in it: its window needs its send registration,
        // which its slices then find taken (`sends_from_tensor`).
        if algorithm != Resolved::Relay && !self.sends_from_tensor(sub, algorithm) {
            return Some(none);
        }
        let Some((ptr, len)) = self.memory.host_bytes(&sub.tensor) else {
            return Some(none);
        };
        let seq = sub.seq;
        let mut windows = self.lock_windows();
        if !windows.take(seq, (ptr.as_ptr() as usize, len), || {
            direct::register_window(fabric, ptr, len, seq)
        }) {
            return Some(none);
        }
        let window = windows.get(seq)?;
        if windows.holders(seq) == 1 {
            // The engine neither reads nor writes a range of the tensor a peer
            // may be writing: a received broadcast's tensor where its chunks
            // land, an all-reduce's cell between the last read of its
            // contribution (which the peer has all of before it sends the
            // result) and the result's landing (`direct` module docs); and it
            // closes the window before it completes or fails the operation
            // (`try_complete`, `fail_locked`).
            // SAFETY: so, with the caller leaving the pending operation's
            // tensor valid and alone until then, `open_window`'s contract holds.
            let opened = unsafe { fabric.open_window(window) };
            if let Err(e) = opened {
                log::debug!(
                    "fairring: operation #{seq} lands in staging: opening its window failed: {e}"
                );
                windows.release(seq);
                return Some(none);
            }
        }
        Some(window.remote())
    }

    /// The geometry operations of `algorithm` plan with: the job's, or for
    /// those that move a slice whole, slices that fit their receive slots;
    /// for the machines' own plan beside dedicated servers, the job's
    /// without them; for small tensors on the flat plan, its groups (the
    /// job's second geometry either way).
    pub(super) fn geometry_of(&self, algorithm: Resolved) -> Result<&Geometry, Fault> {
        let unsplit = match algorithm {
            Resolved::Doubling => &self.doubling_geometry,
            Resolved::Scatter => &self.scatter_geometry,
            Resolved::Nccl => &self.nccl_geometry,
            Resolved::Colocated | Resolved::Grouped => &self.second_geometry,
            Resolved::Hierarchical | Resolved::Ring | Resolved::Relay => return Ok(&self.geometry),
        };
        Ok(unsplit.as_ref().ok_or_else(|| {
            let holds = if algorithm.on_second_geometry() {
                "an algorithm of the job's second geometry is chosen only where the job has one"
            } else {
                "the layout holds a slice of at least a line for every algorithm"
            };
            Error::internal(holds, format!("{algorithm} in {:?}", self.layout))
        })?)
    }

    /// Completes operation `seq` if it is finished and checked (and its share is
    /// delivered, for a reduce-scatter).
    pub(super) fn try_complete(&self, d: &mut Driver<M>, seq: u64) -> Result<(), Fault> {
        let Some(rec) = d.operations.get(seq) else {
            return Ok(());
        };
        if !rec.finished() || !d.checks.checked(seq, &self.links) {
            return Ok(());
        }
        let on_device = rec.device.is_some();
        let delivery = rec
            .sub
            .deliver
            .as_ref()
            .map(|dl| (rec.sub.tensor, dl.range.clone(), dl.to));
        if let Some((from, range, to)) = delivery {
            let fence = match d.operations.take_delivery(seq) {
                Some(fence) => fence,
                // A device tensor's delivery is its program's last stage.
                None if on_device => self.memory.raise_delivery(seq)?,
                None => self.memory.deliver(&from, range, &to)?,
            };
            if !self.memory.poll(&fence)? {
                d.operations.hold_delivery(seq, fence);
                return Ok(());
            }
        }
        d.operations.complete(seq);
        // Every write of the operation has completed (its slices released their
        // buffers only then): the fabric reads the tensor no more. Every chunk
        // written into its window has landed: closing it waits for nothing.
        self.lock_source_regions().release(seq);
        let mut windows = self.lock_windows();
        if windows.holders(seq) == 1
            && let Some(window) = windows.get(seq)
        {
            self.links.fabric.close_window(window);
        }
        windows.release(seq);
        drop(windows);
        self.complete(seq, DONE);
        self.machine.doorbell().ring();
        Ok(())
    }
}
