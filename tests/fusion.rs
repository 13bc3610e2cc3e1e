//! Balanced fusion buffers: tensors handed over in a different order on every
//! rank land at the same place everywhere (the order rank 0 saw first), and fused
//! all-reduces are exact, with and without dedicated servers.
#![expect(clippy::cast_possible_truncation, reason = "test values are small")]

mod common;

use common::{Rng, job_with_servers};
use fairring::{Fusion, ReduceOp};
use proptest::prelude::*;

/// Rank `rank`'s element `i` of tensor `k` in step `step`: small integers, exact
/// in f32 whatever the order of summation.
fn value(rank: u32, step: usize, k: usize, i: usize) -> f32 {
    ((rank as usize * 5 + step * 11 + k * 7 + i * 3) % 41) as f32 - 20.0
}

/// A permutation of `0..n` from `seed`.
fn shuffled(n: usize, seed: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng = Rng(seed | 1);
    for i in (1..n).rev() {
        order.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }
    order
}

/// Three steps of a `Fusion` on an `m x d (+ servers)` job, every rank handing its
/// tensors over in its own order each step; checks every result and returns each
/// rank's placement.
fn steps(m: u32, d: u32, servers: u32, sizes: &[usize], buffer_bytes: usize, seed: u64) {
    let world = m * d;
    let placements = job_with_servers(
        m,
        d,
        servers,
        |b| {
            b.slice_bytes(64 << 10)
                .min_shard_bytes(4 << 10)
                .total_memory(1 << 20)
        },
        |rank, comm| {
            let mut fusion = Fusion::<f32>::new(sizes, buffer_bytes).expect("fusion");
            for step in 0..3 {
                let mut tensors: Vec<Vec<f32>> = sizes
                    .iter()
                    .enumerate()
                    .map(|(k, &n)| (0..n).map(|i| value(rank, step, k, i)).collect())
                    .collect();
                let order = shuffled(sizes.len(), seed ^ u64::from(rank) << 20 ^ step as u64);
                let mut views: Vec<Option<&mut [f32]>> =
                    tensors.iter_mut().map(|t| Some(t.as_mut_slice())).collect();
                let handed: Vec<(usize, &mut [f32])> = order
                    .iter()
                    .map(|&k| (k, views[k].take().expect("each once")))
                    .collect();
                fusion
                    .all_reduce(comm, handed, ReduceOp::Sum)
                    .unwrap_or_else(|e| panic!("rank {rank}, step {step}: {e}"));
                for (k, t) in tensors.iter().enumerate() {
                    for (i, &v) in t.iter().enumerate() {
                        let want: f32 = (0..world).map(|r| value(r, step, k, i)).sum();
                        assert_eq!(v, want, "rank {rank}, step {step}, tensor {k}, element {i}");
                    }
                }
            }
            let placement: Vec<_> = (0..sizes.len()).map(|k| fusion.position(k)).collect();
            (placement, fusion.buffers())
        },
    );
    // Rank 0's first order decides: every rank has its placement.
    let first = shuffled(sizes.len(), seed);
    let (placement0, buffers0) = &placements[0];
    let mut at = 0usize;
    for &k in &first {
        let (b, off) = placement0[k].expect("placed");
        assert_eq!(
            b as usize * (buffer_bytes / 4) + off as usize,
            at,
            "tensor {k} follows rank 0's order"
        );
        at += sizes[k];
    }
    assert_eq!(*buffers0, at.div_ceil(buffer_bytes / 4));
    for (rank, p) in placements.iter().enumerate() {
        assert_eq!(
            p, &placements[0],
            "rank {rank} placed differently from rank 0"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(6))]

    #[test]
    fn out_of_order_tensors_are_placed_alike_on_every_rank(
        sizes in prop::collection::vec(0usize..3000, 1..30),
        buffer_elements in 64usize..4096,
        seed in any::<u64>(),
        layout in 0usize..3,
    ) {
        let (m, d, servers) = [(1, 2, 0), (2, 1, 0), (2, 1, 1)][layout];
        steps(m, d, servers, &sizes, buffer_elements * 4, seed);
    }
}

/// 100 tensors from one element to about 1 MiB, as a DDP gradient list.
fn gradient_sizes() -> Vec<usize> {
    let mut rng = Rng(0x5eed);
    (0..100)
        .map(|k| match k % 10 {
            0 => 1 + (rng.next() % 7) as usize,
            1..=6 => 256 + (rng.next() % 4096) as usize,
            _ => 16_384 + (rng.next() % 250_000) as usize,
        })
        .collect()
}

#[test]
fn coalesced_all_reduce_of_a_hundred_mixed_tensors_is_exact() {
    let sizes = gradient_sizes();
    for (m, d, servers) in [(2, 2, 0), (2, 1, 2), (1, 2, 1)] {
        let world = m * d;
        job_with_servers(
            m,
            d,
            servers,
            |b| b.total_memory(16 << 20),
            |rank, comm| {
                let mut tensors: Vec<Vec<f32>> = sizes
                    .iter()
                    .enumerate()
                    .map(|(k, &n)| (0..n).map(|i| value(rank, 0, k, i)).collect())
                    .collect();
                let mut views: Vec<&mut [f32]> =
                    tensors.iter_mut().map(Vec::as_mut_slice).collect();
                comm.all_reduce_fused(&mut views, ReduceOp::Sum)
                    .unwrap_or_else(|e| panic!("{m}x{d}+{servers}: rank {rank}: {e}"));
                for (k, t) in tensors.iter().enumerate() {
                    let wrong = t
                        .iter()
                        .enumerate()
                        .filter(|&(i, &v)| v != (0..world).map(|r| value(r, 0, k, i)).sum::<f32>())
                        .count();
                    assert_eq!(wrong, 0, "{m}x{d}+{servers}: rank {rank}, tensor {k}");
                }
            },
        );
    }
}

#[test]
fn a_fusion_refuses_tensors_it_was_not_declared_with() {
    job_with_servers(
        1,
        1,
        0,
        |b| b,
        |_, comm| {
            let mut f = Fusion::<f32>::new(&[4, 8], 1024).expect("fusion");
            let mut a = [0f32; 4];
            let mut b = [0f32; 7];
            let e = f
                .all_reduce(comm, [(0, &mut a[..]), (1, &mut b[..])], ReduceOp::Sum)
                .expect_err("a tensor of the wrong length");
            assert!(
                e.to_string()
                    .contains("tensor 1 has 7 elements, declared 8"),
                "{e}"
            );
            let e = f
                .all_reduce(comm, [(0, &mut a[..])], ReduceOp::Sum)
                .expect_err("a missing tensor");
            assert!(e.to_string().contains("1 of 2 tensors"), "{e}");
            assert!(
                Fusion::<f64>::new(&[1], 4).is_err(),
                "a buffer smaller than an element"
            );
        },
    );
}
