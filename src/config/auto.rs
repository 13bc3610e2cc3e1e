//! What [`Algorithm::Auto`] runs.
//!
//! The choice is made per operation from the job's layout and the operation's
//! size, the same on every rank (the descriptor check compares the resolved
//! algorithm, so ranks configured differently fail loudly instead of mixing).
//!
//! # Measured crossovers
//!
//! `fairring-bench --local MxD --algo all`, f32 sum, 2-core VM, loopback tcp,
//! times in microseconds (hierarchical / ring), one sitting:
//!
//! | layout | 4 KiB | 64 KiB | 1 MiB | 4 MiB | 16 MiB | 64 MiB |
//! |---|---|---|---|---|---|---|
//! | 1x2 | 1.7 / 245 | 13.8 / 264 | 153 / 927 | 552 / 3915 | 4355 / 18047 | 16596 / 65068 |
//! | 1x3 | 120 / 509 | 188 / 629 | 1010 / 1980 | 2202 / 8932 | 8374 / 32490 | 34222 / 127227 |
//! | 2x1 | 228 / 253 | 262 / 274 | 870 / 1049 | 3969 / 4363 | 17920 / 18209 | 76209 / 73784 |
//! | 2x2 | 1194 / 2249 | 1497 / 2187 | 2763 / 3923 | 6656 / 12231 | 25295 / 46432 | 95820 / 184507 |
//! | 3x1 | 807 / 924 | 626 / 1000 | 2131 / 2349 | 8004 / 7935 | 37762 / 36441 | 127030 / 131531 |
//!
//! and, repeated at large sizes for one device per machine (two sittings each):
//!
//! | layout | 1 MiB | 4 MiB | 16 MiB | 64 MiB |
//! |---|---|---|---|---|
//! | 3x1 | 3262 / 3618 | 8253 / 7479 | 33994 / 37789 | 124498 / 113891 |
//! | 4x1 | 3070 / 4313 | 15395 / 14813 | 54594 / 54396 | |
//!
//! - With several devices per machine, hierarchical wins at every size, by 1.9x
//!   to 140x: its shared-memory step replaces `D - 1` fabric hops, and on one
//!   machine it never touches the fabric (the single-machine path).
//! - With one device per machine both move the same bytes per rank. Hierarchical
//!   wins below 4 MiB (2 hops instead of `2(M - 1)`: 1.1x to 1.6x); from 4 MiB the
//!   two are within the run-to-run spread (ring ahead by up to 10% in one
//!   sitting, behind by up to 10% in the next).
//!
//! Since the tcp fabric sends each driver pass's frames in one vectored write and
//! reads bursts in one read (and credits ride along), small operations cost
//! less under both; one sitting, same machine (hierarchical / ring):
//!
//! | layout | 4 KiB | 64 KiB | 1 MiB | 16 MiB |
//! |---|---|---|---|---|
//! | 2x1 | 48 / 56, 34 / 41, 48 / 49 | 71 / 73, 59 / 49, 63 / 73 | 483 / 489 | 10605 / 10151 |
//! | 3x1 | 116 / 179 | 153 / 225 | 560 / 657 | 18802 / 19171 |
//!
//! (three runs at 2x1 for the small sizes, whose ring times are bimodal on two
//! cores). The ring's two simultaneous hops tie hierarchical's two at 2x1;
//! from 3x1 its `2(M - 1)` hops lose.
//!
//! Ring was never faster beyond that spread. Where the two tie `auto` keeps
//! hierarchical.
//!
//! **Recursive doubling** ([`Algorithm::Doubling`]) exchanges the whole slice
//! with one partner per round: at 2x1 that is one hop where the others take two.
//! `fairring-bench --local MxD --algo all --min-bytes 4K --max-bytes 1M --factor
//! 4`, one sitting, times in microseconds (hierarchical / ring / doubling), two
//! runs each:
//!
//! | layout | 4 KiB | 16 KiB | 64 KiB | 256 KiB | 1 MiB |
//! |---|---|---|---|---|---|
//! | 2x1 | 38 / 20 / 11, 61 / 68 / 35 | 38 / 32 / 13, 63 / 66 / 47 | 56 / 47 / 53, 79 / 59 / 61 | 109 / 135 / 77, 138 / 138 / 87 | 478 / 469 / 435, 457 / 472 / 447 |
//! | 3x1 | 127 / 193 / 113, 120 / 198 / 144 | 132 / 213 / 109, 126 / 186 / 134 | 141 / 201 / 128, 145 / 192 / 130 | 396 / 377 / 283, 264 / 356 / 282 | 806 / 903 / 1212, 725 / 860 / 1120 |
//!
//! and over six alternating runs at 2x1, 4 KiB, medians of 41 (doubling), 51
//! (hierarchical) and 61 us (ring). So `auto` runs doubling on two machines of
//! one device each up to 1 MiB. At 3x1 (an extra rank folds in and out: three
//! hops) doubling ties hierarchical up to 256 KiB and loses at 1 MiB; `auto`
//! keeps hierarchical. From four ranks these two cores are oversubscribed and
//! measure the scheduler more than the hops (doubling lost at 4x1 by 1.1x to
//! 2x); more machines wait for a machine with the cores to measure them. The
//! rule lives here, next to its evidence: a layout measured adds a row and a
//! branch.

