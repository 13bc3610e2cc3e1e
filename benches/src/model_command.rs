//! `fairring-bench model`: the scale model's table, JSON and charts.
//!
//! ```text
//! fairring-bench model [--preset NAME] [--presets FILE] [--gpus N,N,...] [--devices D]
//!                      [--min-bytes N] [--max-bytes N] [--factor F]
//!                      [--algo all|NAME,NAME,...] [--tensors N] [--servers K]
//!                      [--group G] [--grouping auto|off|N] [--slice-bytes N]
//!                      [--min-shard N] [--budget N] [--original]
//!                      [--comms-per-direction 1|2]
//!                      [--plan-only] [--breakdown] [--json PATH] [--plot PATH]
//!                      [--plot-gpus N] [--plot-bytes N]
//! fairring-bench model --calibrate BENCH.json [--calibrate-algo NAME] [--preset NAME]
//! ```
//!
//! Predicts every algorithm on every GPU count (`M = N / D` machines) and size, and
//! prints one row each: predicted time, algbw, busbw, and for fairring's
//! algorithms the plan's shards per full slice (`k`), staging buffers and messages
//! the busiest rail sends, and for NCCL's rows the algorithm and protocol its
//! tuner chose (last). `--breakdown` adds where the time of fairring's
//! busiest machine went: busbw as a share of its NICs' rate (the bound between
//! machines), then the share of the time each of its resources was busy: the
//! rail's send side, the part of it beyond its bytes on the wire (posts no earlier
//! message hid), the receive
//! side, the GPU reducing, NVLink. `--plot PATH` writes `PATH-size` (busbw against size at
//! `--plot-gpus`, default the largest count) and `PATH-gpus` (busbw against GPUs
//! at `--plot-bytes`, default the largest size), each as SVG and PNG.
//! `--plan-only` runs the plan where the engine would run an all-reduce as one
//! NCCL all-reduce across the job (`FAIRRING_NCCL_ACROSS_MACHINES=off`).
//!
//! `--comms-per-direction 2` is a study the engine does not run: each
//! machine's reduce-scatters and all-gathers each take two NCCL
//! communicators in turn, slice by slice, so that one call's latency passes
//! while the other's bytes move (the engine has one a direction; where it
//! runs NCCL across the job, so does the study).
//!
//! `--grouping` groups the machines as `FAIRRING_GROUP_SIZE` does the
//! engine's, for the `hierarchical` row and fairring's `ring` (whose slices
//! follow the geometry): `auto` (the default), `off` (one level: flat, or
//! through the trees), or `N` (groups of at most `N` machines). Where the
//! engine would refuse it (a size that makes no two levels), the row says
//! so and the sweep goes on.
//!
//! `--algo groups` adds a study of the two-level plan over group sizes of its
//! own choice (the engine's is `FAIRRING_GROUP_SIZE`: two levels of reduction servers, `model::groups`; `all` leaves it out), its groups of
//! `--group G` machines (default: the study's own choice); its `k` column is
//! the largest group's size.

use std::path::Path;
use std::process::ExitCode;

use fairring_bench::model::calibrate::{BenchRow, calibrate};
use fairring_bench::model::{
    Algo, BUILTIN_PRESETS, Hardware, Job, ModelError, Prediction, parse_presets, predict, preset,
};
use fairring_bench::plot::{self, Axis, Chart, Series};
use fairring_core::plan::PlanConfig;

use crate::{bytes, number};

#[derive(Clone, Debug)]
struct Options {
    preset: String,
    presets: Option<String>,
    gpus: Vec<u64>,
    devices: Option<u32>,
    min_bytes: u64,
    max_bytes: u64,
    factor: u64,
    algos: Vec<Algo>,
    tensors: u32,
    servers: u32,
    group: u32,
    grouping: fairring::Grouping,
    /// `None`: the engine's default slices (smaller through the trees).
    slice_bytes: Option<u64>,
    /// `None`: the engine's default.
    min_shard: Option<u64>,
    /// `None`: the engine's default staging.
    budget: Option<u64>,
    comms_per_direction: u32,
    breakdown: bool,
    plan_only: bool,
    json: Option<String>,
    plot: Option<String>,
    plot_gpus: Option<u64>,
    plot_bytes: Option<u64>,
    calibrate: Option<String>,
    calibrate_algo: String,
}

