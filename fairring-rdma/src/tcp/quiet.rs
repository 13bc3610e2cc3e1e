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
//! sockets: it parks until a spinner hands the sockets back, or the last
//! inline read is [`SPIN_WINDOW`] old, and then takes whatever readiness piled up
//! in the meantime (epoll keeps edge-triggered events until they are
//! collected, so none is lost), and writes the frames left unsent. It naps only
//! with nothing of its own to do: no bytes left to read, no handshake in
//! progress, no wake-up pending. A frame half written does not keep it awake:
//! the spinner writes on as the socket takes bytes. A nap ends early when
//!
//! - anyone wakes the loop (`Shared::wake`: work left for it, shutdown);
//! - the spinning thread stops spinning to sleep ([`Quiet::spin_ends`]), so that
//!   arrivals are taken while nobody else reads them;
//! - the spinning thread returns to its caller ([`Quiet::spinner_leaves`])
//!   with frames left unsent, which its peers wait for.
//!
//! A spinner that returns to its caller with everything written leaves the
//! nap running: what arrives then is for a later call, whose wait reads it
//! inline, or which wakes the loop when it sleeps; at the latest, the nap
//! ends a window after the last inline read. Waking the loop on every
//! return would cost a context switch per call, and naps that end on a short
//! timer cost one per timer: with naps of at most 1 ms, 2x1 tcp all-reduces
//! of 1 MiB, 4 MiB and 16 MiB ran at 2.91, 1.84 and 1.81 GB/s on two cores,
//! against 4.00, 2.04 and 1.99 without them (medians of five alternating
//! rounds of 200 iterations; in runs of 1,000 all-reduces of 1 MiB, 1.77
//! against 2.01), and the job switched contexts 5.4 times per all-reduce of
//! 1 MiB against 1.1.
//!
//! The handshakes between a nap and a wake-up are Dekker's: the loop announces
//! the nap, then looks for a pending wake-up and for a spinner; a waker sets
//! its flag (a leaving spinner clears its mark), then looks for a nap to end;
//! with sequentially consistent orderings at least one of them sees the
//! other.

use crate::sync::unmodelled::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::thread::Thread;
use std::time::{Duration, Instant};

