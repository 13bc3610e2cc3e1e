//! `fairring-gpu-bench`: the device reduction kernel against the device's copy
//! bound, and pinned host-device bandwidth.
//!
//! ```text
//! fairring-gpu-bench [--mib N] [--iters N] [--blocks N] [--device N]
//! ```
//!
//! Every case runs `--iters` back-to-back operations on one stream, timed with
//! events, in `--blocks` blocks that take turns case by case (so drift of the
//! device's clocks affects every case alike); the table shows each case's median
//! block. Rows:
//!
//! - `copy`: `cuMemcpyDtoDAsync` of N MiB, the bound: it reads N and writes N
//!   MiB;
//! - `reduce <op> <type>`: `dst op= src` over N MiB per operand: it reads 2N and
//!   writes N MiB;
//! - `reduce_many sum f32 x K`: the many-source kernel folding K sources (a
//!   server's M-1 contributions) into `dst` in one pass: it reads (K+1)N and
//!   writes N MiB;
//! - `h2d` and `d2h`: copies of N MiB between pinned host memory and the device.
//!
//! `GB/s` is the memory traffic per second (bytes read plus written, for the
//! device-to-device rows; bytes moved, for the host rows); `of copy` is a row's
//! traffic rate as a fraction of the copy's, measured in the same run: the
//! kernel's target is at least 0.85 for f32 sum at 256 MiB, the many-source
//! kernel's at least 0.9 for 1, 3 and 7 sources.
//!
//! Needs a CUDA device and NVRTC; without them it exits with status 2 naming what
//! is missing.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use fairring_core::{DataType, ReduceOp};
use fairring_cuda::{
    Device, DeviceBuffer, Event, PinnedBuffer, ReductionKernels, Result, Stream, Timing,
};

struct Options {
    mib: usize,
    iters: u32,
    blocks: usize,
    device: u32,
}

fn parse() -> std::result::Result<Options, String> {
    let mut o = Options {
        mib: 256,
        iters: 20,
        blocks: 5,
        device: 0,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = |what: &str| {
            value
                .parse::<u64>()
                .ok()
                .filter(|v| *v > 0)
                .ok_or_else(|| format!("{what} must be a positive integer, got {value:?}"))
        };
        match flag.as_str() {
            "--mib" => o.mib = usize::try_from(number("--mib")?).map_err(|e| e.to_string())?,
            "--iters" => o.iters = u32::try_from(number("--iters")?).map_err(|e| e.to_string())?,
            "--blocks" => {
                o.blocks = usize::try_from(number("--blocks")?).map_err(|e| e.to_string())?;
            }
            "--device" => {
                o.device = u32::try_from(
                    value
                        .parse::<u64>()
                        .map_err(|_| format!("--device must be an integer, got {value:?}"))?,
                )
                .map_err(|e| e.to_string())?;
            }
            _ => return Err(format!("unknown argument {flag:?}")),
        }
    }
    Ok(o)
}

/// One thing to time, and the bytes of memory traffic of one run of it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Case {
    Copy,
    Reduce(ReduceOp, DataType),
    /// f32 sum of this many sources in one many-source launch.
    ReduceMany(usize),
    HostToDevice,
    DeviceToHost,
}

impl Case {
    fn name(self) -> String {
        match self {
            Case::Copy => "copy (cuMemcpyDtoDAsync)".to_owned(),
            Case::Reduce(op, dtype) => format!("reduce {op} {dtype}"),
            Case::ReduceMany(k) => format!("reduce_many sum f32 x {k}"),
            Case::HostToDevice => "h2d (pinned)".to_owned(),
            Case::DeviceToHost => "d2h (pinned)".to_owned(),
        }
    }

    fn traffic(self, bytes: usize) -> usize {
        match self {
            Case::Copy => 2 * bytes,
            Case::Reduce(..) => 3 * bytes,
            Case::ReduceMany(k) => (k + 2) * bytes,
            Case::HostToDevice | Case::DeviceToHost => bytes,
        }
    }
}

/// The most sources a many-source case folds: the contributions a server of
/// an 8-machine job reduces.
const MOST_SOURCES: usize = 7;

struct Bench {
    stream: Stream,
    kernels: ReductionKernels,
    dst: DeviceBuffer,
    src: DeviceBuffer,
    /// More sources for the many-source cases (`src` is the first).
    more: Vec<DeviceBuffer>,
    host: PinnedBuffer,
    start: Event,
    end: Event,
}

impl Bench {
    fn new(device: &Arc<Device>, bytes: usize) -> Result<Bench> {
        Ok(Bench {
            stream: Stream::new(device, false)?,
            kernels: ReductionKernels::load(device)?,
            dst: DeviceBuffer::zeroed(device, bytes)?,
            src: DeviceBuffer::zeroed(device, bytes)?,
            more: (1..MOST_SOURCES)
                .map(|_| DeviceBuffer::zeroed(device, bytes))
                .collect::<Result<Vec<_>>>()?,
            host: PinnedBuffer::zeroed(device, bytes)?,
            start: Event::new(device, Timing::Enabled)?,
            end: Event::new(device, Timing::Enabled)?,
        })
    }

