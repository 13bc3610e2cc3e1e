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
//! # The engine
//!
//! [`Communicator`] runs all-reduce, broadcast, all-gather, reduce-scatter, reduce,
//! gather, scatter, barrier and coalesced all-reduce across processes and machines
//! on host memory, and sends, receives and all-to-all (each message an operation
//! of the engine, from tensor to tensor), every one a [`Call`] started by
//! [`Communicator::start`], alone or in a group under one [`Work`]:
//!
//! - **built** from torchrun's environment or a [`Config`] builder; ranks meet
//!   through a [`Store`] (by default the authenticated [`store::TcpStore`] rank 0
//!   serves; under torchrun, the PyTorch TCPStore its agent serves, through
//!   [`store::C10dStore`]; or the host runtime's own), find which of them share a
//!   machine, and connect the fabric;
//! - **asynchronous**: operations started in a [`Communicator::scope`] return a
//!   [`Work`] at once, and successive ones overlap up to the number of staging
//!   buffers; a progress thread (or a waiting caller) drives them. Runtimes that
//!   own their memory describe a [`Call`], start it with the `unsafe`
//!   [`Communicator::start`] and hold an [`OwnedWork`] (the C ABI, `fairring-ffi`,
//!   does);
//! - **hierarchical** (the reduction-server algorithm), **ring** or recursive
//!   **doubling**, per call, or **auto** (the default: chosen per size and layout
//!   from measured crossovers); with the ring, broadcast and all-gather are a
//!   relay and reduce-scatter the ring's reduce-scatter half, each byte moved
//!   once per hop (around the machines, with shared memory inside each, where
//!   machines have several devices);
//! - **compressed** if asked (`FAIRRING_WIRE`): `f32` values cross between
//!   machines, or to servers, as bf16 or f16 and are reduced in `f32`;
//! - **checked**: ranks compare every operation's descriptor before combining any
//!   of its data ([`Error::Mismatch`]), and a failing rank tells every other rank,
//!   so that no rank waits out a timeout for a peer that has given up;
//! - **intra-machine** behind one local-step trait, over a memory-space trait
//!   that the engine is generic over: host memory through the machine's shared
//!   segment, and with the `cuda` feature device memory too (every collective
//!   on GPU tensors, ordered on the caller's CUDA stream, each operation's
//!   device work enqueued when the call is accepted so that a stream may wait
//!   for the engine; with several ranks per machine, the machine's
//!   reduce-scatter and all-gather run as NCCL's collectives on the tensors,
//!   or staged through the shared segment: `FAIRRING_DEVICE_LOCAL`; on two to
//!   seven machines whose GPUs reduce in their NVSwitch, a device all-reduce
//!   of the sizes where NCCL's all-reduce is ahead of the plan runs as one
//!   NCCL all-reduce over the whole job, with or without dedicated servers:
//!   `FAIRRING_NCCL_ACROSS_MACHINES`, [`nccl_across_job`]; on one machine
//!   beside dedicated servers, every
//!   device all-reduce NCCL reduces runs as one on the machine's:
//!   [`nccl_beside_servers`]);
//! - **on any fabric**: tcp, or verbs where an RDMA device is present and the
//!   `verbs` feature is built (`FAIRRING_FABRIC`);
//! - **with dedicated servers** if asked (`FAIRRING_SERVERS`, Herring's design):
//!   CPU-only [`Server`] processes then take the all-reduce's inter-machine
//!   step, and each machine sends and receives its buffer once (broadcasts,
//!   all-gathers and reduce-scatters relay and scatter around the workers'
//!   rails where the rules of a job without servers would; where the
//!   machines reduce faster than the servers, the machines serve an
//!   all-reduce's shards themselves: [`MachinesServe`]);
//! - **fused**: [`Fusion`] places a step's tensors into balanced fusion buffers
//!   from the order rank 0 saw first, with no negotiation afterwards;
//! - **allocation-free** per operation once built.
#![deny(unsafe_code)]

pub use fairring_core as core;
#[cfg(feature = "cuda")]
pub use fairring_cuda as cuda;
pub use fairring_rdma as rdma;

#[allow(unsafe_code)]
mod bootstrap;
#[allow(unsafe_code)]
mod communicator;
pub mod config;
#[allow(unsafe_code)]
mod engine;
mod error;
mod fusion;
#[allow(unsafe_code)]
mod local;
#[allow(unsafe_code)]
mod memory;
mod server;
#[allow(unsafe_code)]
mod shm;
/// The seeded simulation of every rank of a job, with a simulated GPU and the
/// machine's collectives: the engine's test bench.
#[cfg(all(test, not(loom)))]
#[allow(unsafe_code)]
mod simulation;
pub mod store;
mod sync;

pub use bootstrap::job_id::{JOB_ID_BYTES, JobId};
pub use communicator::{
    Call, Collective, Communicator, Memory, Options, OwnedWork, Scope, Tensor, TensorMut, Work,
};
pub use config::{
    Algorithm, Config, ConfigBuilder, DeviceLocal, FabricChoice, Grouping, Launcher, MachinesServe,
    NcclAcrossMachines, Role, Staging,
};
pub use engine::layout::{GROUPED_FROM_MACHINES, grouped_geometry, takes_groups};
pub use engine::links::Traffic;
pub use engine::{NCCL_ACROSS_UP_TO_MACHINES, nccl_across_job, nccl_beside_servers};
pub use error::{Error, Result};
pub use fairring_core::{DataType, ReduceOp, WireFormat};
pub use fusion::Fusion;
pub use local::{ONE_REDUCE_SCATTER_FROM_BYTES, reduces_in_one_call};
pub use server::Server;
pub use store::Store;
