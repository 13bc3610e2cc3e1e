//! Who drives: the progress thread, or a caller that waits; and the handshake
//! that keeps them from competing for a core.
//!
//! While a caller waits it drives the engine itself, and the progress thread
//! **parks**: it sleeps on a bell of its own ([`Parking`]), which no doorbell,
//! completion or local rank rings, so that a small blocking all-reduce runs on one
//! thread per process. The progress thread wakes, unparks and drives again:
//!
//! - when the last waiter leaves with work outstanding (that work has no driver);
//! - when a submission comes while nobody waits and [`UNATTENDED`] after the last
//!   wait returned (the caller is not in a loop of blocking calls);
//! - when it looks again after a nap ([`PARK`]) and no caller has entered a wait
//!   since its last look;
//! - when the engine stops.
//!
//! A submission sooner than [`UNATTENDED`] after a wait (a caller in a loop of
//! blocking calls, which will wait for it) leaves the progress thread parked: the
//! caller's wait drives it, or the progress thread within `2 * PARK`.
//!
//! # Why no needed wake-up is lost
//!
//! - **A submission and an unparking thread.** The submitter queues, then a
//!   `SeqCst` fence, then reads `parked`; the unparking thread clears `parked`,
//!   then a `SeqCst` fence, then drives (reads the queue). Whichever fence comes
//!   first, the other side sees its write: the submitter sees the thread unparked
//!   and rings its doorbell, or the thread's drive finds the submission.
//! - **A thread about to park.** It reads its bell's count *before* it checks
//!   for waiters, so a ring after the check wakes its first nap at once; after
//!   it publishes `parked` (and a fence) it looks at the waiters once more, and
//!   runs on if the last one just left: a submission that saw `parked` still clear
//!   rang the doorbell, which a running thread hears.
//! - **A waiter and a completion.** A waiting caller reads its doorbell's count
//!   before it looks whether its operation is done; a completion rings the
//!   doorbell after marking the operation done, so the caller sees it done or
//!   sleeps for no more than the ring.
//! - **Two drivers.** A thread that finds the driver taken does not sleep: the
//!   other pass may have looked at the queue just before a submission landed.
//!   It spins and tries again, and sleeps only after a pass of its own found
//!   nothing to do.
//! - **Stopping.** The stop is published before the bells ring, and the
//!   progress thread looks at it after reading a bell's count and before it
//!   sleeps on that count: it sees the stop, or the ring ends its sleep.
//! - **The last waiter leaving.** It decrements `waiters`, then a `SeqCst` fence,
//!   then reads `outstanding`; a submitter from another thread increments
//!   `outstanding` before its fence and reads `waiters` after it: one of the two
//!   sees the other and rings the bell (an attended submission excepted, above).
//!
//! The loom models in `loom_models.rs` check each of these over the code below,
//! with naps that never time out, so that a lost wake-up shows as a deadlock.

use std::time::{Duration, Instant};

use crate::error::Result;
use crate::shm::Doorbell;
use crate::sync::{AtomicBool, AtomicU32, AtomicU64, Ordering, fence, unmodelled, yield_now};

/// How long the progress thread spins before it sleeps.
pub(crate) const SPIN: Duration = Duration::from_micros(20);
/// How long a waiting caller spins before it sleeps: long enough to cover the
/// skew between ranks arriving at a small all-reduce, so that its latency is that
/// of shared memory and not of a wake-up.
pub(crate) const WAIT_SPIN: Duration = Duration::from_micros(100);
/// Pure spinning before a spinner starts yielding its core each round, on a
/// machine with fewer cores than local ranks, so that the ranks it waits for get
/// to run.
const SPIN_ALONE: Duration = Duration::from_micros(2);
/// With a core per local rank, the most pure spinning before a spinner yields
/// each round. The scheduler may still put two ranks on one core (on the
/// 2-core development machine, about one 1x2 run in six): a rank that spins
/// without yielding then holds the core its answer needs until its spin ends,
/// and 1x2 4 KiB all-reduces took 236-240 us. So the bound adapts between
/// [`SPIN_ALONE`] and this ([`Parking::spun`]): it halves after every wait
/// that outlasted it and doubles after every one that ended sooner. Two
/// ranks made to share one core (`taskset`) while the engine counts a core
/// each, 1x2 4 KiB: 240 us spinning purely, 50 us
/// yielding after 20 us, 9.4 us adapting (as when the engine counts one
/// core); on two free cores alike (3.0 against 3.05 us, six alternating
/// rounds; 64 KiB to 16 MiB within 1%). Waits long for other reasons (a slow
/// peer, the network where no fabric thread makes the job crowded) shrink
/// the bound too: such a job then yields its core each round after 2 us,
/// which costs a system call per round and gives the core only to a thread
/// that can run.
const SPIN_BEFORE_YIELDING: Duration = Duration::from_micros(20);
/// How long the progress thread stays parked before it looks again whether a
/// caller still drives. Timer wake-ups are costly on virtual machines: with
/// 200 us, 4 KiB all-reduces on two ranks took 10-50 us; with 5 ms, 2 us.
pub(crate) const PARK: Duration = Duration::from_millis(5);
/// A submission this long after the last wait returned wakes a parked progress
/// thread: the caller is not in a tight loop of blocking calls.
pub(crate) const UNATTENDED: Duration = Duration::from_micros(200);
/// How long a waiting caller sleeps on its doorbell at a time.
const WAIT_NAP: Duration = Duration::from_micros(200);

