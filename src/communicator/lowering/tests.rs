use fairring_core::WireFormat;
use fairring_core::plan::Routing;
use fairring_core::topology::{RankLayout, Topology};

use super::*;
use crate::config::Algorithm;
use crate::engine::algorithm::Resolved;
use crate::engine::work_table::Submission;
use crate::memory::{Host, HostTensor};

const INPUT: *mut u8 = 0x10_0000 as *mut u8;
const OUTPUT: *mut u8 = 0x400_0000 as *mut u8;

fn job(m: u32, d: u32, rank: u32) -> Job {
    Job {
        choice: choice::Job {
            topology: Topology::new(m, d, RankLayout::Contiguous).unwrap(),
            servers: 0,
            routing: Routing::Flat,
            algorithm: Algorithm::Auto,
            wire: WireFormat::Exact,
            nccl_over_workers: false,
            machines_serve: crate::MachinesServe::Auto,
            gpus_in_switch: false,
            machines_can_serve: true,
            groups_for_small_tensors: None,
        },
        rank,
    }
}

fn call(collective: Collective, count: u64, dtype: DataType, root: u32) -> Call {
    let in_place = matches!(collective, Collective::AllReduce | Collective::Broadcast);
    Call {
        collective,
        input: if in_place { OUTPUT } else { INPUT },
        output: OUTPUT,
        count,
        dtype,
        op: ReduceOp::Sum,
        root,
        peer: 0,
        tag: 0,
        memory: Memory::Host,
        options: Default::default(),
    }
}

/// The operation a collective call lowers to.
fn operation(c: &Call, job: &Job) -> Result<Operation> {
    match lower(c, job)? {
        Lowered::Operation(o) => Ok(o),
        Lowered::Message(m) => panic!("{c:?} lowered to a message: {m:?}"),
    }
}

const COLLECTIVES: [Collective; 8] = [
    Collective::AllReduce,
    Collective::Broadcast,
    Collective::AllGather,
    Collective::ReduceScatter,
    Collective::Barrier,
    Collective::Reduce,
    Collective::Gather,
    Collective::Scatter,
];

/// The engine plans what a call's descriptor runs as (as a dedicated server
/// does from the descriptor alone); the tensor lowering hands it must be
/// exactly that big, and a delivered share must be this rank's part of it.
/// This is the property the descriptor once was checked against at run time.
#[test]
fn every_call_hands_the_engine_the_tensor_its_descriptor_runs_as() {
    let mut lowered_calls = 0;
    for (m, d) in [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (1, 8), (4, 2)] {
        let world = m * d;
        for rank in [0, world - 1] {
            let job = job(m, d, rank);
            for collective in COLLECTIVES {
                for count in [0, 1, 1000, 1 << 20] {
                    for dtype in [DataType::U8, DataType::F32, DataType::I64] {
                        for algorithm in [
                            None,
                            Some(Algorithm::Hierarchical),
                            Some(Algorithm::Ring),
                            Some(Algorithm::Doubling),
                        ] {
                            let mut c = call(collective, count, dtype, world - 1);
                            c.options.algorithm = algorithm;
                            let Ok(l) = operation(&c, &job) else {
                                continue;
                            };
                            lowered_calls += 1;
                            let what = format!("{c:?} on {m}x{d}, rank {rank}");
                            let d = l.descriptor;
                            assert_eq!(Descriptor::from_words(d.words()), Some(d), "{what}");
                            let (at, bytes) = match l.tensor {
                                Tensor::Call { at, bytes } => (at, bytes),
                                Tensor::BarrierByte => {
                                    assert!(
                                        d.by_messages || collective == Collective::Barrier,
                                        "{what}"
                                    );
                                    (std::ptr::null_mut(), 1)
                                }
                            };
                            let sub = Submission::<Host>::new(
                                0,
                                HostTensor::new(at, bytes),
                                d,
                                None,
                                world,
                            )
                            .unwrap();
                            let planned = sub.elements() * sub.dtype().size_bytes();
                            let n = usize::try_from(count * dtype.size_bytes()).unwrap();
                            if d.algorithm == Resolved::Scatter {
                                // The scatter algorithm plans each rank's
                                // share of the whole input.
                                assert_eq!(planned, n as u64, "{what}");
                                assert_eq!(bytes, n * world as usize, "{what}");
                            } else {
                                assert_eq!(planned, bytes as u64, "{what}");
                            }
                            if let Some(share) = &l.deliver {
                                assert_eq!(share.to, OUTPUT, "{what}");
                                assert_eq!(share.range.len(), n, "{what}");
                                assert_eq!(share.range.start, rank as usize * n, "{what}");
                                assert!(share.range.end <= bytes, "{what}");
                            }
                            let delivers = !d.by_messages
                                && matches!(
                                    collective,
                                    Collective::ReduceScatter | Collective::Scatter
                                );
                            assert_eq!(l.deliver.is_some(), delivers, "{what}");
                        }
                    }
                }
            }
        }
    }
    assert!(lowered_calls > 5000, "{lowered_calls} calls lowered");
}

