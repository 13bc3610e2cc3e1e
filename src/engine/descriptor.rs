//! What a rank says about each operation, so that ranks can check they issued the
//! same one, and what a failing rank tells the others.
//!
//! # Mismatch detection
//!
//! Every rank publishes a [`Descriptor`] of each operation when its engine accepts
//! it: into the machine's shared segment for its local ranks, and in a
//! [`Kind::Descriptor`](super::tags::Kind) message to every rank on another machine
//! that it writes to, ahead of any data of the operation. A rank then
//!
//! - starts no slice of operation `s` before every local rank's descriptor of `s`
//!   is published and equal to its own (shared memory is the only way local data
//!   reaches it);
//! - compares each remote descriptor as it arrives, or as it accepts `s` if the
//!   peer is ahead; a remote peer's data follows its descriptor on the same
//!   ordered connection, so no remote data of `s` is combined unchecked;
//! - reports `s` finished only once every remote rank that writes to it has
//!   confirmed `s`.
//!
//! Local ranks compare all with all; machines compare along rails and the ring.
//! Every rank's result depends on data that crossed only checked links, so a
//! mismatch anywhere stops every rank before a wrong result is reported. The
//! rank that finds it fails, and its failure reaches everyone (below).
//!
//! # Failure propagation
//!
//! A failing rank writes a [`Failure`] record (64 bytes, the largest message a
//! fabric carries) into the shared segment and sends it in a `Kind::Abort`
//! message to every rank it is linked to. A rank that reads one fails with the
//! error it describes and passes it on, so a failure floods the job through the
//! links the operations use, and no rank waits for a peer that has given up.

use fairring_core::{DataType, ReduceOp};

use crate::config::Algorithm;
use crate::error::Error;

/// What a collective call was, as descriptors name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Collective {
    AllReduce = 1,
    Broadcast = 2,
    AllGather = 3,
    ReduceScatter = 4,
    Barrier = 5,
}

impl Collective {
    fn from_u8(v: u8) -> Option<Collective> {
        Some(match v {
            1 => Collective::AllReduce,
            2 => Collective::Broadcast,
            3 => Collective::AllGather,
            4 => Collective::ReduceScatter,
            5 => Collective::Barrier,
            _ => return None,
        })
    }

    fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::Broadcast => "broadcast",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
            Collective::Barrier => "barrier",
        }
    }
}

/// One operation as the caller issued it (not as the engine runs it: a broadcast
/// runs as a byte-wise all-reduce, but its descriptor says broadcast).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Descriptor {
    pub(crate) collective: Collective,
    pub(crate) dtype: DataType,
    pub(crate) op: ReduceOp,
    /// The algorithm that runs it (never `Auto`: every rank resolves it alike).
    pub(crate) algorithm: Algorithm,
    /// The root of a broadcast; 0 otherwise.
    pub(crate) root: u32,
    /// Elements per rank as the caller counts them (a broadcast's tensor, an
    /// all-gather's input, a reduce-scatter's output).
    pub(crate) elements: u64,
}

/// A descriptor packed into two words.
///
/// ```text
/// word 0: elements
/// word 1: bits  0..8   collective
///         bits  8..16  dtype discriminant
///         bits 16..24  op discriminant
///         bits 24..32  algorithm (1 hierarchical, 2 ring)
///         bits 32..64  root
/// ```
pub(crate) type Words = [u64; 2];

fn algorithm_code(a: Algorithm) -> u64 {
    match a {
        Algorithm::Hierarchical => 1,
        Algorithm::Ring => 2,
        Algorithm::Auto => 3,
    }
}

impl Descriptor {
    pub(crate) fn words(&self) -> Words {
        [
            self.elements,
            self.collective as u64
                | u64::from(self.dtype as u8) << 8
                | u64::from(self.op as u8) << 16
                | algorithm_code(self.algorithm) << 24
                | u64::from(self.root) << 32,
        ]
    }

    pub(crate) fn from_words(w: Words) -> Option<Descriptor> {
        let byte = |shift: u32| ((w[1] >> shift) & 0xff) as u8;
        Some(Descriptor {
            collective: Collective::from_u8(byte(0))?,
            dtype: DataType::from_u8(byte(8))?,
            op: ReduceOp::from_u8(byte(16))?,
            algorithm: match byte(24) {
                1 => Algorithm::Hierarchical,
                2 => Algorithm::Ring,
                3 => Algorithm::Auto,
                _ => return None,
            },
            root: (w[1] >> 32) as u32,
            elements: w[0],
        })
    }

    /// Text for errors, e.g. `all_reduce of 1024 x f32 (sum, hierarchical)`.
    pub(crate) fn describe(w: Words) -> String {
        match Descriptor::from_words(w) {
            Some(d) => d.to_string(),
            None => format!(
                "an operation this rank cannot decode ({:#x}, {:#x})",
                w[0], w[1]
            ),
        }
    }
}

impl std::fmt::Display for Descriptor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c = self.collective.name();
        match self.collective {
            Collective::Barrier => write!(f, "barrier ({})", self.algorithm),
            Collective::Broadcast => write!(
                f,
                "{c} of {} x {} from rank {} ({})",
                self.elements, self.dtype, self.root, self.algorithm
            ),
            Collective::AllGather => write!(
                f,
                "{c} of {} x {} per rank ({})",
                self.elements, self.dtype, self.algorithm
            ),
            Collective::AllReduce | Collective::ReduceScatter => write!(
                f,
                "{c} of {} x {} ({}, {})",
                self.elements, self.dtype, self.op, self.algorithm
            ),
        }
    }
}

