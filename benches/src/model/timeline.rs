//! A resource that does one thing at a time: the pipeline's unit of contention.

/// A resource that runs one task at a time (a link's send side, a GPU, NVLink),
/// as the busy intervals it has been given.
///
/// A task goes into the earliest gap at or after its ready time that holds it, so
/// a task ready early is not held up behind one given earlier but ready later (a
/// NIC interleaves the messages of different slices; the engine issues each
/// stage when its inputs are ready, not in slice order).
#[derive(Clone, Debug, Default, PartialEq)]
pub(super) struct Timeline {
    /// Disjoint busy intervals, by start.
    busy: Vec<(f64, f64)>,
    /// Seconds of every task run so far.
    total: f64,
}

/// Intervals kept before the oldest are merged into one (losing the gaps between
/// them, which only tasks ready that long ago could have used).
const KEPT: usize = 256;

impl Timeline {
    /// Runs a task of `seconds` that may start at `ready`, in the first gap that
    /// holds it; returns when it ends.
    pub(super) fn run(&mut self, ready: f64, seconds: f64) -> f64 {
        let mut start = ready;
        let mut at = self.busy.len();
        for (i, &(s, e)) in self.busy.iter().enumerate() {
            if e <= start {
                continue;
            }
            if s >= start + seconds {
                at = i;
                break;
            }
            start = start.max(e);
        }
        let end = start + seconds;
        self.total += seconds;
        if seconds > 0.0 {
            self.busy.insert(at, (start, end));
        }
        if self.busy.len() > KEPT {
            let (first, _) = self.busy[0];
            let (_, end_of_half) = self.busy[KEPT / 2];
            self.busy.drain(..=KEPT / 2);
            self.busy.insert(0, (first, end_of_half));
        }
        end
    }

    /// Seconds the resource has been busy, over every task run so far.
    pub(super) fn busy(&self) -> f64 {
        self.total
    }
}

/// The largest value of `values` at an index other than `skip` (`f64::NEG_INFINITY`
/// when there is none), in O(1) after [`TopTwo::of`] has seen every value once.
#[derive(Clone, Copy, Debug)]
pub(super) struct TopTwo {
    first: (usize, f64),
    second: f64,
}

impl TopTwo {
    pub(super) fn of(values: impl IntoIterator<Item = (usize, f64)>) -> TopTwo {
        let mut t = TopTwo {
            first: (usize::MAX, f64::NEG_INFINITY),
            second: f64::NEG_INFINITY,
        };
        for (i, v) in values {
            if v > t.first.1 {
                t.second = t.first.1;
                t.first = (i, v);
            } else if v > t.second {
                t.second = v;
            }
        }
        t
    }

    pub(super) fn max_except(&self, skip: usize) -> f64 {
        if self.first.0 == skip {
            self.second
        } else {
            self.first.1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_resource_delays_the_next_task() {
        let mut t = Timeline::default();
        assert_eq!(t.run(0.0, 2.0), 2.0);
        assert_eq!(t.run(0.0, 1.0), 3.0, "waits for the first task");
        assert_eq!(t.run(10.0, 1.0), 11.0, "idle until ready");
    }

    #[test]
    fn a_task_ready_early_fills_an_earlier_gap() {
        let mut t = Timeline::default();
        assert_eq!(t.run(0.0, 1.0), 1.0);
        assert_eq!(t.run(5.0, 1.0), 6.0);
        assert_eq!(t.run(0.5, 2.0), 3.0, "fits in the gap 1..5");
        assert_eq!(t.run(2.0, 2.5), 8.5, "2.5 fits nowhere before 6");
        assert_eq!(t.run(3.0, 2.0), 5.0, "3..5 is still free");
    }

    #[test]
    fn old_intervals_merge_without_freeing_busy_time() {
        let mut t = Timeline::default();
        for i in 0..1000 {
            t.run(f64::from(i) * 2.0, 1.0);
        }
        assert!(t.busy.len() <= KEPT + 1);
        // Nothing may be placed over time that was given out.
        assert!(t.run(0.0, 0.5) >= 1.0);
    }

    #[test]
    fn top_two_skips_only_the_largest_index() {
        let v = [3.0, 9.0, 5.0, 9.0];
        let t = TopTwo::of(v.iter().copied().enumerate());
        for skip in 0..v.len() {
            let want = v
                .iter()
                .enumerate()
                .filter(|&(i, _)| i != skip)
                .map(|(_, &x)| x)
                .fold(f64::NEG_INFINITY, f64::max);
            assert_eq!(t.max_except(skip), want, "skip {skip}");
        }
    }
}