//! # Broadcast and all-gather
//!
//! Ring runs them as a relay (each byte sent once per hop, `M - 1` hops one
//! after another); hierarchical as all-reduces (each byte sent twice, in two
//! hops). `fairring-bench --collective broadcast|all_gather --algo all`, 2-core
//! VM, loopback tcp, times in microseconds (hierarchical / relay), one sitting
//! each:
//!
//! | layout | 4 KiB | 64 KiB | 256 KiB | 1 MiB | 4 MiB | 64 MiB |
//! |---|---|---|---|---|---|---|
//! | 2x1 broadcast | 90 / 72 (8 KiB) | 108 / 93 | 230 / 214 (512 KiB) | | 1940 / 1642 | 43030 / 14984 |
//! | 2x1 all-gather | 73 / 69 (8 KiB) | 88 / 78 | 227 / 194 (512 KiB) | | 2029 / 1175 | 45234 / 22882 |
//! | 3x1 broadcast | 344 / 291 (3 KiB) | 326 / 243 (48 KiB) | 803 / 703 (768 KiB) | | 13546 / 7124 (12 MiB) | 54877 / 22323 (48 MiB) |
//! | 4x1 broadcast | 460 / 516 | 562 / 532 | 831 / 679 | 1620 / 1625 | 7418 / 4478 | |
//! | 4x1 all-gather | 517 / 548 | 461 / 391 | 766 / 576 | 1786 / 1459 | 7045 / 4489 | |
//! | 2x2 broadcast (relay over every rank) | 398 / 287 (3 KiB) | 331 / 284 (48 KiB) | 659 / 1119 (768 KiB) | | 12990 / 11472 (12 MiB) | 44999 / 36662 (48 MiB) |
//!
//! - With one device per machine the relay moves half the bytes and wins from
//!   256 KiB by 1.1x to 2.9x. Below that the two are within this machine's
//!   noise; the relay takes `M - 1` hops one after another where hierarchical
//!   takes two, so from four machines on `auto` keeps hierarchical for small
//!   operations (a bound reasoned from the hops, not yet measured where the
//!   hops, not the cores, are the cost).
//! - With several devices per machine the relay runs around the machines, one
//!   chain per rail, with shared memory inside each (`algorithm/relay.rs`).
//!   2x2, same command with `--factor 4 --iters 5`, two sittings, times in
//!   microseconds (hierarchical / relay):
//!
//! | 2x2 | 4 KiB | 64 KiB | 1 MiB | 4 MiB | 16 MiB | 64 MiB |
//! |---|---|---|---|---|---|---|
//! | broadcast | 310 / 222, 291 / 275 | 354 / 292, 344 / 254 | 737 / 713, 758 / 1524 | 3981 / 3078, 3152 / 3992 | 17039 / 14961, 17294 / 12882 | 61870 / 52063, 64487 / 49415 |
//! | all-gather | 290 / 255, 310 / 258 | 306 / 254, 367 / 265 | 863 / 604, 827 / 629 | 3451 / 3496, 3884 / 3471 | 19990 / 17092, 16193 / 14628 | 67317 / 53166, 62764 / 53452 |
//!
//!   The relay wins from 16 MiB by 1.1x to 1.3x and mostly below; `auto`
//!   relays on several devices per machine by the rule above. On one machine
//!   there is no hop between machines, and hierarchical's single-machine path
//!   copies less: `auto` keeps it. A job with dedicated servers keeps
//!   hierarchical where machines have several devices (its ranks link no
//!   rails, so a relay would cross the fabric inside each machine).
//!
//! # Reduce-scatter
//!
//! Ring runs it as the ring's reduce-scatter half over the same range of every
//! rank's share, once per byte: around the ranks where machines have one
//! device (`(N-1)/N` of the input leaves each rank), around the machines along
//! each rail after the machine's own reduce-scatter where they have several
//! (`(M-1)/M` of each rank's slot, `1/D` of the input, leaves it; on one
//! machine, the machine's reduce-scatter alone). Hierarchical and doubling run
//! an all-reduce of the whole input. `fairring-bench --collective
//! reduce_scatter --algo all --min-bytes 4K --max-bytes 64M --factor 16 --iters
//! 5`, 2-core VM, loopback tcp, times in microseconds (hierarchical / ring /
//! doubling), one sitting per group of rows:
//!
//! | layout | 4 KiB | 64 KiB | 1 MiB | 16 MiB | 64 MiB |
//! |---|---|---|---|---|---|
//! | 2x1 | 64 / 36 / 34 | 91 / 82 / 75 | 516 / 280 / 370 | 11715 / 6761 / 13345 | 46154 / 29567 / 49688 |
//! | 3x1 | 147 / 168 / 132 | 190 / 167 / 139 | 832 / 640 / 1020 | 22695 / 14054 / 23260 | 77898 / 47813 / 83782 |
//! | 4x1 | 264 / 306 / 207 | 282 / 357 / 385 | 1448 / 1369 / 1870 | 27823 / 21854 / 41476 | 108658 / 62251 / 150217 |
//! | 1x2 | 26 / 21 / | 47 / 26 / | 77 / 60 / | 3042 / 2025 / | 13000 / 8353 / |
//! | 1x3 | 86 / 97 / | 108 / 88 / | 224 / 160 / | 5969 / 3673 / | 22173 / 13780 / |
//! | 2x2 | 178 / 167 / | 219 / 208 / | 821 / 852 / | 15374 / 10343 / | 57950 / 36946 / |
//!
//! The ring wins from 16 MiB by 1.5x to 1.8x everywhere, and from 1 MiB where
//! machines have one device. Below that it ties at two and three machines; at
//! four it takes `M - 1` hops where hierarchical takes two, and loses at 64 KiB
//! and below. So `auto` follows the relay's rule on several machines (the ring
//! on two or three, and from 256 KiB), and runs the ring on one machine of
//! several ranks, where it is hierarchical's reduce-scatter without the
//! all-gather. A job with dedicated servers keeps hierarchical (its ranks link
//! no rails, so the ring would cross the fabric inside each machine).

