#!/usr/bin/env python3
"""One sitting: fairring-bench beside OpenMPI and gloo, all-reduce, several runs each,
in turns, on this host; the table of every cell's median and spread.

    python3 benches/peers/sitting.py --fairring after=target/release/fairring-bench \\
        [--fairring before=/path/to/an/older/fairring-bench] [--rounds 10] \\
        [--layouts 1x2,2x1,2x2] [--sizes 4096,65536,...] [--gloo PYTHON] [--no-mpi]

The sizes are a geometric series (fairring-bench walks them by a factor); the
default is 4 KiB to 256 MiB by 16.

Each round runs every system once per layout, in turn (so a drift of the machine
reaches them all alike). Each run is the system's own table (the median over its
iterations of the slowest rank's time, every call after a barrier: the peers'
benches time so, and fairring-bench does by default; a build older than its
`--barrier` flag times calls back to back, which at small sizes adds the ranks'
skew to each call, so its small cells do not compare; sizes below `--large` take `--iters`
iterations, larger ones `--large-iters`, in a second invocation); a cell shows the median over runs of the
busbw in GB/s, or at 4 KiB and below the time in us, with the range over the
runs beside it (lowest to highest value: fastest to slowest for a time,
slowest to fastest for a busbw), and `spread`, the slowest run's time over the median
run's. The peers, per layout:

- `1x2`: OpenMPI over shared memory (vader), 2 ranks; gloo, 2 ranks;
- `2x1`: OpenMPI over loopback TCP, 2 ranks; gloo, 2 ranks;
- `MxD` otherwise: OpenMPI over loopback TCP, M*D ranks; gloo, M*D ranks.

OpenMPI's bench (`mpi_allreduce_bench.c` in the shared peers folder, `--mpi-src`)
is built with `mpicc`; gloo runs through `gloo_bench.py` beside it with the
Python given (`--gloo`, one with torch). fairring-bench runs with `--no-check`
after a checked warm-up run per layout.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_PEERS = os.path.normpath(os.path.join(HERE, "..", "..", "..", "shared", "peers"))
SIZES = [4096, 65536, 1 << 20, 16 << 20, 256 << 20]
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def parse(text):
    """{size: (time_us, busbw)} from a fairring-bench, MPI or gloo table."""
    rows = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 6 and f[1] in UNITS and f[0].isdigit():
            # MPI and gloo: "4 KiB count time algbw busbw min"
            rows[int(f[0]) * UNITS[f[1]]] = (float(f[3]), float(f[5]))
        elif len(f) >= 8 and f[0].isdigit() and f[1].isdigit():
            # fairring-bench: "size count type redop algo time algbw busbw ..."
            rows[int(f[0])] = (float(f[5]), float(f[7]))
    return rows


def run(cmd, timeout):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"# timed out: {' '.join(cmd)}", file=sys.stderr)
        return {}
    rows = parse(out.stdout)
    if out.returncode != 0 or not rows:
        print(f"# failed ({out.returncode}): {' '.join(cmd)}\n{out.stderr[-2000:]}", file=sys.stderr)
    return rows


def cell(values, size):
    """The cell's text: busbw (time at 4 KiB and below), median [lowest-highest]."""
    times = sorted(t for t, _ in values)
    med_t = statistics.median(times)
    spread = times[-1] / med_t if med_t > 0 else float("nan")
    if size <= 4096:
        return f"{med_t:.1f} [{times[0]:.1f}-{times[-1]:.1f}] us x{spread:.2f}", med_t, spread
    bws = sorted(b for _, b in values)
    return (f"{statistics.median(bws):.2f} [{bws[0]:.2f}-{bws[-1]:.2f}] x{spread:.2f}",
            med_t, spread)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fairring", action="append", required=True, metavar="NAME=PATH",
                   help="a fairring-bench to run (repeat: before and after)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--layouts", default="1x2,2x1,2x2")
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=SIZES)
    p.add_argument("--iters", type=int, default=200,
                   help="timed iterations per run below --large (each a few us to ms)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--large", type=int, default=4 << 20,
                   help="sizes from this on are timed --large-iters times, after --large-warmup")
    p.add_argument("--large-iters", type=int, default=10)
    p.add_argument("--large-warmup", type=int, default=3)
    p.add_argument("--gloo", metavar="PYTHON", help="a Python with torch, to run gloo")
    p.add_argument("--no-mpi", action="store_true")
    p.add_argument("--mpi-src", default=os.path.join(DEFAULT_PEERS, "mpi_allreduce_bench.c"))
    p.add_argument("--timeout", type=int, default=600, help="seconds for one run")
    a = p.parse_args()

    # fairring-bench walks sizes by a factor: the sizes must be its steps.
    factor = a.sizes[1] // a.sizes[0] if len(a.sizes) > 1 else 2
    if any(b != a.sizes[0] * factor ** i for i, b in enumerate(a.sizes)) or factor < 2:
        sys.exit("--sizes: give a geometric series (each size the last times one factor)")
    # Small sizes take many iterations, large ones few: two runs per system,
    # counted as one.
    groups = [(g, iters, warmup) for g, iters, warmup in (
        ([b for b in a.sizes if b < a.large], a.iters, a.warmup),
        ([b for b in a.sizes if b >= a.large], a.large_iters, a.large_warmup)) if g]
    systems = {}  # layout -> [(name, [command per group])]
    mpi = None
    if not a.no_mpi:
        mpi = os.path.join(tempfile.mkdtemp(), "mpi_allreduce_bench")
        subprocess.run(["mpicc", "-O3", "-march=native", "-o", mpi, a.mpi_src], check=True)
    for layout in a.layouts.split(","):
        m, d = (int(x) for x in layout.split("x"))
        n = m * d
        cmds = []
        for spec in a.fairring:
            name, path = spec.split("=", 1)
            cmds.append((f"fairring {name}", [
                [path, "--local", layout, "--no-check", "--iters", str(iters),
                 "--warmup", str(warmup), "--min-bytes", str(min(g)),
                 "--max-bytes", str(max(g)), "--factor", str(factor)]
                for g, iters, warmup in groups]))
        if mpi:
            btl = ["--mca", "btl", "vader,self"] if layout == "1x2" else \
                ["--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "lo"]
            kind = "shared memory" if layout == "1x2" else "TCP"
            cmds.append((f"OpenMPI {kind}, {n} ranks", [
                ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n),
                 "--mca", "pml", "ob1", *btl, mpi, "--sizes", ",".join(map(str, g)),
                 "--iters", str(iters), "--warmup", str(warmup)]
                for g, iters, warmup in groups]))
        if a.gloo:
            cmds.append((f"gloo, {n} ranks", [
                [a.gloo, os.path.join(os.path.dirname(a.mpi_src), "gloo_bench.py"),
                 "--nproc", str(n), "--sizes", ",".join(map(str, g)),
                 "--iters", str(iters), "--warmup", str(warmup)]
                for g, iters, warmup in groups]))
        systems[layout] = cmds

    # Every fairring-bench checks its results once per layout before the sitting.
    for layout, cmds in systems.items():
        for name, group_cmds in cmds:
            if name.startswith("fairring"):
                for cmd in group_cmds:
                    checked = [c for c in cmd if c != "--no-check"] + ["--check"]
                    out = subprocess.run(checked, capture_output=True, text=True,
                                         timeout=a.timeout)
                    if out.returncode != 0:
                        sys.exit(f"{name} {layout}: the checked run failed:\n"
                                 f"{out.stdout}{out.stderr}")

    results = {(layout, name): [] for layout, cmds in systems.items() for name, _ in cmds}
    for r in range(a.rounds):
        for layout, cmds in systems.items():
            for name, group_cmds in cmds:
                rows = {}
                for cmd in group_cmds:
                    rows.update(run(cmd, a.timeout))
                results[(layout, name)].append(rows)
        print(f"# round {r + 1} of {a.rounds} done", file=sys.stderr, flush=True)

    print(f"# all-reduce, f32 sum, {a.rounds} runs per cell ({a.iters} iterations after "
          f"{a.warmup} below {fmt(a.large)}, {a.large_iters} after {a.large_warmup} from it), "
          f"{os.cpu_count()} CPUs; "
          "busbw GB/s (time at 4 KiB and below), median [lowest-highest] xslowest/median time")
    for layout, cmds in systems.items():
        print(f"\n## {layout}\n")
        print("| system | " + " | ".join(fmt(s) for s in a.sizes) + " |")
        print("|---|" + "---|" * len(a.sizes))
        medians = {}
        for name, _ in cmds:
            cells = []
            for s in a.sizes:
                values = [run_rows[s] for run_rows in results[(layout, name)] if s in run_rows]
                if not values:
                    cells.append("-")
                    continue
                text, med_t, _ = cell(values, s)
                medians[(name, s)] = med_t
                cells.append(text)
            print(f"| {name} | " + " | ".join(cells) + " |")
        peers = [name for name, _ in cmds if not name.startswith("fairring")]
        for name, _ in cmds:
            if not name.startswith("fairring") or not peers:
                continue
            ratios = []
            for s in a.sizes:
                best = min((medians[(q, s)] for q in peers if (q, s) in medians), default=None)
                mine = medians.get((name, s))
                ratios.append(f"{best / mine:.2f}x" if best and mine else "-")
            print(f"| {name} / best peer (speed) | " + " | ".join(ratios) + " |")


def fmt(b):
    for unit in ("GiB", "MiB", "KiB"):
        if b >= UNITS[unit] and b % UNITS[unit] == 0:
            return f"{b // UNITS[unit]} {unit}"
    return f"{b} B"


if __name__ == "__main__":
    main()
