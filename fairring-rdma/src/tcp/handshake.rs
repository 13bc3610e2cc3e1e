//! The admission handshake, as a pair of sans-IO state machines.
//!
//! The higher rank of a pair dials the lower. Four `Hello` frames follow, each a
//! core [`wire`](fairring_core::wire) header plus a short payload:
//!
//! ```text
//! dialer   -> acceptor  1 | epoch u64 | wanted rank u32 | world size u32 | dialer nonce [32]
//! acceptor -> dialer    2 | acceptor nonce [32] | acceptor proof [32]
//! dialer   -> acceptor  3 | dialer proof [32]
//! acceptor -> dialer    4                                      (admitted)
//! ```
//!
//! A proof is HMAC-SHA256 under the job secret of a direction label ("acceptor" or
//! "dialer"), the job tag, the epoch, the world size, both ranks and both nonces,
//! so a proof is bound to this job, this incarnation, this pair of ranks and this
//! connection, and cannot be reflected back or replayed. Proofs are compared in
//! constant time (`hmac`'s `verify_slice`). Either side that refuses sends an
//! `Abort` frame whose payload encodes the [`Refusal`], then closes.
//!
//! Nothing here does I/O, reads a clock or draws random numbers: nonces are
//! arguments, so the machines are deterministic under test and fuzzing.

use fairring_core::wire::{FrameHeader, FrameKind, HEADER_LEN, WireError};
use hmac::{KeyInit, Mac};
use sha2::Sha256;

use crate::fabric::Refusal;
use crate::secret::JobSecret;

type HmacSha256 = hmac::Hmac<Sha256>;

/// The largest handshake payload this code sends or reads.
pub const MAX_HANDSHAKE_PAYLOAD: usize = 96;

/// A frame to send: a header and a short payload.
pub struct OutFrame {
    bytes: [u8; HEADER_LEN + MAX_HANDSHAKE_PAYLOAD],
    len: usize,
}

impl OutFrame {
    fn new(kind: FrameKind, params: &HandshakeParams, payload: &[u8]) -> OutFrame {
        debug_assert!(payload.len() <= MAX_HANDSHAKE_PAYLOAD);
        let payload_len = u32::try_from(payload.len()).unwrap_or(u32::MAX);
        let header = FrameHeader::control(kind, params.job_tag, params.rank, payload_len);
        let mut bytes = [0; HEADER_LEN + MAX_HANDSHAKE_PAYLOAD];
        bytes[..HEADER_LEN].copy_from_slice(&header.encode());
        bytes[HEADER_LEN..HEADER_LEN + payload.len()].copy_from_slice(payload);
        OutFrame {
            bytes,
            len: HEADER_LEN + payload.len(),
        }
    }

    /// The frame's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// What both sides of a handshake must agree on.
#[derive(Clone, Debug)]
pub struct HandshakeParams {
    /// The job's tag.
    pub job_tag: u64,
    /// The job's incarnation.
    pub epoch: u64,
    /// Ranks in the job.
    pub world_size: u32,
    /// This side's rank.
    pub rank: u32,
    /// The job secret.
    pub secret: JobSecret,
}

/// Why a handshake ended without admission, and who decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Failure {
    /// The reason.
    pub refusal: Refusal,
    /// `true` when the other side refused (its `Abort` frame said why).
    pub by_peer: bool,
}

impl From<Refusal> for Failure {
    fn from(refusal: Refusal) -> Failure {
        Failure {
            refusal,
            by_peer: false,
        }
    }
}

/// The `Abort` frame that tells the other side why it was refused.
pub fn refusal_frame(params: &HandshakeParams, refusal: Refusal) -> OutFrame {
    let (code, a, b): (u8, u64, u64) = match refusal {
        Refusal::WrongSecret => (1, 0, 0),
        Refusal::WrongJob { expected, found } => (2, expected, found),
        Refusal::WrongEpoch { expected, found } => (3, expected, found),
        Refusal::WrongWorldSize { expected, found } => (4, expected.into(), found.into()),
        Refusal::UnknownRank { rank } => (5, rank.into(), 0),
        Refusal::DuplicateRank { rank } => (6, rank.into(), 0),
        Refusal::WrongTarget { wanted, actual } => (7, wanted.into(), actual.into()),
        Refusal::Garbage(_) | Refusal::Malformed => (8, 0, 0),
        Refusal::Deadline => (9, 0, 0),
        Refusal::TooManyPending => (10, 0, 0),
    };
    let mut payload = [0; 17];
    payload[0] = code;
    payload[1..9].copy_from_slice(&a.to_le_bytes());
    payload[9..17].copy_from_slice(&b.to_le_bytes());
    OutFrame::new(FrameKind::Abort, params, &payload)
}

