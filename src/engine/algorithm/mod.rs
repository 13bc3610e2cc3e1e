//! The algorithms that move one slice: types that own the slice's state, take
//! events and return the steps to take, as values.
//!
//! An algorithm never touches memory, the fabric or the local step itself. It is
//! told what happened to its slice ([`SliceEvent`]: a write landed, a post was
//! sent, a reduction finished, the local step ran) and answers with [`Step`]s
//! (post this write, reduce these bytes, run the local all-gather, release the
//! buffer), which the engine performs over its memory space, fabric and local
//! step (`engine/steps.rs`). A step whose work ends later reports back as an
//! event once its fence has passed; on the host that is at once. This is the
//! shape of fairring-core's staging machine (events in, [`Actions`] out), one
//! level up, and it is what lets one engine drive host and device memory alike.
//!
//! - [`hierarchical`]: the reduction-server all-reduce of the seeds, driven by the
//!   core's staging word;
//! - [`two_level`]: the same all-reduce where the job reduces its slots in
//!   groups of machines (`Routing::Groups`): within each group, then across
//!   the groups, a staging word per level;
//! - [`ring`]: the ring all-reduce (the Horovod/Gloo/NCCL baseline);
//! - [`doubling`]: recursive doubling, the all-reduce of small slices in
//!   `log2 N` exchanges;
//! - [`relay`]: broadcast and all-gather, each byte around the ring from the
//!   rank it starts at (a pipelined chain from a broadcast's root);
//! - [`scatter`]: reduce-scatter, the ring's reduce-scatter half over the same
//!   range of every rank's share, each byte reduced on its way to the rank
//!   whose share it is (around the machines, after the machine's own
//!   reduce-scatter, where machines have several devices);
//! - [`serve`]: a dedicated reduction server's part of every slice (Herring's
//!   design), where the workers run [`hierarchical`] with the servers in the
//!   machines' place;
//! - [`serve_in_groups`]: the same where the servers are in groups, each
//!   serving its group's workers and then reducing across the groups;
//! - [`nccl`]: a device tensor's all-reduce as one NCCL all-reduce over the
//!   whole job, where NCCL's NVLSTree is ahead of the plan (few machines
//!   whose GPUs reduce in their NVSwitch).
//!
//! `auto` is resolved before an operation reaches the engine ([`Resolved`]), so
//! every slice runs exactly one of them. Hierarchical and doubling run every
//! collective as an all-reduce (a broadcast sums zeros into the root's bytes);
//! where the ring is chosen it runs all-reduces and barriers, the relay
//! broadcasts and all-gathers, and scatter reduce-scatters.
//!
//! [`Actions`]: fairring_core::staging::Actions

pub(crate) mod doubling;
mod hierarchical;
mod levels;
mod nccl;
mod peers;
mod relay;
mod ring;
mod scatter;
mod serve;
mod serve_in_groups;
mod two_level;

use std::ops::Range;

use fairring_core::plan::Slice;
use fairring_core::topology::{Location, Topology};
use fairring_core::{DataType, ReduceOp, WireFormat};

pub(crate) use doubling::Doubling;
pub(crate) use hierarchical::Hierarchical;
pub(crate) use nccl::Nccl;
pub(crate) use peers::Wiring;
pub(crate) use relay::{
    Origins, Relay, most_writes as relay_most_writes, over_machines as relay_over_machines,
};
pub(crate) use ring::Ring;
pub(crate) use scatter::Scatter;
pub(crate) use serve::{Serve, ServeScratch};
pub(crate) use serve_in_groups::ServeInGroups;
pub(crate) use two_level::TwoLevel;

use super::layout::BufferLayout;
use super::tags::Kind;
use crate::config::Algorithm;
use crate::error::{Error, Result};
use crate::local::RailPieces;
use crate::memory::{Conversion, Reduction};

