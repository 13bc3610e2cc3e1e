//! Property tests of the staging state machine: the atomic word against the
//! sequential reference model over random event sequences, and random legal
//! schedules of whole slices.

use fairring_core::staging::reference::ReferenceModel;
use fairring_core::staging::{
    Actions, Event, GENERATION_BITS, Role, StagingErrorKind, StagingState, Word,
};
use proptest::prelude::*;

/// Counts: mostly small, sometimes up to the 12-bit limit.
fn count() -> impl Strategy<Value = u16> {
    prop_oneof![6 => 0u16..=4, 2 => 5u16..=64, 1 => 4000u16..=4095]
}

/// A role the plan could produce (valid): a client, a server, or an inner node
/// of a tree that forwards its partial sum.
fn valid_role() -> impl Strategy<Value = Role> {
    (count(), count(), any::<bool>(), any::<bool>()).prop_map(|(sends, others, reduces, up)| {
        let others = if reduces { others.max(1) } else { 0 };
        Role {
            contributions_to_send: sends,
            contributions_to_receive: others,
            results_to_send: others,
            results_to_receive: sends,
            reduces,
            forwards: reduces && up,
        }
    })
}

/// Any role at all, valid or not, with small counts (so random events can finish it).
fn any_role() -> impl Strategy<Value = Role> {
    (
        0u16..=3,
        0u16..=3,
        0u16..=3,
        0u16..=3,
        any::<bool>(),
        0u8..20,
        any::<bool>(),
    )
        .prop_map(|(a, b, c, d, r, big, f)| Role {
            contributions_to_send: if big == 0 { 4096 } else { a },
            contributions_to_receive: b,
            results_to_send: c,
            results_to_receive: d,
            reduces: r,
            forwards: f,
        })
}

#[derive(Clone, Debug)]
enum Step {
    Acquire { skew: i8, role: Role },
    Event { event: Event, skew: i8 },
}

fn step() -> impl Strategy<Value = Step> {
    let skew = prop_oneof![8 => Just(0i8), 1 => Just(-1i8), 1 => Just(1i8)];
    prop_oneof![
        1 => (skew.clone(), any_role()).prop_map(|(skew, role)| Step::Acquire { skew, role }),
        12 => (prop::sample::select(Event::ALL.to_vec()), skew).prop_map(|(event, skew)| Step::Event { event, skew }),
    ]
}

/// A small deterministic generator for schedule choices (the seed is what proptest
/// shrinks and reports).
struct SplitMix64(u64);

impl SplitMix64 {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        usize::try_from(z % n as u64).unwrap()
    }
}

fn with_skew(generation: u64, skew: i8) -> u64 {
    generation.wrapping_add_signed(i64::from(skew))
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Step for step, the atomic word and the reference model accept and refuse the
    /// same events, and hand out the same actions.
    #[test]
    fn word_matches_the_reference_model(steps in prop::collection::vec(step(), 1..120)) {
        let real = StagingState::new();
        let mut model = ReferenceModel::new();
        for (i, step) in steps.iter().enumerate() {
            let generation = model.generation();
            match *step {
                Step::Acquire { skew, role } => {
                    let g = with_skew(generation, skew);
                    let got = real.acquire(g, role).map(|_| ()).map_err(|e| e.kind());
                    let want = model.acquire(g, role);
                    prop_assert_eq!(got, want, "step {}: acquire({}, {:?})", i, g, role);
                }
                Step::Event { event, skew } => {
                    let g = with_skew(generation, skew);
                    let before = real.load();
                    let got = real.on_event(event, g).map_err(|e| e.kind());
                    let want = model.on_event(event, g);
                    prop_assert_eq!(got, want, "step {}: {:?} gen {} on {}", i, event, g, before);
                    if got.is_err() {
                        prop_assert_eq!(real.load(), before, "a refused event changed the state");
                    }
                }
            }
            prop_assert_eq!(real.load().in_use(), model.is_acquired());
            prop_assert_eq!(real.load().generation(), model.generation() % (1 << GENERATION_BITS));
        }
    }

    /// A random legal schedule of whole slices: completions become possible as their
    /// actions are handed out and happen in a random order. Nothing is refused, each
    /// action is handed out at most once and exactly when its work exists, and the
    /// last completion of each slice releases the buffer.
    #[test]
    fn legal_schedules_run_to_release(roles in prop::collection::vec(valid_role(), 1..4), seed in any::<u64>()) {
        let state = StagingState::new();
        let mut rng = SplitMix64(seed);
        for (generation, role) in (0u64..).zip(&roles) {
            state.acquire(generation, *role).unwrap();
            // Completions that may happen now.
            let mut ready: Vec<Event> = vec![Event::ReduceScatterDone];
            ready.extend(std::iter::repeat_n(Event::ContributionReceived, role.contributions_to_receive.into()));
            let mut handed = Actions::empty();
            let mut released = false;
            while !ready.is_empty() {
                prop_assert!(!released, "released with {} completions outstanding", ready.len());
                let event = ready.swap_remove(rng.below(ready.len()));
                let actions = state.on_event(event, generation)
                    .map_err(|e| TestCaseError::fail(format!("{e}")))?;
                prop_assert!(!handed.intersects(actions), "{actions:?} handed out twice");
                handed |= actions;
                for action in actions.iter() {
                    match action {
                        Actions::START_CONTRIBUTIONS => {
                            ready.extend(std::iter::repeat_n(Event::ContributionSent, role.contributions_to_send.into()));
                            ready.extend(std::iter::repeat_n(Event::ResultReceived, role.results_to_receive.into()));
                        }
                        Actions::START_REDUCE => ready.push(Event::Reduced),
                        Actions::START_SEND_BACK => {
                            ready.extend(std::iter::repeat_n(Event::ResultSent, role.results_to_send.into()));
                        }
                        Actions::START_SEND_UP => {
                            ready.push(Event::PartialSent);
                            ready.push(Event::ParentResultReceived);
                        }
                        Actions::START_ALL_GATHER => ready.push(Event::AllGatherDone),
                        Actions::RELEASE => released = true,
                        _ => prop_assert!(false, "unknown action {action:?}"),
                    }
                }
            }
            prop_assert!(released, "every completion reported but the buffer was not released");
            prop_assert_eq!(handed.contains(Actions::START_CONTRIBUTIONS), role.contributions_to_send > 0);
            prop_assert_eq!(handed.contains(Actions::START_REDUCE), role.reduces);
            prop_assert_eq!(handed.contains(Actions::START_SEND_BACK), role.reduces);
            prop_assert_eq!(handed.contains(Actions::START_SEND_UP), role.forwards);
            prop_assert!(handed.contains(Actions::START_ALL_GATHER | Actions::RELEASE));
            prop_assert_eq!(state.load(), Word::free(generation + 1));
            // The old generation is gone.
            let stale = state.on_event(Event::AllGatherDone, generation).unwrap_err();
            prop_assert_eq!(stale.kind(), StagingErrorKind::WrongGeneration);
        }
    }
}

#[test]
fn roles_past_twelve_bits_are_refused() {
    let state = StagingState::new();
    let role = Role {
        contributions_to_send: 4096,
        ..Role::IDLE
    };
    assert_eq!(
        state.acquire(0, role).unwrap_err().kind(),
        StagingErrorKind::InvalidRole
    );
    assert!(!state.load().in_use());
}
