//! The local step of a process with no local peers and no tensors: a dedicated
//! reduction server, whose slices never run an intra-machine step.

use super::{LocalSlice, LocalStep};
use crate::error::{Error, Result};
use crate::memory::MemorySpace;

/// No local step: every buffer is free as soon as this process released it, and
/// asking for a reduce-scatter or an all-gather is an internal error.
pub(crate) struct Solo;

fn none(step: &str) -> Error {
    Error::internal(
        "a dedicated server's slices run no intra-machine step",
        format!("asked for the local {step}"),
    )
}

impl<M: MemorySpace> LocalStep<M> for Solo {
    fn buffer_free(&self, _buffer: u32, _number: u64) -> bool {
        true
    }

    fn begin(&self, _s: &LocalSlice<'_, M>) -> Result<()> {
        Err(none("stage-in"))
    }

    fn try_reduce_scatter(
        &self,
        _s: &LocalSlice<'_, M>,
        _final_world: Option<u32>,
    ) -> Result<Option<M::Fence>> {
        Err(none("reduce-scatter"))
    }

    fn publish_slot(&self, _s: &LocalSlice<'_, M>) {}

    fn try_all_gather(
        &self,
        _s: &LocalSlice<'_, M>,
        _own_in_tensor: bool,
    ) -> Result<Option<M::Fence>> {
        Err(none("all-gather"))
    }

    fn finish(&self, _buffer: u32, _number: u64) {}

    fn laggards(&self, _buffer: u32, _number: u64) -> Vec<u32> {
        Vec::new()
    }
}
