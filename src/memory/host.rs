//! Host memory: tensors in the caller's address space, staging buffers in this
//! rank's part of the machine's shared segment.

use std::ops::Range;
use std::ptr::NonNull;
use std::sync::Arc;

use fairring_core::reduce::{ReduceError, WireCodec, finish_avg_bytes, reduce_many_bytes};
use fairring_core::{DataType, ReduceOp, WireFormat};

use super::program::{Stage, Stages, StagingAt};
use super::{Conversion, Direction, MemorySpace, Reduction};
use crate::error::{Error, Result};
use crate::shm::Segment;

/// Most sources one reduction call takes; more are folded in batches.
const MAX_SOURCES: usize = 16;

// A dedicated server's fold is one pass over its accumulator.
const _: () = assert!(fairring_core::plan::SERVER_FOLD_CELLS as usize <= MAX_SOURCES);

/// A caller's tensor in host memory: `len` bytes at `ptr`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct HostTensor {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the pointer is only dereferenced by the engine's driver, under the
// contract of the call that submitted it (the memory stays valid and untouched by
// the caller until the operation completes).
unsafe impl Send for HostTensor {}
// SAFETY: as for `Send`; the driver, which alone dereferences it, is one thread at
// a time.
unsafe impl Sync for HostTensor {}

impl HostTensor {
    /// `len` bytes at `ptr` (null only when `len` is 0).
    pub(crate) fn new(ptr: *mut u8, len: usize) -> HostTensor {
        HostTensor { ptr, len }
    }

    /// Its first byte and length; `None` for a tensor of no bytes.
    pub(crate) fn host_bytes(&self) -> Option<(NonNull<u8>, usize)> {
        NonNull::new(self.ptr)
            .filter(|_| self.len > 0)
            .map(|p| (p, self.len))
    }

    /// Its bytes `range`.
    ///
    /// # Safety
    ///
    /// The submitting call's contract holds (the memory is valid and the caller
    /// does not touch it until the operation completes), and nothing else holds a
    /// reference to these bytes while the result lives.
    #[expect(clippy::mut_from_ref, reason = "exclusive by the submission contract")]
    pub(crate) unsafe fn bytes(&self, range: Range<usize>) -> Result<&mut [u8]> {
        if range.start > range.end || range.end > self.len {
            return Err(Error::internal(
                "tensor ranges lie within the tensor",
                format!("{range:?} of a tensor of {} bytes", self.len),
            ));
        }
        if range.is_empty() {
            return Ok(&mut []);
        }
        // SAFETY: `ptr` is valid for `len` bytes (the caller's contract) and the
        // range lies within them (checked); exclusive by the caller's contract.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(self.ptr.wrapping_add(range.start), range.len())
        })
    }
}

/// Host memory: staging buffers in this rank's part of the machine's segment.
/// A clone is another view of the same buffers.
#[derive(Clone)]
pub(crate) struct Host {
    segment: Arc<Segment>,
    rank: u32,
    buffers: u32,
    /// The compressed wire's conversions (F16C where the CPU has it).
    codec: WireCodec,
}

impl Host {
    /// Local rank `rank`'s staging buffers in `segment`.
    pub(crate) fn new(segment: Arc<Segment>, rank: u32, buffers: u32) -> Host {
        Host {
            segment,
            rank,
            buffers,
            codec: super::f16c::wire_codec(),
        }
    }

    /// Bytes `range` of staging buffer `buffer`.
    ///
    /// The driver alone calls this, and by the engine's protocol no peer writes
    /// and no local rank reads these bytes while it works on them (see `local` and
    /// the engine's flow control); callers never hold two overlapping results.
    #[expect(clippy::mut_from_ref, reason = "exclusive by the engine's protocol")]
    pub(crate) fn staging(&self, buffer: u32, range: Range<usize>) -> Result<&mut [u8]> {
        if buffer >= self.buffers
            || range.start > range.end
            || range.end > self.segment.buffer_bytes()
        {
            return Err(Error::internal(
                "staging ranges lie within a staging buffer",
                format!(
                    "{range:?} of buffer {buffer} ({} buffers of {} bytes)",
                    self.buffers,
                    self.segment.buffer_bytes()
                ),
            ));
        }
        let start = self.segment.buffer(self.rank, buffer).as_ptr();
        // SAFETY: in bounds (checked); exclusive by the engine's protocol (above).
        Ok(unsafe { std::slice::from_raw_parts_mut(start.wrapping_add(range.start), range.len()) })
    }

