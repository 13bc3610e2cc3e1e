//! What a rank says about each operation, so that ranks can check they issued the
//! same one: the descriptor and its encodings. The checks themselves are in
//! `checks`.
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
//! rank that finds it fails, and its failure reaches everyone (see `failure`).
//!
//! # On the wire
//!
//! A descriptor travels as two little-endian words ([`Words`]); to a remote rank,
//! in a `Kind::Descriptor` message of 24 bytes: the sequence number, then the two
//! words ([`encode_message`], [`decode_message`]). A rank that opened a window
//! for the operation (its tensor, for the peer to write into: `engine/direct.rs`)
//! appends it, 24 more bytes (a `RemoteRegion`; one of no bytes says it has none).

use fairring_core::{DataType, ReduceOp, WireFormat};
use fairring_rdma::fabric::RemoteRegion;

use super::algorithm::Resolved;
pub(crate) use crate::local::Words;
use crate::memory::MemoryKind;

fairring_core::named_enum! {
    /// Which collective a call is (a [`Call`](crate::Call) says which, and
    /// descriptors carry it, as its number, to compare across ranks). The
    /// values are those of the C ABI's `FR_COLLECTIVE_*`.
    pub enum Collective {
        /// Every rank's tensor reduced into every rank's.
        AllReduce = 1 => "all_reduce",
        /// The root's tensor copied into every rank's.
        Broadcast = 2 => "broadcast",
        /// Every rank's input, in rank order, into every rank's output.
        AllGather = 3 => "all_gather",
        /// Every rank's input reduced; each rank's share into its output.
        ReduceScatter = 4 => "reduce_scatter",
        /// Every rank waits for every rank.
        Barrier = 5 => "barrier",
        /// Every rank's tensor reduced into the root's (run as an all-reduce).
        Reduce = 6 => "reduce",
        /// Every rank's input, in rank order, into the root's output (as
        /// messages to the root after a check, or as an all-gather: see
        /// [`Call::gather`](crate::Call::gather)).
        Gather = 7 => "gather",
        /// Each part of the root's input into the output of the rank of its
        /// index (as messages from the root after a check, or as a broadcast
        /// of the whole input: see [`Call::scatter`](crate::Call::scatter)).
        Scatter = 8 => "scatter",
        /// A message to the call's peer, matched by its receive of the same tag
        /// (see [`Call::send`](crate::Call::send)).
        Send = 9 => "send",
        /// A message from the call's peer, of the same tag (see
        /// [`Call::recv`](crate::Call::recv)).
        Recv = 10 => "recv",
    }
}

impl Collective {
    /// The collective the engine runs this one as: a reduce as an
    /// all-reduce, a gather as an all-gather, a scatter as a broadcast; every
    /// other as itself. Algorithms, choices and plans follow this form; the
    /// descriptor keeps the caller's, root included, so that ranks that call
    /// different ones, or name different roots, are told apart.
    pub(crate) fn engine_form(self) -> Collective {
        match self {
            Collective::Reduce => Collective::AllReduce,
            Collective::Gather => Collective::AllGather,
            Collective::Scatter => Collective::Broadcast,
            other => other,
        }
    }

    /// Whether a root takes part in the call.
    pub(crate) fn has_root(self) -> bool {
        matches!(
            self,
            Collective::Broadcast | Collective::Reduce | Collective::Gather | Collective::Scatter
        )
    }
}

/// One operation as the caller issued it (not as the engine runs it: a broadcast
/// runs as a byte-wise all-reduce, but its descriptor says broadcast).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Descriptor {
    pub(crate) collective: Collective,
    pub(crate) dtype: DataType,
    pub(crate) op: ReduceOp,
    /// The algorithm that runs it (every rank resolves `auto` alike).
    pub(crate) algorithm: Resolved,
    /// How its `f32` values travel between machines ([`WireFormat::Exact`] for
    /// every operation that runs exact).
    pub(crate) wire: WireFormat,
    /// Where the caller's tensors live: every rank of an operation passes the
    /// same kind.
    pub(crate) memory: MemoryKind,
    /// The call's data moves as messages once this operation, its check (a
    /// barrier), has passed: a gather, a scatter or a reduce
    /// (`choice::rooted_by_messages`).
    pub(crate) by_messages: bool,
    /// The root of a broadcast, a reduce, a gather or a scatter; 0
    /// otherwise.
    pub(crate) root: u32,
    /// Elements per rank as the caller counts them (a broadcast's or a
    /// reduce's tensor, an all-gather's or a gather's input, a
    /// reduce-scatter's or a scatter's output).
    pub(crate) elements: u64,
}

