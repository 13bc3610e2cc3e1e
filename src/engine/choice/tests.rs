use fairring_core::topology::RankLayout;

use super::*;

fn job(m: u32, d: u32, servers: u32, wire: WireFormat) -> Job {
    Job {
        topology: Topology::new(m, d, RankLayout::Contiguous).unwrap(),
        servers,
        routing: Routing::Flat,
        algorithm: Algorithm::Auto,
        wire,
        nccl_over_workers: false,
        machines_serve: crate::MachinesServe::Auto,
        gpus_in_switch: false,
        machines_can_serve: true,
        groups_for_small_tensors: None,
    }
}

/// What `asked` runs for `collective` of `bytes` on `m`x`d`, no servers.
fn runs(collective: Collective, m: u32, d: u32, asked: Algorithm, bytes: u64) -> Resolved {
    let call = Call {
        collective,
        dtype: DataType::U8,
        bytes,
        algorithm: Some(asked),
        wire: None,
        op: ReduceOp::Sum,
        memory: MemoryKind::Host,
    };
    choose(call, &job(m, d, 0, WireFormat::Exact))
        .unwrap()
        .algorithm
}

/// Every row of the rules table in the module docs holds.
#[test]
fn the_documented_rules_are_the_ones_chosen() {
    let source = include_str!("../choice.rs");
    let mut rows = 0;
    // The table from its header to the first line that is not a row.
    let table = source
        .lines()
        .skip_while(|line| !line.starts_with("//! | collective |"))
        .skip(2)
        .take_while(|line| line.starts_with("//! | "));
    for line in table {
        let row = line.trim_start_matches("//! | ");
        let cells: Vec<&str> = row.trim_end_matches(" |").split(" | ").collect();
        assert_eq!(cells.len(), 11, "a rules row has 11 cells: {line}");
        let collective = match cells[0] {
            "all-reduce" => Collective::AllReduce,
            "broadcast" => Collective::Broadcast,
            "all-gather" => Collective::AllGather,
            "reduce-scatter" => Collective::ReduceScatter,
            "barrier" => Collective::Barrier,
            other => panic!("no collective {other}: {line}"),
        };
        let number = |cell: &str| -> u32 { cell.parse().unwrap() };
        let bytes = match cells[4].strip_suffix('K') {
            Some(k) => k.parse::<u64>().unwrap() << 10,
            None => match cells[4].strip_suffix('M') {
                Some(m) => m.parse::<u64>().unwrap() << 20,
                None => cells[4].parse().unwrap(),
            },
        };
        let wire = |cell: &str| WireFormat::from_name(cell).unwrap();
        let call = Call {
            collective,
            dtype: DataType::from_name(cells[6]).unwrap(),
            bytes,
            algorithm: Some(cells[5].parse().unwrap()),
            wire: None,
            op: ReduceOp::Sum,
            memory: MemoryKind::Host,
        };
        let job = job(
            number(cells[1]),
            number(cells[2]),
            number(cells[3]),
            wire(cells[7]),
        );
        let chosen = choose(call, &job).unwrap();
        assert_eq!(chosen.algorithm.name(), cells[8], "{line}");
        assert_eq!(chosen.wire, wire(cells[9]), "{line}");
        assert_eq!(chosen.zero_fill, cells[10] == "yes", "{line}");
        rows += 1;
    }
    assert!(rows >= 30, "the table has {rows} rules");
}

#[test]
fn a_call_asking_a_compressed_wire_for_another_type_is_refused() {
    let call = Call {
        collective: Collective::AllReduce,
        dtype: DataType::I64,
        bytes: 4096,
        algorithm: None,
        wire: Some(WireFormat::Bf16),
        op: ReduceOp::Sum,
        memory: MemoryKind::Host,
    };
    let e = choose(call, &job(2, 1, 0, WireFormat::Exact))
        .unwrap_err()
        .to_string();
    assert!(e.contains("wire") && e.contains("i64"), "{e}");
    // The configured wire does not refuse: such calls run exact.
    let call = Call { wire: None, ..call };
    let chosen = choose(call, &job(2, 1, 0, WireFormat::Bf16)).unwrap();
    assert_eq!(chosen.wire, WireFormat::Exact);
}

