//! One rank's part: the sizes, algorithms and iterations timed, and the
//! gradient-list run.

use super::*;

pub(crate) fn worker(options: &Options) -> ExitCode {
    // The job as its launcher describes it (torchrun, mpirun, mpiexec, srun).
    let config = Config::from_lookup(|k| match (k, options.wire) {
        ("FAIRRING_WIRE", Some(wire)) => Some(wire.name().to_owned()),
        _ => std::env::var(k).ok(),
    });
    let config = match config {
        Ok(config) => config,
        Err(e) => {
            eprintln!("fairring-bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    let rank = config.rank();
    match run(options, config) {
        Ok(0) => ExitCode::SUCCESS,
        Ok(wrong) => {
            if rank == 0 {
                eprintln!("fairring-bench: {wrong} wrong elements");
            }
            ExitCode::from(3)
        }
        Err(e) => {
            eprintln!("fairring-bench: rank {rank}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One row of the table.
pub(crate) struct Row {
    pub(crate) bytes: u64,
    pub(crate) count: u64,
    pub(crate) algorithm: Algorithm,
    pub(crate) time_us: f64,
    pub(crate) algbw: f64,
    pub(crate) busbw: f64,
    pub(crate) wrong: u64,
    /// Data bytes the busiest rank's fabric wrote, and received, per all-reduce.
    pub(crate) sent_per_op: u64,
    pub(crate) received_per_op: u64,
}

pub(crate) fn run(o: &Options, config: Config) -> fairring::Result<u64> {
    let comm = Communicator::new(config)?;
    if o.gradients > 0 {
        return gradients(&comm, o);
    }
    macro_rules! dispatch {
        ($($variant:ident => $t:ty),*) => {
            match o.dtype {
                $(DataType::$variant => sweep::<$t>(&comm, o),)*
            }
        };
    }
    dispatch!(F32 => f32, F64 => f64, F16 => f16, BF16 => bf16, I32 => i32, I64 => i64, U8 => u8, I8 => i8, I16 => i16, Bool => Bool)
}

pub(crate) fn sweep<T: Value>(comm: &Communicator, o: &Options) -> fairring::Result<u64> {
    let rank = comm.rank();
    let world = comm.world_size();
    let esize = T::DTYPE.size_bytes();
    let elements = usize::try_from(o.max_bytes / esize).unwrap_or(0);
    let mut bufs: Vec<Vec<T>> = (0..o.parallel)
        .map(|_| vec![T::default(); elements])
        .collect();
    // The other side of an all-gather or a gather (the input), a reduce-scatter
    // or a scatter (the output), a reduce or an all-to-all (the output).
    let mut parts: Vec<Vec<T>> = if matches!(o.collective, Timed::Reduce | Timed::AllToAll) {
        (0..o.parallel)
            .map(|_| vec![T::default(); elements])
            .collect()
    } else if o.collective.per_rank() {
        (0..o.parallel)
            .map(|_| vec![T::default(); elements / world as usize + 1])
            .collect()
    } else {
        Vec::new()
    };
    let part_elements = parts.first().map_or(0, Vec::len);
    let mut device = if o.device {
        Some(device_tensors::DeviceTensors::new(
            comm.location().device,
            o.parallel,
            usize::try_from(o.max_bytes).unwrap_or(usize::MAX),
            part_elements * std::mem::size_of::<T>(),
        )?)
    } else {
        None
    };
    let mut rows = Vec::new();
    let mut total_wrong = 0u64;
    if rank == 0 {
        let t = comm.topology();
        println!(
            "# fairring-bench {}{}: {} machines x {} ranks, {} staging buffers of slices up to {} bytes, {} x {} in flight, {}",
            o.collective.name(),
            if o.device { " on GPU tensors" } else { "" },
            t.machines(),
            t.devices_per_machine(),
            comm.staging_buffers(),
            comm.slice_bytes(),
            o.parallel,
            T::DTYPE,
            timing(o)
        );
        println!(
            "{:>12} {:>12} {:>6} {:>7} {:>13} {:>10} {:>9} {:>9} {:>7} {:>12} {:>12}",
            "size",
            "count",
            "type",
            "redop",
            "algo",
            "time(us)",
            "algbw",
            "busbw",
            "#wrong",
            "sent/op",
            "recv/op"
        );
        println!(
            "{:>12} {:>12} {:>6} {:>7} {:>13} {:>10} {:>9} {:>9} {:>7} {:>12} {:>12}",
            "(B)", "(elements)", "", "", "", "", "(GB/s)", "(GB/s)", "", "(B)", "(B)"
        );
    }
    let step = if o.collective.per_rank() {
        esize * u64::from(world)
    } else {
        esize
    };
    let mut size = o.min_bytes.max(step);
    loop {
        // A size that must divide among the ranks is rounded down to a multiple.
        let count = size / step * step / esize;
        let n = usize::try_from(count).unwrap_or(0);
        let per_rank = count / u64::from(world);
        // One timed (or warm-up) iteration, on device or host tensors.
        let timed = |algorithm: Algorithm,
                     device: &mut Option<device_tensors::DeviceTensors>,
                     bufs: &mut [Vec<T>],
                     parts: &mut [Vec<T>]| match device {
            Some(dev) => dev.run(
                comm,
                o.collective,
                count,
                per_rank,
                T::DTYPE,
                o.op,
                algorithm,
            ),
            None => iteration(comm, o, bufs, parts, n, algorithm),
        };
        // Check and warm up every algorithm first, then time them in turns of
        // `ROUNDS` blocks of consecutive iterations: a comparison in one run sees
        // the same machine state for every algorithm, whichever comes first,
        // while a block keeps each algorithm's steady state (a small all-reduce
        // right after a different algorithm's pays for the switch).
        let mut wrongs = Vec::with_capacity(o.algorithms.len());
        let mut warm_traffic = Vec::with_capacity(o.algorithms.len());
        // At least one warm-up call where it counts the traffic.
        let warmup = if o.barrier { o.warmup.max(1) } else { o.warmup };
        for &algorithm in &o.algorithms {
            // Check one iteration against the exactly known result.
            let mut wrong = 0u64;
            if o.check {
                fill(o, rank, &mut bufs, &mut parts, n, world);
                if let Some(dev) = device.as_mut() {
                    let k = if o.collective.per_rank() {
                        n / world as usize
                    } else {
                        0
                    };
                    dev.upload(&bufs, &parts, n, k)?;
                    dev.run(
                        comm,
                        o.collective,
                        count,
                        k as u64,
                        T::DTYPE,
                        o.op,
                        algorithm,
                    )?;
                    dev.download(&mut bufs, &mut parts, n, k)?;
                } else {
                    iteration(comm, o, &mut bufs, &mut parts, n, algorithm)?;
                }
                wrong = count_wrong(o, rank, &bufs, &parts, n, world);
                let mut w = [i64::try_from(wrong).unwrap_or(i64::MAX)];
                comm.all_reduce(&mut w, ReduceOp::Sum)?;
                wrong = u64::try_from(w[0]).unwrap_or(u64::MAX);
            }
            wrongs.push(wrong);
            // Timed after barriers, the calls' bytes are counted here, back to
            // back: a barrier moves bytes too, and a landing counts once
            // taken, which may be after its call returned.
            let before = comm.traffic();
            for _ in 0..warmup {
                timed(algorithm, &mut device, &mut bufs, &mut parts)?;
            }
            let after = comm.traffic();
            if o.barrier {
                warm_traffic.push(fairring::Traffic {
                    sent_bytes: after.sent_bytes - before.sent_bytes,
                    received_bytes: after.received_bytes - before.received_bytes,
                    received_in_place_bytes: 0,
                });
            }
        }
        let mut timings = vec![vec![0f64; o.iters]; o.algorithms.len()];
        let mut moved = vec![fairring::Traffic::default(); o.algorithms.len()];
        let rounds = ROUNDS.min(o.iters);
        for round in 0..rounds {
            let iters = (round * o.iters / rounds)..((round + 1) * o.iters / rounds);
            // Odd rounds take the algorithms in reverse: none always goes first.
            let mut order: Vec<usize> = (0..o.algorithms.len()).collect();
            if round % 2 == 1 {
                order.reverse();
            }
            for a in order {
                let algorithm = o.algorithms[a];
                let before = comm.traffic();
                for i in iters.clone() {
                    if o.barrier {
                        comm.barrier()?;
                    }
                    let start = Instant::now();
                    timed(algorithm, &mut device, &mut bufs, &mut parts)?;
                    timings[a][i] = start.elapsed().as_secs_f64() / o.collective.legs();
                }
                let after = comm.traffic();
                if !o.barrier {
                    moved[a].sent_bytes += after.sent_bytes - before.sent_bytes;
                    moved[a].received_bytes += after.received_bytes - before.received_bytes;
                }
            }
        }
        let counted_calls = if o.barrier {
            moved = warm_traffic;
            warmup
        } else {
            o.iters
        };
        for (((&algorithm, mut times), wrong), moved) in
            o.algorithms.iter().zip(timings).zip(wrongs).zip(moved)
        {
            // The slowest rank's time, iteration by iteration.
            comm.all_reduce(&mut times, ReduceOp::Max)?;
            // The busiest rank's bytes per all-reduce.
            let ops = (counted_calls * o.parallel) as u64;
            let per_rank = [moved.sent_bytes / ops, moved.received_bytes / ops];
            let mut per_op = per_rank.map(|b| i64::try_from(b).unwrap_or(i64::MAX));
            comm.all_reduce(&mut per_op, ReduceOp::Max)?;
            let per_op = per_op.map(|b| u64::try_from(b).unwrap_or(0));
            times.sort_by(f64::total_cmp);
            let t = times[times.len() / 2];
            #[expect(clippy::cast_precision_loss, reason = "sizes far below 2^52")]
            let algbw = (size * o.parallel as u64) as f64 / t / 1e9;
            let busbw = algbw * o.collective.bus_factor(world);
            let row = Row {
                bytes: count * esize,
                count,
                algorithm,
                time_us: t * 1e6,
                algbw,
                busbw,
                wrong,
                sent_per_op: per_op[0],
                received_per_op: per_op[1],
            };
            if rank == 0 {
                println!(
                    "{:>12} {:>12} {:>6} {:>7} {:>13} {:>10.1} {:>9.3} {:>9.3} {:>7} {:>12} {:>12}",
                    row.bytes,
                    row.count,
                    T::DTYPE.name(),
                    // Broadcast and all-gather reduce nothing.
                    if o.collective.moves_bytes() {
                        "-"
                    } else {
                        o.op.name()
                    },
                    row.algorithm.name(),
                    row.time_us,
                    row.algbw,
                    row.busbw,
                    if o.check {
                        row.wrong.to_string()
                    } else {
                        "N/A".into()
                    },
                    row.sent_per_op,
                    row.received_per_op
                );
                let _ = std::io::stdout().flush();
            }
            total_wrong += wrong;
            rows.push(row);
        }
        if size >= o.max_bytes {
            break;
        }
        size = size.saturating_mul(o.factor).min(o.max_bytes);
    }
    if rank == 0
        && let Some(path) = &o.json
    {
        write_json(path, &rows, T::DTYPE, o, comm).map_err(|e| fairring::Error::Io {
            context: format!("writing {path}"),
            source: e.into(),
        })?;
    }
    if rank == 0
        && let Some(path) = &o.plot
    {
        plot_rows(comm, path, &rows, o)?;
    }
    Ok(total_wrong)
}

/// The gradient list of `--gradients N`: sizes in elements of f32, from 1 KiB to
/// `max` bytes, log-uniform.
pub(crate) fn gradient_sizes(n: usize, max: u64) -> Vec<usize> {
    #[expect(clippy::cast_precision_loss, reason = "a size below 2^53")]
    let span = (max.max(1024) as f64 / 1024.0).log2();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            #[expect(clippy::cast_precision_loss, reason = "a 53-bit fraction")]
            let u = (x >> 11) as f64 / (1u64 << 53) as f64;
            #[expect(clippy::cast_possible_truncation, reason = "at most `max`")]
            let bytes = 2f64.powf(10.0 + span * u) as usize;
            (bytes / 4).max(1)
        })
        .collect()
}

/// `--gradients N`: the list fused and one all-reduce per tensor, in turns.
pub(crate) fn gradients(comm: &Communicator, o: &Options) -> fairring::Result<u64> {
    let sizes = gradient_sizes(o.gradients, o.gradient_max);
    let total: usize = sizes.iter().sum::<usize>() * 4;
    let rank = comm.rank();
    let world = comm.world_size();
    let mut tensors: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![1.0; n]).collect();
    let ways = ["fused", "per-tensor"];
    let run = |tensors: &mut Vec<Vec<f32>>, way: usize| -> fairring::Result<()> {
        let mut views: Vec<&mut [f32]> = tensors.iter_mut().map(Vec::as_mut_slice).collect();
        if way == 0 {
            comm.all_reduce_fused(&mut views, ReduceOp::Avg)
        } else {
            comm.scope(|s| s.all_reduce_coalesced(views, ReduceOp::Avg)?.wait())
        }
    };
    let mut wrong = 0u64;
    for way in 0..ways.len() {
        for _ in 0..o.warmup.max(1) {
            run(&mut tensors, way)?;
        }
        wrong += tensors.iter().flatten().filter(|&&v| v != 1.0).count() as u64;
    }
    let mut timings = vec![vec![0f64; o.iters]; ways.len()];
    let rounds = ROUNDS.min(o.iters);
    for round in 0..rounds {
        let iters = (round * o.iters / rounds)..((round + 1) * o.iters / rounds);
        let mut order: Vec<usize> = (0..ways.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for way in order {
            for i in iters.clone() {
                if o.barrier {
                    comm.barrier()?;
                }
                let start = Instant::now();
                run(&mut tensors, way)?;
                timings[way][i] = start.elapsed().as_secs_f64();
            }
        }
    }
    if rank == 0 {
        println!(
            "# fairring-bench: {} machines x {} ranks, {} servers: {} f32 tensors, {total} bytes in all, {}",
            comm.topology().machines(),
            comm.topology().devices_per_machine(),
            comm.servers(),
            sizes.len(),
            timing(o)
        );
        println!(
            "{:>12} {:>12} {:>10} {:>9} {:>9}",
            "way", "bytes", "time(us)", "algbw", "busbw"
        );
    }
    let mut medians = Vec::new();
    for (way, mut times) in timings.into_iter().enumerate() {
        comm.all_reduce(&mut times, ReduceOp::Max)?;
        times.sort_by(f64::total_cmp);
        let t = times[times.len() / 2];
        #[expect(clippy::cast_precision_loss, reason = "sizes far below 2^52")]
        let algbw = total as f64 / t / 1e9;
        let busbw = algbw * 2.0 * f64::from(world - 1) / f64::from(world);
        medians.push(t);
        if rank == 0 {
            println!(
                "{:>12} {total:>12} {:>10.1} {algbw:>9.3} {busbw:>9.3}",
                ways[way],
                t * 1e6
            );
        }
    }
    if rank == 0 {
        println!("# fused / per-tensor time: {:.3}", medians[0] / medians[1]);
    }
    Ok(wrong)
}

pub(crate) fn iteration<T: Value>(
    comm: &Communicator,
    o: &Options,
    bufs: &mut [Vec<T>],
    parts: &mut [Vec<T>],
    n: usize,
    algorithm: Algorithm,
) -> fairring::Result<()> {
    if o.collective == Timed::SendRecv {
        return ping_pong(comm, bufs, n);
    }
    if o.collective == Timed::AllToAll {
        return all_to_all(comm, bufs, parts, n);
    }
    let k = n / comm.world_size() as usize;
    comm.scope(|s| {
        let mut works = Vec::with_capacity(bufs.len());
        let mut parts = parts.iter_mut();
        for b in bufs.iter_mut() {
            let b = &mut b[..n];
            works.push(match o.collective {
                Timed::AllReduce => s.all_reduce(b, o.op, algorithm)?,
                Timed::Broadcast => s.broadcast(b, 0, algorithm)?,
                Timed::AllGather => {
                    let p = parts.next().map_or(&[][..], |p| &p[..k]);
                    s.all_gather(p, b, algorithm)?
                }
                Timed::ReduceScatter => {
                    let p = parts.next().map(|p| &mut p[..k]).unwrap_or_default();
                    s.reduce_scatter(b, p, o.op, algorithm)?
                }
                Timed::Reduce => {
                    let p = parts.next().map(|p| &mut p[..n]).unwrap_or_default();
                    s.reduce(b, p, o.op, 0, algorithm)?
                }
                Timed::Gather => {
                    let p = parts.next().map_or(&[][..], |p| &p[..k]);
                    s.gather(p, b, 0, algorithm)?
                }
                Timed::Scatter => {
                    let p = parts.next().map(|p| &mut p[..k]).unwrap_or_default();
                    s.scatter(b, p, 0, algorithm)?
                }
                // Timed by `ping_pong` and `all_to_all` above: messages are
                // not collectives of the engine.
                Timed::SendRecv | Timed::AllToAll => {
                    return Err(fairring::Error::InvalidArgument {
                        argument: "--collective",
                        reason: "send_recv is timed as a ping-pong".into(),
                    });
                }
            });
        }
        works.into_iter().try_for_each(fairring::Work::wait)
    })
}

/// One round trip of `--collective send_recv`: the even rank of each pair
/// sends every buffer and receives it back; the odd rank receives and
/// returns it. An odd last rank has no partner and idles.
fn ping_pong<T: Value>(comm: &Communicator, bufs: &mut [Vec<T>], n: usize) -> fairring::Result<()> {
    let rank = comm.rank();
    let partner = rank ^ 1;
    if partner >= comm.world_size() {
        return Ok(());
    }
    let mut messages: Vec<(u32, &mut [T])> =
        bufs.iter_mut().map(|b| (partner, &mut b[..n])).collect();
    if rank.is_multiple_of(2) {
        comm.send_recv(&mut messages, &mut [])?;
        comm.send_recv(&mut [], &mut messages)
    } else {
        comm.send_recv(&mut [], &mut messages)?;
        comm.send_recv(&mut messages, &mut [])
    }
}

/// One all-to-all per buffer, all in flight at once: block `j` of each
/// buffer to rank `j`, into the buffer's part.
fn all_to_all<T: Value>(
    comm: &Communicator,
    bufs: &mut [Vec<T>],
    parts: &mut [Vec<T>],
    n: usize,
) -> fairring::Result<()> {
    let world = comm.world_size() as usize;
    let counts = vec![(n / world) as u64; world];
    let mut messages = Vec::with_capacity(bufs.len());
    for (b, p) in bufs.iter_mut().zip(parts.iter_mut()) {
        let (input, output) = (b[..n].as_mut_ptr().cast(), p[..n].as_mut_ptr().cast());
        // SAFETY: every buffer and part holds at least `n` elements, they are
        // apart, and both are borrowed mutably until the messages have
        // finished (waited below, or dropped, which waits).
        messages.push(unsafe { comm.post_all_to_all(input, &counts, output, &counts, T::DTYPE) }?);
    }
    messages.into_iter().try_for_each(fairring::Work::wait)
}

/// How the table's calls were timed, for its header.
fn timing(o: &Options) -> &'static str {
    if o.barrier {
        "a barrier before each timed call"
    } else {
        "calls timed back to back"
    }
}
