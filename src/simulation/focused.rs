//! Focused tests: schedules and faults the seeds reach rarely, built by
//! hand over the same simulated job.

use super::*;

/// Relayed chunks land early in the slice area of a buffer, the bytes a local
/// rank's all-gather reads from its peers' buffers: all-reduces with a local step
/// interleaved with relays, over few buffers, on schedules where a rank runs
/// ahead of the other ranks of its machine.
#[test]
fn relays_after_local_steps_leave_local_readers_their_bytes() {
    let (mut checked, mut expected) = (0, 0);
    for seed in 1..=400u64 {
        let mut rng = Rng::new(seed);
        let (machines, devices) = rng.pick(&[(2, 2), (2, 3), (3, 2)]);
        let world = machines * devices;
        let reduce = |elements| Op {
            elements,
            dtype: DataType::I64,
            op: ReduceOp::Sum,
            algorithm: Resolved::Hierarchical,
            wire: WireFormat::Exact,
            origins: None,
            share: None,
            rooted: None,
        };
        let relay = |origins| Op {
            elements: match origins {
                Origins::Blocks(block) => block * u64::from(world),
                Origins::Rank(_) => 3000,
            },
            dtype: DataType::U8,
            op: ReduceOp::Sum,
            algorithm: Resolved::Relay,
            wire: WireFormat::Exact,
            origins: Some(origins),
            share: None,
            rooted: None,
        };
        let scenario = Scenario {
            machines,
            devices,
            layout: RankLayout::Contiguous,
            servers: 0,
            buffers: 1 + rng.below(2) as u32,
            slice_bytes: 1024,
            min_shard_bytes: 64,
            ops: vec![
                reduce(300),
                relay(Origins::Blocks(400)),
                reduce(200),
                relay(Origins::Rank(world - 1)),
                reduce(129),
                relay(Origins::Blocks(97)),
            ],
            window: 2 + rng.below(3) as usize,
            kill: None,
            direct: DirectSettings::from(None),
            device: vec![false; 6],
            collectives: false,
            whole_up_to: 0,
            one_reduce_scatter_from: crate::local::ONE_REDUCE_SCATTER_FROM_BYTES,
            across_job: false,
            group_size: None,
            grouped: None,
        };
        match play(
            &scenario,
            &messages::Script::default(),
            &mut rng,
            Design::Accepted,
            STEP_LIMIT,
        ) {
            Ok(outcome) => checked += outcome.done,
            Err(e) => panic!("seed {seed}, {scenario:?}: {e}"),
        }
        expected += world as usize * scenario.ops.len();
    }
    assert_eq!(checked, expected, "every operation of every rank is done");
}

/// Broadcasts between two ranks of machines of their own land in the
/// receiver's tensor through its window (`engine/direct.rs`), from either
/// root, and so do the results of an all-reduce among them, over one to
/// three buffers, with one registration kept or many (so that a rank may
/// find none to send from, and stage), and with a rank killed at a drawn
/// step: every rank's result exact, every survivor's error naming the
/// victim, and chunks landing in windows.
#[test]
fn broadcasts_and_results_land_in_receivers_windows() {
    let (mut checked, mut expected, mut in_windows) = (0, 0, 0);
    for seed in 1..=300u64 {
        let mut rng = Rng::new(seed);
        let broadcast = |root, elements| Op {
            elements,
            dtype: DataType::U8,
            op: ReduceOp::Sum,
            algorithm: Resolved::Relay,
            wire: WireFormat::Exact,
            origins: Some(Origins::Rank(root)),
            share: None,
            rooted: None,
        };
        let reduce = Op {
            elements: 700,
            dtype: DataType::I64,
            op: ReduceOp::Sum,
            algorithm: Resolved::Hierarchical,
            wire: WireFormat::Exact,
            origins: None,
            share: None,
            rooted: None,
        };
        let killed = rng.below(3) == 0;
        let scenario = Scenario {
            machines: 2,
            devices: 1,
            layout: RankLayout::Contiguous,
            servers: 0,
            buffers: 1 + rng.below(3) as u32,
            slice_bytes: 1024,
            min_shard_bytes: 64,
            ops: vec![
                broadcast(1, 5000),
                reduce,
                broadcast(0, 3001),
                broadcast(0, 3001),
                broadcast(1, 17),
                broadcast(1, 4096),
            ],
            window: 1 + rng.below(4) as usize,
            kill: killed.then(|| (1 + rng.below(3000), rng.below(2) as u32)),
            direct: DirectSettings {
                from_bytes: Some(rng.pick(&[0, 4096])),
                cached: rng.pick(&[1, 2, 64]),
            },
            device: vec![false; 6],
            collectives: false,
            whole_up_to: 0,
            one_reduce_scatter_from: crate::local::ONE_REDUCE_SCATTER_FROM_BYTES,
            across_job: false,
            group_size: None,
            grouped: None,
        };
        match play(
            &scenario,
            &messages::Script::default(),
            &mut rng,
            Design::Accepted,
            STEP_LIMIT,
        ) {
            // With a rank killed, `play` checks every survivor's error.
            Ok(outcome) if killed => in_windows += outcome.in_windows,
            Ok(outcome) => {
                checked += outcome.done;
                expected += 2 * scenario.ops.len();
                in_windows += outcome.in_windows;
            }
            Err(e) => panic!("seed {seed}, {scenario:?}: {e}"),
        }
    }
    assert_eq!(checked, expected, "every operation of every rank is done");
    assert!(in_windows > 1000, "{in_windows} writes landed in windows");
}

/// Submits operation 0 on `engine`: a hierarchical `i64` sum of `tensor`, a
/// device tensor whose caller's stream first writes `input` into it.
fn submit_device_sum(
    engine: &Engine<SimFabric, SimMemory>,
    tensor: &mut [u64],
    input: &mut [u64],
) -> crate::Result<()> {
    submit_device_sum_by(engine, tensor, input, Resolved::Hierarchical)
}

/// [`submit_device_sum`] running `algorithm`.
fn submit_device_sum_by(
    engine: &Engine<SimFabric, SimMemory>,
    tensor: &mut [u64],
    input: &mut [u64],
    algorithm: Resolved,
) -> crate::Result<()> {
    assert!(engine.works.try_take(0));
    let elements = tensor.len() as u64;
    let descriptor = Descriptor {
        collective: Collective::AllReduce,
        dtype: DataType::I64,
        op: ReduceOp::Sum,
        algorithm,
        wire: WireFormat::Exact,
        memory: MemoryKind::Device,
        by_messages: false,
        root: 0,
        elements,
    };
    let tensor = engine
        .memory
        .submit_device(bytemuck_bytes(tensor), bytemuck_bytes(input), 0);
    engine.submit(Submission::new(0, tensor, descriptor, None, 2).unwrap())
}

/// Drives every engine (and, with `gpu`, runs every simulated GPU's ready
/// work) until operation 0 has settled on each, for at most 10 000 rounds.
fn drive_until_settled(engines: &[Engine<SimFabric, SimMemory>], gpu: bool) {
    drive_over(engines, gpu, None);
}

/// [`drive_until_settled`], delivering what is in flight on `net` each
/// round from round `from` on, where given (`(net, from)`): the network
/// holds every message until then.
fn drive_over(
    engines: &[Engine<SimFabric, SimMemory>],
    gpu: bool,
    net: Option<(&Arc<std::sync::Mutex<Network>>, usize)>,
) {
    let settled = |e: &Engine<SimFabric, SimMemory>| e.works.state(0).is_some_and(|s| s != 0);
    for round in 0..10_000 {
        if engines.iter().all(settled) {
            break;
        }
        for e in engines {
            e.try_drive();
            while gpu && e.memory.gpu().run_any(|_| 0) {}
        }
        if let Some((net, from)) = net
            && round >= from
        {
            let mut net = net
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for (a, b) in net.busy_links() {
                net.deliver(a, b);
            }
        }
    }
}

/// A local step that panics in its all-gather: a bug inside a step.
struct PanickingAllGather(SimStep);

impl LocalStep<SimMemory> for PanickingAllGather {
    fn buffer_free(&self, buffer: u32, number: u64) -> bool {
        self.0.buffer_free(buffer, number)
    }
    fn begin(&self, s: &LocalSlice<'_, SimMemory>) -> crate::Result<()> {
        self.0.begin(s)
    }
    fn try_reduce_scatter(
        &self,
        s: &LocalSlice<'_, SimMemory>,
        final_world: Option<u32>,
    ) -> crate::Result<Option<SimFence>> {
        self.0.try_reduce_scatter(s, final_world)
    }
    fn publish_slot(&self, s: &LocalSlice<'_, SimMemory>) {
        self.0.publish_slot(s);
    }
    fn try_all_gather(
        &self,
        _s: &LocalSlice<'_, SimMemory>,
        _own_in_tensor: bool,
    ) -> crate::Result<Option<SimFence>> {
        panic!("an injected panic in the all-gather");
    }
    fn finish(&self, buffer: u32, number: u64) {
        self.0.finish(buffer, number);
    }
    fn laggards(&self, buffer: u32, number: u64) -> Vec<u32> {
        self.0.laggards(buffer, number)
    }
}