#[test]
fn a_call_asking_a_compressed_wire_for_bytes_it_only_moves_is_refused() {
    for collective in [
        Collective::Broadcast,
        Collective::AllGather,
        Collective::Barrier,
    ] {
        let call = Call {
            collective,
            dtype: DataType::U8,
            bytes: 4096,
            algorithm: None,
            wire: Some(WireFormat::F16),
            op: ReduceOp::Sum,
            memory: MemoryKind::Host,
        };
        let e = choose(call, &job(2, 1, 0, WireFormat::Exact))
            .unwrap_err()
            .to_string();
        assert!(e.contains("wire") && e.contains(collective.name()), "{e}");
        // Exact is what they run: asking for it is no error.
        let exact = Call {
            wire: Some(WireFormat::Exact),
            ..call
        };
        assert!(choose(exact, &job(2, 1, 0, WireFormat::Exact)).is_ok());
    }
}

#[test]
fn auto_doubles_small_operations_on_two_single_device_machines() {
    let all_reduce = |bytes| runs(Collective::AllReduce, 2, 1, Algorithm::Auto, bytes);
    for bytes in [0, 4096, 256 << 10] {
        assert_eq!(all_reduce(bytes), Resolved::Doubling);
    }
    for bytes in [(256 << 10) + 1, 1 << 20, 64 << 20] {
        assert_eq!(all_reduce(bytes), Resolved::Hierarchical);
    }
}

#[test]
fn auto_resolves_to_a_concrete_algorithm_and_others_stay() {
    for (m, d) in [(1, 1), (1, 8), (2, 2), (3, 1), (64, 8)] {
        for bytes in [0, 4096, 64 << 20, u64::MAX] {
            let all_reduce = |asked| runs(Collective::AllReduce, m, d, asked, bytes);
            assert_eq!(all_reduce(Algorithm::Auto), Resolved::Hierarchical);
            assert_eq!(all_reduce(Algorithm::Doubling), Resolved::Doubling);
            assert_eq!(all_reduce(Algorithm::Ring), Resolved::Ring);
            assert_eq!(all_reduce(Algorithm::Hierarchical), Resolved::Hierarchical);
        }
    }
}

#[test]
fn auto_relays_spreads_across_machines() {
    let spread = |m, d, bytes| runs(Collective::Broadcast, m, d, Algorithm::Auto, bytes);
    let scatter = |m, d, bytes| runs(Collective::ReduceScatter, m, d, Algorithm::Auto, bytes);
    for bytes in [0, 4096, 64 << 20] {
        assert_eq!(spread(2, 1, bytes), Resolved::Relay);
        assert_eq!(spread(3, 1, bytes), Resolved::Relay);
        assert_eq!(scatter(2, 1, bytes), Resolved::Scatter);
        // Several devices per machine: both run over the machines, with
        // shared memory inside each.
        assert_eq!(spread(2, 2, bytes), Resolved::Relay);
        assert_eq!(scatter(2, 2, bytes), Resolved::Scatter);
        // One machine: shared memory only; a reduce-scatter skips the
        // all-gather.
        assert_eq!(spread(1, 8, bytes), Resolved::Hierarchical);
        assert_eq!(spread(1, 1, bytes), Resolved::Hierarchical);
        assert_eq!(scatter(1, 8, bytes), Resolved::Scatter);
        assert_eq!(scatter(1, 1, bytes), Resolved::Hierarchical);
    }
    assert_eq!(scatter(8, 1, 4096), Resolved::Hierarchical);
    assert_eq!(scatter(8, 1, 256 << 10), Resolved::Scatter);
    assert_eq!(scatter(4, 2, 4096), Resolved::Hierarchical);
    assert_eq!(scatter(4, 2, 256 << 10), Resolved::Scatter);
    assert_eq!(
        runs(Collective::ReduceScatter, 2, 2, Algorithm::Ring, 4096),
        Resolved::Scatter
    );
    // Four machines or more: two hops beat M - 1 for small operations.
    assert_eq!(spread(8, 1, 4096), Resolved::Hierarchical);
    assert_eq!(spread(8, 1, 256 << 10), Resolved::Relay);
    assert_eq!(spread(4, 1, (256 << 10) - 1), Resolved::Hierarchical);
    let spread_asked = |asked, m, d, bytes| runs(Collective::Broadcast, m, d, asked, bytes);
    assert_eq!(spread_asked(Algorithm::Ring, 8, 1, 4096), Resolved::Relay);
    assert_eq!(
        spread_asked(Algorithm::Ring, 2, 2, 64 << 20),
        Resolved::Relay
    );
    assert_eq!(
        spread_asked(Algorithm::Hierarchical, 8, 1, 4096),
        Resolved::Hierarchical
    );
    assert_eq!(
        spread_asked(Algorithm::Hierarchical, 2, 2, 64 << 20),
        Resolved::Hierarchical
    );
}

