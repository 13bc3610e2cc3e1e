//! What the engine writes in a write's immediate and a post's token.
//!
//! **Immediate** (32 bits, delivered with the peer's `Landed` completion):
//!
//! ```text
//! bits  0..4   kind (Kind)
//! bits  4..16  staging buffer index (so at most 4096 buffers)
//! bits 16..24  the slice's generation on that buffer, mod 2^8 (the staging
//!              word's GENERATION_BITS)
//! bits 24..32  the part of the cell it carries (a hierarchical write through
//!              the trees: fairring-core's `Cell::part`), or the words it
//!              belongs to in groups (`algorithm/two_level.rs`: 0 within a
//!              group, 1 + 2 i + j across); 0 otherwise
//! ```
//!
//! A message's data lays out bits 4..32 its own way (below:
//! [`message_immediate`], [`eager_immediate`]), as its token bits 4..64.
//!
//! Landings carry no address: the receiver knows where each kind lands from the
//! buffer, the generation and (for the ring) the order in which one peer's
//! writes arrive, which both providers keep.
//!
//! **Token** (64 bits, returned in the poster's `Sent` completion):
//!
//! ```text
//! bits  0..4   kind
//! bits  4..16  staging buffer index
//! bits 16..24  part, as in the immediate
//! bits 24..64  generation mod 2^40 (no buffer sees 2^40 slices)
//! ```

use fairring_core::staging::GENERATION_BITS;

/// Most staging buffers the encoding can name.
pub(crate) const MAX_BUFFERS: u32 = 1 << 12;

/// Parts of a cell the encoding can name.
pub(crate) const MAX_PARTS: u32 = 1 << 8;

/// Bits of a generation a token carries.
const TOKEN_GENERATION_BITS: u32 = 40;

/// What a write or message is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Kind {
    /// A hierarchical contribution to a served shard.
    Contribution = 1,
    /// A hierarchical reduced shard, sent back.
    Result = 2,
    /// A ring reduce-scatter chunk.
    RingReduce = 3,
    /// A ring all-gather chunk.
    RingGather = 4,
    /// A credit: the sender may be written up to the slice in the payload.
    Credit = 5,
    /// A goodbye: the sender finished the operations below the payload's count and
    /// is closing; its connection closing next is not a failure.
    Bye = 6,
    /// The sender's descriptor of one operation (see `descriptor`), sent before
    /// any of the operation's data, so that the receiver compares it first.
    Descriptor = 7,
    /// The sender has failed; the payload says why (see `descriptor::Failure`).
    Abort = 8,
    /// A relayed chunk of a broadcast or all-gather.
    Relay = 9,
    /// A recursive-doubling partial (or an extra rank's fold, or its result).
    Doubling = 10,
    /// A reduce-scatter's partial piece, on its way around the ring to the rank
    /// whose share it is.
    Scatter = 11,
    /// A slice's bytes written into the receiver's tensor, through the window
    /// the receiver opened for the operation (`engine/direct.rs`): a relayed
    /// chunk, or a hierarchical result. Nothing to copy out of staging.
    IntoTensor = 12,
    /// A hierarchical partial sum, sent up a tree to the parent, or in groups
    /// a group's partial sum of a piece, sent across to the piece's holder,
    /// where it lands as a contribution (its own kind so that its sender
    /// tells it from a contribution of a leaf's cell, or of a range within
    /// its group, when the send completes).
    Partial = 13,
    /// A chunk of a point-to-point message, written into the receiver's
    /// tensor; the rest of its immediate is the receive's id, the rest of
    /// its token the send's (`engine/messages`).
    MessageData = 14,
    /// A control message of point-to-point messages (`messages/wire.rs`).
    MessageControl = 15,
}

impl Kind {
    /// Whether it is a write of a slice's data (naming a buffer and a generation),
    /// not a control message.
    pub(crate) fn is_data(self) -> bool {
        matches!(
            self,
            Kind::Contribution
                | Kind::Partial
                | Kind::Result
                | Kind::RingReduce
                | Kind::RingGather
                | Kind::Relay
                | Kind::IntoTensor
                | Kind::Doubling
                | Kind::Scatter
        )
    }

    /// Whether it is a write of the hierarchical all-reduce, which may carry a
    /// part of a cell (the immediate's part).
    pub(crate) fn is_hierarchical(self) -> bool {
        matches!(self, Kind::Contribution | Kind::Partial | Kind::Result)
    }

