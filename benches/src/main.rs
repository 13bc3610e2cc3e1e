//! `fairring-bench`: an nccl-tests-style all-reduce benchmark.
//!
//! ```text
//! fairring-bench [--local MxD] [--min-bytes N] [--max-bytes N] [--factor F]
//!                [--iters N] [--warmup N] [--algo auto|hierarchical|ring|doubling|all]
//!                [--collective all_reduce|broadcast|all_gather|reduce_scatter]
//!                [--wire exact|bf16|f16] [--device host|cuda]
//!                [--dtype f32|f64|f16|bf16|i32|i64|u8|i8] [--op sum|prod|min|max|avg]
//!                [--check|--no-check] [--parallel N] [--servers K] [--json PATH]
//!                [--plot PATH]
//! fairring-bench model ...   (the scale model: see `model_command.rs`)
//! ```
//!
//! With `--local MxD` (the default, `2x2`, when no torchrun environment is set) it
//! launches `M*D` copies of itself on this host as `M` simulated machines of `D`
//! ranks; with a torchrun environment and no `--local` it joins that job. Rank 0
//! prints one row per size and algorithm:
//!
//! - `time`: median over iterations of the slowest rank's time for one iteration
//!   (one iteration is `--parallel` all-reduces in flight at once);
//! - `algbw` = bytes x parallel / time; `busbw` = algbw x 2(n-1)/n for an
//!   all-reduce, algbw for a broadcast, algbw x (n-1)/n for an all-gather and a
//!   reduce-scatter (nccl-tests' factors; `size` is the buffer a rank ends with
//!   for an all-gather and starts with for a reduce-scatter);
//! - `#wrong`: elements that differ from the exactly known result, summed over
//!   ranks (inputs are small integers, so every order of summation is exact);
//! - `sent/op`, `recv/op`: data bytes the busiest rank's fabric wrote and
//!   received per all-reduce, counted by the fabric over the timed iterations.
//!
//! `--collective` times a broadcast (from rank 0), an all-gather or a
//! reduce-scatter instead of an all-reduce, checked the same way. They take
//! `--algo` too: `ring` relays a broadcast or an all-gather around the ring
//! and runs a reduce-scatter as the ring's reduce-scatter half; `hierarchical`
//! and `doubling` run them as all-reduces.
//!
//! `--wire bf16|f16` carries the `f32` values of all-reduces and
//! reduce-scatters between machines in that format (`FAIRRING_WIRE`; it
//! overrides the variable). The inputs stay exact on it (sums up to 256 for
//! bf16), so `#wrong` still checks every element bit for bit; `sent/op` shows
//! the halved bytes.
//!
//! `--gradients N` instead times an all-reduce of a DDP-like gradient list, `N`
//! f32 tensors of 1 KiB to `--gradient-max` (4 MiB; log-uniform, the same on every
//! run), fused into
//! full buffers (`Communicator::all_reduce_coalesced`) and as one all-reduce per
//! tensor, in turns; one row per way.
//!
//! `--device cuda` runs the collective on tensors in GPU memory (each rank on GPU
//! `LOCAL_RANK % visible devices`; with one GPU every rank shares it), ordered on
//! a stream of the rank's; the host fills and checks them outside the timed
//! iterations, and a timed iteration ends when the host sees every operation
//! complete. With several ranks per machine (`--local 1x2`), the machine's step
//! is staged through its shared segment.
//!
//! `--servers K` runs the job with `K` dedicated reduction servers
//! (`FAIRRING_SERVERS`); a local job launches them too, as processes of this
//! program, and each prints its own bytes when the job ends.
//!
//! `--plot PATH` writes busbw against size, one line per algorithm, to `PATH.svg`
//! and `PATH.png`.
//!
//! The launcher exits non-zero if any rank fails (with that rank's error) or any
//! element is wrong.

mod device_tensors;
mod model_command;

use std::io::Write;
use std::process::{Child, Command, ExitCode};
use std::time::{Duration, Instant};

use fairring::core::reduce::Element;
use fairring::{Algorithm, Communicator, Config, DataType, ReduceOp, WireFormat};
use half::{bf16, f16};

