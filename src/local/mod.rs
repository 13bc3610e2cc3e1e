//! The intra-machine step: the ranks of one machine reduce-scatter and all-gather a
//! slice among themselves.
//!
//! [`LocalGroup`] is what the engine needs from a machine; [`ShmGroup`] implements it
//! for processes sharing host memory, and the GPU layer implements it with NCCL.
//! Every call is non-blocking: a `try_` call that cannot proceed yet returns
//! `false`, and the engine retries it when a doorbell rings, so one progress thread
//! can drive many slices at once and never waits inside a step.
//!
//! # The shared-memory protocol
//!
//! Every local rank owns `B` staging buffers in one shared segment and three
//! monotone counters per buffer (slice number + 1):
//!
//! 1. **stage in**: rank `e` copies the slots *other* ranks reduce from its tensor
//!    into its buffer (its own slot it reads straight from the tensor), then
//!    publishes `InputReady` (release);
//! 2. **reduce-scatter**: once every rank's `InputReady` covers the slice (acquire),
//!    rank `d` combines slot `d` of its tensor with slot `d` of every other rank's
//!    buffer into slot `d` of its own buffer: a reduction that reads `D` inputs and
//!    writes one, split over `D` processes, so every core's memory bandwidth is
//!    used. It works in cache-sized chunks, so the chunk it writes is still in
//!    cache when it is copied a second time. In a single-machine job the result is
//!    final: it goes into the tensor too;
//! 3. the slot then goes through the inter-machine step (results land in slot `d`
//!    of rank `d`'s buffer), and rank `d` publishes `SlotFinal`;
//! 4. **all-gather**: once every `SlotFinal` covers the slice, each rank copies the
//!    final slots it does not hold yet into its tensor, then publishes `Done`;
//! 5. a buffer takes slice `s` only when every rank's `Done` covers slice `s - B`:
//!    nobody still reads what it is about to overwrite.
//!
//! Per rank and slice of `S` bytes that is `S (D-1)/D` bytes copied in, one
//! reduction over `S/D` bytes, and `S (D-1)/D` (single machine) or `S` bytes copied
//! out: the fewest copies a tensor in private memory allows.
//!
//! Each rank writes only its own buffer, and only while no other rank reads the
//! bytes it writes; the counters' release/acquire pairs order the data.
//!
//! # Waiting
//!
//! Publishing rings every other local rank's doorbell (a futex in the segment), so
//! a progress thread with nothing to do sleeps instead of spinning: oversubscribed
//! runs (more ranks than cores) do not starve.

mod doorbell;
pub(crate) mod segment;

use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};
use std::time::Duration;

use fairring_core::plan::Slice;
use fairring_core::reduce::{finish_avg_bytes, reduce_many_bytes};
use fairring_core::{DataType, ReduceOp};

pub use doorbell::Doorbell;
use segment::{Counter, Segment};

use crate::error::{Error, Result};

/// Most sources one reduction call takes; more are folded in batches.
const MAX_SOURCES: usize = 16;

/// Bytes the reduce-scatter handles at a time: small enough that a chunk it has
/// just written is still in L2 cache when it copies it a second time.
const CHUNK_BYTES: usize = 64 * 1024;

/// The intra-machine step as the engine drives it.
pub trait LocalGroup: Send + Sync {
    /// This rank's index on its machine.
    fn local_rank(&self) -> u32;

    /// Ranks on this machine.
    fn local_size(&self) -> u32;

    /// Whether staging buffer `buffer` may take slice `slice`: every local rank is
    /// done with the slice it held before.
    fn buffer_free(&self, buffer: u32, slice: u64) -> bool;

    /// Stages what the other local ranks need of the slice for the reduce-scatter
    /// (`tensor` holds the slice's bytes in the caller's tensor) and announces it.
    fn stage_in(&self, buffer: u32, number: u64, slice: &Slice, tensor: &[u8]) -> Result<()>;

    /// Reduces this rank's slot of the slice across the machine, once every local
    /// rank has staged it; returns whether it did. The result goes into this
    /// rank's staging slot. `final_world` is `Some(world size)` when that result is
    /// final (a single-machine job): it then goes into the slot of `tensor` too,
    /// already divided by the world size for [`ReduceOp::Avg`].
    #[expect(clippy::too_many_arguments, reason = "one step's complete inputs")]
    fn try_reduce_scatter(
        &self,
        buffer: u32,
        number: u64,
        slice: &Slice,
        dtype: DataType,
        op: ReduceOp,
        tensor: &mut [u8],
        final_world: Option<u32>,
    ) -> Result<bool>;

