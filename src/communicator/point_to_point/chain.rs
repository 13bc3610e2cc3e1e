//! The chained reduce: a reduce to a root moved as a pipelined chain of
//! messages, each rank's contribution crossing one link once.
//!
//! The ranks form a chain ending at the root: the rank at distance `p` from
//! the root (counting up, modulo the world) receives from the one at `p + 1`
//! and sends to the one at `p - 1`. The tensor travels in chunks of
//! [`CHUNK_BYTES`]: each rank receives a chunk of the partial result from its
//! successor into a slot of the gate's scratch, reduces it into its own copy
//! of the chunk (its output, which holds its input), and sends that on; the
//! root's copy is the result. Every link carries the tensor once, and the
//! root's link receives it once, where an all-reduce (what a reduce ran as)
//! has every rank receive `2(n-1)/n` of it.
//!
//! The gate's thread runs the chain (`gate`): it posts up to [`SLOTS`]
//! receives ahead, and after each reduce the send of that chunk and the
//! receive of the chunk that reuses the slot. Sums are combined in the
//! chain's order, the root's contribution last; `f16` and `bf16`, which would
//! round at every hop, keep the all-reduce's form (`choice`).

use std::sync::Arc;
use std::time::Duration;

use fairring_core::reduce::{finish_avg_bytes, reduce_bytes};
use fairring_core::{DataType, ReduceOp};

use super::hand_over::{GatedPosts, closed, post_one};
use super::{PointToPoint, Posted};
use crate::error::{Error, Result};

/// The bytes a chain moves per message (the last chunk may be shorter).
pub(super) const CHUNK_BYTES: usize = 1 << 20;

/// Chunks a rank receives ahead of its reduce: the scratch holds this many.
pub(super) const SLOTS: usize = 4;

/// One rank's part of a chained reduce, queued at the gate.
pub(super) struct Chain {
    /// The rank's copy of the tensor: its output, holding its input.
    pub(super) output: *mut u8,
    pub(super) bytes: usize,
    pub(super) dtype: DataType,
    pub(super) op: ReduceOp,
    pub(super) world: u32,
    pub(super) timeout: Duration,
    /// One receive per chunk from the successor (none at the chain's end);
    /// their calls' memory is set to a scratch slot when posted.
    pub(super) receives: GatedPosts,
    /// One send per chunk to the predecessor (none at the root).
    pub(super) sends: GatedPosts,
    /// The root's: finished once its last chunk is reduced.
    pub(super) done: Option<Arc<Posted>>,
}

// SAFETY: `output` is the caller's memory, which `Communicator::start`'s
// contract keeps valid and unshared until the call's work (whose messages
// include every post here) reports completion.
unsafe impl Send for Chain {}

impl Chain {
    /// Runs the chain once the check has come out as `check`, on
    /// `p2p`, with `scratch` (the gate's, grown here once). Every post
    /// is settled when this returns.
    ///
    /// The lists go to `give_back` before the last post is posted or
    /// settled: the caller, who may issue the next call as soon as every
    /// post has finished, then finds them free.
    pub(super) fn run(
        mut self,
        check: &Result<()>,
        p2p: Option<&Arc<PointToPoint>>,
        scratch: &mut Vec<u64>,
        give_back: &mut dyn FnMut(GatedPosts),
    ) {
        let outcome = match (check, p2p) {
            (Err(e), _) => Err(e.clone()),
            (Ok(()), None) => Err(closed()),
            (Ok(()), Some(c)) => self.pipeline(c, scratch, give_back),
        };
        if let Err(e) = &outcome {
            for (_, p) in self.receives.0.iter().chain(&self.sends.0) {
                p.settle(Err(e.clone()));
            }
        }
        let mut done = self.done.take();
        for list in [&mut self.receives, &mut self.sends] {
            list.0.clear();
            give_back(std::mem::replace(list, GatedPosts(Vec::new())));
        }
        if let Some(done) = done.take() {
            done.finish(outcome);
        }
    }