/// An algorithm as the engine runs it: [`Algorithm::Auto`] is resolved before an
/// operation is submitted, the same way on every rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Resolved {
    /// [`hierarchical`].
    Hierarchical,
    /// [`ring`].
    Ring,
    /// [`relay`]: what broadcasts and all-gathers run when the ring is chosen.
    Relay,
    /// [`doubling`].
    Doubling,
    /// [`scatter`]: what reduce-scatters run when the ring is chosen.
    Scatter,
    /// [`nccl`]: what `auto` runs for a device all-reduce where the job's
    /// NCCL all-reduce is ahead of the plan (never asked for by name).
    Nccl,
    /// [`hierarchical`] with the machines serving their own shards, in a job
    /// with dedicated servers: what `auto` runs for an all-reduce there where
    /// the machines reduce faster than the servers
    /// (`FAIRRING_MACHINES_SERVE`; never asked for by name). It plans with
    /// the geometry the same job would have without servers
    /// ([`colocated_geometry`](super::layout::colocated_geometry)); the
    /// servers plan it too and serve none of it.
    Colocated,
    /// [`hierarchical`] in two levels ([`two_level`]) on the flat plan: what
    /// `auto` runs for an exact all-reduce of a small tensor there
    /// ([`takes_groups`](super::layout::takes_groups); never asked for by
    /// name). It plans with the same machines in groups
    /// ([`grouped_geometry`](super::layout::grouped_geometry)).
    Grouped,
}

impl Resolved {
    /// The concrete algorithm `a` names; `None` for `auto`.
    pub(crate) fn of(a: Algorithm) -> Option<Resolved> {
        match a {
            Algorithm::Hierarchical => Some(Resolved::Hierarchical),
            Algorithm::Ring => Some(Resolved::Ring),
            Algorithm::Doubling => Some(Resolved::Doubling),
            Algorithm::Auto => None,
        }
    }

    /// What it is called in errors and reports.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Resolved::Hierarchical => "hierarchical",
            Resolved::Ring => "ring",
            Resolved::Relay => "relay",
            Resolved::Doubling => "doubling",
            Resolved::Scatter => "scatter",
            Resolved::Nccl => "nccl",
            Resolved::Colocated => "colocated",
            Resolved::Grouped => "grouped",
        }
    }

    /// Whether it plans with the job's second geometry (the engine
    /// layout's docs), in that geometry's layout of the buffers.
    pub(crate) fn on_second_geometry(self) -> bool {
        matches!(self, Resolved::Colocated | Resolved::Grouped)
    }
}

impl std::fmt::Display for Resolved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What happened to a slice, as the engine tells its algorithm.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SliceEvent {
    /// [`Step::StageIn`] finished: the input is in the staging buffer.
    Staged,
    /// [`Step::LocalReduceScatter`] finished.
    LocalReduceScatterDone,
    /// [`Step::LocalAllGather`] finished.
    LocalAllGatherDone,
    /// A peer's write of `kind` landed in the staging buffer.
    Landed {
        /// What it was.
        kind: Kind,
        /// Who wrote it.
        peer: u32,
        /// The part of a cell it carried ([`Write::part`]).
        part: u32,
    },
    /// One of this slice's writes of `kind` has left the staging buffer.
    Sent {
        /// What it was.
        kind: Kind,
        /// The part of a cell it carried ([`Write::part`]).
        part: u32,
    },
    /// [`Step::Reduce`] finished.
    Reduced,
    /// [`Step::CopyOut`] finished.
    CopiedOut,
    /// The [`Step::Convert`] that named this, and every conversion before it,
    /// finished.
    Converted(Converted),
}

/// What a slice's conversions prepared, as the last of them names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Converted {
    /// The cells this rank contributes are narrow, ready to send.
    Contributions,
    /// The served shard's result is narrow, ready to send, and this rank's own
    /// copy holds the same rounded values.
    Results,
    /// The results that landed are widened: the slot is final.
    Slot,
}

