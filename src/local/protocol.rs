//! The counter protocol of the shared-memory step: when a local rank may read what
//! another wrote, and when it may overwrite what others read.
//!
//! Every local rank owns `B` staging buffers and three monotone counters per buffer,
//! each holding `slice number + 1` of the last slice it announced:
//!
//! | counter | published after | lets the other ranks |
//! |---|---|---|
//! | [`Counter::InputReady`] | the rank staged the slots others reduce | read those slots (reduce-scatter) |
//! | [`Counter::SlotFinal`] | the rank's own slot holds the final values | read that slot (all-gather) |
//! | [`Counter::Done`] | the rank stopped reading others' buffers for the slice | overwrite their buffer with slice `s + B` |
//!
//! A counter is published with a `Release` store after the data it announces is
//! written, and read with an `Acquire` load before the data is read: the
//! release/acquire pair orders every byte. Each rank writes only its own buffer, and
//! only while no other rank reads the bytes it writes: slice `s` takes a buffer only
//! once every rank's `Done` covers slice `s - B`.
//!
//! A slice every rank reduces whole ([`Protocol::try_reduce_whole`]) reads
//! every rank's input after `InputReady` and announces `SlotFinal` and `Done`
//! together: it has no all-gather.
//!
//! The functions here hold the order of those steps and their memory orderings; the
//! data movement between them is the caller's (a closure). They reach the counters
//! through [`Counters`], which the shared segment implements with its atomics, and
//! the loom model (`local/loom_models.rs`) with loom's, so that the orderings checked
//! there are the ones that ship.

use crate::sync::unmodelled::Ordering;

/// Which progress counter (its index among a buffer's counters in the segment).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Counter {
    /// Slice number + 1 whose input this rank has staged.
    InputReady = 0,
    /// Slice number + 1 whose slot this rank has finished.
    SlotFinal = 1,
    /// Slice number + 1 this rank has finished reading others' buffers for.
    Done = 2,
}

impl Counter {
    /// Every counter, in the order a slice publishes them.
    pub(crate) const ALL: [Counter; 3] = [Counter::InputReady, Counter::SlotFinal, Counter::Done];
}

/// Where the counters of a machine's local ranks are.
pub(crate) trait Counters {
    /// Local ranks.
    fn ranks(&self) -> u32;
    /// Stores `value` into `rank`'s counter `which` of `buffer`.
    fn store(&self, rank: u32, buffer: u32, which: Counter, value: u64, order: Ordering);
    /// Loads `rank`'s counter `which` of `buffer`.
    fn load(&self, rank: u32, buffer: u32, which: Counter, order: Ordering) -> u64;
    /// Wakes `rank` (rings its doorbell).
    fn wake(&self, rank: u32);
}

/// One local rank's side of the protocol.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Protocol {
    /// This rank's index on its machine.
    pub(crate) rank: u32,
    /// Staging buffers per rank.
    pub(crate) buffers: u32,
}

impl Protocol {
    /// Whether `buffer` may take slice `slice`: every rank is done with the slice
    /// it held before.
    pub(crate) fn buffer_free(&self, c: &impl Counters, buffer: u32, slice: u64) -> bool {
        let b = u64::from(self.buffers);
        slice < b || self.all_reached(c, buffer, slice - b + 1, Counter::Done)
    }

    /// Stage in: `write` fills this rank's buffer with what the others reduce from
    /// it; then the rank announces `InputReady`.
    pub(crate) fn stage_in<E>(
        &self,
        c: &impl Counters,
        buffer: u32,
        slice: u64,
        write: impl FnOnce() -> Result<(), E>,
    ) -> Result<(), E> {
        write()?;
        self.publish(c, buffer, slice, Counter::InputReady);
        Ok(())
    }

    /// Reduce-scatter: once every rank's input is staged, `reduce` reads this
    /// rank's slot of every other rank's buffer. Returns whether it ran.
    pub(crate) fn try_reduce_scatter<E>(
        &self,
        c: &impl Counters,
        buffer: u32,
        slice: u64,
        reduce: impl FnOnce() -> Result<(), E>,
    ) -> Result<bool, E> {
        if !self.all_reached(c, buffer, slice + 1, Counter::InputReady) {
            return Ok(false);
        }
        reduce()?;
        Ok(true)
    }

