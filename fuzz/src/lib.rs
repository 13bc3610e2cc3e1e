//! Inputs shared by the fuzz targets: a job geometry and a plan built from
//! arbitrary bytes, clamped into the ranges the core accepts so that the fuzzer
//! spends its time inside the core rather than on refused configurations (the
//! refusals are exercised too: every constructor is also called unclamped).

use arbitrary::Arbitrary;
use fairring_core::DataType;
use fairring_core::plan::{Geometry, Plan, PlanConfig};
use fairring_core::topology::{RankLayout, Topology};

/// A job and a tensor.
#[derive(Arbitrary, Debug)]
pub struct Job {
    machines: u16,
    devices: u8,
    interleaved: bool,
    slice_bytes: u32,
    min_shard_bytes: u32,
    dtype: u8,
    elements: u64,
    rotation: u64,
}

impl Job {
    /// The geometry and plan, or `None` where the core refused (after checking that
    /// it refused with an error and did not panic).
    pub fn build(&self) -> Option<(Geometry, Plan)> {
        // Unclamped: any refusal must be an error, never a panic.
        let layout = if self.interleaved {
            RankLayout::Interleaved
        } else {
            RankLayout::Contiguous
        };
        let raw = Topology::new(self.machines.into(), self.devices.into(), layout);
        let _ = raw.map(|t| {
            PlanConfig::new(self.slice_bytes.into(), self.min_shard_bytes.into())
                .map(|c| Geometry::new(t, c))
        });

        let machines = u32::from(self.machines % 4096) + 1;
        let devices = u32::from(self.devices % 16) + 1;
        let topology = Topology::new(machines, devices, layout).ok()?;
        let slice = (u64::from(self.slice_bytes) % (64 << 20)).max(64 * u64::from(devices));
        let min_shard = (u64::from(self.min_shard_bytes) % (4 << 20)).max(64);
        let config = PlanConfig::new(slice, min_shard).ok()?;
        let geometry = Geometry::new(topology, config).ok()?;
        let dtype = DataType::from_u8(self.dtype % 8)?;
        // Keep the slice count moderate so a run explores many jobs.
        let elements = self.elements % (geometry.full_slice_bytes() / dtype.size_bytes() * 64 + 1);
        let plan = Plan::new(&geometry, dtype, elements, self.rotation).ok()?;
        assert!(
            Plan::new(&geometry, dtype, self.elements, self.rotation).is_ok()
                || self.elements.checked_mul(dtype.size_bytes()).is_none()
        );
        Some((geometry, plan))
    }
}
