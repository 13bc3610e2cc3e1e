//! The lock-free state machine of one staging buffer.
//!
//! Every slice in flight owns one staging buffer on every device. While it does, many
//! things finish at once, on many threads, in any order: this device's intra-machine
//! reduce-scatter, its sends of contributions to the servers of its shards, the
//! contributions other machines send to the shard it serves (one may land before its
//! own reduce-scatter ends), its reduction, its sends of the result, the results it
//! receives from the other servers, its intra-machine all-gather. Each finished piece
//! of work is an [`Event`]. [`StagingState::on_event`] records it with one
//! compare-and-swap on one 64-bit word and returns the [`Actions`] that this event
//! made possible: the caller must now perform them. Each action of a slice is
//! returned to exactly one caller, exactly once.
//!
//! # The protocol of one slice
//!
//! The buffer is **acquired** for a generation with the device's [`Role`] in the slice
//! (from [`Slice::role`](crate::plan::Slice::role): how many contributions it sends
//! and receives, how many results it sends and receives, whether it reduces). Then:
//!
//! | action | handed out when | the caller then | and reports |
//! |---|---|---|---|
//! | [`START_CONTRIBUTIONS`](Actions::START_CONTRIBUTIONS) | the reduce-scatter is done (and there is something to send) | sends each shard of its slot to that shard's server | one `ContributionSent` per send |
//! | [`START_REDUCE`](Actions::START_REDUCE) | the reduce-scatter is done and every contribution has arrived | reduces the served shard in place in the slot | `Reduced` |
//! | [`START_SEND_BACK`](Actions::START_SEND_BACK) | the served shard is reduced | sends it to every other machine | one `ResultSent` per send |
//! | [`START_ALL_GATHER`](Actions::START_ALL_GATHER) | the slot is final: every result is in, and its own shard is reduced (if it serves one) | runs the intra-machine all-gather | `AllGatherDone` |
//! | [`RELEASE`](Actions::RELEASE) | the all-gather is done and every send has completed | the buffer is free for the next generation already; the caller may grant credits for it | nothing |
//!
//! **Through a tree** ([`Role::forwards`]): where cells travel through a
//! [`DoubleTree`](crate::plan::DoubleTree) instead of straight to a server, a
//! device's *served shard* is its cell of the tree in which its machine is an
//! inner node: it receives its children's contributions (at most two) and reduces
//! them into the cell, as a server does. Below the root that sum is partial, and
//! the order changes:
//!
//! | action | handed out when | the caller then | and reports |
//! |---|---|---|---|
//! | [`START_SEND_UP`](Actions::START_SEND_UP) | the shard is reduced | sends the partial sum to the parent | `PartialSent` |
//! | [`START_SEND_BACK`](Actions::START_SEND_BACK) | the parent's result has landed over the shard | sends it down to the children | one `ResultSent` per child |
//!
//! and the slot is final only once the parent's result is in. A tree's root is a
//! server of its children, and a leaf's cell is a contribution sent at the
//! reduce-scatter whose result comes back: both follow the first table.
//!
//! Events arriving from the network (`ContributionReceived`, `ResultReceived`) are
//! reported by whoever sees them land. An event that completes an action's work is
//! legal only once that action was handed out (a `Reduced` before `START_REDUCE` is an
//! error), and events that contradict the role (a contribution received by a device
//! that serves nothing), repeat a one-shot event, or exceed the role's counts are
//! errors too: they are rejected without changing the state, never absorbed.
//!
//! **Flow control.** A peer may write into this buffer only for a generation it has
//! been granted, and the engine grants generation `g` only after acquiring the buffer
//! for `g`. So nothing lands in a buffer before it is acquired, and
//! [`StagingError::NotAcquired`] reports a peer that broke that rule.
//!
//! # Why each action is handed out exactly once
//!
//! Each action has a *stage predicate* over the word ("the reduce-scatter is done and
//! no contribution is outstanding", ...). Every predicate is monotone while the buffer
//! is in use: flags are only ever set and countdowns only ever decrease. An action is
//! returned by the one transition that turns its predicate from false to true; since
//! every transition is a single successful compare-and-swap, transitions are totally
//! ordered, and exactly one of them is that edge. `RELEASE` resets the word to the
//! next generation's free state in the same compare-and-swap, so a late event for the
//! old generation finds a different generation and is refused.
//!
//! # Memory ordering
//!
//! Every event is the completion of some data movement into or out of the buffer, and
//! the action it enables consumes that data (the reduction reads the contributions,
//! the all-gather reads the results). The compare-and-swap is `AcqRel`: the event's
//! data writes happen-before the successful swap, which happens-before the action
//! performed by whichever thread's swap completes the predicate. The loom models in
//! `tests/loom_staging.rs` check this with tracked cells.
//!
//! # Generation wrap-around
//!
//! The word keeps the generation modulo 2^8 ([`GENERATION_BITS`]); callers pass the
//! full 64-bit generation (for buffer `b` of `B`, slice number `n` has generation
//! `n / B`). An event whose generation differs from the buffer's only in the bits
//! above those 11 would be taken for the current one. That cannot happen to a
//! correct engine:
//! - local completions (sends, reduce, reduce-scatter, all-gather) are reported for
//!   the generation they were started in, and the buffer cannot be released, let
//!   alone reused, before every one of them has been reported;
//! - remote frames name their operation and slice; the engine accepts them only for
//!   operations inside its window of in-flight operations, and credits keep every
//!   peer within one generation of this buffer, far less than 256 generations apart.
//!
//! # Limits
//!
//! Countdowns have 12 bits: a device waits on at most 4095 other machines, which is
//! why [`MAX_MACHINES`](crate::topology::MAX_MACHINES) is 4096.
//!
//! # Targets
//!
//! [`StagingState`] needs 64-bit atomics and is absent on targets without them
//! (`thumbv7em`, for instance); the pure transition function ([`Word`]) and the
//! [`reference`](mod@reference) model are everywhere.