fn usage(error: &str) -> ! {
    eprintln!("fairring-bench model: {error}");
    eprintln!(
        "usage: fairring-bench model [--preset NAME] [--presets FILE] [--gpus N,N,...] \
         [--devices D] [--min-bytes N] [--max-bytes N] [--factor F] [--algo all|NAME,...] \
         [--tensors N] [--servers K] [--group G] [--grouping auto|off|N] [--slice-bytes N] \
         [--min-shard N] [--budget N] [--comms-per-direction 1|2] \
         [--original] [--plan-only] [--breakdown] [--json PATH] [--plot PATH] \
         [--plot-gpus N] [--plot-bytes N]\n       \
         fairring-bench model --calibrate BENCH.json [--calibrate-algo NAME] [--preset NAME]\n\
         algorithms: {}; studies: {}",
        Algo::ALL.map(Algo::name).join(", "),
        Algo::STUDIES.map(Algo::name).join(", ")
    );
    std::process::exit(2)
}

fn parse(args: &[String]) -> Options {
    let mut o = Options {
        preset: "h100".into(),
        presets: None,
        gpus: (3..=11).map(|p| 1u64 << p).collect(),
        devices: None,
        min_bytes: 1 << 20,
        max_bytes: 1 << 30,
        factor: 4,
        algos: Algo::ALL.to_vec(),
        tensors: 1,
        servers: 0,
        group: 0,
        grouping: fairring::Grouping::Auto,
        slice_bytes: None,
        min_shard: None,
        budget: None,
        comms_per_direction: 1,
        breakdown: false,
        plan_only: false,
        json: None,
        plot: None,
        plot_gpus: None,
        plot_bytes: None,
        calibrate: None,
        calibrate_algo: "hierarchical".into(),
    };
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .cloned()
                .unwrap_or_else(|| usage(&format!("{flag} needs a value")))
        };
        match flag.as_str() {
            "--preset" => o.preset = value(),
            "--presets" => o.presets = Some(value()),
            "--gpus" => {
                o.gpus = value()
                    .split(',')
                    .map(|g| number::<u64>(g.trim(), "--gpus"))
                    .collect();
            }
            "--devices" => o.devices = Some(number(&value(), flag)),
            "--min-bytes" => o.min_bytes = bytes(&value(), flag),
            "--max-bytes" => o.max_bytes = bytes(&value(), flag),
            "--factor" => o.factor = number(&value(), flag),
            "--algo" => {
                let v = value();
                o.algos = if v == "all" {
                    Algo::ALL.to_vec()
                } else {
                    v.split(',')
                        .map(|a| {
                            Algo::from_name(a.trim()).unwrap_or_else(|| {
                                usage(&format!("--algo: unknown algorithm {a:?}"))
                            })
                        })
                        .collect()
                };
            }
            "--tensors" => o.tensors = number(&value(), flag),
            "--servers" => o.servers = number(&value(), flag),
            "--group" => o.group = number(&value(), flag),
            "--grouping" => {
                o.grouping = match value().as_str() {
                    "auto" => fairring::Grouping::Auto,
                    "off" => fairring::Grouping::OneLevel,
                    n => fairring::Grouping::AtMost(number(n, flag)),
                };
            }
            "--slice-bytes" => o.slice_bytes = Some(bytes(&value(), flag)),
            "--min-shard" => o.min_shard = Some(bytes(&value(), flag)),
            "--budget" => o.budget = Some(bytes(&value(), flag)),
            "--comms-per-direction" => {
                o.comms_per_direction = match value().as_str() {
                    "1" => 1,
                    "2" => 2,
                    other => usage(&format!(
                        "--comms-per-direction: {other:?} is not 1 (the engine's) or 2 (the study)"
                    )),
                };
            }
            "--original" => {
                o.slice_bytes = Some(PlanConfig::DEFAULT_SLICE_BYTES);
                o.min_shard = Some(PlanConfig::MIN_SHARD_FLOOR);
                o.plan_only = true;
            }
            "--breakdown" => o.breakdown = true,
            "--plan-only" => o.plan_only = true,
            "--json" => o.json = Some(value()),
            "--plot" => o.plot = Some(value()),
            "--plot-gpus" => o.plot_gpus = Some(number(&value(), flag)),
            "--plot-bytes" => o.plot_bytes = Some(bytes(&value(), flag)),
            "--calibrate" => o.calibrate = Some(value()),
            "--calibrate-algo" => o.calibrate_algo = value(),
            "-h" | "--help" => usage("help"),
            other => usage(&format!("unknown option {other:?}")),
        }
    }
    if o.factor < 2 {
        usage("--factor must be at least 2");
    }
    if o.min_bytes == 0 || o.min_bytes > o.max_bytes {
        usage("--min-bytes must be positive and at most --max-bytes");
    }
    if o.tensors == 0 {
        usage("--tensors must be at least 1");
    }
    if o.gpus.is_empty() || o.gpus.contains(&0) {
        usage("--gpus: every count must be positive");
    }
    o
}

