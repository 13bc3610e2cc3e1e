//! Loom models of the staging state machine: two and three threads delivering the
//! events of one slice concurrently, every interleaving explored.
//!
//! Each thread writes the data its event stands for into a loom-tracked cell before
//! reporting the event, and whichever thread is handed the action reads every cell
//! that action consumes: loom then also proves that the compare-and-swap's ordering
//! makes that data visible (a weaker ordering fails with a causality violation).
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p fairring-core --release --test loom_staging`
#![cfg(loom)]

use fairring_core::staging::{Actions, Event, Role, StagingErrorKind, StagingState, Word};
use loom::cell::UnsafeCell;
use loom::sync::Arc;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::thread;

/// Data one event stands for: written before the event, read by the action.
struct Data(UnsafeCell<u64>);

impl Data {
    fn new() -> Data {
        Data(UnsafeCell::new(0))
    }

    fn write(&self, value: u64) {
        // SAFETY: each cell has exactly one writer, which writes before reporting its
        // event; readers read only after being handed an action that needs the event.
        // Loom reports any access these rules fail to order.
        self.0.with_mut(|p| unsafe { *p = value });
    }

    fn read(&self) -> u64 {
        // SAFETY: as in `write`: the read follows the action that requires the write.
        self.0.with(|p| unsafe { *p })
    }
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    if builder.preemption_bound.is_none() {
        builder.preemption_bound = Some(3);
    }
    builder.check(f);
}

const SERVER: Role = Role {
    contributions_to_send: 1,
    contributions_to_receive: 1,
    results_to_send: 1,
    results_to_receive: 1,
    reduces: true,
    forwards: false,
};

/// A peer's contribution lands while our reduce-scatter finishes: exactly one of the
/// two threads is handed `START_REDUCE`, and it sees both the slot and the
/// contribution.
#[test]
fn reduce_starts_once_and_sees_both_inputs() {
    model(|| {
        let state = Arc::new(StagingState::new());
        let slot = Arc::new(Data::new());
        let contribution = Arc::new(Data::new());
        let reduces = Arc::new(AtomicUsize::new(0));
        state.acquire(0, SERVER).unwrap();

        let perform = {
            let (slot, contribution, reduces) =
                (slot.clone(), contribution.clone(), reduces.clone());
            move |actions: Actions| {
                if actions.contains(Actions::START_REDUCE) {
                    assert_eq!(
                        slot.read() + contribution.read(),
                        3,
                        "reduce saw stale inputs"
                    );
                    reduces.fetch_add(1, Ordering::Relaxed);
                }
            }
        };
        let local = {
            let (state, slot, perform) = (state.clone(), slot.clone(), perform.clone());
            thread::spawn(move || {
                slot.write(1);
                let actions = state.on_event(Event::ReduceScatterDone, 0).unwrap();
                assert!(actions.contains(Actions::START_CONTRIBUTIONS));
                perform(actions);
            })
        };
        let network = {
            let (state, contribution) = (state.clone(), contribution.clone());
            thread::spawn(move || {
                contribution.write(2);
                perform(state.on_event(Event::ContributionReceived, 0).unwrap());
            })
        };
        local.join().unwrap();
        network.join().unwrap();
        assert_eq!(reduces.load(Ordering::Relaxed), 1);
    });
}

/// The reduction finishes while the last result lands: exactly one thread is handed
/// `START_ALL_GATHER`, and the all-gather sees the reduced shard and the result.
#[test]
fn reduced_and_last_result_race_for_the_all_gather() {
    model(|| {
        let state = Arc::new(StagingState::new());
        let reduced = Arc::new(Data::new());
        let result = Arc::new(Data::new());
        let gathers = Arc::new(AtomicUsize::new(0));
        state.acquire(0, SERVER).unwrap();
        state.on_event(Event::ReduceScatterDone, 0).unwrap();
        assert!(
            state
                .on_event(Event::ContributionReceived, 0)
                .unwrap()
                .contains(Actions::START_REDUCE)
        );

        let perform = {
            let (reduced, result, gathers) = (reduced.clone(), result.clone(), gathers.clone());
            move |actions: Actions| {
                if actions.contains(Actions::START_ALL_GATHER) {
                    assert_eq!(
                        (reduced.read(), result.read()),
                        (10, 20),
                        "all-gather saw a stale slot"
                    );
                    gathers.fetch_add(1, Ordering::Relaxed);
                }
            }
        };
        let reducer = {
            let (state, reduced, perform) = (state.clone(), reduced.clone(), perform.clone());
            thread::spawn(move || {
                reduced.write(10);
                let actions = state.on_event(Event::Reduced, 0).unwrap();
                assert!(actions.contains(Actions::START_SEND_BACK));
                perform(actions);
            })
        };
        let receiver = {
            let (state, result) = (state.clone(), result.clone());
            thread::spawn(move || {
                result.write(20);
                perform(state.on_event(Event::ResultReceived, 0).unwrap());
            })
        };
        reducer.join().unwrap();
        receiver.join().unwrap();
        assert_eq!(gathers.load(Ordering::Relaxed), 1);
    });
}

/// Three threads complete the last three pieces of a slice: the contribution send,
/// the result send, and the received result followed by the all-gather. Exactly one
/// is handed `RELEASE`, only after all three, and it sees everything they wrote; the
/// buffer is then free for generation 1.
#[test]
fn release_exactly_once_after_every_event() {
    model(|| {
        let state = Arc::new(StagingState::new());
        let cells: Arc<[Data; 3]> = Arc::new([Data::new(), Data::new(), Data::new()]);
        let releases = Arc::new(AtomicUsize::new(0));
        state.acquire(0, SERVER).unwrap();
        state.on_event(Event::ReduceScatterDone, 0).unwrap();
        state.on_event(Event::ContributionReceived, 0).unwrap();
        state.on_event(Event::Reduced, 0).unwrap();

        let spawn = |i: usize, events: &'static [Event]| {
            let (state, cells, releases) = (state.clone(), cells.clone(), releases.clone());
            thread::spawn(move || {
                cells[i].write(i as u64 + 1);
                for &event in events {
                    let actions = state.on_event(event, 0).unwrap();
                    if actions.contains(Actions::RELEASE) {
                        let seen: Vec<u64> = cells.iter().map(Data::read).collect();
                        assert_eq!(seen, [1, 2, 3], "released before every event");
                        releases.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        };
        let threads = [
            spawn(0, &[Event::ContributionSent]),
            spawn(1, &[Event::ResultSent]),
            spawn(2, &[Event::ResultReceived, Event::AllGatherDone]),
        ];
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(releases.load(Ordering::Relaxed), 1);
        assert_eq!(state.load(), Word::free(1));
    });
}

/// A late event of generation 0 races with the buffer's next slice: it is refused
/// whatever the interleaving, and the new slice runs as if it were not there.
#[test]
fn stale_generation_is_refused_while_the_buffer_moves_on() {
    model(|| {
        let state = Arc::new(StagingState::new());
        state.acquire(0, Role::IDLE).unwrap();
        state.on_event(Event::ReduceScatterDone, 0).unwrap();
        assert_eq!(
            state.on_event(Event::AllGatherDone, 0).unwrap(),
            Actions::RELEASE
        );

        let next = {
            let state = state.clone();
            thread::spawn(move || {
                state.acquire(1, Role::IDLE).unwrap();
                assert_eq!(
                    state.on_event(Event::ReduceScatterDone, 1).unwrap(),
                    Actions::START_ALL_GATHER
                );
                assert_eq!(
                    state.on_event(Event::AllGatherDone, 1).unwrap(),
                    Actions::RELEASE
                );
            })
        };
        let late = {
            let state = state.clone();
            thread::spawn(move || {
                for (event, generation) in
                    [(Event::AllGatherDone, 0), (Event::ReduceScatterDone, 0)]
                {
                    let refused = state.on_event(event, generation).unwrap_err();
                    assert_eq!(refused.kind(), StagingErrorKind::WrongGeneration);
                }
            })
        };
        next.join().unwrap();
        late.join().unwrap();
        assert_eq!(state.load(), Word::free(2));
    });
}

/// The same result reported twice, from two threads: exactly one is accepted and
/// the other is refused as a duplicate.
#[test]
fn a_duplicate_is_refused_exactly_once() {
    model(|| {
        let state = Arc::new(StagingState::new());
        let client = Role {
            contributions_to_send: 1,
            results_to_receive: 1,
            ..Role::IDLE
        };
        state.acquire(0, client).unwrap();
        state.on_event(Event::ReduceScatterDone, 0).unwrap();
        let deliver = || {
            let state = state.clone();
            thread::spawn(move || {
                state
                    .on_event(Event::ResultReceived, 0)
                    .map_err(|e| e.kind())
            })
        };
        let (a, b) = (deliver(), deliver());
        let outcomes = [a.join().unwrap(), b.join().unwrap()];
        let accepted = outcomes.iter().filter(|o| o.is_ok()).count();
        let duplicates = outcomes
            .iter()
            .filter(|o| **o == Err(StagingErrorKind::Duplicate))
            .count();
        assert_eq!((accepted, duplicates), (1, 1));
        assert!(outcomes.contains(&Ok(Actions::START_ALL_GATHER)));
    });
}

/// An inner node of a tree below its root: one leaf cell of the other tree,
/// two children, a parent.
const INNER: Role = Role {
    contributions_to_send: 1,
    contributions_to_receive: 2,
    results_to_send: 2,
    results_to_receive: 1,
    reduces: true,
    forwards: true,
};

/// An inner node's parent result, its leaf cell's result and the completion of
/// its send up all arrive at once: the send down is handed out once and sees
/// the parent's result, the all-gather once and sees both results.
#[test]
fn an_inner_nodes_parent_result_races_its_leaf_result() {
    model(|| {
        let state = Arc::new(StagingState::new());
        let from_parent = Arc::new(Data::new());
        let leaf_result = Arc::new(Data::new());
        let (downs, gathers) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        state.acquire(0, INNER).unwrap();
        state.on_event(Event::ReduceScatterDone, 0).unwrap();
        state.on_event(Event::ContributionReceived, 0).unwrap();
        state.on_event(Event::ContributionReceived, 0).unwrap();
        assert_eq!(
            state.on_event(Event::Reduced, 0).unwrap(),
            Actions::START_SEND_UP
        );
        state.on_event(Event::ContributionSent, 0).unwrap();

        let perform = {
            let (from_parent, leaf_result) = (from_parent.clone(), leaf_result.clone());
            let (downs, gathers) = (downs.clone(), gathers.clone());
            move |actions: Actions| {
                if actions.contains(Actions::START_SEND_BACK) {
                    assert_eq!(from_parent.read(), 7, "sent down a stale shard");
                    downs.fetch_add(1, Ordering::Relaxed);
                }
                if actions.contains(Actions::START_ALL_GATHER) {
                    assert_eq!(
                        (from_parent.read(), leaf_result.read()),
                        (7, 9),
                        "all-gather saw a stale slot"
                    );
                    gathers.fetch_add(1, Ordering::Relaxed);
                }
            }
        };
        let parent = {
            let (state, from_parent, perform) =
                (state.clone(), from_parent.clone(), perform.clone());
            thread::spawn(move || {
                from_parent.write(7);
                perform(state.on_event(Event::ParentResultReceived, 0).unwrap());
            })
        };
        let leaf = {
            let (state, leaf_result, perform) =
                (state.clone(), leaf_result.clone(), perform.clone());
            thread::spawn(move || {
                leaf_result.write(9);
                perform(state.on_event(Event::ResultReceived, 0).unwrap());
            })
        };
        let sent = {
            let state = state.clone();
            thread::spawn(move || {
                assert_eq!(
                    state.on_event(Event::PartialSent, 0).unwrap(),
                    Actions::empty()
                );
            })
        };
        parent.join().unwrap();
        leaf.join().unwrap();
        sent.join().unwrap();
        assert_eq!(downs.load(Ordering::Relaxed), 1);
        assert_eq!(gathers.load(Ordering::Relaxed), 1);
        // The buffer stays in use until the all-gather and the sends down end.
        assert!(state.load().in_use());
        let released = [Event::AllGatherDone, Event::ResultSent, Event::ResultSent]
            .into_iter()
            .fold(Actions::empty(), |a, e| a | state.on_event(e, 0).unwrap());
        assert_eq!(released, Actions::RELEASE);
    });
}