#[test]
fn gathers_scatters_and_reduces_on_host_memory_move_as_messages_within_the_limits() {
    let (up_to, from) = (ROOTED_BY_MESSAGES_UP_TO, ROOTED_BY_MESSAGES_FROM);
    let layout = |m, d| Topology::new(m, d, RankLayout::Contiguous).unwrap();
    let exact = WireFormat::Exact;
    let host = |c, dtype, m, d, bytes| {
        rooted_by_messages(c, dtype, MemoryKind::Host, exact, layout(m, d), bytes)
    };
    for c in [Collective::Gather, Collective::Scatter, Collective::Reduce] {
        for dtype in [DataType::F32, DataType::I64, DataType::U8] {
            assert!(host(c, dtype, 2, 1, from), "{c:?} {dtype}");
            assert!(host(c, dtype, up_to, 1, 1 << 30), "{c:?} {dtype}");
            assert!(!host(c, dtype, 2, 1, from - 1), "{c:?} {dtype}");
            assert!(!host(c, dtype, up_to + 1, 1, 1 << 30), "{c:?} {dtype}");
            let device = MemoryKind::Device;
            let on_device = rooted_by_messages(c, dtype, device, exact, layout(2, 1), 1 << 30);
            assert!(!on_device, "{c:?} {dtype}");
        }
    }
    // A machine's ranks reduce through its shared segment; gathers and
    // scatters move as messages there too.
    for (m, d) in [(1, 2), (1, 8), (2, 2), (4, 8)] {
        assert!(
            !host(Collective::Reduce, DataType::F32, m, d, 1 << 30),
            "{m}x{d}"
        );
        assert!(
            host(Collective::Gather, DataType::F32, m, d, 1 << 30),
            "{m}x{d}"
        );
        assert!(
            host(Collective::Scatter, DataType::F32, m, d, 1 << 30),
            "{m}x{d}"
        );
    }
    // Halves would round at every hop of a chain; gathers and scatters move
    // them as bytes.
    for dtype in [DataType::F16, DataType::BF16] {
        assert!(!host(Collective::Reduce, dtype, 4, 1, 1 << 30));
        assert!(host(Collective::Gather, dtype, 4, 1, 1 << 30));
    }
    // A compressed wire compresses an f32 reduce as an all-reduce.
    let bf16 = |dtype| {
        let wire = WireFormat::Bf16;
        rooted_by_messages(
            Collective::Reduce,
            dtype,
            MemoryKind::Host,
            wire,
            layout(4, 1),
            1 << 30,
        )
    };
    assert!(!bf16(DataType::F32));
    assert!(bf16(DataType::I64));
    // A reduce of one rank has no chain.
    assert!(!host(Collective::Reduce, DataType::F32, 1, 1, 1 << 30));
    for c in [
        Collective::AllGather,
        Collective::Broadcast,
        Collective::AllReduce,
        Collective::ReduceScatter,
        Collective::Barrier,
    ] {
        assert!(!host(c, DataType::U8, 2, 1, 1 << 30), "{c:?}");
    }
}

