//! The intra-machine step of processes that share host memory.
//!
//! Every local rank stages a slice in its own buffers of the machine's segment, in
//! the input area that holds the whole slice (`InputArea::Slice`), under the
//! counter [`protocol`](super::protocol):
//!
//! 1. **stage in**: rank `e` copies the slots *other* ranks reduce from its tensor
//!    into its buffer (its own slot it reads straight from the tensor), then
//!    publishes `InputReady`;
//! 2. **reduce-scatter**: once every rank's input is ready, rank `d` combines slot
//!    `d` of its tensor with slot `d` of every other rank's buffer into slot `d` of
//!    its own buffer: a reduction that reads `D` inputs and writes one, split over
//!    `D` processes, so every core's memory bandwidth is used. It works in
//!    cache-sized chunks, so the chunk it writes is still in cache when it is
//!    copied a second time. In a single-machine job the result is final: it goes
//!    into the tensor too;
//! 3. the slot then goes through the inter-machine step (results land in slot `d`
//!    of rank `d`'s buffer), and rank `d` publishes `SlotFinal`;
//! 4. **all-gather**: once every slot is final, each rank copies the final slots it
//!    does not hold yet into its tensor, then publishes `Done`;
//! 5. a buffer takes slice `s` only when every rank is done with slice `s - B`.
//!
//! Per rank and slice of `S` bytes that is `S (D-1)/D` bytes copied in, one
//! reduction over `S/D` bytes, and `S (D-1)/D` (single machine) or `S` bytes copied
//! out: the fewest copies a tensor in private memory allows.
//!
//! A reduce-scatter's slice ([`RailPieces`](super::RailPieces)) runs steps 1 and 2
//! over its pieces instead of the slice's slots: slot `d` is the pieces of
//! device `d` on every machine, read from their ranks' shares of the tensor. No
//! all-gather follows; on one machine the reduction goes into the rank's own
//! share only.
//!
//! A small slice in a job of one machine is **reduced whole** on every rank
//! instead: at step 1 each rank stages the whole slice, at step 2 each
//! reduces every slot from every rank's buffer into its tensor (slot `d` in
//! the order rank `d` would take it, so every rank holds the same bits), and
//! announces at once that its slot is final and that it is done: one wait per
//! slice instead of two, for `(D-1) S` bytes read instead of `2 S (D-1)/D`
//! ([`REDUCE_WHOLE_UP_TO`]).
//!
//! A broadcast in a job of one machine, where the ranks may copy between each
//! other's memory ([`PeerCopy`]), skips the staging: at step 1 every rank
//! publishes where the slice lies in its tensor; at step 2 every other rank
//! reads the slice from the root's tensor into its own; steps 3 and 4 copy
//! nothing, and every rank is done once every other has read.
//!
//! Publishing rings every other local rank's doorbell (a futex in the segment), so
//! a progress thread with nothing to do sleeps instead of spinning: oversubscribed
//! runs (more ranks than cores) do not starve.

use std::ops::Range;
use std::sync::Arc;

use fairring_core::ReduceOp;
use fairring_core::plan::Slice;
use fairring_core::reduce::finish_avg_bytes;

use super::protocol::{Counter, Counters, Protocol};
use super::tensor_copies::{self, CopyWords, MAX_READERS};
use super::{LocalSlice, LocalStep, PeerCopy};
use crate::error::{Error, Result};
use crate::memory::{Host, HostTensor, reduce_into};
use crate::shm::Segment;
use crate::sync::unmodelled::Ordering;

/// Bytes the reduce-scatter handles at a time: small enough that a chunk it has
/// just written is still in L2 cache when it copies it a second time.
const CHUNK_BYTES: usize = 64 * 1024;

/// Bytes of the address every rank publishes in its buffer, where a
/// broadcast copied between tensors puts or finds the slice.
const ADDRESS_BYTES: usize = 8;

/// The smallest broadcast slice copied between tensors: below it a system
/// call costs more than the staged copies through the segment (1x2
/// ping-pong on 2 cores: 16 KiB 3.3 against 3.4 GB/s staged, 64 KiB 7.0
/// against 6.6).
pub(crate) const COPY_BETWEEN_TENSORS_FROM: usize = 64 << 10;

