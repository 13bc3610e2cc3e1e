//! The command line: what `fairring-bench` is asked to run.

use super::*;

#[derive(Clone, Debug)]
pub(crate) struct Options {
    pub(crate) local: Option<(u32, u32)>,
    pub(crate) min_bytes: u64,
    pub(crate) max_bytes: u64,
    pub(crate) factor: u64,
    pub(crate) iters: usize,
    pub(crate) warmup: usize,
    pub(crate) algorithms: Vec<Algorithm>,
    pub(crate) dtype: DataType,
    pub(crate) op: ReduceOp,
    pub(crate) check: bool,
    /// `--barrier` (the default): a barrier before each timed call, as the
    /// peers' benches time theirs (the traffic columns then come from the
    /// warm-up, at least one call); `--no-barrier` times calls back to back.
    pub(crate) barrier: bool,
    pub(crate) parallel: usize,
    pub(crate) json: Option<String>,
    pub(crate) plot: Option<String>,
    pub(crate) servers: u32,
    pub(crate) gradients: usize,
    pub(crate) gradient_max: u64,
    pub(crate) collective: Timed,
    /// `--wire`: the wire format, over `FAIRRING_WIRE`.
    pub(crate) wire: Option<WireFormat>,
    /// `--device cuda`: tensors in GPU memory.
    pub(crate) device: bool,
}

/// The collective `--collective` times (a barrier is not timed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Timed {
    AllReduce,
    Broadcast,
    AllGather,
    ReduceScatter,
    /// To rank 0.
    Reduce,
    /// To rank 0.
    Gather,
    /// From rank 0.
    Scatter,
    /// A ping-pong between the ranks of each pair (0 and 1, 2 and 3, ...):
    /// the even rank sends, the odd one sends it back; timed one way (half
    /// the round trip).
    SendRecv,
    /// Block `j` of every rank's buffer to rank `j`, equal blocks.
    AllToAll,
}

impl Timed {
    const ALL: [Timed; 9] = [
        Timed::AllReduce,
        Timed::Broadcast,
        Timed::AllGather,
        Timed::ReduceScatter,
        Timed::Reduce,
        Timed::Gather,
        Timed::Scatter,
        Timed::SendRecv,
        Timed::AllToAll,
    ];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Timed::AllReduce => "all_reduce",
            Timed::Broadcast => "broadcast",
            Timed::AllGather => "all_gather",
            Timed::ReduceScatter => "reduce_scatter",
            Timed::Reduce => "reduce",
            Timed::Gather => "gather",
            Timed::Scatter => "scatter",
            Timed::SendRecv => "send_recv",
            Timed::AllToAll => "all_to_all",
        }
    }

    /// nccl-tests' factor from algbw to busbw for `n` ranks.
    pub(crate) fn bus_factor(self, n: u32) -> f64 {
        let n = f64::from(n);
        match self {
            Timed::AllReduce => 2.0 * (n - 1.0) / n,
            Timed::Broadcast | Timed::Reduce | Timed::SendRecv => 1.0,
            Timed::AllGather
            | Timed::ReduceScatter
            | Timed::Gather
            | Timed::Scatter
            | Timed::AllToAll => (n - 1.0) / n,
        }
    }

    /// Times an iteration covers the size one way: two for a ping-pong's
    /// round trip, one otherwise.
    pub(crate) fn legs(self) -> f64 {
        if self == Timed::SendRecv { 2.0 } else { 1.0 }
    }

    /// Whether the size's element count must divide among the ranks.
    pub(crate) fn per_rank(self) -> bool {
        matches!(
            self,
            Timed::AllGather
                | Timed::ReduceScatter
                | Timed::Gather
                | Timed::Scatter
                | Timed::AllToAll
        )
    }

    /// Whether it moves bytes only (no operator applies).
    pub(crate) fn moves_bytes(self) -> bool {
        matches!(
            self,
            Timed::Broadcast
                | Timed::AllGather
                | Timed::Gather
                | Timed::Scatter
                | Timed::SendRecv
                | Timed::AllToAll
        )
    }
}

pub(crate) fn usage(error: &str) -> ! {
    eprintln!("fairring-bench: {error}");
    eprintln!(
        "usage: fairring-bench [--local MxD] [--min-bytes N] [--max-bytes N] [--factor F] \
         [--iters N] [--warmup N] [--algo auto|hierarchical|ring|doubling|all] \
         [--collective all_reduce|broadcast|all_gather|reduce_scatter|reduce|gather|scatter|send_recv|all_to_all] \
         [--wire exact|bf16|f16] [--device host|cuda] [--dtype T] [--op OP] [--check|--no-check] [--barrier|--no-barrier] [--parallel N] [--servers K] [--gradients N] \
         [--gradient-max N] [--json PATH] \
         [--plot PATH]\n       \
         fairring-bench model --help"
    );
    std::process::exit(2)
}

pub(crate) fn bytes(text: &str, flag: &str) -> u64 {
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

pub(crate) fn number<T: std::str::FromStr>(text: &str, flag: &str) -> T {
    text.parse()
        .unwrap_or_else(|_| usage(&format!("{flag}: expected a number, got {text:?}")))
}

pub(crate) fn parse(args: &[String]) -> Options {
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
        barrier: true,
        parallel: 1,
        json: None,
        plot: None,
        servers: 0,
        gradients: 0,
        gradient_max: 4 << 20,
        collective: Timed::AllReduce,
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
                    "prod" => ReduceOp::Product,
                    name => ReduceOp::from_name(name)
                        .unwrap_or_else(|| usage(&format!("--op: unknown operator {v:?}"))),
                }
            }
            "--check" => o.check = true,
            "--no-check" => o.check = false,
            "--barrier" => o.barrier = true,
            "--no-barrier" => o.barrier = false,
            "--parallel" => o.parallel = number(&value(), flag),
            "--json" => o.json = Some(value()),
            "--plot" => o.plot = Some(value()),
            "--servers" => o.servers = number(&value(), flag),
            "--gradients" => o.gradients = number(&value(), flag),
            "--gradient-max" => o.gradient_max = bytes(&value(), flag),
            "--collective" => {
                let v = value();
                o.collective = Timed::ALL
                    .into_iter()
                    .find(|c| c.name() == v)
                    .unwrap_or_else(|| {
                        usage(&format!(
                            "--collective: expected all_reduce, broadcast, all_gather, \
                             reduce_scatter, reduce, gather, scatter, send_recv or all_to_all, got {v:?}"
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
    if o.device
        && matches!(
            o.collective,
            Timed::Reduce | Timed::Gather | Timed::Scatter | Timed::SendRecv | Timed::AllToAll
        )
    {
        usage("--device cuda times all_reduce, broadcast, all_gather and reduce_scatter");
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
    if o.collective != Timed::AllReduce && o.gradients > 0 {
        usage("--gradients times all-reduces: it takes no --collective");
    }
    o
}
