//! A doorbell in shared memory: a counter that waiters sleep on with a futex.
//!
//! Ringing costs one atomic add, plus one `FUTEX_WAKE` system call only while some
//! thread sleeps on the bell. A waiter reads the counter ([`Doorbell::seen`]) *before*
//! checking whether it has work, and sleeps only if the counter still has that value,
//! so a ring between the check and the sleep is never lost.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// Two words on their own cache line (in a shared segment, or in process memory).
#[repr(C, align(64))]
pub struct Doorbell {
    /// Bumped by every ring; the futex word.
    rings: AtomicU32,
    /// Threads currently asleep (or about to sleep) on `rings`.
    sleepers: AtomicU32,
}

impl Default for Doorbell {
    fn default() -> Doorbell {
        Doorbell::new()
    }
}

impl Doorbell {
    /// A doorbell in process memory.
    pub const fn new() -> Doorbell {
        Doorbell {
            rings: AtomicU32::new(0),
            sleepers: AtomicU32::new(0),
        }
    }

    /// The counter now; pass it to [`Doorbell::sleep`].
    pub fn seen(&self) -> u32 {
        self.rings.load(Ordering::SeqCst)
    }

    /// Wakes every sleeper.
    pub fn ring(&self) {
        self.rings.fetch_add(1, Ordering::SeqCst);
        if self.sleepers.load(Ordering::SeqCst) > 0 {
            futex_wake(&self.rings);
        }
    }

    /// Sleeps until the bell rings after `seen` was read, or `timeout` passes.
    pub fn sleep(&self, seen: u32, timeout: Duration) {
        self.sleepers.fetch_add(1, Ordering::SeqCst);
        if self.rings.load(Ordering::SeqCst) == seen {
            futex_wait(&self.rings, seen, timeout);
        }
        self.sleepers.fetch_sub(1, Ordering::SeqCst);
    }
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
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
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &raw const ts,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a live, aligned 32-bit atomic; FUTEX_WAKE only reads its
    // address.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Instant;

    #[test]
    fn a_ring_wakes_a_sleeper_and_a_stale_seen_does_not_sleep() {
        let bell = Arc::new(Doorbell {
            rings: AtomicU32::new(0),
            sleepers: AtomicU32::new(0),
        });
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
