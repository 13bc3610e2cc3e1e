//! Matching in order per tag: the `k`-th of one side's entries with a tag
//! meets the `k`-th of the other side's with that tag, whichever is posted
//! first.
//!
//! One [`Matcher`] serves one peer. On the fabric path a sender matches its
//! sends (left) with the receiver's announcements (right); on the
//! shared-memory path a receiver matches its receives (left) with the
//! sender's offers (right). Entries of different tags never meet, and within
//! a tag neither side is reordered: MPI's order for messages between one
//! pair of ranks (NCCL's is the same, with no tags).

use std::collections::{HashMap, VecDeque};

/// Entries a tag's queues hold before they grow.
const ROOM: usize = 64;

/// Two queues per tag, at most one of them non-empty.
pub(crate) struct Matcher<L, R> {
    by_tag: HashMap<u32, Waiting<L, R>>,
}

/// What waits under one tag.
struct Waiting<L, R> {
    left: VecDeque<L>,
    right: VecDeque<R>,
}

impl<L, R> Default for Matcher<L, R> {
    fn default() -> Self {
        Matcher {
            by_tag: HashMap::new(),
        }
    }
}

impl<L, R> Matcher<L, R> {
    fn waiting(&mut self, tag: u32) -> &mut Waiting<L, R> {
        // Room up front, so that a tag in use allocates nothing more until
        // more than this many wait on one side.
        self.by_tag.entry(tag).or_insert_with(|| Waiting {
            left: VecDeque::with_capacity(ROOM),
            right: VecDeque::with_capacity(ROOM),
        })
    }

    /// Adds a left entry under `tag`: the pair it completes, if the oldest
    /// right entry of `tag` was waiting for it.
    pub(crate) fn left(&mut self, tag: u32, l: L) -> Option<(L, R)> {
        let w = self.waiting(tag);
        match w.right.pop_front() {
            Some(r) => Some((l, r)),
            None => {
                w.left.push_back(l);
                None
            }
        }
    }

    /// Whether a right entry of `tag` waits for its left one.
    pub(crate) fn right_waiting(&self, tag: u32) -> bool {
        self.by_tag.get(&tag).is_some_and(|w| !w.right.is_empty())
    }

    /// The oldest left entry of `tag` waiting for its right one.
    pub(crate) fn left_waiting(&self, tag: u32) -> Option<&L> {
        self.by_tag.get(&tag)?.left.front()
    }

    /// Adds a right entry under `tag` (see [`left`](Matcher::left)).
    pub(crate) fn right(&mut self, tag: u32, r: R) -> Option<(L, R)> {
        let w = self.waiting(tag);
        match w.left.pop_front() {
            Some(l) => Some((l, r)),
            None => {
                w.right.push_back(r);
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn entries_meet_in_order_within_a_tag_and_never_across_tags() {
        let mut m: Matcher<u32, char> = Matcher::default();
        assert_eq!(m.left(7, 1), None);
        assert_eq!(m.left(7, 2), None);
        assert_eq!(m.right(8, 'x'), None);
        assert_eq!(m.right(7, 'a'), Some((1, 'a')));
        assert_eq!(m.right(7, 'b'), Some((2, 'b')));
        assert_eq!(m.right(7, 'c'), None);
        assert_eq!(m.left(8, 3), Some((3, 'x')));
        assert_eq!(m.left(7, 4), Some((4, 'c')), "the waiting right entry");
        assert_eq!(m.left(7, 5), None);
    }

    proptest! {
        /// Whatever the interleaving of posts, the k-th left entry of a tag
        /// meets the k-th right entry of that tag.
        #[test]
        fn the_kth_of_each_side_meet(posts in proptest::collection::vec((any::<bool>(), 0u32..3), 0..64)) {
            let mut m: Matcher<(u32, usize), (u32, usize)> = Matcher::default();
            let mut counts = [[0usize; 2]; 3];
            let mut met = Vec::new();
            for (left, tag) in posts {
                let side = usize::from(!left);
                let k = counts[tag as usize][side];
                counts[tag as usize][side] += 1;
                let pair = if left { m.left(tag, (tag, k)) } else { m.right(tag, (tag, k)) };
                met.extend(pair);
            }
            for (l, r) in &met {
                prop_assert_eq!(l, r);
            }
            let expected: usize = counts.iter().map(|c| c[0].min(c[1])).sum();
            prop_assert_eq!(met.len(), expected);
        }
    }
}
