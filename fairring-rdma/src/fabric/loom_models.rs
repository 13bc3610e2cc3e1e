//! Loom models of the completion queue's sleep-and-wake handshake
//! (`completion.rs`): providers' I/O threads push while the user sleeps in
//! `wait`, and no push may fall between the waiter's last look at the queue
//! and its sleep.
//!
//! Under loom a condition variable's timed wait ignores its timeout, so a
//! wake-up the handshake should send and does not leaves the waiter asleep
//! for ever: loom reports the deadlock. The queue itself (crossbeam's
//! `ArrayQueue`) is taken as linearizable: loom schedules around its push and
//! pop, not inside them.
//!
//! Run: `RUSTFLAGS="--cfg loom" cargo test -p fairring-rdma --lib --release loom_models`

use std::time::Duration;

use loom::sync::Arc;
use loom::thread;

use super::{Completion, CompletionEvent, CompletionQueue};

/// A wait no model outlasts (loom ignores it anyway).
const FOREVER: Duration = Duration::from_secs(3600);

fn sent(token: u64) -> Completion {
    Completion {
        peer: 1,
        event: CompletionEvent::Sent { token },
    }
}

/// Waits until `want` completions have arrived; returns their tokens in
/// arrival order.
fn wait_for(queue: &CompletionQueue, want: usize) -> Vec<u64> {
    let mut tokens = Vec::new();
    let mut out = [sent(0); 4];
    while tokens.len() < want {
        let n = queue.wait(&mut out, FOREVER);
        for c in &out[..n] {
            match c.event {
                CompletionEvent::Sent { token } => tokens.push(token),
                other => panic!("only sends were pushed, got {other:?}"),
            }
        }
    }
    tokens
}

#[test]
fn a_push_wakes_a_sleeping_waiter() {
    loom::model(|| {
        let queue = Arc::new(CompletionQueue::new(4));
        let producer = {
            let queue = Arc::clone(&queue);
            thread::spawn(move || queue.push(sent(7)).expect("room for one"))
        };
        assert_eq!(wait_for(&queue, 1), [7]);
        producer.join().unwrap();
    });
}

#[test]
fn pushes_from_two_threads_each_reach_the_waiter() {
    loom::model(|| {
        let queue = Arc::new(CompletionQueue::new(4));
        let producers: Vec<_> = [1, 2]
            .into_iter()
            .map(|token| {
                let queue = Arc::clone(&queue);
                thread::spawn(move || queue.push(sent(token)).expect("room for two"))
            })
            .collect();
        let mut tokens = wait_for(&queue, 2);
        tokens.sort_unstable();
        assert_eq!(tokens, [1, 2]);
        for p in producers {
            p.join().unwrap();
        }
    });
}

#[test]
fn a_full_queue_gives_the_completion_back_and_a_retry_lands_it() {
    loom::model(|| {
        let queue = Arc::new(CompletionQueue::new(1));
        queue.push(sent(1)).expect("room for one");
        let producer = {
            let queue = Arc::clone(&queue);
            thread::spawn(move || {
                // A provider retries a push the full queue refused.
                while let Err(back) = queue.push(sent(2)) {
                    assert_eq!(back, sent(2));
                    thread::yield_now();
                }
            })
        };
        assert_eq!(wait_for(&queue, 2), [1, 2]);
        producer.join().unwrap();
    });
}
