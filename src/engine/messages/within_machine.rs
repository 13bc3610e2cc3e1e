//! The driver's side of messages between ranks of one machine whose ranks
//! may read each other's memory: offers through the machine's mailboxes
//! (`mailbox`). A message of up to `BOUNCE_BYTES`, while one of the
//! sender's bounce slots is free, is copied into it by the sender and out by
//! the receiver (two copies, no system call); any other is copied once, by
//! its receiver, from the sender's tensor straight into its own
//! (`process_vm_readv`).
//!
//! The receiver copies at most [`CHUNK`] bytes of a message per pass, so a
//! large message holds no other work of the driver up for long. A read
//! races with its owner's failure as the shared-memory step's reads do: a
//! failing sender closes its tensors to reads before it declares its sends
//! failed, and a read it overtook is thrown away (`local::tensor_copies`).

use fairring_rdma::fabric::Fabric;

use super::mailbox::{self, Offer, Settled};
use super::transfers::{Active, Transfers, mismatch};
use super::{CHUNK, Post};
use crate::engine::Engine;
use crate::engine::failure::Fault;
use crate::engine::work_table::{DONE, FAILED};
use crate::error::Error;
use crate::local::tensor_copies;
use crate::memory::MemorySpace;
use crate::shm::segment::{BOUNCE_BYTES, BOUNCE_SLOTS};

impl<F: Fabric, M: MemorySpace> Engine<F, M> {
    /// Starts `post`, to or from local rank `local`: a send is offered (once
    /// its line is free), a receive waits for its offer.
    pub(super) fn start_local(
        &self,
        t: &mut Transfers<F::Region>,
        post: Post,
        local: u32,
    ) -> Result<(), Fault> {
        let peer = post.peer as usize;
        if t.peers[peer].left {
            self.fail_after_goodbye(t, &post);
            return Ok(());
        }
        if post.sending {
            let k = t.peers[peer].next_offer;
            t.peers[peer].next_offer += 1;
            t.put(post.id, Active::Offered(post, k, None));
            t.peers[peer].offering.push_back(post.id);
            self.offer_waiting(t, post.peer, local);
            return Ok(());
        }
        t.put(post.id, Active::Posted(post));
        if let Some((receive, offer)) = t.peers[peer].offers.left(post.tag, post.id) {
            self.begin_copy(t, receive, offer, local);
        }
        Ok(())
    }

    /// Offers `peer` (local rank `local`) the sends waiting for a free line,
    /// in order.
    fn offer_waiting(&self, t: &mut Transfers<F::Region>, peer: u32, local: u32) -> bool {
        let me = self.machine.local_rank();
        let segment = self.machine.segment();
        let mut moved = false;
        while let Some(&id) = t.peers[peer as usize].offering.front() {
            let Active::Offered(post, k, _) = *t.get(id) else {
                t.peers[peer as usize].offering.pop_front();
                continue;
            };
            let line = segment.mailbox(local, me, mailbox::slot(k));
            if !mailbox::is_free(line, k) {
                break;
            }
            let bounce = self.bounce(t, &post);
            t.put(id, Active::Offered(post, k, bounce));
            mailbox::offer(
                line,
                &Offer {
                    k,
                    tag: post.tag,
                    dtype: post.dtype,
                    bytes: post.bytes,
                    address: post.data as u64,
                    bounce,
                },
            );
            segment.doorbell(local).ring();
            t.peers[peer as usize].offering.pop_front();
            t.offered.push(id);
            moved = true;
        }
        moved
    }

    /// Copies a small message's bytes into a free bounce slot of this rank,
    /// and returns the slot; `None` (the receiver then reads the tensor)
    /// for a larger one, or when every slot is held.
    fn bounce(&self, t: &mut Transfers<F::Region>, post: &Post) -> Option<usize> {
        let len = usize::try_from(post.bytes)
            .ok()
            .filter(|&n| n > 0 && n <= BOUNCE_BYTES)?;
        let slot = t.bounce_free.trailing_zeros() as usize;
        if slot >= BOUNCE_SLOTS {
            return None;
        }
        t.bounce_free &= !(1 << slot);
        let to = self
            .machine
            .segment()
            .bounce(self.machine.local_rank(), slot);
        // SAFETY: the send's tensor holds `len` readable bytes (`post_message`'s
        // contract); the slot holds `BOUNCE_BYTES` of the segment that only
        // this rank writes, and no receiver reads until the offer is made.
        unsafe { std::ptr::copy_nonoverlapping(post.data as *const u8, to.as_ptr(), len) };
        Some(slot)
    }

    /// One pass of the local path: offers that waited for a line, sends
    /// settled by their receivers, offers received, copies.
    pub(super) fn drive_local(&self, t: &mut Transfers<F::Region>) -> Result<bool, Fault> {
        let mut moved = false;
        let me = self.machine.local_rank();
        let segment = self.machine.segment();
        for i in 0..t.locals.len() {
            let (peer, local) = t.locals[i];
            if !t.peers[peer as usize].offering.is_empty() {
                moved |= self.offer_waiting(t, peer, local);
            }
            // Offers from `local`, in order.
            loop {
                let k = t.peers[peer as usize].next_expected;
                let line = segment.mailbox(me, local, mailbox::slot(k));
                let offer = match mailbox::take(line, k) {
                    None => break,
                    Some(Ok(offer)) => offer,
                    Some(Err(())) => {
                        return Err(Error::peer(
                            peer,
                            "offered a message of an unknown element type (the peer broke the \
                             message protocol)",
                        )
                        .into());
                    }
                };
                moved = true;
                t.peers[peer as usize].next_expected += 1;
                if let Some((receive, offer)) =
                    t.peers[peer as usize].offers.right(offer.tag, offer)
                {
                    self.begin_copy(t, receive, offer, local);
                }
            }
        }
        moved |= self.settle_offered(t);
        // Copies, a chunk of each per pass.
        let mut i = 0;
        while i < t.copying.len() {
            let id = t.copying[i];
            moved = true;
            if self.copy_chunk(t, id) {
                t.copying.swap_remove(i);
            } else {
                i += 1;
            }
        }
        Ok(moved)
    }