/// One round of spinning, while less than `limit` has passed since `since`;
/// returns whether it spun. Yields the core once `pure` has passed (after
/// `long`, which may move the thread off a core it shares).
/// Under loom a spinner never spins: every wait is a sleep on a bell.
fn spin_a_little(since: Instant, limit: Duration, pure: Duration, long: impl FnOnce()) -> bool {
    if cfg!(loom) {
        return false;
    }
    let spent = since.elapsed();
    if spent >= limit {
        return false;
    }
    if spent >= pure {
        long();
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
    true
}

/// The shared state of the handshake.
pub(crate) struct Parking {
    /// Callers inside a wait (each drives while it waits).
    waiters: AtomicU32,
    /// How many times a caller entered a wait.
    wait_entries: AtomicU64,
    /// Operations submitted and not finished.
    outstanding: AtomicU64,
    /// Whether the progress thread is parked.
    parked: AtomicBool,
    /// Set once: the progress thread returns.
    shutdown: AtomicBool,
    /// When a wait last returned, in nanoseconds on the caller's clock.
    last_wait_end: AtomicU64,
    /// Pure spinning before a spinner yields, in nanoseconds, where local
    /// ranks have a core each ([`SPIN_BEFORE_YIELDING`]).
    pure_spin: unmodelled::AtomicU64,
    /// What the parked progress thread sleeps on.
    bell: Doorbell,
}

/// The progress thread's own record of its parking.
#[derive(Debug, Default)]
pub(crate) struct ParkState {
    parked: bool,
    /// The bell's count when it last looked.
    seen: u32,
    /// `wait_entries` when it last looked.
    entries: u64,
}

/// What a try at driving came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Drove {
    /// It drove, and something moved.
    Moved,
    /// It drove, and nothing could move.
    Idle,
    /// Another thread drives: nothing is known until it is tried again (a
    /// submission may have landed after the other pass looked), so the caller
    /// must not sleep on it.
    Busy,
}

/// Whom a submission must wake.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wake {
    /// The progress thread runs: ring its doorbell.
    Doorbell,
    /// Nobody (the parked progress thread was rung, or a waiter will drive).
    Nobody,
}

impl Parking {
    pub(crate) fn new() -> Parking {
        Parking {
            waiters: AtomicU32::new(0),
            wait_entries: AtomicU64::new(0),
            outstanding: AtomicU64::new(0),
            parked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            last_wait_end: AtomicU64::new(0),
            pure_spin: unmodelled::AtomicU64::new(nanos(SPIN_BEFORE_YIELDING)),
            bell: Doorbell::new(),
        }
    }

    /// A submission is about to be queued.
    pub(crate) fn submitting(&self) {
        self.outstanding.fetch_add(1, Ordering::AcqRel);
    }

    /// An operation finished, or a submission was not queued after all.
    pub(crate) fn finished(&self) {
        self.outstanding.fetch_sub(1, Ordering::AcqRel);
    }

    /// A submission was queued at `now` (nanoseconds on the waits' clock): whom
    /// to wake.
    pub(crate) fn submitted(&self, now: u64) -> Wake {
        // Pairs with the fence in `unpark`.
        fence(Ordering::SeqCst);
        if !self.parked.load(Ordering::Acquire) {
            return Wake::Doorbell;
        }
        let unattended = u128::from(now.saturating_sub(self.last_wait_end.load(Ordering::Relaxed)))
            > UNATTENDED.as_nanos();
        if unattended && self.waiters.load(Ordering::Relaxed) == 0 {
            self.bell.ring();
        }
        Wake::Nobody
    }

