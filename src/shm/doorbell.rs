//! A doorbell: a counter that waiters sleep on, with a futex in shared memory.
//!
//! One 32-bit word holds the count of rings (bits 1..32) and whether anyone sleeps
//! or is about to (bit 0). Ringing is one atomic add; it costs a `FUTEX_WAKE`
//! system call only when the sleeper bit was set. A waiter reads the count
//! ([`Doorbell::seen`]) *before* checking whether it has work, and sleeps only if
//! the count still has that value, so a ring between the check and the sleep is
//! never lost.
//!
//! # Why no ring is lost
//!
//! Every operation is a read-modify-write of the one word, so they are totally
//! ordered. A sleeper sets the sleeper bit with a compare-and-swap that succeeds
//! only if the count is still the one it saw, then waits on the futex for exactly
//! that word. A ring that comes before the swap changes the count, so the swap
//! fails and the sleeper returns; a ring that comes after it sees the bit, clears
//! it and wakes every sleeper, and the futex compares the word inside the kernel,
//! so a sleeper that had not yet gone to sleep does not. No fence is needed.
//!
//! Under `cfg(loom)` the futex is a loom mutex and condition variable, and sleeps
//! ignore their timeout: a lost wake-up then shows as a deadlock in the models,
//! where in the real code it would show only as a delay.

use std::time::Duration;

use crate::sync::{AtomicU32, Ordering};

/// Bit 0 of the word: someone sleeps, or is about to.
const SLEEPER: u32 = 1;
/// What one ring adds.
const RING: u32 = 2;

/// One word on its own cache line (in a shared segment, or in process memory).
#[repr(C, align(64))]
pub(crate) struct Doorbell {
    /// `rings << 1 | sleeper`: the futex word.
    word: AtomicU32,
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
            word: AtomicU32::new(0),
            #[cfg(loom)]
            futex: Default::default(),
        }
    }

    /// The count of rings now; pass it to [`Doorbell::sleep`].
    pub(crate) fn seen(&self) -> u32 {
        self.word.load(Ordering::Acquire) >> 1
    }

    /// Wakes every sleeper.
    pub(crate) fn ring(&self) {
        // Release: the work this ring announces is visible to a waiter that sees
        // the new count.
        let before = self.word.fetch_add(RING, Ordering::AcqRel);
        if before & SLEEPER != 0 {
            self.word.fetch_and(!SLEEPER, Ordering::AcqRel);
            self.wake_all();
        }
    }

    /// Sleeps until the bell rings after `seen` was read, or `timeout` passes.
    /// May return early; callers look again.
    pub(crate) fn sleep(&self, seen: u32, timeout: Duration) {
        let quiet = (seen & (u32::MAX >> 1)) << 1;
        // Set the sleeper bit if nothing rang since `seen`; if another sleeper set
        // it already, sleep on that word.
        let word = match self.word.compare_exchange(
            quiet,
            quiet | SLEEPER,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => quiet | SLEEPER,
            Err(now) if now == quiet | SLEEPER => now,
            Err(_) => return,
        };
        self.wait_while(word, timeout);
    }

    #[cfg(not(loom))]
    fn wait_while(&self, expected: u32, timeout: Duration) {
        let ts = libc::timespec {
            tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
            tv_nsec: libc::c_long::from(timeout.subsec_nanos().min(999_999_999) as i32),
        };
        // Spurious returns (EINTR, EAGAIN, ETIMEDOUT) are fine: callers re-check.
        // SAFETY: `word` is a live, aligned 32-bit atomic (shared FUTEX_WAIT works
        // across processes) and `ts` lives for the call; the kernel only reads both.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.word.as_ptr(),
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
        // SAFETY: `word` is a live, aligned 32-bit atomic; FUTEX_WAKE only reads
        // its address.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.word.as_ptr(),
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
        if self.word.load(Ordering::Relaxed) == expected {
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
        assert_eq!(bell.word.load(Ordering::Relaxed) & SLEEPER, 0);
    }

    #[test]
    fn the_count_wraps_without_a_lost_ring() {
        let bell = Doorbell::new();
        bell.word.store(u32::MAX - 1, Ordering::Relaxed);
        let seen = bell.seen();
        bell.ring();
        assert_ne!(bell.seen(), seen);
        let t = Instant::now();
        bell.sleep(seen, Duration::from_secs(5));
        assert!(t.elapsed() < Duration::from_secs(4), "slept across a wrap");
    }
}