/// The most bytes a rank of a job of one machine reads from the others'
/// buffers for a slice it reduces whole: `(D-1)` times the slice. 1x2 on 2
/// cores, f32 sum, whole against in parts, three runs each: 4 KiB 2.9-3.1
/// against 3.3-3.5 us, 8 KiB 3.9-4.1 against 3.8-3.9, 16 KiB 5.8-6.6
/// against 5.3-5.4; 1x3 (more ranks than cores), where each wait can cost a
/// wake-up: 1 KiB 11.3-11.7 against 19.3-31.9 us, 4 KiB 13.2-13.5 against
/// 21.2-25.2. The bound counts bytes read, so that 1x3 slices of 4 KiB fall
/// under it; 1x2 slices of 8 KiB, a tie, do too.
pub(crate) const REDUCE_WHOLE_UP_TO: usize = 8 << 10;

/// The local step of processes that share host memory.
pub(crate) struct ShmStep {
    pub(crate) segment: Arc<Segment>,
    pub(crate) protocol: Protocol,
    pub(crate) size: u32,
    /// Where every local rank may read every other's memory: a broadcast
    /// goes from its root's tensor into the others', unstaged.
    pub(crate) peer_copy: Option<Arc<PeerCopy>>,
    /// The smallest broadcast slice copied between tensors.
    pub(crate) copy_from: usize,
    /// The most bytes a rank reads from the others' buffers for a slice it
    /// reduces whole (`(D-1)` times the slice); 0 where slices are never
    /// reduced whole (a job of several machines, or with servers).
    pub(crate) whole_up_to: usize,
}

impl ShmStep {
    /// Local rank `rank` of `size` on `segment` (whose `buffers` staging buffers
    /// per rank hold whole slices).
    pub(crate) fn new(segment: Arc<Segment>, rank: u32, size: u32, buffers: u32) -> ShmStep {
        ShmStep {
            segment,
            protocol: Protocol { rank, buffers },
            size,
            peer_copy: None,
            copy_from: COPY_BETWEEN_TENSORS_FROM,
            whole_up_to: 0,
        }
    }

    /// The step, its small slices reduced whole on every rank: those of
    /// which a rank reads at most `up_to` bytes from the others' buffers
    /// (`(D-1)` times the slice). Only for a job of one machine without
    /// servers, whose reduce-scatter is final ([`REDUCE_WHOLE_UP_TO`] in a
    /// communicator).
    pub(crate) fn reducing_whole(self, up_to: usize) -> ShmStep {
        ShmStep {
            whole_up_to: up_to,
            ..self
        }
    }

    /// Whether every rank reduces slice `s` whole: a small all-reduce slice
    /// (not a reduce-scatter's pieces, not a broadcast copied between
    /// tensors). Every local rank answers alike.
    fn reduces_whole(&self, s: &LocalSlice<'_, Host>) -> bool {
        let others = self.size.saturating_sub(1) as usize;
        others > 0
            && s.pieces.is_none()
            && self.copy_root(s).is_none()
            && slice_range(s.slice)
                .is_ok_and(|r| r.len().saturating_mul(others) <= self.whole_up_to)
    }

    /// Reduces the whole slice `s` into the tensor, once every rank has
    /// staged all of it: slot by slot, each in the order its owner's
    /// reduce-scatter takes (the owner's input, then the others' by rank), so
    /// that every rank holds the same bits whatever the operator, and the
    /// same as a slice reduced in parts.
    fn reduce_whole(&self, s: &LocalSlice<'_, Host>, world: u32) -> Result<()> {
        let me = self.rank();
        for owner in 0..self.size {
            let slot = slot_range(s.slice, owner)?;
            if slot.is_empty() {
                continue;
            }
            // SAFETY: as in `begin`.
            let out = unsafe { tensor_bytes(s.tensor, s.slice, slot.clone())? };
            if owner != me {
                // This rank's own input of the slot stays in its buffer.
                out.copy_from_slice(self.peer_bytes(owner, s.buffer, slot.clone())?);
            }
            let mut rest = (0..self.size)
                .filter(|&r| r != owner)
                .map(|r| self.peer_bytes(r, s.buffer, slot.clone()));
            reduce_into(s.dtype, s.op, out, &mut rest)?;
        }
        if s.op == ReduceOp::Avg {
            let whole = 0..slice_range(s.slice)?.len();
            // SAFETY: as in `begin`.
            let out = unsafe { tensor_bytes(s.tensor, s.slice, whole)? };
            finish_avg_bytes(s.dtype, out, world)
                .map_err(|e| Error::internal("averages divide a whole sum", e.to_string()))?;
        }
        Ok(())
    }

    /// The step, its broadcast slices of `from_bytes` or more copied between
    /// tensors where `peer_copy` is given ([`COPY_BETWEEN_TENSORS_FROM`] in
    /// a communicator).
    pub(crate) fn copying_between_tensors(
        self,
        peer_copy: Option<Arc<PeerCopy>>,
        from_bytes: usize,
    ) -> ShmStep {
        // One bit per local rank in a tensor-copy word.
        let peer_copy = peer_copy.filter(|_| self.size <= MAX_READERS);
        ShmStep {
            peer_copy,
            copy_from: from_bytes,
            ..self
        }
    }