#[test]
fn a_panic_inside_a_step_fails_the_communicator_with_its_message() {
    let (engines, _net) = small_job(
        (1, 2),
        Design::Accepted,
        Duration::from_secs(3600),
        |rank, step| {
            if rank == 1 {
                Box::new(PanickingAllGather(step))
            } else {
                Box::new(step)
            }
        },
    );
    let mut tensors = [[1u64; 300], [2u64; 300]];
    for (engine, tensor) in engines.iter().zip(&mut tensors) {
        assert!(engine.works.try_take(0));
        let descriptor = Descriptor {
            collective: Collective::AllReduce,
            dtype: DataType::I64,
            op: ReduceOp::Sum,
            algorithm: Resolved::Hierarchical,
            wire: WireFormat::Exact,
            memory: crate::memory::MemoryKind::Host,
            by_messages: false,
            root: 0,
            elements: 300,
        };
        engine
            .submit(
                Submission::new(
                    0,
                    SimTensor::Host(HostTensor::new(tensor.as_mut_ptr().cast(), 2400)),
                    descriptor,
                    None,
                    2,
                )
                .unwrap(),
            )
            .unwrap();
    }
    drive_until_settled(&engines, false);
    for e in &engines {
        assert_eq!(e.works.state(0), Some(FAILED), "rank {}", e.rank());
    }
    let own = engines[1].failure().unwrap();
    assert!(
        matches!(&own, crate::Error::Internal { detail, .. } if detail.contains("injected panic")),
        "{own}"
    );
    let peer = engines[0].failure().unwrap().to_string();
    assert!(
        peer.contains("rank 1") && peer.contains("injected panic"),
        "{peer}"
    );
    assert!(!engines[1].driver_is_poisoned());
    // The failed engine takes no more work and drives nothing.
    assert!(!engines[1].try_drive());
    assert!(engines[1].works.try_take(1));
    let barrier = Descriptor {
        collective: Collective::Barrier,
        dtype: DataType::U8,
        op: ReduceOp::Sum,
        algorithm: Resolved::Hierarchical,
        wire: WireFormat::Exact,
        memory: crate::memory::MemoryKind::Host,
        by_messages: false,
        root: 0,
        elements: 1,
    };
    let mut byte = 0u8;
    let refused = engines[1].submit(
        Submission::new(
            1,
            SimTensor::Host(HostTensor::new(&raw mut byte, 1)),
            barrier,
            None,
            2,
        )
        .unwrap(),
    );
    assert!(matches!(refused, Err(crate::Error::Failed { .. })));
}

