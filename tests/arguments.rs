//! Bad arguments are errors naming the argument, with no side effects: the
//! memory is untouched and no sequence number is used, so the ranks still agree.

mod common;

use common::job;
use fairring::{Call, DataType, ReduceOp};

#[test]
fn bad_raw_arguments_are_refused_without_side_effects() {
    job(
        1,
        2,
        |b| b,
        |rank, comm| {
            let mut words = [7u64; 4];
            let base: *mut u8 = words.as_mut_ptr().cast();
            let raw = |data: *mut u8, count: u64, dtype: DataType, op: ReduceOp| {
                // SAFETY: every call below is refused before the pointer is used.
                unsafe { comm.start(&Call::all_reduce(data, count, dtype, op)) }.err()
            };
            let refusals = [
                (
                    raw(std::ptr::null_mut(), 4, DataType::F32, ReduceOp::Sum),
                    "null",
                ),
                (
                    raw(base.wrapping_add(1), 4, DataType::F32, ReduceOp::Sum),
                    "not aligned to 4 bytes for f32",
                ),
                (
                    raw(base.wrapping_add(4), 2, DataType::F64, ReduceOp::Sum),
                    "not aligned to 8 bytes for f64",
                ),
                (
                    raw(base, 4, DataType::I32, ReduceOp::Avg),
                    "avg is not defined on i32",
                ),
                (
                    raw(base, u64::MAX / 2, DataType::F64, ReduceOp::Sum),
                    "overflow",
                ),
            ];
            for (error, want) in refusals {
                let text = error.expect("refused").to_string();
                assert!(text.contains(want), "rank {rank}: {text:?} lacks {want:?}");
            }
            assert_eq!(words, [7; 4], "rank {rank}: memory touched");
            // A null pointer with no elements is a valid empty operation.
            // SAFETY: zero elements are never accessed.
            let empty = unsafe {
                comm.start(&Call::all_reduce(
                    std::ptr::null_mut(),
                    0,
                    DataType::F32,
                    ReduceOp::Sum,
                ))
            };
            empty.expect("empty").wait().expect("empty");
            let mut x = [i64::from(rank) + 1; 3];
            comm.all_reduce(&mut x, ReduceOp::Sum)
                .expect("after refusals");
            assert_eq!(x, [3; 3]);
        },
    );
}

#[test]
fn a_worker_and_a_server_refuse_each_others_configuration() {
    let port = common::free_port();
    let server = fairring::Config::server_builder(0, 2, "127.0.0.1", port)
        .servers(1)
        .build()
        .expect("config");
    let e = fairring::Communicator::new(server).err().expect("refused");
    assert!(e.to_string().contains("FAIRRING_ROLE"), "{e}");
    let worker = fairring::Config::builder(0, 2, "127.0.0.1", port)
        .build()
        .expect("config");
    let e = fairring::Server::with_store(worker, std::sync::Arc::new(NoStore))
        .err()
        .expect("refused");
    assert!(e.to_string().contains("FAIRRING_ROLE"), "{e}");
}

/// A store nothing should touch: the refusals come before any rendezvous.
struct NoStore;

impl fairring::Store for NoStore {
    fn set(&self, key: &str, _: &[u8]) -> fairring::Result<()> {
        panic!("set {key}")
    }
    fn get(&self, key: &str, _: std::time::Duration) -> fairring::Result<Vec<u8>> {
        panic!("get {key}")
    }
    fn check(&self, keys: &[&str]) -> fairring::Result<bool> {
        panic!("check {keys:?}")
    }
}
