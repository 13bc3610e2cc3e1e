//! Device programs as the engine sees them: what an operation on device
//! tensors asks of the device, enumerated from its plan when its call is
//! accepted ([`Engine::program`], enqueued by the caller's thread), and the
//! check that holds each running slice to what was enqueued for it
//! ([`SliceStages`]).
//!
//! Both come from one enumeration. A slice's algorithm says, from the call
//! alone, which parts of the local step it runs and which copies it asks for
//! ([`DeviceUse`], [`SliceAlgorithm::device_copies`]); the local step says
//! what its parts do on the device ([`LocalStep::device_items`]). The
//! enumeration puts them in stream order, stage by stage
//! ([`crate::memory::program`]). When a device slice starts, the engine
//! enumerates it again into a [`SliceStages`]: which stages its program
//! holds, and a tally of the copies of its algorithm stages. Every copy the
//! running slice asks for is tallied against it, its stage is opened once
//! the last one is asked for and only if the tallies agree, every local step
//! it asks for must be the one enqueued, and the slice may release its
//! buffer only once its program's last stage has ended. An algorithm that
//! strays from what it said fails the engine naming the slice, instead of
//! opening a stage whose bytes are not in place.
//!
//! [`LocalStep::device_items`]: crate::local::LocalStep::device_items

use std::ops::Range;

use fairring_core::plan::{Plan, Slice};
use fairring_rdma::fabric::Fabric;

use super::Engine;
use super::algorithm::{DeviceCopy, DeviceUse, Origins, Resolved, SliceAlgorithm, SliceInfo};
use super::work_table::Submission;
use crate::error::{Error, Result};
use crate::local::{LocalSlice, LocalStage, slice_range};
use crate::memory::MemorySpace;
use crate::memory::program::{self, ProgramItem, Stage, Stages, StagingAt};

/// A running device slice, held to its program.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SliceStages {
    /// What the slice's algorithm said it asks of the device.
    pub(crate) device_use: DeviceUse,
    /// The stages its program holds.
    pub(crate) stages: Stages,
    /// The copies of its copy-in and copy-out stages: enqueued, and asked
    /// for so far.
    expected: [Tally; 2],
    asked: [Tally; 2],
}

/// Copies counted, and an order-free digest of them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Tally {
    copies: u32,
    digest: u64,
}

impl Tally {
    /// Counts a copy between staging offset `staging` and bytes `tensor`.
    fn add(&mut self, staging: usize, tensor: &Range<usize>) {
        self.copies += 1;
        let key = mix(staging as u64)
            ^ mix(tensor.start as u64).rotate_left(21)
            ^ mix(tensor.end as u64).rotate_left(42);
        self.digest = self.digest.wrapping_add(mix(key));
    }
}

/// SplitMix64's finalizer: every input bit moves every output bit.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The index of an algorithm stage among the tallies.
fn tally_of(stage: Stage) -> Option<usize> {
    match stage {
        Stage::CopyIn => Some(0),
        Stage::CopyOut => Some(1),
        _ => None,
    }
}

impl SliceStages {
    /// The running slice asks for a copy of algorithm stage `stage`
    /// (copy-in or copy-out) between staging offset `staging` and bytes
    /// `tensor`: returns whether it is the stage's last, which opens it.
    /// Refused if the stage holds no more copies, or if the last leaves
    /// the copies asked for other than those enqueued.
    pub(crate) fn ask(
        &mut self,
        number: u64,
        stage: Stage,
        staging: usize,
        tensor: &Range<usize>,
    ) -> Result<bool> {
        let strayed = |what: String| {
            Error::internal(
                "a device slice asks for exactly the copies enqueued for it",
                format!("slice {number}: {what}"),
            )
        };
        let i = tally_of(stage)
            .ok_or_else(|| strayed(format!("a copy of its {} stage", stage.name())))?;
        let (expected, asked) = (self.expected[i], &mut self.asked[i]);
        if asked.copies >= expected.copies {
            return Err(strayed(format!(
                "{} copy {staging} <-> {tensor:?} past the {} enqueued",
                stage.name(),
                expected.copies
            )));
        }
        asked.add(staging, tensor);
        if asked.copies < expected.copies {
            return Ok(false);
        }
        if *asked != expected {
            return Err(strayed(format!(
                "its {} copies differ from those enqueued",
                stage.name()
            )));
        }
        Ok(true)
    }