/// What each collective writes into its own memory before it starts.
#[test]
fn preludes_fill_what_the_engine_does_not() {
    let n = 400u64; // 100 f32
    let input = INPUT as u64;
    let output = OUTPUT as u64;
    // An all-gather on rank 1 of four machines (hierarchical under auto at
    // 4 KiB on 8 machines; relayed here over the ranks, which need no
    // zeros).
    let on = |m, d, rank, c: Call| operation(&c, &job(m, d, rank)).unwrap().prelude.fills();
    let gather = call(Collective::AllGather, 100, DataType::F32, 0);
    assert_eq!(
        on(2, 1, 1, gather),
        [Fill::Copy {
            to: output + n,
            from: input,
            bytes: 400
        }]
    );
    // Hierarchical all-gathers sum every rank's zeros into each place.
    let hierarchical = gather.with(Algorithm::Hierarchical);
    assert_eq!(
        on(4, 1, 1, hierarchical),
        [
            Fill::Copy {
                to: output + n,
                from: input,
                bytes: 400
            },
            Fill::Zero {
                at: output,
                bytes: 400
            },
            Fill::Zero {
                at: output + 2 * n,
                bytes: 800
            },
        ]
    );
    // In place: no copy.
    let in_place = Call {
        input: OUTPUT.wrapping_add(400),
        ..hierarchical
    };
    assert_eq!(on(4, 1, 1, in_place).len(), 2);
    // A broadcast zeroes where it is not the root, under the all-reduce.
    let broadcast =
        call(Collective::Broadcast, 100, DataType::F32, 0).with(Algorithm::Hierarchical);
    assert_eq!(
        on(1, 2, 1, broadcast),
        [Fill::Zero {
            at: output,
            bytes: 400
        }]
    );
    assert_eq!(on(1, 2, 0, broadcast), []);
    // A reduce out of place copies its input into the output it reduces in.
    let reduce = call(Collective::Reduce, 100, DataType::F32, 0);
    assert_eq!(
        on(1, 2, 1, reduce),
        [Fill::Copy {
            to: output,
            from: input,
            bytes: 400
        }]
    );
    // A gather of 2 MiB or more on host memory moves as messages; each rank
    // copies its part to its place in the output with the check.
    let big = call(Collective::Gather, 1 << 20, DataType::F32, 0);
    let lowered = operation(&big, &job(2, 1, 1)).unwrap();
    assert!(lowered.descriptor.by_messages);
    assert_eq!(lowered.tensor, Tensor::BarrierByte);
    assert_eq!(
        lowered.prelude.fills(),
        [Fill::Copy {
            to: output + (4 << 20),
            from: input,
            bytes: 4 << 20
        }]
    );
}