    /// Runs `read`, this rank's read of local rank `owner`'s tensor, unless
    /// `owner` failed and closed its tensors to reads before it was over (see
    /// [`tensor_copies`](super::tensor_copies)): an error naming it then.
    fn read_with<T>(
        &self,
        owner: u32,
        peers: &PeerCopy,
        read: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        tensor_copies::read_with(&*self.segment, self.rank(), owner, read).unwrap_or_else(|| {
            Err(Error::peer(
                peers.rank_of(owner),
                "failed, and no longer lets its machine's ranks copy its tensors",
            ))
        })
    }

    /// A broadcast's root, where this step copies the slice between tensors:
    /// it may, and the slice is large enough.
    fn copy_root(&self, s: &LocalSlice<'_, Host>) -> Option<(u32, &PeerCopy)> {
        let large = slice_range(s.slice).is_ok_and(|r| r.len() >= self.copy_from);
        Some((s.root.filter(|_| large)?, self.peer_copy.as_ref()?))
    }

    /// This rank's part of broadcast slice `s` from local rank `root`, once
    /// every rank has published where the slice lies in its tensor: every
    /// rank but the root reads the slice from the root's tensor into its own.
    /// The root's tensor stays as it is until every rank has read (a rank
    /// completes the slice only once every other has published its slot).
    fn copy_broadcast(&self, s: &LocalSlice<'_, Host>, root: u32, peers: &PeerCopy) -> Result<()> {
        if root == self.rank() {
            return Ok(());
        }
        let len = slice_range(s.slice)?.len();
        let mut word = [0u8; ADDRESS_BYTES];
        word.copy_from_slice(self.peer_bytes(root, s.buffer, 0..ADDRESS_BYTES)?);
        let from = u64::from_ne_bytes(word);
        // SAFETY: as in `begin`.
        let out = unsafe { tensor_bytes(s.tensor, s.slice, 0..len)? };
        // The root's tensor stays as it is until this rank publishes its
        // slot, after the read; if the root fails first, the read is thrown
        // away (`read_with`).
        self.read_with(root, peers, || peers.read(root, from, out))
    }

    pub(super) fn rank(&self) -> u32 {
        self.protocol.rank
    }

    /// Bytes `range` of local rank `rank`'s buffer `buffer`.
    ///
    /// By the protocol no rank writes these bytes while the caller reads them (the
    /// caller has seen, with acquire, the counter that the owner published after
    /// its last write).
    pub(super) fn peer_bytes(&self, rank: u32, buffer: u32, range: Range<usize>) -> Result<&[u8]> {
        self.check(range.clone())?;
        let start = self.segment.buffer(rank, buffer).as_ptr();
        // SAFETY: in bounds (checked); no concurrent writer (above).
        Ok(unsafe { std::slice::from_raw_parts(start.wrapping_add(range.start), range.len()) })
    }

    /// Bytes `range` of this rank's buffer `buffer`.
    ///
    /// This rank's own buffer: by the protocol no other rank reads or writes these
    /// bytes until this rank publishes the counter that follows this write, and the
    /// engine's single driver holds no other reference to them.
    #[expect(clippy::mut_from_ref, reason = "exclusive by the protocol, see above")]
    pub(super) fn own_bytes(&self, buffer: u32, range: Range<usize>) -> Result<&mut [u8]> {
        self.check(range.clone())?;
        let start = self.segment.buffer(self.rank(), buffer).as_ptr();
        // SAFETY: in bounds (checked); exclusive (above).
        Ok(unsafe { std::slice::from_raw_parts_mut(start.wrapping_add(range.start), range.len()) })
    }

    fn check(&self, range: Range<usize>) -> Result<()> {
        if range.start > range.end || range.end > self.segment.buffer_bytes() {
            return Err(Error::internal(
                "slots lie within the staging buffer",
                format!("{range:?} of {} bytes", self.segment.buffer_bytes()),
            ));
        }
        Ok(())
    }
}

/// The byte range of `slice`'s slot `device`, from the start of the slice (which is
/// where the staging buffer's input area holds it).
pub(super) fn slot_range(slice: &Slice, device: u32) -> Result<Range<usize>> {
    let slot = slice
        .slot(device)
        .map_err(|e| Error::internal("every local device has a slot", e.to_string()))?;
    slot.byte_range_in(slice.span())
        .ok_or_else(|| Error::internal("a slot lies within its slice", format!("{slot:?}")))
}