#[test]
fn through_the_trees_a_compressed_wire_runs_exact() {
    let call = Call {
        collective: Collective::AllReduce,
        dtype: DataType::F32,
        bytes: 64 << 20,
        algorithm: None,
        wire: Some(WireFormat::Bf16),
        op: ReduceOp::Sum,
        memory: MemoryKind::Host,
    };
    let flat = job(64, 8, 0, WireFormat::Exact);
    let trees = Job {
        routing: Routing::Trees,
        ..flat
    };
    assert_eq!(choose(call, &flat).unwrap().wire, WireFormat::Bf16);
    let through = choose(call, &trees).unwrap();
    assert_eq!(through.algorithm, Resolved::Hierarchical);
    assert_eq!(through.wire, WireFormat::Exact);
    let groups = Job {
        routing: Routing::Groups,
        ..flat
    };
    let in_groups = choose(call, &groups).unwrap();
    assert_eq!(
        (in_groups.algorithm, in_groups.wire),
        (Resolved::Hierarchical, WireFormat::Exact)
    );
    // `auto` keeps the hierarchical all-reduce for a wire it would use, not
    // for one it would not: two machines of one device double small ones.
    let small = Call {
        bytes: 4096,
        ..call
    };
    let two = job(2, 1, 0, WireFormat::Exact);
    assert_eq!(
        choose(small, &two).unwrap().algorithm,
        Resolved::Hierarchical
    );
    let two_trees = Job {
        routing: Routing::Trees,
        ..two
    };
    let doubled = choose(small, &two_trees).unwrap();
    assert_eq!(
        (doubled.algorithm, doubled.wire),
        (Resolved::Doubling, WireFormat::Exact)
    );
}

/// A device all-reduce of `bytes` of `dtype` reduced with `op` on `m`x8,
/// with the job's NCCL communicator made or not, asking for `asked`.
fn device_all_reduce(
    m: u32,
    bytes: u64,
    dtype: DataType,
    op: ReduceOp,
    across_job: bool,
    asked: Option<Algorithm>,
) -> Resolved {
    let call = Call {
        collective: Collective::AllReduce,
        dtype,
        bytes,
        algorithm: asked,
        wire: None,
        op,
        memory: MemoryKind::Device,
    };
    let job = Job {
        nccl_over_workers: across_job,
        ..job(m, 8, 0, WireFormat::Exact)
    };
    choose(call, &job).unwrap().algorithm
}

/// An all-reduce of `bytes` of `f32` summed, on `memory`, asking for nothing.
fn f32_sum(bytes: u64, memory: MemoryKind) -> Call {
    Call {
        collective: Collective::AllReduce,
        dtype: DataType::F32,
        bytes,
        algorithm: None,
        wire: None,
        op: ReduceOp::Sum,
        memory,
    }
}

