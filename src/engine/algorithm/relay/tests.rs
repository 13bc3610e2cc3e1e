use fairring_core::plan::{Geometry, Plan, PlanConfig};
use fairring_core::topology::{RankLayout, Topology};
use fairring_core::{DataType, ReduceOp, WireFormat};

use super::*;
use crate::engine::layout::BufferLayout;

/// Runs `f` on rank `rank` of a 3x1 job, on the first slice of a relayed
/// `u8` operation of `bytes` with `origins` (slices of 4 KiB: chunks of 256).
fn on_rank(rank: u32, bytes: u64, origins: Origins, f: impl FnOnce(&Context<'_>, &SliceInfo<'_>)) {
    on_rank_of((3, 1), rank, bytes, origins, f);
}

/// [`on_rank`] on an `m x d` job.
fn on_rank_of(
    (m, d): (u32, u32),
    rank: u32,
    bytes: u64,
    origins: Origins,
    f: impl FnOnce(&Context<'_>, &SliceInfo<'_>),
) {
    let topology = Topology::new(m, d, RankLayout::Contiguous).unwrap();
    let geometry = Geometry::new(topology, PlanConfig::new(4096, 64).unwrap()).unwrap();
    let layout = BufferLayout::new(&geometry, m * d).unwrap();
    let plan = Plan::new(&geometry, DataType::U8, bytes, 0).unwrap();
    let slice = plan.slice(0).unwrap();
    let ctx = Context {
        topology,
        location: topology.locate(rank).unwrap(),
        rank,
        world: m * d,
        layout: &layout,
        servers: 0,
        server: None,
    };
    let s = SliceInfo {
        number: 0,
        generation: 0,
        slice: &slice,
        dtype: DataType::U8,
        op: ReduceOp::Sum,
        wire: WireFormat::Exact,
        origins: Some(origins),
        direct: false,
        into_window: false,
    };
    f(&ctx, &s);
}

