//! The admission of strangers: accepting connections, driving each
//! pending one's handshake (a small non-blocking state machine with a
//! deadline) to admission or refusal, and adopting the connections this
//! process dialed. None of it blocks admitted traffic.

use super::*;

impl EventLoop {
    pub(super) fn accept(&mut self) {
        loop {
            let (mut stream, address) = match self.listener.accept() {
                Ok(accepted) => accepted,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Out of descriptors, say: the listener stays; try again later.
                    log::warn!("fairring tcp: accept failed: {e}");
                    return;
                }
            };
            let Some(slot) = self.pending.iter().position(Option::is_none) else {
                self.shared.record_refusal(RefusalRecord {
                    address,
                    claimed_rank: None,
                    refusal: Refusal::TooManyPending,
                    by_peer: false,
                });
                let frame = refusal_frame(&self.shared.params, Refusal::TooManyPending);
                let _ = io::Write::write(&mut NoSigPipe(&stream), frame.as_bytes());
                continue;
            };
            let _ = stream.set_nodelay(true);
            socket::ask_receive_buffer(&stream, self.shared.config.receive_buffer);
            let token = Self::pending_token(slot);
            if let Err(e) = self.poll.registry().register(
                &mut stream,
                token,
                Interest::READABLE | Interest::WRITABLE,
            ) {
                log::warn!("fairring tcp: cannot watch a connection from {address}: {e}");
                continue;
            }
            self.pending[slot] = Some(Pending {
                stream,
                address,
                reader: HelloReader::new(),
                acceptor: Acceptor::new(),
                out: None,
                deadline: Instant::now() + self.shared.config.handshake_timeout,
            });
            self.drive_pending(slot);
        }
    }

    /// Advances one handshake as far as its socket allows.
    pub(super) fn drive_pending(&mut self, slot: usize) {
        loop {
            let Some(p) = self.pending[slot].as_mut() else {
                return;
            };
            // First, any reply not yet fully written.
            if let Some((frame, sent)) = &mut p.out {
                match io::Write::write(&mut NoSigPipe(&p.stream), &frame.as_bytes()[*sent..]) {
                    Ok(n) => {
                        *sent += n;
                        if *sent == frame.as_bytes().len() {
                            p.out = None;
                        }
                        continue;
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(_) => return self.drop_pending(slot),
                }
            }
            let buffer = p.reader.buffer();
            let n = match p.stream.read(buffer) {
                Ok(0) => return self.drop_pending(slot),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(_) => return self.drop_pending(slot),
            };
            let frame = match p.reader.filled(n) {
                Ok(None) => continue,
                Ok(Some(frame)) => frame,
                Err(refusal) => return self.refuse(slot, refusal.into()),
            };
            let (header, payload) = frame;
            let mut nonce = [0; 32];
            if getrandom::fill(&mut nonce).is_err() {
                log::error!("fairring tcp: no randomness for a handshake nonce");
                return self.drop_pending(slot);
            }
            let peers = &self.shared.peers;
            let step = p.acceptor.on_frame(
                &self.shared.params,
                &header,
                payload,
                |rank| peers[rank as usize].state.load(Ordering::Acquire) != NOT_CONNECTED,
                nonce,
            );
            match step {
                Ok(AcceptorStep::Reply(frame)) => p.out = Some((frame, 0)),
                Ok(AcceptorStep::Admit { peer }) => return self.admit(slot, peer),
                Err(failure) => return self.refuse(slot, failure),
            }
        }
    }

    pub(super) fn drop_pending(&mut self, slot: usize) {
        if let Some(mut p) = self.pending[slot].take() {
            let _ = self.poll.registry().deregister(&mut p.stream);
            log::debug!("fairring tcp: {} left during its handshake", p.address);
        }
    }

    pub(super) fn refuse(&mut self, slot: usize, failure: Failure) {
        let Some(mut p) = self.pending[slot].take() else {
            return;
        };
        let _ = self.poll.registry().deregister(&mut p.stream);
        self.shared.record_refusal(RefusalRecord {
            address: p.address,
            claimed_rank: p.acceptor.claimed_rank(),
            refusal: failure.refusal,
            by_peer: failure.by_peer,
        });
        if !failure.by_peer {
            let frame = refusal_frame(&self.shared.params, failure.refusal);
            let _ = io::Write::write(&mut NoSigPipe(&p.stream), frame.as_bytes());
        }
    }

    pub(super) fn admit(&mut self, slot: usize, peer: u32) {
        let Some(mut p) = self.pending[slot].take() else {
            return;
        };
        let state = &self.shared.peers[peer as usize].state;
        if state.load(Ordering::Acquire) != NOT_CONNECTED {
            self.pending[slot] = Some(p);
            return self.refuse(slot, Refusal::DuplicateRank { rank: peer }.into());
        }
        let token = self.conn_token(peer);
        if let Err(e) = self.poll.registry().reregister(
            &mut p.stream,
            token,
            Interest::READABLE | Interest::WRITABLE,
        ) {
            log::warn!("fairring tcp: cannot watch rank {peer}'s connection: {e}");
            return;
        }
        let mut sender = Sender::new(self.shared.config.job_tag, self.shared.config.rank);
        sender.push_extra(welcome_frame(&self.shared.params).as_bytes());
        let receiver = Receiver::new(peer, self.shared.config.job_tag);
        self.shared.watch(peer, &p.stream);
        *self.shared.lock_link(peer) = Some(Link::new(p.stream, receiver, sender));
        self.connected.push(peer);
        self.conns[peer as usize] = Some(Conn {
            last_keepalive: Instant::now(),
        });
        let depth = self.shared.config.send_queue_depth;
        let _ = self.shared.peers[peer as usize]
            .queue
            .set(ArrayQueue::new(depth));
        state.store(ADMITTED, Ordering::Release);
        log::info!(
            "fairring tcp rank {}: admitted rank {peer} from {}",
            self.shared.config.rank,
            p.address
        );
        self.shared.notify_status();
        self.write(peer);
    }

    /// Takes over sockets that `connect` dialed and admitted.
    pub(super) fn adopt_dialed(&mut self) {
        let dialed = std::mem::take(
            &mut *self
                .shared
                .handoff
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        );
        for (peer, stream) in dialed {
            let mut stream = TcpStream::from_std(stream);
            let token = self.conn_token(peer);
            if let Err(e) = self.poll.registry().register(
                &mut stream,
                token,
                Interest::READABLE | Interest::WRITABLE,
            ) {
                log::warn!("fairring tcp: cannot watch rank {peer}'s connection: {e}");
                self.conns[peer as usize] = None;
                self.fail(peer, PeerFailure::Io(e.kind()));
                continue;
            }
            let receiver = Receiver::new(peer, self.shared.config.job_tag);
            let sender = Sender::new(self.shared.config.job_tag, self.shared.config.rank);
            self.shared.watch(peer, &stream);
            *self.shared.lock_link(peer) = Some(Link::new(stream, receiver, sender));
            self.connected.push(peer);
            self.conns[peer as usize] = Some(Conn {
                last_keepalive: Instant::now(),
            });
        }
    }
}