    /// Announces that this rank's slot of the slice is final.
    fn publish_slot(&self, buffer: u32, slice: u64);

    /// Copies the final slots into `tensor`, once every local rank's slot is final
    /// (this rank's own slot too, unless the reduce-scatter wrote it there
    /// already: `own_in_tensor`); returns whether it did. Announces that this rank
    /// is done with the buffer.
    fn try_all_gather(
        &self,
        buffer: u32,
        number: u64,
        slice: &Slice,
        tensor: &mut [u8],
        own_in_tensor: bool,
    ) -> bool;

    /// Announces, without an all-gather, that this rank is done with the buffer
    /// for the slice (algorithms that do not use the local step).
    fn finish(&self, buffer: u32, slice: u64);

    /// This rank's staging buffer `buffer`.
    fn staging(&self, buffer: u32) -> NonNull<u8>;

    /// Bytes in one staging buffer.
    fn buffer_bytes(&self) -> usize;

    /// This rank's doorbell: rung whenever another local rank publishes progress.
    fn doorbell(&self) -> &Doorbell;

    /// A handle that rings this rank's doorbell from any thread, and keeps it
    /// alive as long as the handle lives (for a fabric's completion notifier).
    fn waker(&self) -> Arc<dyn Fn() + Send + Sync>;

    /// Publishes this rank's descriptor words of operation `seq` to the local
    /// ranks (see the engine's `descriptor` module).
    fn publish_operation(&self, seq: u64, words: [u64; 2]);

    /// Local rank `rank`'s descriptor words of operation `seq`, once published.
    fn operation(&self, rank: u32, seq: u64) -> Option<[u64; 2]>;

    /// Records the machine's failure (the first one wins) and wakes every local
    /// rank; `record` says why, in the engine's failure encoding.
    fn fail(&self, record: [u64; 8]);

    /// The local rank that failed first on this machine and its record, if one
    /// has.
    fn failure(&self) -> Option<(u32, [u64; 8])>;

    /// The local ranks that have not yet done their part of slice `number` in
    /// buffer `buffer`, at the first step some rank has not finished: what a
    /// stalled slice waits for.
    fn laggards(&self, buffer: u32, number: u64) -> Vec<u32>;
}

/// The local group of processes that share host memory.
pub struct ShmGroup {
    segment: Arc<Segment>,
    rank: u32,
    size: u32,
    buffers: u32,
}

impl ShmGroup {
    /// Attaches to the machine's segment `name` (local rank 0 creates it).
    pub(crate) fn attach(
        name: &str,
        rank: u32,
        size: u32,
        buffers: u32,
        buffer_bytes: usize,
        timeout: Duration,
    ) -> Result<ShmGroup> {
        let segment = Arc::new(Segment::attach(
            name,
            rank == 0,
            size,
            buffers,
            buffer_bytes,
            timeout,
        )?);
        Ok(ShmGroup {
            segment,
            rank,
            size,
            buffers,
        })
    }

    /// Local rank `rank` of `size` on `segment`, shared with the other local ranks
    /// (the engine's simulation).
    #[cfg(test)]
    pub(crate) fn on_segment(
        segment: Arc<Segment>,
        rank: u32,
        size: u32,
        buffers: u32,
    ) -> ShmGroup {
        ShmGroup {
            segment,
            rank,
            size,
            buffers,
        }
    }

    /// Removes the segment's name (local rank 0, once every local rank attached).
    pub(crate) fn unlink(&self) {
        self.segment.unlink();
    }

    /// This rank's buffers as one range, for registration with the fabric.
    pub(crate) fn own_area(&self) -> (NonNull<u8>, usize) {
        self.segment.rank_area(self.rank)
    }

    fn publish(&self, buffer: u32, slice: u64, which: Counter) {
        self.segment
            .counter(self.rank, buffer, which)
            .store(slice + 1, Ordering::Release);
        for r in (0..self.size).filter(|&r| r != self.rank) {
            self.segment.doorbell(r).ring();
        }
    }

    fn all_reached(&self, buffer: u32, value: u64, which: Counter) -> bool {
        (0..self.size).all(|r| {
            self.segment
                .counter(r, buffer, which)
                .load(Ordering::Acquire)
                >= value
        })
    }

