//! Arbitrary acquires and events against one staging buffer: the atomic word and the
//! sequential reference model must accept and refuse alike and hand out the same
//! actions, and a refusal must leave the state unchanged.
#![no_main]

use arbitrary::Arbitrary;
use fairring_core::staging::reference::ReferenceModel;
use fairring_core::staging::{Event, Role, StagingState};
use libfuzzer_sys::fuzz_target;

#[derive(Arbitrary, Debug)]
enum Step {
    Acquire {
        skew: i8,
        sends: u16,
        receives: u16,
        results_sent: u16,
        results_received: u16,
        reduces: bool,
        forwards: bool,
    },
    Event {
        event: u8,
        skew: i8,
    },
}

fuzz_target!(|steps: Vec<Step>| {
    let real = StagingState::new();
    let mut model = ReferenceModel::new();
    for step in steps {
        let generation = model.generation();
        // Mostly the current generation; sometimes a neighbour (stale or early).
        let g = |skew: i8| generation.wrapping_add_signed(i64::from(skew / 64));
        match step {
            Step::Acquire {
                skew,
                sends,
                receives,
                results_sent,
                results_received,
                reduces,
                forwards,
            } => {
                // Small counts mostly, so that sequences can complete slices.
                let small = |n: u16| if n > 0xF000 { n } else { n % 4 };
                let role = Role {
                    contributions_to_send: small(sends),
                    contributions_to_receive: small(receives),
                    results_to_send: small(results_sent),
                    results_to_receive: small(results_received),
                    reduces,
                    forwards,
                };
                let got = real
                    .acquire(g(skew), role)
                    .map(|_| ())
                    .map_err(|e| e.kind());
                assert_eq!(got, model.acquire(g(skew), role), "acquire {role:?}");
            }
            Step::Event { event, skew } => {
                let event = Event::ALL[usize::from(event) % Event::ALL.len()];
                let before = real.load();
                let got = real.on_event(event, g(skew)).map_err(|e| e.kind());
                assert_eq!(got, model.on_event(event, g(skew)), "{event:?} on {before}");
                if got.is_err() {
                    assert_eq!(real.load(), before, "a refused event changed the state");
                }
            }
        }
        assert_eq!(real.load().in_use(), model.is_acquired());
    }
});