    /// Whether a peer may write it before this rank's slice has started: the
    /// writes that need the slice's credit, not the slice itself.
    pub(crate) fn lands_early(self) -> bool {
        matches!(
            self,
            Kind::Contribution
                | Kind::Partial
                | Kind::RingReduce
                | Kind::Relay
                | Kind::IntoTensor
                | Kind::Doubling
                | Kind::Scatter
        )
    }

    fn from_bits(bits: u32) -> Option<Kind> {
        Some(match bits {
            1 => Kind::Contribution,
            2 => Kind::Result,
            3 => Kind::RingReduce,
            4 => Kind::RingGather,
            5 => Kind::Credit,
            6 => Kind::Bye,
            7 => Kind::Descriptor,
            8 => Kind::Abort,
            9 => Kind::Relay,
            10 => Kind::Doubling,
            11 => Kind::Scatter,
            12 => Kind::IntoTensor,
            13 => Kind::Partial,
            14 => Kind::MessageData,
            15 => Kind::MessageControl,
            _ => return None,
        })
    }
}

const GEN_MASK: u64 = (1 << GENERATION_BITS) - 1;

/// The immediate of a write of `kind` into buffer `buffer` for `generation`.
pub(crate) fn immediate(kind: Kind, buffer: u32, generation: u64, part: u32) -> u32 {
    debug_assert!(buffer < MAX_BUFFERS && part < MAX_PARTS);
    let g = (generation & GEN_MASK) as u32;
    kind as u32 | (buffer & (MAX_BUFFERS - 1)) << 4 | g << 16 | (part & (MAX_PARTS - 1)) << 24
}

/// `imm` (an immediate of [`immediate`]) with its kind replaced by `kind`.
pub(crate) fn with_kind(imm: u32, kind: Kind) -> u32 {
    imm & !15 | kind as u32
}

/// Whether a landing with immediate `imm` wrote into the receiver's tensor
/// (an eager send lands in a slot, to be copied).
pub(crate) fn lands_in_tensor(imm: u32) -> bool {
    match parse_immediate(imm) {
        Some((Kind::IntoTensor, ..)) => true,
        Some((Kind::MessageData, ..)) => u64::from(imm) & EAGER == 0,
        _ => false,
    }
}

/// Whether immediate `imm` or token `token` is of a message's data.
pub(crate) fn is_message_data(bits: u64) -> bool {
    bits & 15 == Kind::MessageData as u64
}

// A message's data: bit 4 of its immediate and token says whether it is a
// chunk written into the receiver's tensor (0) or an eager send written
// into one of the receiver's eager slots (1):
//
//   chunk immediate  kind | 0 << 4 | receive id mod 2^27 << 5
//   eager immediate  kind | 1 << 4 | slot << 5
//   chunk token      kind | 0 << 4 | send id << 5
//   eager token      kind | 1 << 4 | slot << 5 | send id << 10

/// Bits of a receive's id a chunk's immediate carries.
pub(crate) const MESSAGE_ID_BITS: u32 = 27;

/// Eager slots a message's immediate and token can name.
pub(crate) const EAGER_SLOTS_MAX: u32 = 32;

const EAGER: u64 = 1 << 4;

/// The immediate of a chunk of a message for receive `receive` (its id's
/// low [`MESSAGE_ID_BITS`] bits).
pub(crate) fn message_immediate(receive: u64) -> u32 {
    let id = u32::try_from(receive & ((1 << MESSAGE_ID_BITS) - 1)).unwrap_or(0);
    Kind::MessageData as u32 | id << 5
}

/// The token of a chunk of send `send` (its id, below 2^59).
pub(crate) fn message_token(send: u64) -> u64 {
    Kind::MessageData as u64 | send << 5
}

/// The immediate of an eager send written into the receiver's slot `slot`.
pub(crate) fn eager_immediate(slot: u32) -> u32 {
    debug_assert!(slot < EAGER_SLOTS_MAX);
    Kind::MessageData as u32 | 1 << 4 | slot << 5
}

/// The token of eager send `send` (its id, below 2^54) through slot `slot`.
pub(crate) fn eager_token(send: u64, slot: u32) -> u64 {
    debug_assert!(slot < EAGER_SLOTS_MAX);
    Kind::MessageData as u64 | EAGER | u64::from(slot) << 5 | send << 10
}

/// What a message data immediate or token (widened) names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum MessageBits {
    /// A chunk: the receive's id mod 2^27 (an immediate) or the send's id (a
    /// token).
    Chunk(u64),
    /// An eager send through `slot`; `send` its id (a token; 0 in an
    /// immediate).
    Eager { slot: u32, send: u64 },
}

