//! The packed state word and the one transition function.

use super::{Actions, Event, Role, StagingError};
use core::fmt;

/// Bits of the generation kept in the word (see the module docs on wrap-around).
pub const GENERATION_BITS: u32 = 8;

/// The state of one staging buffer, packed in 64 bits.
///
/// ```text
/// bits  0..12  contributions still to send        (countdown, from Role)
/// bits 12..24  contributions still to receive     (countdown, from Role)
/// bits 24..36  results still to send              (countdown, from Role)
/// bits 36..48  results still to receive           (countdown, from Role)
/// bit  48      IN_USE    acquired for the generation below
/// bit  49      REDUCES   the role serves a shard (from Role)
/// bit  50      RS_DONE   the reduce-scatter is done
/// bit  51      REDUCED   the served shard is reduced
/// bit  52      AG_DONE   the all-gather is done
/// bit  53      FORWARDS  the reduced shard is a partial sum for a parent (from Role)
/// bit  54      PARTIAL_SENT   the partial sum has left for the parent
/// bit  55      PARENT_RESULT  the parent's result for the shard has landed
/// bits 56..64  generation mod 2^8
/// ```
///
/// A free buffer is `IN_USE` clear with every other bit but the generation zero.
/// While in use, flags are only set and countdowns only decrease; releasing clears
/// everything and increments the generation.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Word(u64);

/// One of the four countdowns of a [`Word`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Counter {
    /// Contributions still to send.
    ContributionsToSend = 0,
    /// Contributions still to receive.
    ContributionsToReceive = 1,
    /// Results still to send.
    ResultsToSend = 2,
    /// Results still to receive.
    ResultsToReceive = 3,
}

impl Counter {
    /// Width of each countdown.
    pub const BITS: u32 = 12;
    /// The largest count a countdown holds.
    pub const MAX: u64 = (1 << Self::BITS) - 1;

    const fn shift(self) -> u32 {
        self as u32 * Self::BITS
    }
}

const IN_USE: u64 = 1 << 48;
const REDUCES: u64 = 1 << 49;
const RS_DONE: u64 = 1 << 50;
const REDUCED: u64 = 1 << 51;
const AG_DONE: u64 = 1 << 52;
const FORWARDS: u64 = 1 << 53;
const PARTIAL_SENT: u64 = 1 << 54;
const PARENT_RESULT: u64 = 1 << 55;
const GENERATION_SHIFT: u32 = 56;
const GENERATION_MASK: u64 = (1 << GENERATION_BITS) - 1;

/// What an event does to the word.
#[derive(Clone, Copy)]
enum Effect {
    /// Sets a one-shot flag; a second time is a duplicate.
    Set(u64),
    /// Counts down; below zero is a duplicate.
    CountDown(Counter),
}

/// One row of the table of legal transitions.
#[derive(Clone, Copy)]
struct Rule {
    /// Flags the role must have (else [`StagingError::NotInRole`]).
    role: u64,
    /// The stage that must have begun (else [`StagingError::OutOfOrder`]); empty for
    /// events that may come any time after acquire.
    after: Actions,
    effect: Effect,
}

/// The table of legal transitions, indexed by [`Event`] discriminant. An event is
/// legal when the buffer is in use for its generation, the role has `role`, the
/// `after` stage has begun and the effect does not repeat or overrun.
const RULES: [Rule; 9] = [
    // ReduceScatterDone: any time after acquire, once.
    Rule {
        role: 0,
        after: Actions::empty(),
        effect: Effect::Set(RS_DONE),
    },
    // ContributionSent: after the contributions were started.
    Rule {
        role: 0,
        after: Actions::START_CONTRIBUTIONS,
        effect: Effect::CountDown(Counter::ContributionsToSend),
    },
    // ContributionReceived: any time after acquire (even before our reduce-scatter
    // ends), by a device that reduces.
    Rule {
        role: REDUCES,
        after: Actions::empty(),
        effect: Effect::CountDown(Counter::ContributionsToReceive),
    },
    // Reduced: after the reduce was started, once.
    Rule {
        role: REDUCES,
        after: Actions::START_REDUCE,
        effect: Effect::Set(REDUCED),
    },
    // ResultSent: after the send-back was started.
    Rule {
        role: REDUCES,
        after: Actions::START_SEND_BACK,
        effect: Effect::CountDown(Counter::ResultsToSend),
    },
    // ResultReceived: only after our contributions went out (a server cannot have
    // reduced our shard before); results overwrite the slot.
    Rule {
        role: 0,
        after: Actions::START_CONTRIBUTIONS,
        effect: Effect::CountDown(Counter::ResultsToReceive),
    },
    // AllGatherDone: after the all-gather was started, once.
    Rule {
        role: 0,
        after: Actions::START_ALL_GATHER,
        effect: Effect::Set(AG_DONE),
    },
    // PartialSent: after the send up was started, once, by a device that forwards.
    Rule {
        role: FORWARDS,
        after: Actions::START_SEND_UP,
        effect: Effect::Set(PARTIAL_SENT),
    },
    // ParentResultReceived: only after the partial sum went up (the parent cannot
    // have finished the shard before), once; it overwrites the shard.
    Rule {
        role: FORWARDS,
        after: Actions::START_SEND_UP,
        effect: Effect::Set(PARENT_RESULT),
    },
];

