//! The progress loop: who drives the engine, when, and what happens when a pass
//! fails or stalls.
//!
//! All engine state lives in one [`Driver`] behind a mutex. Whoever holds it
//! *drives* (one pass: `drive`), without ever blocking inside a step. Two kinds of
//! threads drive:
//!
//! - a **progress thread** per communicator ([`Engine::run`]), so that operations
//!   advance while the caller computes; when there is nothing to do it sleeps on
//!   this rank's doorbell, which local ranks ring when they publish progress and
//!   the fabric rings when it queues a completion (a fabric that cannot notify is
//!   waited on instead);
//! - a **waiting caller** ([`Engine::wait`]), which drives itself instead of
//!   sleeping while the driver is free: a small all-reduce then runs start to
//!   finish on the caller's thread, with no thread hand-off. Meanwhile the progress
//!   thread parks ([`park`]), so the two never compete for a core.
//!
//! A pass that fails, or panics, fails the engine ([`Engine::fail_locked`]); a pass
//! that finds nothing to do for longer than the timeout while work is in flight
//! fails it with a timeout naming what it waits for (`stall`).

#[cfg(all(test, loom))]
mod loom_models;
pub(crate) mod park;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::{Duration, Instant};

use fairring_rdma::fabric::{Completion, Fabric};

use super::failure::Fault;
use super::work_table::{DONE, FAILED};
use super::{Driver, Engine};
use crate::error::{Error, Result};
use crate::memory::MemorySpace;
use crate::shm::Doorbell;
use park::{Driven, Drove, Parking};

/// How long the progress thread waits on a fabric that cannot ring the doorbell.
const FABRIC_WAIT: Duration = Duration::from_micros(200);
/// How long the progress thread sleeps on its doorbell with work in flight, and
/// without.
const NAP_BUSY: Duration = Duration::from_millis(1);
const NAP_IDLE: Duration = Duration::from_millis(50);
/// How long it sleeps while a step's fence (device copies) is still to pass:
/// nothing rings the doorbell when a GPU finishes.
const NAP_FENCE: Duration = Duration::from_micros(20);

impl<F: Fabric, M: MemorySpace> Engine<F, M> {
    /// The progress thread's loop (see [`park`]); returns once the engine stops.
    pub(crate) fn run(&self) {
        // A fabric's batch keeps per-thread room (tcp: a list of peers),
        // taken on the thread's first batch: taken now, so that a thread
        // parked while callers drive, which may first drive long after a job
        // is warm, allocates nothing then.
        drop(self.links.fabric.batch());
        park::run_progress(self);
    }

    /// Tells the progress thread to stop, and wakes it wherever it sleeps.
    pub(crate) fn stop_progress(&self) {
        self.parking.stop();
        self.machine.doorbell().ring();
    }

    /// Waits for operation `seq` to finish, driving while the driver is free.
    pub(crate) fn wait(&self, seq: u64, timeout: Option<Duration>) -> Result<bool> {
        park::wait_driving(self, || self.test(seq), timeout)
    }

    /// Whether operation `seq` has finished; its error if it failed.
    pub(crate) fn test(&self, seq: u64) -> Result<bool> {
        match self.works.state(seq) {
            Some(DONE) | None => Ok(true),
            Some(FAILED) => Err(self.failure().unwrap_or(Error::Aborted)),
            _ => Ok(false),
        }
    }

    /// Drives if the driver is free; returns whether anything moved.
    pub(crate) fn try_drive(&self) -> bool {
        self.try_drive_once() == Drove::Moved
    }