#[test]
fn device_all_reduces_on_few_machines_run_as_the_jobs_nccl_all_reduce_where_it_is_ahead() {
    const MIB: u64 = 1 << 20;
    let (f32, sum) = (DataType::F32, ReduceOp::Sum);
    let nccl = |m, bytes| device_all_reduce(m, bytes, f32, sum, true, None);
    // Every edge of every window, 4 bytes either side.
    let mut edges = vec![
        (2, 1 << 30, true),
        (8, 16 * MIB, false),
        (64, 16 * MIB, false),
    ];
    for (m, windows) in (2u32..).zip(NCCL_ACROSS_WINDOWS_KIB) {
        for &(from, to) in windows {
            if from > 0 {
                edges.push((m, (from << 10) - 4, false));
            }
            edges.push((m, (from << 10).max(4), true));
            if to != u64::MAX {
                edges.push((m, to << 10, true));
                edges.push((m, (to << 10) + 4, false));
            }
        }
    }
    for (m, bytes, expected) in edges {
        let chosen = nccl(m, bytes);
        assert_eq!(
            chosen == Resolved::Nccl,
            expected,
            "{m} machines, {bytes} bytes: {chosen}"
        );
        // The same beside dedicated servers, which serve the rest.
        let call = f32_sum(bytes, MemoryKind::Device);
        for servers in [1, 2, 8 * m] {
            let beside = Job {
                nccl_over_workers: true,
                ..job(m, 8, servers, WireFormat::Exact)
            };
            let chosen = choose(call, &beside).unwrap().algorithm;
            let expected = if expected {
                Resolved::Nccl
            } else {
                Resolved::Hierarchical
            };
            assert_eq!(
                chosen, expected,
                "{m} machines, {servers} servers, {bytes} bytes"
            );
        }
    }
    // Not without the job's communicator, not where an algorithm is asked
    // for, not on host memory, and not for what NCCL does not reduce (a
    // float maximum keeps fairring's NaN rules; NCCL has no i16 or bitwise
    // operators).
    let bytes = 64 * MIB;
    assert_eq!(
        device_all_reduce(2, bytes, f32, sum, false, None),
        Resolved::Hierarchical
    );
    assert_eq!(
        device_all_reduce(2, bytes, f32, sum, true, Some(Algorithm::Hierarchical)),
        Resolved::Hierarchical
    );
    assert_eq!(
        device_all_reduce(2, bytes, f32, ReduceOp::Max, true, None),
        Resolved::Hierarchical
    );
    assert_eq!(
        device_all_reduce(2, bytes, DataType::I16, sum, true, None),
        Resolved::Hierarchical
    );
    assert_eq!(
        device_all_reduce(2, bytes, DataType::I32, ReduceOp::BitOr, true, None),
        Resolved::Hierarchical
    );
    assert_eq!(
        device_all_reduce(2, bytes, DataType::I32, ReduceOp::Max, true, None),
        Resolved::Nccl
    );
    assert_eq!(
        device_all_reduce(2, bytes, DataType::Bool, ReduceOp::Max, true, None),
        Resolved::Hierarchical
    );
    let host = f32_sum(bytes, MemoryKind::Host);
    // A reduce runs as an all-reduce, but not as NCCL's across the job.
    let reduce = Call {
        collective: Collective::Reduce,
        memory: MemoryKind::Device,
        ..host
    };
    let with_comm = Job {
        nccl_over_workers: true,
        ..job(2, 8, 0, WireFormat::Exact)
    };
    assert_eq!(
        choose(reduce, &with_comm).unwrap().algorithm,
        Resolved::Hierarchical
    );
    assert_eq!(
        choose(host, &with_comm).unwrap().algorithm,
        Resolved::Hierarchical
    );
    let device = Call {
        memory: MemoryKind::Device,
        ..host
    };
    let servers = Job {
        nccl_over_workers: true,
        ..job(2, 8, 2, WireFormat::Exact)
    };
    assert_eq!(choose(device, &servers).unwrap().algorithm, Resolved::Nccl);
    assert_eq!(
        choose(host, &servers).unwrap().algorithm,
        Resolved::Hierarchical
    );
    // A compressed wire asked for keeps the plan, which compresses.
    let compressed = Call {
        wire: Some(WireFormat::Bf16),
        ..device
    };
    let chosen = choose(compressed, &with_comm).unwrap();
    assert_eq!(
        (chosen.algorithm, chosen.wire),
        (Resolved::Hierarchical, WireFormat::Bf16)
    );
    // ... even through the trees, where the plan then runs exact.
    let trees = Job {
        routing: Routing::Trees,
        ..with_comm
    };
    let chosen = choose(compressed, &trees).unwrap();
    assert_eq!(
        (chosen.algorithm, chosen.wire),
        (Resolved::Hierarchical, WireFormat::Exact)
    );
    // Only jobs of two to seven machines of several ranks make the
    // communicator at all.
    let t = |m, d| Topology::new(m, d, RankLayout::Contiguous).unwrap();
    assert!(nccl_across_job_may_run(t(2, 8)));
    assert!(nccl_across_job_may_run(t(7, 2)));
    assert!(!nccl_across_job_may_run(t(1, 8)));
    assert!(!nccl_across_job_may_run(t(8, 8)));
    assert!(!nccl_across_job_may_run(t(2, 1)));
}