/// Calls `each(in_tensor, staged)` for the bytes of slot `device` of `s`, each
/// run as it lies in the tensor (from the slice's start) and in the staging
/// buffer: the slot itself, at the same place in both, or a reduce-scatter's
/// pieces of that device ([`RailPieces`](super::RailPieces)).
pub(super) fn for_each_run<M: crate::memory::MemorySpace>(
    s: &LocalSlice<'_, M>,
    device: u32,
    mut each: impl FnMut(Range<usize>, Range<usize>) -> Result<()>,
) -> Result<()> {
    match s.pieces {
        Some(pieces) => pieces.for_each_in_slot(device, each),
        None => {
            let slot = slot_range(s.slice, device)?;
            each(slot.clone(), slot)
        }
    }
}

/// The byte range of `slice` in its tensor.
pub(crate) fn slice_range(slice: &Slice) -> Result<Range<usize>> {
    slice.span().byte_range().ok_or_else(|| {
        Error::internal(
            "a slice's bytes fit the address space",
            format!("{:?}", slice.span()),
        )
    })
}

/// Bytes `within` (relative to the slice) of the slice in `tensor`.
///
/// # Safety
///
/// As for [`HostTensor::bytes`].
#[expect(clippy::mut_from_ref, reason = "exclusive by the submission contract")]
unsafe fn tensor_bytes<'t>(
    tensor: &'t HostTensor,
    slice: &Slice,
    within: Range<usize>,
) -> Result<&'t mut [u8]> {
    let base = slice_range(slice)?.start;
    // SAFETY: forwarded.
    unsafe { tensor.bytes(base + within.start..base + within.end) }
}

/// The segment's counters, in the protocol's order (`Counter as usize`).
impl Counters for Segment {
    fn ranks(&self) -> u32 {
        Segment::ranks(self)
    }

    fn store(&self, rank: u32, buffer: u32, which: Counter, value: u64, order: Ordering) {
        self.counter(rank, buffer, which as usize)
            .store(value, order);
    }

    fn load(&self, rank: u32, buffer: u32, which: Counter, order: Ordering) -> u64 {
        self.counter(rank, buffer, which as usize).load(order)
    }

    fn wake(&self, rank: u32) {
        self.doorbell(rank).ring();
    }
}

/// The segment's tensor-copy words.
impl CopyWords for Segment {
    fn fetch_or(&self, owner: u32, bits: u64, order: Ordering) -> u64 {
        self.tensor_copies(owner).fetch_or(bits, order)
    }

    fn fetch_and(&self, owner: u32, bits: u64, order: Ordering) -> u64 {
        self.tensor_copies(owner).fetch_and(bits, order)
    }
}

impl LocalStep<Host> for ShmStep {
    fn buffer_free(&self, buffer: u32, number: u64) -> bool {
        self.protocol.buffer_free(&*self.segment, buffer, number)
    }

    fn begin(&self, s: &LocalSlice<'_, Host>) -> Result<()> {
        if self.copy_root(s).is_some() {
            // A broadcast copied between tensors: every rank publishes where
            // the slice lies in its tensor, in the first word of its buffer.
            return self
                .protocol
                .stage_in(&*self.segment, s.buffer, s.number, || {
                    let whole = 0..slice_range(s.slice)?.len();
                    // SAFETY: as below.
                    let slice = unsafe { tensor_bytes(s.tensor, s.slice, whole)? };
                    let at = (slice.as_ptr() as u64).to_ne_bytes();
                    self.own_bytes(s.buffer, 0..ADDRESS_BYTES)?
                        .copy_from_slice(&at);
                    Ok(())
                });
        }
        if self.reduces_whole(s) {
            // Every rank reads every slot of every other's input, and the
            // slots of its own that other ranks own from its buffer.
            return self
                .protocol
                .stage_in(&*self.segment, s.buffer, s.number, || {
                    let whole = 0..slice_range(s.slice)?.len();
                    // SAFETY: the operation is pending; only the driver touches it.
                    let src = unsafe { tensor_bytes(s.tensor, s.slice, whole.clone())? };
                    self.own_bytes(s.buffer, whole)?.copy_from_slice(src);
                    Ok(())
                });
        }
        self.protocol
            .stage_in(&*self.segment, s.buffer, s.number, || {
                for r in (0..self.size).filter(|&r| r != self.rank()) {
                    for_each_run(s, r, |in_tensor, staged| {
                        // SAFETY: the operation is pending; only the driver touches it.
                        let src = unsafe { tensor_bytes(s.tensor, s.slice, in_tensor)? };
                        self.own_bytes(s.buffer, staged)?.copy_from_slice(src);
                        Ok(())
                    })?;
                }
                Ok(())
            })
    }