    /// A slice every rank reduces whole (a small one, in a job of one
    /// machine): once every rank's input is staged, `reduce` reads what it
    /// needs of every rank's buffer; then the rank announces, at once, that
    /// its slot is final and that it is done with the others' buffers. No
    /// all-gather follows, so one wait per slice remains instead of two.
    /// Returns whether it ran.
    pub(crate) fn try_reduce_whole<E>(
        &self,
        c: &impl Counters,
        buffer: u32,
        slice: u64,
        reduce: impl FnOnce() -> Result<(), E>,
    ) -> Result<bool, E> {
        let ran = self.try_reduce_scatter(c, buffer, slice, reduce)?;
        if ran {
            // `SlotFinal` too, so that `laggards` of a later stall reads the
            // counters as it does for any slice; only `Done` is waited for.
            c.store(
                self.rank,
                buffer,
                Counter::SlotFinal,
                slice + 1,
                Ordering::Release,
            );
            self.publish(c, buffer, slice, Counter::Done);
        }
        Ok(ran)
    }

    /// Announces that this rank's slot of the slice is final.
    pub(crate) fn publish_slot(&self, c: &impl Counters, buffer: u32, slice: u64) {
        self.publish(c, buffer, slice, Counter::SlotFinal);
    }

    /// All-gather: once every rank's slot is final, `gather` reads the slots it
    /// needs; then the rank announces `Done`. Returns whether it ran.
    pub(crate) fn try_all_gather<E>(
        &self,
        c: &impl Counters,
        buffer: u32,
        slice: u64,
        gather: impl FnOnce() -> Result<(), E>,
    ) -> Result<bool, E> {
        let ran = self.try_all_gather_started(c, buffer, slice, gather)?;
        if ran {
            self.publish(c, buffer, slice, Counter::Done);
        }
        Ok(ran)
    }

    /// All-gather whose reads end later (copies a GPU makes from the other
    /// ranks' buffers): once every rank's slot is final, `gather` starts them;
    /// the rank announces `Done` with [`finish`](Protocol::finish) once they
    /// have ended. Returns whether it ran.
    pub(crate) fn try_all_gather_started<E>(
        &self,
        c: &impl Counters,
        buffer: u32,
        slice: u64,
        gather: impl FnOnce() -> Result<(), E>,
    ) -> Result<bool, E> {
        if !self.all_reached(c, buffer, slice + 1, Counter::SlotFinal) {
            return Ok(false);
        }
        gather()?;
        Ok(true)
    }

    /// Announces that this rank's input of the slice is staged, once the
    /// copies that stage it have ended (a GPU's): the second half of
    /// [`stage_in`](Protocol::stage_in).
    pub(crate) fn staged_in(&self, c: &impl Counters, buffer: u32, slice: u64) {
        self.publish(c, buffer, slice, Counter::InputReady);
    }

    /// Announces `Done` without an all-gather (an algorithm that does not use the
    /// local step), or once an all-gather's reads have ended.
    pub(crate) fn finish(&self, c: &impl Counters, buffer: u32, slice: u64) {
        self.publish(c, buffer, slice, Counter::Done);
    }

    /// The ranks that have not yet announced slice `slice` on `buffer`, at the
    /// first counter some rank has not reached: what a stalled slice waits for.
    pub(crate) fn laggards(&self, c: &impl Counters, buffer: u32, slice: u64) -> Vec<u32> {
        for which in Counter::ALL {
            let behind: Vec<u32> = (0..c.ranks())
                .filter(|&r| c.load(r, buffer, which, Ordering::Acquire) <= slice)
                .collect();
            if !behind.is_empty() {
                return behind;
            }
        }
        Vec::new()
    }

    /// Publishes `which` for `slice` (release: everything written before is
    /// visible to a rank that reads the counter) and wakes the other ranks.
    fn publish(&self, c: &impl Counters, buffer: u32, slice: u64, which: Counter) {
        c.store(self.rank, buffer, which, slice + 1, Ordering::Release);
        for r in (0..c.ranks()).filter(|&r| r != self.rank) {
            c.wake(r);
        }
    }

    /// Whether every rank's counter `which` of `buffer` has reached `value`
    /// (acquire: what each wrote before publishing is visible after).
    fn all_reached(&self, c: &impl Counters, buffer: u32, value: u64, which: Counter) -> bool {
        (0..c.ranks()).all(|r| c.load(r, buffer, which, Ordering::Acquire) >= value)
    }
}
