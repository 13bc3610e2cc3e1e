//! The order a local rank issues the machine's collectives in, where every
//! rank must issue them in one order (NCCL's communicators): slice order, one
//! sequence per communicator, whatever order the engine reaches the slices'
//! steps in.
//!
//! A slice joins the reduce sequence when it begins (slices begin in number
//! order on every rank); its reduce-scatter may be issued once it is the
//! oldest there, and then joins the gather sequence if an all-gather follows;
//! its all-gather may be issued once it is the oldest there. A step asked
//! out of turn is refused, and the engine asks again.

use std::collections::VecDeque;

/// Whether a slice's all-gather may be issued.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GatherTurn {
    /// It is the oldest waiting.
    Now,
    /// An older slice gathers first.
    Later,
    /// It has nothing to gather: its reduce left the whole result in place.
    Nothing,
}

/// The two sequences of one rank.
#[derive(Debug)]
pub(crate) struct IssueOrder {
    reduce: VecDeque<u64>,
    gather: VecDeque<u64>,
}

impl IssueOrder {
    /// Empty, holding `capacity` slices in each sequence without growing.
    pub(crate) fn with_capacity(capacity: usize) -> IssueOrder {
        IssueOrder {
            reduce: VecDeque::with_capacity(capacity),
            gather: VecDeque::with_capacity(capacity),
        }
    }

    /// Slice `number` began.
    pub(crate) fn begun(&mut self, number: u64) {
        self.reduce.push_back(number);
    }

    /// Whether slice `number`'s reduce-scatter may be issued.
    pub(crate) fn reduce_turn(&self, number: u64) -> bool {
        self.reduce.front() == Some(&number)
    }

    /// The oldest slice's reduce-scatter was issued; its all-gather follows
    /// if `gathers`.
    pub(crate) fn reduced(&mut self, gathers: bool) {
        if let Some(number) = self.reduce.pop_front()
            && gathers
        {
            self.gather.push_back(number);
        }
    }

    /// Whether slice `number`'s all-gather may be issued (asked only once
    /// its reduce-scatter was).
    pub(crate) fn gather_turn(&self, number: u64) -> GatherTurn {
        if self.gather.front() == Some(&number) {
            GatherTurn::Now
        } else if self.gather.contains(&number) {
            GatherTurn::Later
        } else {
            GatherTurn::Nothing
        }
    }

    /// The oldest slice's all-gather was issued.
    pub(crate) fn gathered(&mut self) {
        self.gather.pop_front();
    }

    /// Whether a slice waits in either sequence.
    pub(crate) fn waiting(&self) -> bool {
        !self.reduce.is_empty() || !self.gather.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_slice_waits_for_the_older_ones_and_a_whole_one_gathers_nothing() {
        let mut order = IssueOrder::with_capacity(4);
        order.begun(0);
        order.begun(1);
        assert!(!order.reduce_turn(1) && order.reduce_turn(0));
        order.reduced(false);
        assert!(order.reduce_turn(1));
        order.reduced(true);
        assert_eq!(order.gather_turn(0), GatherTurn::Nothing);
        assert_eq!(order.gather_turn(1), GatherTurn::Now);
        order.gathered();
        assert!(!order.waiting());
    }

    /// One rank's engine: reaches begun slices' steps in an order `picks`
    /// draws, and records what it issues on each sequence.
    fn issue(slices: &[bool], in_flight: usize, picks: &[usize]) -> (Vec<u64>, Vec<u64>) {
        let mut order = IssueOrder::with_capacity(in_flight);
        let (mut reduced, mut gathered) = (Vec::new(), Vec::new());
        // Slices begun and not done: (number, reduced, gathers).
        let mut active: Vec<(u64, bool, bool)> = Vec::new();
        let mut next = 0usize;
        let mut picks = picks.iter().cycle();
        let (mut idle, mut cursor) = (0, 0usize);
        while next < slices.len() || !active.is_empty() {
            assert!(idle <= 2 * in_flight, "no step could be issued: {active:?}");
            if active.len() < in_flight && next < slices.len() {
                order.begun(next as u64);
                active.push((next as u64, false, slices[next]));
                next += 1;
            }
            // A step asked out of turn is asked again later: after a refusal
            // the engine moves on to the next, so every step is asked in time.
            cursor = if idle == 0 {
                picks.next().copied().unwrap_or(0)
            } else {
                cursor.wrapping_add(1)
            };
            let i = cursor % active.len();
            let (number, was_reduced, gathers) = active[i];
            idle += 1;
            if !was_reduced {
                if order.reduce_turn(number) {
                    order.reduced(gathers);
                    reduced.push(number);
                    active[i].1 = true;
                    if !gathers {
                        active.remove(i);
                    }
                    idle = 0;
                }
            } else {
                match order.gather_turn(number) {
                    GatherTurn::Now => {
                        order.gathered();
                        gathered.push(number);
                        active.remove(i);
                        idle = 0;
                    }
                    GatherTurn::Later => {}
                    GatherTurn::Nothing => panic!("slice {number} gathers"),
                }
            }
        }
        assert!(!order.waiting());
        (reduced, gathered)
    }

    proptest! {
        /// Ranks that reach their slices' steps in different orders issue
        /// each sequence in the same order: slice order, every slice once.
        #[test]
        fn ranks_reaching_steps_in_any_order_issue_in_one_order(
            slices in proptest::collection::vec(any::<bool>(), 1..40),
            in_flight in 1usize..6,
            a in proptest::collection::vec(any::<usize>(), 1..64),
            b in proptest::collection::vec(any::<usize>(), 1..64),
        ) {
            let first = issue(&slices, in_flight, &a);
            let second = issue(&slices, in_flight, &b);
            prop_assert_eq!(&first, &second);
            let all: Vec<u64> = (0..slices.len() as u64).collect();
            let gathering: Vec<u64> = all.iter().copied().zip(&slices)
                .filter_map(|(n, &gathers)| gathers.then_some(n))
                .collect();
            prop_assert_eq!(first, (all, gathering));
        }
    }
}
