//! The data path of the verbs provider: posting receives, writes and
//! messages against the peer's credits, returning credits, and turning work
//! completions into the fabric's completions (and failures of peers).

use super::*;

impl Inner {
    pub(super) fn lock(&self) -> MutexGuard<'_, DataPath> {
        self.data.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(super) fn timing(&self) -> Timing {
        Timing {
            timeout: self.config.ack_timeout,
            retry_count: self.config.retry_count,
        }
    }

    /// Posts `receive` slot `slot` of `peer`'s queue pair.
    pub(super) fn post_receive(
        qp: &QueuePair,
        receives: &Receives,
        peer: u32,
        slot: usize,
    ) -> Result<(), FabricError> {
        let mut sge = sys::ibv_sge {
            addr: receives.buffer[slot * SLOT..].as_ptr() as u64,
            length: SLOT_U32,
            lkey: receives.mr.lkey(),
        };
        let mut wr = sys::ibv_recv_wr {
            wr_id: RECEIVE | (u64::from(peer) << 20) | slot as u64,
            next: std::ptr::null_mut(),
            sg_list: &mut sge,
            num_sge: 1,
        };
        // SAFETY: the buffer is registered and lives in the link, which outlives the
        // queue pair's requests (a failed link keeps both).
        unsafe { qp.post_recv(&mut wr) }
    }

    /// Takes an op slot for `peer`.
    pub(super) fn take_slot(
        data: &mut DataPath,
        peer: u32,
        token: Option<u64>,
        source: Option<SourceUse>,
    ) -> Result<usize, FabricError> {
        let slot = data.free.pop().ok_or(FabricError::QueueFull {
            peer,
            depth: data.ops.len(),
        })?;
        data.ops[slot] = Some(Op {
            peer,
            token,
            _source: source,
        });
        Ok(slot)
    }

    pub(super) fn release_slot(data: &mut DataPath, slot: usize) -> Option<Op> {
        let op = data.ops.get_mut(slot)?.take()?;
        data.free.push(slot);
        Some(op)
    }

    /// Posts `wr` (its id set here) to `peer`, accounting a credit and a send slot.
    pub(super) fn post(
        &self,
        data: &mut DataPath,
        peer: u32,
        wr: &mut sys::ibv_send_wr,
        token: Option<u64>,
        source: Option<SourceUse>,
        reserve: u32,
    ) -> Result<(), FabricError> {
        let depth = self.config.send_queue_depth;
        let link = match &data.peers[peer as usize] {
            Link::Connected(c) if c.credits > reserve && c.outstanding < depth => c,
            Link::Connected(_) => {
                return Err(FabricError::QueueFull {
                    peer,
                    depth: usize::from(self.config.receive_depth),
                });
            }
            Link::Failed { failure, .. } => {
                return Err(FabricError::PeerFailed {
                    peer,
                    failure: *failure,
                });
            }
            _ => return Err(FabricError::NotConnected { peer }),
        };
        let _ = link;
        let slot = Self::take_slot(data, peer, token, source)?;
        wr.wr_id = slot as u64;
        let Link::Connected(c) = &mut data.peers[peer as usize] else {
            unreachable!("checked above")
        };
        // SAFETY: a write's source is registered and held by its op until the
        // completion; inline payloads are copied by the post itself.
        match unsafe { c.qp.post_send(wr) } {
            Ok(()) => {
                c.credits -= 1;
                c.outstanding += 1;
                Ok(())
            }
            Err(e) => {
                Self::release_slot(data, slot);
                Err(e)
            }
        }
    }

    /// Returns credits to `peer` once half its receives have been consumed.
    pub(super) fn return_credits(&self, data: &mut DataPath, peer: u32) -> Result<(), FabricError> {
        let half = u32::from(self.config.receive_depth) / 2;
        let count = match &data.peers[peer as usize] {
            Link::Connected(c) if c.consumed >= half && c.credits >= 1 => c.consumed,
            _ => return Ok(()),
        };
        let payload = count.to_le_bytes();
        let mut sge = sys::ibv_sge {
            addr: payload.as_ptr() as u64,
            length: 4,
            lkey: 0,
        };
        let mut wr = send_wr(&mut sge, sys::ibv_wr_opcode::IBV_WR_SEND, true);
        self.post(data, peer, &mut wr, None, None, 0)?;
        if let Link::Connected(c) = &mut data.peers[peer as usize] {
            c.consumed -= count;
        }
        Ok(())
    }