    /// How long a spinner spins before it yields each round.
    fn pure_spin(&self, crowded: bool) -> Duration {
        if crowded {
            return SPIN_ALONE;
        }
        Duration::from_nanos(self.pure_spin.load(unmodelled::Ordering::Relaxed))
    }

    /// A spinner's wait of `waited` ended with something to do: the bound on
    /// pure spinning halves if the wait outlasted it (the answer came only
    /// once the spinner yielded, or late anyway), and doubles if it did not.
    /// Only a heuristic: no ordering rests on it.
    fn spun(&self, waited: Duration) {
        let pure = self.pure_spin.load(unmodelled::Ordering::Relaxed);
        let next = if nanos(waited) >= pure {
            (pure / 2).max(nanos(SPIN_ALONE))
        } else {
            pure.saturating_mul(2).min(nanos(SPIN_BEFORE_YIELDING))
        };
        if next != pure {
            self.pure_spin.store(next, unmodelled::Ordering::Relaxed);
        }
    }

    /// A caller starts to wait (and to drive).
    pub(crate) fn enter_wait(&self) {
        self.waiters.fetch_add(1, Ordering::AcqRel);
        self.wait_entries.fetch_add(1, Ordering::AcqRel);
    }

    /// A caller stops waiting at `now`; the last one to leave with work outstanding
    /// hands it to the progress thread.
    pub(crate) fn leave_wait(&self, now: u64) {
        self.last_wait_end.store(now, Ordering::Relaxed);
        if self.waiters.fetch_sub(1, Ordering::AcqRel) == 1 {
            // Pairs with the fence in `submitted`.
            fence(Ordering::SeqCst);
            if self.outstanding.load(Ordering::Relaxed) > 0 {
                self.bell.ring();
            }
        }
    }

    /// Tells the progress thread to stop, and wakes it if it is parked.
    pub(crate) fn stop(&self) {
        self.shutdown.store(true, Ordering::Release);
        self.bell.ring();
    }

    /// Whether the progress thread should return.
    pub(crate) fn stopping(&self) -> bool {
        self.shutdown.load(Ordering::Acquire)
    }

    /// The progress thread, at the top of its loop: parks while callers drive.
    /// Returns whether it was parked (it then loops without driving).
    pub(crate) fn park_while_callers_drive(&self, st: &mut ParkState, nap: Duration) -> bool {
        if !st.parked {
            // Read before looking at the waiters (and at `shutdown`): a ring after
            // this wakes the nap.
            let seen = self.bell.seen();
            if self.stopping() || self.waiters.load(Ordering::Acquire) == 0 {
                return false;
            }
            self.parked.store(true, Ordering::Release);
            fence(Ordering::SeqCst);
            if self.waiters.load(Ordering::Relaxed) == 0 {
                // The last waiter left meanwhile: run on.
                self.unpark(st);
                return false;
            }
            *st = ParkState {
                parked: true,
                seen,
                entries: self.wait_entries.load(Ordering::Acquire),
            };
        }
        self.bell.sleep(st.seen, nap);
        let seen = self.bell.seen();
        let entries = self.wait_entries.load(Ordering::Acquire);
        let unpark =
            self.waiters.load(Ordering::Acquire) == 0 && (seen != st.seen || entries == st.entries);
        if unpark || self.stopping() {
            self.unpark(st);
        } else {
            st.seen = seen;
            st.entries = entries;
        }
        true
    }

    fn unpark(&self, st: &mut ParkState) {
        st.parked = false;
        self.parked.store(false, Ordering::Relaxed);
        // Pairs with the fence in `submitted`.
        fence(Ordering::SeqCst);
    }
}

/// What the progress loop and a waiting caller drive: the engine, or a model of
/// it in the loom tests.
pub(crate) trait Driven {
    /// The handshake.
    fn parking(&self) -> &Parking;
    /// The doorbell that local ranks, the fabric and completions ring.
    fn doorbell(&self) -> &Doorbell;
    /// Drives if nobody else does.
    fn try_drive(&self) -> Drove;
    /// The progress thread found nothing to do since the doorbell showed `seen`:
    /// sleeps until something may have changed.
    fn idle(&self, seen: u32);
    /// Whether every event the engine waits for rings the doorbell, so the
    /// progress thread may park (otherwise it must keep polling the fabric).
    fn parks(&self) -> bool;
    /// Whether local ranks outnumber cores (spinners yield).
    fn crowded(&self) -> bool;
    /// A spinner has spun past its pure bound and is about to yield: where
    /// local ranks have a core each, it moves off a core it shares with
    /// another local rank (`local::shared_core`).
    fn spins_long(&self) {}
    /// Nanoseconds on the clock of the waits.
    fn now(&self) -> u64;
    /// The calling thread stops spinning and is about to sleep (the fabric's
    /// own thread takes the arrivals again).
    fn spin_ends(&self) {}
    /// A waiting caller returns (the fabric's own thread takes what it left
    /// unwritten).
    fn spinner_leaves(&self) {}
}

