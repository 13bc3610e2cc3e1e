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
//! Ring was never faster beyond that spread, so `Auto` runs hierarchical on every
//! layout measured. Where the two tie it keeps hierarchical, which pipelines
//! slices over all staging buffers while the ring runs one slice at a time. The
//! rule lives here, next to its evidence: a layout where ring wins (many machines
//! with one device each on a real network is the candidate) adds a row and a
//! branch.

use fairring_core::topology::Topology;

use super::Algorithm;

impl Algorithm {
    /// The algorithm an operation of `bytes` runs on `topology`: `self`, unless
    /// `self` is [`Algorithm::Auto`] (see the module documentation for the
    /// measurements behind the choice).
    pub fn resolve(self, topology: Topology, bytes: u64) -> Algorithm {
        match self {
            Algorithm::Auto => {
                // Every measured (layout, size): hierarchical, or a tie kept
                // hierarchical. The arguments stay for the rows still to come.
                let _ = (topology, bytes);
                Algorithm::Hierarchical
            }
            concrete => concrete,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_resolves_to_a_concrete_algorithm_and_others_stay() {
        for (m, d) in [(1, 1), (1, 8), (2, 2), (3, 1), (64, 8)] {
            let t = Topology::new(m, d, fairring_core::topology::RankLayout::Contiguous).unwrap();
            for bytes in [0, 4096, 64 << 20, u64::MAX] {
                assert_eq!(Algorithm::Auto.resolve(t, bytes), Algorithm::Hierarchical);
                assert_eq!(Algorithm::Ring.resolve(t, bytes), Algorithm::Ring);
                assert_eq!(
                    Algorithm::Hierarchical.resolve(t, bytes),
                    Algorithm::Hierarchical
                );
            }
        }
    }
}