    pub(super) fn fail(
        data: &mut DataPath,
        peer: u32,
        failure: PeerFailure,
        out: &mut VecDeque<Completion>,
    ) {
        let link = std::mem::replace(&mut data.peers[peer as usize], Link::None);
        data.peers[peer as usize] = match link {
            Link::Connected(c) => {
                log::warn!("fairring verbs: rank {peer} failed: {failure}");
                out.push_back(Completion {
                    peer,
                    event: CompletionEvent::PeerFailed { failure },
                });
                Link::Failed {
                    _qp: c.qp,
                    _receives: c.receives,
                    failure,
                }
            }
            other => other,
        };
    }

    /// Polls the completion queue once, turning work completions into fabric
    /// completions in `data.overflow`.
    pub(super) fn progress(&self, data: &mut DataPath) -> Result<(), FabricError> {
        let mut scratch = std::mem::take(&mut data.scratch);
        let n = self.device.poll(&mut scratch)?;
        let mut out = std::mem::take(&mut data.overflow);
        for wc in &scratch[..n] {
            let id = wc.wr_id();
            if id & RECEIVE != 0 {
                let (Ok(peer), Ok(slot)) = (
                    u32::try_from((id & !RECEIVE) >> 20),
                    usize::try_from(id & 0xf_ffff),
                ) else {
                    continue;
                };
                if let Some((status, _)) = wc.error() {
                    Self::fail(data, peer, PeerFailure::Transport { status }, &mut out);
                    continue;
                }
                let Link::Connected(c) = &mut data.peers[peer as usize] else {
                    continue;
                };
                let bytes = &c.receives.buffer[slot * SLOT..slot * SLOT + wc.len().min(SLOT)];
                match (wc.opcode(), wc.imm_data()) {
                    (sys::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM, Some(imm)) => {
                        out.push_back(Completion {
                            peer,
                            event: CompletionEvent::Landed {
                                len: wc.len() as u64,
                                immediate: u32::from_be(imm),
                            },
                        })
                    }
                    (sys::ibv_wc_opcode::IBV_WC_RECV, Some(imm)) => {
                        let message =
                            Message::new(u32::from_be(imm), bytes).expect("at most a slot");
                        out.push_back(Completion {
                            peer,
                            event: CompletionEvent::Message(message),
                        });
                    }
                    (sys::ibv_wc_opcode::IBV_WC_RECV, None) if bytes.len() == 4 => {
                        c.credits += u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]);
                    }
                    (opcode, _) => {
                        log::warn!(
                            "fairring verbs: unexpected receive opcode {opcode} from rank {peer}"
                        );
                    }
                }
                c.consumed += 1;
                if let Err(e) = Self::post_receive(&c.qp, &c.receives, peer, slot) {
                    log::error!("fairring verbs: re-posting a receive for rank {peer}: {e}");
                    Self::fail(
                        data,
                        peer,
                        PeerFailure::Transport { status: u32::MAX },
                        &mut out,
                    );
                    continue;
                }
                if let Err(e) = self.return_credits(data, peer) {
                    log::warn!("fairring verbs: returning credits to rank {peer}: {e}");
                }
            } else {
                let Some(op) = usize::try_from(id)
                    .ok()
                    .and_then(|slot| Self::release_slot(data, slot))
                else {
                    continue;
                };
                let peer = op.peer;
                match &mut data.peers[peer as usize] {
                    Link::Connected(c) => c.outstanding -= 1,
                    Link::Failed { .. } | Link::Created { .. } | Link::None => {}
                }
                match (wc.error(), op.token) {
                    (None, Some(token)) => out.push_back(Completion {
                        peer,
                        event: CompletionEvent::Sent { token },
                    }),
                    (None, None) => {}
                    (Some((status, _)), token) => {
                        let failure = match &data.peers[peer as usize] {
                            Link::Failed { failure, .. } => *failure,
                            _ => PeerFailure::Transport { status },
                        };
                        if let Some(token) = token {
                            out.push_back(Completion {
                                peer,
                                event: CompletionEvent::SendFailed { token, failure },
                            });
                        }
                        Self::fail(data, peer, failure, &mut out);
                    }
                }
            }
        }
        data.overflow = out;
        data.scratch = scratch;
        Ok(())
    }
}

pub(super) fn send_wr(
    sge: &mut sys::ibv_sge,
    opcode: sys::ibv_wr_opcode::Type,
    inline: bool,
) -> sys::ibv_send_wr {
    // SAFETY: all-zero is a valid send request, filled in below.
    let mut wr: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
    wr.sg_list = sge;
    wr.num_sge = i32::from(sge.length > 0);
    wr.opcode = opcode;
    wr.send_flags = sys::ibv_send_flags::IBV_SEND_SIGNALED.0
        | if inline {
            sys::ibv_send_flags::IBV_SEND_INLINE.0
        } else {
            0
        };
    wr
}