    /// `dst op=` the sources of `r` in staging buffer `buffer`, then the
    /// average's division where `r` finishes one.
    fn reduce_sources(&self, buffer: u32, dst: &mut [u8], r: &Reduction) -> Result<()> {
        if dst.len() != r.dst.len() {
            return Err(Error::internal(
                "a reduction's destination is as long as its range",
                format!("{} bytes for {:?}", dst.len(), r.dst),
            ));
        }
        for source in r.sources.ranges() {
            if source.len() != r.source_len() {
                return Err(Error::internal(
                    "reduction sources are as long as the destination",
                    format!("source {source:?}, destination {:?}", r.dst),
                ));
            }
        }
        let mut sources = r
            .sources
            .ranges()
            .map(|range| self.staging(buffer, range).map(|s| &*s));
        if r.wire == WireFormat::Exact {
            reduce_into(r.dtype, r.op, dst, &mut sources)?;
        } else {
            if r.dtype != DataType::F32 {
                return Err(Error::internal(
                    "only f32 values travel compressed",
                    format!("{} on the {} wire", r.dtype, r.wire),
                ));
            }
            in_batches(&mut sources, |batch| {
                self.codec
                    .reduce_many_compressed_bytes(r.op, r.wire, dst, batch)
            })?;
        }
        if let Some(world) = r.average_over
            && r.op == ReduceOp::Avg
        {
            finish_avg_bytes(r.dtype, dst, world)
                .map_err(|e| Error::internal("averages divide a whole sum", e.to_string()))?;
        }
        Ok(())
    }
}

impl Host {
    /// Its staging buffers.
    #[cfg(any(feature = "cuda", all(test, not(loom))))]
    pub(crate) fn buffers(&self) -> u32 {
        self.buffers
    }

    /// The first of `len` bytes of the machine's staging at `at` (any local
    /// rank's buffer), for a device program's copy; refused where they do
    /// not lie within that buffer.
    #[cfg_attr(
        not(any(feature = "cuda", all(test, not(loom)))),
        expect(dead_code, reason = "device programs need a GPU, or the simulation's")
    )]
    pub(crate) fn machine_bytes(&self, at: StagingAt, len: usize) -> Result<NonNull<u8>> {
        let end = at.offset.checked_add(len);
        if at.rank >= self.segment.ranks()
            || at.buffer >= self.buffers
            || end.is_none_or(|end| end > self.segment.buffer_bytes())
        {
            return Err(Error::internal(
                "a device program's copies lie within the machine's staging buffers",
                format!(
                    "{len} bytes at {at:?} of {} ranks' {} buffers of {} bytes",
                    self.segment.ranks(),
                    self.buffers,
                    self.segment.buffer_bytes()
                ),
            ));
        }
        // SAFETY: within local rank `at.rank`'s buffer `at.buffer` (checked).
        Ok(unsafe { self.segment.buffer(at.rank, at.buffer).add(at.offset) })
    }

    /// Every local rank's staging buffers, back to back (first byte,
    /// length): what a GPU's copies read the other ranks' results from.
    #[cfg(feature = "cuda")]
    pub(crate) fn machine_staging(&self) -> (NonNull<u8>, usize) {
        self.segment.buffers_region()
    }
}

impl MemorySpace for Host {
    type Tensor = HostTensor;
    type Fence = ();

    fn poll(&self, (): &()) -> Result<bool> {
        Ok(true)
    }

    fn stage_in(
        &self,
        buffer: u32,
        to: usize,
        tensor: &HostTensor,
        from: Range<usize>,
    ) -> Result<()> {
        let dst = self.staging(buffer, to..to + from.len())?;
        // SAFETY: the operation is pending and only the driver touches its tensor.
        let src = unsafe { tensor.bytes(from)? };
        dst.copy_from_slice(src);
        Ok(())
    }

    fn reduce(&self, buffer: u32, _tensor: &HostTensor, r: &Reduction) -> Result<()> {
        for source in r.sources.ranges() {
            if overlap(&source, &r.dst) {
                return Err(Error::internal(
                    "reduction sources lie apart from the destination",
                    format!("source {source:?}, destination {:?}", r.dst),
                ));
            }
        }
        self.reduce_sources(buffer, self.staging(buffer, r.dst.clone())?, r)
    }

    fn reduce_in_tensor(&self, buffer: u32, tensor: &HostTensor, r: &Reduction) -> Result<()> {
        // SAFETY: as in `stage_in`; the sources are staging memory, apart from
        // the caller's tensor.
        let dst = unsafe { tensor.bytes(r.dst.clone())? };
        self.reduce_sources(buffer, dst, r)
    }