    fn bytes(&self, rank: u32, buffer: u32, range: std::ops::Range<usize>) -> &[u8] {
        assert!(
            range.end <= self.segment.buffer_bytes(),
            "range outside the buffer"
        );
        // SAFETY: in bounds of the buffer (asserted); by the protocol above no rank
        // writes these bytes while the caller reads them (the caller has seen, with
        // acquire, the counter that the owner published after its last write).
        let start = self
            .segment
            .buffer(rank, buffer)
            .as_ptr()
            .wrapping_add(range.start);
        // SAFETY: (see above.)
        unsafe { std::slice::from_raw_parts(start, range.len()) }
    }

    #[expect(clippy::mut_from_ref, reason = "exclusive by the protocol, see SAFETY")]
    fn own_bytes_mut(&self, buffer: u32, range: std::ops::Range<usize>) -> &mut [u8] {
        assert!(
            range.end <= self.segment.buffer_bytes(),
            "range outside the buffer"
        );
        // SAFETY: in bounds (asserted). This rank's own buffer: by the protocol no
        // other rank reads or writes these bytes until this rank publishes the
        // counter that follows this write, and the engine's single driver holds no
        // other reference to them.
        let start = self
            .segment
            .buffer(self.rank, buffer)
            .as_ptr()
            .wrapping_add(range.start);
        // SAFETY: (see above.)
        unsafe { std::slice::from_raw_parts_mut(start, range.len()) }
    }
}

/// The byte range of `slice`'s slot `device`, from the start of the slice.
pub(crate) fn slot_range(slice: &Slice, device: u32) -> Result<std::ops::Range<usize>> {
    let slot = slice
        .slot(device)
        .map_err(|e| Error::invalid("device", e.to_string()))?;
    let base = slice.span().byte_offset();
    let start = usize::try_from(slot.byte_offset() - base).unwrap_or(usize::MAX);
    let end = usize::try_from(slot.byte_end() - base).unwrap_or(usize::MAX);
    Ok(start..end)
}

/// `dst op= srcs[0] op srcs[1] ...`, in batches of [`MAX_SOURCES`], allocation-free.
pub(crate) fn reduce_into<'a>(
    dtype: DataType,
    op: ReduceOp,
    dst: &mut [u8],
    srcs: &mut impl Iterator<Item = &'a [u8]>,
) -> Result<()> {
    let mut batch: [&[u8]; MAX_SOURCES] = [&[]; MAX_SOURCES];
    loop {
        let mut n = 0;
        for s in srcs.by_ref().take(MAX_SOURCES) {
            batch[n] = s;
            n += 1;
        }
        if n == 0 {
            return Ok(());
        }
        reduce_many_bytes(dtype, op, dst, &batch[..n])
            .map_err(|e| Error::invalid("reduction", e.to_string()))?;
    }
}

impl LocalGroup for ShmGroup {
    fn local_rank(&self) -> u32 {
        self.rank
    }

    fn local_size(&self) -> u32 {
        self.size
    }

    fn buffer_free(&self, buffer: u32, slice: u64) -> bool {
        let b = u64::from(self.buffers);
        slice < b || self.all_reached(buffer, slice - b + 1, Counter::Done)
    }

    fn stage_in(&self, buffer: u32, number: u64, slice: &Slice, tensor: &[u8]) -> Result<()> {
        for r in (0..self.size).filter(|&r| r != self.rank) {
            let range = slot_range(slice, r)?;
            let src = tensor
                .get(range.clone())
                .ok_or_else(|| Error::invalid("tensor", "shorter than its slice"))?;
            self.own_bytes_mut(buffer, range).copy_from_slice(src);
        }
        self.publish(buffer, number, Counter::InputReady);
        Ok(())
    }

    fn try_reduce_scatter(
        &self,
        buffer: u32,
        number: u64,
        slice: &Slice,
        dtype: DataType,
        op: ReduceOp,
        tensor: &mut [u8],
        final_world: Option<u32>,
    ) -> Result<bool> {
        if !self.all_reached(buffer, number + 1, Counter::InputReady) {
            return Ok(false);
        }
        let range = slot_range(slice, self.rank)?;
        let own = tensor
            .get_mut(range.clone())
            .ok_or_else(|| Error::invalid("tensor", "shorter than its slice"))?;
        let staged = self.own_bytes_mut(buffer, range.clone());
        let elem = usize::try_from(dtype.size_bytes()).unwrap_or(1);
        let step = CHUNK_BYTES - CHUNK_BYTES % elem;
        let mut at = 0;
        for (own, staged) in own.chunks_mut(step).zip(staged.chunks_mut(step)) {
            let chunk = range.start + at..range.start + at + own.len();
            at += own.len();
            let mut peers = (0..self.size)
                .filter(|&r| r != self.rank)
                .map(|r| self.bytes(r, buffer, chunk.clone()));
            match final_world {
                Some(world) => {
                    // Final: reduce in the tensor, then publish a copy (from cache).
                    reduce_into(dtype, op, own, &mut peers)?;
                    if op == ReduceOp::Avg {
                        finish_avg_bytes(dtype, own, world)
                            .map_err(|e| Error::invalid("reduction", e.to_string()))?;
                    }
                    if self.size > 1 {
                        staged.copy_from_slice(own);
                    }
                }
                None => {
                    staged.copy_from_slice(own);
                    reduce_into(dtype, op, staged, &mut peers)?;
                }
            }
        }
        Ok(true)
    }

