//! The allocation-free heart of fairring.
//!
//! fairring all-reduces the way Amazon's Herring and Meta's Fairring do: an
//! intra-machine reduce-scatter, a sharded exchange along rails in which every
//! device serves the reduction of one shard for all machines, and an intra-machine
//! all-gather. This crate holds everything about that algorithm that is pure
//! arithmetic or pure state, with no I/O, no clock, no thread, no allocation and no
//! `unsafe`, so that every other layer (the engine, a GPU runtime, a dedicated
//! reduction server, a fuzzer) can share it:
//!
//! | module | what it answers |
//! |---|---|
//! | [`topology`] | machines, devices, ranks in the contiguous and interleaved layouts, rails |
//! | [`plan`] | which bytes of a tensor form which slice, slot, shard and cell; which machine serves each; where they go in a staging buffer |
//! | [`staging`] | the lock-free state machine of one staging buffer: events in, actions out, each action exactly once |
//! | [`wire`] | the frame header every transport carries, and its validation against the plan before a byte is written |
//! | [`reduce`] | host reduction kernels `dst op= src` for every supported type and operator, and the compressed wire's conversions |
//! | [`fusion`] | Herring's balanced fusion buffers: where each gradient goes, identically on every rank |
//! | [`dtype`] | element types and reduction operators |
//!
//! # Guarantees
//!
//! - `#![no_std]` with no `alloc` anywhere in the dependency graph: CI links this
//!   crate into a bare-metal binary that has no allocator
//!   (`ci/no-alloc-probe`), and a test with a counting allocator sees no allocation
//!   across planning, a full staging sequence, a frame round trip and a reduction.
//! - Sans-IO: the crate never blocks, sleeps, reads a clock or touches a file or a
//!   socket; events come in as arguments and the work to do comes out as values.
//! - No panics on any input: every refusal is an error value that names the argument
//!   and both values. All arithmetic that could overflow is checked.
//! - `#![deny(unsafe_code)]`.
//! - [`staging::StagingState`] needs 64-bit atomics; on targets without them it is
//!   absent and the rest of the crate is unchanged.
//!
//! # Verification
//!
//! Property tests (`tests/`) check every plan invariant, the state machine against
//! its sequential [`staging::reference`] model, the frame codec against corruption,
//! and every kernel against a scalar reference; loom models
//! (`RUSTFLAGS="--cfg loom"`, `tests/loom_staging.rs`) explore the concurrent use of
//! the staging word; fuzz targets in `fuzz/` drive the frame decoder, the plan and
//! the state machine with arbitrary input.
#![no_std]
#![deny(unsafe_code)]
#![warn(clippy::std_instead_of_core)]

#[cfg(test)]
extern crate std;

pub mod dtype;
pub mod fusion;
pub mod plan;
pub mod reduce;
pub mod staging;
pub mod topology;
pub mod wire;

mod named_enum;
mod sync;

pub use dtype::{DataType, ReduceOp, WireFormat};