/// A one-sided write of part of this rank's staging buffer into a peer's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Write {
    /// What it is (the peer learns it from the immediate).
    pub(crate) kind: Kind,
    /// The rank written to.
    pub(crate) peer: u32,
    /// Bytes of this rank's staging buffer.
    pub(crate) source: Range<usize>,
    /// Offset in the peer's staging buffer of the same index.
    pub(crate) target: usize,
    /// Whether the peer must have credited the slice first: the write lands in an
    /// area the peer's previous slice on that buffer may still use.
    pub(crate) needs_credit: bool,
    /// The part of a cell it carries, where cells travel in parts
    /// (fairring-core's `Cell::part`: a hierarchical slice through the trees);
    /// 0 for every other write. The peer learns it from the immediate, and this
    /// rank from the write's completion.
    pub(crate) part: u32,
}

/// What an algorithm asks the engine to do.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Step {
    /// Post a write (in posting order, as flow control allows).
    Write(Write),
    /// Copy bytes `from` of the slice (relative to its start in the tensor) into
    /// the staging buffer at `to`; then [`SliceEvent::Staged`].
    StageIn {
        /// Offset in the staging buffer.
        to: usize,
        /// Bytes of the slice.
        from: Range<usize>,
    },
    /// Begin the local step (stage in what the other local ranks reduce).
    LocalBegin,
    /// Run the local reduce-scatter once it can; then
    /// [`SliceEvent::LocalReduceScatterDone`].
    LocalReduceScatter {
        /// `Some(world size)` when its result is final (one machine).
        final_world: Option<u32>,
    },
    /// Announce that this rank's slot is final.
    PublishSlot,
    /// Run the local all-gather once it can; then
    /// [`SliceEvent::LocalAllGatherDone`].
    LocalAllGather {
        /// Whether the reduce-scatter already wrote this rank's slot into the
        /// tensor.
        own_in_tensor: bool,
    },
    /// Reduce within the staging buffer; then [`SliceEvent::Reduced`].
    Reduce(Reduction),
    /// Post a write whose `source` is bytes of the slice in the tensor
    /// (relative to the slice's start), which the fabric reads directly
    /// ([`SliceInfo::direct`]).
    WriteFromTensor(Write),
    /// [`Step::WriteFromTensor`], landing in the peer's window for the
    /// operation, at the bytes' offset in its tensor, where the peer opened
    /// one ([`SliceInfo::into_window`]): it is posted once the peer's
    /// descriptor has said, and lands in the peer's staging buffer (`target`)
    /// where it opened none.
    WriteIntoWindow(Write),
    /// Reduce staging sources into bytes `dst` of the slice in the tensor
    /// (relative to the slice's start); then [`SliceEvent::Reduced`].
    ReduceInTensor(Reduction),
    /// Convert within the staging buffer between `f32` and a compressed wire
    /// format; then, if `then` names it, [`SliceEvent::Converted`] once this
    /// and every earlier conversion of the slice has finished.
    Convert {
        /// What to convert.
        conversion: Conversion,
        /// The event its end raises, on the last conversion of a group.
        then: Option<Converted>,
    },
    /// Copy staging bytes from `from` into bytes `to` of the slice (relative to
    /// its start in the tensor); then [`SliceEvent::CopiedOut`].
    CopyOut {
        /// Offset in the staging buffer.
        from: usize,
        /// Bytes of the slice.
        to: Range<usize>,
    },
    /// Announce, without an all-gather, that this rank is done with the buffer.
    LocalFinish,
    /// The slice is finished: free the buffer.
    Release,
}

/// What every slice of this rank shares.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Context<'a> {
    /// The job.
    pub(crate) topology: Topology,
    /// This rank's place in it.
    pub(crate) location: Location,
    /// This rank.
    pub(crate) rank: u32,
    /// Workers in the job (dedicated servers are not counted).
    pub(crate) world: u32,
    /// The staging buffer's layout.
    pub(crate) layout: &'a BufferLayout,
    /// Dedicated servers in the job (0: the machines serve); server `i` is
    /// process `world + i`.
    pub(crate) servers: u32,
    /// This process's index if it is a dedicated server.
    pub(crate) server: Option<u32>,
}

