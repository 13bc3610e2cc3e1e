//! `fairring-bench`: an nccl-tests-style all-reduce benchmark.
//!
//! ```text
//! fairring-bench [--local MxD] [--min-bytes N] [--max-bytes N] [--factor F]
//!                [--iters N] [--warmup N] [--algo auto|hierarchical|ring|doubling|all]
//!                [--collective all_reduce|broadcast|all_gather|reduce_scatter|reduce|gather|scatter|send_recv|all_to_all]
//!                [--wire exact|bf16|f16] [--device host|cuda]
//!                [--dtype f32|f64|f16|bf16|i32|i64|u8|i8] [--op sum|prod|min|max|avg]
//!                [--check|--no-check] [--barrier|--no-barrier] [--parallel N]
//!                [--servers K] [--json PATH]
//!                [--plot PATH]
//! fairring-bench model ...   (the scale model: see `model_command.rs`)
//! ```
//!
//! With `--local MxD` (the default, `2x2`, when no launcher's environment is set)
//! it launches `M*D` copies of itself on this host as `M` simulated machines of
//! `D` ranks; started by a launcher (torchrun, OpenMPI's `mpirun`, an MPICH-style
//! `mpiexec`, Slurm's `srun`) and without `--local`, it is one rank of that job. Rank 0
//! prints one row per size and algorithm:
//!
//! - `time`: median over iterations of the slowest rank's time for one iteration
//!   (one iteration is `--parallel` all-reduces in flight at once), each after a
//!   barrier, as OpenMPI's and gloo's benches in `../shared/peers` time theirs
//!   (`--no-barrier`: back to back, where a call also carries the ranks' skew
//!   from the one before);
//! - `algbw` = bytes x parallel / time; `busbw` = algbw x 2(n-1)/n for an
//!   all-reduce, algbw for a broadcast and a reduce, algbw x (n-1)/n for an
//!   all-gather, a reduce-scatter, a gather and a scatter (nccl-tests' factors;
//!   `size` is the buffer a rank ends with for an all-gather or a gather and
//!   starts with for a reduce-scatter or a scatter);
//! - `#wrong`: elements that differ from the exactly known result, summed over
//!   ranks (inputs are small integers, so every order of summation is exact);
//! - `sent/op`, `recv/op`: data bytes the busiest rank's fabric wrote and
//!   received per all-reduce, counted by the fabric over the timed iterations
//!   (after barriers: over the warm-up calls, at least one, which run back to
//!   back, so that no barrier's bytes are counted). A send counts when posted; a
//!   landing when taken, which may fall in a later call.
//!
//! `--collective` times a broadcast (from rank 0), an all-gather, a
//! reduce-scatter, or a reduce, a gather (both to rank 0) or a scatter (from
//! rank 0) instead of an all-reduce, checked the same way (the rooted ones
//! where their results are defined; host tensors only). They take
//! `--algo` too: `ring` relays a broadcast or an all-gather around the ring
//! and runs a reduce-scatter as the ring's reduce-scatter half; `hierarchical`
//! and `doubling` run them as all-reduces.
//!
//! `--collective send_recv` times point-to-point messages as a ping-pong
//! between the ranks of each pair (0 and 1, 2 and 3, ...; an odd last rank
//! idles): the even rank sends its buffer, the odd one receives it and sends
//! it back (`--parallel` messages in flight each way). `time` is one way,
//! half the round trip, and `algbw` = `busbw` = bytes / that time; `--algo`
//! does not apply (a message is no collective). `--collective all_to_all`
//! sends block `j` of each rank's buffer to rank `j` (equal blocks, each one
//! message), busbw = algbw x (n-1)/n
//! as nccl-tests counts it, every element checked.
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
//! its index on its machine modulo the visible devices; with one GPU every rank shares it), ordered on
//! a stream of the rank's; the host fills and checks them outside the timed
//! iterations, and a timed iteration ends when the host sees every operation
//! complete. With several ranks per machine (`--local 1x2`), the machine's step
//! runs through NCCL or the shared segment, as `FAIRRING_DEVICE_LOCAL` chooses.
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
mod launcher;
mod model_command;
mod options;
mod report;
mod sweep;
mod values;

use std::io::Write;
use std::process::ExitCode;
use std::time::Instant;

use fairring::core::reduce::{Bool, Element};
use fairring::{Algorithm, Communicator, Config, DataType, ReduceOp, WireFormat};
use half::{bf16, f16};

use launcher::*;
use options::*;
use report::*;
use sweep::*;
use values::*;

/// Blocks of iterations the algorithms of one size take turns in.
const ROUNDS: usize = 5;

const CHILD_VAR: &str = "FAIRRING_BENCH_CHILD";

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
    match (options.local, fairring::Launcher::from_env()) {
        (Some(layout), _) => launch(layout, &args),
        // Started by torchrun, mpirun, mpiexec or srun: one rank of its job.
        (None, Ok(Some(_))) => worker(&options),
        (None, Ok(None)) => launch((2, 2), &args),
        (None, Err(e)) => {
            eprintln!("fairring-bench: {e}");
            ExitCode::FAILURE
        }
    }
}
