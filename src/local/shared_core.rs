//! Ranks of one machine that spin on one core, and moving them apart.
//!
//! Where a machine's ranks have a core each, every waiting rank spins: the
//! answer it waits for comes from a rank on another core. The scheduler
//! places processes as they wake, though, and two ranks may start on one
//! core and stay there while both spin, the other cores idle: nothing makes
//! the kernel balance two threads that never sleep. Each then holds the core
//! its peer needs until it yields; on the 2-core development machine, one
//! 1x2 all-reduce run of 4 KiB in about twelve took 9 us a call, against 3.
//!
//! So a rank whose wait has run long enough to yield publishes the core it
//! spins on ([`Segment::core`](crate::shm::segment::Segment::core)), and
//! looks at the others': if a lower local rank last spun on the same core,
//! this one moves off it. It narrows its thread's CPU mask to the CPUs of
//! the mask no local rank last spun on (or, if that leaves none, to every
//! CPU but its own), which makes the kernel migrate it at once, and
//! restores the mask it found: it stays where the kernel put it until the
//! kernel moves it again. Only the higher of two ranks moves, at most once
//! every [`MOVE_AFTER`], so two ranks never chase each other. A mask of one
//! CPU (a rank pinned by its launcher) is left alone.
//!
//! The thread is often the caller's, waiting on its `Work`. Its mask is
//! read and restored by two calls some microseconds apart: a mask another
//! thread sets in between is overwritten by the restore (and on recent
//! kernels the restored mask becomes the one the thread asked for). A
//! published core is a hint: a rank's word keeps the core it last spun on
//! after it sleeps or moves, which may move another rank once more than
//! needed.

use std::time::Duration;

use super::Machine;
use crate::sync::unmodelled::Ordering;

/// The least time between two moves of one rank.
pub(crate) const MOVE_AFTER: Duration = Duration::from_millis(10);

/// The core the calling thread runs on, if the kernel says.
pub(crate) fn current_core() -> Option<u32> {
    // SAFETY: `sched_getcpu` takes nothing and only reads the thread's state.
    let cpu = unsafe { libc::sched_getcpu() };
    u32::try_from(cpu).ok()
}

/// Whether local rank `me`, spinning on `core`, should move: a lower local
/// rank last spun on the same core (`published` yields each other rank's
/// published word: its core plus one, 0 for none).
pub(crate) fn should_move(me: u32, core: u32, published: impl Iterator<Item = (u32, u32)>) -> bool {
    published
        .filter(|&(rank, _)| rank < me)
        .any(|(_, word)| word == core + 1)
}

impl Machine {
    /// Publishes that this rank's waiting thread spins on `core`.
    pub(crate) fn spins_on(&self, core: u32) {
        let word = self.segment().core(self.local_rank());
        if word.load(Ordering::Relaxed) != core + 1 {
            word.store(core + 1, Ordering::Relaxed);
        }
    }

    /// Each other local rank and its published word (its core plus one, 0
    /// for none).
    fn published_by_others(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        let me = self.local_rank();
        (0..self.local_size())
            .filter(move |&r| r != me)
            .map(|r| (r, self.segment().core(r).load(Ordering::Relaxed)))
    }

    /// The cores the other local ranks last spun on.
    pub(crate) fn cores_of_others(&self) -> impl Iterator<Item = u32> + '_ {
        self.published_by_others()
            .filter_map(|(_, word)| word.checked_sub(1))
    }

    /// Whether this rank, spinning on `core`, shares it with a lower local
    /// rank (see the module docs).
    pub(crate) fn shares_core(&self, core: u32) -> bool {
        should_move(self.local_rank(), core, self.published_by_others())
    }
}