fn hardware(o: &Options) -> Result<Hardware, ModelError> {
    let presets = match &o.presets {
        Some(path) => {
            let text = std::fs::read_to_string(path).map_err(|e| ModelError::Presets {
                source: path.clone(),
                detail: e.to_string(),
            })?;
            parse_presets(&text, path)?
        }
        None => parse_presets(BUILTIN_PRESETS, "the built-in presets")?,
    };
    preset(&presets, &o.preset)
}

/// Runs `fairring-bench model` with the arguments after `model`.
pub(crate) fn main(args: &[String]) -> ExitCode {
    let o = parse(args);
    match run(&o) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fairring-bench model: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One predicted row.
struct Row {
    gpus: u64,
    job: Job,
    prediction: Prediction,
}

fn run(o: &Options) -> Result<(), String> {
    let hw = hardware(o).map_err(|e| e.to_string())?;
    if let Some(path) = &o.calibrate {
        return calibrate_from(path, &o.calibrate_algo, &hw);
    }
    let min_shard = o.min_shard.unwrap_or(PlanConfig::DEFAULT_MIN_SHARD_BYTES);
    let slicing = match o.slice_bytes {
        Some(slice) => PlanConfig::new(slice, min_shard),
        None => PlanConfig::with_default_slices(min_shard),
    }
    .map_err(|e| e.to_string())?;
    let slices = match o.slice_bytes {
        Some(slice) => format!("slices of {slice} bytes"),
        None => format!(
            "slices of {} bytes ({} through the trees)",
            PlanConfig::DEFAULT_SLICE_BYTES,
            PlanConfig::DEFAULT_TREE_SLICE_BYTES
        ),
    };
    let budget = match o.budget {
        Some(budget) => format!("{budget} bytes of staging per GPU"),
        None => "the default staging".into(),
    };
    let devices = o.devices.unwrap_or(hw.devices_per_machine);
    println!("# fairring-bench model: {hw}");
    println!(
        "# {devices} GPUs per machine, {slices}, minimum shard {}, {budget}, \
         {} tensor(s) at once; k: shards per slot (t: through the trees), or the \
         largest group (g: in groups), bufs: staging buffers",
        match o.min_shard {
            Some(bytes) => format!("{bytes} bytes"),
            None => format!(
                "{} bytes ({} with dedicated servers)",
                PlanConfig::DEFAULT_MIN_SHARD_BYTES,
                PlanConfig::DEFAULT_SERVER_MIN_SHARD_BYTES
            ),
        },
        o.tensors
    );
    if o.comms_per_direction == 2 {
        println!(
            "# study: two NCCL communicators a direction within each machine, taken in turn by \
             slice (the engine has one)"
        );
    }
    print!(
        "{:>6} {:>5} {:>12} {:>13} {:>12} {:>9} {:>9} {:>5} {:>4} {:>9}",
        "gpus", "M", "size(B)", "algo", "time(us)", "algbw", "busbw", "k", "bufs", "msgs"
    );
    if o.breakdown {
        print!(
            " {:>5} {:>5} {:>6} {:>5} {:>5} {:>5}",
            "%nic", "send%", "alpha%", "recv%", "gpu%", "nvl%"
        );
    }
    println!(" nccl");
    let mut rows = Vec::new();
    for &gpus in &o.gpus {
        if gpus % u64::from(devices) != 0 {
            return Err(format!(
                "--gpus: {gpus} GPUs is not a whole number of machines of {devices} GPUs"
            ));
        }
        let machines = u32::try_from(gpus / u64::from(devices))
            .map_err(|_| format!("--gpus: {gpus} GPUs is too many machines"))?;
        let mut size = o.min_bytes;
        loop {
            let mut job = Job::new(machines, devices, size);
            job.tensors = o.tensors;
            job.slicing = slicing;
            job.min_shard_given = o.min_shard.is_some();
            job.budget_bytes = o.budget;
            job.servers = o.servers;
            job.group = o.group;
            job.grouping = o.grouping;
            job.comms_per_direction = o.comms_per_direction;
            job.nccl_across_machines = !o.plan_only;
            job.machines_serve = !o.plan_only;
            for &algo in &o.algos {
                let prediction = match predict(&hw, &job, algo) {
                    Ok(p) => p,
                    Err(ModelError::NotApplicable { .. }) => continue,
                    // The engine would refuse this job too (a staging buffer over
                    // the budget, say): say so and go on with the sweep.
                    Err(ModelError::Plan(e)) => {
                        println!("# {gpus} GPUs, {size} bytes, {algo}: fairring refuses: {e}");
                        continue;
                    }
                    Err(e @ ModelError::Refused(_)) => {
                        println!("# {gpus} GPUs, {size} bytes, {algo}: {e}");
                        continue;
                    }
                    Err(e) => return Err(format!("{gpus} GPUs, {size} bytes, {algo}: {e}")),
                };
                print_row(gpus, &job, &prediction, o.breakdown.then_some(&hw));
                rows.push(Row {
                    gpus,
                    job,
                    prediction,
                });
            }
            if size >= o.max_bytes {
                break;
            }
            size = size.saturating_mul(o.factor).min(o.max_bytes);
        }
    }
    if let Some(path) = &o.json {
        write_json(path, &hw, &rows).map_err(|e| format!("writing {path}: {e}"))?;
    }
    if let Some(path) = &o.plot {
        plot_rows(o, &hw, &rows, path)?;
    }
    Ok(())
}

/// One row of the table; with `breakdown`, where the time went (see the
/// module docs).
fn print_row(gpus: u64, job: &Job, p: &Prediction, breakdown: Option<&Hardware>) {
    let (k, buffers, messages) = match p.traffic {
        // A `t` marks shards that go through the trees, a `g` the largest
        // group where the slots are reduced in groups.
        Some(t) => (
            format!(
                "{}{}",
                t.shards_per_full_slice,
                if t.through_trees {
                    "t"
                } else if t.in_groups {
                    "g"
                } else {
                    ""
                }
            ),
            t.staging_buffers.to_string(),
            t.messages_sent.to_string(),
        ),
        None => ("-".into(), "-".into(), "-".into()),
    };
    print!(
        "{:>6} {:>5} {:>12} {:>13} {:>12.1} {:>9.2} {:>9.2} {:>5} {:>4} {:>9}",
        gpus,
        job.machines,
        job.bytes,
        p.algo.name(),
        p.seconds * 1e6,
        p.algbw_gbps,
        p.busbw_gbps,
        k,
        buffers,
        messages
    );
    if let Some(hw) = breakdown {
        let nic = if job.machines > 1 {
            format!("{:.0}", 100.0 * p.busbw_gbps / hw.machine_nic_gbps())
        } else {
            "-".into()
        };
        print!(" {nic:>5}");
        match p.busy {
            Some(b) => {
                let share = |busy: f64| 100.0 * busy / p.seconds;
                print!(
                    " {:>5.0} {:>6.0} {:>5.0} {:>5.0} {:>5.0}",
                    share(b.send),
                    share(b.send_alpha),
                    share(b.receive),
                    share(b.gpu),
                    share(b.nvlink)
                );
            }
            None => print!(" {:>5} {:>6} {:>5} {:>5} {:>5}", "-", "-", "-", "-", "-"),
        }
    }
    match p.nccl {
        Some(e) => println!(" {}/{}", e.algorithm.name(), e.protocol.name()),
        None => println!(" -"),
    }
}

fn write_json(path: &str, hw: &Hardware, rows: &[Row]) -> std::io::Result<()> {
    let rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            let t = r.prediction.traffic;
            serde_json::json!({
                "preset": hw.name,
                "gpus": r.gpus,
                "machines": r.job.machines,
                "devices": r.job.devices,
                "bytes": r.job.bytes,
                "tensors": r.job.tensors,
                "comms_per_direction": r.job.comms_per_direction,
                "algo": r.prediction.algo.name(),
                "time_us": r.prediction.seconds * 1e6,
                "algbw_gbps": r.prediction.algbw_gbps,
                "busbw_gbps": r.prediction.busbw_gbps,
                "shards_per_full_slice": t.map(|t| t.shards_per_full_slice),
                "routing": t.map(|t| if t.through_trees {
                    "trees"
                } else if t.in_groups {
                    "groups"
                } else {
                    "flat"
                }),
                "staging_buffers": t.map(|t| t.staging_buffers),
                "messages_sent": t.map(|t| t.messages_sent),
                "bytes_sent": t.map(|t| t.bytes_sent),
                "nccl": r.prediction.nccl.map(|e| serde_json::json!({
                    "algorithm": e.algorithm.name(),
                    "protocol": e.protocol.name(),
                    "bandwidth_gbps": e.bandwidth_gbps,
                    "latency_us": e.latency_us,
                })),
                "busy_seconds": r.prediction.busy.map(|b| serde_json::json!({
                    "send": b.send,
                    "send_alpha": b.send_alpha,
                    "receive": b.receive,
                    "gpu": b.gpu,
                    "nvlink": b.nvlink,
                })),
            })
        })
        .collect();
    let text = serde_json::to_string_pretty(&rows).map_err(std::io::Error::other)?;
    std::fs::write(path, text + "\n")
}