fn writes(steps: &[Step]) -> Vec<Range<usize>> {
    steps
        .iter()
        .filter_map(|s| match s {
            Step::Write(w) => Some(w.source.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn a_chunk_that_lands_before_the_own_piece_is_staged_waits_for_it() {
    // All-gather of 3 x 1000 bytes: rank 1 owns 1000..2000 (4 chunks of
    // 256, the last short) and first receives rank 0's 0..1000.
    on_rank(1, 3000, Origins::Blocks(1000), |ctx, s| {
        let mut steps = Vec::new();
        let mut relay = Relay::start(ctx, s, &mut steps).unwrap();
        assert_eq!(
            steps,
            [Step::StageIn {
                to: 1000,
                from: 1000..2000
            }]
        );
        steps.clear();
        let landed = SliceEvent::Landed {
            kind: Kind::Relay,
            peer: 0,
            part: 0,
        };
        relay.on_event(ctx, s, landed, &mut steps).unwrap();
        assert!(steps.is_empty(), "{steps:?}");
        relay
            .on_event(ctx, s, SliceEvent::Staged, &mut steps)
            .unwrap();
        // A sixteenth of the largest slice (4 KiB, rounded to the layout).
        let c = usize::try_from(relay.chunk).unwrap();
        assert!((240..=256).contains(&c), "{c}");
        // The own chunks leave first, then the landed chunk of rank 0 goes on
        // (rank 2 is not its origin's predecessor) and into the tensor.
        assert_eq!(
            writes(&steps),
            [
                1000..1000 + c,
                1000 + c..1000 + 2 * c,
                1000 + 2 * c..1000 + 3 * c,
                1000 + 3 * c..2000,
                0..c
            ]
        );
        assert!(steps.contains(&Step::CopyOut { from: 0, to: 0..c }));
        assert_eq!(relay.expected, 8);
    });
}

#[test]
fn the_last_rank_of_a_chain_keeps_what_lands() {
    // A broadcast from rank 1: rank 0 is the last of the chain 1 -> 2 -> 0.
    on_rank(0, 600, Origins::Rank(1), |ctx, s| {
        let mut steps = Vec::new();
        let mut relay = Relay::start(ctx, s, &mut steps).unwrap();
        assert!(steps.is_empty(), "{steps:?}");
        for _ in 0..3 {
            let landed = SliceEvent::Landed {
                kind: Kind::Relay,
                peer: 2,
                part: 0,
            };
            relay.on_event(ctx, s, landed, &mut steps).unwrap();
        }
        assert!(writes(&steps).is_empty(), "{steps:?}");
        let copies = steps
            .iter()
            .filter(|s| matches!(s, Step::CopyOut { .. }))
            .count();
        assert_eq!(copies, 3);
        // A fourth chunk is one too many, and a chunk from rank 1 comes from
        // the wrong side.
        for peer in [2, 1] {
            let landed = SliceEvent::Landed {
                kind: Kind::Relay,
                peer,
                part: 0,
            };
            assert!(relay.on_event(ctx, s, landed, &mut steps).is_err());
        }
        steps.clear();
        for _ in 0..3 {
            relay
                .on_event(ctx, s, SliceEvent::CopiedOut, &mut steps)
                .unwrap();
        }
        assert_eq!(steps, [Step::LocalFinish, Step::Release]);
    });
}

#[test]
fn over_the_machines_a_rail_relays_its_slot_through_the_receive_area() {
    // A broadcast of 2000 bytes from rank 0 on 2x2: rank 2 (machine 1,
    // device 0) hears from rank 0 on its rail, about its slot 0.
    on_rank_of((2, 2), 2, 2000, Origins::Rank(0), |ctx, s| {
        let mut steps = Vec::new();
        let mut relay = Relay::start(ctx, s, &mut steps).unwrap();
        assert_eq!(
            steps,
            [
                Step::LocalBegin,
                Step::LocalReduceScatter { final_world: None }
            ]
        );
        steps.clear();
        let slot = s
            .slice
            .slot(0)
            .unwrap()
            .byte_range_in(s.slice.span())
            .unwrap();
        let inbox = ctx.layout.slice_bytes();
        // The rank on the same device of the other machine writes; the
        // other device of that machine does not.
        let from = |peer| SliceEvent::Landed {
            kind: Kind::Relay,
            peer,
            part: 0,
        };
        assert!(relay.on_event(ctx, s, from(1), &mut steps).is_err());
        relay.on_event(ctx, s, from(0), &mut steps).unwrap();
        // It waits for the machine's reduce-scatter, which writes the slot.
        assert!(steps.is_empty(), "{steps:?}");
        relay
            .on_event(ctx, s, SliceEvent::LocalReduceScatterDone, &mut steps)
            .unwrap();
        // Rank 2 is the chain's last: the chunk goes into the slot from the
        // receive area, and nowhere else.
        assert!(writes(&steps).is_empty(), "{steps:?}");
        let c = usize::try_from(relay.chunk).unwrap().min(slot.len());
        assert!(
            steps.iter().any(|step| matches!(step, Step::Reduce(r)
                if r.dst == (slot.start..slot.start + c)
                    && r.sources.ranges().eq(std::iter::once(inbox..inbox + c)))),
            "{steps:?}"
        );
        steps.clear();
        let chunks = usize::try_from(relay.expected).unwrap();
        for _ in 1..chunks {
            relay.on_event(ctx, s, from(0), &mut steps).unwrap();
        }
        for _ in 0..chunks {
            relay
                .on_event(ctx, s, SliceEvent::Reduced, &mut steps)
                .unwrap();
        }
        assert_eq!(
            steps
                .iter()
                .filter(|s| matches!(s, Step::PublishSlot))
                .count(),
            1,
            "{steps:?}"
        );
        assert!(!steps.contains(&Step::Release));
        steps.clear();
        relay
            .on_event(ctx, s, SliceEvent::LocalAllGatherDone, &mut steps)
            .unwrap();
        assert_eq!(steps, [Step::Release]);
    });
}