    /// The chunks in turn. What is posted leaves the lists; on a failure
    /// what is left in them is failed by the caller.
    fn pipeline(
        &mut self,
        p2p: &Arc<PointToPoint>,
        scratch: &mut Vec<u64>,
        give_back: &mut dyn FnMut(GatedPosts),
    ) -> Result<()> {
        let chunks = self.bytes.div_ceil(CHUNK_BYTES);
        let receiving = !self.receives.0.is_empty();
        let words = SLOTS * CHUNK_BYTES / 8;
        if receiving && scratch.len() < words {
            scratch.resize(words, 0);
        }
        let slots = scratch.as_mut_ptr().cast::<u8>();
        let mut received = 0;
        let mut outcome = Ok(());
        let post_receive = |receives: &GatedPosts, j: usize| {
            let (mut call, posted) = (receives.0[j].0, Arc::clone(&receives.0[j].1));
            let slot = slots.wrapping_add((j % SLOTS) * CHUNK_BYTES);
            (call.input, call.output) = (slot, slot);
            // SAFETY: the slot is the gate's scratch, which no other receive
            // uses until this one has finished (it is reused only after this
            // chunk's reduce, and kept if a receive may still write it).
            unsafe { post_one(Some(p2p), call, posted) };
        };
        let mut posted = 0;
        while receiving && posted < chunks.min(SLOTS) {
            post_receive(&self.receives, posted);
            posted += 1;
        }
        let mut sent = 0;
        for k in 0..chunks {
            let start = k * CHUNK_BYTES;
            let len = CHUNK_BYTES.min(self.bytes - start);
            // SAFETY: chunk `k` of the caller's output (this type's SAFETY
            // note); nothing else touches it until its send is posted below.
            let chunk =
                unsafe { std::slice::from_raw_parts_mut(self.output.wrapping_add(start), len) };
            if receiving {
                if let Err(e) = self.receives.0[k].1.wait(self.timeout) {
                    outcome = Err(e);
                    break;
                }
                received += 1;
                // SAFETY: the slot's receive has finished; nothing writes it
                // until the next receive into it is posted below.
                let partial = unsafe {
                    std::slice::from_raw_parts(slots.wrapping_add((k % SLOTS) * CHUNK_BYTES), len)
                };
                if let Err(e) = reduce_bytes(self.dtype, self.op, chunk, partial) {
                    outcome = Err(Error::internal(
                        "a chained reduce's chunk reduces",
                        e.to_string(),
                    ));
                    break;
                }
                if posted < chunks {
                    post_receive(&self.receives, posted);
                    posted += 1;
                }
            }
            if self.done.is_some()
                && self.op == ReduceOp::Avg
                && let Err(e) = finish_avg_bytes(self.dtype, chunk, self.world)
            {
                outcome = Err(Error::internal(
                    "a chained reduce's average finishes",
                    e.to_string(),
                ));
                break;
            }
            if let Some(&(call, ref send)) = self.sends.0.get(k) {
                let send = Arc::clone(send);
                if k + 1 == chunks {
                    // The last post: the lists go back first (every receive
                    // has finished).
                    for list in [&mut self.receives, &mut self.sends] {
                        list.0.clear();
                        give_back(std::mem::replace(list, GatedPosts(Vec::new())));
                    }
                }
                // SAFETY: the chunk is the caller's memory, done with here.
                unsafe { post_one(Some(p2p), call, send) };
                sent += 1;
            }
        }
        if outcome.is_err() {
            // Only what was not posted stays for the caller to fail.
            self.receives.0.drain(..posted.min(self.receives.0.len()));
            self.sends.0.drain(..sent.min(self.sends.0.len()));
            // Receives posted but not seen to finish may still write the
            // scratch: it is let go of, never reused.
            if posted > received {
                std::mem::forget(std::mem::take(scratch));
            }
        }
        outcome
    }
}
