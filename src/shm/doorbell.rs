//! A doorbell: a counter that waiters sleep on, with a futex in shared memory.
//!
//! Ringing costs one atomic add, plus one `FUTEX_WAKE` system call only while some
//! thread sleeps on the bell. A waiter reads the counter ([`Doorbell::seen`]) *before*
//! checking whether it has work, and sleeps only if the counter still has that value,
//! so a ring between the check and the sleep is never lost.
//!
//! # Why no ring is lost
//!
//! A ring is `rings += 1` (release: the work it announces is visible to a waiter
//! that sees the new count), a `SeqCst` fence, then a look at `sleepers`; a sleep is
//! `sleepers += 1`, a `SeqCst` fence, then a look at `rings`. The two fences are
//! ordered one way or the other: if the sleeper's comes first, the ringer sees it
//! counted and wakes it; if the ringer's comes first, the sleeper sees the new count
//! and does not sleep. The futex itself compares the count once more inside the
//! kernel, so a ring that lands between the look and the sleep makes the sleep
//! return at once.
//!
//! Under `cfg(loom)` the futex is a loom mutex and condition variable, and sleeps
//! ignore their timeout: a lost wake-up then shows as a deadlock in the models,
//! where in the real code it would show only as a delay.

use std::time::Duration;

use crate::sync::{AtomicU32, Ordering, fence};

/// Two words on their own cache line (in a shared segment, or in process memory).
#[repr(C, align(64))]
pub(crate) struct Doorbell {
    /// Bumped by every ring; the futex word.
    rings: AtomicU32,
    /// Threads currently asleep (or about to sleep) on `rings`.
    sleepers: AtomicU32,
    /// The futex, as loom models it.
    #[cfg(loom)]
    futex: (crate::sync::Mutex<()>, crate::sync::Condvar),
}

// The segment reserves one cache line per doorbell.
#[cfg(not(loom))]
const _: () = assert!(size_of::<Doorbell>() == 64);

impl Default for Doorbell {
    fn default() -> Doorbell {
        Doorbell::new()
    }
}

impl Doorbell {
    /// A doorbell in process memory.
    pub(crate) fn new() -> Doorbell {
        Doorbell {
            rings: AtomicU32::new(0),
            sleepers: AtomicU32::new(0),
            #[cfg(loom)]
            futex: Default::default(),
        }
    }

    /// The counter now; pass it to [`Doorbell::sleep`].
    pub(crate) fn seen(&self) -> u32 {
        self.rings.load(Ordering::Acquire)
    }

    /// Wakes every sleeper.
    pub(crate) fn ring(&self) {
        self.rings.fetch_add(1, Ordering::Release);
        fence(Ordering::SeqCst);
        if self.sleepers.load(Ordering::Relaxed) > 0 {
            self.wake_all();
        }
    }

    /// Sleeps until the bell rings after `seen` was read, or `timeout` passes.
    pub(crate) fn sleep(&self, seen: u32, timeout: Duration) {
        self.sleepers.fetch_add(1, Ordering::Relaxed);
        fence(Ordering::SeqCst);
        if self.rings.load(Ordering::Relaxed) == seen {
            self.wait_while(seen, timeout);
        }
        self.sleepers.fetch_sub(1, Ordering::Relaxed);
    }

    #[cfg(not(loom))]
    fn wait_while(&self, expected: u32, timeout: Duration) {
        let ts = libc::timespec {
            tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
            tv_nsec: libc::c_long::from(timeout.subsec_nanos().min(999_999_999) as i32),
        };
        // Spurious returns (EINTR, EAGAIN, ETIMEDOUT) are fine: callers re-check.
        // SAFETY: `rings` is a live, aligned 32-bit atomic (shared FUTEX_WAIT works
        // across processes) and `ts` lives for the call; the kernel only reads both.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.rings.as_ptr(),
                libc::FUTEX_WAIT,
                expected,
                &raw const ts,
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }

    #[cfg(not(loom))]
    fn wake_all(&self) {
        // SAFETY: `rings` is a live, aligned 32-bit atomic; FUTEX_WAKE only reads
        // its address.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.rings.as_ptr(),
                libc::FUTEX_WAKE,
                i32::MAX,
            );
        }
    }

    #[cfg(loom)]
    fn wait_while(&self, expected: u32, _timeout: Duration) {
        let (lock, condvar) = &self.futex;
        let guard = lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if self.rings.load(Ordering::Relaxed) == expected {
            drop(condvar.wait(guard));
        }
    }

    #[cfg(loom)]
    fn wake_all(&self) {
        let (lock, condvar) = &self.futex;
        let _guard = lock
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        condvar.notify_all();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn a_ring_wakes_a_sleeper_and_a_stale_seen_does_not_sleep() {
        let bell = Arc::new(Doorbell::new());
        let seen = bell.seen();
        bell.ring();
        let t = Instant::now();
        bell.sleep(seen, Duration::from_secs(5));
        assert!(
            t.elapsed() < Duration::from_secs(4),
            "slept on a stale count"
        );

        let b = Arc::clone(&bell);
        let seen = bell.seen();
        let sleeper = std::thread::spawn(move || {
            let t = Instant::now();
            b.sleep(seen, Duration::from_secs(10));
            t.elapsed()
        });
        std::thread::sleep(Duration::from_millis(50));
        bell.ring();
        let slept = sleeper.join().unwrap();
        assert!(
            slept < Duration::from_secs(9),
            "the ring did not wake the sleeper"
        );
    }
}