/// On one machine of several GPUs beside dedicated servers, a device
/// all-reduce NCCL reduces runs as one NCCL all-reduce on the machine's
/// communicators at every size, where they were made, `auto` and exact; the
/// servers serve it nowhere else.
#[test]
fn device_all_reduces_of_one_machine_beside_servers_run_as_its_nccl_all_reduce() {
    let call = |bytes, dtype, op, wire| Call {
        collective: Collective::AllReduce,
        dtype,
        bytes,
        algorithm: None,
        wire,
        op,
        memory: MemoryKind::Device,
    };
    let (f32, sum) = (DataType::F32, ReduceOp::Sum);
    let on = |m: u32, d: u32, servers: u32, made: bool| Job {
        nccl_over_workers: made,
        ..job(m, d, servers, WireFormat::Exact)
    };
    let runs = |c: Call, j: &Job| choose(c, j).unwrap();
    for bytes in [4, 64 << 10, 64 << 20, 1 << 30, u64::MAX / 2] {
        for servers in [1, 2, 8] {
            let chosen = runs(call(bytes, f32, sum, None), &on(1, 8, servers, true));
            assert_eq!(
                (chosen.algorithm, chosen.wire),
                (Resolved::Nccl, WireFormat::Exact),
                "{bytes} bytes, {servers} servers"
            );
        }
        // The servers serve: without the machine's communicators, with one
        // GPU a machine, on eight machines (on two to seven, NCCL's
        // all-reduce across the job runs in its windows).
        for job in [on(1, 8, 2, false), on(1, 1, 2, true), on(8, 8, 2, true)] {
            assert_eq!(
                runs(call(bytes, f32, sum, None), &job).algorithm,
                Resolved::Hierarchical,
                "{bytes} bytes, {job:?}"
            );
        }
        // One machine without servers runs the plan's single slice.
        assert_eq!(
            runs(call(bytes, f32, sum, None), &on(1, 8, 0, true)).algorithm,
            Resolved::Hierarchical
        );
    }
    let beside = on(1, 8, 2, true);
    // Not where NCCL does not reduce, an algorithm is asked for, or a
    // compressed wire (which the servers carry).
    for (dtype, op) in [(f32, ReduceOp::Max), (DataType::I16, sum)] {
        assert_eq!(
            runs(call(1 << 20, dtype, op, None), &beside).algorithm,
            Resolved::Hierarchical
        );
    }
    let asked = Call {
        algorithm: Some(Algorithm::Hierarchical),
        ..call(1 << 20, f32, sum, None)
    };
    assert_eq!(runs(asked, &beside).algorithm, Resolved::Hierarchical);
    let chosen = runs(call(1 << 20, f32, sum, Some(WireFormat::Bf16)), &beside);
    assert_eq!(
        (chosen.algorithm, chosen.wire),
        (Resolved::Hierarchical, WireFormat::Bf16)
    );
    // Host memory stays with the servers.
    let host = Call {
        memory: MemoryKind::Host,
        ..call(1 << 20, f32, sum, None)
    };
    assert_eq!(runs(host, &beside).algorithm, Resolved::Hierarchical);
}

/// The windows of sizes that run NCCL across the job: one list per machine
/// count from two to seven, each ascending and disjoint, the first from the
/// smallest size; none past seven machines or below two; a window's ends
/// are in it, the byte past its end is not.
#[test]
fn nccl_across_the_job_runs_in_ordered_windows_of_two_to_seven_machines() {
    assert_eq!(
        NCCL_ACROSS_WINDOWS_KIB.len(),
        NCCL_ACROSS_UP_TO_MACHINES as usize - 1
    );
    for (m, windows) in (2u32..).zip(NCCL_ACROSS_WINDOWS_KIB) {
        assert_eq!(windows[0].0, 0, "{m} machines: the smallest sizes");
        assert!(nccl_across_job(m, 1), "{m} machines");
        for (j, &(from, to)) in windows.iter().enumerate() {
            assert!(from < to, "{m} machines, window {j}");
            if let Some(&(next, _)) = windows.get(j + 1) {
                assert!(to < next, "{m} machines, windows {j} and {}", j + 1);
            }
            assert!(nccl_across_job(m, from << 10), "{m}: {from} KiB");
            if to != u64::MAX {
                assert!(nccl_across_job(m, to << 10), "{m}: {to} KiB");
                assert!(!nccl_across_job(m, (to << 10) + 1), "{m}: past {to} KiB");
            }
        }
    }
    for m in [0, 1, 8, 64] {
        assert!(!nccl_across_job(m, 64 << 20), "{m} machines");
    }
    assert!(nccl_across_job(2, u64::MAX));
}