impl Context<'_> {
    /// The rank of this device's rail on machine `machine`.
    pub(crate) fn rail_peer(&self, machine: u32) -> Result<u32> {
        self.topology
            .rank(Location {
                machine,
                device: self.location.device,
            })
            .map_err(|e| Error::internal("every machine has this device's rail", e.to_string()))
    }

    /// Where the dedicated servers are in groups (each serving one rail),
    /// the rank of server `index` of rail `device`'s group: server `index *
    /// D + device` of the job.
    pub(crate) fn grouped_server_rank(&self, index: u32, device: u32) -> u32 {
        self.world + index * self.topology.devices_per_machine() + device
    }

    /// The worker `offset` places after this one around the ring (and the ring
    /// all-reduce's chunk index of that rank).
    pub(crate) fn around(&self, offset: i64) -> u32 {
        let n = i64::from(self.world);
        #[expect(clippy::cast_possible_truncation, reason = "reduced mod N <= u32::MAX")]
        let i = (i64::from(self.rank) + offset).rem_euclid(n) as u32;
        i
    }
}

/// One slice, as its algorithm sees it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SliceInfo<'a> {
    /// The slice's number (global, across operations).
    pub(crate) number: u64,
    /// Its generation on its staging buffer.
    pub(crate) generation: u64,
    /// The slice of the operation's plan.
    pub(crate) slice: &'a Slice,
    /// The element type.
    pub(crate) dtype: DataType,
    /// The operator.
    pub(crate) op: ReduceOp,
    /// How its `f32` values travel between machines.
    pub(crate) wire: WireFormat,
    /// Where its bytes start, for a relayed slice.
    pub(crate) origins: Option<Origins>,
    /// The fabric sends from the operation's tensor, registered for it
    /// (`engine/direct.rs`): the slice stages nothing in.
    pub(crate) direct: bool,
    /// Its writes from the tensor go into the peer's window, if the peer
    /// opened one for the operation (`engine/direct.rs`).
    pub(crate) into_window: bool,
}

impl SliceInfo<'_> {
    /// The bytes of cell (`device`, `shard`), counted from the start of the slice.
    pub(crate) fn cell_range(&self, device: u32, shard: u32) -> Result<Range<usize>> {
        let cell = self
            .slice
            .cell(device, shard)
            .map_err(|e| Error::internal("every shard of a slice has a cell", e.to_string()))?;
        cell.span().byte_range_in(self.slice.span()).ok_or_else(|| {
            Error::internal(
                "a cell lies within its slice",
                format!("{:?} in {:?}", cell.span(), self.slice.span()),
            )
        })
    }

    /// The bytes of part `part` of cell (`device`, `shard`), counted from the
    /// start of the slice (the whole cell where cells travel whole).
    pub(crate) fn part_range(&self, device: u32, shard: u32, part: u32) -> Result<Range<usize>> {
        let span = self
            .slice
            .cell(device, shard)
            .and_then(|cell| cell.part(part))
            .map_err(|e| Error::internal("every part of a cell exists", e.to_string()))?;
        span.byte_range_in(self.slice.span()).ok_or_else(|| {
            Error::internal(
                "a part lies within its slice",
                format!("{span:?} in {:?}", self.slice.span()),
            )
        })
    }

    /// Bytes of the slice.
    pub(crate) fn bytes(&self) -> Result<usize> {
        usize::try_from(self.slice.span().byte_len()).map_err(|_| {
            Error::internal(
                "a slice's bytes fit the address space",
                format!("{:?}", self.slice),
            )
        })
    }
}

