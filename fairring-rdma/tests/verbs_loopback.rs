//! The verbs provider. Without an RDMA device only the first test can run; the
//! others are ignored with the reason and run with `--include-ignored` where a
//! device (or Soft-RoCE) exists, as two fabrics in one process on that device.
#![cfg(feature = "verbs")]

use std::ptr::NonNull;
use std::time::Duration;

use fairring_rdma::JobSecret;
use fairring_rdma::fabric::{Completion, CompletionEvent, Fabric, LocalRegion, WriteRequest};
use fairring_rdma::verbs::{VerbsConfig, VerbsFabric, VerbsRegion};

fn config(rank: u32) -> VerbsConfig {
    let mut c = VerbsConfig::new(rank, 2, 0x7e5, JobSecret::from_bytes([8; 32]));
    c.device = std::env::var("FAIRRING_TEST_RDMA_DEVICE").ok();
    c.receive_depth = 16;
    c
}

#[test]
fn a_missing_device_is_an_error_not_a_panic() {
    let mut c = config(0);
    c.device = Some("fairring-no-such-device".into());
    let e = VerbsFabric::new(c).unwrap_err().to_string();
    assert!(e.contains("RDMA device"), "{e}");
}

#[test]
fn listing_devices_never_fails() {
    let names = fairring_rdma::verbs::devices();
    // Without a device the list is empty; with one, opening it by name works.
    if let Some(first) = names.first() {
        let mut c = config(0);
        c.device = Some(first.clone());
        assert!(
            VerbsFabric::new(c).is_ok(),
            "{first} is listed but does not open"
        );
    }
    assert!(names.iter().all(|n| !n.is_empty()));
}

fn pair() -> (VerbsFabric, VerbsFabric) {
    let zero = VerbsFabric::new(config(0)).unwrap();
    let one = VerbsFabric::new(config(1)).unwrap();
    let (e0, e1) = (zero.endpoint(1).unwrap(), one.endpoint(0).unwrap());
    zero.connect(1, &e1).unwrap();
    one.connect(0, &e0).unwrap();
    (zero, one)
}

fn register(fabric: &VerbsFabric, memory: &mut [u8]) -> VerbsRegion {
    // SAFETY: the tests keep `memory` alive and untouched while registered.
    unsafe { fabric.register(NonNull::new(memory.as_mut_ptr()).unwrap(), memory.len()) }.unwrap()
}

fn next(fabric: &VerbsFabric) -> Completion {
    let mut out = [Completion {
        peer: 9,
        event: CompletionEvent::Sent { token: 0 },
    }];
    assert_eq!(
        fabric.wait(&mut out, Duration::from_secs(10)),
        1,
        "no completion in 10 s"
    );
    out[0]
}

#[test]
#[ignore = "needs an RDMA device"]
fn write_with_immediate_lands_byte_exact() {
    let (zero, one) = pair();
    let mut source: Vec<u8> = (0..1 << 20).map(|i| (i % 253) as u8).collect();
    let mut target = vec![0u8; 2 << 20];
    let s = register(&one, &mut source);
    let t = register(&zero, &mut target);
    let request = WriteRequest {
        source: &s,
        source_offset: 16,
        len: 1000,
        target: t.remote(),
        target_offset: 4096,
        immediate: 0xdead_beef,
        token: 5,
    };
    one.write(0, request).unwrap();
    assert_eq!(
        next(&zero).event,
        CompletionEvent::Landed {
            len: 1000,
            immediate: 0xdead_beef
        }
    );
    assert_eq!(next(&one).event, CompletionEvent::Sent { token: 5 });
    drop((s, t));
    assert_eq!(&target[4096..5096], &source[16..1016]);
}

#[test]
#[ignore = "needs an RDMA device"]
fn messages_and_credits_flow_past_the_receive_depth() {
    let (zero, one) = pair();
    // Four times the receive depth: credits must come back for this to finish.
    let mut sent = 0u32;
    let mut received = 0u32;
    while received < 64 {
        if sent < 64
            && one
                .send_message(0, sent, &sent.to_le_bytes(), u64::from(sent))
                .is_ok()
        {
            sent += 1;
        }
        let mut out = [Completion {
            peer: 9,
            event: CompletionEvent::Sent { token: 0 },
        }; 8];
        let n = zero.poll(&mut out);
        for c in &out[..n] {
            match c.event {
                CompletionEvent::Message(m) => {
                    assert_eq!(
                        (m.immediate, m.payload()),
                        (received, &received.to_le_bytes()[..])
                    );
                    received += 1;
                }
                other => panic!("{other:?}"),
            }
        }
        one.poll(&mut out);
    }
}

#[test]
#[ignore = "needs an RDMA device"]
fn a_forged_endpoint_is_refused() {
    let zero = VerbsFabric::new(config(0)).unwrap();
    let mut other = config(1);
    other.secret = JobSecret::from_bytes([9; 32]);
    let one = VerbsFabric::new(other).unwrap();
    let e = zero
        .connect(1, &one.endpoint(0).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("wrong job secret"), "{e}");
}