/// Blocks of iterations the algorithms of one size take turns in.
const ROUNDS: usize = 5;

const CHILD_VAR: &str = "FAIRRING_BENCH_CHILD";

#[derive(Clone, Debug)]
struct Options {
    local: Option<(u32, u32)>,
    min_bytes: u64,
    max_bytes: u64,
    factor: u64,
    iters: usize,
    warmup: usize,
    algorithms: Vec<Algorithm>,
    dtype: DataType,
    op: ReduceOp,
    check: bool,
    parallel: usize,
    json: Option<String>,
    plot: Option<String>,
    servers: u32,
    gradients: usize,
    gradient_max: u64,
    collective: Collective,
    /// `--wire`: the wire format, over `FAIRRING_WIRE`.
    wire: Option<WireFormat>,
    /// `--device cuda`: tensors in GPU memory.
    device: bool,
}

/// What `--collective` times.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Collective {
    AllReduce,
    Broadcast,
    AllGather,
    ReduceScatter,
}

impl Collective {
    const ALL: [Collective; 4] = [
        Collective::AllReduce,
        Collective::Broadcast,
        Collective::AllGather,
        Collective::ReduceScatter,
    ];

    fn name(self) -> &'static str {
        match self {
            Collective::AllReduce => "all_reduce",
            Collective::Broadcast => "broadcast",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter => "reduce_scatter",
        }
    }

    /// nccl-tests' factor from algbw to busbw for `n` ranks.
    fn bus_factor(self, n: u32) -> f64 {
        let n = f64::from(n);
        match self {
            Collective::AllReduce => 2.0 * (n - 1.0) / n,
            Collective::Broadcast => 1.0,
            Collective::AllGather | Collective::ReduceScatter => (n - 1.0) / n,
        }
    }

    /// Whether the size's element count must divide among the ranks.
    fn per_rank(self) -> bool {
        matches!(self, Collective::AllGather | Collective::ReduceScatter)
    }
}

fn usage(error: &str) -> ! {
    eprintln!("fairring-bench: {error}");
    eprintln!(
        "usage: fairring-bench [--local MxD] [--min-bytes N] [--max-bytes N] [--factor F] \
         [--iters N] [--warmup N] [--algo auto|hierarchical|ring|doubling|all] \
         [--collective all_reduce|broadcast|all_gather|reduce_scatter] \
         [--wire exact|bf16|f16] [--device host|cuda] [--dtype T] [--op OP] [--check|--no-check] [--parallel N] [--servers K] [--gradients N] \
         [--gradient-max N] [--json PATH] \
         [--plot PATH]\n       \
         fairring-bench model --help"
    );
    std::process::exit(2)
}

fn bytes(text: &str, flag: &str) -> u64 {
    let t = text.trim();
    let digits = t.bytes().take_while(u8::is_ascii_digit).count();
    let (n, suffix) = t.split_at(digits);
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" => 0,
        "k" | "kib" => 10,
        "m" | "mib" => 20,
        "g" | "gib" => 30,
        _ => usage(&format!(
            "{flag}: expected a byte count like 4096, 64K or 256M, got {text:?}"
        )),
    };
    n.parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(1 << shift))
        .unwrap_or_else(|| usage(&format!("{flag}: expected a byte count, got {text:?}")))
}

fn number<T: std::str::FromStr>(text: &str, flag: &str) -> T {
    text.parse()
        .unwrap_or_else(|_| usage(&format!("{flag}: expected a number, got {text:?}")))
}