impl Word {
    /// The free word of generation 0: a new buffer.
    pub const FREE: Word = Word(0);

    /// The raw 64 bits.
    pub const fn to_bits(self) -> u64 {
        self.0
    }

    /// The word with these raw bits.
    pub const fn from_bits(bits: u64) -> Word {
        Word(bits)
    }

    /// The free word of `generation`.
    pub const fn free(generation: u64) -> Word {
        Word((generation & GENERATION_MASK) << GENERATION_SHIFT)
    }

    /// The generation, mod 2^[`GENERATION_BITS`].
    pub const fn generation(self) -> u64 {
        self.0 >> GENERATION_SHIFT
    }

    /// Whether the buffer is acquired.
    pub const fn in_use(self) -> bool {
        self.0 & IN_USE != 0
    }

    /// Whether the role reduces a shard.
    pub const fn reduces(self) -> bool {
        self.0 & REDUCES != 0
    }

    /// Whether the reduce-scatter is done.
    pub const fn reduce_scatter_done(self) -> bool {
        self.0 & RS_DONE != 0
    }

    /// Whether the served shard is reduced.
    pub const fn reduced(self) -> bool {
        self.0 & REDUCED != 0
    }

    /// Whether the all-gather is done.
    pub const fn all_gather_done(self) -> bool {
        self.0 & AG_DONE != 0
    }

    /// Whether the role forwards its reduced shard, a partial sum, to a parent.
    pub const fn forwards(self) -> bool {
        self.0 & FORWARDS != 0
    }

    /// Whether the partial sum has left for the parent.
    pub const fn partial_sent(self) -> bool {
        self.0 & PARTIAL_SENT != 0
    }

    /// Whether the shard is final: reduced here with nothing above (or nothing
    /// reduced here), or the parent's result for it has landed.
    const fn shard_final(self) -> bool {
        if self.forwards() {
            self.0 & PARENT_RESULT != 0
        } else {
            self.reduced() || !self.reduces()
        }
    }

    /// What is left on a countdown.
    pub const fn remaining(self, counter: Counter) -> u64 {
        (self.0 >> counter.shift()) & Counter::MAX
    }

    /// The stages that have begun: the stage predicates of the module docs.
    ///
    /// `START_CONTRIBUTIONS` here means the contribution stage has begun (the
    /// reduce-scatter is done), whether or not it had anything to send.
    pub const fn begun(self) -> Actions {
        let rs = self.reduce_scatter_done();
        let mut bits = 0;
        if rs {
            bits |= Actions::START_CONTRIBUTIONS.bits();
        }
        if self.reduces() && rs && self.remaining(Counter::ContributionsToReceive) == 0 {
            bits |= Actions::START_REDUCE.bits();
        }
        if self.forwards() && self.reduced() {
            bits |= Actions::START_SEND_UP.bits();
        }
        if self.reduced() && self.shard_final() {
            bits |= Actions::START_SEND_BACK.bits();
        }
        if rs && self.remaining(Counter::ResultsToReceive) == 0 && self.shard_final() {
            bits |= Actions::START_ALL_GATHER.bits();
        }
        if self.all_gather_done()
            && self.remaining(Counter::ContributionsToSend) == 0
            && self.remaining(Counter::ResultsToSend) == 0
            && (self.partial_sent() || !self.forwards())
        {
            bits |= Actions::RELEASE.bits();
        }
        Actions::from_bits_retain(bits)
    }

    /// Acquire: the in-use word of `generation` for `role`.
    pub const fn acquire(self, generation: u64, role: Role) -> Result<Word, StagingError> {
        if self.in_use() {
            return Err(StagingError::Busy {
                generation,
                state: self,
            });
        }
        if generation & GENERATION_MASK != self.generation() {
            return Err(StagingError::WrongGeneration {
                event: None,
                generation,
                state: self,
            });
        }
        if !role.is_valid() {
            return Err(StagingError::InvalidRole { role });
        }
        let mut bits = self.0 | IN_USE;
        if role.reduces {
            bits |= REDUCES;
        }
        if role.forwards {
            bits |= FORWARDS;
        }
        bits |= (role.contributions_to_send as u64) << Counter::ContributionsToSend.shift();
        bits |= (role.contributions_to_receive as u64) << Counter::ContributionsToReceive.shift();
        bits |= (role.results_to_send as u64) << Counter::ResultsToSend.shift();
        bits |= (role.results_to_receive as u64) << Counter::ResultsToReceive.shift();
        Ok(Word(bits))
    }

