//! Plan arithmetic: making a plan, planning one slice, locating an element.
//!
//! "Planning a slice" is what the engine does for every slice it starts: the slice,
//! this device's role in it, and the cells of its slot it sends.

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use fairring_core::DataType;
use fairring_core::plan::{Geometry, Plan, PlanConfig};
use fairring_core::topology::{Location, RankLayout, Topology};
use std::hint::black_box;

fn geometry(machines: u32, devices: u32) -> Geometry {
    let topology = Topology::new(machines, devices, RankLayout::Contiguous).unwrap();
    Geometry::new(topology, PlanConfig::default()).unwrap()
}

fn plan(c: &mut Criterion) {
    let mut group = c.benchmark_group("plan");
    for (m, d) in [(8u32, 8u32), (512, 8), (4096, 1)] {
        let g = geometry(m, d);
        // A 1 GiB f32 tensor: 41 slices of 25 MiB.
        let n = (1u64 << 30) / 4;
        group.bench_with_input(BenchmarkId::new("new", format!("{m}x{d}")), &g, |b, g| {
            b.iter(|| Plan::new(black_box(g), DataType::F32, black_box(n), black_box(17)))
        });
        let p = Plan::new(&g, DataType::F32, n, 17).unwrap();
        let me = Location {
            machine: m / 2,
            device: d - 1,
        };
        group.bench_with_input(BenchmarkId::new("slice", format!("{m}x{d}")), &p, |b, p| {
            let mut i = 0;
            b.iter(|| {
                i = (i + 1) % p.slice_count();
                let slice = p.slice(black_box(i)).unwrap();
                let role = slice.role(me).unwrap();
                let mut bytes = 0u64;
                for shard in 0..slice.shards() {
                    bytes += slice.cell(me.device, shard).unwrap().span().byte_len();
                }
                (role, bytes)
            })
        });
        group.bench_with_input(
            BenchmarkId::new("locate", format!("{m}x{d}")),
            &p,
            |b, p| {
                let mut x = 0u64;
                b.iter(|| {
                    x = (x + 0x9E37_79B9) % p.elements();
                    p.locate(black_box(x)).unwrap()
                })
            },
        );
    }
    group.finish();
}

criterion_group!(benches, plan);
criterion_main!(benches);
