//! Property tests of the balanced-fusion-buffer planner.

use fairring_core::fusion::{Position, plan_fusion};
use proptest::prelude::*;

prop_compose! {
    fn case()(align_log in 0u32..=7, buffer_mult in 1u64..=64,
              sizes in prop::collection::vec(prop_oneof![1 => Just(0u64), 8 => 0u64..5000], 0..60))
        -> (Vec<u64>, u64, u64)
    {
        let align = 1u64 << align_log;
        // Buffers of 128 B to 8 KiB: a multiple of every alignment tried.
        (sizes, buffer_mult * 128, align)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn placement_is_dense_aligned_and_balanced((sizes, buffer, align) in case()) {
        let mut pos = vec![Position::default(); sizes.len()];
        let plan = plan_fusion(&sizes, buffer, align, &mut pos).unwrap();
        let global = |p: &Position| p.buffer * buffer + p.offset;
        let mut end = 0u64;
        for (i, (p, &s)) in pos.iter().zip(&sizes).enumerate() {
            let g = global(p);
            prop_assert!(p.offset < buffer);
            prop_assert_eq!(g % align, 0, "tensor {} unaligned", i);
            // Placed right after the previous tensor, rounded up to the alignment.
            prop_assert_eq!(g, end.next_multiple_of(align), "tensor {} not packed", i);
            end = g + s;
            // Its pieces cover it exactly, each inside one buffer's used bytes.
            let mut covered = 0;
            for piece in plan.pieces(*p, s) {
                prop_assert_eq!(piece.tensor_offset, covered);
                prop_assert!(piece.len > 0);
                prop_assert_eq!(piece.buffer * buffer + piece.offset, g + covered);
                prop_assert!(piece.offset + piece.len <= plan.buffer_len(piece.buffer));
                covered += piece.len;
            }
            prop_assert_eq!(covered, s);
        }
        // Every buffer but the last is full; the last holds the rest.
        let total: u64 = pos.iter().zip(&sizes).filter(|(_, s)| **s > 0).map(|(p, s)| global(p) + s).max().unwrap_or(0);
        prop_assert_eq!(plan.buffers(), total.div_ceil(buffer));
        for b in 0..plan.buffers() {
            let want = if b + 1 < plan.buffers() { buffer } else { total - b * buffer };
            prop_assert_eq!(plan.buffer_len(b), want);
        }
        prop_assert_eq!(plan.buffer_len(plan.buffers()), 0);
        // `tensors_in` names exactly the non-empty tensors with bytes in the buffer
        // (empty tensors between them may be included). Checked on the first, last
        // and a spread of buffers.
        let buffers = plan.buffers();
        let step = (buffers / 16).max(1);
        for b in (0..buffers).step_by(step as usize).chain(buffers.checked_sub(1)) {
            let range = plan.tensors_in(b, &sizes, &pos);
            for (i, (p, &s)) in pos.iter().zip(&sizes).enumerate() {
                let g = global(p);
                let touches = s > 0 && g / buffer <= b && b <= (g + s - 1) / buffer;
                if touches {
                    prop_assert!(range.contains(&i), "buffer {} misses tensor {}", b, i);
                } else if range.contains(&i) {
                    prop_assert_eq!(s, 0, "buffer {} claims tensor {}", b, i);
                }
            }
        }
    }

    /// The same sizes give the same placement, whatever the output held before: no
    /// rank can disagree.
    #[test]
    fn deterministic((sizes, buffer, align) in case(), junk in any::<u64>()) {
        let mut a = vec![Position::default(); sizes.len()];
        let mut b = vec![Position { buffer: junk, offset: junk }; sizes.len() + 3];
        let pa = plan_fusion(&sizes, buffer, align, &mut a).unwrap();
        let pb = plan_fusion(&sizes, buffer, align, &mut b).unwrap();
        prop_assert_eq!(pa, pb);
        prop_assert_eq!(&a[..], &b[..sizes.len()]);
    }
}