    /// The transition function: the word after `event` of `generation`, and the
    /// actions it hands out; or why the event is refused.
    pub const fn on_event(
        self,
        event: Event,
        generation: u64,
    ) -> Result<(Word, Actions), StagingError> {
        if generation & GENERATION_MASK != self.generation() {
            return Err(StagingError::WrongGeneration {
                event: Some(event),
                generation,
                state: self,
            });
        }
        if !self.in_use() {
            return Err(StagingError::NotAcquired { event, state: self });
        }
        let rule = RULES[event as usize];
        if self.0 & rule.role != rule.role {
            return Err(StagingError::NotInRole { event, state: self });
        }
        let before = self.begun();
        if !before.contains(rule.after) {
            return Err(StagingError::OutOfOrder { event, state: self });
        }
        let next = match rule.effect {
            Effect::Set(flag) => {
                if self.0 & flag != 0 {
                    return Err(StagingError::Duplicate { event, state: self });
                }
                Word(self.0 | flag)
            }
            Effect::CountDown(counter) => {
                if self.remaining(counter) == 0 {
                    return Err(StagingError::Duplicate { event, state: self });
                }
                Word(self.0 - (1 << counter.shift()))
            }
        };
        let mut fired = next.begun().difference(before);
        // The contribution stage begins with the reduce-scatter; it is an action only
        // if there is something to send. (No contribution can have been sent before
        // the stage began, so the countdown still holds the role's count.)
        if next.remaining(Counter::ContributionsToSend) == 0 {
            fired = fired.difference(Actions::START_CONTRIBUTIONS);
        }
        if fired.contains(Actions::RELEASE) {
            return Ok((Word::free(self.generation() + 1), fired));
        }
        Ok((next, fired))
    }
}

impl fmt::Display for Word {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.in_use() {
            return write!(
                f,
                "free, generation {} mod 2^{GENERATION_BITS}",
                self.generation()
            );
        }
        write!(
            f,
            "generation {} mod 2^{GENERATION_BITS}, {}reduce-scatter {}, ",
            self.generation(),
            match (self.reduces(), self.forwards()) {
                (true, true) => "reducing for a parent, ",
                (true, false) => "serving, ",
                _ => "",
            },
            if self.reduce_scatter_done() {
                "done"
            } else {
                "pending"
            },
        )?;
        write!(
            f,
            "to send {} contributions and {} results, to receive {} contributions and {} results",
            self.remaining(Counter::ContributionsToSend),
            self.remaining(Counter::ResultsToSend),
            self.remaining(Counter::ContributionsToReceive),
            self.remaining(Counter::ResultsToReceive),
        )?;
        if self.reduced() {
            f.write_str(", reduced")?;
        }
        if self.partial_sent() {
            f.write_str(", partial sum sent")?;
        }
        if self.0 & PARENT_RESULT != 0 {
            f.write_str(", parent's result in")?;
        }
        if self.all_gather_done() {
            f.write_str(", all-gather done")?;
        }
        Ok(())
    }
}

