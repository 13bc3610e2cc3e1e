//! Benchmarks of fairring, kept out of the published crates.
//!
//! - `benches/plan.rs`: plan creation and per-slice queries;
//! - `benches/staging.rs`: staging state transitions, single-threaded and contended;
//! - `benches/reduce.rs`: host reduction kernels against a `copy_from_slice` of the
//!   same bytes, the memory-bandwidth bound.
//!
//! Run one with `cargo bench -p fairring-bench --bench reduce`.
//!
//! Two binaries: `fairring-bench` (the all-reduce, nccl-tests style) and
//! `fairring-gpu-bench` (the device reduction kernel against the device's copy
//! bound, and pinned host-device bandwidth; needs a GPU).
//!
//! Two modules serve the binaries: [`model`], the scale model behind
//! `fairring-bench model`, and [`plot`], the charts `--plot` writes.

pub mod model;
pub mod plot;