pub mod reference;
#[cfg(target_has_atomic = "64")]
mod state;
mod word;

#[cfg(target_has_atomic = "64")]
pub use state::{StagingState, Transition};
pub use word::{Counter, GENERATION_BITS, Word};

use crate::named_enum::named_enum;
use core::fmt;

named_enum! {
    /// Something that finished on a staging buffer.
    pub enum Event {
        /// This device's part of the intra-machine reduce-scatter is done: its slot holds
        /// the machine's partial sum.
        ReduceScatterDone = 0 => "reduce-scatter done",
        /// One contribution this device sent has left the buffer.
        ContributionSent = 1 => "contribution sent",
        /// One other machine's contribution to the shard this device serves has landed.
        ContributionReceived = 2 => "contribution received",
        /// The served shard is reduced.
        Reduced = 3 => "reduced",
        /// One result this device sent has left the buffer.
        ResultSent = 4 => "result sent",
        /// One other server's result has landed in the slot.
        ResultReceived = 5 => "result received",
        /// This device's part of the intra-machine all-gather is done.
        AllGatherDone = 6 => "all-gather done",
        /// The partial sum this device reduced has left for its parent.
        PartialSent = 7 => "partial sum sent",
        /// The parent's result for the shard this device reduced as a partial sum
        /// has landed, over it.
        ParentResultReceived = 8 => "parent's result received",
    }
}

bitflags::bitflags! {
    /// What the caller of [`StagingState::on_event`] must now do. Usually empty or one
    /// action; `Reduced` can hand out both `START_SEND_BACK` and `START_ALL_GATHER`
    /// when every result is already in.
    #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
    pub struct Actions: u8 {
        /// Send each shard of the slot to the machine that serves it.
        const START_CONTRIBUTIONS = 1 << 0;
        /// Reduce the served shard: every contribution has arrived.
        const START_REDUCE = 1 << 1;
        /// Send the reduced shard back to every other machine.
        const START_SEND_BACK = 1 << 2;
        /// Run the intra-machine all-gather: the slot is final.
        const START_ALL_GATHER = 1 << 3;
        /// The buffer was released and is free for the next generation.
        const RELEASE = 1 << 4;
        /// Send the reduced shard, a partial sum, up to the parent.
        const START_SEND_UP = 1 << 5;
    }
}

/// What one device does in one slice: the counts its buffer waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct Role {
    /// Contributions it sends: one per shard of its slot served by another machine.
    pub contributions_to_send: u16,
    /// Contributions it receives: `M - 1` if it reduces, else 0.
    pub contributions_to_receive: u16,
    /// Results it sends back: `M - 1` if it reduces, else 0.
    pub results_to_send: u16,
    /// Results it receives: one per shard of its slot served by another machine.
    pub results_to_receive: u16,
    /// Whether it serves (reduces) a shard of this slice on behalf of other machines.
    pub reduces: bool,
    /// Whether what it reduces is a partial sum that goes up to a parent, whose
    /// result comes back before the results go out (an inner node of a tree below
    /// its root); only with `reduces`.
    pub forwards: bool,
}

impl Role {
    /// A device with nothing to exchange (an empty slot, or a single machine): the
    /// buffer goes straight from the reduce-scatter to the all-gather.
    pub const IDLE: Role = Role {
        contributions_to_send: 0,
        contributions_to_receive: 0,
        results_to_send: 0,
        results_to_receive: 0,
        reduces: false,
        forwards: false,
    };

