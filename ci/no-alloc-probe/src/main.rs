//! A bare-metal program that uses every module of fairring-core and links without
//! an allocator. Linking fails ("no global memory allocator found but one is
//! required") if `alloc` is anywhere in fairring-core's dependency graph, used or
//! not. Built for `thumbv7em-none-eabihf` (no 64-bit atomics: `StagingState` is
//! absent there) and `riscv64imac-unknown-none-elf` (with them).
#![no_std]
#![no_main]

use core::hint::black_box;
use core::panic::PanicInfo;
use fairring_core::fusion::{Position, plan_fusion};
use fairring_core::plan::{Geometry, Plan, PlanConfig};
use fairring_core::reduce;
use fairring_core::staging::{Event, Role, Word};
use fairring_core::topology::{RankLayout, Topology};
use fairring_core::wire::{FrameHeader, FrameKind};
use fairring_core::{DataType, ReduceOp};

#[panic_handler]
fn panic(_: &PanicInfo<'_>) -> ! {
    loop {}
}

fn exercise() -> u64 {
    let Ok(topology) = Topology::new(black_box(4), black_box(8), RankLayout::Contiguous) else {
        return 0;
    };
    let Ok(geometry) = Geometry::new(topology, PlanConfig::DEFAULT) else {
        return 0;
    };
    let Ok(plan) = Plan::new(&geometry, DataType::BF16, black_box(1 << 24), 0) else {
        return 0;
    };
    let mut total = 0;
    for slice in plan.slices() {
        for cell in slice.cells() {
            total += cell.span().byte_len();
        }
    }
    let Ok(word) = Word::FREE.acquire(0, Role::IDLE) else {
        return 0;
    };
    if let Ok((word, _)) = word.on_event(Event::ReduceScatterDone, 0) {
        total += word.to_bits();
    }
    #[cfg(target_has_atomic = "64")]
    {
        let state = fairring_core::staging::StagingState::new();
        let _ = state.acquire(0, Role::IDLE);
        let _ = black_box(state.on_event(Event::ReduceScatterDone, 0));
    }
    if let Ok(cell) = plan.slice(0).and_then(|s| s.cell(0, 0)) {
        if let Ok(header) = FrameHeader::for_cell(FrameKind::Contribution, 1, 2, &cell, 0, 3) {
            let bytes = header.encode();
            if FrameHeader::decode(black_box(&bytes)).is_ok() {
                total += 1;
            }
        }
    }
    let mut dst = [1.0f32; 64];
    let src = [2.0f32; 64];
    if reduce::reduce(ReduceOp::Sum, &mut dst, black_box(&src)).is_ok() {
        total += dst[0] as u64;
    }
    let mut positions = [Position::default(); 3];
    if let Ok(fused) = plan_fusion(black_box(&[10, 20, 30]), 64, 8, &mut positions) {
        total += fused.buffers();
    }
    total
}

/// The entry point: keeps `exercise` and everything it calls in the binary.
#[unsafe(no_mangle)]
pub extern "C" fn _start() -> ! {
    black_box(exercise());
    loop {}
}
