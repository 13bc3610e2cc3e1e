//! The fabric of fairring: an RDMA-shaped transport between the ranks of a job.
//!
//! [`fabric`] is the API, the one every provider implements and all the engine
//! uses: registered memory regions, peers admitted by a mutual HMAC-SHA256
//! handshake over the job secret, one-sided writes with immediate data, small
//! control messages, and a completion queue polled without allocation.
//!
//! Providers, one folder each:
//!
//! - [`tcp`] (feature `tcp`, on by default): real sockets, on loopback or across
//!   machines. Frames are a [`fairring_core::wire`] header plus payload, checked
//!   against the target region before a payload byte is read into it.
//! - `verbs` (feature `verbs`, needs libibverbs): RC queue pairs, RDMA write with
//!   immediate, credits, GPUDirect registration (`ibv_reg_mr` on device memory,
//!   `ibv_reg_dmabuf_mr`). Compiled in CI; never yet run on an RDMA device (its
//!   module docs say what that means).
//!
//! [`any`] (with `tcp`) is one fabric type over whichever provider a process
//! chooses at run time, and the rule that chooses it: what a runtime generic
//! over [`Fabric`] is built with when the provider is known only once it runs.
#![deny(unsafe_code)]

#[cfg(feature = "tcp")]
#[allow(unsafe_code)]
pub mod any;
pub mod fabric;
mod secret;
mod sync;
#[cfg(feature = "tcp")]
#[allow(unsafe_code)]
pub mod tcp;
#[cfg(feature = "verbs")]
#[allow(unsafe_code)]
pub mod verbs;

pub use fabric::{Completion, CompletionEvent, Fabric, FabricError, LocalRegion, WriteRequest};
pub use secret::{JOB_SECRET_VAR, JobSecret};