fn parse(args: &[String]) -> Options {
    let mut o = Options {
        local: None,
        min_bytes: 4 << 10,
        max_bytes: 64 << 20,
        factor: 4,
        iters: 20,
        warmup: 5,
        algorithms: vec![Algorithm::Auto],
        dtype: DataType::F32,
        op: ReduceOp::Sum,
        check: true,
        parallel: 1,
        json: None,
        plot: None,
        servers: 0,
        gradients: 0,
        gradient_max: 4 << 20,
        collective: Collective::AllReduce,
        wire: None,
        device: false,
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .unwrap_or_else(|| usage(&format!("{flag} needs a value")))
        };
        match flag.as_str() {
            "--local" => {
                let v = value();
                let (m, d) = v
                    .split_once('x')
                    .unwrap_or_else(|| usage(&format!("--local: expected MxD, got {v:?}")));
                let (m, d): (u32, u32) = (number(m, "--local"), number(d, "--local"));
                if m == 0 || d == 0 || m * d > 256 {
                    usage("--local: M and D must be positive, M*D at most 256");
                }
                o.local = Some((m, d));
            }
            "--min-bytes" => o.min_bytes = bytes(&value(), flag),
            "--max-bytes" => o.max_bytes = bytes(&value(), flag),
            "--factor" => o.factor = number(&value(), flag),
            "--iters" => o.iters = number(&value(), flag),
            "--warmup" => o.warmup = number(&value(), flag),
            "--algo" => {
                let v = value();
                o.algorithms = match v.as_str() {
                    "all" => Algorithm::ALL.to_vec(),
                    other => vec![
                        other
                            .parse()
                            .unwrap_or_else(|e| usage(&format!("--algo: {e}"))),
                    ],
                }
            }
            "--dtype" => {
                let v = value();
                o.dtype = DataType::ALL
                    .iter()
                    .copied()
                    .find(|d| d.name() == v)
                    .unwrap_or_else(|| usage(&format!("--dtype: unknown type {v:?}")));
            }
            "--op" => {
                let v = value();
                o.op = match v.as_str() {
                    "sum" => ReduceOp::Sum,
                    "prod" | "product" => ReduceOp::Product,
                    "min" => ReduceOp::Min,
                    "max" => ReduceOp::Max,
                    "avg" => ReduceOp::Avg,
                    _ => usage(&format!("--op: unknown operator {v:?}")),
                }
            }
            "--check" => o.check = true,
            "--no-check" => o.check = false,
            "--parallel" => o.parallel = number(&value(), flag),
            "--json" => o.json = Some(value()),
            "--plot" => o.plot = Some(value()),
            "--servers" => o.servers = number(&value(), flag),
            "--gradients" => o.gradients = number(&value(), flag),
            "--gradient-max" => o.gradient_max = bytes(&value(), flag),
            "--collective" => {
                let v = value();
                o.collective = Collective::ALL
                    .into_iter()
                    .find(|c| c.name() == v)
                    .unwrap_or_else(|| {
                        usage(&format!(
                            "--collective: expected all_reduce, broadcast, all_gather or \
                             reduce_scatter, got {v:?}"
                        ))
                    });
            }
            "--wire" => {
                let v = value();
                o.wire = Some(WireFormat::from_name(&v).unwrap_or_else(|| {
                    usage(&format!("--wire: expected exact, bf16 or f16, got {v:?}"))
                }));
            }
            "--device" => {
                o.device = match value().as_str() {
                    "host" => false,
                    "cuda" => true,
                    v => usage(&format!("--device: expected host or cuda, got {v:?}")),
                }
            }
            "-h" | "--help" => usage("help"),
            other => usage(&format!("unknown option {other:?}")),
        }
    }
    if o.factor < 2 {
        usage("--factor must be at least 2");
    }
    if o.iters == 0 || o.parallel == 0 {
        usage("--iters and --parallel must be positive");
    }
    if o.min_bytes > o.max_bytes {
        usage("--min-bytes is above --max-bytes");
    }
    if !o.op.supports(o.dtype) {
        usage(&format!("--op {} is not defined on {}", o.op, o.dtype));
    }
    if let Some(wire) = o.wire
        && !wire.carries(o.dtype)
    {
        usage(&format!(
            "--wire {wire} carries f32 values only, not --dtype {}",
            o.dtype
        ));
    }
    if o.collective != Collective::AllReduce && o.gradients > 0 {
        usage("--gradients times all-reduces: it takes no --collective");
    }
    o
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("model") {
        return model_command::main(&args[1..]);
    }
    let options = parse(&args);
    if std::env::var_os(CHILD_VAR).is_some() {
        if std::env::var("FAIRRING_ROLE").as_deref() == Ok("server") {
            return server();
        }
        return worker(&options);
    }
    match options.local {
        Some(layout) => launch(layout, &args),
        None if std::env::var_os("RANK").is_some() => worker(&options),
        None => launch((2, 2), &args),
    }
}

