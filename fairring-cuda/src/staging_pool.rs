//! The staging pool: the device memory, pinned host memory, streams and events
//! one device's share of the all-reduce pipeline runs on.
//!
//! Each slice runs through up to five stages, each on its own stream, as the
//! original's last design did: the intra-machine **reduce-scatter**, the
//! **collect** of the other machines' contributions to the shard this device
//! serves, the **add** that reduces them, the **diffuse** of the reduced shard
//! back, and the intra-machine **all-gather**. A single-machine job skips the
//! middle three; a job of one device per machine skips the first and last.
//!
//! The order between stages is carried by events, never by the host waiting:
//!
//! - [`begin`](StagingPool::begin) orders the first stage after the caller's
//!   stream (the input is ready) and after the buffer's previous all-gather (the
//!   buffer is free again);
//! - [`hand_over`](StagingPool::hand_over) orders one stage after another, for one
//!   buffer;
//! - [`complete`](StagingPool::complete) records the slice's completion on the
//!   all-gather stream and returns the event, on which the caller's stream can
//!   wait and chain its next kernel without a CPU wait.
//!
//! Reuse relies on one thread issuing every buffer's work in slice order: a wait
//! binds to the last record of an event before it, and waiting on an event never
//! recorded is a no-op (the first use of a buffer).

use std::sync::Arc;

use fairring_core::plan::{Geometry, StagingLayout};

use crate::buffers::{DeviceBuffer, DeviceSliceMut, PinnedBuffer};
use crate::device::Device;
use crate::error::{self, Result};
use crate::event::{Event, Timing};
use crate::stream::Stream;

/// A stage of the pipeline; each has its own stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// The intra-machine reduce-scatter (NCCL).
    ReduceScatter,
    /// Receiving the other machines' contributions to this device's shard.
    Collect,
    /// Reducing them into the shard (the reduction kernel).
    Add,
    /// Sending the reduced shard back and receiving the other shards.
    Diffuse,
    /// The intra-machine all-gather (NCCL); the slice completes on its stream.
    AllGather,
}

impl Stage {
    /// Every stage, in pipeline order.
    pub const ALL: [Stage; 5] = [
        Stage::ReduceScatter,
        Stage::Collect,
        Stage::Add,
        Stage::Diffuse,
        Stage::AllGather,
    ];

    fn index(self) -> usize {
        self as usize
    }
}

/// Whether each staging buffer has a pinned host copy, for fabrics that cannot
/// reach device memory (the TCP provider, or verbs without GPUDirect).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HostStaging {
    /// Device memory only.
    None,
    /// A pinned host buffer of the same layout beside each device buffer.
    Pinned,
}

/// One staging buffer: device memory laid out by the core's [`StagingLayout`], an
/// optional pinned host twin, and an event per stage.
#[derive(Debug)]
struct StagingBuffer {
    device_memory: DeviceBuffer,
    host_memory: Option<PinnedBuffer>,
    /// Recorded on the caller's stream when a slice begins.
    entry: Event,
    /// Recorded on each stage's stream when that stage is done with the buffer.
    stage_done: [Event; 5],
}

/// The staging buffers, streams and events of one device, allocated once.
#[derive(Debug)]
pub struct StagingPool {
    device: Arc<Device>,
    layout: StagingLayout,
    streams: [Stream; 5],
    buffers: Vec<StagingBuffer>,
}

impl StagingPool {
    /// A pool for `geometry`: as many buffers of its staging layout as fit in
    /// `budget_bytes` (at least one, or an error naming the budget).
    pub fn for_geometry(
        device: &Arc<Device>,
        geometry: &Geometry,
        budget_bytes: u64,
        host: HostStaging,
    ) -> Result<StagingPool> {
        let buffers = geometry
            .staging_buffers(budget_bytes)
            .map_err(|e| error::invalid("staging budget", e.to_string()))?;
        StagingPool::new(device, geometry.staging_layout(), buffers, host)
    }

    /// A pool of `buffers` buffers of `layout`.
    pub fn new(
        device: &Arc<Device>,
        layout: StagingLayout,
        buffers: u32,
        host: HostStaging,
    ) -> Result<StagingPool> {
        if buffers == 0 {
            return Err(error::invalid(
                "staging buffers",
                "a pool needs at least one",
            ));
        }
        let bytes = usize::try_from(layout.total_bytes())
            .map_err(|_| error::invalid("staging layout", "larger than the address space"))?;
        let streams = [
            Stream::new(device, true)?,
            Stream::new(device, true)?,
            Stream::new(device, true)?,
            Stream::new(device, true)?,
            Stream::new(device, true)?,
        ];
        let event = || Event::new(device, Timing::Disabled);
        let mut pool = Vec::with_capacity(buffers as usize);
        for _ in 0..buffers {
            pool.push(StagingBuffer {
                device_memory: DeviceBuffer::zeroed(device, bytes)?,
                host_memory: match host {
                    HostStaging::None => None,
                    HostStaging::Pinned => Some(PinnedBuffer::zeroed(device, bytes)?),
                },
                entry: event()?,
                stage_done: [event()?, event()?, event()?, event()?, event()?],
            });
        }
        Ok(StagingPool {
            device: Arc::clone(device),
            layout,
            streams,
            buffers: pool,
        })
    }