/// How recently a thread must have read inline for the I/O thread to nap: a
/// driver busy reducing a large slice between two looks at the sockets still
/// counts as spinning. A nap ends once the last inline read is this old, so
/// a thread that stops reading inline without a word ([`Quiet::spin_ends`],
/// [`Quiet::spinner_leaves`]) leaves what arrives, and what it left
/// unwritten, for at most about this; a nap that ends while a thread still
/// spins costs it a context switch, one per window: 2x1 tcp all-reduces of
/// 16 MiB on two cores ran at 1.86 GB/s with 5 ms, 2.09 with 20 ms and 2.08
/// with naps bounded by the timers' tick alone (four alternating rounds).
pub(crate) const SPIN_WINDOW: Duration = Duration::from_millis(20);

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
        self.inline_at.store(self.now().max(1), Ordering::SeqCst);
    }

    /// The spinning thread goes to sleep: whatever arrives from now on is the
    /// I/O thread's to take.
    pub(crate) fn spin_ends(&self) {
        self.inline_at.store(0, Ordering::SeqCst);
        self.end_nap();
    }

    /// The spinning thread returns to its caller: no thread reads inline now.
    /// Ends the I/O thread's nap if `unsent` says frames were left unwritten
    /// (looked at only if it naps).
    pub(crate) fn spinner_leaves(&self, unsent: impl FnOnce() -> bool) {
        self.inline_at.store(0, Ordering::SeqCst);
        if self.napping() && unsent() {
            self.end_nap();
        }
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

    /// How long until the last inline read is [`SPIN_WINDOW`] old; `None`
    /// if it is already, or no thread spins.
    fn until_stale(&self) -> Option<Duration> {
        self.left_at(self.now()).map(Duration::from_nanos)
    }

    /// Whether a thread has read inline within [`SPIN_WINDOW`] before `now`.
    fn spins_at(&self, now: u64) -> bool {
        self.left_at(now).is_some()
    }

    /// Nanoseconds left at `now` until the last inline read is
    /// [`SPIN_WINDOW`] old; `None` if it is already, or no thread spins.
    fn left_at(&self, now: u64) -> Option<u64> {
        let at = self.inline_at.load(Ordering::SeqCst);
        let window = u64::try_from(SPIN_WINDOW.as_nanos()).unwrap_or(u64::MAX);
        let age = now.saturating_sub(at);
        (at != 0 && age < window).then(|| window - age)
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

    /// On the I/O thread: parks for at most `most`, and at most until the
    /// last inline read is [`SPIN_WINDOW`] old; not at all if `woken` is set
    /// (with `SeqCst`) or no thread spins, and no longer once `woken` is set
    /// and the nap ended ([`end_nap`](Quiet::end_nap)).
    pub(crate) fn nap(&self, woken: &AtomicBool, most: Duration) {
        self.napping.store(true, Ordering::SeqCst);
        // After announcing the nap: a spinner that left before this look
        // is seen here; one that leaves after it sees the nap.
        if !woken.load(Ordering::SeqCst)
            && let Some(left) = self.until_stale()
        {
            std::thread::park_timeout(most.min(left));
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

    /// Naps in a thread registered as the I/O thread of a new `Quiet` while
    /// this one marks a spinner, and runs `during` once the nap has started;
    /// returns the `Quiet`, and how long the nap took. (A nap that ended
    /// before `during` could run, the marked spinner a window old by its look,
    /// is tried again with a new `Quiet`.)
    fn nap_while(woken: &Arc<AtomicBool>, during: impl FnOnce(&Quiet)) -> (Arc<Quiet>, Duration) {
        loop {
            let q = Arc::new(Quiet::new());
            let finished = Arc::new(AtomicBool::new(false));
            let napper = {
                let (q, woken, finished) =
                    (Arc::clone(&q), Arc::clone(woken), Arc::clone(&finished));
                std::thread::spawn(move || {
                    q.register_io_thread();
                    let start = Instant::now();
                    q.nap(&woken, Duration::from_secs(30));
                    finished.store(true, Ordering::SeqCst);
                    start.elapsed()
                })
            };
            while !q.napping.load(Ordering::SeqCst) && !finished.load(Ordering::SeqCst) {
                q.spinning();
                std::thread::yield_now();
            }
            if finished.load(Ordering::SeqCst) {
                napper.join().expect("the napping thread");
                continue;
            }
            during(&q);
            let napped = napper.join().expect("the napping thread");
            return (q, napped);
        }
    }

    #[test]
    fn no_nap_starts_without_a_spinner() {
        let q = Quiet::new();
        let woken = AtomicBool::new(false);
        let start = Instant::now();
        q.nap(&woken, Duration::from_secs(30));
        assert!(start.elapsed() < Duration::from_secs(15));
        q.spinning();
        q.spinner_leaves(|| false);
        let start = Instant::now();
        q.nap(&woken, Duration::from_secs(30));
        assert!(start.elapsed() < Duration::from_secs(15));
    }

    #[test]
    fn a_spinner_leaving_frames_unsent_ends_the_nap() {
        let woken = Arc::new(AtomicBool::new(false));
        let (q, napped) = nap_while(&woken, |q| q.spinner_leaves(|| true));
        assert!(napped < Duration::from_secs(15), "{napped:?}");
        assert!(!q.someone_spins());
    }

    #[test]
    fn a_spinner_going_to_sleep_ends_the_nap() {
        let woken = Arc::new(AtomicBool::new(false));
        let (_, napped) = nap_while(&woken, Quiet::spin_ends);
        assert!(napped < Duration::from_secs(15), "{napped:?}");
    }

    #[test]
    fn a_wake_up_before_or_during_a_nap_ends_it() {
        let q = Arc::new(Quiet::new());
        let woken = Arc::new(AtomicBool::new(false));
        let long = Duration::from_secs(30);
        q.spinning();
        // Before: the nap does not start.
        woken.store(true, Ordering::SeqCst);
        let start = Instant::now();
        q.nap(&woken, long);
        assert!(start.elapsed() < long / 2);
        // During: the waker unparks the napping thread.
        woken.store(false, Ordering::SeqCst);
        let (_, napped) = nap_while(&woken, |q| {
            woken.store(true, Ordering::SeqCst);
            q.end_nap();
        });
        assert!(napped < long / 2, "{napped:?}");
    }
}
