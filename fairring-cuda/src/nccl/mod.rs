//! NCCL among the devices of one machine: the intra-machine reduce-scatter and
//! all-gather of the hierarchical all-reduce, in place (as equal chunks, or as
//! one reduce and one broadcast per rank's unequal part, grouped), and the
//! all-reduce of a job that fits on one machine.
//!
//! One rank makes a [`UniqueId`], the job's rendezvous store carries its 128 bytes
//! to the others, and each creates its [`Communicator`] member from it. Every call
//! is bounded: the communicator is non-blocking, waits poll with a deadline, and
//! [`Communicator::abort`] returns promptly from any thread.
//!
//! Min and max of floats follow NCCL's semantics here (NCCL does not promise to
//! propagate NaN or to order -0 below +0), unlike [`ReductionKernels`](crate::ReductionKernels),
//! which follow fairring-core's.

mod communicator;
mod types;
mod unique_id;

pub use communicator::{Communicator, GIVE_UP_EVERY, group};
pub use unique_id::UniqueId;