    /// Whether the role is one a buffer can complete: every count fits its 12-bit
    /// countdown, a device receives contributions and sends results exactly when
    /// it reduces, and only a device that reduces forwards.
    pub const fn is_valid(&self) -> bool {
        let max = (1u16 << Counter::BITS) - 1;
        self.contributions_to_send <= max
            && self.contributions_to_receive <= max
            && self.results_to_send <= max
            && self.results_to_receive <= max
            && (self.reduces == (self.contributions_to_receive > 0))
            && (self.reduces == (self.results_to_send > 0))
            && (self.reduces || !self.forwards)
    }
}

/// Why an acquire or an event was refused. The state is unchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StagingError {
    /// Acquire of a buffer still in use.
    Busy {
        /// The generation asked for.
        generation: u64,
        /// The state found.
        state: Word,
    },
    /// An event for a generation that is not the buffer's current one: stale (the
    /// slice already released the buffer) or from the future.
    WrongGeneration {
        /// The event, or `None` for an acquire.
        event: Option<Event>,
        /// The generation given.
        generation: u64,
        /// The state found.
        state: Word,
    },
    /// An event for the right generation before the buffer was acquired for it.
    NotAcquired {
        /// The event.
        event: Event,
        /// The state found.
        state: Word,
    },
    /// An event the device's role never produces (a contribution received by a device
    /// that reduces nothing).
    NotInRole {
        /// The event.
        event: Event,
        /// The state found.
        state: Word,
    },
    /// An event that completes an action not yet handed out (a `Reduced` before
    /// `START_REDUCE`).
    OutOfOrder {
        /// The event.
        event: Event,
        /// The state found.
        state: Word,
    },
    /// A one-shot event seen twice, or more counted events than the role has.
    Duplicate {
        /// The event.
        event: Event,
        /// The state found.
        state: Word,
    },
    /// Acquire with a role that fails [`Role::is_valid`].
    InvalidRole {
        /// The role given.
        role: Role,
    },
}

/// The kind of a [`StagingError`], without its details.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StagingErrorKind {
    /// [`StagingError::Busy`].
    Busy,
    /// [`StagingError::WrongGeneration`].
    WrongGeneration,
    /// [`StagingError::NotAcquired`].
    NotAcquired,
    /// [`StagingError::NotInRole`].
    NotInRole,
    /// [`StagingError::OutOfOrder`].
    OutOfOrder,
    /// [`StagingError::Duplicate`].
    Duplicate,
    /// [`StagingError::InvalidRole`].
    InvalidRole,
}

impl StagingError {
    /// The kind of error.
    pub const fn kind(&self) -> StagingErrorKind {
        match self {
            StagingError::Busy { .. } => StagingErrorKind::Busy,
            StagingError::WrongGeneration { .. } => StagingErrorKind::WrongGeneration,
            StagingError::NotAcquired { .. } => StagingErrorKind::NotAcquired,
            StagingError::NotInRole { .. } => StagingErrorKind::NotInRole,
            StagingError::OutOfOrder { .. } => StagingErrorKind::OutOfOrder,
            StagingError::Duplicate { .. } => StagingErrorKind::Duplicate,
            StagingError::InvalidRole { .. } => StagingErrorKind::InvalidRole,
        }
    }
}

impl fmt::Display for StagingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StagingError::Busy { generation, state } => write!(
                f,
                "cannot acquire staging buffer for generation {generation}: still in use ({state})"
            ),
            StagingError::WrongGeneration {
                event: Some(event),
                generation,
                state,
            } => write!(
                f,
                "{event} for generation {generation} does not match the staging buffer ({state})"
            ),
            StagingError::WrongGeneration {
                event: None,
                generation,
                state,
            } => write!(
                f,
                "cannot acquire staging buffer for generation {generation} ({state})"
            ),
            StagingError::NotAcquired { event, state } => {
                write!(
                    f,
                    "{event} before the staging buffer was acquired ({state})"
                )
            }
            StagingError::NotInRole { event, state } => write!(
                f,
                "{event} on a device whose role in the slice has no such event ({state})"
            ),
            StagingError::OutOfOrder { event, state } => write!(
                f,
                "{event} before the action it completes was started ({state})"
            ),
            StagingError::Duplicate { event, state } => {
                write!(f, "{event} once more than the slice expects ({state})")
            }
            StagingError::InvalidRole { role } => {
                write!(f, "invalid role for a staging buffer: {role:?}")
            }
        }
    }
}

impl core::error::Error for StagingError {}