    fn publish_slot(&self, buffer: u32, slice: u64) {
        self.publish(buffer, slice, Counter::SlotFinal);
    }

    fn try_all_gather(
        &self,
        buffer: u32,
        number: u64,
        slice: &Slice,
        tensor: &mut [u8],
        own_in_tensor: bool,
    ) -> bool {
        if !self.all_reached(buffer, number + 1, Counter::SlotFinal) {
            return false;
        }
        for r in (0..self.size).filter(|&r| !(own_in_tensor && r == self.rank)) {
            // Slots of a valid slice never fail to resolve; skip defensively.
            let Ok(range) = slot_range(slice, r) else {
                continue;
            };
            if let Some(out) = tensor.get_mut(range.clone()) {
                out.copy_from_slice(self.bytes(r, buffer, range));
            }
        }
        self.publish(buffer, number, Counter::Done);
        true
    }

    fn finish(&self, buffer: u32, slice: u64) {
        self.publish(buffer, slice, Counter::Done);
    }

    fn staging(&self, buffer: u32) -> NonNull<u8> {
        self.segment.buffer(self.rank, buffer)
    }

    fn buffer_bytes(&self) -> usize {
        self.segment.buffer_bytes()
    }

    fn doorbell(&self) -> &Doorbell {
        self.segment.doorbell(self.rank)
    }

    fn waker(&self) -> Arc<dyn Fn() + Send + Sync> {
        let segment = Arc::clone(&self.segment);
        let rank = self.rank;
        Arc::new(move || segment.doorbell(rank).ring())
    }

    fn publish_operation(&self, seq: u64, words: [u64; 2]) {
        let entry = self.segment.operation(self.rank, operation_index(seq));
        // A seqlock: readers check the sequence before and after the words.
        entry[0].store(0, Ordering::Relaxed);
        fence(Ordering::Release);
        entry[1].store(words[0], Ordering::Relaxed);
        entry[2].store(words[1], Ordering::Relaxed);
        entry[0].store(seq + 1, Ordering::Release);
        for r in (0..self.size).filter(|&r| r != self.rank) {
            self.segment.doorbell(r).ring();
        }
    }

    fn operation(&self, rank: u32, seq: u64) -> Option<[u64; 2]> {
        let entry = self.segment.operation(rank, operation_index(seq));
        if entry[0].load(Ordering::Acquire) != seq + 1 {
            return None;
        }
        let words = [
            entry[1].load(Ordering::Relaxed),
            entry[2].load(Ordering::Relaxed),
        ];
        fence(Ordering::Acquire);
        (entry[0].load(Ordering::Relaxed) == seq + 1).then_some(words)
    }

    fn fail(&self, record: [u64; 8]) {
        if self.segment.claim_failure(self.rank) {
            self.segment.publish_failure(record);
        }
        for r in (0..self.size).filter(|&r| r != self.rank) {
            self.segment.doorbell(r).ring();
        }
    }

    fn failure(&self) -> Option<(u32, [u64; 8])> {
        self.segment.failure()
    }

    fn laggards(&self, buffer: u32, number: u64) -> Vec<u32> {
        for which in [Counter::InputReady, Counter::SlotFinal, Counter::Done] {
            let behind: Vec<u32> = (0..self.size)
                .filter(|&r| {
                    self.segment
                        .counter(r, buffer, which)
                        .load(Ordering::Acquire)
                        <= number
                })
                .collect();
            if !behind.is_empty() {
                return behind;
            }
        }
        Vec::new()
    }
}

/// The operation-table entry of operation `seq`.
fn operation_index(seq: u64) -> usize {
    #[expect(clippy::cast_possible_truncation, reason = "below OPERATIONS")]
    let i = (seq % segment::OPERATIONS as u64) as usize;
    i
}