/// What a slice of a device tensor asks of the device, known from the call
/// alone (a device tensor is never sent from: [`SliceInfo::direct`] is
/// false): which parts of the local step it runs, with which arguments, and
/// (through [`SliceAlgorithm::device_copies`]) the algorithm's own copies.
/// The slice's device program is enqueued from it when the call is accepted,
/// and the engine holds the running slice to it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct DeviceUse {
    /// [`Step::LocalBegin`].
    pub(crate) begin: bool,
    /// [`Step::LocalReduceScatter`], with its `final_world`.
    pub(crate) reduce_scatter: Option<Option<u32>>,
    /// [`Step::LocalAllGather`], with its `own_in_tensor`.
    pub(crate) all_gather: Option<bool>,
    /// How the slice lies in the machine's staging buffers
    /// ([`SliceAlgorithm::local_pieces`]).
    pub(crate) pieces: Option<RailPieces>,
}

impl DeviceUse {
    /// The whole local step: begin, the reduce-scatter (final where
    /// `final_world`), and the all-gather.
    pub(crate) fn local(final_world: Option<u32>, own_in_tensor: bool) -> DeviceUse {
        DeviceUse {
            begin: true,
            reduce_scatter: Some(final_world),
            all_gather: Some(own_in_tensor),
            pieces: None,
        }
    }
}

/// A copy between the tensor and the staging buffer an algorithm asks for,
/// as its step names it (tensor ranges from the slice's start).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum DeviceCopy {
    /// [`Step::StageIn`].
    In { to: usize, from: Range<usize> },
    /// [`Step::CopyOut`].
    Out { from: usize, to: Range<usize> },
}

/// The state of one slice's algorithm.
#[derive(Debug)]
pub(crate) enum SliceAlgorithm {
    /// [`hierarchical`].
    Hierarchical(Hierarchical),
    /// [`two_level`]: [`Resolved::Hierarchical`] in groups.
    TwoLevel(TwoLevel),
    /// [`ring`].
    Ring(Ring),
    /// [`relay`].
    Relay(Relay),
    /// [`doubling`].
    Doubling(Doubling),
    /// [`scatter`].
    Scatter(Scatter),
    /// [`serve`].
    Serve(Serve),
    /// [`serve_in_groups`].
    ServeInGroups(ServeInGroups),
    /// [`nccl`].
    Nccl(Nccl),
}

impl SliceAlgorithm {
    /// Starts `algorithm` on a slice that just acquired its buffer; its first
    /// steps go into `steps`.
    pub(crate) fn start(
        algorithm: Resolved,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        scratch: &mut ServeScratch,
        steps: &mut Vec<Step>,
    ) -> Result<SliceAlgorithm> {
        if ctx.server.is_some() {
            if algorithm == Resolved::Hierarchical && s.slice.server_groups().is_some() {
                return Ok(SliceAlgorithm::ServeInGroups(ServeInGroups::start(
                    ctx, s, steps,
                )?));
            }
            return Ok(SliceAlgorithm::Serve(Serve::start(
                ctx, s, algorithm, scratch, steps,
            )?));
        }
        Ok(match algorithm {
            // The second geometry's algorithms (the machines' own plan beside
            // servers, small tensors in groups) run in its own context
            // (`Engine::context_for`), the first as in a job without servers.
            Resolved::Hierarchical | Resolved::Colocated | Resolved::Grouped if in_groups(s) => {
                SliceAlgorithm::TwoLevel(TwoLevel::start(ctx, s, steps)?)
            }
            Resolved::Hierarchical | Resolved::Colocated | Resolved::Grouped => {
                SliceAlgorithm::Hierarchical(Hierarchical::start(ctx, s, steps)?)
            }
            Resolved::Ring => SliceAlgorithm::Ring(Ring::start(ctx, s, steps)?),
            Resolved::Relay => SliceAlgorithm::Relay(Relay::start(ctx, s, steps)?),
            Resolved::Doubling => SliceAlgorithm::Doubling(Doubling::start(ctx, s, steps)?),
            Resolved::Scatter => SliceAlgorithm::Scatter(Scatter::start(ctx, s, steps)?),
            Resolved::Nccl => SliceAlgorithm::Nccl(Nccl::start(ctx, s, steps)?),
        })
    }

