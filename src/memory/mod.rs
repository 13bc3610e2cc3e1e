//! Memory spaces: where a caller's tensors and this rank's staging buffers live, and
//! how bytes move between them.
//!
//! The engine is written once over [`MemorySpace`], as gloo writes its algorithms
//! once over a workspace template parameter: the algorithms say *which* bytes move
//! (a range of the tensor into a range of a staging buffer, sources reduced into a
//! destination), the memory space says *how*. Every method only starts its work
//! and returns a [`MemorySpace::Fence`]; the progress loop polls fences the way it
//! polls the fabric's completion queue, and reports the step done once its fence
//! has passed. Nothing here may block the progress thread.
//!
//! [`Host`] is host memory: its fence is `()`, every step is done when its method
//! returns, and the engine then goes on at once, in the same pass.
//!
//! # Host and device tensors: [`Placed`]
//!
//! A communicator's engine runs over [`Placed`], whose tensor is a host or (with
//! the `cuda` feature) a device tensor, chosen per operation: one engine, one
//! sequence of operations and one set of checks serve both, and the descriptor
//! check compares the [`MemoryKind`] as it compares the type.
//!
//! Both kinds share the staging buffers, this rank's part of the machine's
//! segment, which the fabric registers. For a device tensor (`device`) the
//! device side page-locks them, and every byte moves by the operation's
//! device [`program`]: enqueued whole on the caller's thread when the call is
//! accepted, on one stream per staging buffer, each stage behind a gate word
//! the engine raises ([`MemorySpace::raise`]) and ended by an end word its
//! stream writes, which the progress loop reads. The progress thread makes no
//! CUDA call. Reductions and conversions run on the host, in the staging
//! buffers, where the tcp fabric put the bytes:
//!
//! | item | host tensor | device tensor |
//! |---|---|---|
//! | [`Tensor`](MemorySpace::Tensor) | address and length | device address, length, the operation |
//! | [`Fence`](MemorySpace::Fence) | passed at once | a buffer's end word reaching a stage's value |
//! | [`stage_in`](MemorySpace::stage_in), the local reduce-scatter | `memcpy` | a stage of the program: device-to-host copies into staging ([`raise`](MemorySpace::raise) opens it) |
//! | [`copy_out`](MemorySpace::copy_out), the local all-gather | `memcpy` | a stage: host-to-device copies from staging |
//! | [`reduce`](MemorySpace::reduce), [`convert`](MemorySpace::convert) | the host kernels | the host kernels, in the staging buffer |
//! | [`deliver`](MemorySpace::deliver) | `memcpy` | the program's delivery, device to device ([`raise_delivery`](MemorySpace::raise_delivery)) |
//! | [`host_bytes`](MemorySpace::host_bytes), for a fabric to send from | the tensor's address | none: staged |
//! | [`reduce_in_tensor`](MemorySpace::reduce_in_tensor) | the host kernels, into the tensor | refused (never asked) |
//!
//! Staging in device memory (GPUDirect RDMA over verbs, where the device
//! reduction kernel would reduce) is not built yet. The intra-machine step of
//! several GPUs (NCCL's collectives, or staged through the host) is the local
//! step's (`crate::local`): its stages are in the same programs, on the
//! streams of this memory space.

#[cfg(feature = "cuda")]
mod device_side;
mod f16c;
mod host;
mod placed;
pub(crate) mod program;

use std::fmt;
use std::ops::Range;
use std::ptr::NonNull;

use fairring_core::{DataType, ReduceOp, WireFormat};

#[cfg(feature = "cuda")]
pub(crate) use device_side::DeviceFence;
#[cfg(feature = "cuda")]
pub(crate) use device_side::{DeviceSide, DeviceTensor, cuda as cuda_error};
pub(crate) use host::{Host, HostTensor, reduce_into};
#[cfg(feature = "cuda")]
pub(crate) use placed::DeviceCell;
pub(crate) use placed::{Placed, PlacedFence, PlacedTensor};

use crate::error::Result;