impl fmt::Debug for Word {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Word({:#018x}: {self})", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SERVER: Role = Role {
        contributions_to_send: 1,
        contributions_to_receive: 2,
        results_to_send: 2,
        results_to_receive: 1,
        reduces: true,
        forwards: false,
    };

    /// An inner node of a tree below the root: two children, a parent, and a
    /// leaf cell in the other tree.
    const INNER: Role = Role {
        contributions_to_send: 1,
        contributions_to_receive: 2,
        results_to_send: 2,
        results_to_receive: 1,
        reduces: true,
        forwards: true,
    };

    #[test]
    fn an_inner_node_sends_up_after_reducing_and_down_after_its_parent() {
        let mut w = Word::FREE.acquire(0, INNER).unwrap();
        let mut step = |e| {
            let (next, actions) = w.on_event(e, 0).unwrap();
            w = next;
            actions
        };
        assert_eq!(step(Event::ContributionReceived), Actions::empty());
        // The leaf cell leaves at once; the shard waits for the second child.
        assert_eq!(step(Event::ReduceScatterDone), Actions::START_CONTRIBUTIONS);
        assert_eq!(step(Event::ContributionReceived), Actions::START_REDUCE);
        assert_eq!(step(Event::ResultReceived), Actions::empty());
        // Reduced: a partial sum, which goes up, not down.
        assert_eq!(step(Event::Reduced), Actions::START_SEND_UP);
        assert_eq!(step(Event::ContributionSent), Actions::empty());
        assert_eq!(
            step(Event::ParentResultReceived),
            Actions::START_SEND_BACK | Actions::START_ALL_GATHER
        );
        assert_eq!(step(Event::AllGatherDone), Actions::empty());
        assert_eq!(step(Event::ResultSent), Actions::empty());
        assert_eq!(step(Event::ResultSent), Actions::empty());
        assert_eq!(step(Event::PartialSent), Actions::RELEASE);
        assert_eq!(w, Word::free(1));
    }

    #[test]
    fn a_parents_result_before_the_send_up_is_refused() {
        let w = Word::FREE.acquire(0, INNER).unwrap();
        let (w, _) = w.on_event(Event::ReduceScatterDone, 0).unwrap();
        assert!(matches!(
            w.on_event(Event::ParentResultReceived, 0),
            Err(StagingError::OutOfOrder { .. })
        ));
        assert!(matches!(
            w.on_event(Event::PartialSent, 0),
            Err(StagingError::OutOfOrder { .. })
        ));
        let server = Word::FREE.acquire(0, SERVER).unwrap();
        assert!(matches!(
            server.on_event(Event::ParentResultReceived, 0),
            Err(StagingError::NotInRole { .. })
        ));
    }

    #[test]
    fn a_server_slice_in_order() {
        let mut w = Word::FREE.acquire(0, SERVER).unwrap();
        let mut step = |e| {
            let (next, actions) = w.on_event(e, 0).unwrap();
            w = next;
            actions
        };
        assert_eq!(step(Event::ContributionReceived), Actions::empty());
        assert_eq!(step(Event::ReduceScatterDone), Actions::START_CONTRIBUTIONS);
        assert_eq!(step(Event::ContributionReceived), Actions::START_REDUCE);
        assert_eq!(step(Event::ContributionSent), Actions::empty());
        assert_eq!(step(Event::ResultReceived), Actions::empty());
        assert_eq!(
            step(Event::Reduced),
            Actions::START_SEND_BACK | Actions::START_ALL_GATHER
        );
        assert_eq!(step(Event::AllGatherDone), Actions::empty());
        assert_eq!(step(Event::ResultSent), Actions::empty());
        assert_eq!(step(Event::ResultSent), Actions::RELEASE);
        assert_eq!(w, Word::free(1));
    }

    #[test]
    fn refusals_leave_nothing_behind() {
        let w = Word::FREE.acquire(0, SERVER).unwrap();
        assert!(matches!(
            w.on_event(Event::Reduced, 0),
            Err(StagingError::OutOfOrder { .. })
        ));
        assert!(matches!(
            w.on_event(Event::ReduceScatterDone, 1),
            Err(StagingError::WrongGeneration { .. })
        ));
        let (w, _) = w.on_event(Event::ReduceScatterDone, 0).unwrap();
        assert!(matches!(
            w.on_event(Event::ReduceScatterDone, 0),
            Err(StagingError::Duplicate { .. })
        ));
        let idle = Word::FREE.acquire(0, Role::IDLE).unwrap();
        assert!(matches!(
            idle.on_event(Event::ContributionReceived, 0),
            Err(StagingError::NotInRole { .. })
        ));
        assert!(matches!(
            Word::FREE.on_event(Event::ReduceScatterDone, 0),
            Err(StagingError::NotAcquired { .. })
        ));
        assert!(matches!(
            w.acquire(0, SERVER),
            Err(StagingError::Busy { .. })
        ));
    }

    #[test]
    fn idle_role_goes_straight_to_the_all_gather() {
        let w = Word::FREE.acquire(0, Role::IDLE).unwrap();
        let (w, a) = w.on_event(Event::ReduceScatterDone, 0).unwrap();
        assert_eq!(a, Actions::START_ALL_GATHER);
        let (w, a) = w.on_event(Event::AllGatherDone, 0).unwrap();
        assert_eq!(a, Actions::RELEASE);
        assert_eq!(w, Word::free(1));
    }

    #[test]
    fn generation_wraps_after_2_pow_bits() {
        let last = (1u64 << GENERATION_BITS) - 1;
        let w = Word::free(last).acquire(last, Role::IDLE).unwrap();
        let (w, _) = w.on_event(Event::ReduceScatterDone, last).unwrap();
        let (w, _) = w.on_event(Event::AllGatherDone, last).unwrap();
        assert_eq!(w.generation(), 0);
        assert!(w.acquire(last + 1, Role::IDLE).is_ok());
    }
}