/// Reads the refusal an `Abort` frame carries. The values are the other side's
/// view ("expected" is its own value), reported as it sent them.
fn read_refusal(payload: &[u8]) -> Refusal {
    if payload.len() != 17 {
        return Refusal::Malformed;
    }
    let a = u64_at(payload, 1);
    let b = u64_at(payload, 9);
    let narrow = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
    match payload[0] {
        1 => Refusal::WrongSecret,
        2 => Refusal::WrongJob {
            expected: a,
            found: b,
        },
        3 => Refusal::WrongEpoch {
            expected: a,
            found: b,
        },
        4 => Refusal::WrongWorldSize {
            expected: narrow(a),
            found: narrow(b),
        },
        5 => Refusal::UnknownRank { rank: narrow(a) },
        6 => Refusal::DuplicateRank { rank: narrow(a) },
        7 => Refusal::WrongTarget {
            wanted: narrow(a),
            actual: narrow(b),
        },
        9 => Refusal::Deadline,
        10 => Refusal::TooManyPending,
        _ => Refusal::Malformed,
    }
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut b = [0; 8];
    b.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(b)
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    let mut b = [0; 4];
    b.copy_from_slice(&bytes[at..at + 4]);
    u32::from_le_bytes(b)
}

fn proof(
    params: &HandshakeParams,
    label: &[u8],
    dialer: u32,
    acceptor: u32,
    dialer_nonce: &[u8; 32],
    acceptor_nonce: &[u8; 32],
) -> HmacSha256 {
    let mut mac = <HmacSha256 as KeyInit>::new_from_slice(params.secret.as_bytes())
        .expect("HMAC takes a key of any length");
    mac.update(b"fairring tcp v1 ");
    mac.update(label);
    mac.update(&params.job_tag.to_le_bytes());
    mac.update(&params.epoch.to_le_bytes());
    mac.update(&params.world_size.to_le_bytes());
    mac.update(&dialer.to_le_bytes());
    mac.update(&acceptor.to_le_bytes());
    mac.update(dialer_nonce);
    mac.update(acceptor_nonce);
    mac
}

/// Checks what every handshake frame must satisfy: the kind, the job, and a
/// payload of the expected step and length. `Abort` frames end the handshake.
fn expect_step<'p>(
    params: &HandshakeParams,
    header: &FrameHeader,
    payload: &'p [u8],
    step: u8,
    len: usize,
) -> Result<&'p [u8], Failure> {
    match header.kind {
        FrameKind::Abort => {
            return Err(Failure {
                refusal: read_refusal(payload),
                by_peer: true,
            });
        }
        FrameKind::Hello => {}
        kind => return Err(Refusal::Garbage(WireError::NotControlFrame { kind }).into()),
    }
    if header.job_tag != params.job_tag {
        return Err(Refusal::WrongJob {
            expected: params.job_tag,
            found: header.job_tag,
        }
        .into());
    }
    if payload.len() != len || payload.first() != Some(&step) {
        return Err(Refusal::Malformed.into());
    }
    Ok(&payload[1..])
}

/// The accepting side of a handshake.
pub struct Acceptor {
    state: AcceptorState,
    claimed: Option<u32>,
}

enum AcceptorState {
    AwaitHello,
    AwaitProof {
        peer: u32,
        dialer_nonce: [u8; 32],
        acceptor_nonce: [u8; 32],
    },
    Finished,
}

/// What the acceptor does next.
pub enum AcceptorStep {
    /// Send this frame and wait for the next.
    Reply(OutFrame),
    /// The peer proved itself: admit it (unless the rank was admitted meanwhile)
    /// and send [`welcome_frame`].
    Admit {
        /// The peer's rank.
        peer: u32,
    },
}

impl Default for Acceptor {
    fn default() -> Self {
        Acceptor::new()
    }
}