/// Where tensors and staging buffers live.
pub(crate) trait MemorySpace: Send + Sync + 'static {
    /// A caller's tensor, as an operation holds it until it completes.
    type Tensor: Copy + Send + Sync + fmt::Debug;
    /// The end of a step started on this memory.
    type Fence: Send;

    /// Whether `fence` has passed; an error if the work it ends failed.
    fn poll(&self, fence: &Self::Fence) -> Result<bool>;

    /// Copies bytes `from` of `tensor` into staging buffer `buffer` at offset `to`.
    fn stage_in(
        &self,
        buffer: u32,
        to: usize,
        tensor: &Self::Tensor,
        from: Range<usize>,
    ) -> Result<Self::Fence>;

    /// Performs `reduction` in staging buffer `buffer`, which holds a slice of
    /// `tensor` (a space whose staging differs by the kind of tensor reads it).
    fn reduce(
        &self,
        buffer: u32,
        tensor: &Self::Tensor,
        reduction: &Reduction,
    ) -> Result<Self::Fence>;

    /// Performs `reduction` with its destination in `tensor` (bytes
    /// `reduction.dst` of it) and its sources in staging buffer `buffer`: the
    /// step of a slice whose tensor the fabric sends from directly
    /// ([`host_bytes`](MemorySpace::host_bytes)). A space that never offers
    /// that refuses it.
    fn reduce_in_tensor(
        &self,
        buffer: u32,
        tensor: &Self::Tensor,
        reduction: &Reduction,
    ) -> Result<Self::Fence> {
        let _ = (buffer, tensor);
        Err(crate::error::Error::internal(
            "only a tensor the fabric may read is reduced in place",
            format!("{reduction:?}"),
        ))
    }

    /// Where `tensor` lies in host memory, for a fabric to register and send
    /// from directly (first byte, length); `None` where it cannot (device
    /// memory, or a tensor of no bytes).
    fn host_bytes(&self, tensor: &Self::Tensor) -> Option<(NonNull<u8>, usize)> {
        let _ = tensor;
        None
    }

    /// Performs `conversion` in staging buffer `buffer`, which holds a slice of
    /// `tensor`.
    fn convert(
        &self,
        buffer: u32,
        tensor: &Self::Tensor,
        conversion: &Conversion,
    ) -> Result<Self::Fence>;

    /// Copies bytes of staging buffer `buffer` from offset `from` into bytes `to` of
    /// `tensor`.
    fn copy_out(
        &self,
        buffer: u32,
        from: usize,
        tensor: &Self::Tensor,
        to: Range<usize>,
    ) -> Result<Self::Fence>;

    /// Copies bytes `range` of `from` into `to`, from its start (a reduce-scatter
    /// delivers the caller's share of the result).
    fn deliver(
        &self,
        from: &Self::Tensor,
        range: Range<usize>,
        to: &Self::Tensor,
    ) -> Result<Self::Fence>;

    /// The memory the fabric registers: every staging buffer, back to back,
    /// [`buffer_bytes`](MemorySpace::buffer_bytes) apart.
    fn registered(&self) -> (NonNull<u8>, usize);

    /// Bytes from one staging buffer to the next in
    /// [`registered`](MemorySpace::registered) memory.
    fn buffer_bytes(&self) -> usize;

    /// A tensor of no bytes: what a dedicated server's operations hold (a server
    /// has no caller, only staging buffers).
    fn no_tensor(&self) -> Self::Tensor;

    /// Whether `tensor`'s operation may start on it: for a tensor ordered on a
    /// caller's stream, whether that stream has passed the operation's start
    /// (a word the caller's stream writes there, read without a CUDA call).
    /// The engine starts no slice of an operation before, so the stall timer
    /// does not count the caller's own time.
    fn started(&self, tensor: &Self::Tensor) -> Result<bool> {
        let _ = tensor;
        Ok(true)
    }

    /// Operation `seq` has finished (done or failed): nothing touches its
    /// tensors any more. A space whose callers' streams wait for completion
    /// releases them here.
    fn completed(&self, _seq: u64) {}

    /// Whether `tensor` lives on a device: its operation runs a device
    /// program ([`program`]), enqueued when its call was accepted.
    fn on_device(&self, tensor: &Self::Tensor) -> bool {
        let _ = tensor;
        false
    }

    /// The fence that passes once staging buffer `buffer`'s end word has
    /// reached `value`: a stage of a device program, or a slice's end
    /// ([`program::slice_end`]).
    fn stage_end(&self, buffer: u32, value: u64) -> Self::Fence;

    /// Opens `stage` of the device program of the slice of generation
    /// `generation` in staging buffer `buffer`, whose program holds `stages`
    /// (checked as [`program::raised`] does); returns the fence of its end.
    /// A write of host memory.
    fn raise(
        &self,
        buffer: u32,
        generation: u64,
        stage: program::Stage,
        stages: program::Stages,
    ) -> Result<Self::Fence>;

    /// The fence that passes once operation `seq`'s delivery (a
    /// reduce-scatter's share, on a device) has run.
    fn delivery_end(&self, seq: u64) -> Self::Fence;

    /// Opens operation `seq`'s delivery; returns [`delivery_end`].
    ///
    /// [`delivery_end`]: MemorySpace::delivery_end
    fn raise_delivery(&self, seq: u64) -> Result<Self::Fence>;

    /// The engine failed: opens every gate of every device program, so that
    /// every stream runs to its end.
    fn release(&self) {}
}

