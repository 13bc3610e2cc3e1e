"""Whole jobs as users run them: plain processes, a rank killed mid-training,
torchrun (the Python backend and fairring-bench), and the backend found
through its entry point without ``import fairring``."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = os.path.join(HERE, "ddp_job.py")
GROUPS_JOB = os.path.join(HERE, "groups_job.py")
REPO = os.path.dirname(os.path.dirname(HERE))


def launch(world, *args, env=None):
    port = free_port()
    procs = []
    for rank in range(world):
        e = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                 MASTER_PORT=str(port), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
        # `env`: what every rank's environment adds, or a function of the rank.
        e.update(env(rank) if callable(env) else (env or {}))
        procs.append(subprocess.Popen([sys.executable, JOB, *args], env=e,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def finish(procs, limit):
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            out += "\n(killed by the test: it hung)"
        outs.append((p.returncode, out))
    return outs


def test_a_job_trains_and_tears_down_without_leaving_threads():
    outs = finish(launch(2, "--steps", "5"), 120)
    sums = set()
    for rank, (code, out) in enumerate(outs):
        assert code == 0, f"rank {rank} exited {code}:\n{out}"
        sums.add(re.search(r"DONE \d+ (\S+)", out).group(1))
        found = re.search(r"THREADS (\d+) (\d+) (\S+)", out)
        assert found, out
        # Every thread fairring started (progress, completion, futures,
        # callbacks) is gone.
        assert found.group(3) == "-", f"rank {rank}: fairring's threads left: {found.group(3)}\n{out}"
    assert len(sums) == 1, sums


def kill_rank_1_of_3(*args, env=None):
    """A 3-rank `ddp_job.py` (with `args`) whose rank 1 SIGKILLs itself at
    step 3: both survivors raise a Python exception naming rank 1, within
    the timeout."""
    timeout = 10
    start = time.monotonic()
    procs = launch(3, "--steps", "50", "--kill-rank", "1", "--kill-step", "3",
                   "--timeout", str(timeout), *args, env=env)
    outs = finish(procs, 4 * timeout + 60)
    elapsed = time.monotonic() - start
    assert outs[1][0] == -signal.SIGKILL, outs[1]
    for rank in (0, 2):
        code, out = outs[rank]
        # A Python exception, not a segfault, an abort or a hang.
        assert code == 3, f"rank {rank} exited {code}:\n{out}"
        raised = re.search(r"RAISED .*", out).group(0)
        assert "rank 1" in raised, f"rank {rank} does not name the lost rank: {raised}"
    # Bounded by the timeout (plus start-up), never longer.
    assert elapsed < 2 * timeout + 60, elapsed


def test_a_killed_rank_fails_every_survivor_naming_it():
    kill_rank_1_of_3()


def torchrun():
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    assert exe, "torchrun (from torch) is not on PATH"
    return exe


MODES = {
    "default": [],
    "standalone": ["--standalone"],
    "c10d": ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:{port}"],
}


def modes(name):
    return [a.replace("{port}", str(free_port())) for a in MODES[name]]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_ddp_under_torchrun(mode):
    extra = modes(mode)
    if mode == "default":
        extra = ["--master-port", str(free_port())]
    run = subprocess.run([torchrun(), *extra, "--nproc-per-node", "2", JOB, "--steps", "3"],
                         capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert len(re.findall(r"DONE \d", out)) == 2, out


def test_subgroups_meshes_and_three_inits_under_torchrun():
    """Subgroups read their layout from the rendezvous, not from the job's
    LOCAL_WORLD_SIZE; a group built again reads its own keys, not the last
    construction's."""
    run = subprocess.run([torchrun(), "--master-port", str(free_port()), "--nproc-per-node", "4",
                          GROUPS_JOB], capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    done = re.findall(r"GROUPS DONE \d", out)
    assert len(done) == 4, out


def bench_binary():
    path = os.environ.get("FAIRRING_BENCH")
    candidates = [path] if path else [
        os.path.join(REPO, "target", profile, "fairring-bench") for profile in ("release", "debug")
    ]
    for c in candidates:
        if c and os.path.exists(c):
            return c
    pytest.fail(f"fairring-bench is not built (looked at {candidates}); "
                "`cargo build --release -p fairring-bench` or set FAIRRING_BENCH")


@pytest.mark.parametrize("mode", sorted(MODES))
def test_fairring_bench_under_torchrun(mode):
    extra = modes(mode)
    if mode == "default":
        extra = ["--master-port", str(free_port())]
    run = subprocess.run([torchrun(), "--no-python", *extra, "--nproc-per-node", "2",
                          bench_binary(), "--max-bytes", "1M", "--iters", "5"],
                         capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    rows = [l for l in out.splitlines() if re.match(r"\s+1048576\s", l)]
    assert rows, out
    assert rows[0].split()[8] == "0", f"#wrong is not 0: {rows[0]}"


def test_init_process_group_finds_the_backend_without_an_import():
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 14):
        pytest.skip(f"torch {torch.__version__} has no backend entry points (2.14 added them)")
    code = (
        "import sys, datetime, torch.distributed as dist\n"
        "assert 'fairring' not in sys.modules\n"
        "dist.init_process_group('fairring', init_method='tcp://127.0.0.1:%d', rank=0,"
        " world_size=1, timeout=datetime.timedelta(seconds=30))\n"
        "assert 'fairring' in sys.modules, 'loaded through the entry point'\n"
        "t = __import__('torch').ones(3); dist.all_reduce(t); assert t.tolist() == [1, 1, 1]\n"
        "print(dist.get_backend())\n"
        "dist.destroy_process_group()\n" % free_port()
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().endswith("fairring"), run.stdout
