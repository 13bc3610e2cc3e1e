//! Loom models of the park/wake handshake (`park.rs`): a caller that submits and
//! waits, and the progress thread, running the shipped `Parking`, `Doorbell`,
//! `run_progress` and `wait_driving` over a model of the engine whose drive
//! completes one queued operation per pass.
//!
//! Under loom a sleep on a bell ignores its timeout, so a wake-up the protocol
//! should send and does not leaves both threads asleep: loom reports the
//! deadlock. Each model ends by stopping the progress thread and joining it.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p fairring --lib --release loom_models`

use std::time::Duration;

use loom::sync::{Arc, Mutex};
use loom::thread;

use super::park::{Driven, Drove, Parking, Wake, run_progress, wait_driving};
use crate::shm::Doorbell;
use crate::sync::{AtomicU32, AtomicU64, Ordering};

/// A clock reading long after any wait: the submission is unattended.
const LATER: u64 = 1 << 40;

/// The engine as the handshake sees it.
struct Model {
    parking: Parking,
    doorbell: Doorbell,
    /// The driver: operations taken so far.
    driver: Mutex<u32>,
    /// The submission queue: operations queued so far.
    queued: AtomicU32,
    /// Operations completed.
    done: AtomicU32,
    /// The clock the waits read.
    clock: AtomicU64,
}

impl Model {
    fn new() -> Model {
        Model {
            parking: Parking::new(),
            doorbell: Doorbell::new(),
            driver: Mutex::new(0),
            queued: AtomicU32::new(0),
            done: AtomicU32::new(0),
            clock: AtomicU64::new(0),
        }
    }

    /// As `Engine::submit`.
    fn submit(&self, now: u64) {
        self.parking.submitting();
        self.queued.fetch_add(1, Ordering::Release);
        if self.parking.submitted(now) == Wake::Doorbell {
            self.doorbell.ring();
        }
    }

    /// Sleeps on the doorbell, without driving, until `n` operations are done.
    fn await_done(&self, n: u32) {
        loop {
            let seen = self.doorbell.seen();
            if self.done.load(Ordering::Acquire) >= n {
                return;
            }
            self.doorbell.sleep(seen, Duration::from_secs(1));
        }
    }
}

impl Driven for Model {
    fn parking(&self) -> &Parking {
        &self.parking
    }

    fn doorbell(&self) -> &Doorbell {
        &self.doorbell
    }

    fn try_drive(&self) -> Drove {
        let Ok(mut taken) = self.driver.try_lock() else {
            return Drove::Busy;
        };
        if *taken >= self.queued.load(Ordering::Acquire) {
            return Drove::Idle;
        }
        *taken += 1;
        self.done.fetch_add(1, Ordering::Release);
        self.parking.finished();
        // As the engine: a completion rings the doorbell.
        self.doorbell.ring();
        Drove::Moved
    }

    fn idle(&self, seen: u32) {
        self.doorbell.sleep(seen, Duration::from_millis(50));
    }

    fn parks(&self) -> bool {
        true
    }

    fn crowded(&self) -> bool {
        false
    }

    fn now(&self) -> u64 {
        self.clock.load(Ordering::Relaxed)
    }
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    model_bounded(3, f);
}

/// A model with at most `preemptions` preemptions per execution (unless
/// `LOOM_MAX_PREEMPTIONS` says otherwise).
fn model_bounded(preemptions: usize, f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(preemptions);
    }
    builder.check(f);
}

/// Starts the progress thread over `m`.
fn progress(m: &Arc<Model>) -> thread::JoinHandle<()> {
    let m = Arc::clone(m);
    thread::spawn(move || run_progress(&*m))
}

fn stop(m: &Model, t: thread::JoinHandle<()>) {
    m.parking.stop();
    m.doorbell.ring();
    t.join().unwrap();
}

/// A caller submits two operations and waits for the first (driving while it
/// waits, so the progress thread may park); the second is left when it stops
/// waiting, and the progress thread must finish it without anyone driving.
#[test]
fn work_left_by_the_last_waiter_reaches_the_progress_thread() {
    model(|| {
        let m = Arc::new(Model::new());
        let t = progress(&m);
        m.submit(0);
        m.submit(0);
        let first = wait_driving(&*m, || Ok(m.done.load(Ordering::Acquire) >= 1), None);
        assert!(matches!(first, Ok(true)));
        m.await_done(2);
        stop(&m, t);
    });
}

/// A caller waits for one operation (the progress thread may park meanwhile),
/// then, long after, submits another and does not wait: the submission must wake
/// the progress thread, parked or not.
#[test]
fn an_unattended_submission_wakes_the_progress_thread() {
    model(|| {
        let m = Arc::new(Model::new());
        let t = progress(&m);
        m.submit(0);
        let first = wait_driving(&*m, || Ok(m.done.load(Ordering::Acquire) >= 1), None);
        assert!(matches!(first, Ok(true)));
        m.clock.store(LATER, Ordering::Relaxed);
        m.submit(2 * LATER);
        m.await_done(2);
        stop(&m, t);
    });
}

/// One caller waits for its operation while another thread submits one and does
/// not wait: whichever way the last waiter's leaving and the submission
/// interleave, the progress thread gets the second operation.
#[test]
fn a_submission_from_another_thread_as_the_last_waiter_leaves() {
    // Three threads: two preemptions keep it to seconds (three take ten minutes).
    model_bounded(2, || {
        let m = Arc::new(Model::new());
        let t = progress(&m);
        m.submit(0);
        let other = {
            let m = Arc::clone(&m);
            thread::spawn(move || {
                m.submit(LATER);
                m.await_done(2);
            })
        };
        let first = wait_driving(&*m, || Ok(m.done.load(Ordering::Acquire) >= 1), None);
        assert!(matches!(first, Ok(true)));
        other.join().unwrap();
        stop(&m, t);
    });
}

/// Nobody waits: a submission to a running progress thread is never lost
/// between its look at the queue and its sleep.
#[test]
fn a_running_progress_thread_hears_every_submission() {
    model(|| {
        let m = Arc::new(Model::new());
        let t = progress(&m);
        m.submit(LATER);
        m.await_done(1);
        m.submit(2 * LATER);
        m.await_done(2);
        stop(&m, t);
    });
}