    /// The device the pool lives on.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// The layout of every buffer.
    pub fn layout(&self) -> StagingLayout {
        self.layout
    }

    /// Buffers in the pool: slices in flight at once.
    pub fn buffers(&self) -> u32 {
        u32::try_from(self.buffers.len()).unwrap_or(u32::MAX)
    }

    /// The stream `stage` runs on.
    pub fn stream(&self, stage: Stage) -> &Stream {
        &self.streams[stage.index()]
    }

    /// Buffer `buffer`'s memory, with the stage streams to enqueue work on it.
    pub fn parts(&mut self, buffer: u32) -> Result<StagingParts<'_>> {
        let count = self.buffers.len();
        let b = self
            .buffers
            .get_mut(buffer as usize)
            .ok_or_else(|| out_of_range(buffer, count))?;
        Ok(StagingParts {
            streams: StageStreams(&self.streams),
            device_memory: b.device_memory.slice_mut(),
            host_memory: b.host_memory.as_mut(),
        })
    }

    /// Starts a slice in `buffer`: the reduce-scatter stream (the first stage)
    /// waits for the work enqueued on `caller` so far and for the buffer's
    /// previous slice to complete.
    pub fn begin(&self, buffer: u32, caller: &Stream) -> Result<()> {
        let b = self.buffer(buffer)?;
        b.entry.record(caller)?;
        let first = self.stream(Stage::ReduceScatter);
        first.wait(&b.entry)?;
        first.wait(&b.stage_done[Stage::AllGather.index()])
    }

    /// Ends `from`'s work on `buffer` and orders `to`'s later work after it.
    pub fn hand_over(&self, buffer: u32, from: Stage, to: Stage) -> Result<()> {
        let done = &self.buffer(buffer)?.stage_done[from.index()];
        done.record(self.stream(from))?;
        self.stream(to).wait(done)
    }

    /// Ends the slice in `buffer`: records its completion on the all-gather
    /// stream and returns that event, which the caller's stream may
    /// [`wait`](Stream::wait) on. The buffer takes its next slice after it.
    pub fn complete(&self, buffer: u32) -> Result<&Event> {
        let done = &self.buffer(buffer)?.stage_done[Stage::AllGather.index()];
        done.record(self.stream(Stage::AllGather))?;
        Ok(done)
    }

    fn buffer(&self, buffer: u32) -> Result<&StagingBuffer> {
        let count = self.buffers.len();
        self.buffers
            .get(buffer as usize)
            .ok_or_else(|| out_of_range(buffer, count))
    }
}

/// One staging buffer's memory, borrowed together with the pool's streams.
#[derive(Debug)]
pub struct StagingParts<'a> {
    /// The stage streams.
    pub streams: StageStreams<'a>,
    /// The buffer's device memory, laid out by the pool's [`StagingLayout`].
    pub device_memory: DeviceSliceMut<'a>,
    /// Its pinned host twin, if the pool has one.
    pub host_memory: Option<&'a mut PinnedBuffer>,
}

/// The pool's stream per stage.
#[derive(Clone, Copy, Debug)]
pub struct StageStreams<'a>(&'a [Stream; 5]);

impl<'a> StageStreams<'a> {
    /// The stream `stage` runs on.
    pub fn get(&self, stage: Stage) -> &'a Stream {
        &self.0[stage.index()]
    }
}

fn out_of_range(buffer: u32, count: usize) -> error::Error {
    error::invalid(
        "staging buffer",
        format!("buffer {buffer} does not exist (the pool has {count})"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use fairring_core::plan::PlanConfig;
    use fairring_core::topology::{RankLayout, Topology};

    #[test]
    fn stages_index_their_streams_in_pipeline_order() {
        for (i, stage) in Stage::ALL.into_iter().enumerate() {
            assert_eq!(stage.index(), i);
        }
    }

    #[test]
    fn layout_spans_become_byte_ranges_inside_the_buffer() {
        let topology = Topology::new(4, 8, RankLayout::Contiguous).unwrap();
        let geometry = Geometry::new(topology, PlanConfig::DEFAULT).unwrap();
        let layout = geometry.staging_layout();
        let slot = layout.slot().byte_range().unwrap();
        assert_eq!(slot.start, 0);
        let total = usize::try_from(layout.total_bytes()).unwrap();
        let mut end = slot.end;
        for from in 1..4 {
            let area = layout.contribution(from, 0).unwrap().byte_range().unwrap();
            assert!(area.start >= slot.end && area.end <= total, "{area:?}");
            end = end.max(area.end);
        }
        assert_eq!(end, total, "the areas fill the buffer");
    }

    #[test]
    fn out_of_range_buffers_are_named() {
        let e = out_of_range(3, 2).to_string();
        assert!(e.contains("buffer 3") && e.contains("has 2"), "{e}");
    }
}
