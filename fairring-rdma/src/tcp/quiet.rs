//! Keeping the I/O thread out of the way of a thread that spins for completions.
//!
//! A thread about to spin reads what has arrived itself, and writes what is
//! left to write (`Shared::progress_inline`, see `link`), so a small write's hop
//! costs no thread hand-off. But the I/O
//! thread still sleeps in `epoll_wait` on the same sockets: every arrival wakes it
//! too, only to find the bytes taken, and on a machine with few cores that
//! wake-up takes the spinner's core at the moment its answer arrives (two cores
//! and two ranks measured the I/O threads at a quarter of a core each, and the
//! spinners' small all-reduces bimodal).
//!
//! So while threads read inline, the I/O thread **naps** instead of waiting on the
//! sockets: it parks for at most [`MAX_NAP`], and then takes whatever readiness piled
//! up in the meantime (epoll keeps edge-triggered events until they are
//! collected, so none is lost), and writes the frames left unsent. It naps only
//! with nothing of its own to do: no bytes left to read, no handshake in
//! progress, no wake-up pending. A frame half written does not keep it awake:
//! the spinner writes on as the socket takes bytes. A nap ends early when
//!
//! - anyone wakes the loop (`Shared::wake`: work left for it, shutdown);
//! - the spinning thread stops spinning to sleep ([`Quiet::spin_ends`]), so that
//!   arrivals are taken while nobody else reads them.
//!
//! The handshake between a nap and a wake-up is Dekker's: the loop announces the
//! nap, then looks for a pending wake-up; a waker sets its flag, then looks for
//! a nap to end; with sequentially consistent orderings at least one of them
//! sees the other.

use crate::sync::unmodelled::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How recently a thread must have read inline for the I/O thread to nap: a
/// driver busy reducing a large slice between two looks at the sockets still
/// counts as spinning.
pub(crate) const SPIN_WINDOW: Duration = Duration::from_millis(1);

/// The longest nap. When the thread that read inline leaves without sleeping
/// (it returned to its caller), what arrives, and what it left unsent, waits
/// at worst about this: each nap's end takes both, and the naps go on until
/// its last read is a window old. Each nap's timer takes a core from a
/// spinner: with naps of 250 us (and a window of 200 us), 2x1 tcp all-reduces
/// of 256 KiB and 1 MiB ran at 2.38 and 3.33 GB/s on two cores, against 3.03
/// and 3.74 with these (medians of five alternating rounds; 4 MiB alike).
pub(crate) const MAX_NAP: Duration = Duration::from_millis(1);

/// What the I/O thread and the spinning threads share about spinning.
pub(crate) struct Quiet {
    epoch: Instant,
    /// When a thread last read inline, in nanoseconds after `epoch`; 0: no
    /// thread is spinning.
    inline_at: AtomicU64,
    /// The I/O thread is napping (or about to).
    napping: AtomicBool,
    /// The I/O thread, to unpark.
    thread: OnceLock<Thread>,
}

impl Quiet {
    pub(crate) fn new() -> Quiet {
        Quiet {
            epoch: Instant::now(),
            inline_at: AtomicU64::new(0),
            napping: AtomicBool::new(false),
            thread: OnceLock::new(),
        }
    }

    /// Registers the calling thread as the I/O thread.
    pub(crate) fn register_io_thread(&self) {
        let _ = self.thread.set(std::thread::current());
    }

    /// Nanoseconds since `epoch`.
    fn now(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// A thread is reading inline, now.
    pub(crate) fn spinning(&self) {
        self.inline_at.store(self.now().max(1), Ordering::Relaxed);
    }

    /// The spinning thread goes to sleep: whatever arrives from now on is the
    /// I/O thread's to take.
    pub(crate) fn spin_ends(&self) {
        self.inline_at.store(0, Ordering::Relaxed);
        self.end_nap();
    }

    /// Whether the I/O thread naps (or is about to): the end of its nap takes
    /// what is left to read and writes what is left unsent.
    pub(crate) fn napping(&self) -> bool {
        self.napping.load(Ordering::SeqCst)
    }

    /// Whether a thread has read inline within [`SPIN_WINDOW`].
    pub(crate) fn someone_spins(&self) -> bool {
        self.spins_at(self.now())
    }

    /// Whether a thread has read inline within [`SPIN_WINDOW`] before `now`.
    fn spins_at(&self, now: u64) -> bool {
        let at = self.inline_at.load(Ordering::Relaxed);
        let window = u64::try_from(SPIN_WINDOW.as_nanos()).unwrap_or(u64::MAX);
        at != 0 && now.saturating_sub(at) < window
    }

    /// Ends the I/O thread's nap, if it takes one. Callers set what they want
    /// it to see (with `SeqCst`) first.
    pub(crate) fn end_nap(&self) {
        if self.napping.load(Ordering::SeqCst)
            && let Some(thread) = self.thread.get()
        {
            thread.unpark();
        }
    }

    /// On the I/O thread: parks for at most `most`, unless `woken` is set (with
    /// `SeqCst`) before or during the nap.
    pub(crate) fn nap(&self, woken: &AtomicBool, most: Duration) {
        self.napping.store(true, Ordering::SeqCst);
        if !woken.load(Ordering::SeqCst) {
            std::thread::park_timeout(most);
        }
        self.napping.store(false, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    #[test]
    fn spinning_is_seen_within_the_window_and_forgotten_when_it_ends() {
        let q = Quiet::new();
        let window = u64::try_from(SPIN_WINDOW.as_nanos()).unwrap();
        assert!(!q.someone_spins());
        q.spinning();
        let at = q.inline_at.load(Ordering::Relaxed);
        assert!(q.spins_at(at) && q.spins_at(at + window - 1));
        assert!(!q.spins_at(at + window));
        q.spin_ends();
        assert!(!q.spins_at(at));
    }

    #[test]
    fn a_wake_up_before_or_during_a_nap_ends_it() {
        let q = Arc::new(Quiet::new());
        let woken = Arc::new(AtomicBool::new(false));
        let long = Duration::from_secs(30);
        // Before: the nap does not start.
        woken.store(true, Ordering::SeqCst);
        let start = Instant::now();
        q.nap(&woken, long);
        assert!(start.elapsed() < long / 2);
        // During: the waker unparks the napping thread.
        woken.store(false, Ordering::SeqCst);
        let napper = {
            let (q, woken) = (Arc::clone(&q), Arc::clone(&woken));
            std::thread::spawn(move || {
                q.register_io_thread();
                let start = Instant::now();
                q.nap(&woken, long);
                start.elapsed()
            })
        };
        while !q.napping.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        woken.store(true, Ordering::SeqCst);
        q.end_nap();
        let napped = napper.join().expect("the napping thread");
        assert!(napped < long / 2, "{napped:?}");
    }
}