/// Bytes of a failure record.
pub(crate) const FAILURE_BYTES: usize = 64;

/// A failure as it travels between ranks.
///
/// ```text
/// byte 0        1: a rank failed, 2: a mismatch
/// failed:       bytes 1..5 the rank the error names, 5..7 reason length,
///               7..64 the reason (UTF-8, cut at a character boundary)
/// mismatch:     bytes 8..16 sequence, 16..20 rank, 20..36 its words,
///               36..40 peer, 40..56 its words
/// ```
pub(crate) struct Failure;

fn u32_at(b: &[u8; FAILURE_BYTES], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8; FAILURE_BYTES], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

impl Failure {
    /// The record of a mismatch at operation `sequence` between `rank`, which
    /// issued `words`, and `peer`, which issued `peer_words`; and its error.
    pub(crate) fn mismatch(
        sequence: u64,
        rank: u32,
        words: Words,
        peer: u32,
        peer_words: Words,
    ) -> ([u8; FAILURE_BYTES], Error) {
        let mut b = [0u8; FAILURE_BYTES];
        b[0] = 2;
        b[8..16].copy_from_slice(&sequence.to_le_bytes());
        b[16..20].copy_from_slice(&rank.to_le_bytes());
        b[20..28].copy_from_slice(&words[0].to_le_bytes());
        b[28..36].copy_from_slice(&words[1].to_le_bytes());
        b[36..40].copy_from_slice(&peer.to_le_bytes());
        b[40..48].copy_from_slice(&peer_words[0].to_le_bytes());
        b[48..56].copy_from_slice(&peer_words[1].to_le_bytes());
        let error = Failure::decode(&b, rank);
        (b, error)
    }

    /// The record of any other `error`, found by rank `me`.
    pub(crate) fn encode(error: &Error, me: u32) -> [u8; FAILURE_BYTES] {
        let (about, reason) = match error {
            Error::Peer { rank, reason } => (*rank, reason.clone()),
            Error::Failed { first } => return Failure::encode(first, me),
            other => (me, other.to_string()),
        };
        let mut b = [0u8; FAILURE_BYTES];
        b[0] = 1;
        b[1..5].copy_from_slice(&about.to_le_bytes());
        let mut cut = reason.len().min(FAILURE_BYTES - 7);
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        #[expect(clippy::cast_possible_truncation, reason = "at most 57")]
        let len = cut as u16;
        b[5..7].copy_from_slice(&len.to_le_bytes());
        b[7..7 + cut].copy_from_slice(&reason.as_bytes()[..cut]);
        b
    }

    /// The error a record describes, as rank `from` reported it.
    pub(crate) fn decode(b: &[u8; FAILURE_BYTES], from: u32) -> Error {
        match b[0] {
            2 => {
                let words = [u64_at(b, 20), u64_at(b, 28)];
                let peer_words = [u64_at(b, 40), u64_at(b, 48)];
                Error::Mismatch {
                    sequence: u64_at(b, 8),
                    rank: u32_at(b, 16),
                    called: Descriptor::describe(words),
                    peer: u32_at(b, 36),
                    peer_called: Descriptor::describe(peer_words),
                }
            }
            1 => {
                let about = u32_at(b, 1);
                let len = usize::from(u16::from_le_bytes([b[5], b[6]])).min(FAILURE_BYTES - 7);
                let reason = String::from_utf8_lossy(&b[7..7 + len]);
                let via = if about == from {
                    String::new()
                } else {
                    format!(" (reported by rank {from})")
                };
                Error::peer(about, format!("failed: {reason}{via}"))
            }
            _ => Error::peer(from, "failed, for a reason this rank cannot decode"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_round_trip_and_read_well() {
        let d = Descriptor {
            collective: Collective::Broadcast,
            dtype: DataType::BF16,
            op: ReduceOp::Sum,
            algorithm: Algorithm::Ring,
            root: 7,
            elements: 1 << 40,
        };
        assert_eq!(Descriptor::from_words(d.words()), Some(d));
        assert_eq!(
            d.to_string(),
            "broadcast of 1099511627776 x bf16 from rank 7 (ring)"
        );
        assert!(Descriptor::from_words([0, 0]).is_none());
    }

    #[test]
    fn failures_round_trip() {
        let a = Descriptor {
            collective: Collective::AllReduce,
            dtype: DataType::F32,
            op: ReduceOp::Sum,
            algorithm: Algorithm::Hierarchical,
            root: 0,
            elements: 100,
        };
        let b = Descriptor { elements: 200, ..a };
        let (record, error) = Failure::mismatch(5, 1, a.words(), 3, b.words());
        let text = Failure::decode(&record, 9).to_string();
        assert_eq!(text, error.to_string());
        assert!(text.contains("#5") && text.contains("rank 1 called all_reduce of 100 x f32"));
        assert!(
            text.contains("rank 3 called all_reduce of 200 x f32"),
            "{text}"
        );

        let long = Error::peer(4, "é".repeat(60));
        let decoded = Failure::decode(&Failure::encode(&long, 2), 2);
        let Error::Peer { rank, reason } = decoded else {
            panic!("not a peer error");
        };
        assert_eq!(rank, 4);
        assert!(reason.starts_with("failed: é") && reason.ends_with("(reported by rank 2)"));
        let own = Failure::decode(&Failure::encode(&Error::Aborted, 6), 6);
        assert_eq!(
            own.to_string(),
            "rank 6: failed: the communicator was aborted"
        );
    }
}