fn plot_rows(o: &Options, hw: &Hardware, rows: &[Row], path: &str) -> Result<(), String> {
    let gpus = o
        .plot_gpus
        .unwrap_or_else(|| o.gpus.iter().copied().max().unwrap_or(8));
    let size = o
        .plot_bytes
        .unwrap_or_else(|| rows.iter().map(|r| r.job.bytes).max().unwrap_or(0));
    let series = |x: &dyn Fn(&Row) -> Option<f64>| -> Vec<Series> {
        o.algos
            .iter()
            .map(|&algo| Series {
                label: algo.name().to_owned(),
                points: rows
                    .iter()
                    .filter(|r| r.prediction.algo == algo)
                    .filter_map(|r| x(r).map(|x| (x, r.prediction.busbw_gbps)))
                    .collect(),
            })
            .filter(|s| !s.points.is_empty())
            .collect()
    };
    #[expect(clippy::cast_precision_loss, reason = "sizes far below 2^52")]
    let by_size = Chart {
        title: format!("predicted all-reduce busbw, {gpus} GPUs ({})", hw.name),
        x_axis: Axis::Bytes,
        x_label: "tensor size".into(),
        y_label: "busbw (GB/s)".into(),
        series: series(&|r| (r.gpus == gpus).then_some(r.job.bytes as f64)),
    };
    #[expect(clippy::cast_precision_loss, reason = "sizes far below 2^52")]
    let by_gpus = Chart {
        title: format!(
            "predicted all-reduce busbw at {} MiB ({})",
            size >> 20,
            hw.name
        ),
        x_axis: Axis::Count,
        x_label: "GPUs".into(),
        y_label: "busbw (GB/s)".into(),
        series: series(&|r| (r.job.bytes == size).then_some(r.gpus as f64)),
    };
    for (chart, suffix) in [(by_size, "size"), (by_gpus, "gpus")] {
        let files = plot::write(&chart, Path::new(&format!("{path}-{suffix}")))?;
        for f in files {
            println!("# wrote {}", f.display());
        }
    }
    Ok(())
}

fn calibrate_from(path: &str, algo: &str, hw: &Hardware) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {path}: {e}"))?;
    let rows: Vec<BenchRow> =
        serde_json::from_str(&text).map_err(|e| format!("{path}: not fairring-bench JSON: {e}"))?;
    let c = calibrate(&rows, algo, hw).map_err(|e| format!("{path}: {e}"))?;
    println!(
        "# {} rows of {algo} on {}x{}: fixed cost {:.1} us, a rail reached {:.3} GB/s",
        rows.iter().filter(|r| r.algo == algo).count(),
        c.machines,
        c.devices,
        c.fixed_us,
        c.rail_gbps
    );
    print!("{}", c.to_toml(&hw.name));
    Ok(())
}