    fn enqueue(&mut self, case: Case) -> Result<()> {
        let stream = &self.stream;
        match case {
            Case::Copy => stream.copy(&mut self.dst.slice_mut(), self.src.slice()),
            Case::Reduce(op, dtype) => self.kernels.reduce(
                stream,
                dtype,
                op,
                &mut self.dst.slice_mut(),
                self.src.slice(),
            ),
            Case::ReduceMany(k) => {
                let srcs: Vec<_> = std::iter::once(&self.src)
                    .chain(&self.more)
                    .take(k)
                    .map(DeviceBuffer::slice)
                    .collect();
                self.kernels.reduce_many(
                    stream,
                    DataType::F32,
                    ReduceOp::Sum,
                    &mut self.dst.slice_mut(),
                    &srcs,
                )
            }
            // SAFETY: the host buffer is not touched until `time` has synchronised
            // the stream's end event.
            Case::HostToDevice => unsafe {
                stream.copy_to_device(&mut self.dst.slice_mut(), self.host.as_slice())
            },
            // SAFETY: as above.
            Case::DeviceToHost => unsafe {
                stream.copy_to_host(self.host.as_mut_slice(), self.src.slice())
            },
        }
    }

    /// Time per operation over `iters` back-to-back operations.
    fn time(&mut self, case: Case, iters: u32) -> Result<Duration> {
        self.enqueue(case)?;
        self.start.record(&self.stream)?;
        for _ in 0..iters {
            self.enqueue(case)?;
        }
        self.end.record(&self.stream)?;
        self.end.synchronize()?;
        Ok(self.end.elapsed_since(&self.start)? / iters)
    }
}

fn run(o: &Options) -> Result<()> {
    let device = Device::open(o.device)?;
    let bytes = o.mib << 20;
    let mut bench = Bench::new(&device, bytes)?;
    let cases = [
        Case::Copy,
        Case::Reduce(ReduceOp::Sum, DataType::F32),
        Case::Reduce(ReduceOp::Sum, DataType::BF16),
        Case::Reduce(ReduceOp::Sum, DataType::F16),
        Case::Reduce(ReduceOp::Sum, DataType::F64),
        Case::Reduce(ReduceOp::Sum, DataType::I32),
        Case::Reduce(ReduceOp::Max, DataType::F32),
        Case::Reduce(ReduceOp::Sum, DataType::U8),
        Case::ReduceMany(1),
        Case::ReduceMany(3),
        Case::ReduceMany(MOST_SOURCES),
        Case::HostToDevice,
        Case::DeviceToHost,
    ];
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); cases.len()];
    for block in 0..o.blocks {
        // Odd blocks run the cases in reverse, so no case always follows another.
        let order: Vec<usize> = if block % 2 == 0 {
            (0..cases.len()).collect()
        } else {
            (0..cases.len()).rev().collect()
        };
        for i in order {
            times[i].push(bench.time(cases[i], o.iters)?);
        }
    }
    let (cc_major, cc_minor) = device.compute_capability();
    println!(
        "# {} ({} SMs, sm_{cc_major}{cc_minor}), {} MiB per operand, {} iterations x {} blocks, median block",
        device.name(),
        device.multiprocessors(),
        o.mib,
        o.iters,
        o.blocks
    );
    println!(
        "# {:<28} {:>12} {:>10} {:>8}",
        "operation", "time (us)", "GB/s", "of copy"
    );
    let median = |t: &mut Vec<Duration>| {
        t.sort();
        t[t.len() / 2]
    };
    let copy_rate = {
        let t = median(&mut times[0]);
        Case::Copy.traffic(bytes) as f64 / t.as_secs_f64()
    };
    for (case, t) in cases.iter().zip(times.iter_mut()) {
        let t = median(t);
        let rate = case.traffic(bytes) as f64 / t.as_secs_f64();
        let fraction = match case {
            Case::HostToDevice | Case::DeviceToHost => "-".to_owned(),
            _ => format!("{:.3}", rate / copy_rate),
        };
        println!(
            "  {:<28} {:>12.1} {:>10.1} {:>8}",
            case.name(),
            t.as_secs_f64() * 1e6,
            rate / 1e9,
            fraction
        );
    }
    Ok(())
}

fn main() -> ExitCode {
    let options = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("fairring-gpu-bench: {e}");
            eprintln!("usage: fairring-gpu-bench [--mib N] [--iters N] [--blocks N] [--device N]");
            return ExitCode::from(2);
        }
    };
    match run(&options) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fairring-gpu-bench: {e}");
            ExitCode::from(2)
        }
    }
}