/// Decodes the rest of a message data immediate or token.
pub(crate) fn message_bits(bits: u64) -> MessageBits {
    if bits & EAGER == 0 {
        MessageBits::Chunk(bits >> 5)
    } else {
        #[expect(clippy::cast_possible_truncation, reason = "five bits")]
        let slot = ((bits >> 5) & u64::from(EAGER_SLOTS_MAX - 1)) as u32;
        MessageBits::Eager {
            slot,
            send: bits >> 10,
        }
    }
}

/// Decodes an immediate: kind, buffer, generation mod 2^8, part.
pub(crate) fn parse_immediate(imm: u32) -> Option<(Kind, u32, u64, u32)> {
    let kind = Kind::from_bits(imm & 15)?;
    Some((
        kind,
        (imm >> 4) & (MAX_BUFFERS - 1),
        u64::from(imm >> 16) & GEN_MASK,
        imm >> 24,
    ))
}

/// The token of a post.
pub(crate) fn token(kind: Kind, buffer: u32, generation: u64, part: u32) -> u64 {
    debug_assert!(part < MAX_PARTS);
    kind as u64
        | u64::from(buffer & (MAX_BUFFERS - 1)) << 4
        | u64::from(part & (MAX_PARTS - 1)) << 16
        | generation << 24
}

/// Decodes a token: kind, buffer, generation mod 2^40, part.
pub(crate) fn parse_token(token: u64) -> Option<(Kind, u32, u64, u32)> {
    let (kind, buffer) = ((token & 15) as u32, ((token >> 4) & 0xfff) as u32);
    Some((
        Kind::from_bits(kind)?,
        buffer,
        token >> 24,
        ((token >> 16) & 0xff) as u32,
    ))
}

/// Whether `generation` (full width) matches one carried mod 2^8.
pub(crate) fn same_generation(full: u64, carried: u64) -> bool {
    full & GEN_MASK == carried
}

/// Whether `generation` (full width) matches a token's, carried mod 2^40.
pub(crate) fn same_token_generation(full: u64, carried: u64) -> bool {
    full & ((1 << TOKEN_GENERATION_BITS) - 1) == carried
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        for kind in [
            Kind::Contribution,
            Kind::Result,
            Kind::RingReduce,
            Kind::RingGather,
            Kind::Credit,
            Kind::Bye,
            Kind::Descriptor,
            Kind::Abort,
            Kind::Relay,
            Kind::Doubling,
            Kind::Scatter,
            Kind::IntoTensor,
            Kind::Partial,
        ] {
            for buffer in [0, 1, 77, MAX_BUFFERS - 1] {
                for generation in [0u64, 1, 2047, 2048, 123_456_789, (1 << 40) + 5] {
                    for part in [0, 1, MAX_PARTS - 1] {
                        let imm = immediate(kind, buffer, generation, part);
                        let (k, b, g, p) = parse_immediate(imm).unwrap();
                        assert_eq!((k, b, p), (kind, buffer, part));
                        assert!(same_generation(generation, g));
                        assert!(!same_generation(generation + 1, g));
                        let other = with_kind(imm, Kind::Relay);
                        assert_eq!(parse_immediate(other).unwrap(), (Kind::Relay, b, g, p));
                        let (k, b, g, p) =
                            parse_token(token(kind, buffer, generation, part)).unwrap();
                        assert_eq!((k, b, p), (kind, buffer, part));
                        assert!(same_token_generation(generation, g));
                        assert!(!same_token_generation(generation + 1, g));
                    }
                }
            }
        }
        assert!(parse_immediate(0).is_none());
        let id = (1 << MESSAGE_ID_BITS) - 1;
        let imm = message_immediate(id | 1 << 40);
        assert!(is_message_data(u64::from(imm)) && lands_in_tensor(imm));
        assert_eq!(message_bits(u64::from(imm)), MessageBits::Chunk(id));
        let token = message_token(1 << 50);
        assert!(is_message_data(token));
        assert_eq!(message_bits(token), MessageBits::Chunk(1 << 50));
        for slot in [0, 1, EAGER_SLOTS_MAX - 1] {
            let imm = eager_immediate(slot);
            assert!(is_message_data(u64::from(imm)) && !lands_in_tensor(imm));
            let send = 0;
            assert_eq!(
                message_bits(u64::from(imm)),
                MessageBits::Eager { slot, send }
            );
            let send = (1 << 53) + 3;
            let token = eager_token(send, slot);
            assert!(is_message_data(token));
            assert_eq!(message_bits(token), MessageBits::Eager { slot, send });
        }
        assert!(!is_message_data(u64::from(immediate(Kind::Relay, 3, 1, 0))));
    }
}
