"""torch.distributed's all-reduce through fairring beside the Rust bench and
gloo, on the same layouts, in one sitting.

    python python/benches/side_by_side.py --bench target/release/fairring-bench
    python python/benches/side_by_side.py --layouts 1x2,2x1 --sizes 4096,1048576 \\
        --rounds 3 --iters 500 --before /tmp/fairring-before   # a second install to compare

Each round runs, in an order that alternates between rounds, every entry:
- ``rust``: ``fairring-bench --local MxD`` (the engine without Python);
- ``torch``: ``dist.all_reduce`` on a ``"fairring"`` group (``FAIRRING_TORCH_CALLS``
  as set, default ``native``);
- ``torch-backend``: the group's C++ backend called from Python as torch's
  dispatcher calls it (``allreduce([t], opts).wait()``), without
  ``dist.all_reduce``'s own layers;
- ``torch-python``: the same as ``torch`` with ``FAIRRING_TORCH_CALLS=python`` (every call
  through the Python group);
- ``torch-before``: the same from another install of the package (``--before
  DIR``, a ``pip install --target DIR`` of it), put first on ``PYTHONPATH``;
- ``gloo``: ``dist.all_reduce`` on a gloo group;
- ``fake``: ``dist.all_reduce`` on torch's ``fake`` backend, which moves
  nothing: what torch's own layers cost a call (the ranks do not meet: rank
  0's times).

Every one times each all-reduce (sum, float32, in place) on every rank, back
to back after a warm-up, takes the slowest rank's time per iteration and
reports the median, as ``fairring-bench --no-barrier`` does. Machines are simulated on
one host as the bench simulates them (``FAIRRING_HOST_ID``; gloo always runs
over loopback TCP). The table gives, per entry, layout and size, the median
over rounds and the range, and each entry's ratio to ``rust``.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

WORKER = r"""
import json, os, statistics, sys, time
import torch
import torch.distributed as dist

backend, sizes, iters, warmup, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
direct = sys.argv[6] == "1"
if backend == "fairring":
    import fairring  # noqa: F401
torch.set_num_threads(1)
if backend == "fake":
    # torch's own backend that moves nothing: what dist.all_reduce itself costs.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))
else:
    dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
rows = []
for nbytes in sizes:
    t = torch.ones(nbytes // 4)
    dist.all_reduce(t)
    if backend != "fake":
        assert t[0].item() == world and t[-1].item() == world, "wrong result"
    for _ in range(warmup):
        dist.all_reduce(t)
    if direct:
        # The group's backend called as torch's dispatcher calls it.
        backend = dist.group.WORLD._get_backend(t.device)
        opts = dist.AllreduceOptions()
        call = lambda: backend.allreduce([t], opts).wait()  # noqa: E731
    else:
        call = lambda: dist.all_reduce(t)  # noqa: E731
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    tt = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(tt, op=dist.ReduceOp.MAX)
    rows.append([nbytes, statistics.median(tt.tolist()) * 1e6])
dist.destroy_process_group()
if rank == 0:
    with open(out, "w") as f:
        json.dump(rows, f)
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torch(entry, layout, a):
    """Median time (us) per size of `dist.all_reduce` for one entry."""
    machines, devices = layout
    world = machines * devices
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        script = os.path.join(tmp, "worker.py")
        with open(script, "w") as f:
            f.write(WORKER)
        procs = []
        for rank in range(world):
            env = dict(os.environ)
            env.update(
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank % devices),
                LOCAL_WORLD_SIZE=str(devices),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                FAIRRING_HOST_ID=f"side-by-side-{rank // devices}",
            )
            backend = entry if entry in ("gloo", "fake") else "fairring"
            if entry == "torch-python":
                env["FAIRRING_TORCH_CALLS"] = "python"
            if entry == "torch-before":
                env["PYTHONPATH"] = a.before + os.pathsep + env.get("PYTHONPATH", "")
            args = [sys.executable, script, backend, json.dumps(a.sizes), str(a.iters),
                    str(a.warmup), out, "1" if entry == "torch-backend" else "0"]
            procs.append(subprocess.Popen(args, env=env))
        for p in procs:
            if p.wait(timeout=600) != 0:
                raise SystemExit(f"{entry} on {machines}x{devices}: a rank exited {p.returncode}")
        with open(out) as f:
            return {nbytes: us for nbytes, us in json.load(f)}


def run_rust(layout, a):
    """Median time (us) per size of `fairring-bench`'s all-reduce."""
    machines, devices = layout
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        found = {}
        for nbytes in a.sizes:
            subprocess.run(
                [a.bench, "--local", f"{machines}x{devices}", "--min-bytes", str(nbytes),
                 "--max-bytes", str(nbytes), "--iters", str(a.iters), "--warmup",
                 str(a.warmup), "--no-barrier", "--json", out],
                check=True, stdout=subprocess.DEVNULL, timeout=600,
            )
            with open(out) as f:
                (row,) = [r for r in json.load(f) if r["bytes"] == nbytes]
            assert row["wrong"] == 0, row
            found[nbytes] = row["time_us"]
        return found


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bench", default="target/release/fairring-bench", help="fairring-bench to run")
    p.add_argument("--layouts", default="1x2,2x1", help="machines x ranks each, comma-separated")
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 1 << 20])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=500)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--before", help="a directory holding another install of the package")
    p.add_argument("--entries", default="rust,torch,torch-backend,torch-python,gloo,fake")
    a = p.parse_args()
    layouts = [tuple(int(x) for x in l.split("x")) for l in a.layouts.split(",")]
    entries = a.entries.split(",")
    if a.before and "torch-before" not in entries:
        entries.append("torch-before")
    results = {}
    for round_ in range(a.rounds):
        order = entries if round_ % 2 == 0 else list(reversed(entries))
        for layout in layouts:
            for entry in order:
                started = time.monotonic()
                got = run_rust(layout, a) if entry == "rust" else run_torch(entry, layout, a)
                for nbytes, us in got.items():
                    results.setdefault((entry, layout, nbytes), []).append(us)
                print(f"# round {round_ + 1} {entry} {layout[0]}x{layout[1]}: "
                      f"{time.monotonic() - started:.0f} s", file=sys.stderr)
    print(f"# dist.all_reduce (sum, f32, in place) against fairring-bench; {a.rounds} rounds of "
          f"{a.iters} iterations; median over rounds [min-max] of the per-round median of the "
          f"slowest rank's time; {os.cpu_count()} CPUs")
    print(f"# {'layout':>6} {'size':>9} {'entry':>13} {'time (us)':>10} {'range':>17} {'x rust':>8}")
    for layout in layouts:
        for nbytes in a.sizes:
            rust = statistics.median(results[("rust", layout, nbytes)]) if "rust" in entries else None
            for entry in entries:
                times = results[(entry, layout, nbytes)]
                med = statistics.median(times)
                ratio = f"{med / rust:8.2f}" if rust else f"{'':>8}"
                span = f"{min(times):.1f}-{max(times):.1f}"
                print(f"  {layout[0]}x{layout[1]:<4} {nbytes:>9} {entry:>13} {med:>10.1f} {span:>17} {ratio}")


if __name__ == "__main__":
    main()