    /// Finishes the sends their receivers settled; returns whether any.
    pub(super) fn settle_offered(&self, t: &mut Transfers<F::Region>) -> bool {
        let (me, segment) = (self.machine.local_rank(), self.machine.segment());
        let mut settled = false;
        let mut i = 0;
        while i < t.offered.len() {
            let id = t.offered[i];
            let Active::Offered(post, k, _) = *t.get(id) else {
                t.offered.swap_remove(i);
                continue;
            };
            let Some(local) = t.local_of(post.peer) else {
                t.offered.swap_remove(i);
                continue;
            };
            let line = segment.mailbox(local, me, mailbox::slot(k));
            match mailbox::settled(line, k) {
                None => i += 1,
                Some(how) => {
                    settled = true;
                    t.offered.swap_remove(i);
                    match how {
                        Settled::Done => self.settle_message(t, id, DONE, None),
                        Settled::Refused { bytes, dtype } => {
                            let e = mismatch(&post, bytes, dtype, self.links.rank);
                            self.settle_message(t, id, FAILED, Some(e));
                        }
                    }
                }
            }
        }
        settled
    }

    /// A receive met its offer: checks it, and starts copying.
    fn begin_copy(&self, t: &mut Transfers<F::Region>, receive: u64, offer: Offer, local: u32) {
        let Active::Posted(post) = *t.get(receive) else {
            return;
        };
        let segment = self.machine.segment();
        let line = segment.mailbox(self.machine.local_rank(), local, mailbox::slot(offer.k));
        if post.bytes != offer.bytes || post.dtype != offer.dtype {
            mailbox::settle(
                line,
                offer.k,
                Settled::Refused {
                    bytes: post.bytes,
                    dtype: post.dtype,
                },
            );
            segment.doorbell(local).ring();
            let e = mismatch(&post, offer.bytes, offer.dtype, self.links.rank);
            self.settle_message(t, receive, FAILED, Some(e));
            return;
        }
        t.put(
            receive,
            Active::Copying {
                post,
                offer,
                local,
                copied: 0,
            },
        );
        if post.bytes == 0 {
            self.copy_chunk(t, receive);
        } else {
            t.copying.push(receive);
        }
    }

    /// Copies the next chunk of receive `id`; returns whether it finished.
    fn copy_chunk(&self, t: &mut Transfers<F::Region>, id: u64) -> bool {
        let Active::Copying {
            post,
            offer,
            local,
            copied,
        } = *t.get(id)
        else {
            return true;
        };
        let segment = self.machine.segment();
        let me = self.machine.local_rank();
        let Some(peers) = self.peer_copy.as_deref() else {
            return true;
        };
        let n = (post.bytes - copied).min(CHUNK);
        #[expect(
            clippy::cast_possible_truncation,
            reason = "a chunk of a tensor in memory"
        )]
        let (at, len) = (copied as usize, n as usize);
        let read = if len == 0 {
            Some(Ok(()))
        } else if let Some(slot) = offer.bounce {
            if slot >= BOUNCE_SLOTS || len > BOUNCE_BYTES {
                Some(Err(Error::peer(
                    post.peer,
                    "offered a message through a bounce slot it does not have (the peer \
                     broke the message protocol)",
                )))
            } else {
                let from = segment.bounce(local, slot);
                // The sender wrote the slot before offering it, and writes it
                // again only once this offer is settled.
                // SAFETY: so `len` bytes there are stable; the receive's tensor
                // holds `len` writable bytes left alone until it finishes.
                unsafe {
                    std::ptr::copy_nonoverlapping(from.as_ptr(), post.data as *mut u8, len);
                }
                Some(Ok(()))
            }
        } else {
            let start = (post.data as *mut u8).wrapping_add(at);
            // SAFETY: the receive's tensor is the caller's, left valid and
            // alone until the message finishes (`post_message`'s contract);
            // only this chunk's bytes, within it, are written here.
            let into = unsafe { std::slice::from_raw_parts_mut(start, len) };
            tensor_copies::read_with(segment, me, local, || {
                peers.read(local, offer.address + copied, into)
            })
        };
        let failed = match read {
            Some(Ok(())) => None,
            Some(Err(e)) => Some(e),
            None => Some(self.recorded_failure_of(post.peer).map_or_else(
                || {
                    Error::peer(
                        post.peer,
                        "failed, and no longer lets its machine's ranks copy its tensors",
                    )
                },
                |fault| fault.error,
            )),
        };
        if let Some(e) = failed {
            self.settle_message(t, id, FAILED, Some(e));
            return true;
        }
        let copied = copied + n;
        if copied < post.bytes {
            t.put(
                id,
                Active::Copying {
                    post,
                    offer,
                    local,
                    copied,
                },
            );
            return false;
        }
        let line = segment.mailbox(me, local, mailbox::slot(offer.k));
        mailbox::settle(line, offer.k, Settled::Done);
        segment.doorbell(local).ring();
        self.settle_message(t, id, DONE, None);
        true
    }
}
