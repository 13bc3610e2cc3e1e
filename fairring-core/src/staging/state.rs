//! The atomic word of one staging buffer.

use super::{Actions, Event, Role, StagingError, Word};
use crate::sync::{AtomicU64, Ordering};

/// The shared state of one staging buffer: a [`Word`] in an `AtomicU64`.
///
/// Any thread may call any method at any time; every successful change is one
/// compare-and-swap through [`Word::on_event`] or [`Word::acquire`], the one
/// transition function. Refused calls change nothing.
#[derive(Debug)]
pub struct StagingState {
    word: AtomicU64,
}

/// One recorded transition: the state before and after, and the actions handed out.
/// For tracing (`old => new`) and tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transition {
    /// The state the event was applied to.
    pub before: Word,
    /// The state it left (the next generation's free state after a release).
    pub after: Word,
    /// The actions the caller must now perform.
    pub actions: Actions,
}

impl StagingState {
    /// A free buffer at generation 0.
    pub fn new() -> StagingState {
        StagingState {
            word: AtomicU64::new(Word::FREE.to_bits()),
        }
    }

    /// The current state.
    pub fn load(&self) -> Word {
        Word::from_bits(self.word.load(Ordering::Acquire))
    }

    /// Acquires the buffer for `generation` with `role`, or says why not (still in
    /// use, another generation, an invalid role).
    pub fn acquire(&self, generation: u64, role: Role) -> Result<Word, StagingError> {
        let mut current = self.word.load(Ordering::Acquire);
        loop {
            let next = Word::from_bits(current).acquire(generation, role)?;
            match self.word.compare_exchange_weak(
                current,
                next.to_bits(),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(next),
                Err(actual) => current = actual,
            }
        }
    }

    /// Records `event` for `generation` and returns the actions the caller must now
    /// perform (often none).
    pub fn on_event(&self, event: Event, generation: u64) -> Result<Actions, StagingError> {
        self.apply(event, generation).map(|t| t.actions)
    }

    /// [`StagingState::on_event`], also returning the states before and after.
    pub fn apply(&self, event: Event, generation: u64) -> Result<Transition, StagingError> {
        let mut current = self.word.load(Ordering::Acquire);
        loop {
            let before = Word::from_bits(current);
            let (after, actions) = before.on_event(event, generation)?;
            // AcqRel: this event's data movement happens-before the swap, and the
            // swap that completes a stage predicate observes every earlier event's
            // (see the module docs on memory ordering).
            match self.word.compare_exchange_weak(
                current,
                after.to_bits(),
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    return Ok(Transition {
                        before,
                        after,
                        actions,
                    });
                }
                Err(actual) => current = actual,
            }
        }
    }
}

impl Default for StagingState {
    fn default() -> StagingState {
        StagingState::new()
    }
}