/// Starts `m*d` ranks of this program on this host and waits for them.
fn launch((m, d): (u32, u32), args: &[String]) -> ExitCode {
    let exe =
        std::env::current_exe().unwrap_or_else(|e| usage(&format!("cannot find myself: {e}")));
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| usage(&format!("no free port: {e}")));
    let mut secret = [0u8; 32];
    if let Err(e) = getrandom::fill(&mut secret) {
        usage(&format!("no random source: {e}"));
    }
    let secret: String = secret.iter().map(|b| format!("{b:02x}")).collect();
    let world = m * d;
    let servers = parse(args).servers;
    let mut children: Vec<(u32, Child)> = Vec::new();
    for rank in 0..world + servers {
        let mut command = Command::new(&exe);
        if rank >= world {
            command
                .env("FAIRRING_ROLE", "server")
                .env("FAIRRING_SERVER_RANK", (rank - world).to_string());
        }
        let spawned = command
            .args(args)
            .env(CHILD_VAR, "1")
            .env("FAIRRING_SERVERS", servers.to_string())
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_RANK", (rank % d).to_string())
            .env("LOCAL_WORLD_SIZE", d.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env(
                "FAIRRING_HOST_ID",
                format!("fairring-bench-machine-{}", rank / d),
            )
            .env("FAIRRING_JOB_SECRET", &secret)
            .spawn();
        match spawned {
            Ok(c) => children.push((rank, c)),
            Err(e) => {
                eprintln!("fairring-bench: starting rank {rank}: {e}");
                kill_all(&mut children);
                return ExitCode::FAILURE;
            }
        }
    }
    let mut result = ExitCode::SUCCESS;
    let mut pending: Vec<(u32, Child)> = children;
    while !pending.is_empty() {
        let mut still = Vec::new();
        for (rank, mut c) in pending {
            match c.try_wait() {
                Ok(Some(status)) if status.success() => {}
                Ok(Some(status)) => {
                    eprintln!("fairring-bench: rank {rank} failed ({status})");
                    result = ExitCode::FAILURE;
                }
                Ok(None) => still.push((rank, c)),
                Err(e) => {
                    eprintln!("fairring-bench: waiting for rank {rank}: {e}");
                    result = ExitCode::FAILURE;
                }
            }
        }
        pending = still;
        if result != ExitCode::SUCCESS {
            // The other ranks would only wait for the failed one until their timeout.
            kill_all(&mut pending);
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    result
}

fn kill_all(children: &mut Vec<(u32, Child)>) {
    for (_, c) in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
    children.clear();
}

/// A dedicated server of a local job: serves, then prints its bytes.
fn server() -> ExitCode {
    let served = fairring::Server::from_env().and_then(|s| {
        let index = s.index();
        s.run().map(|t| (index, t))
    });
    match served {
        Ok((index, t)) => {
            eprintln!(
                "# fairring-bench: server {index} sent {} and received {} data bytes in all",
                t.sent_bytes, t.received_bytes
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("fairring-bench: server: {e}");
            ExitCode::FAILURE
        }
    }
}

fn worker(options: &Options) -> ExitCode {
    let rank = std::env::var("RANK").unwrap_or_default();
    match run(options) {
        Ok(0) => ExitCode::SUCCESS,
        Ok(wrong) => {
            if rank == "0" {
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
struct Row {
    bytes: u64,
    count: u64,
    algorithm: Algorithm,
    time_us: f64,
    algbw: f64,
    busbw: f64,
    wrong: u64,
    /// Data bytes the busiest rank's fabric wrote, and received, per all-reduce.
    sent_per_op: u64,
    received_per_op: u64,
}

fn run(o: &Options) -> fairring::Result<u64> {
    let config = Config::from_lookup(|k| match (k, o.wire) {
        ("FAIRRING_WIRE", Some(wire)) => Some(wire.name().to_owned()),
        _ => std::env::var(k).ok(),
    })?;
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
    dispatch!(F32 => f32, F64 => f64, F16 => f16, BF16 => bf16, I32 => i32, I64 => i64, U8 => u8, I8 => i8)
}

/// Element types the benchmark can fill and check.
trait Value: Element + Copy + PartialEq + Default + Send {
    fn from_small(v: i64) -> Self;
}

macro_rules! value_int {
    ($($t:ty),*) => {$(
        impl Value for $t {
            #[allow(clippy::cast_possible_truncation, reason = "wrapping, as the reduction")]
            fn from_small(v: i64) -> Self { v as $t }
        }
    )*};
}
value_int!(i32, i64, u8, i8);

impl Value for f32 {
    #[expect(clippy::cast_precision_loss, reason = "small integers are exact")]
    fn from_small(v: i64) -> Self {
        v as f32
    }
}
impl Value for f64 {
    #[expect(clippy::cast_precision_loss, reason = "small integers are exact")]
    fn from_small(v: i64) -> Self {
        v as f64
    }
}
impl Value for f16 {
    fn from_small(v: i64) -> Self {
        f16::from_f64(i32::try_from(v).map_or(f64::NAN, f64::from))
    }
}
impl Value for bf16 {
    fn from_small(v: i64) -> Self {
        bf16::from_f64(i32::try_from(v).map_or(f64::NAN, f64::from))
    }
}

/// Rank `rank`'s input at element `i`: 1..=4, so sums over 256 ranks stay exact
/// in every type but u8/i8 (which wrap identically on every side). For `avg`,
/// a value shared by every rank (2..=5) moved by +1 and -1 in pairs of ranks (the
/// last of an odd world keeps it), so the sum is `world` times it and the average
/// is a whole number in every type.
fn input(op: ReduceOp, rank: u32, world: u32, i: u64) -> i64 {
    let v = (u64::from(rank) * 7 + i * 3) % 4;
    #[expect(clippy::cast_possible_wrap, reason = "below 4")]
    let (v, shared) = (v as i64, ((i * 3) % 4) as i64);
    match op {
        ReduceOp::Product => 1 + v % 2,
        ReduceOp::Avg => {
            let deviation = if !world.is_multiple_of(2) && rank + 1 == world {
                0
            } else if rank.is_multiple_of(2) {
                1
            } else {
                -1
            };
            2 + shared + deviation
        }
        _ => 1 + v,
    }
}

fn expected(op: ReduceOp, world: u32, i: u64) -> i64 {
    let vals = (0..world).map(|r| input(op, r, world, i));
    match op {
        ReduceOp::Sum => vals.sum(),
        ReduceOp::Avg => vals.sum::<i64>() / i64::from(world),
        ReduceOp::Product => vals.fold(1i64, i64::wrapping_mul),
        ReduceOp::Min => vals.min().unwrap_or(0),
        ReduceOp::Max => vals.max().unwrap_or(0),
    }
}

fn sweep<T: Value>(comm: &Communicator, o: &Options) -> fairring::Result<u64> {
    let rank = comm.rank();
    let world = comm.world_size();
    let esize = T::DTYPE.size_bytes();
    let elements = usize::try_from(o.max_bytes / esize).unwrap_or(0);
    let mut bufs: Vec<Vec<T>> = (0..o.parallel)
        .map(|_| vec![T::default(); elements])
        .collect();
    // The other side of an all-gather (the input) or a reduce-scatter (the output).
    let mut parts: Vec<Vec<T>> = if o.collective.per_rank() {
        (0..o.parallel)
            .map(|_| vec![T::default(); elements / world as usize + 1])
            .collect()
    } else {
        Vec::new()
    };
    let part_elements = parts.first().map_or(0, Vec::len);
    let mut device = if o.device {
        Some(device_tensors::DeviceTensors::new(
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
            "# fairring-bench {}{}: {} machines x {} ranks, {} staging buffers of slices up to {} bytes, {} x {} in flight",
            o.collective.name(),
            if o.device { " on GPU tensors" } else { "" },
            t.machines(),
            t.devices_per_machine(),
            comm.staging_buffers(),
            comm.slice_bytes(),
            o.parallel,
            T::DTYPE
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
            for _ in 0..o.warmup {
                timed(algorithm, &mut device, &mut bufs, &mut parts)?;
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
                    let start = Instant::now();
                    timed(algorithm, &mut device, &mut bufs, &mut parts)?;
                    timings[a][i] = start.elapsed().as_secs_f64();
                }
                let after = comm.traffic();
                moved[a].sent_bytes += after.sent_bytes - before.sent_bytes;
                moved[a].received_bytes += after.received_bytes - before.received_bytes;
            }
        }
        for (((&algorithm, mut times), wrong), moved) in
            o.algorithms.iter().zip(timings).zip(wrongs).zip(moved)
        {
            // The slowest rank's time, iteration by iteration.
            comm.all_reduce(&mut times, ReduceOp::Max)?;
            // The busiest rank's bytes per all-reduce.
            let ops = (o.iters * o.parallel) as u64;
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
                    if matches!(o.collective, Collective::Broadcast | Collective::AllGather) {
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
fn gradient_sizes(n: usize, max: u64) -> Vec<usize> {
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
fn gradients(comm: &Communicator, o: &Options) -> fairring::Result<u64> {
    let sizes = gradient_sizes(o.gradients, o.gradient_max);
    let total: usize = sizes.iter().sum::<usize>() * 4;
    let rank = comm.rank();
    let world = comm.world_size();
    let mut tensors: Vec<Vec<f32>> = sizes.iter().map(|&n| vec![1.0; n]).collect();
    let ways = ["fused", "per-tensor"];
    let run = |tensors: &mut Vec<Vec<f32>>, way: usize| -> fairring::Result<()> {
        let mut views: Vec<&mut [f32]> = tensors.iter_mut().map(Vec::as_mut_slice).collect();
        if way == 0 {
            comm.all_reduce_coalesced(&mut views, ReduceOp::Avg)
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
                let start = Instant::now();
                run(&mut tensors, way)?;
                timings[way][i] = start.elapsed().as_secs_f64();
            }
        }
    }
    if rank == 0 {
        println!(
            "# fairring-bench: {} machines x {} ranks, {} servers: {} f32 tensors, {total} bytes in all",
            comm.topology().machines(),
            comm.topology().devices_per_machine(),
            comm.servers(),
            sizes.len()
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

/// Fills the buffers with every rank's known inputs for `o.collective`.
fn fill<T: Value>(
    o: &Options,
    rank: u32,
    bufs: &mut [Vec<T>],
    parts: &mut [Vec<T>],
    n: usize,
    world: u32,
) {
    let k = n / world as usize;
    for (b, p) in bufs.iter_mut().zip(
        parts
            .iter_mut()
            .map(Some)
            .chain(std::iter::repeat_with(|| None)),
    ) {
        match (o.collective, p) {
            (Collective::AllGather, Some(p)) => {
                for (i, v) in p[..k].iter_mut().enumerate() {
                    *v = T::from_small(input(o.op, rank, world, i as u64));
                }
            }
            _ => {
                for (i, v) in b[..n].iter_mut().enumerate() {
                    *v = T::from_small(input(o.op, rank, world, i as u64));
                }
            }
        }
    }
}

/// Elements that differ from the exactly known result, summed over ranks.
fn count_wrong<T: Value>(
    o: &Options,
    rank: u32,
    bufs: &[Vec<T>],
    parts: &[Vec<T>],
    n: usize,
    world: u32,
) -> u64 {
    let k = n / world as usize;
    let mut wrong = 0u64;
    for (j, b) in bufs.iter().enumerate() {
        let (got, want): (&[T], Box<dyn Fn(usize) -> i64>) = match o.collective {
            Collective::AllReduce => (&b[..n], Box::new(|i| expected(o.op, world, i as u64))),
            Collective::Broadcast => (&b[..n], Box::new(|i| input(o.op, 0, world, i as u64))),
            Collective::AllGather => (
                &b[..n],
                Box::new(|i| {
                    let (r, at) = (i / k.max(1), i % k.max(1));
                    input(o.op, u32::try_from(r).unwrap_or(0), world, at as u64)
                }),
            ),
            Collective::ReduceScatter => (
                &parts[j][..k],
                Box::new(move |i| expected(o.op, world, (rank as usize * k + i) as u64)),
            ),
        };
        wrong += got
            .iter()
            .enumerate()
            .filter(|&(i, v)| *v != T::from_small(want(i)))
            .count() as u64;
    }
    wrong
}

fn iteration<T: Value>(
    comm: &Communicator,
    o: &Options,
    bufs: &mut [Vec<T>],
    parts: &mut [Vec<T>],
    n: usize,
    algorithm: Algorithm,
) -> fairring::Result<()> {
    let k = n / comm.world_size() as usize;
    comm.scope(|s| {
        let mut works = Vec::with_capacity(bufs.len());
        let mut parts = parts.iter_mut();
        for b in bufs.iter_mut() {
            let b = &mut b[..n];
            works.push(match o.collective {
                Collective::AllReduce => s.all_reduce_with(b, o.op, algorithm)?,
                Collective::Broadcast => s.broadcast_with(b, 0, algorithm)?,
                Collective::AllGather => {
                    let p = parts.next().map_or(&[][..], |p| &p[..k]);
                    s.all_gather_with(p, b, algorithm)?
                }
                Collective::ReduceScatter => {
                    let p = parts.next().map(|p| &mut p[..k]).unwrap_or_default();
                    s.reduce_scatter_with(b, p, o.op, algorithm)?
                }
            });
        }
        works.into_iter().try_for_each(fairring::Work::wait)
    })
}

fn write_json(
    path: &str,
    rows: &[Row],
    dtype: DataType,
    o: &Options,
    comm: &Communicator,
) -> std::io::Result<()> {
    let t = comm.topology();
    let (machines, devices, servers) = (t.machines(), t.devices_per_machine(), comm.servers());
    // Only f32 values travel compressed; every other type runs exact.
    let wire = if dtype == DataType::F32 {
        comm.wire()
    } else {
        WireFormat::Exact
    };
    let rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "machines": machines,
                "devices": devices,
                "servers": servers,
                "bytes": r.bytes,
                "count": r.count,
                "collective": o.collective.name(),
                "device": if o.device { "cuda" } else { "host" },
                "wire": wire.name(),
                "dtype": dtype.name(),
                "op": o.op.name(),
                "algo": r.algorithm.name(),
                "time_us": r.time_us,
                "algbw_gbps": r.algbw,
                "busbw_gbps": r.busbw,
                "wrong": r.wrong,
                "sent_bytes_per_op": r.sent_per_op,
                "received_bytes_per_op": r.received_per_op,
            })
        })
        .collect();
    let text = serde_json::to_string_pretty(&rows).map_err(std::io::Error::other)?;
    std::fs::write(path, text + "\n")
}

/// Busbw against size, one line per algorithm.
fn plot_rows(comm: &Communicator, path: &str, rows: &[Row], o: &Options) -> fairring::Result<()> {
    let t = comm.topology();
    #[expect(clippy::cast_precision_loss, reason = "sizes far below 2^52")]
    let series = o
        .algorithms
        .iter()
        .map(|&a| fairring_bench::plot::Series {
            label: a.name().to_owned(),
            points: rows
                .iter()
                .filter(|r| r.algorithm == a)
                .map(|r| (r.bytes as f64, r.busbw))
                .collect(),
        })
        .collect();
    let chart = fairring_bench::plot::Chart {
        title: format!(
            "fairring-bench: {} machines x {} ranks, {} {}",
            t.machines(),
            t.devices_per_machine(),
            o.dtype,
            o.op
        ),
        x_axis: fairring_bench::plot::Axis::Bytes,
        x_label: "tensor size".into(),
        y_label: "busbw (GB/s)".into(),
        series,
    };
    let files = fairring_bench::plot::write(&chart, std::path::Path::new(path)).map_err(|e| {
        fairring::Error::Io {
            context: format!("--plot {path}"),
            source: std::io::Error::other(e).into(),
        }
    })?;
    for f in files {
        println!("# wrote {}", f.display());
    }
    Ok(())
}