/// Refusals name the argument that was wrong.
#[test]
fn a_call_that_cannot_run_is_refused_naming_its_argument() {
    let job = job(2, 1, 0);
    let refused = |c: Call| match lower(&c, &job) {
        Err(Error::InvalidArgument { argument, reason }) => (argument, reason),
        other => panic!("{c:?} lowered to {other:?}"),
    };
    let (argument, reason) = refused(call(Collective::Broadcast, 1, DataType::F32, 2));
    assert_eq!(argument, "root");
    assert!(
        reason.contains("rank 2 is not in a job of 2 ranks"),
        "{reason}"
    );
    let mut bad_op = call(Collective::AllReduce, 1, DataType::U8, 0);
    bad_op.op = ReduceOp::Avg;
    let (argument, _) = refused(bad_op);
    assert_eq!(argument, "op");
    let (argument, _) = refused(call(Collective::AllGather, u64::MAX / 2, DataType::U8, 0));
    assert_eq!(argument, "count");
    let (argument, _) = refused(call(Collective::AllReduce, u64::MAX / 4, DataType::F32, 0));
    assert_eq!(argument, "count");
    let compressed = call(Collective::Broadcast, 1, DataType::F32, 0).with(WireFormat::Bf16);
    let (argument, _) = refused(compressed);
    assert_eq!(argument, "wire");
    let integer = call(Collective::AllReduce, 1, DataType::I32, 0).with(WireFormat::F16);
    let (argument, _) = refused(integer);
    assert_eq!(argument, "wire");
}

/// A send or a receive lowers to a message of the engine, to or from another
/// rank, on host memory.
#[test]
fn sends_and_receives_lower_to_messages_of_the_engine() {
    let job = job(2, 2, 1);
    let send = Call::send(3, 7, INPUT, 100, DataType::F32);
    match lower(&send, &job) {
        Ok(Lowered::Message(m)) => assert_eq!(
            m,
            MessagePost {
                peer: 3,
                tag: 7,
                sending: true,
                data: INPUT,
                count: 100,
                dtype: DataType::F32,
            }
        ),
        other => panic!("{send:?} lowered to {other:?}"),
    }
    let recv = Call::recv(0, 2, OUTPUT, 0, DataType::I64);
    assert!(matches!(
        lower(&recv, &job),
        Ok(Lowered::Message(MessagePost {
            peer: 0,
            tag: 2,
            sending: false,
            count: 0,
            ..
        }))
    ));
    let refused = |c: Call| match lower(&c, &job) {
        Err(Error::InvalidArgument { argument, reason }) => (argument, reason),
        other => panic!("{c:?} lowered to {other:?}"),
    };
    // Itself, and a rank outside the job.
    for peer in [1, 4] {
        let (argument, reason) = refused(Call::send(peer, 0, INPUT, 1, DataType::F32));
        assert_eq!(argument, "peer", "{reason}");
        assert!(
            reason.contains("not another rank of this job of 4"),
            "{reason}"
        );
    }
    let (argument, _) = refused(Call::recv(0, 0, std::ptr::null_mut(), 1, DataType::F32));
    assert_eq!(argument, "data");
    let (argument, _) = refused(Call::recv(0, 0, OUTPUT.wrapping_add(1), 1, DataType::F32));
    assert_eq!(argument, "data");
    let (argument, _) = refused(Call::send(0, 0, INPUT, u64::MAX, DataType::F32));
    assert_eq!(argument, "count");
    let (argument, _) = refused(Call::send(0, 0, INPUT, 1, DataType::F32).with(WireFormat::Bf16));
    assert_eq!(argument, "wire");
    // Messages run on host memory.
    #[cfg(feature = "cuda")]
    {
        let on_device = Call::recv(0, 0, OUTPUT, 1, DataType::F32).on_stream(std::ptr::null_mut());
        let (argument, reason) = refused(on_device);
        assert_eq!(argument, "memory");
        assert_eq!(reason, "a recv runs on host memory");
    }
}