/// Where a caller's tensor lives, as descriptors compare it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum MemoryKind {
    /// Host memory.
    Host = 0,
    /// A GPU's memory.
    Device = 1,
}

impl MemoryKind {
    pub(crate) fn from_u8(v: u8) -> Option<MemoryKind> {
        match v {
            0 => Some(MemoryKind::Host),
            1 => Some(MemoryKind::Device),
            _ => None,
        }
    }
}

/// `dst op= sources` within one staging buffer, then, for an average, `dst /=
/// average_over`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Reduction {
    /// The element type.
    pub(crate) dtype: DataType,
    /// The operator.
    pub(crate) op: ReduceOp,
    /// The bytes reduced into.
    pub(crate) dst: Range<usize>,
    /// The bytes reduced from, each as long as `dst`.
    pub(crate) sources: Sources,
    /// The world size to divide by once the sum is complete, for
    /// [`ReduceOp::Avg`]; `None` while partial sums are still to come.
    pub(crate) average_over: Option<u32>,
    /// How the sources hold their values: `f32` narrowed to a compressed
    /// format (each source then holds [`WireFormat::f32_bytes`] per `f32` of
    /// `dst`), or [`WireFormat::Exact`]: as `dtype`, as long as `dst`.
    pub(crate) wire: WireFormat,
}

impl Reduction {
    /// Bytes of each source.
    pub(crate) fn source_len(&self) -> usize {
        self.wire.wire_bytes(self.dst.len())
    }
}

/// Which way a [`Conversion`] goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    /// `f32` to the wire format.
    Narrow,
    /// The wire format to `f32`.
    Widen,
}

/// `f32` values converted to or from a compressed wire format within one
/// staging buffer: bytes `from` into the bytes from `to`. In place when `to ==
/// from.start` (the narrow values then occupy the first half of the wide
/// range); otherwise the two ranges must not overlap.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Conversion {
    /// The compressed format.
    pub(crate) format: WireFormat,
    /// Narrowing or widening.
    pub(crate) direction: Direction,
    /// The bytes read: `f32` values to narrow, or narrow values to widen.
    pub(crate) from: Range<usize>,
    /// Where the converted bytes go.
    pub(crate) to: usize,
}

impl Conversion {
    /// The bytes written.
    pub(crate) fn written(&self) -> Range<usize> {
        let len = match self.direction {
            Direction::Narrow => self.format.wire_bytes(self.from.len()),
            Direction::Widen => self.from.len() / self.format.f32_bytes() * 4,
        };
        self.to..self.to + len
    }
}

/// Equally long source ranges of a staging buffer, without a list: `count` areas
/// `stride` bytes apart from `first`, read from area `start` on, wrapping around.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Sources {
    /// Offset of area 0.
    pub(crate) first: usize,
    /// Bytes from one area to the next.
    pub(crate) stride: usize,
    /// Number of areas.
    pub(crate) count: u32,
    /// The area read first.
    pub(crate) start: u32,
    /// Bytes read from each area.
    pub(crate) len: usize,
}

impl Sources {
    /// One range.
    pub(crate) fn one(range: Range<usize>) -> Sources {
        Sources {
            first: range.start,
            stride: 0,
            count: 1,
            start: 0,
            len: range.len(),
        }
    }

    /// No range: a reduction that only finishes its destination (divides an
    /// average).
    pub(crate) fn none(len: usize) -> Sources {
        Sources {
            first: 0,
            stride: 0,
            count: 0,
            start: 0,
            len,
        }
    }

    /// The ranges, in reading order.
    pub(crate) fn ranges(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        (0..self.count).map(move |i| {
            let area = (self.start + i) % self.count;
            let at = self.first + area as usize * self.stride;
            at..at + self.len
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_rotate_over_their_areas() {
        let s = Sources {
            first: 100,
            stride: 10,
            count: 3,
            start: 2,
            len: 4,
        };
        let ranges: Vec<_> = s.ranges().collect();
        assert_eq!(ranges, vec![120..124, 100..104, 110..114]);
        assert_eq!(Sources::one(5..9).ranges().collect::<Vec<_>>(), vec![5..9]);
    }
}
