//! A discrete-event schedule: tasks on resources that do one thing at a time,
//! each started when its inputs are in, in the order they became ready.
//!
//! A pipeline's stages are tasks; a task may hold a resource (a link's send
//! side, a GPU, NVLink) or none (a join, or a wait). Each waits for every task
//! it depends on to end (plus a delay per dependency: a message's latency), or
//! for the first of them ([`Schedule::first_of`]), and for a time of its own
//! (`not_before`). A resource runs its tasks one at a time, in the order they
//! became ready, none interrupted: so a stage of a later slice that is ready
//! first runs first, as the engine issues every stage the moment its inputs are
//! in, and no task's place depends on the order the schedule was written in.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};

/// A task of a [`Schedule`].
pub(super) type TaskId = usize;
/// A resource of a [`Schedule`].
pub(super) type ResourceId = usize;

#[derive(Clone, Debug)]
struct Task {
    resource: Option<ResourceId>,
    seconds: f64,
    /// The earliest it may start; raised by each dependency as it ends.
    ready: f64,
    /// Dependencies not yet ended (every one, or the first for `first`).
    pending: u32,
    /// Starts when the first of its dependencies has ended.
    first: bool,
    /// Tasks that wait for this one, each with its delay.
    then: Vec<(TaskId, f64)>,
    end: f64,
}

#[derive(Clone, Debug, Default)]
struct Resource {
    /// Running until then.
    busy_until: f64,
    running: bool,
    /// Ready tasks waiting for it, by the time they became ready.
    waiting: VecDeque<TaskId>,
    /// Seconds of every task it ran.
    total: f64,
}

/// Tasks, their dependencies and their resources; [`Schedule::run`] times them.
#[derive(Clone, Debug, Default)]
pub(super) struct Schedule {
    tasks: Vec<Task>,
    resources: Vec<Resource>,
}

/// An event: at `time`, a task became ready (`end == false`) or ended.
type Event = Reverse<(Time, u64, bool, TaskId)>;

/// A time that orders (never NaN: every duration the model makes is finite).
#[derive(Clone, Copy, Debug)]
struct Time(f64);

impl PartialEq for Time {
    fn eq(&self, other: &Time) -> bool {
        self.cmp(other).is_eq()
    }
}

impl Eq for Time {}

impl PartialOrd for Time {
    fn partial_cmp(&self, other: &Time) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Time {
    fn cmp(&self, other: &Time) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

impl Schedule {
    /// A new resource.
    pub(super) fn resource(&mut self) -> ResourceId {
        self.resources.push(Resource::default());
        self.resources.len() - 1
    }

    /// A task of `seconds` on `resource` (or none), starting no sooner than
    /// `not_before` and than every dependency given it ([`Schedule::after`]).
    pub(super) fn task(
        &mut self,
        resource: Option<ResourceId>,
        seconds: f64,
        not_before: f64,
    ) -> TaskId {
        self.tasks.push(Task {
            resource,
            seconds,
            ready: not_before,
            pending: 0,
            first: false,
            then: Vec::new(),
            end: f64::NAN,
        });
        self.tasks.len() - 1
    }

    /// A task of no time and no resource that ends once the first of its
    /// dependencies has (each with its delay), but not before `not_before`.
    pub(super) fn first_of(&mut self, not_before: f64) -> TaskId {
        let t = self.task(None, 0.0, not_before);
        self.tasks[t].first = true;
        t
    }

    /// `task` waits for `before` to end, and `delay` more.
    pub(super) fn after(&mut self, task: TaskId, before: TaskId, delay: f64) {
        self.tasks[before].then.push((task, delay));
        let t = &mut self.tasks[task];
        if !t.first || t.pending == 0 {
            t.pending += 1;
        }
    }

    /// Times every task: each starts when it is ready and its resource has run
    /// every task that became ready before it.
    pub(super) fn run(&mut self) {
        let mut events: BinaryHeap<Event> = BinaryHeap::new();
        let mut seq = 0u64;
        let mut push = |events: &mut BinaryHeap<Event>, time: f64, end: bool, id: TaskId| {
            seq += 1;
            events.push(Reverse((Time(time), seq, end, id)));
        };
        for (id, t) in self.tasks.iter().enumerate() {
            if t.pending == 0 {
                push(&mut events, t.ready, false, id);
            }
        }
        while let Some(Reverse((Time(now), _, end, id))) = events.pop() {
            if !end {
                match self.tasks[id].resource {
                    None => push(&mut events, now + self.tasks[id].seconds, true, id),
                    Some(r) => {
                        let res = &mut self.resources[r];
                        if res.running {
                            res.waiting.push_back(id);
                        } else {
                            res.running = true;
                            res.busy_until = now + self.tasks[id].seconds;
                            res.total += self.tasks[id].seconds;
                            push(&mut events, res.busy_until, true, id);
                        }
                    }
                }
                continue;
            }
            self.tasks[id].end = now;
            if let Some(r) = self.tasks[id].resource {
                let res = &mut self.resources[r];
                match res.waiting.pop_front() {
                    Some(next) => {
                        res.busy_until = now + self.tasks[next].seconds;
                        res.total += self.tasks[next].seconds;
                        push(&mut events, res.busy_until, true, next);
                    }
                    None => res.running = false,
                }
            }
            for i in 0..self.tasks[id].then.len() {
                let (next, delay) = self.tasks[id].then[i];
                let t = &mut self.tasks[next];
                if t.pending == 0 {
                    // A first-of task already started.
                    continue;
                }
                t.ready = t.ready.max(now + delay);
                t.pending = if t.first { 0 } else { t.pending - 1 };
                if t.pending == 0 {
                    let ready = t.ready;
                    push(&mut events, ready, false, next);
                }
            }
        }
    }

    /// When `task` ended (after [`Schedule::run`]; NaN if it never became ready).
    pub(super) fn end(&self, task: TaskId) -> f64 {
        self.tasks[task].end
    }

    /// Seconds `resource` was busy.
    pub(super) fn busy(&self, resource: ResourceId) -> f64 {
        self.resources[resource].total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resource_runs_its_tasks_in_the_order_they_became_ready() {
        let mut s = Schedule::default();
        let r = s.resource();
        // Written first, ready last: it runs last.
        let late = s.task(Some(r), 1.0, 5.0);
        let early = s.task(Some(r), 4.0, 0.0);
        let next = s.task(Some(r), 2.0, 1.0);
        s.run();
        assert_eq!(s.end(early), 4.0);
        assert_eq!(
            s.end(next),
            6.0,
            "waits for the task running when it became ready"
        );
        assert_eq!(s.end(late), 7.0, "ready at 5, behind the one ready at 1");
        assert_eq!(s.busy(r), 7.0);
    }

    #[test]
    fn dependencies_wait_for_all_or_for_the_first() {
        let mut s = Schedule::default();
        let (a, b) = (s.task(None, 3.0, 0.0), s.task(None, 1.0, 0.0));
        let all = s.task(None, 0.5, 0.0);
        s.after(all, a, 0.25);
        s.after(all, b, 10.0);
        let first = s.first_of(0.0);
        s.after(first, a, 0.0);
        s.after(first, b, 0.0);
        let not_before = s.first_of(2.0);
        s.after(not_before, b, 0.0);
        s.run();
        assert_eq!(s.end(all), 11.5, "b's end and its delay, then its own time");
        assert_eq!(s.end(first), 1.0);
        assert_eq!(s.end(not_before), 2.0);
    }
}