    fn try_reduce_scatter(
        &self,
        s: &LocalSlice<'_, Host>,
        final_world: Option<u32>,
    ) -> Result<Option<()>> {
        if self.reduces_whole(s) {
            let world = final_world.ok_or_else(|| {
                Error::internal(
                    "only a job of one machine reduces slices whole",
                    format!("slice {}", s.number),
                )
            })?;
            let ran = self
                .protocol
                .try_reduce_whole(&*self.segment, s.buffer, s.number, || {
                    self.reduce_whole(s, world)
                })?;
            return Ok(ran.then_some(()));
        }
        let elem = usize::try_from(s.dtype.size_bytes()).unwrap_or(1);
        let step = CHUNK_BYTES - CHUNK_BYTES % elem;
        // A final slot is copied into the buffer for the all-gather; a
        // reduce-scatter's final pieces have none.
        let publish_final = self.size > 1 && s.pieces.is_none();
        let reduce_run = |in_tensor: Range<usize>, range: Range<usize>| -> Result<()> {
            // SAFETY: as in `begin`.
            let own = unsafe { tensor_bytes(s.tensor, s.slice, in_tensor)? };
            let staged = self.own_bytes(s.buffer, range.clone())?;
            let mut at = range.start;
            for (own, staged) in own.chunks_mut(step).zip(staged.chunks_mut(step)) {
                let chunk = at..at + own.len();
                at += own.len();
                let mut peers = (0..self.size)
                    .filter(|&r| r != self.rank())
                    .map(|r| self.peer_bytes(r, s.buffer, chunk.clone()));
                match final_world {
                    Some(world) => {
                        // Final: reduce in the tensor, then publish a copy (from cache).
                        reduce_into(s.dtype, s.op, own, &mut peers)?;
                        if s.op == ReduceOp::Avg {
                            finish_avg_bytes(s.dtype, own, world).map_err(|e| {
                                Error::internal("averages divide a whole sum", e.to_string())
                            })?;
                        }
                        if publish_final {
                            staged.copy_from_slice(own);
                        }
                    }
                    None => {
                        staged.copy_from_slice(own);
                        reduce_into(s.dtype, s.op, staged, &mut peers)?;
                    }
                }
            }
            Ok(())
        };
        let ran = self
            .protocol
            .try_reduce_scatter(&*self.segment, s.buffer, s.number, || {
                match self.copy_root(s) {
                    Some((root, peers)) => self.copy_broadcast(s, root, peers),
                    None => for_each_run(s, self.rank(), reduce_run),
                }
            })?;
        Ok(ran.then_some(()))
    }

    fn publish_slot(&self, s: &LocalSlice<'_, Host>) {
        if self.reduces_whole(s) {
            // Published with the reduction.
            return;
        }
        self.protocol
            .publish_slot(&*self.segment, s.buffer, s.number);
    }

    fn try_all_gather(&self, s: &LocalSlice<'_, Host>, own_in_tensor: bool) -> Result<Option<()>> {
        if s.pieces.is_some() {
            return Err(Error::internal(
                "a reduce-scatter's pieces are never gathered",
                format!("slice {}", s.number),
            ));
        }
        if self.reduces_whole(s) {
            // Every rank reduced every slot; it announced `Done` then.
            return Ok(Some(()));
        }
        let gather = || -> Result<()> {
            if self.copy_root(s).is_some() {
                // A broadcast copied between tensors: every one holds the slice.
                return Ok(());
            }
            for r in (0..self.size).filter(|&r| !(own_in_tensor && r == self.rank())) {
                let range = slot_range(s.slice, r)?;
                // SAFETY: as in `begin`.
                let out = unsafe { tensor_bytes(s.tensor, s.slice, range.clone())? };
                out.copy_from_slice(self.peer_bytes(r, s.buffer, range)?);
            }
            Ok(())
        };
        let ran = self
            .protocol
            .try_all_gather(&*self.segment, s.buffer, s.number, gather)?;
        Ok(ran.then_some(()))
    }

    fn finish(&self, buffer: u32, number: u64) {
        self.protocol.finish(&*self.segment, buffer, number);
    }

    fn close_tensors(&self) {
        if self.peer_copy.is_some() {
            tensor_copies::close(&*self.segment, self.rank());
        }
    }

    fn laggards(&self, buffer: u32, number: u64) -> Vec<u32> {
        self.protocol.laggards(&*self.segment, buffer, number)
    }
}
