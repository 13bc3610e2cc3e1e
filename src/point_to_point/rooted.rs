//! The gather and the scatter on host memory: each rank's part moves once,
//! as one message between it and the root, on the pair's channel (the
//! root's own part is copied). The call's check runs first on the engine,
//! and its messages wait at the [gate](super::gate) until it passes.

use std::sync::Arc;

use super::Message;
use super::gate::CheckWait;
use crate::communicator::{Call, Collective, Communicator};
use crate::error::Result;

impl Communicator {
    /// Readies what a gather or a scatter on host memory needs before its
    /// check is submitted (the gate's thread), so that nothing can refuse it
    /// after.
    pub(crate) fn ready_rooted(&self, wait: impl FnOnce() -> CheckWait) -> Result<()> {
        self.channels.gate.open(&self.channels, wait)
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
        let channels = &self.channels;
        let timeout = channels.config.timeout;
        let mut posts = channels.pool.list(world as usize - 1);
        for (call, check) in calls {
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
            let mut gated = channels.gate.list(peers);
            let mut add = |peer: u32, sending: bool, data: *mut u8| {
                let (src, dst) = if sending { (me, peer) } else { (peer, me) };
                let posted = channels.pool.posted(peer, sending, src, dst, timeout);
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
            channels.gate.queue(check, gated);
        }
        Message::many(posts, &channels.pool)
    }
}