/// One try at driving and, if nothing moved, one round of spinning (until `spin`
/// has passed since the last move); returns whether to look again at once (it
/// moved, another thread drives, or it spun) rather than sleep.
fn drive_or_spin(driven: &impl Driven, idle_since: &mut Option<Instant>, spin: Duration) -> bool {
    match driven.try_drive() {
        Drove::Moved => {
            if let Some(since) = idle_since.take()
                && !cfg!(loom)
            {
                driven.parking().spun(since.elapsed());
            }
            true
        }
        Drove::Busy => {
            // The other driver holds the lock for one pass: spin on it, as on the
            // work itself (yield where ranks outnumber cores, and under loom).
            if cfg!(loom) || driven.crowded() {
                yield_now();
            } else {
                std::hint::spin_loop();
            }
            true
        }
        Drove::Idle => {
            let since = *idle_since.get_or_insert_with(Instant::now);
            spin_a_little(
                since,
                spin,
                driven.parking().pure_spin(driven.crowded()),
                || driven.spins_long(),
            )
        }
    }
}

/// The progress thread's loop, until the engine stops.
pub(crate) fn run_progress(driven: &impl Driven) {
    let parking = driven.parking();
    let mut st = ParkState::default();
    let mut idle_since: Option<Instant> = None;
    while !parking.stopping() {
        if driven.parks() && parking.park_while_callers_drive(&mut st, PARK) {
            idle_since = None;
            continue;
        }
        let seen = driven.doorbell().seen();
        // Again after reading the count: a stop that rang before it is seen here,
        // one that rings after it ends the sleep below.
        if parking.stopping() {
            break;
        }
        if drive_or_spin(driven, &mut idle_since, SPIN) {
            continue;
        }
        driven.spin_ends();
        driven.idle(seen);
    }
}

/// A caller's wait: drives while the driver is free, until `done` says so or
/// `timeout` passes; returns whether it is done.
pub(crate) fn wait_driving(
    driven: &impl Driven,
    mut done: impl FnMut() -> Result<bool>,
    timeout: Option<Duration>,
) -> Result<bool> {
    let parking = driven.parking();
    parking.enter_wait();
    let start = Instant::now();
    let mut idle_since: Option<Instant> = None;
    let result = loop {
        // Read before looking: a completion after this ends the sleep below.
        let seen = driven.doorbell().seen();
        match done() {
            Ok(true) => break Ok(true),
            Err(e) => break Err(e),
            Ok(false) => {}
        }
        if timeout.is_some_and(|t| start.elapsed() >= t) {
            break Ok(false);
        }
        if drive_or_spin(driven, &mut idle_since, WAIT_SPIN) {
            continue;
        }
        driven.spin_ends();
        driven.doorbell().sleep(seen, WAIT_NAP);
    };
    driven.spinner_leaves();
    parking.leave_wait(driven.now());
    result
}

/// `d` in nanoseconds, saturated.
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn pure_spinning_shrinks_after_long_waits_and_grows_back_after_short_ones() {
        let p = Parking::new();
        assert_eq!(p.pure_spin(false), SPIN_BEFORE_YIELDING);
        assert_eq!(p.pure_spin(true), SPIN_ALONE, "crowded: always short");
        // Answers that come only after a yield (two ranks on one core).
        for _ in 0..10 {
            p.spun(SPIN_BEFORE_YIELDING * 2);
        }
        assert_eq!(p.pure_spin(false), SPIN_ALONE, "never below SPIN_ALONE");
        p.spun(Duration::from_micros(3));
        assert_eq!(p.pure_spin(false), SPIN_ALONE, "and stays at the floor");
        // Answers within the pure spin (a core each).
        for _ in 0..10 {
            p.spun(Duration::from_nanos(500));
        }
        assert_eq!(
            p.pure_spin(false),
            SPIN_BEFORE_YIELDING,
            "never above the bound"
        );
        p.spun(Duration::from_micros(12));
        assert_eq!(
            p.pure_spin(false),
            SPIN_BEFORE_YIELDING,
            "a shorter wait keeps it"
        );
        p.spun(SPIN_BEFORE_YIELDING);
        assert_eq!(
            p.pure_spin(false),
            SPIN_BEFORE_YIELDING / 2,
            "one as long halves it"
        );
    }
}