/// The algorithm's code in a descriptor's word 1.
fn algorithm_code(a: Resolved) -> u64 {
    match a {
        Resolved::Hierarchical => 1,
        Resolved::Ring => 2,
        Resolved::Relay => 3,
        Resolved::Doubling => 4,
        Resolved::Scatter => 5,
        Resolved::Nccl => 6,
        Resolved::Colocated => 7,
        Resolved::Grouped => 8,
    }
}

/// Bytes of a descriptor message.
pub(crate) const MESSAGE_BYTES: usize = 24;

/// Bytes of a descriptor message that also carries the sender's window for
/// the operation (`engine/direct.rs`).
pub(crate) const WINDOW_MESSAGE_BYTES: usize = MESSAGE_BYTES + RemoteRegion::BYTES;

/// The message that carries this rank's descriptor words of operation `seq`,
/// and its window for the operation if it has one (a window of no bytes: it
/// has none, and the operation's writes land in its staging buffers).
/// Returns the buffer and how many of its bytes the message is.
pub(crate) fn encode_message(
    seq: u64,
    words: Words,
    window: Option<RemoteRegion>,
) -> ([u8; WINDOW_MESSAGE_BYTES], usize) {
    let mut payload = [0u8; WINDOW_MESSAGE_BYTES];
    payload[..8].copy_from_slice(&seq.to_le_bytes());
    payload[8..16].copy_from_slice(&words[0].to_le_bytes());
    payload[16..24].copy_from_slice(&words[1].to_le_bytes());
    match window {
        Some(w) => {
            payload[MESSAGE_BYTES..].copy_from_slice(&w.to_bytes());
            (payload, WINDOW_MESSAGE_BYTES)
        }
        None => (payload, MESSAGE_BYTES),
    }
}

/// The operation, words and window a descriptor message carries; `None` if
/// it is not one.
pub(crate) fn decode_message(payload: &[u8]) -> Option<(u64, Words, Option<RemoteRegion>)> {
    let (head, window) = match payload.len() {
        MESSAGE_BYTES => (payload, None),
        WINDOW_MESSAGE_BYTES => (
            &payload[..MESSAGE_BYTES],
            Some(RemoteRegion::from_bytes(&payload[MESSAGE_BYTES..])?),
        ),
        _ => return None,
    };
    let word = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&head[i * 8..i * 8 + 8]);
        u64::from_le_bytes(w)
    };
    Some((word(0), [word(1), word(2)], window))
}

impl Descriptor {
    /// The descriptor packed into two words:
    ///
    /// ```text
    /// word 0: elements
    /// word 1: bits  0..7   collective
    ///         bit   7      the call moves as messages after this check
    ///         bits  8..16  dtype discriminant
    ///         bits 16..24  op discriminant
    ///         bits 24..28  algorithm (1 hierarchical, 2 ring, 3 relay, 4 doubling,
    ///                      5 scatter, 6 nccl, 7 colocated, 8 grouped)
    ///         bits 28..30  wire format discriminant
    ///         bits 30..32  memory (0 host, 1 device)
    ///         bits 32..64  root
    /// ```
    pub(crate) fn words(&self) -> Words {
        [
            self.elements,
            self.collective as u64
                | u64::from(self.by_messages) << 7
                | u64::from(self.dtype as u8) << 8
                | u64::from(self.op as u8) << 16
                | algorithm_code(self.algorithm) << 24
                | u64::from(self.wire as u8) << 28
                | u64::from(self.memory as u8) << 30
                | u64::from(self.root) << 32,
        ]
    }