    /// Refuses a local step the slice's program does not hold as asked.
    pub(crate) fn check_local(&self, number: u64, asked: LocalStage) -> Result<()> {
        let held = match asked {
            LocalStage::Begin => self.device_use.begin,
            LocalStage::ReduceScatter { final_world } => {
                self.device_use.reduce_scatter == Some(final_world)
            }
            LocalStage::AllGather { own_in_tensor, .. } => {
                self.device_use.all_gather == Some(own_in_tensor)
            }
        };
        if held {
            return Ok(());
        }
        Err(Error::internal(
            "a device slice runs the local step its program holds",
            format!(
                "slice {number} asked for {asked:?}; its program holds {:?}",
                self.device_use
            ),
        ))
    }
}

impl<F: Fabric, M: MemorySpace> Engine<F, M> {
    /// Calls `each` with operation `sub`'s device program, planned as
    /// `plan` from slice number `first` on: every slice's, in number order,
    /// then its delivery.
    pub(super) fn program(
        &self,
        sub: &Submission<M>,
        plan: &Plan,
        first: u64,
        each: &mut dyn FnMut(ProgramItem<M::Tensor>) -> Result<()>,
    ) -> Result<()> {
        // An operation of one slice without delivery whose last stage is
        // ungated ends there: its stream writes its done word.
        let alone = plan.slice_count() == 1 && sub.deliver.is_none();
        for i in 0..plan.slice_count() {
            let slice = plan.slice(i).map_err(|e| {
                Error::internal("every slice index below the count plans", e.to_string())
            })?;
            self.slice_program(sub, &slice, first + i, alone, each)?;
        }
        if let Some(delivery) = &sub.deliver {
            each(ProgramItem::Deliver {
                from: delivery.range.clone(),
                to: delivery.to,
            })?;
        }
        Ok(())
    }

    /// The running slice `number` of `sub`, held to its program.
    pub(super) fn slice_stages(
        &self,
        sub: &Submission<M>,
        slice: &Slice,
        number: u64,
    ) -> Result<SliceStages> {
        let (mut stages, mut expected) = (Stages::default(), [Tally::default(); 2]);
        let mut stage = None;
        // Stages and copies are the same whether or not the done word
        // follows, which this check does not count.
        let device_use = self.slice_program(sub, slice, number, false, &mut |item| {
            match item {
                ProgramItem::Stage { stage: s, .. } => {
                    stages = stages.with(s);
                    stage = Some(s);
                }
                ProgramItem::ToStaging { tensor, to } => {
                    tally(&mut expected, stage, to.offset, &tensor);
                }
                ProgramItem::FromStaging { from, tensor } => {
                    tally(&mut expected, stage, from.offset, &tensor);
                }
                _ => {}
            }
            Ok(())
        })?;
        Ok(SliceStages {
            device_use,
            stages,
            expected,
            asked: [Tally::default(); 2],
        })
    }