/// Moves the calling thread off `core`, within its CPU mask, to a CPU not
/// in `taken` if the mask has one, and restores the mask; returns whether
/// it moved (false where the mask holds no other CPU, `core` is not in it,
/// or the kernel refused).
pub(crate) fn move_off(core: u32, taken: impl Iterator<Item = u32>) -> bool {
    let Ok(core) = usize::try_from(core) else {
        return false;
    };
    // SAFETY: a zeroed `cpu_set_t` is an empty set, a valid value.
    let mut mask: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: `mask` is a live `cpu_set_t` of `size` bytes, which the kernel
    // fills with the calling thread's mask.
    if unsafe { libc::sched_getaffinity(0, size, &raw mut mask) } != 0 {
        return false;
    }
    let setsize = libc::CPU_SETSIZE as usize;
    // SAFETY: `core` is below `CPU_SETSIZE`, so within the set, only read.
    if core >= setsize || !unsafe { libc::CPU_ISSET(core, &mask) } {
        return false;
    }
    let mut others = mask;
    // SAFETY: as above.
    unsafe { libc::CPU_CLR(core, &mut others) };
    // SAFETY: `CPU_COUNT` only reads the set.
    if unsafe { libc::CPU_COUNT(&others) } == 0 {
        return false;
    }
    let mut free = others;
    for cpu in taken.filter_map(|c| usize::try_from(c).ok()) {
        if cpu < setsize {
            // SAFETY: `cpu` is below `CPU_SETSIZE`, so within the set.
            unsafe { libc::CPU_CLR(cpu, &mut free) };
        }
    }
    // SAFETY: `CPU_COUNT` only reads the set.
    if unsafe { libc::CPU_COUNT(&free) } > 0 {
        others = free;
    }
    // SAFETY: `others` is a valid set of `size` bytes; narrowing the calling
    // thread's mask to it migrates the thread off `core` before this returns.
    if unsafe { libc::sched_setaffinity(0, size, &raw const others) } != 0 {
        return false;
    }
    // SAFETY: as above, for the mask the thread had: it only widens the mask
    // again, leaving the thread where it now runs.
    let restored = unsafe { libc::sched_setaffinity(0, size, &raw const mask) } == 0;
    if !restored {
        log::warn!(
            "fairring: restoring a thread's CPU mask after moving it off core {core} failed"
        );
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_higher_of_two_ranks_on_one_core_moves() {
        // Rank 1 on core 3; rank 0 published core 3 (word 4).
        assert!(should_move(1, 3, [(0, 4)].into_iter()));
        // Rank 0 on core 3, rank 1 published it: rank 0 stays.
        assert!(!should_move(0, 3, [(1, 4)].into_iter()));
        // Another core, or nothing published.
        assert!(!should_move(1, 3, [(0, 3)].into_iter()));
        assert!(!should_move(2, 0, [(0, 0), (1, 2)].into_iter()));
        assert!(should_move(2, 1, [(0, 0), (1, 2)].into_iter()));
    }

    /// The calling thread's CPU mask.
    fn mask() -> libc::cpu_set_t {
        let size = std::mem::size_of::<libc::cpu_set_t>();
        // SAFETY: an empty set is a valid value.
        let mut mask: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: a live set of `size` bytes, filled by the kernel.
        let got = unsafe { libc::sched_getaffinity(0, size, &raw mut mask) };
        assert_eq!(got, 0, "sched_getaffinity failed");
        mask
    }

    /// A thread on one core of a mask of several moves off it, and keeps its
    /// mask. Skipped (with the reason printed) where the process may use
    /// only one CPU.
    #[test]
    fn a_thread_moves_off_its_core_and_keeps_its_mask() {
        std::thread::spawn(|| {
            let before = mask();
            // SAFETY: only reads the set.
            let cpus = unsafe { libc::CPU_COUNT(&before) };
            if cpus < 2 {
                eprintln!("skipped: this process may use only one CPU");
                return;
            }
            let core = current_core().expect("the kernel names the thread's core");
            assert!(move_off(core, std::iter::empty()), "moved");
            assert_ne!(current_core(), Some(core), "off the core it was on");
            let after = mask();
            // SAFETY: both are valid sets, only read.
            let same = unsafe { libc::CPU_EQUAL(&before, &after) };
            assert!(same, "its mask restored");
        })
        .join()
        .unwrap();
    }

    /// A thread whose mask holds one CPU does not move.
    #[test]
    fn a_thread_pinned_to_one_core_stays() {
        std::thread::spawn(|| {
            let core = current_core().expect("the kernel names the thread's core");
            let size = std::mem::size_of::<libc::cpu_set_t>();
            // SAFETY: an empty set is a valid value.
            let mut one: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            // SAFETY: `core` is the thread's own core, within the set.
            unsafe { libc::CPU_SET(core as usize, &mut one) };
            // SAFETY: a valid set of `size` bytes; the thread already runs there.
            let pinned = unsafe { libc::sched_setaffinity(0, size, &raw const one) };
            assert_eq!(pinned, 0, "sched_setaffinity failed");
            assert!(!move_off(core, std::iter::empty()));
            assert_eq!(current_core(), Some(core));
        })
        .join()
        .unwrap();
    }
}