    fn try_drive_once(&self) -> Drove {
        let moved = match self.driver.try_lock() {
            Ok(mut d) => self.drive_locked(&mut d),
            Err(std::sync::TryLockError::Poisoned(p)) => self.drive_locked(&mut p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => return Drove::Busy,
        };
        // Nothing to do: before this thread spins or sleeps, it takes what the
        // fabric has received itself (outside the driver lock), which spares a
        // small write's hop the wake-up of the fabric's thread.
        if moved || (self.remote && self.links.fabric.progress()) {
            Drove::Moved
        } else {
            Drove::Idle
        }
    }

    fn drive_locked(&self, d: &mut Driver<M>) -> bool {
        if self.failure.failed() {
            return self.settle_failure(d);
        }
        // What one pass posts to a peer (descriptors, credits, the data behind
        // them) leaves together when the pass ends.
        let _batch = self.links.fabric.batch();
        match self.guarded(d, |e, d| e.drive(d)) {
            Some(true) => {
                d.last_progress = Instant::now();
                true
            }
            Some(false) => {
                // The stall timer runs from an operation's start: time its
                // caller's stream spends before reaching it is the caller's.
                if !self.in_flight(d) || self.waits_only_for_a_start(d) {
                    d.last_progress = Instant::now();
                } else if d.last_progress.elapsed() > self.timeout {
                    let what = self.describe_stall(d);
                    self.fail_locked(d, Error::timeout(what, self.timeout).into());
                }
                false
            }
            None => true,
        }
    }

    /// Runs `step` on the driver; if it fails or panics, fails the engine with its
    /// error and returns `None`.
    fn guarded<T>(
        &self,
        d: &mut Driver<M>,
        step: impl FnOnce(&Self, &mut Driver<M>) -> Result<T, Fault>,
    ) -> Option<T> {
        let outcome = catch_unwind(AssertUnwindSafe(|| step(self, &mut *d)));
        let fault = match outcome {
            Ok(Ok(value)) => return Some(value),
            Ok(Err(fault)) => fault,
            Err(panic) => {
                let message = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic without a message".to_owned());
                Error::internal("no step of the driver panics", message).into()
            }
        };
        self.fail_locked(d, fault);
        None
    }

    /// Handles completions the progress thread took while waiting on the fabric.
    fn handle_locked(&self, d: &mut Driver<M>, completions: &[Completion]) {
        if self.failure.failed() {
            return;
        }
        let handled = self.guarded(d, |e, d| {
            completions.iter().try_for_each(|c| e.on_completion(d, *c))
        });
        if handled.is_some() {
            d.last_progress = Instant::now();
            self.drive_locked(d);
        }
    }

    /// Nanoseconds since the engine started.
    pub(super) fn nanos(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}

impl<F: Fabric, M: MemorySpace> Driven for Engine<F, M> {
    fn parking(&self) -> &Parking {
        &self.parking
    }

    fn spin_ends(&self) {
        if self.remote {
            self.links.fabric.spin_ends();
        }
    }

    fn spinner_leaves(&self) {
        if self.remote {
            self.links.fabric.spinner_leaves();
        }
    }

    fn doorbell(&self) -> &Doorbell {
        self.machine.doorbell()
    }

    fn try_drive(&self) -> Drove {
        self.try_drive_once()
    }

    fn idle(&self, seen: u32) {
        let (busy, fenced) = if self.failure.failed() {
            let d = self.lock_driver();
            (false, d.failing.as_ref().is_some_and(|f| f.awaits_fences()))
        } else {
            let d = self.lock_driver();
            (
                self.in_flight(&d) || self.messages.any_pending(),
                d.slices.awaits_fences() || d.operations.delivering() || self.local.awaits_fences(),
            )
        };
        if fenced {
            self.machine.doorbell().sleep(seen, NAP_FENCE);
        } else if busy && !self.doorbell_wakes {
            // Completions are taken and handled under the driver lock, so that no
            // other driver handles later ones first: the ring counts one peer's
            // landings in the order they arrive.
            let mut d = self.lock_driver();
            let mut batch = std::mem::take(&mut d.scratch.waited);
            let n = self.links.wait(&mut batch, FABRIC_WAIT);
            if n > 0 {
                self.handle_locked(&mut d, &batch[..n]);
            }
            d.scratch.waited = batch;
        } else {
            let nap = if busy { NAP_BUSY } else { NAP_IDLE };
            self.machine.doorbell().sleep(seen, nap);
        }
    }

    fn parks(&self) -> bool {
        self.doorbell_wakes
    }

    fn crowded(&self) -> bool {
        self.crowded
    }

    fn spins_long(&self) {
        use crate::local::shared_core::{MOVE_AFTER, current_core, move_off};
        use crate::sync::unmodelled::Ordering;
        // Where ranks outnumber cores (or a fabric thread needs one), sharing
        // is expected: spinners yield instead.
        if self.crowded || self.machine.local_size() < 2 {
            return;
        }
        let Some(core) = current_core() else {
            return;
        };
        self.machine.spins_on(core);
        if !self.machine.shares_core(core) {
            return;
        }
        let now = self.nanos().max(1);
        let last = self.last_move.load(Ordering::Relaxed);
        if last != 0 && u128::from(now.saturating_sub(last)) < MOVE_AFTER.as_nanos() {
            return;
        }
        self.last_move.store(now, Ordering::Relaxed);
        if move_off(core, self.machine.cores_of_others()) {
            log::debug!(
                "fairring local rank {}: moved off core {core}, which a lower local rank spun on",
                self.machine.local_rank()
            );
        }
    }

    fn now(&self) -> u64 {
        self.nanos()
    }
}
