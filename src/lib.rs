//! fairring: a reduction-server all-reduce for data-parallel training.
//!
//! The all-reduce at the end of every training step runs as Amazon's Herring and
//! Meta's Fairring run it: an intra-machine reduce-scatter, a sharded exchange along
//! rails with each device serving the reduction of one shard, and an intra-machine
//! all-gather. The number of network hops stays constant as machines are added, and
//! every device carries the same load.
//!
//! This package is the engine and the facade. Each layer below it is a crate of its
//! own, re-exported here, so that a runtime can link only the layer it needs:
//!
//! | module | crate | what it holds |
//! |---|---|---|
//! | [`core`] | `fairring-core` | `no_std`, allocation-free: topology, plan arithmetic, staging state machine, wire frames, host reduction kernels, fusion planner |
//! | [`rdma`] | `fairring-rdma` | the fabric: an RDMA-shaped transport, providers `tcp` and `verbs` |
//! | `cuda` | `fairring-cuda` | CUDA streams and events, NCCL intra-machine collectives, device reduction (feature `cuda`) |
//!
//! Features: `tcp` (default) enables the TCP provider of the fabric, `verbs` its verbs
//! provider, `cuda` the GPU layer.
//!
//! The engine itself (the `Communicator`, rendezvous, progress and the algorithms) is
//! not written yet; today this package re-exports the layers.
#![forbid(unsafe_code)]

pub use fairring_core as core;
#[cfg(feature = "cuda")]
pub use fairring_cuda as cuda;
pub use fairring_rdma as rdma;