    /// What a device tensor's slice running `algorithm` asks of the device
    /// (see [`DeviceUse`]).
    pub(crate) fn device_use(
        algorithm: Resolved,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
    ) -> Result<DeviceUse> {
        device_slice(ctx, s)?;
        Ok(match algorithm {
            Resolved::Hierarchical | Resolved::Colocated | Resolved::Grouped if in_groups(s) => {
                TwoLevel::device_use()
            }
            Resolved::Hierarchical | Resolved::Colocated | Resolved::Grouped => {
                Hierarchical::device_use(ctx)
            }
            Resolved::Ring | Resolved::Doubling => DeviceUse::default(),
            Resolved::Relay => Relay::device_use(ctx, s)?,
            Resolved::Scatter => Scatter::device_use(ctx, s)?,
            Resolved::Nccl => Nccl::device_use(ctx),
        })
    }

    /// Calls `each` with every copy a device tensor's slice running
    /// `algorithm` asks for: exactly the [`Step::StageIn`]s and
    /// [`Step::CopyOut`]s it will take, in any order.
    pub(crate) fn device_copies(
        algorithm: Resolved,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        each: &mut dyn FnMut(DeviceCopy) -> Result<()>,
    ) -> Result<()> {
        device_slice(ctx, s)?;
        match algorithm {
            Resolved::Hierarchical | Resolved::Colocated | Resolved::Grouped | Resolved::Nccl => {
                Ok(())
            }
            Resolved::Ring => Ring::device_copies(s, each),
            Resolved::Doubling => Doubling::device_copies(ctx, s, each),
            Resolved::Relay => Relay::device_copies(ctx, s, each),
            Resolved::Scatter => Scatter::device_copies(ctx, s, each),
        }
    }

    /// Takes `event`; the steps it makes possible go into `steps`.
    pub(crate) fn on_event(
        &mut self,
        ctx: &Context<'_>,
        s: &SliceInfo<'_>,
        event: SliceEvent,
        steps: &mut Vec<Step>,
    ) -> Result<()> {
        match self {
            SliceAlgorithm::Hierarchical(h) => h.on_event(ctx, s, event, steps),
            SliceAlgorithm::TwoLevel(t) => t.on_event(ctx, s, event, steps),
            SliceAlgorithm::Ring(r) => r.on_event(ctx, s, event, steps),
            SliceAlgorithm::Relay(r) => r.on_event(ctx, s, event, steps),
            SliceAlgorithm::Doubling(r) => r.on_event(ctx, s, event, steps),
            SliceAlgorithm::Scatter(r) => r.on_event(ctx, s, event, steps),
            SliceAlgorithm::Serve(v) => v.on_event(ctx, s, event, steps),
            SliceAlgorithm::ServeInGroups(v) => v.on_event(ctx, s, event, steps),
            SliceAlgorithm::Nccl(v) => v.on_event(s, event, steps),
        }
    }

    /// Gives back what the slice borrowed from its buffer for the next one.
    pub(crate) fn recycle(self, scratch: &mut ServeScratch) {
        if let SliceAlgorithm::Serve(v) = self {
            v.recycle(scratch);
        }
    }

    /// How the slice lies in the staging buffers the local step shares: a
    /// reduce-scatter's pieces grouped by device, or (`None`) the slice's slots.
    pub(crate) fn local_pieces(&self) -> Option<RailPieces> {
        match self {
            SliceAlgorithm::Scatter(r) => r.local_pieces(),
            _ => None,
        }
    }