/// Beside dedicated servers, an exact all-reduce the servers would take runs
/// as the same job without servers would (`Resolved::Colocated`) where the
/// machines serve (`FAIRRING_MACHINES_SERVE`): `on` for every tensor, `auto`
/// for device tensors where every GPU reduces in its NVSwitch, `off` never;
/// not where an algorithm or a compressed wire is asked for, for the other
/// collectives, without servers, where the job cannot plan without them,
/// or where NCCL's all-reduce across the job is ahead.
#[test]
fn beside_servers_the_machines_serve_the_all_reduces_the_servers_would_take() {
    let (host, device) = (MemoryKind::Host, MemoryKind::Device);
    let beside = |m: u32, serve: MachinesServe, in_switch: bool| Job {
        machines_serve: serve,
        gpus_in_switch: in_switch,
        ..job(m, 8, 8, WireFormat::Exact)
    };
    let runs = |c: Call, j: &Job| choose(c, j).unwrap();
    for bytes in [4, 64 << 10, 64 << 20, 1 << 30] {
        for m in [1, 8, 64] {
            let what = format!("{m}x8 + 8, {bytes} bytes");
            for memory in [host, device] {
                for in_switch in [false, true] {
                    let on = runs(
                        f32_sum(bytes, memory),
                        &beside(m, MachinesServe::On, in_switch),
                    );
                    assert_eq!(on.algorithm, Resolved::Colocated, "{what}, {memory:?}");
                    assert_eq!(on.wire, WireFormat::Exact, "{what}");
                    let off = beside(m, MachinesServe::Off, in_switch);
                    assert_eq!(
                        runs(f32_sum(bytes, memory), &off).algorithm,
                        Resolved::Hierarchical,
                        "{what}, {memory:?}"
                    );
                }
            }
            let auto = |in_switch| beside(m, MachinesServe::Auto, in_switch);
            assert_eq!(
                runs(f32_sum(bytes, device), &auto(true)).algorithm,
                Resolved::Colocated,
                "{what}"
            );
            for (memory, in_switch) in [(device, false), (host, true), (host, false)] {
                assert_eq!(
                    runs(f32_sum(bytes, memory), &auto(in_switch)).algorithm,
                    Resolved::Hierarchical,
                    "{what}, {memory:?}, in switch {in_switch}"
                );
            }
            // Every type and operator the plan reduces.
            let ints = Call {
                dtype: DataType::I16,
                op: ReduceOp::BitXor,
                ..f32_sum(bytes, device)
            };
            assert_eq!(runs(ints, &auto(true)).algorithm, Resolved::Colocated);
        }
    }
    let on = beside(8, MachinesServe::On, true);
    // Asked for by name, or with a compressed wire: the servers.
    let asked = Call {
        algorithm: Some(Algorithm::Hierarchical),
        ..f32_sum(1 << 20, host)
    };
    assert_eq!(runs(asked, &on).algorithm, Resolved::Hierarchical);
    let narrow = Call {
        wire: Some(WireFormat::Bf16),
        ..f32_sum(1 << 20, host)
    };
    let chosen = runs(narrow, &on);
    assert_eq!(
        (chosen.algorithm, chosen.wire),
        (Resolved::Hierarchical, WireFormat::Bf16)
    );
    // The other collectives run as they do beside servers: a reduce (whose
    // device side is not readied before the choice) goes to them.
    for (collective, runs_as) in [
        (Collective::Reduce, Resolved::Hierarchical),
        (Collective::Broadcast, Resolved::Relay),
        (Collective::AllGather, Resolved::Relay),
        (Collective::ReduceScatter, Resolved::Scatter),
    ] {
        let call = Call {
            collective,
            ..f32_sum(64 << 20, host)
        };
        assert_eq!(runs(call, &on).algorithm, runs_as, "{collective:?}");
    }
    // Without servers, or where the job cannot plan without them.
    let alone = Job {
        machines_serve: MachinesServe::On,
        ..job(8, 8, 0, WireFormat::Exact)
    };
    assert_eq!(
        runs(f32_sum(1 << 20, host), &alone).algorithm,
        Resolved::Hierarchical
    );
    let cannot = Job {
        machines_can_serve: false,
        ..on
    };
    assert_eq!(
        runs(f32_sum(1 << 20, host), &cannot).algorithm,
        Resolved::Hierarchical
    );
    // Within NCCL's windows across the job, NCCL; outside them, the machines.
    let two = Job {
        nccl_over_workers: true,
        ..beside(2, MachinesServe::Auto, true)
    };
    let mut sizes = (16..31).map(|k| 1u64 << k);
    let inside = sizes.clone().find(|&b| nccl_across_job(2, b)).unwrap();
    let outside = sizes.rfind(|&b| !nccl_across_job(2, b)).unwrap();
    assert_eq!(
        runs(f32_sum(inside, device), &two).algorithm,
        Resolved::Nccl
    );
    assert_eq!(
        runs(f32_sum(outside, device), &two).algorithm,
        Resolved::Colocated
    );
}