    fn device_info<'a>(&self, sub: &Submission<M>, slice: &'a Slice, number: u64) -> SliceInfo<'a> {
        SliceInfo {
            number,
            generation: number / u64::from(self.buffers),
            slice,
            dtype: sub.dtype(),
            op: sub.op(),
            wire: sub.wire(),
            origins: Origins::of(&sub.descriptor),
            direct: false,
            into_window: false,
        }
    }

    /// One slice's program: its start, each stage that has items behind its
    /// gate, its end. Where the slice is its operation's only one (`alone`:
    /// no delivery follows either) and its reduce-scatter stage is one
    /// all-reduce in the tensor ([`program::ungated`]), that stage waits for
    /// no gate and writes the operation's done word before its end; no stage
    /// may follow it. Returns what the slice's algorithm asks of the device.
    fn slice_program(
        &self,
        sub: &Submission<M>,
        slice: &Slice,
        number: u64,
        alone: bool,
        each: &mut dyn FnMut(ProgramItem<M::Tensor>) -> Result<()>,
    ) -> Result<DeviceUse> {
        let info = self.device_info(sub, slice, number);
        let device_use =
            SliceAlgorithm::device_use(sub.algorithm(), &self.context_for(sub.algorithm()), &info)?;
        let buffer = u32::try_from(number % u64::from(self.buffers)).unwrap_or(u32::MAX);
        let local = LocalSlice {
            buffer,
            number,
            slice,
            tensor: &sub.tensor,
            dtype: sub.dtype(),
            op: sub.op(),
            pieces: device_use.pieces,
            root: self.local_root(info.origins),
            stages: Stages::default(),
        };
        let ask = StageAsk {
            info: &info,
            device_use: &device_use,
            local: &local,
            algorithm: sub.algorithm(),
        };
        each(ProgramItem::Slice {
            buffer,
            generation: info.generation,
        })?;
        let mut done = false;
        for stage in Stage::ALL {
            // Whether the stage is the whole operation, one all-reduce in
            // the tensor, which waits for no gate: a first pass counts its
            // items, for the only slice of an operation without delivery.
            let (mut count, mut ungated) = (0_usize, false);
            if alone && stage == Stage::ReduceScatter {
                self.stage_items(stage, &ask, &mut |item| {
                    count += 1;
                    ungated = program::ungated(&item);
                    Ok(())
                })?;
            }
            let ungated = count == 1 && ungated;
            // A stage is in the program where it has items: it starts at
            // its first.
            let mut started = false;
            self.stage_items(stage, &ask, &mut |item| {
                if !started {
                    if done {
                        return Err(Error::internal(
                            "an operation's done word follows its program's last stage",
                            format!("slice {number}: its {} stage after it", stage.name()),
                        ));
                    }
                    started = true;
                    each(ProgramItem::Stage {
                        stage,
                        gated: !ungated,
                    })?;
                }
                each(item)
            })?;
            if started {
                if ungated {
                    done = true;
                    each(ProgramItem::Done)?;
                }
                each(ProgramItem::StageEnd)?;
            }
        }
        each(ProgramItem::SliceEnd)?;
        Ok(device_use)
    }

    /// What `stage` of a slice does on the device.
    fn stage_items(
        &self,
        stage: Stage,
        ask: &StageAsk<'_, '_, M>,
        each: &mut dyn FnMut(ProgramItem<M::Tensor>) -> Result<()>,
    ) -> Result<()> {
        let StageAsk {
            info,
            device_use,
            local,
            algorithm,
        } = *ask;
        let base = slice_range(info.slice)?.start;
        let own = |offset| StagingAt {
            rank: self.links.location.device,
            buffer: local.buffer,
            offset,
        };
        let in_tensor = |r: &Range<usize>| base + r.start..base + r.end;
        let ctx = self.context_for(algorithm);
        match stage {
            Stage::Begin if device_use.begin => {
                self.local.device_items(local, LocalStage::Begin, each)
            }
            Stage::ReduceScatter => match device_use.reduce_scatter {
                Some(final_world) => {
                    let asked = LocalStage::ReduceScatter { final_world };
                    self.local.device_items(local, asked, each)
                }
                None => Ok(()),
            },
            Stage::CopyIn => {
                SliceAlgorithm::device_copies(algorithm, &ctx, info, &mut |c| match c {
                    DeviceCopy::In { to, from } => each(ProgramItem::ToStaging {
                        tensor: in_tensor(&from),
                        to: own(to),
                    }),
                    DeviceCopy::Out { .. } => Ok(()),
                })
            }
            Stage::CopyOut => {
                SliceAlgorithm::device_copies(algorithm, &ctx, info, &mut |c| match c {
                    DeviceCopy::Out { from, to } => each(ProgramItem::FromStaging {
                        from: own(from),
                        tensor: in_tensor(&to),
                    }),
                    DeviceCopy::In { .. } => Ok(()),
                })
            }
            Stage::AllGather => match device_use.all_gather {
                Some(own_in_tensor) => {
                    let asked = LocalStage::AllGather {
                        final_world: device_use.reduce_scatter.flatten(),
                        own_in_tensor,
                    };
                    self.local.device_items(local, asked, each)
                }
                None => Ok(()),
            },
            Stage::Begin => Ok(()),
        }
    }
}