/// The stall timer runs from an operation's start on the caller's stream:
/// a rank whose caller's stream takes longer than the timeout to reach the
/// start does not fail, and its operation then completes exactly. Under the
/// design before the gate its engine issued the operation's copies at once,
/// and they waited on its stream past the timeout: the stall timer fired.
#[test]
fn time_before_an_operation_starts_is_the_callers() {
    let timeout = Duration::from_millis(40);
    let outcome = |design| -> Result<Vec<i64>, String> {
        let (engines, net) = small_job((2, 1), design, timeout, |_, step| Box::new(step));
        let mut tensors = [vec![0u64; 1000], vec![0u64; 1000]];
        let mut inputs = [vec![3u64; 1000], vec![4u64; 1000]];
        let pump = |engines: &[Engine<SimFabric, SimMemory>]| {
            for e in engines {
                e.try_drive();
            }
            let mut net = net
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            for (a, b) in net.busy_links() {
                net.deliver(a, b);
            }
        };
        let submit = |r: usize, tensor: &mut [u64], input: &mut [u64]| {
            submit_device_sum(&engines[r], tensor, input).map_err(|e| e.to_string())
        };
        let [t0, t1] = &mut tensors;
        let [i0, i1] = &mut inputs;
        // Rank 0's caller's stream is busy for three timeouts before it
        // reaches the start; rank 1 has not called yet.
        submit(0, t0, i0)?;
        let begun = std::time::Instant::now();
        while begun.elapsed() < 3 * timeout {
            pump(&engines);
            if let Some(e) = engines[0].failure() {
                return Err(e.to_string());
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        submit(1, t1, i1)?;
        for _ in 0..100_000 {
            if engines.iter().all(|e| e.works.state(0) == Some(DONE)) {
                return Ok(tensors.iter().map(|t| t[999] as i64).collect());
            }
            for e in &engines {
                e.memory.gpu().run_any(|_| 0);
            }
            pump(&engines);
            if let Some(e) = engines.iter().find_map(|e| e.failure()) {
                return Err(e.to_string());
            }
        }
        Err("not done".into())
    };
    assert_eq!(outcome(Design::Accepted), Ok(vec![7, 7]));
}

/// A failing engine neither waits for the GPU nor declares an operation
/// failed while one of its copies may still write the caller's tensor: the
/// operation stays pending until the copy has run, then fails.
#[test]
fn a_failure_waits_for_running_copies_without_blocking() {
    // One rank per machine (a copy a slice's step holds) and two (the staged
    // step's copies in, which only the local step holds).
    for layout in [(2, 1), (1, 2)] {
        let (engines, _net) = small_job(
            layout,
            Design::Accepted,
            Duration::from_secs(3600),
            |_, step| Box::new(step),
        );
        let mut tensors = [vec![0u64; 1000], vec![0u64; 1000]];
        let mut inputs = [vec![3u64; 1000], vec![4u64; 1000]];
        for (r, (t, i)) in tensors.iter_mut().zip(&mut inputs).enumerate() {
            submit_device_sum(&engines[r], t, i).unwrap();
        }
        // Rank 0's caller's stream reaches the start (the input's copy runs);
        // its engine then issues the slice's first copy, which has not run.
        assert!(engines[0].memory.gpu().run_any(|_| 0));
        for _ in 0..100 {
            for e in &engines {
                e.try_drive();
            }
        }
        let waiting = engines[0].memory.gpu().waiting().unwrap_or_default();
        assert!(waiting.contains("engine stream"), "{layout:?}: {waiting}");
        engines[0].fail(crate::Error::Aborted);
        assert_eq!(
            engines[0].works.state(0),
            Some(work::PENDING),
            "{layout:?}: declared failed while its copy may still touch the tensor"
        );
        assert!(engines[0].memory.gpu().run_out().is_none());
        engines[0].try_drive();
        assert_eq!(engines[0].works.state(0), Some(FAILED), "{layout:?}");
    }
}

/// A local step that records the bytes of every slice it reduces.
struct RecordingSlices {
    step: SimStep,
    slices: std::sync::Mutex<Vec<u64>>,
}

impl LocalStep<SimMemory> for std::sync::Arc<RecordingSlices> {
    fn buffer_free(&self, buffer: u32, number: u64) -> bool {
        self.step.buffer_free(buffer, number)
    }
    fn works_in_tensor(&self, tensor: &SimTensor, dtype: DataType, op: ReduceOp) -> bool {
        self.step.works_in_tensor(tensor, dtype, op)
    }
    fn begin(&self, s: &LocalSlice<'_, SimMemory>) -> crate::Result<()> {
        self.slices.lock().unwrap().push(s.slice.span().byte_len());
        self.step.begin(s)
    }
    fn try_reduce_scatter(
        &self,
        s: &LocalSlice<'_, SimMemory>,
        final_world: Option<u32>,
    ) -> crate::Result<Option<SimFence>> {
        self.step.try_reduce_scatter(s, final_world)
    }
    fn publish_slot(&self, s: &LocalSlice<'_, SimMemory>) {
        self.step.publish_slot(s);
    }
    fn try_all_gather(
        &self,
        s: &LocalSlice<'_, SimMemory>,
        own_in_tensor: bool,
    ) -> crate::Result<Option<SimFence>> {
        self.step.try_all_gather(s, own_in_tensor)
    }
    fn finish(&self, buffer: u32, number: u64) {
        self.step.finish(buffer, number);
    }
    fn laggards(&self, buffer: u32, number: u64) -> Vec<u32> {
        self.step.laggards(buffer, number)
    }
    fn gathered(&self, buffer: u32, number: u64) -> crate::Result<()> {
        self.step.gathered(buffer, number)
    }
    fn awaits_fences(&self) -> bool {
        self.step.awaits_fences()
    }
    fn device_items(
        &self,
        s: &LocalSlice<'_, SimMemory>,
        stage: crate::local::LocalStage,
        each: &mut dyn FnMut(ProgramItem<SimTensor>) -> crate::Result<()>,
    ) -> crate::Result<()> {
        self.step.device_items(s, stage, each)
    }
    fn enqueue(
        &self,
        tensor: &SimTensor,
        seq: u64,
        items: &[ProgramItem<SimTensor>],
    ) -> std::result::Result<(), crate::memory::program::Unfinished> {
        self.step.enqueue(tensor, seq, items)
    }
    fn release(&self) {
        self.step.release();
    }
    fn close_tensors(&self) {
        self.step.close_tensors();
    }
}

/// The engines of a job of `machines` x `devices` ranks (1 KiB slices, two
/// buffers) over `net`, through `collectives` where given, each worker's
/// local step recording the bytes of its slices (the recorders, by rank).
fn recording_job(
    machines: u32,
    devices: u32,
    net: &Arc<std::sync::Mutex<Network>>,
    collectives: Option<&Collectives>,
) -> (
    Vec<Engine<SimFabric, SimMemory>>,
    Vec<std::sync::Arc<RecordingSlices>>,
) {
    let topology = Topology::new(machines, devices, RankLayout::Contiguous).unwrap();
    let geometry = Geometry::new(topology, PlanConfig::new(1024, 64).unwrap()).unwrap();
    let layout = BufferLayout::new(&geometry, machines * devices).unwrap();
    let recorders = std::sync::Mutex::new(Vec::new());
    let engines = build_job(
        &geometry,
        &layout,
        2,
        net,
        DirectSettings::from(None),
        Design::Accepted,
        collectives,
        0,
        Duration::from_secs(3600),
        |rank, step| {
            let recorder = std::sync::Arc::new(RecordingSlices {
                step,
                slices: std::sync::Mutex::default(),
            });
            let mut recorders = recorders.lock().unwrap();
            assert_eq!(recorders.len(), rank as usize, "ranks in order");
            recorders.push(std::sync::Arc::clone(&recorder));
            Box::new(recorder)
        },
    )
    .unwrap();
    (engines, recorders.into_inner().unwrap())
}

/// On one machine whose ranks reduce device tensors through the machine's
/// collectives, an all-reduce of many slices' worth is one slice, one
/// collective all-reduce in the tensor; device tensors that go through the
/// host are still sliced to the staging buffers. Every result is exact.
#[test]
fn one_machine_reduces_a_device_tensor_in_one_slice_through_its_collectives() {
    const ELEMENTS: usize = 1000;
    for (collectives, expect_whole) in [(true, true), (false, false)] {
        let net = Network::new(2);
        let (engines, recorders) =
            recording_job(1, 2, &net, collectives.then(Collectives::shipped).as_ref());
        let mut tensors = [vec![0u64; ELEMENTS], vec![0u64; ELEMENTS]];
        let mut inputs = [
            (0..ELEMENTS as u64).collect::<Vec<_>>(),
            (0..ELEMENTS as u64).map(|i| 3 * i + 1).collect::<Vec<_>>(),
        ];
        for (r, (t, i)) in tensors.iter_mut().zip(&mut inputs).enumerate() {
            submit_device_sum(&engines[r], t, i).unwrap();
        }
        drive_until_settled(&engines, true);
        for e in &engines {
            assert_eq!(e.works.state(0), Some(DONE), "rank {}", e.rank());
        }
        for (r, t) in tensors.iter().enumerate() {
            for (i, &v) in t.iter().enumerate() {
                assert_eq!(v, 4 * i as u64 + 1, "rank {r}, element {i}");
            }
        }
        for (r, recorder) in recorders.iter().enumerate() {
            let slices = recorder.slices.lock().unwrap().clone();
            let bytes = (ELEMENTS * 8) as u64;
            if expect_whole {
                assert_eq!(
                    slices,
                    vec![bytes],
                    "rank {r}: one slice of the whole tensor"
                );
            } else {
                assert!(
                    slices.len() > 1 && slices.iter().all(|&b| b <= 1024),
                    "rank {r}: slices {slices:?}"
                );
                assert_eq!(slices.iter().sum::<u64>(), bytes, "rank {r}");
            }
        }
    }
}

/// `e` failed with the mismatch, or naming a peer that did (`what` says
/// which job).
fn assert_failed_on_a_mismatch(e: &Engine<SimFabric, SimMemory>, what: &str) {
    let error = e
        .failure()
        .unwrap_or_else(|| panic!("{what}: rank {} failed", e.rank()));
    assert!(
        matches!(
            error,
            crate::Error::Mismatch { .. } | crate::Error::Peer { .. }
        ),
        "{what}: rank {}: {error}",
        e.rank()
    );
}

/// On one machine through its collectives, a device all-reduce runs and ends
/// on the device with no engine driven: its one NCCL call waits for no gate,
/// and its stream writes the operation's done word, which a stream waiting
/// for the result waits on. The engines, driven afterwards, check it and
/// declare it done. Where rank 1 issued another length, the calls disagree
/// and never meet (no done word is written); the engines fail naming the
/// mismatch, and their failures abort the calls, so every stream ends.
#[test]
fn one_machines_nccl_all_reduce_runs_and_ends_on_the_device_without_the_engine() {
    const ELEMENTS: usize = 1000;
    for mismatched in [false, true] {
        let net = Network::new(2);
        let (engines, _) = recording_job(1, 2, &net, Some(&Collectives::shipped()));
        let len = |r: usize| {
            if mismatched && r == 1 {
                ELEMENTS + 8
            } else {
                ELEMENTS
            }
        };
        let mut tensors: Vec<Vec<u64>> = (0..2).map(|r| vec![0; len(r)]).collect();
        let mut inputs: Vec<Vec<u64>> = (0..2)
            .map(|r| (0..len(r) as u64).map(|i| i * (r as u64 + 2)).collect())
            .collect();
        for (r, (t, i)) in tensors.iter_mut().zip(&mut inputs).enumerate() {
            submit_device_sum(&engines[r], t, i).unwrap();
        }
        // The devices alone: no engine is driven.
        for _ in 0..10 {
            for e in &engines {
                while e.memory.gpu().run_any(|_| 0) {}
            }
        }
        for e in &engines {
            assert_eq!(
                e.memory.gpu().done_written(0),
                !mismatched,
                "mismatched {mismatched}: rank {}'s done word",
                e.rank()
            );
            assert_eq!(e.works.state(0), Some(0), "the engine has not settled it");
            assert_eq!(
                e.memory.gpu().ungated_met(),
                usize::from(!mismatched),
                "mismatched {mismatched}: rank {}'s ungated calls met",
                e.rank()
            );
        }
        if !mismatched {
            for (r, t) in tensors.iter().enumerate() {
                for (i, &v) in t.iter().enumerate() {
                    assert_eq!(v, 5 * i as u64, "rank {r}, element {i}");
                }
            }
        }
        drive_until_settled(&engines, true);
        for e in &engines {
            if mismatched {
                assert_failed_on_a_mismatch(e, "one machine");
            } else {
                assert_eq!(e.works.state(0), Some(DONE), "rank {}", e.rank());
            }
            assert_eq!(
                e.memory.gpu().run_out(),
                None,
                "mismatched {mismatched}: rank {}'s streams end",
                e.rank()
            );
        }
    }
}

/// On one machine through its collectives, a rank that never makes its call
/// (alive, its engine idle) leaves the other's ungated NCCL call waiting:
/// the other's engine fails within its timeout naming it, and its failure
/// aborts the call, so its streams end. NCCL's watchdog, as ProcessGroupNCCL
/// has one, is the engine's stall timer.
#[test]
fn a_rank_that_never_calls_fails_the_other_whose_nccl_call_then_ends() {
    let timeout = Duration::from_millis(50);
    let net = Network::new(2);
    let topology = Topology::new(1, 2, RankLayout::Contiguous).unwrap();
    let geometry = Geometry::new(topology, PlanConfig::new(1024, 64).unwrap()).unwrap();
    let layout = BufferLayout::new(&geometry, 2).unwrap();
    let engines = build_job(
        &geometry,
        &layout,
        2,
        &net,
        DirectSettings::from(None),
        Design::Accepted,
        Some(&Collectives::shipped()),
        0,
        timeout,
        |_, step| Box::new(step),
    )
    .unwrap();
    let (mut tensor, mut input) = (vec![0u64; 1000], vec![3u64; 1000]);
    submit_device_sum(&engines[0], &mut tensor, &mut input).unwrap();
    // Ungated, the call has reached NCCL before the engine ran at all.
    while engines[0].memory.gpu().run_any(|_| 0) {}
    let waiting = engines[0].memory.gpu().waiting().unwrap_or_default();
    assert!(waiting.contains("AllReduce"), "{waiting}");
    let begun = std::time::Instant::now();
    while engines[0].failure().is_none() && begun.elapsed() < 100 * timeout {
        engines[0].try_drive();
        while engines[0].memory.gpu().run_any(|_| 0) {}
        std::thread::sleep(Duration::from_millis(1));
    }
    let error = engines[0]
        .failure()
        .unwrap_or_else(|| panic!("rank 0 still running after {:?}", begun.elapsed()));
    // Within its timeout, and the scheduling of this binary's other tests
    // on two cores (the simulation's seeds among them).
    assert!(
        begun.elapsed() < 60 * timeout,
        "rank 0 failed only after {:?}",
        begun.elapsed()
    );
    let named = error.to_string();
    assert!(
        named.contains("rank 1") || named.contains("rank(s) 1"),
        "{named}"
    );
    assert_eq!(
        engines[0].memory.gpu().run_out(),
        None,
        "rank 0's streams end once its failure aborts the call"
    );
    assert_eq!(
        engines[0].memory.gpu().ungated_met(),
        0,
        "the call ended by the abort, never met"
    );
}

/// The job's NCCL all-reduce on 2x2 and 3x2: one slice of the whole tensor
/// on every rank, on the job's communicator, ungated (it starts as soon as
/// the caller's stream reaches it), exact. Where rank 3 issued another
/// length, the calls run before the engines' checks end, disagree and never
/// meet, moving nothing; every rank fails naming the mismatch or a peer,
/// and its failure aborts the call, so every stream runs to its end. On 3x2
/// rank 0 hears nothing from rank 3 (neither its rail, nor its ring
/// neighbour, nor a partner): it fails through rank 1, whose rail rank 3 is,
/// which never begins the slice past its own check.
#[test]
fn the_jobs_nccl_all_reduce_is_exact_and_fails_every_rank_on_a_mismatch() {
    const ELEMENTS: usize = 1000;
    for (machines, mismatched) in [(2u32, false), (2, true), (3, false), (3, true)] {
        let world = (machines * 2) as usize;
        let net = Network::new(machines * 2);
        let collectives = Collectives {
            across_job: true,
            ..Collectives::shipped()
        };
        let (engines, recorders) = recording_job(machines, 2, &net, Some(&collectives));
        // On 3x2 rank 0 does not hear from rank 3 (rank 1 does: its rail).
        if machines == 3 {
            assert!(!engines[0].links.remote_in.contains(&3));
            assert!(engines[1].links.remote_in.contains(&3));
        }
        let what = format!(
            "{machines}x2, rank 3 {}",
            if mismatched { "differs" } else { "agrees" }
        );
        let len = |r: usize| {
            if mismatched && r == 3 {
                ELEMENTS + 8
            } else {
                ELEMENTS
            }
        };
        let mut tensors: Vec<Vec<u64>> = (0..world).map(|r| vec![0; len(r)]).collect();
        let mut inputs: Vec<Vec<u64>> = (0..world)
            .map(|r| (0..len(r) as u64).map(|i| i * (r as u64 + 1)).collect())
            .collect();
        for (r, (t, i)) in tensors.iter_mut().zip(&mut inputs).enumerate() {
            submit_device_sum_by(&engines[r], t, i, Resolved::Nccl).unwrap();
        }
        // The network holds the descriptors for 50 rounds: the local ranks
        // agree long before the remote ones are heard from.
        drive_over(&engines, true, Some((&net, 50)));
        let met = collectives
            .job_all_reduces
            .load(std::sync::atomic::Ordering::Relaxed);
        if mismatched {
            assert_eq!(met, 0, "{what}: the disagreeing calls never met");
            let unfailed = collectives
                .job_arrived_unfailed
                .load(std::sync::atomic::Ordering::Relaxed);
            assert!(
                unfailed > 0,
                "{what}: the job's call ran ungated, before the engines' checks ended"
            );
            for e in &engines {
                let waiting = e.memory.gpu().run_out();
                assert_eq!(
                    waiting,
                    None,
                    "{what}: rank {}'s streams end once its failure aborts the call",
                    e.rank()
                );
            }
            for e in &engines {
                assert_failed_on_a_mismatch(e, &what);
            }
            continue;
        }
        assert_eq!(met, 1, "{what}: one all-reduce on the job's communicator");
        let opened = collectives
            .job_arrived_unfailed
            .load(std::sync::atomic::Ordering::Relaxed);
        assert_eq!(
            opened, world as u64,
            "{what}: every rank ran the job's call before any failure"
        );
        for e in &engines {
            assert_eq!(e.works.state(0), Some(DONE), "{what}: rank {}", e.rank());
        }
        // Rank r holds i * (r + 1): the sum is i * world * (world + 1) / 2.
        let factor = (world * (world + 1) / 2) as u64;
        for (r, t) in tensors.iter().enumerate() {
            for (i, &v) in t.iter().enumerate() {
                assert_eq!(v, factor * i as u64, "{what}: rank {r}, element {i}");
            }
        }
        for (r, recorder) in recorders.iter().enumerate() {
            let slices = recorder.slices.lock().unwrap().clone();
            assert_eq!(
                slices,
                vec![(ELEMENTS * 8) as u64],
                "{what}: rank {r}: the whole tensor"
            );
        }
    }
}

/// What the focused sets of seeds settled: operations done and expected
/// where no rank was killed, and seeds that killed one.
#[derive(Default)]
struct Settled {
    checked: usize,
    expected: usize,
    killed_seeds: usize,
}

impl Settled {
    /// Plays seed `seed`'s `scenario` (a rank killed in it if `killed`) and
    /// counts it; a failing seed panics, naming it.
    fn play(&mut self, seed: u64, scenario: &Scenario, rng: &mut Rng, killed: bool) {
        let world = (scenario.machines * scenario.devices) as usize;
        match play(
            scenario,
            &messages::Script::default(),
            rng,
            Design::Accepted,
            STEP_LIMIT,
        ) {
            // With a rank killed, `play` checks every survivor's error.
            Ok(_) if killed => self.killed_seeds += 1,
            Ok(outcome) => {
                self.checked += outcome.done;
                self.expected += world * scenario.ops.len();
            }
            Err(e) => panic!("seed {seed}, {scenario:?}: {e}"),
        }
    }

    /// Every operation of every rank that lived is done, and over a hundred
    /// seeds killed a rank.
    fn check(&self) {
        self.check_at_least(100);
    }

    /// As [`Settled::check`], with over `killed` seeds that killed a rank.
    fn check_at_least(&self, killed: usize) {
        assert_eq!(
            self.checked, self.expected,
            "every operation of every rank is done"
        );
        let seeds = self.killed_seeds;
        assert!(seeds > killed, "{seeds} seeds killed a rank");
    }
}

/// Hierarchical all-reduces through the double binary tree on jobs deeper
/// than the seeds draw (5 to 8 machines of one or two ranks: up to three
/// levels, an inner node below an inner node, and for odd `M` a machine that
/// is a leaf of both trees), one or two shards a slot, over one to three
/// buffers, and for one seed in three a rank killed at a drawn step: every
/// rank's result exact, every survivor's error naming the victim. On 7x1 and
/// 8x1, one seed in three takes 2 KiB slices of 320-byte shards, whose cells
/// of 1 KiB travel in three parts.
#[test]
fn deep_trees_settle_with_exact_results() {
    let (mut settled, mut three_parts) = (Settled::default(), 0);
    for seed in 1..=400u64 {
        let mut rng = Rng::new(seed);
        let (machines, devices) = rng.pick(&[(5, 1), (6, 1), (7, 1), (8, 1), (5, 2)]);
        let world = machines * devices;
        let ops: Vec<Op> = (0..4)
            .map(|_| Op {
                elements: rng.pick(&[1, 37, 300, 1000, 2500]),
                dtype: rng.pick(&[DataType::I32, DataType::I64, DataType::F32]),
                op: rng.pick(&[ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min]),
                algorithm: Resolved::Hierarchical,
                wire: WireFormat::Exact,
                origins: None,
                share: None,
                rooted: None,
            })
            .collect();
        let killed = rng.below(3) == 0;
        let deeper = devices == 1 && machines >= 7 && rng.below(3) == 0;
        let scenario = Scenario {
            machines,
            devices,
            layout: RankLayout::Contiguous,
            servers: 0,
            buffers: 1 + rng.below(3) as u32,
            slice_bytes: if deeper { 2048 } else { 1024 },
            // A slot of 1024 / D bytes: one shard of the minimum, or two; or
            // of 2048 bytes, six shards of 320 (five units) for 7 or 8
            // machines: through the trees, cells of 16 units in three parts.
            min_shard_bytes: if deeper {
                320
            } else {
                rng.pick(&[1024 / u64::from(devices), 512 / u64::from(devices)])
            },
            window: 1 + rng.below(3) as usize,
            kill: killed.then(|| (1 + rng.below(3000), rng.below(u64::from(world)) as u32)),
            direct: DirectSettings::from(None),
            device: vec![false; ops.len()],
            collectives: false,
            whole_up_to: 0,
            one_reduce_scatter_from: crate::local::ONE_REDUCE_SCATTER_FROM_BYTES,
            across_job: false,
            group_size: None,
            grouped: None,
            ops,
        };
        let topology = Topology::new(machines, devices, RankLayout::Contiguous).unwrap();
        let config = PlanConfig::new(scenario.slice_bytes, scenario.min_shard_bytes).unwrap();
        let geometry = Geometry::new(topology, config).unwrap();
        assert_eq!(geometry.routing(), fairring_core::plan::Routing::Trees);
        if deeper {
            let plan = fairring_core::plan::Plan::new(&geometry, DataType::I32, 2500, 0).unwrap();
            assert_eq!(plan.slice(0).unwrap().parts(), 3);
            three_parts += 1;
        }
        settled.play(seed, &scenario, &mut rng, killed);
    }
    settled.check();
    assert!(
        three_parts > 30,
        "{three_parts} seeds sent cells in three parts"
    );
}

/// Hierarchical all-reduces in two levels on more machines than the seeds
/// draw in groups (6 to 10 machines of one rank, and 4 and 6 of two, in
/// groups of two to four: equal groups, and unequal ones whose ranges meet
/// two intervals), over one to three buffers, in slices whose slots hold a
/// few units or fewer than a group has members (some machines' ranges
/// empty), and for one seed in three a rank killed at a drawn step: every
/// rank's result exact, every survivor's error naming the victim.
#[test]
fn machines_in_groups_settle_with_exact_results() {
    let (mut settled, mut unequal) = (Settled::default(), 0);
    for seed in 1..=400u64 {
        let mut rng = Rng::new(seed);
        let (machines, devices, size) = rng.pick(&[
            (6, 1, 2),
            (6, 1, 3),
            (7, 1, 3),
            (8, 1, 3),
            (8, 1, 4),
            (10, 1, 4),
            (4, 2, 2),
            (6, 2, 3),
        ]);
        let world = machines * devices;
        let ops: Vec<Op> = (0..4)
            .map(|_| Op {
                elements: rng.pick(&[1, 5, 37, 300, 1000, 2500]),
                dtype: rng.pick(&[DataType::I32, DataType::I64, DataType::F32, DataType::U8]),
                op: rng.pick(&[ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min]),
                algorithm: Resolved::Hierarchical,
                wire: WireFormat::Exact,
                origins: None,
                share: None,
                rooted: None,
            })
            .collect();
        let killed = rng.below(3) == 0;
        let scenario = Scenario {
            machines,
            devices,
            layout: RankLayout::Contiguous,
            servers: 0,
            buffers: 1 + rng.below(3) as u32,
            slice_bytes: rng.pick(&[256, 1024, 4096]),
            min_shard_bytes: 64,
            window: 1 + rng.below(3) as usize,
            kill: killed.then(|| (1 + rng.below(3000), rng.below(u64::from(world)) as u32)),
            direct: DirectSettings::from(None),
            device: vec![false; ops.len()],
            collectives: false,
            whole_up_to: 0,
            one_reduce_scatter_from: crate::local::ONE_REDUCE_SCATTER_FROM_BYTES,
            across_job: false,
            group_size: Some(size),
            grouped: None,
            ops,
        };
        let groups = fairring_core::plan::MachineGroups::new(machines, size).unwrap();
        let sizes: Vec<u32> = (0..groups.groups())
            .map(|g| groups.size(g).unwrap())
            .collect();
        if sizes.iter().any(|&s| s != sizes[0]) {
            unequal += 1;
        }
        settled.play(seed, &scenario, &mut rng, killed);
    }
    settled.check();
    assert!(unequal > 100, "{unequal} seeds had groups of two sizes");
}

/// Dedicated servers folding the cells of 18 to 40 machines (two or three
/// folds a slot, the last one short), one to three servers, over one to three
/// buffers, compressed wires among the `f32` operations, and for one seed in
/// three a process (rank or server) killed at a drawn step: every rank's
/// result exact, every survivor's error naming the victim.
#[test]
fn servers_fold_many_machines_with_exact_results() {
    let mut settled = Settled::default();
    let mut compressed = 0;
    for seed in 1..=150u64 {
        let mut rng = Rng::new(seed);
        let (machines, devices) = rng.pick(&[(18, 1), (20, 1), (33, 1), (34, 1), (40, 1), (18, 2)]);
        let servers = 1 + rng.below(3) as u32;
        let ops: Vec<Op> = (0..3)
            .map(|_| {
                let dtype = rng.pick(&[DataType::I32, DataType::I64, DataType::F32, DataType::U8]);
                let wire = if dtype == DataType::F32 {
                    rng.pick(&[WireFormat::Exact, WireFormat::Bf16, WireFormat::F16])
                } else {
                    WireFormat::Exact
                };
                compressed += usize::from(wire != WireFormat::Exact);
                Op {
                    elements: rng.pick(&[1, 37, 300, 1000, 2500]),
                    dtype,
                    op: rng.pick(&[ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min]),
                    algorithm: Resolved::Hierarchical,
                    wire,
                    origins: None,
                    share: None,
                    rooted: None,
                }
            })
            .collect();
        let processes = machines * devices + servers;
        let killed = rng.below(3) == 0;
        let scenario = Scenario {
            machines,
            devices,
            layout: RankLayout::Contiguous,
            servers,
            buffers: 1 + rng.below(3) as u32,
            slice_bytes: rng.pick(&[1024, 4096]),
            min_shard_bytes: 64,
            window: 1 + rng.below(3) as usize,
            kill: killed.then(|| (1 + rng.below(6000), rng.below(u64::from(processes)) as u32)),
            direct: DirectSettings::from(None),
            device: vec![false; ops.len()],
            collectives: false,
            whole_up_to: 0,
            one_reduce_scatter_from: crate::local::ONE_REDUCE_SCATTER_FROM_BYTES,
            across_job: false,
            group_size: None,
            grouped: None,
            ops,
        };
        let topology = Topology::new(machines, devices, RankLayout::Contiguous).unwrap();
        let layout = Geometry::with_servers(topology, PlanConfig::DEFAULT, servers)
            .unwrap()
            .server_layout()
            .unwrap();
        assert!(
            layout.folds() >= 2,
            "{machines} machines fold more than once"
        );
        settled.play(seed, &scenario, &mut rng, killed);
    }
    settled.check_at_least(40);
    assert!(
        compressed > 50,
        "{compressed} operations on a compressed wire"
    );
}

/// Dedicated servers in groups (`ServerGroups`): 4 to 12 servers a rail in
/// groups of 2 to 4 (equal and unequal ones, two to four groups), 2 to 9
/// machines of one or two devices, slots of fewer units than a group has
/// servers among them, over one to three buffers, every operator and several
/// types, and for one seed in three a process (a worker or a server) killed
/// at a drawn step: every rank's result exact, every survivor's error naming
/// the victim.
#[test]
fn servers_in_groups_settle_with_exact_results() {
    let mut settled = Settled::default();
    let (mut unequal, mut empty_ranges) = (0, 0);
    for seed in 1..=300u64 {
        let mut rng = Rng::new(seed);
        let (machines, devices, per_rail, size) = rng.pick(&[
            (2, 1, 4, 2),
            (3, 1, 6, 2),
            (4, 1, 7, 3),
            (5, 1, 8, 2),
            (9, 1, 12, 4),
            (3, 2, 6, 3),
            (4, 2, 4, 2),
            (7, 1, 9, 3),
        ]);
        let servers = per_rail * devices;
        let ops: Vec<Op> = (0..3)
            .map(|_| {
                // The simulation's check knows no average (the real runs
                // of `tests/all_reduce.rs` check them).
                let dtype = rng.pick(&[DataType::I32, DataType::I64, DataType::F32, DataType::U8]);
                let op = rng.pick(&[ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min]);
                Op {
                    elements: rng.pick(&[1, 3, 37, 300, 1000, 2500]),
                    dtype,
                    op,
                    algorithm: Resolved::Hierarchical,
                    wire: WireFormat::Exact,
                    origins: None,
                    share: None,
                    rooted: None,
                }
            })
            .collect();
        // A slot of fewer units than the smallest group has servers leaves
        // some range empty.
        let smallest: u32 = per_rail / u32::div_ceil(per_rail, size);
        if ops.iter().any(|op| {
            let slot = (op.elements * op.dtype.size_bytes()).div_ceil(u64::from(devices));
            slot.div_ceil(64) < u64::from(smallest)
        }) {
            empty_ranges += 1;
        }
        let processes = machines * devices + servers;
        let killed = rng.below(3) == 0;
        let scenario = Scenario {
            machines,
            devices,
            layout: RankLayout::Contiguous,
            servers,
            buffers: 1 + rng.below(3) as u32,
            slice_bytes: rng.pick(&[256, 1024, 4096]),
            min_shard_bytes: 64,
            window: 1 + rng.below(3) as usize,
            kill: killed.then(|| (1 + rng.below(4000), rng.below(u64::from(processes)) as u32)),
            direct: DirectSettings::from(None),
            device: vec![false; ops.len()],
            collectives: false,
            whole_up_to: 0,
            one_reduce_scatter_from: crate::local::ONE_REDUCE_SCATTER_FROM_BYTES,
            across_job: false,
            group_size: Some(size),
            grouped: None,
            ops,
        };
        let groups = fairring_core::plan::ServerGroups::new(machines, per_rail, size).unwrap();
        let servers_of = groups.servers();
        let sizes: Vec<u32> = (0..servers_of.groups())
            .map(|g| servers_of.size(g).unwrap())
            .collect();
        if sizes.iter().any(|&s| s != sizes[0]) || machines % groups.groups() != 0 {
            unequal += 1;
        }
        settled.play(seed, &scenario, &mut rng, killed);
    }
    settled.check_at_least(60);
    assert!(unequal > 60, "{unequal} seeds had groups of two sizes");
    assert!(
        empty_ranges > 60,
        "{empty_ranges} seeds had ranges left empty"
    );
}

/// One machine of two or three ranks beside one to three dedicated servers,
/// its device tensors through the machine's collectives: the device
/// all-reduces NCCL reduces run as one NCCL all-reduce on the machine's
/// communicator (`Resolved::Nccl`), which each server plans as a slice it
/// does not serve, between operations the servers do serve (device tensors
/// staged through them, host tensors, other operators). Every result is
/// exact, the servers' slices keep their numbers with the workers', and for
/// one seed in three a worker or a server killed at a drawn step fails every
/// survivor naming it.
#[test]
fn one_machine_beside_servers_runs_its_nccl_all_reduces_between_those_the_servers_serve() {
    let mut settled = Settled::default();
    let (mut nccl, mut served_after) = (0, 0);
    for seed in 1..=200u64 {
        let mut rng = Rng::new(seed);
        let devices = 2 + rng.below(2) as u32;
        let servers = 1 + rng.below(3) as u32;
        let mut device = Vec::new();
        let ops: Vec<Op> = (0..4)
            .map(|_| {
                let dtype = rng.pick(&[DataType::I32, DataType::I64, DataType::F32, DataType::U8]);
                let op = rng.pick(&[ReduceOp::Sum, ReduceOp::Sum, ReduceOp::Max]);
                let on_device = rng.below(4) != 0;
                device.push(on_device);
                let through_nccl = on_device && crate::local::takes(dtype, op) && rng.below(4) != 0;
                Op {
                    elements: rng.pick(&[0, 1, 37, 300, 1000, 2500]),
                    dtype,
                    op,
                    algorithm: if through_nccl {
                        Resolved::Nccl
                    } else {
                        Resolved::Hierarchical
                    },
                    wire: WireFormat::Exact,
                    origins: None,
                    share: None,
                    rooted: None,
                }
            })
            .collect();
        let first = ops.iter().position(|op| op.algorithm == Resolved::Nccl);
        nccl += ops
            .iter()
            .filter(|op| op.algorithm == Resolved::Nccl)
            .count();
        if first.is_some_and(|i| ops[i..].iter().any(|op| op.algorithm != Resolved::Nccl)) {
            served_after += 1;
        }
        let processes = devices + servers;
        let killed = rng.below(3) == 0;
        let scenario = Scenario {
            machines: 1,
            devices,
            layout: RankLayout::Contiguous,
            servers,
            buffers: 1 + rng.below(3) as u32,
            slice_bytes: rng.pick(&[1024, 4096]),
            min_shard_bytes: 64,
            window: 1 + rng.below(3) as usize,
            kill: killed.then(|| (1 + rng.below(3000), rng.below(u64::from(processes)) as u32)),
            direct: DirectSettings::from(None),
            device,
            collectives: true,
            whole_up_to: 0,
            one_reduce_scatter_from: crate::local::ONE_REDUCE_SCATTER_FROM_BYTES,
            across_job: true,
            group_size: None,
            grouped: None,
            ops,
        };
        settled.play(seed, &scenario, &mut rng, killed);
    }
    settled.check_at_least(40);
    assert!(nccl > 200, "{nccl} NCCL all-reduces beside the servers");
    assert!(
        served_after > 60,
        "{served_after} seeds served an operation after an NCCL all-reduce"
    );
}

/// A dedicated server refuses a worker's descriptor of an NCCL all-reduce
/// over the workers where none can run over them (8x2 with two servers:
/// past [`crate::NCCL_ACROSS_UP_TO_MACHINES`] machines): it would plan it
/// and serve none of it, so that the step between machines would pass
/// unserved. The server fails naming the worker and why, and the workers
/// fail with it.
#[test]
fn a_server_refuses_the_workers_nccl_all_reduce_where_none_runs_over_them() {
    servers_refuse(
        Resolved::Nccl,
        "only on one to 7 machines of several ranks",
        None,
    );
}

/// A dedicated server refuses a descriptor of small tensors in groups
/// (`Resolved::Grouped`), which runs only without dedicated servers (no
/// worker's choice makes it there; these workers hold groups in their
/// buffers, as a worker of another build might): the server fails naming
/// the worker and why, and the workers fail with it.
#[test]
fn a_server_refuses_small_tensors_in_groups() {
    let topology = Topology::new(8, 2, RankLayout::Contiguous).unwrap();
    let groups =
        Geometry::with_groups_in_its_slices(topology, PlanConfig::new(1024, 64).unwrap(), 4)
            .unwrap();
    servers_refuse(
        Resolved::Grouped,
        "small tensors run in groups only in a job without dedicated servers",
        Some(groups),
    );
}

/// Every worker of 8x2 beside two servers, its buffers holding `second`
/// too, submits a device all-reduce described as `algorithm`: some server
/// refuses it saying `why`, naming a worker, and every process fails.
fn servers_refuse(algorithm: Resolved, why: &str, second: Option<Geometry>) {
    let (m, d) = (8, 2);
    let processes = m * d + 2;
    let workers = (m * d) as usize;
    let net = Network::new(processes);
    let topology = Topology::new(m, d, RankLayout::Contiguous).unwrap();
    assert!(m > crate::NCCL_ACROSS_UP_TO_MACHINES);
    let geometry = Geometry::with_servers(topology, PlanConfig::new(1024, 64).unwrap(), 2).unwrap();
    let mut layout = BufferLayout::new(&geometry, m * d).unwrap();
    if let Some(second) = second {
        layout = layout.holding_second(second, m * d).unwrap();
    }
    let engines = build_job(
        &geometry,
        &layout,
        2,
        &net,
        DirectSettings::from(None),
        Design::Accepted,
        Some(&Collectives {
            across_job: true,
            ..Collectives::shipped()
        }),
        0,
        Duration::from_secs(3600),
        |_, step| Box::new(step),
    )
    .unwrap();
    assert_eq!(engines.len(), workers + 2);
    let mut tensors: Vec<Vec<u64>> = (0..workers).map(|_| vec![0; 1000]).collect();
    let mut inputs: Vec<Vec<u64>> = (0..workers).map(|_| vec![1; 1000]).collect();
    for (r, (t, i)) in tensors.iter_mut().zip(&mut inputs).enumerate() {
        // A worker may refuse it itself; the server must, whatever the
        // workers do.
        let _ = submit_device_sum_by(&engines[r], t, i, algorithm);
    }
    for _ in 0..10_000 {
        if engines.iter().all(|e| e.failure().is_some()) {
            break;
        }
        for e in &engines {
            e.try_drive();
            while e.memory.gpu().run_any(|_| 0) {}
        }
        let mut net = net
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (a, b) in net.busy_links() {
            net.deliver(a, b);
        }
    }
    let mut refused = 0;
    for server in &engines[workers..] {
        let error = server
            .failure()
            .unwrap_or_else(|| panic!("server {} still running", server.rank()))
            .to_string();
        if error.contains(why) {
            assert!(error.contains("rank "), "the worker named: {error}");
            refused += 1;
        }
    }
    assert!(refused > 0, "a server refused the descriptor itself");
    for e in &engines[..workers] {
        assert!(e.failure().is_some(), "rank {} failed", e.rank());
    }
}

/// The device model catches the three ways the design can break, each on a
/// seed the shipped design passes:
///
/// - [`Design::IssuedByEngine`], the progress thread enqueueing each stage
///   as it opens it (a CUDA call on the progress path, as the design before
///   made): seed 1 (2x1, one staging buffer, every operation on device
///   tensors) hangs. Another thread's device-wide wait holds the context
///   for the caller's stream, which waits for operation 0; rank 1's
///   progress thread blocks in its next enqueue behind it, so operation 0
///   never ends and the stream never passes (172 of seeds 1 to 300 hang
///   this way, seed 1 among them);
/// - [`Design::AbortFirst`], a failing engine aborting the machine's
///   collectives on its progress thread before it opens its gates: seed 3
///   (4x2 with three servers, the machines reducing through their
///   collectives, rank 2 killed) hangs. The abort waits for streams that
///   wait for gates only the blocked thread would open (27 of seeds 1 to
///   300);
/// - [`Design::AbortOneByOne`], the reaper aborting the reduce communicator
///   and waiting for the device before it aborts the gather one: seed 12
///   (1x3 with two servers, one staging buffer, rank 2 killed) hangs. The
///   buffer's stream carries both communicators' calls in slice order, and
///   the gather call at its head waits for the killed rank until its
///   communicator is aborted, which the reaper never reaches (8 of seeds 1
///   to 300).
#[test]
fn cuda_calls_on_the_progress_path_and_aborts_that_wait_too_soon_hang() {
    let issued = run_for(1, Design::IssuedByEngine, 200_000).unwrap_err();
    assert!(
        issued.contains("not settled") && issued.contains("device-wide wait"),
        "{issued}"
    );
    let aborted = run_for(3, Design::AbortFirst, 200_000).unwrap_err();
    assert!(
        aborted.contains("not settled") && aborted.contains("device-wide wait"),
        "{aborted}"
    );
    let one_by_one = run_for(12, Design::AbortOneByOne, 200_000).unwrap_err();
    assert!(
        one_by_one.contains("not settled") && one_by_one.contains("comm: Gather"),
        "{one_by_one}"
    );
    let shipped = run(1, Design::Accepted).unwrap_or_else(|e| panic!("seed 1: {e}"));
    assert!(shipped.device > 0, "seed 1 runs device operations");
    let shipped = run(3, Design::Accepted).unwrap_or_else(|e| panic!("seed 3: {e}"));
    assert!(
        shipped.killed.is_some() && shipped.failed > 0,
        "seed 3 fails its operations"
    );
    let shipped = run(12, Design::Accepted).unwrap_or_else(|e| panic!("seed 12: {e}"));
    assert!(
        shipped.killed.is_some() && shipped.failed > 0,
        "seed 12 fails its operations"
    );
}

/// Seed 1261 posts two messages of one tag from rank 5 to rank 0 between
/// machines, the first before the pair is linked and the second after: the
/// second must wait behind the first (it once started first, and each
/// receive then met the other's send, failing both as mismatched).
#[test]
fn a_message_posted_once_its_peer_is_linked_waits_behind_those_posted_before() {
    let outcome = run(1261, Design::Accepted).unwrap_or_else(|e| panic!("{e}"));
    assert!(outcome.messages >= 18, "{outcome:?}");
}

/// Seed 8661: an empty send between machines finishes as soon as it tells
/// its receiver so, and that reply waits for room in the fabric's queue. The
/// reply must still go out with no message left in flight on the sender
/// (its driver once skipped messages then, and the receive never finished).
#[test]
fn a_finished_sends_reply_goes_out_with_nothing_left_in_flight() {
    let outcome = run(8661, Design::Accepted).unwrap_or_else(|e| panic!("{e}"));
    assert!(outcome.messages >= 28, "{outcome:?}");
}

/// Two engines of a 2x1 job, linked for messages as the communicator's
/// linker links them, and their network.
struct Pair {
    engines: Vec<Engine<SimFabric, SimMemory>>,
    net: Arc<std::sync::Mutex<Network>>,
}

impl Pair {
    fn new() -> Pair {
        let (engines, net) = small_job(
            (2, 1),
            Design::Accepted,
            Duration::from_secs(5),
            |_, step| Box::new(step),
        );
        for (a, b) in [(0u32, 1u32), (1, 0)] {
            let fabric = &engines[a as usize].links.fabric;
            fabric
                .endpoint(b)
                .and_then(|ep| fabric.connect(b, &ep))
                .unwrap();
            engines[a as usize].late_links.settle(b, Ok(()));
        }
        Pair { engines, net }
    }

    fn net(&self) -> std::sync::MutexGuard<'_, Network> {
        self.net
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Drives both engines and delivers what every link holds, 50 times.
    fn pump(&self) {
        for _ in 0..50 {
            for e in &self.engines {
                e.try_drive();
            }
            let busy = self.net().busy_links();
            for (a, b) in busy {
                self.net().deliver(a, b);
            }
        }
    }

    /// Whether rank `r`'s message `id` has settled; why it failed.
    fn settled(&self, r: usize, id: u64) -> Result<bool, String> {
        self.engines[r].test_message(id).map_err(|e| e.to_string())
    }
}

/// A post of the `i32` of `data` between ranks 0 and 1, tag 0.
fn post_between_0_and_1(sending: bool, data: &mut [i32]) -> crate::engine::messages::Post {
    crate::engine::messages::Post {
        id: 0,
        peer: u32::from(sending),
        tag: 0,
        sending,
        data: data.as_mut_ptr() as usize,
        bytes: data.len() as u64 * 4,
        dtype: DataType::I32,
    }
}

/// Rank 1 of a [`Pair`] says goodbye after no operation, and rank 0's
/// fabric reports it ahead of what it had queued.
fn goodbye_reported_first(pair: &Pair) {
    use crate::engine::tags::{self, Kind};
    let bye = 0u64.to_le_bytes();
    pair.engines[1]
        .links
        .fabric
        .send_message(
            0,
            tags::immediate(Kind::Bye, 0, 0, 0),
            &bye,
            tags::token(Kind::Bye, 0, 0, 0),
        )
        .unwrap();
    let mut n = pair.net();
    n.deliver(1, 0);
    n.report_newest_first(0);
}

/// A receiver between machines leaves the job as soon as its receive is
/// done, and its goodbye is reported to the sender before the `Sent` of the
/// sender's last write (a provider may report from several threads): the
/// send it received still succeeds (it once failed as "left the job before
/// this message was matched").
#[test]
fn a_goodbye_reported_before_the_last_sent_fails_no_send_its_rank_received() {
    // Before the engines, so that they drop after them.
    let (mut sent, mut got) = (vec![7i32; 5000], vec![0i32; 5000]);
    let pair = Pair::new();
    let engines = &pair.engines;
    // SAFETY: `sent` outlives the engines (declared before them).
    let send = unsafe { engines[0].post_message(post_between_0_and_1(true, &mut sent)) }.unwrap();
    // SAFETY: as for `sent`.
    let receive =
        unsafe { engines[1].post_message(post_between_0_and_1(false, &mut got)) }.unwrap();
    // Rank 1 drives first each round: its receive is done with the `Sent`
    // of rank 0's write still queued.
    for _ in 0..1000 {
        let busy = pair.net().busy_links();
        for (a, b) in busy {
            pair.net().deliver(a, b);
        }
        engines[1].try_drive();
        if pair.settled(1, receive) != Ok(false) {
            break;
        }
        engines[0].try_drive();
    }
    assert_eq!(pair.settled(1, receive), Ok(true));
    assert_eq!(pair.settled(0, send), Ok(false), "the Sent is still queued");
    goodbye_reported_first(&pair);
    for _ in 0..10 {
        engines[0].try_drive();
    }
    assert_eq!(pair.settled(0, send), Ok(true));
    assert_eq!(got, sent);
    assert!(
        engines[0].failure().is_none(),
        "a peer leaving fails no engine"
    );
}

/// A send whose every chunk is posted when its receiver says goodbye waits
/// for them to go out; when the receiver's connection then closes with its
/// chunk undelivered, it fails naming the receiver instead of waiting
/// forever, and the engine does not fail.
#[test]
fn a_send_posted_whole_to_a_rank_that_left_fails_once_its_connection_closes() {
    // Before the engines, so that they drop after them.
    let (mut sent, mut got) = (vec![9i32; 5000], vec![0i32; 5000]);
    let pair = Pair::new();
    let engines = &pair.engines;
    // SAFETY: `sent` outlives the engines (declared before them).
    let send = unsafe { engines[0].post_message(post_between_0_and_1(true, &mut sent)) }.unwrap();
    // SAFETY: as for `sent`.
    unsafe { engines[1].post_message(post_between_0_and_1(false, &mut got)) }.unwrap();
    // The receive's announcement reaches rank 0, which posts the one chunk.
    for _ in 0..3 {
        engines[1].try_drive();
        pair.net().deliver(1, 0);
        engines[0].try_drive();
    }
    assert!(
        pair.net().busy_links().contains(&(0, 1)),
        "the chunk is posted"
    );
    goodbye_reported_first(&pair);
    for _ in 0..10 {
        engines[0].try_drive();
    }
    assert_eq!(
        pair.settled(0, send),
        Ok(false),
        "its chunk may still go out"
    );
    pair.net().kill(1);
    for _ in 0..10 {
        engines[0].try_drive();
    }
    let e = pair.settled(0, send).expect_err("never received");
    assert!(e.contains("rank 1") && e.contains("left the job"), "{e}");
    assert!(
        engines[0].failure().is_none(),
        "a peer leaving fails no engine"
    );
}

/// Small sends between machines go eagerly, in one trip, and keep their
/// order with the sends of their tag that go by announcement. On a linked
/// pair whose ranks have opened their slots to each other:
///
/// - a small send whose receive is posted later lands before the receive
///   is posted, and the receive takes it with nothing sent back;
/// - a small receive posted first announces nothing: its send goes
///   eagerly, and the receive takes it as it lands;
/// - a large send of the same tag after those meets its own receive.
#[test]
fn small_sends_go_eagerly_in_order_with_the_others_of_their_tag() {
    const LARGE: usize = 10_000;
    let sizes = [3usize, 1000, 2000, LARGE, 5];
    // Before the engines, so that they drop after them.
    let mut sent: Vec<Vec<i32>> = (0..sizes.len())
        .map(|k| (0..sizes[k]).map(|i| (k * 100_000 + i) as i32).collect())
        .collect();
    let mut got: Vec<Vec<i32>> = sizes.iter().map(|&n| vec![-1; n]).collect();
    let pair = Pair::new();
    let engines = &pair.engines;
    let [s0, s1, s2, s3, s4] = &mut sent[..] else {
        unreachable!()
    };
    let [g0, g1, g2, g3, g4] = &mut got[..] else {
        unreachable!()
    };
    // Message 0 opens the slots both ways (and goes by announcement, which
    // the send asks for, not knowing the receiver's slots yet).
    // SAFETY: every tensor outlives the engines (declared before them).
    let send0 = unsafe { engines[0].post_message(post_between_0_and_1(true, s0)) }.unwrap();
    // SAFETY: as above.
    let receive0 = unsafe { engines[1].post_message(post_between_0_and_1(false, g0)) }.unwrap();
    pair.pump();
    assert_eq!(
        (pair.settled(0, send0), pair.settled(1, receive0)),
        (Ok(true), Ok(true))
    );
    // Message 1: sent first; it lands before its receive is posted.
    // SAFETY: as above.
    let send1 = unsafe { engines[0].post_message(post_between_0_and_1(true, s1)) }.unwrap();
    engines[0].try_drive();
    pair.net().deliver(0, 1);
    engines[0].try_drive();
    assert_eq!(pair.settled(0, send1), Ok(true), "done once its write left");
    // Rank 1 takes the landing, and then its caller posts the receive.
    engines[1].try_drive();
    // SAFETY: as above.
    let receive1 = unsafe { engines[1].post_message(post_between_0_and_1(false, g1)) }.unwrap();
    engines[1].try_drive();
    assert_eq!(
        pair.settled(1, receive1),
        Ok(true),
        "taken with nothing sent back"
    );
    assert!(pair.net().busy_links().is_empty(), "nothing sent back");
    // Message 2: its receive is posted first, and announces nothing (what
    // rank 1 sends is the slot message 1 took, given back).
    // SAFETY: as above.
    let receive2 = unsafe { engines[1].post_message(post_between_0_and_1(false, g2)) }.unwrap();
    engines[1].try_drive();
    assert_eq!(
        pair.net().in_flight(1, 0),
        1,
        "a slot back, no announcement"
    );
    pair.net().deliver(1, 0);
    // SAFETY: as above.
    let send2 = unsafe { engines[0].post_message(post_between_0_and_1(true, s2)) }.unwrap();
    engines[0].try_drive();
    pair.net().deliver(0, 1);
    engines[1].try_drive();
    assert_eq!(pair.settled(1, receive2), Ok(true), "taken as it landed");
    // Messages 3 (large: by announcement) and 4 (small), same tag.
    // SAFETY: as above.
    let send3 = unsafe { engines[0].post_message(post_between_0_and_1(true, s3)) }.unwrap();
    // SAFETY: as above.
    let send4 = unsafe { engines[0].post_message(post_between_0_and_1(true, s4)) }.unwrap();
    // SAFETY: as above.
    let receive3 = unsafe { engines[1].post_message(post_between_0_and_1(false, g3)) }.unwrap();
    // SAFETY: as above.
    let receive4 = unsafe { engines[1].post_message(post_between_0_and_1(false, g4)) }.unwrap();
    pair.pump();
    for id in [send2, send3, send4] {
        assert_eq!(pair.settled(0, id), Ok(true));
    }
    for id in [receive3, receive4] {
        assert_eq!(pair.settled(1, id), Ok(true));
    }
    assert!(engines.iter().all(|e| e.failure().is_none()));
    assert_eq!(got, sent);
}

/// A receive between machines that cannot open its tensor (the fabric
/// refuses its window) fails, and tells its sender in its announcement's
/// place: the send fails naming the receiver, and the pair's next messages
/// meet each other, exact, with neither engine failed. (Unannounced, the
/// sender's next send once met the receive after it.)
#[test]
fn a_receive_that_cannot_open_its_tensor_fails_its_send_and_no_other() {
    // Above the eager bound: every send waits for its receive's word.
    const ELEMENTS: usize = 5000;
    let mut sent: Vec<Vec<i32>> = (0..2)
        .map(|k| (0..ELEMENTS).map(|i| (k * ELEMENTS + i) as i32).collect())
        .collect();
    let mut got: Vec<Vec<i32>> = (0..2).map(|_| vec![-1; ELEMENTS]).collect();
    let pair = Pair::new();
    let engines = &pair.engines;
    let [s0, s1] = &mut sent[..] else {
        unreachable!()
    };
    let [g0, g1] = &mut got[..] else {
        unreachable!()
    };
    // Receive 0 cannot open its tensor; receive 1 can.
    pair.net().refuse_windows = true;
    // SAFETY: every tensor outlives the engines (declared before them).
    let receive0 = unsafe { engines[1].post_message(post_between_0_and_1(false, g0)) }.unwrap();
    engines[1].try_drive();
    pair.net().refuse_windows = false;
    // SAFETY: as above.
    let receive1 = unsafe { engines[1].post_message(post_between_0_and_1(false, g1)) }.unwrap();
    pair.pump();
    // SAFETY: as above.
    let send0 = unsafe { engines[0].post_message(post_between_0_and_1(true, s0)) }.unwrap();
    // SAFETY: as above.
    let send1 = unsafe { engines[0].post_message(post_between_0_and_1(true, s1)) }.unwrap();
    pair.pump();
    let e = pair
        .settled(1, receive0)
        .expect_err("its window was refused");
    assert!(e.contains("opening its tensor"), "{e}");
    let e = pair.settled(0, send0).expect_err("its receive failed");
    assert!(
        e.contains("rank 1") && e.contains("its receive failed"),
        "{e}"
    );
    assert_eq!(
        (pair.settled(0, send1), pair.settled(1, receive1)),
        (Ok(true), Ok(true))
    );
    assert!(engines.iter().all(|e| e.failure().is_none()));
    assert_eq!(got[1], sent[1]);
}

/// A send that cannot go eagerly asks for its receive's announcement, which
/// a small receive does not make on its own once the two ranks have
/// exchanged slots (before, it announces itself). With the slots exchanged
/// and every slot rank 0 may write holding a send of another tag:
///
/// - a small receive waiting unannounced, followed by a large one of its tag
///   that announces itself as posted, is announced first: the sender, which
///   pairs announcements with its waiting sends in order, meets them in
///   order (the large announcement once came first and was dropped, as if
///   for a send gone eagerly, and the large message never finished);
/// - a request that arrives before its receive is posted is answered as the
///   receive is posted;
/// - a large send asking for a small receive's announcement fails with it,
///   each naming both, instead of waiting forever.
#[test]
fn a_send_that_cannot_go_eagerly_asks_for_its_receives_announcement() {
    const LARGE: usize = 5000;
    let sizes = [3usize, 4, LARGE, 7];
    // Before the engines, so that they drop after them.
    let mut sent: Vec<Vec<i32>> = (0..sizes.len())
        .map(|k| (0..sizes[k]).map(|i| (k * 100_000 + i) as i32).collect())
        .collect();
    let mut got: Vec<Vec<i32>> = sizes.iter().map(|&n| vec![-1; n]).collect();
    let mut filling: Vec<Vec<i32>> = (0..4).map(|k| vec![k; 2]).collect();
    let mut filled: Vec<Vec<i32>> = (0..4).map(|_| vec![-1; 2]).collect();
    let (mut large, mut small) = (vec![5i32; LARGE], vec![0i32; 3]);
    let pair = Pair::new();
    let engines = &pair.engines;
    let [s0, s1, s2, s3] = &mut sent[..] else {
        unreachable!()
    };
    let [g0, g1, g2, g3] = &mut got[..] else {
        unreachable!()
    };
    // Message 0 opens the slots both ways. Its receive, posted first, from a
    // rank whose slots it does not know (so that may not send eagerly to
    // it), announces itself.
    // SAFETY: every tensor outlives the engines (declared before them).
    let receive0 = unsafe { engines[1].post_message(post_between_0_and_1(false, g0)) }.unwrap();
    engines[1].try_drive();
    assert_eq!(
        pair.net().in_flight(1, 0),
        2,
        "its slots and the announcement"
    );
    // SAFETY: as above.
    let send0 = unsafe { engines[0].post_message(post_between_0_and_1(true, s0)) }.unwrap();
    pair.pump();
    assert_eq!(
        (pair.settled(0, send0), pair.settled(1, receive0)),
        (Ok(true), Ok(true))
    );
    // Four small sends of tag 1, whose receives are not posted yet, take
    // every slot rank 1 opened to rank 0.
    let tag1 = |sending: bool, data: &mut Vec<i32>| crate::engine::messages::Post {
        tag: 1,
        ..post_between_0_and_1(sending, data)
    };
    let mut filling_sends = Vec::new();
    for data in &mut filling {
        // SAFETY: as above.
        filling_sends.push(unsafe { engines[0].post_message(tag1(true, data)) }.unwrap());
    }
    pair.pump();
    for id in filling_sends {
        assert_eq!(pair.settled(0, id), Ok(true), "went eagerly");
    }
    // Messages 1 (small) and 2 (large), tag 0, receives posted first: the
    // small receive waits unannounced, the large one announces itself; both
    // sends find no slot and ask.
    // SAFETY: as above.
    let receive1 = unsafe { engines[1].post_message(post_between_0_and_1(false, g1)) }.unwrap();
    // SAFETY: as above.
    let receive2 = unsafe { engines[1].post_message(post_between_0_and_1(false, g2)) }.unwrap();
    engines[1].try_drive();
    // SAFETY: as above.
    let send1 = unsafe { engines[0].post_message(post_between_0_and_1(true, s1)) }.unwrap();
    // SAFETY: as above.
    let send2 = unsafe { engines[0].post_message(post_between_0_and_1(true, s2)) }.unwrap();
    pair.pump();
    for (r, id) in [(0, send1), (0, send2), (1, receive1), (1, receive2)] {
        assert_eq!(pair.settled(r, id), Ok(true), "rank {r}, message {id}");
    }
    // Message 3 (small): its send asks, and the request lands before the
    // receive is posted.
    // SAFETY: as above.
    let send3 = unsafe { engines[0].post_message(post_between_0_and_1(true, s3)) }.unwrap();
    pair.pump();
    assert_eq!(pair.settled(0, send3), Ok(false), "waits for its receive");
    // SAFETY: as above.
    let receive3 = unsafe { engines[1].post_message(post_between_0_and_1(false, g3)) }.unwrap();
    pair.pump();
    assert_eq!(
        (pair.settled(0, send3), pair.settled(1, receive3)),
        (Ok(true), Ok(true)),
        "answered as the receive was posted"
    );
    for data in &mut filled {
        // SAFETY: as above.
        let id = unsafe { engines[1].post_message(tag1(false, data)) }.unwrap();
        engines[1].try_drive();
        assert_eq!(pair.settled(1, id), Ok(true), "landed before");
    }
    pair.pump();
    assert_eq!(got, sent);
    assert_eq!(filled, filling);
    // Message 4: a large send, a small receive posted first (unannounced).
    // SAFETY: as above.
    let receive4 =
        unsafe { engines[1].post_message(post_between_0_and_1(false, &mut small)) }.unwrap();
    engines[1].try_drive();
    // SAFETY: as above.
    let send4 = unsafe { engines[0].post_message(post_between_0_and_1(true, &mut large)) }.unwrap();
    pair.pump();
    let e = pair.settled(0, send4).expect_err("sizes differ");
    assert!(e.contains("3 x i32") && e.contains("5000 x i32"), "{e}");
    let e = pair.settled(1, receive4).expect_err("sizes differ");
    assert!(e.contains("3 x i32") && e.contains("5000 x i32"), "{e}");
    assert!(engines.iter().all(|e| e.failure().is_none()));
}

/// Small receives waiting unannounced are bounded by the slots their sender
/// may use: the first past them announces itself, and those of its tag
/// before it, so that a burst of receives posted first does not leave its
/// later sends to ask for their announcements. The sends that went eagerly
/// drop theirs, and every message lands exact.
#[test]
fn small_receives_past_the_slots_announce_themselves() {
    const BURST: usize = crate::engine::messages::EAGER_SLOTS as usize + 1;
    // Before the engines, so that they drop after them.
    let mut sent: Vec<Vec<i32>> = (0..=BURST).map(|k| vec![k as i32; 5]).collect();
    let mut got: Vec<Vec<i32>> = (0..=BURST).map(|_| vec![-1; 5]).collect();
    let pair = Pair::new();
    let engines = &pair.engines;
    let (first_sent, burst_sent) = sent.split_at_mut(1);
    let (first_got, burst_got) = got.split_at_mut(1);
    // Message 0 opens the slots both ways.
    // SAFETY: every tensor outlives the engines (declared before them).
    unsafe { engines[0].post_message(post_between_0_and_1(true, &mut first_sent[0])) }.unwrap();
    // SAFETY: as above.
    unsafe { engines[1].post_message(post_between_0_and_1(false, &mut first_got[0])) }.unwrap();
    pair.pump();
    assert!(pair.net().busy_links().is_empty());
    let mut receives = Vec::new();
    for data in burst_got.iter_mut() {
        // SAFETY: as above.
        receives
            .push(unsafe { engines[1].post_message(post_between_0_and_1(false, data)) }.unwrap());
        engines[1].try_drive();
    }
    assert_eq!(
        pair.net().in_flight(1, 0),
        BURST,
        "the last receive, past the slots, announced itself and those before it"
    );
    while pair.net().in_flight(1, 0) > 0 {
        pair.net().deliver(1, 0);
    }
    engines[0].try_drive();
    let mut sends = Vec::new();
    for data in burst_sent.iter_mut() {
        // SAFETY: as above.
        sends.push(unsafe { engines[0].post_message(post_between_0_and_1(true, data)) }.unwrap());
    }
    engines[0].try_drive();
    assert_eq!(
        pair.net().in_flight(0, 1),
        BURST,
        "each send met its announcement and wrote: none asked"
    );
    pair.pump();
    for id in sends {
        assert_eq!(pair.settled(0, id), Ok(true));
    }
    for id in receives {
        assert_eq!(pair.settled(1, id), Ok(true));
    }
    assert!(engines.iter().all(|e| e.failure().is_none()));
    assert_eq!(got, sent);
}