impl Acceptor {
    /// An acceptor waiting for the dialer's first frame.
    pub fn new() -> Acceptor {
        Acceptor {
            state: AcceptorState::AwaitHello,
            claimed: None,
        }
    }

    /// The rank the dialer claimed, once its first frame was accepted.
    pub fn claimed_rank(&self) -> Option<u32> {
        self.claimed
    }

    /// Handles one frame. `admitted(rank)` says whether a rank is already admitted;
    /// `nonce` is fresh randomness, used if a challenge is sent.
    pub fn on_frame(
        &mut self,
        params: &HandshakeParams,
        header: &FrameHeader,
        payload: &[u8],
        admitted: impl Fn(u32) -> bool,
        nonce: [u8; 32],
    ) -> Result<AcceptorStep, Failure> {
        match core::mem::replace(&mut self.state, AcceptorState::Finished) {
            AcceptorState::AwaitHello => {
                let body = expect_step(params, header, payload, 1, 49)?;
                let epoch = u64_at(body, 0);
                let wanted = u32_at(body, 8);
                let world_size = u32_at(body, 12);
                let peer = header.source_rank;
                self.claimed = Some(peer);
                if world_size != params.world_size {
                    return Err(Refusal::WrongWorldSize {
                        expected: params.world_size,
                        found: world_size,
                    }
                    .into());
                }
                if epoch != params.epoch {
                    return Err(Refusal::WrongEpoch {
                        expected: params.epoch,
                        found: epoch,
                    }
                    .into());
                }
                if wanted != params.rank {
                    return Err(Refusal::WrongTarget {
                        wanted,
                        actual: params.rank,
                    }
                    .into());
                }
                if peer <= params.rank || peer >= params.world_size {
                    return Err(Refusal::UnknownRank { rank: peer }.into());
                }
                if admitted(peer) {
                    return Err(Refusal::DuplicateRank { rank: peer }.into());
                }
                let mut dialer_nonce = [0; 32];
                dialer_nonce.copy_from_slice(&body[16..48]);
                let tag = proof(
                    params,
                    b"acceptor",
                    peer,
                    params.rank,
                    &dialer_nonce,
                    &nonce,
                )
                .finalize()
                .into_bytes();
                let mut reply = [0; 65];
                reply[0] = 2;
                reply[1..33].copy_from_slice(&nonce);
                reply[33..65].copy_from_slice(&tag);
                self.state = AcceptorState::AwaitProof {
                    peer,
                    dialer_nonce,
                    acceptor_nonce: nonce,
                };
                Ok(AcceptorStep::Reply(OutFrame::new(
                    FrameKind::Hello,
                    params,
                    &reply,
                )))
            }
            AcceptorState::AwaitProof {
                peer,
                dialer_nonce,
                acceptor_nonce,
            } => {
                let body = expect_step(params, header, payload, 3, 33)?;
                if header.source_rank != peer {
                    return Err(Refusal::Malformed.into());
                }
                proof(
                    params,
                    b"dialer",
                    peer,
                    params.rank,
                    &dialer_nonce,
                    &acceptor_nonce,
                )
                .verify_slice(body)
                .map_err(|_| Refusal::WrongSecret)?;
                Ok(AcceptorStep::Admit { peer })
            }
            AcceptorState::Finished => Err(Refusal::Malformed.into()),
        }
    }
}

/// The acceptor's last frame: the dialer is admitted.
pub fn welcome_frame(params: &HandshakeParams) -> OutFrame {
    OutFrame::new(FrameKind::Hello, params, &[4])
}

/// The dialing side of a handshake.
pub struct Dialer {
    target: u32,
    state: DialerState,
}

enum DialerState {
    AwaitChallenge { dialer_nonce: [u8; 32] },
    AwaitWelcome,
    Finished,
}

/// What the dialer does next.
pub enum DialerStep {
    /// Send this frame and wait for the next.
    Reply(OutFrame),
    /// Admitted: the connection now carries the fabric's traffic.
    Admitted,
}

impl Dialer {
    /// Starts a handshake with `target`; returns the dialer and its first frame.
    pub fn start(params: &HandshakeParams, target: u32, nonce: [u8; 32]) -> (Dialer, OutFrame) {
        let mut hello = [0; 49];
        hello[0] = 1;
        hello[1..9].copy_from_slice(&params.epoch.to_le_bytes());
        hello[9..13].copy_from_slice(&target.to_le_bytes());
        hello[13..17].copy_from_slice(&params.world_size.to_le_bytes());
        hello[17..49].copy_from_slice(&nonce);
        (
            Dialer {
                target,
                state: DialerState::AwaitChallenge {
                    dialer_nonce: nonce,
                },
            },
            OutFrame::new(FrameKind::Hello, params, &hello),
        )
    }