/// What one slice's stages are enumerated from.
struct StageAsk<'s, 'a, M: MemorySpace> {
    info: &'s SliceInfo<'a>,
    device_use: &'s DeviceUse,
    local: &'s LocalSlice<'a, M>,
    algorithm: Resolved,
}

/// Counts an algorithm stage's copy into `tallies`.
fn tally(tallies: &mut [Tally; 2], stage: Option<Stage>, staging: usize, tensor: &Range<usize>) {
    if let Some(i) = stage.and_then(tally_of) {
        tallies[i].add(staging, tensor);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(expected: &[(usize, Range<usize>)]) -> SliceStages {
        let mut t = Tally::default();
        for (s, r) in expected {
            t.add(*s, r);
        }
        SliceStages {
            device_use: DeviceUse::default(),
            stages: Stages::default().with(Stage::CopyOut),
            expected: [Tally::default(), t],
            asked: [Tally::default(); 2],
        }
    }

    #[test]
    fn copies_open_their_stage_once_all_are_asked_for_in_any_order() {
        let mut h = held(&[(0, 0..64), (64, 64..128), (128, 128..130)]);
        assert!(!h.ask(7, Stage::CopyOut, 128, &(128..130)).unwrap());
        assert!(!h.ask(7, Stage::CopyOut, 0, &(0..64)).unwrap());
        assert!(h.ask(7, Stage::CopyOut, 64, &(64..128)).unwrap());
        let e = h
            .ask(7, Stage::CopyOut, 0, &(0..64))
            .unwrap_err()
            .to_string();
        assert!(e.contains("slice 7") && e.contains("past the 3"), "{e}");
    }

    #[test]
    fn a_copy_other_than_those_enqueued_is_refused() {
        let mut h = held(&[(0, 0..64), (64, 64..128)]);
        assert!(!h.ask(3, Stage::CopyOut, 0, &(0..64)).unwrap());
        let e = h
            .ask(3, Stage::CopyOut, 64, &(64..127))
            .unwrap_err()
            .to_string();
        assert!(e.contains("differ"), "{e}");
        let mut h = held(&[(0, 0..64)]);
        let e = h
            .ask(3, Stage::CopyIn, 0, &(0..64))
            .unwrap_err()
            .to_string();
        assert!(e.contains("copy-in copy"), "{e}");
        let e = h
            .ask(3, Stage::AllGather, 0, &(0..64))
            .unwrap_err()
            .to_string();
        assert!(e.contains("local all-gather"), "{e}");
    }

    #[test]
    fn local_steps_must_be_the_ones_enqueued() {
        let h = SliceStages {
            device_use: DeviceUse::local(None, false),
            stages: Stages::default(),
            expected: [Tally::default(); 2],
            asked: [Tally::default(); 2],
        };
        assert!(h.check_local(1, LocalStage::Begin).is_ok());
        let rs = LocalStage::ReduceScatter { final_world: None };
        assert!(h.check_local(1, rs).is_ok());
        let final_rs = LocalStage::ReduceScatter {
            final_world: Some(4),
        };
        assert!(h.check_local(1, final_rs).is_err());
        let ag = |own_in_tensor| LocalStage::AllGather {
            final_world: None,
            own_in_tensor,
        };
        assert!(h.check_local(1, ag(false)).is_ok());
        assert!(h.check_local(1, ag(true)).is_err());
    }
}