    /// Where the slice is, for a stall report.
    pub(crate) fn phase(&self) -> &'static str {
        match self {
            SliceAlgorithm::Hierarchical(h) => h.phase(),
            SliceAlgorithm::TwoLevel(t) => t.phase(),
            SliceAlgorithm::Ring(r) => r.phase(),
            SliceAlgorithm::Relay(r) => r.phase(),
            SliceAlgorithm::Doubling(r) => r.phase(),
            SliceAlgorithm::Scatter(r) => r.phase(),
            SliceAlgorithm::Serve(v) => v.phase(),
            SliceAlgorithm::ServeInGroups(v) => v.phase(),
            SliceAlgorithm::Nccl(v) => v.phase(),
        }
    }
}

/// Whether the slice's slots are reduced in groups (`Routing::Groups`): its
/// hierarchical all-reduce runs in two levels.
fn in_groups(s: &SliceInfo<'_>) -> bool {
    s.slice.machine_groups().is_some()
}

/// Refuses to describe a slice no device tensor runs: a dedicated server's,
/// or one sent from its tensor.
fn device_slice(ctx: &Context<'_>, s: &SliceInfo<'_>) -> Result<()> {
    if ctx.server.is_some() || s.direct || s.into_window {
        return Err(Error::internal(
            "only a worker's staged slices run on device tensors",
            format!("slice {} (server {:?})", s.number, ctx.server),
        ));
    }
    Ok(())
}

/// The members a slice's bytes go around, each writing to the next: every
/// rank, or the machines along this device's rail (shared memory then takes
/// the hops inside each machine).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Members {
    /// How many: ranks, or machines.
    pub(crate) count: u32,
    /// This rank's place among them.
    pub(crate) position: u32,
    /// The ranks written to and written by.
    pub(crate) next: u32,
    pub(crate) previous: u32,
}

impl Members {
    /// Every rank, in rank order.
    pub(crate) fn ranks(ctx: &Context<'_>) -> Members {
        Members {
            count: ctx.world,
            position: ctx.rank,
            next: ctx.around(1),
            previous: ctx.around(-1),
        }
    }

    /// The machines, each through its rank of this device's rail.
    pub(crate) fn machines(ctx: &Context<'_>) -> Result<Members> {
        let count = ctx.topology.machines();
        let machine = ctx.location.machine;
        Ok(Members {
            count,
            position: machine,
            next: ctx.rail_peer((machine + 1) % count)?,
            previous: ctx.rail_peer((machine + count - 1) % count)?,
        })
    }

    /// The member `offset` places after this one.
    pub(crate) fn at(&self, offset: i64) -> u32 {
        let n = i64::from(self.count);
        #[expect(
            clippy::cast_possible_truncation,
            reason = "reduced mod count <= u32::MAX"
        )]
        let i = (i64::from(self.position) + offset).rem_euclid(n) as u32;
        i
    }

    /// Refuses a write of `kind` from `peer` unless it comes from the previous
    /// member and `expected` (the slice still waits for one), as `why`.
    pub(crate) fn check_from_previous(
        &self,
        s: &SliceInfo<'_>,
        kind: Kind,
        peer: u32,
        expected: bool,
        why: &str,
    ) -> Result<()> {
        if peer == self.previous && expected {
            Ok(())
        } else {
            Err(unexpected(kind, peer, s, why))
        }
    }
}

/// The error for an event a slice's algorithm (`state`, as it stands) does not
/// expect: a bug in the engine, since only the slice's own steps raise events.
pub(crate) fn stray_event(
    event: SliceEvent,
    s: &SliceInfo<'_>,
    state: &dyn std::fmt::Debug,
) -> Error {
    Error::internal(
        "a slice gets only its own steps' events, each once",
        format!("{event:?} for slice {} at {state:?}", s.number),
    )
}

/// The error for a write of `kind` from `peer` that the slice does not expect.
pub(crate) fn unexpected(kind: Kind, peer: u32, s: &SliceInfo<'_>, why: &str) -> Error {
    Error::peer(
        peer,
        format!(
            "a {kind:?} write into slice {} that it does not expect ({why}): the ranks' \
             operations differ, or the peer broke the protocol",
            s.number
        ),
    )
}