    /// Handles one frame from the acceptor.
    pub fn on_frame(
        &mut self,
        params: &HandshakeParams,
        header: &FrameHeader,
        payload: &[u8],
    ) -> Result<DialerStep, Failure> {
        let from_target = |header: &FrameHeader| {
            if header.source_rank == self.target || header.kind == FrameKind::Abort {
                Ok(())
            } else {
                Err(Failure::from(Refusal::WrongTarget {
                    wanted: self.target,
                    actual: header.source_rank,
                }))
            }
        };
        match core::mem::replace(&mut self.state, DialerState::Finished) {
            DialerState::AwaitChallenge { dialer_nonce } => {
                from_target(header)?;
                let body = expect_step(params, header, payload, 2, 65)?;
                let mut acceptor_nonce = [0; 32];
                acceptor_nonce.copy_from_slice(&body[..32]);
                proof(
                    params,
                    b"acceptor",
                    params.rank,
                    self.target,
                    &dialer_nonce,
                    &acceptor_nonce,
                )
                .verify_slice(&body[32..64])
                .map_err(|_| Refusal::WrongSecret)?;
                let tag = proof(
                    params,
                    b"dialer",
                    params.rank,
                    self.target,
                    &dialer_nonce,
                    &acceptor_nonce,
                )
                .finalize()
                .into_bytes();
                let mut reply = [0; 33];
                reply[0] = 3;
                reply[1..].copy_from_slice(&tag);
                self.state = DialerState::AwaitWelcome;
                Ok(DialerStep::Reply(OutFrame::new(
                    FrameKind::Hello,
                    params,
                    &reply,
                )))
            }
            DialerState::AwaitWelcome => {
                from_target(header)?;
                expect_step(params, header, payload, 4, 1)?;
                Ok(DialerStep::Admitted)
            }
            DialerState::Finished => Err(Refusal::Malformed.into()),
        }
    }
}

/// Accumulates one handshake frame from a byte stream: a header, then at most
/// [`MAX_HANDSHAKE_PAYLOAD`] bytes of payload. Anything else is refused before
/// more than a header's worth of bytes is read.
pub struct HelloReader {
    bytes: [u8; HEADER_LEN + MAX_HANDSHAKE_PAYLOAD],
    have: usize,
    want: usize,
}

impl Default for HelloReader {
    fn default() -> Self {
        HelloReader::new()
    }
}

impl HelloReader {
    /// A reader waiting for a frame's first byte.
    pub fn new() -> HelloReader {
        HelloReader {
            bytes: [0; HEADER_LEN + MAX_HANDSHAKE_PAYLOAD],
            have: 0,
            want: HEADER_LEN,
        }
    }

    /// Where the next bytes go; never empty while a frame is incomplete.
    pub fn buffer(&mut self) -> &mut [u8] {
        &mut self.bytes[self.have..self.want]
    }

    /// Records `n` bytes read into [`HelloReader::buffer`]. Returns the frame once
    /// complete (and resets for the next one).
    pub fn filled(&mut self, n: usize) -> Result<Option<(FrameHeader, &[u8])>, Refusal> {
        self.have += n;
        debug_assert!(self.have <= self.want);
        if self.have < self.want {
            return Ok(None);
        }
        let mut raw = [0; HEADER_LEN];
        raw.copy_from_slice(&self.bytes[..HEADER_LEN]);
        let header = FrameHeader::decode(&raw).map_err(Refusal::Garbage)?;
        let len = usize::try_from(header.payload_len).unwrap_or(usize::MAX);
        if len > MAX_HANDSHAKE_PAYLOAD {
            return Err(Refusal::Malformed);
        }
        if self.want == HEADER_LEN && len > 0 {
            self.want = HEADER_LEN + len;
            return Ok(None);
        }
        let end = self.want;
        self.have = 0;
        self.want = HEADER_LEN;
        Ok(Some((header, &self.bytes[HEADER_LEN..end])))
    }
}