/// On the flat plan of 50 machines of 8 in the default slices, `auto` runs
/// an exact all-reduce of a tensor the flat plan cuts into too few slices,
/// or into slices that leave machines without a shard, in groups
/// (`Resolved::Grouped`), host or device, of any type; not a large one, not
/// where an algorithm or a compressed wire is asked for, not the other
/// collectives, and not where the job has no groups for its small tensors.
#[test]
fn small_tensors_on_the_flat_plan_run_in_groups() {
    let topology = Topology::new(50, 8, RankLayout::Contiguous).unwrap();
    let config = fairring_core::plan::PlanConfig::with_default_slices(
        fairring_core::plan::PlanConfig::DEFAULT_MIN_SHARD_BYTES,
    )
    .unwrap();
    let flat = Geometry::new(topology, config).unwrap();
    let grouped = Job {
        groups_for_small_tensors: Some(flat),
        ..job(50, 8, 0, WireFormat::Exact)
    };
    let runs = |c: Call, j: &Job| choose(c, j).unwrap();
    for memory in [MemoryKind::Host, MemoryKind::Device] {
        for bytes in [8, 64 << 10, 1 << 20, 16 << 20, 64 << 20] {
            let chosen = runs(f32_sum(bytes, memory), &grouped);
            assert_eq!(
                (chosen.algorithm, chosen.wire),
                (Resolved::Grouped, WireFormat::Exact),
                "{bytes} bytes, {memory:?}"
            );
            let ints = Call {
                dtype: DataType::I64,
                op: ReduceOp::Max,
                ..f32_sum(bytes, memory)
            };
            assert_eq!(runs(ints, &grouped).algorithm, Resolved::Grouped);
            // Without groups for its small tensors, the flat plan.
            let flat_only = job(50, 8, 0, WireFormat::Exact);
            assert_eq!(
                runs(f32_sum(bytes, memory), &flat_only).algorithm,
                Resolved::Hierarchical
            );
        }
        // Four slices or more of the flat plan's: flat.
        for bytes in [256 << 20, 1 << 30] {
            assert_eq!(
                runs(f32_sum(bytes, memory), &grouped).algorithm,
                Resolved::Hierarchical,
                "{bytes} bytes"
            );
        }
    }
    let asked = Call {
        algorithm: Some(Algorithm::Hierarchical),
        ..f32_sum(1 << 20, MemoryKind::Host)
    };
    assert_eq!(runs(asked, &grouped).algorithm, Resolved::Hierarchical);
    let narrow = Call {
        wire: Some(WireFormat::Bf16),
        ..f32_sum(1 << 20, MemoryKind::Host)
    };
    let chosen = runs(narrow, &grouped);
    assert_eq!(
        (chosen.algorithm, chosen.wire),
        (Resolved::Hierarchical, WireFormat::Bf16)
    );
    for collective in [
        Collective::Reduce,
        Collective::Broadcast,
        Collective::AllGather,
        Collective::ReduceScatter,
    ] {
        let call = Call {
            collective,
            ..f32_sum(1 << 20, MemoryKind::Host)
        };
        assert_ne!(
            runs(call, &grouped).algorithm,
            Resolved::Grouped,
            "{collective:?}"
        );
    }
}