use fairring_core::topology::Topology;

use super::Algorithm;

impl Algorithm {
    /// The algorithm an operation of `bytes` runs on `topology`: `self`, unless
    /// `self` is [`Algorithm::Auto`] (see the module documentation for the
    /// measurements behind the choice).
    pub fn resolve(self, topology: Topology, bytes: u64) -> Algorithm {
        match self {
            Algorithm::Auto => {
                if topology.machines() == 2
                    && topology.devices_per_machine() == 1
                    && bytes <= DOUBLING_UP_TO_BYTES
                {
                    Algorithm::Doubling
                } else {
                    Algorithm::Hierarchical
                }
            }
            concrete => concrete,
        }
    }

    /// The algorithm a broadcast or an all-gather of `bytes` (its whole output)
    /// runs on `topology`: `self`, unless `self` is [`Algorithm::Auto`].
    /// [`Algorithm::Ring`] runs them as a relay, which moves each byte once per
    /// hop instead of twice (around the machines, with shared memory inside
    /// each, where a machine has several devices).
    pub(crate) fn resolve_spread(self, topology: Topology, bytes: u64) -> Algorithm {
        match self {
            Algorithm::Auto => {
                let machines = topology.machines();
                if machines > 1 && (machines <= 3 || bytes >= RELAY_FROM_BYTES) {
                    Algorithm::Ring
                } else {
                    Algorithm::Hierarchical
                }
            }
            concrete => concrete,
        }
    }

    /// The algorithm a reduce-scatter of `bytes` (its whole input) runs on
    /// `topology`: `self`, unless `self` is [`Algorithm::Auto`].
    /// [`Algorithm::Ring`] runs it as the ring's reduce-scatter half, which
    /// moves half the bytes of an all-reduce: around the ranks, or around the
    /// machines after the machine's own reduce-scatter where machines have
    /// several devices.
    pub(crate) fn resolve_scatter(self, topology: Topology, bytes: u64) -> Algorithm {
        match self {
            // One machine: its reduce-scatter alone, without the all-gather.
            Algorithm::Auto if topology.machines() == 1 && topology.devices_per_machine() > 1 => {
                Algorithm::Ring
            }
            other => other.resolve_spread(topology, bytes),
        }
    }
}