    pub(crate) fn from_words(w: Words) -> Option<Descriptor> {
        let byte = |shift: u32| ((w[1] >> shift) & 0xff) as u8;
        Some(Descriptor {
            collective: Collective::from_u8(byte(0) & 0x7f)?,
            dtype: DataType::from_u8(byte(8))?,
            op: ReduceOp::from_u8(byte(16))?,
            algorithm: match byte(24) & 0xf {
                1 => Resolved::Hierarchical,
                2 => Resolved::Ring,
                3 => Resolved::Relay,
                4 => Resolved::Doubling,
                5 => Resolved::Scatter,
                6 => Resolved::Nccl,
                7 => Resolved::Colocated,
                8 => Resolved::Grouped,
                _ => return None,
            },
            wire: WireFormat::from_u8((byte(24) >> 4) & 0x3)?,
            memory: MemoryKind::from_u8(byte(24) >> 6)?,
            by_messages: byte(0) & 0x80 != 0,
            root: (w[1] >> 32) as u32,
            elements: w[0],
        })
    }

    /// The operation the engine plans for this call among `world` workers: its
    /// elements, type and operator. Every collective runs as one all-reduce,
    /// but a reduce-scatter that the scatter algorithm runs, which plans each
    /// rank's share (`elements`) and reduces the same range of every share
    /// together. A dedicated server, which sees only descriptors, plans the same
    /// operation from it; `None` if the sizes overflow.
    /// A call whose data moves as messages runs as its check, a barrier. A
    /// send or a receive is no operation (it is never described): `None`.
    pub(crate) fn runs_as(&self, world: u32) -> Option<(u64, DataType, ReduceOp)> {
        if self.by_messages {
            return Some((1, DataType::U8, ReduceOp::Sum));
        }
        let bytes = |elements: u64| elements.checked_mul(self.dtype.size_bytes());
        Some(match self.collective {
            Collective::AllReduce | Collective::Reduce => (self.elements, self.dtype, self.op),
            Collective::Broadcast => (bytes(self.elements)?, DataType::U8, ReduceOp::Sum),
            Collective::Scatter => (
                bytes(self.elements.checked_mul(u64::from(world))?)?,
                DataType::U8,
                ReduceOp::Sum,
            ),
            Collective::AllGather | Collective::Gather => (
                bytes(self.elements.checked_mul(u64::from(world))?)?,
                DataType::U8,
                ReduceOp::Sum,
            ),
            Collective::ReduceScatter if self.algorithm == Resolved::Scatter => {
                (self.elements, self.dtype, self.op)
            }
            Collective::ReduceScatter => (
                self.elements.checked_mul(u64::from(world))?,
                self.dtype,
                self.op,
            ),
            Collective::Barrier => (1, DataType::U8, ReduceOp::Sum),
            Collective::Send | Collective::Recv => return None,
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
            Collective::Barrier => write!(f, "barrier ({}", self.algorithm)?,
            // Never described: a message is no operation.
            Collective::Send | Collective::Recv => {
                return write!(f, "{c} of {} x {}", self.elements, self.dtype);
            }
            Collective::Broadcast => write!(
                f,
                "{c} of {} x {} from rank {} ({}",
                self.elements, self.dtype, self.root, self.algorithm
            )?,
            Collective::AllGather => write!(
                f,
                "{c} of {} x {} per rank ({}",
                self.elements, self.dtype, self.algorithm
            )?,
            Collective::Gather | Collective::Scatter => write!(
                f,
                "{c} of {} x {} per rank, root {} ({}",
                self.elements, self.dtype, self.root, self.algorithm
            )?,
            Collective::Reduce => write!(
                f,
                "{c} of {} x {} to rank {} ({}, {}",
                self.elements, self.dtype, self.root, self.op, self.algorithm
            )?,
            Collective::AllReduce | Collective::ReduceScatter => {
                write!(
                    f,
                    "{c} of {} x {} ({}, {}",
                    self.elements, self.dtype, self.op, self.algorithm
                )?;
                if self.wire != WireFormat::Exact {
                    write!(f, ", {} wire", self.wire)?;
                }
            }
        }
        if self.memory == MemoryKind::Device {
            f.write_str(", device memory")?;
        }
        f.write_str(")")
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
            algorithm: Resolved::Ring,
            wire: WireFormat::Exact,
            memory: MemoryKind::Host,
            by_messages: false,
            root: 7,
            elements: 1 << 40,
        };
        assert_eq!(Descriptor::from_words(d.words()), Some(d));
        assert_eq!(
            d.to_string(),
            "broadcast of 1099511627776 x bf16 from rank 7 (ring)"
        );
        let compressed = Descriptor {
            collective: Collective::AllReduce,
            dtype: DataType::F32,
            op: ReduceOp::Avg,
            algorithm: Resolved::Hierarchical,
            wire: WireFormat::F16,
            memory: MemoryKind::Host,
            by_messages: false,
            root: 0,
            elements: 12,
        };
        assert_eq!(Descriptor::from_words(compressed.words()), Some(compressed));
        assert_ne!(
            compressed.words(),
            Descriptor {
                wire: WireFormat::Bf16,
                ..compressed
            }
            .words()
        );
        assert_eq!(
            compressed.to_string(),
            "all_reduce of 12 x f32 (avg, hierarchical, f16 wire)"
        );
        // Device memory is part of the descriptor, and reads as such.
        let device = Descriptor {
            memory: MemoryKind::Device,
            by_messages: false,
            ..compressed
        };
        assert_eq!(Descriptor::from_words(device.words()), Some(device));
        assert_ne!(device.words(), compressed.words());
        assert_eq!(
            device.to_string(),
            "all_reduce of 12 x f32 (avg, hierarchical, f16 wire, device memory)"
        );
        // Every algorithm round-trips; a reduce-scatter plans its shares under
        // the scatter algorithm and the whole input under the others.
        for algorithm in [
            Resolved::Hierarchical,
            Resolved::Ring,
            Resolved::Relay,
            Resolved::Doubling,
            Resolved::Scatter,
            Resolved::Nccl,
            Resolved::Colocated,
            Resolved::Grouped,
        ] {
            let d = Descriptor {
                collective: Collective::ReduceScatter,
                algorithm,
                ..compressed
            };
            assert_eq!(Descriptor::from_words(d.words()), Some(d));
            let planned = if algorithm == Resolved::Scatter {
                12
            } else {
                36
            };
            assert_eq!(d.runs_as(3), Some((planned, DataType::F32, ReduceOp::Avg)));
            let checked = Descriptor {
                by_messages: true,
                ..d
            };
            assert_eq!(Descriptor::from_words(checked.words()), Some(checked));
            assert_eq!(checked.runs_as(3), Some((1, DataType::U8, ReduceOp::Sum)));
        }
        // An unknown wire format or memory kind is refused, not read as another.
        let mut w = compressed.words();
        w[1] |= 0x3 << 28;
        assert!(Descriptor::from_words(w).is_none());
        let mut w = compressed.words();
        w[1] |= 0x3 << 30;
        assert!(Descriptor::from_words(w).is_none());
        assert!(Descriptor::from_words([0, 0]).is_none());
    }

    #[test]
    fn messages_round_trip_and_refuse_other_lengths() {
        let words = [0x0123_4567_89ab_cdef, 7];
        let (bytes, len) = encode_message(u64::MAX - 3, words, None);
        assert_eq!(len, MESSAGE_BYTES);
        assert_eq!(
            decode_message(&bytes[..len]),
            Some((u64::MAX - 3, words, None))
        );
        let window = RemoteRegion {
            key: 9,
            address: 0x7000,
            len: 1 << 20,
        };
        let (bytes, len) = encode_message(5, words, Some(window));
        assert_eq!(len, WINDOW_MESSAGE_BYTES);
        assert_eq!(
            decode_message(&bytes[..len]),
            Some((5, words, Some(window)))
        );
        assert_eq!(decode_message(&[0; 23]), None);
        assert_eq!(decode_message(&[0; 25]), None);
        assert_eq!(decode_message(&[0; 47]), None);
        // A window whose padding is not zeros is no window.
        let mut bad = bytes;
        bad[WINDOW_MESSAGE_BYTES - 1] = 1;
        assert_eq!(decode_message(&bad[..len]), None);
    }
}
