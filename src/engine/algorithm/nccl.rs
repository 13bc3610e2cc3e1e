//! The whole job's all-reduce of a device tensor as one NCCL all-reduce over
//! every worker (`local::nccl`'s job communicator), where NCCL's all-reduce
//! is ahead of the reduction-server plan: few machines whose GPUs reduce in
//! their NVSwitch, small tensors (NCCL's tree) and tensors of a few MiB to
//! a hundred or so (NVLSTree), with or without dedicated servers; and one
//! machine's workers beside dedicated servers, on the machine's
//! communicator, at every size (`engine/choice.rs` says where). A dedicated
//! server plans the operation as the workers do and serves none of it
//! (`algorithm/serve.rs`).
//!
//! The operation is one slice, the whole tensor, planned on one machine's
//! geometry (its slots are the machine's ranks', as the local step reads
//! them). Its device program is the local step's final reduce-scatter,
//! which on a job of several machines is one in-place all-reduce on the
//! job's communicator (`local::collective_step`), and nothing is gathered.
//! No byte of it crosses the engine's fabric.
//!
//! The call waits for no gate (`memory::program::ungated`): the device runs
//! it as soon as the caller's stream reaches it, and the streams waiting for
//! the operation go on once it ends, as with PyTorch's NCCL backend. The
//! engine checks it beside the device: the slice starts only once every
//! local rank and every remote rank that writes to this one (its rails among
//! them) has confirmed the operation's descriptor (`engine/slices.rs`), and
//! the collective local step ends it only once every local rank has begun
//! the slice, each past the same check. Every rank of another machine is the
//! rail of a local rank, so ranks that issued different operations fail
//! with the mismatch named (NCCL may have run the mismatched call by then:
//! the tensor's contents are undefined). A rank that fails or stalls fails
//! the engine, whose failure aborts NCCL's communicators, so that a kernel
//! waiting for a rank that is gone, or for a call another rank never made,
//! ends.

use super::{Context, DeviceUse, SliceEvent, SliceInfo, Step};
use crate::engine::choice::nccl_over_workers_may_run;
use crate::error::{Error, Result};

/// One slice of the job's all-reduce through NCCL.
#[derive(Debug)]
pub(crate) struct Nccl {
    gathering: bool,
}

impl Nccl {
    /// Begins the local step, whose reduce-scatter is the job's all-reduce.
    pub(crate) fn start(
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        steps: &mut Vec<Step>,
    ) -> Result<Nccl> {
        let over_workers = nccl_over_workers_may_run(ctx.topology, ctx.servers);
        if ctx.server.is_some() || (ctx.servers > 0 && !over_workers) || s.direct {
            return Err(Error::internal(
                "the job's NCCL all-reduce runs on workers' device tensors, beside servers \
                 only where one can run over the workers",
                format!("slice {}", s.number),
            ));
        }
        steps.push(Step::LocalBegin);
        steps.push(Step::LocalReduceScatter {
            final_world: Some(ctx.world),
        });
        Ok(Nccl { gathering: false })
    }

    /// What its slice asks of the device: the local step, whose
    /// reduce-scatter is final over the whole job.
    pub(crate) fn device_use(ctx: &Context<'_>) -> DeviceUse {
        DeviceUse::local(Some(ctx.world), true)
    }

    /// Takes one event.
    pub(crate) fn on_event(
        &mut self,
        s: &SliceInfo<'_>,
        event: SliceEvent,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        match event {
            SliceEvent::LocalReduceScatterDone if !self.gathering => {
                self.gathering = true;
                steps.push(Step::PublishSlot);
                steps.push(Step::LocalAllGather {
                    own_in_tensor: true,
                });
                Ok(())
            }
            SliceEvent::LocalAllGatherDone if self.gathering => {
                steps.push(Step::Release);
                Ok(())
            }
            SliceEvent::Landed { peer, kind, .. } => Err(Error::peer(
                peer,
                format!(
                    "a {kind:?} write into slice {}, which NCCL reduces across the job: the \
                     ranks' operations differ, or the peer broke the protocol",
                    s.number
                ),
            )),
            other => Err(Error::internal(
                "the job's NCCL all-reduce sees its local step's two ends, in order",
                format!("{other:?} in slice {}", s.number),
            )),
        }
    }

    /// Where the slice is, for a stall report.
    pub(crate) fn phase(&self) -> &'static str {
        if self.gathering {
            "ending NCCL's all-reduce across the job"
        } else {
            "NCCL's all-reduce across the job"
        }
    }
}