    fn host_bytes(&self, tensor: &HostTensor) -> Option<(NonNull<u8>, usize)> {
        tensor.host_bytes()
    }

    fn convert(&self, buffer: u32, _tensor: &HostTensor, c: &Conversion) -> Result<()> {
        let written = c.written();
        let refused = |e: ReduceError| {
            Error::internal(
                "conversions cover whole, aligned f32 values",
                format!("{c:?}: {e}"),
            )
        };
        if c.to == c.from.start {
            let wide = match c.direction {
                Direction::Narrow => c.from.clone(),
                Direction::Widen => written,
            };
            let bytes = self.staging(buffer, wide)?;
            return match c.direction {
                Direction::Narrow => self.codec.narrow_in_place(c.format, bytes),
                Direction::Widen => self.codec.widen_in_place(c.format, bytes),
            }
            .map_err(refused);
        }
        if overlap(&c.from, &written) {
            return Err(Error::internal(
                "a conversion is in place or between separate ranges",
                format!("{c:?}"),
            ));
        }
        let src = self.staging(buffer, c.from.clone())?;
        let dst = self.staging(buffer, written)?;
        match c.direction {
            Direction::Narrow => self.codec.narrow_bytes(c.format, src, dst),
            Direction::Widen => self.codec.widen_bytes(c.format, src, dst),
        }
        .map_err(refused)
    }

    fn copy_out(
        &self,
        buffer: u32,
        from: usize,
        tensor: &HostTensor,
        to: Range<usize>,
    ) -> Result<()> {
        let src = self.staging(buffer, from..from + to.len())?;
        // SAFETY: as in `stage_in`.
        let dst = unsafe { tensor.bytes(to)? };
        dst.copy_from_slice(src);
        Ok(())
    }

    fn deliver(&self, from: &HostTensor, range: Range<usize>, to: &HostTensor) -> Result<()> {
        let len = range.len();
        // SAFETY: both belong to one pending operation and are distinct memory (the
        // caller's input and output, borrowed separately).
        let src = unsafe { from.bytes(range)? };
        // SAFETY: as above.
        let dst = unsafe { to.bytes(0..len)? };
        dst.copy_from_slice(src);
        Ok(())
    }

    fn registered(&self) -> (NonNull<u8>, usize) {
        self.segment.rank_area(self.rank)
    }

    fn buffer_bytes(&self) -> usize {
        self.segment.buffer_bytes()
    }

    fn no_tensor(&self) -> HostTensor {
        HostTensor::new(std::ptr::null_mut(), 0)
    }

    fn stage_end(&self, _buffer: u32, _value: u64) {}

    fn raise(&self, buffer: u32, generation: u64, stage: Stage, _: Stages) -> Result<()> {
        Err(no_program(format!(
            "{} of generation {generation} in buffer {buffer}",
            stage.name()
        )))
    }

    fn delivery_end(&self, _seq: u64) {}

    fn raise_delivery(&self, seq: u64) -> Result<()> {
        Err(no_program(format!("the delivery of operation {seq}")))
    }
}

/// A device program's step asked of host memory, which runs none.
fn no_program(what: String) -> Error {
    Error::internal("host memory runs no device program", what)
}

/// Whether two byte ranges share a byte.
fn overlap(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

/// `dst op= srcs[0] op srcs[1] ...`, in batches of [`MAX_SOURCES`], allocation-free;
/// the first source that cannot be had fails it.
pub(crate) fn reduce_into<'a>(
    dtype: DataType,
    op: ReduceOp,
    dst: &mut [u8],
    srcs: &mut impl Iterator<Item = Result<&'a [u8]>>,
) -> Result<()> {
    in_batches(srcs, |batch| reduce_many_bytes(dtype, op, dst, batch))
}

/// Hands `srcs` to `reduce` in batches of up to [`MAX_SOURCES`].
fn in_batches<'a>(
    srcs: &mut impl Iterator<Item = Result<&'a [u8]>>,
    mut reduce: impl FnMut(&[&[u8]]) -> std::result::Result<(), ReduceError>,
) -> Result<()> {
    let mut batch: [&[u8]; MAX_SOURCES] = [&[]; MAX_SOURCES];
    loop {
        let mut n = 0;
        for s in srcs.by_ref().take(MAX_SOURCES) {
            batch[n] = s?;
            n += 1;
        }
        if n == 0 {
            return Ok(());
        }
        reduce(&batch[..n])
            .map_err(|e| Error::internal("reductions get equal lengths", e.to_string()))?;
    }
}
