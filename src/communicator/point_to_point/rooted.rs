//! The gather, the scatter and the reduce on host memory, as messages: a
//! gather's or a scatter's parts each move once, as one message between its
//! rank and the root (the root's own part is copied);
//! a reduce runs as a [chain](super::chain). The call's check runs first on
//! the engine, and its messages wait at the [gate](super::gate) until it
//! passes.

use std::sync::Arc;

use super::chain::{CHUNK_BYTES, Chain};
use super::gate::CheckWait;
use super::{Message, Posted};
use crate::communicator::{Call, Collective, Communicator};
use crate::error::Result;
use fairring_core::DataType;

impl Communicator {
    /// Readies what a gather or a scatter on host memory needs before its
    /// check is submitted (the gate's thread), so that nothing can refuse it
    /// after.
    pub(crate) fn ready_rooted(&self, wait: impl FnOnce() -> CheckWait) -> Result<()> {
        self.p2p.gate.open(&self.p2p, wait)
    }

    /// Queues the messages of `calls`, gathers and scatters on host memory,
    /// each with the number of its check: they start once their check has
    /// passed. This rank's own part was copied with the check (its prelude);
    /// on a gather, a rank sends its part from its place in its output, where
    /// that copy put it. The [`Message`] covers them all.
    ///
    /// # Safety
    ///
    /// Each call's memory must stay valid and unshared until the message
    /// reports completion (`Communicator::start`'s contract).
    pub(crate) unsafe fn queue_rooted<'c>(
        &self,
        calls: impl IntoIterator<Item = (&'c Call, u64)>,
    ) -> Message {
        let (me, world) = (self.rank(), self.world_size());
        let p2p = &self.p2p;
        let timeout = p2p.config.timeout;
        let mut posts = p2p.pool.list(world as usize - 1);
        for (call, check) in calls {
            if call.collective == Collective::Reduce {
                self.queue_chain(call, check, &mut posts);
                continue;
            }
            let root = call.root;
            // Every count was checked to fit in memory with the call.
            let n = usize::try_from(call.count * call.dtype.size_bytes()).unwrap_or(0);
            let gathers = call.collective == Collective::Gather;
            // Gather: the root receives part r into its output; scatter: it
            // sends part r of its input. Every other rank sends or receives
            // its own part.
            let base = if gathers {
                call.output
            } else {
                call.input.cast_mut()
            };
            let peers = if me == root { world as usize - 1 } else { 1 };
            let mut gated = p2p.gate.list(peers);
            let mut add = |peer: u32, sending: bool, data: *mut u8| {
                let posted = p2p.pool.posted(peer, sending, 0, timeout);
                let message = Call::broadcast(data, call.count, call.dtype, 0);
                gated.0.push((message, Arc::clone(&posted)));
                posts.push(posted);
            };
            if me == root {
                for r in (0..world).filter(|&r| r != root) {
                    add(r, !gathers, base.wrapping_add(r as usize * n));
                }
            } else if gathers {
                add(root, true, base.wrapping_add(me as usize * n));
            } else {
                add(root, false, call.output);
            }
            p2p.gate.queue(check, gated);
        }
        Message::many(posts, &p2p.pool)
    }

    /// Queues this rank's part of `call`, a reduce run as a chain ending at
    /// its root, whose check is operation `check`, and adds its posts to
    /// `posts`: a receive per chunk from its successor in the chain, a send
    /// per chunk to its predecessor, and at the root the chain's end.
    fn queue_chain(&self, call: &Call, check: u64, posts: &mut Vec<Arc<Posted>>) {
        let (me, world, root) = (self.rank(), self.world_size(), call.root);
        let p2p = &self.p2p;
        let timeout = p2p.config.timeout;
        // The rank at distance `p` from the root (counting up) receives
        // from `p + 1` and sends to `p - 1`.
        let at = |p: u32| (p + root) % world;
        let p = (me + world - root) % world;
        let next = (p + 1 < world).then(|| at(p + 1));
        let prev = (p > 0).then(|| at(p - 1));
        // Every count was checked to fit in memory with the call.
        let bytes = usize::try_from(call.count * call.dtype.size_bytes()).unwrap_or(0);
        let chunks = bytes.div_ceil(CHUNK_BYTES);
        let mut receives = p2p.gate.list(if next.is_some() { chunks } else { 0 });
        let mut sends = p2p.gate.list(if prev.is_some() { chunks } else { 0 });
        for k in 0..chunks {
            let start = k * CHUNK_BYTES;
            let len = CHUNK_BYTES.min(bytes - start) as u64;
            if let Some(from) = next {
                let posted = p2p.pool.posted(from, false, 0, timeout);
                // Where it lands (a slot of the gate's scratch) is set when
                // the gate posts it.
                let message = Call::broadcast(std::ptr::null_mut(), len, DataType::U8, 0);
                receives.0.push((message, Arc::clone(&posted)));
                posts.push(posted);
            }
            if let Some(to) = prev {
                let posted = p2p.pool.posted(to, true, 0, timeout);
                let data = call.output.wrapping_add(start);
                sends.0.push((
                    Call::broadcast(data, len, DataType::U8, 0),
                    Arc::clone(&posted),
                ));
                posts.push(posted);
            }
        }
        let done = (me == root).then(|| {
            let from = next.unwrap_or(me);
            let posted = p2p.pool.posted(from, false, 0, timeout);
            posts.push(Arc::clone(&posted));
            posted
        });
        p2p.gate.queue_chain(
            check,
            Chain {
                output: call.output,
                bytes,
                dtype: call.dtype,
                op: call.op,
                world,
                timeout,
                receives,
                sends,
                done,
            },
        );
    }
}
