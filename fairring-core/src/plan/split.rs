//! Dealing `total` units into `parts` parts as evenly as possible.

/// `total` units dealt into `parts` parts: every part gets `base = total / parts`
/// units and the first `extra = total % parts` parts one more. Parts are contiguous
/// and in order, so part `i` starts at `i * base + min(i, extra)`.
///
/// Every query is O(1) and cannot overflow: all results are at most `total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct EvenSplit {
    base: u64,
    extra: u64,
}

impl EvenSplit {
    /// Splits `total` into `parts` parts. `parts` must not be zero.
    pub(crate) const fn new(total: u64, parts: u64) -> EvenSplit {
        debug_assert!(parts > 0);
        EvenSplit {
            base: total / parts,
            extra: total % parts,
        }
    }

    /// First unit of part `i` (for `i <= parts`; `start(parts) == total`).
    pub(crate) const fn start(&self, i: u64) -> u64 {
        let bonus = if i < self.extra { i } else { self.extra };
        i * self.base + bonus
    }

    /// Units in part `i`.
    pub(crate) const fn len(&self, i: u64) -> u64 {
        self.base + if i < self.extra { 1 } else { 0 }
    }

    /// The part that holds unit `x` (for `x < total`).
    pub(crate) const fn part_of(&self, x: u64) -> u64 {
        let big = self.extra * (self.base + 1);
        if x < big {
            x / (self.base + 1)
        } else {
            // x >= big means total > big, so some part has `base > 0` units.
            self.extra + (x - big) / self.base
        }
    }
}

#[cfg(test)]
mod tests {
    use super::EvenSplit;

    #[test]
    fn parts_tile_the_total_and_differ_by_at_most_one() {
        for total in 0..60u64 {
            for parts in 1..13u64 {
                let s = EvenSplit::new(total, parts);
                let mut next = 0;
                for i in 0..parts {
                    assert_eq!(s.start(i), next, "total {total} parts {parts} part {i}");
                    assert!(s.len(i) == total / parts || s.len(i) == total / parts + 1);
                    for x in next..next + s.len(i) {
                        assert_eq!(s.part_of(x), i);
                    }
                    next += s.len(i);
                }
                assert_eq!(next, total);
                assert_eq!(s.start(parts), total);
            }
        }
    }
}
