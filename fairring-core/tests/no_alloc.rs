//! fairring-core never allocates: a counting global allocator sees no allocation
//! across topology detection, planning a tensor and walking every cell (and a
//! tensor as one slice, both trees of a double binary tree, and machines in
//! groups with the intervals of a slot and every machine's roles and areas in
//! its two levels), a whole
//! slice through the staging state machine, frame round trips and validation,
//! reductions, fusion planning and formatting every kind of error.
//!
//! Counting is armed and tallied per thread, so allocations on other threads (the
//! harness, or another test of this file running in parallel) never count.

use fairring_core::fusion::{Position, plan_fusion};
use fairring_core::plan::{
    DoubleTree, Geometry, MachineGroups, Plan, PlanConfig, TREES, TwoLevelLayout,
};
use fairring_core::reduce;
use fairring_core::staging::{Event, StagingState};
use fairring_core::topology::{Location, RankLayout, Topology};
use fairring_core::wire::{FrameCheck, FrameHeader, FrameKind};
use fairring_core::{DataType, ReduceOp};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::fmt::Write;

struct Counting;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static ALLOCATIONS: Cell<usize> = const { Cell::new(0) };
}

fn count() {
    if ARMED.try_with(Cell::get).unwrap_or(false) {
        let _ = ALLOCATIONS.try_with(|n| n.set(n.get() + 1));
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments unchanged,
// so `System`'s guarantees are ours; counting touches only const-initialised
// thread-locals, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: forwarded unchanged; the caller upholds `alloc`'s contract.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: forwarded unchanged; the caller upholds `alloc_zeroed`'s contract.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: forwarded unchanged; `ptr` came from this allocator, which is `System`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged; `ptr` came from this allocator, which is `System`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Runs `f` with counting armed on this thread; returns the allocations it made.
fn allocations_in(f: impl FnOnce()) -> usize {
    let before = ALLOCATIONS.with(Cell::get);
    ARMED.with(|a| a.set(true));
    f();
    ARMED.with(|a| a.set(false));
    ALLOCATIONS.with(Cell::get) - before
}

/// A formatter target on the stack, so that formatting errors allocates nothing.
struct StackText {
    buf: [u8; 512],
    len: usize,
}

impl Write for StackText {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let end = (self.len + s.len()).min(self.buf.len());
        self.buf[self.len..end].copy_from_slice(&s.as_bytes()[..end - self.len]);
        self.len = end;
        Ok(())
    }
}

#[test]
fn the_counter_counts() {
    // The test must be able to fail: an allocation inside the armed region is seen.
    let n = allocations_in(|| drop(std::hint::black_box(vec![1u8; 64])));
    assert_eq!(n, 1);
}

#[test]
fn core_work_allocates_nothing() {
    let (mut dst, src_a, src_b) = (vec![1.0f32; 5000], vec![2.0f32; 5000], vec![3.0f32; 5000]);
    let (mut half_dst, half_src) = (vec![half::bf16::ONE; 3000], vec![half::bf16::ONE; 3000]);
    let mut byte_dst = vec![0u64; 512];
    let byte_src = vec![7u64; 512];
    let mut positions = [Position::default(); 8];
    let mut text = StackText {
        buf: [0; 512],
        len: 0,
    };
    let mut checked_cells = 0u64;

    let n = allocations_in(|| {
        // Topology.
        let machines = [0u32, 0, 1, 1, 2, 2];
        let topo = Topology::detect(&machines).unwrap();
        let _ = write!(text, "{}", Topology::detect(&[0, 0, 1]).unwrap_err());
        let big = Topology::new(3, 2, RankLayout::Contiguous).unwrap();
        assert_eq!(topo, big);

        // A plan of several slices, every cell of every slice, every role.
        let config = PlanConfig::new(1 << 16, 1 << 10).unwrap();
        let g = Geometry::new(topo, config).unwrap();
        let plan = Plan::new(&g, DataType::F16, 300_001, 5).unwrap();
        for slice in plan.slices() {
            for cell in slice.cells() {
                checked_cells += cell.span().len();
                let _ = plan.locate(cell.span().offset()).unwrap();
            }
            for machine in 0..3 {
                for device in 0..2 {
                    let _ = slice.role(Location { machine, device }).unwrap();
                }
            }
        }
        let _ = write!(text, "{}", plan.slice(u64::MAX).unwrap_err());

        // A tensor as one slice on one machine, and its refusal across machines.
        let one =
            Geometry::new(Topology::new(1, 4, RankLayout::Contiguous).unwrap(), config).unwrap();
        let whole = Plan::whole(&one, DataType::F32, 1 << 30).unwrap();
        assert_eq!(whole.slice_count(), 1);
        let _ = write!(text, "{}", Plan::whole(&g, DataType::F32, 1).unwrap_err());

        // Both trees over a few hundred machines, and a refusal.
        let trees = DoubleTree::new(300).unwrap();
        for tree in 0..TREES {
            for machine in 0..300 {
                let _ = trees.parent(tree, machine).unwrap();
                let _ = trees.children(tree, machine).unwrap();
            }
        }
        let _ = write!(text, "{}", trees.root(TREES).unwrap_err());

        // Machines in groups of unequal size: every machine located, every
        // interval of a slot held once per group and cut into its pieces,
        // and a refusal.
        let groups = MachineGroups::new(255, 64).unwrap();
        for machine in 0..255 {
            let at = groups.locate(machine).unwrap();
            let _ = groups.range(1 << 16, at.group, at.member).unwrap();
            let roles = groups.roles(1 << 16, machine).unwrap();
            for across in roles.across() {
                let _ = roles.across_at(across.interval.start).unwrap();
            }
        }
        for interval in groups.intervals(1 << 16) {
            for group in 0..groups.groups() {
                let _ = groups.holder(1 << 16, group, interval.start).unwrap();
                let _ = groups.piece(&interval, group).unwrap();
            }
        }
        let _ = write!(text, "{}", MachineGroups::new(255, 1).unwrap_err());
        let _ = write!(text, "{}", groups.size(4).unwrap_err());
        let _ = write!(text, "{}", groups.machine(3, 63).unwrap_err());
        let _ = write!(text, "{}", groups.holder(8, 0, 8).unwrap_err());
        let _ = write!(text, "{}", groups.roles(8, 255).unwrap_err());
        let layout = TwoLevelLayout::new(groups, 1 << 16, 1 << 16).unwrap();
        for machine in 1..255 {
            let _ = layout.within(machine, 0);
            let _ = layout.across(1, machine, 0);
        }
        let _ = write!(text, "{}", layout.within(200, 0).unwrap_err());
        let _ = write!(text, "{}", layout.across(0, 1, 0).unwrap_err());
        let _ = write!(text, "{}", layout.across(2, 200, 0).unwrap_err());
        let _ = write!(
            text,
            "{}",
            TwoLevelLayout::new(groups, u64::MAX, 0).unwrap_err()
        );

        // A whole slice through the staging state machine, as a server on machine 0.
        let slice = plan.slice(0).unwrap();
        let me = Location {
            machine: slice.server(0, 0).unwrap(),
            device: 0,
        };
        let role = slice.role(me).unwrap();
        let state = StagingState::new();
        state.acquire(0, role).unwrap();
        let step = |e: Event| state.on_event(e, 0).unwrap();
        step(Event::ReduceScatterDone);
        for _ in 0..role.contributions_to_send {
            step(Event::ContributionSent);
        }
        for _ in 0..role.contributions_to_receive {
            step(Event::ContributionReceived);
        }
        if role.reduces {
            step(Event::Reduced);
        }
        for _ in 0..role.results_to_send {
            step(Event::ResultSent);
        }
        for _ in 0..role.results_to_receive {
            step(Event::ResultReceived);
        }
        step(Event::AllGatherDone);
        assert!(!state.load().in_use());
        let _ = write!(
            text,
            "{}",
            state.on_event(Event::AllGatherDone, 0).unwrap_err()
        );

        // Frames: encode, decode, validate; refusals formatted.
        let cell = slice.cell(0, 0).unwrap();
        let server_rank = topo
            .rank(Location {
                machine: cell.server(),
                device: 0,
            })
            .unwrap();
        let client_rank = topo
            .rank(Location {
                machine: (cell.server() + 1) % 3,
                device: 0,
            })
            .unwrap();
        let header =
            FrameHeader::for_cell(FrameKind::Contribution, 9, 1, &cell, 0, client_rank).unwrap();
        let bytes = header.encode();
        let decoded = FrameHeader::decode(&bytes).unwrap();
        let check = FrameCheck::new(9, server_rank, &g).unwrap();
        let placement = check.check_data(&decoded, &plan).unwrap();
        assert_eq!(placement.target.byte_len(), cell.span().byte_len());
        let mut bad = bytes;
        bad[20] ^= 1;
        let _ = write!(text, "{}", FrameHeader::decode(&bad).unwrap_err());

        // Reductions: typed, many sources, bytes, average, a refusal.
        reduce::reduce(ReduceOp::Sum, &mut dst, &src_a).unwrap();
        reduce::reduce_many(ReduceOp::Max, &mut dst, &[&src_a, &src_b]).unwrap();
        reduce::reduce_many(ReduceOp::Sum, &mut half_dst, &[&half_src, &half_src]).unwrap();
        reduce::finish_avg(&mut dst, 3).unwrap();
        let d: &mut [u8] = bytemuck::cast_slice_mut(&mut byte_dst);
        let s: &[u8] = bytemuck::cast_slice(&byte_src);
        reduce::reduce_bytes(DataType::I64, ReduceOp::Sum, d, s).unwrap();
        let _ = write!(
            text,
            "{}",
            reduce::reduce_bytes(DataType::I64, ReduceOp::Avg, d, s).unwrap_err()
        );

        // Fusion.
        let sizes = [100u64, 0, 4000, 64, 9000, 1, 2, 3];
        let fusion = plan_fusion(&sizes, 4096, 64, &mut positions).unwrap();
        for (p, &size) in positions.iter().zip(&sizes) {
            for piece in fusion.pieces(*p, size) {
                assert!(piece.len > 0);
            }
        }
        let _ = fusion.tensors_in(1, &sizes, &positions);
    });
    assert_eq!(n, 0, "fairring-core allocated {n} times");
    // The work was real.
    assert_eq!(checked_cells, 300_001);
    // (1 + 2), then max(3, 2, 3), then / 3.
    assert_eq!(dst[0], 1.0);
    assert_eq!(half_dst[0], half::bf16::from_f32(3.0));
    assert_eq!(byte_dst[0], 7);
    assert!(text.len > 0);
}