/// Largest all-reduce `auto` runs by recursive doubling (on two machines of one
/// device each).
const DOUBLING_UP_TO_BYTES: u64 = 1 << 20;

/// Smallest broadcast or all-gather that `auto` relays on four or more
/// machines (on two or three the relay takes no more hops than hierarchical).
const RELAY_FROM_BYTES: u64 = 256 * 1024;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_doubles_small_operations_on_two_single_device_machines() {
        let t = Topology::new(2, 1, fairring_core::topology::RankLayout::Contiguous).unwrap();
        for bytes in [0, 4096, 1 << 20] {
            assert_eq!(Algorithm::Auto.resolve(t, bytes), Algorithm::Doubling);
        }
        for bytes in [(1 << 20) + 1, 64 << 20] {
            assert_eq!(Algorithm::Auto.resolve(t, bytes), Algorithm::Hierarchical);
        }
    }

    #[test]
    fn auto_resolves_to_a_concrete_algorithm_and_others_stay() {
        for (m, d) in [(1, 1), (1, 8), (2, 2), (3, 1), (64, 8)] {
            let t = Topology::new(m, d, fairring_core::topology::RankLayout::Contiguous).unwrap();
            for bytes in [0, 4096, 64 << 20, u64::MAX] {
                assert_eq!(Algorithm::Auto.resolve(t, bytes), Algorithm::Hierarchical);
                assert_eq!(Algorithm::Doubling.resolve(t, bytes), Algorithm::Doubling);
                assert_eq!(Algorithm::Ring.resolve(t, bytes), Algorithm::Ring);
                assert_eq!(
                    Algorithm::Hierarchical.resolve(t, bytes),
                    Algorithm::Hierarchical
                );
            }
        }
    }

    #[test]
    fn auto_relays_spreads_across_machines() {
        let at =
            |m, d| Topology::new(m, d, fairring_core::topology::RankLayout::Contiguous).unwrap();
        let spread = |m, d, bytes| Algorithm::Auto.resolve_spread(at(m, d), bytes);
        let scatter = |m, d, bytes| Algorithm::Auto.resolve_scatter(at(m, d), bytes);
        for bytes in [0, 4096, 64 << 20] {
            assert_eq!(spread(2, 1, bytes), Algorithm::Ring);
            assert_eq!(spread(3, 1, bytes), Algorithm::Ring);
            assert_eq!(scatter(2, 1, bytes), Algorithm::Ring);
            // Several devices per machine: both run over the machines, with
            // shared memory inside each.
            assert_eq!(spread(2, 2, bytes), Algorithm::Ring);
            assert_eq!(scatter(2, 2, bytes), Algorithm::Ring);
            // One machine: shared memory only; a reduce-scatter skips the
            // all-gather.
            assert_eq!(spread(1, 8, bytes), Algorithm::Hierarchical);
            assert_eq!(spread(1, 1, bytes), Algorithm::Hierarchical);
            assert_eq!(scatter(1, 8, bytes), Algorithm::Ring);
            assert_eq!(scatter(1, 1, bytes), Algorithm::Hierarchical);
        }
        assert_eq!(scatter(8, 1, 4096), Algorithm::Hierarchical);
        assert_eq!(scatter(8, 1, 256 << 10), Algorithm::Ring);
        assert_eq!(scatter(4, 2, 4096), Algorithm::Hierarchical);
        assert_eq!(scatter(4, 2, 256 << 10), Algorithm::Ring);
        assert_eq!(
            Algorithm::Ring.resolve_scatter(at(2, 2), 4096),
            Algorithm::Ring
        );
        // Four machines or more: two hops beat M - 1 for small operations.
        assert_eq!(spread(8, 1, 4096), Algorithm::Hierarchical);
        assert_eq!(spread(8, 1, 256 << 10), Algorithm::Ring);
        assert_eq!(spread(4, 1, (256 << 10) - 1), Algorithm::Hierarchical);
        for a in [Algorithm::Ring, Algorithm::Hierarchical] {
            assert_eq!(a.resolve_spread(at(8, 1), 4096), a);
            assert_eq!(a.resolve_spread(at(2, 2), 64 << 20), a);
        }
    }
}
