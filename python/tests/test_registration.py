"""The group as torch registers it: a C++ backend per device type, named
"fairring", which ``dist.monitored_barrier`` takes as it takes gloo's; and
the common host calls started by the C++ backend itself."""

import datetime
import time

import pytest
import torch
import torch.distributed as dist

import fairring
from conftest import init_fairring as init
from conftest import spawn

SHORT = datetime.timedelta(seconds=2)


def registered(rank, world, port):
    init(rank, world, port)
    group = dist.group.WORLD
    assert set(map(str, group._device_types)) == {"cpu", "cuda"}, group._device_types
    assert dist.get_backend(group) == "fairring"
    assert group.name() == "fairring"
    from fairring import _c10d

    assert isinstance(group._get_backend(torch.device("cpu")), _c10d.Backend)
    assert group._get_backend(torch.device("cuda")) is not None
    # One backend for both device types: torch's accessor for a custom
    # backend's own methods finds it without being told the device.
    assert isinstance(dist.get_backend_impl(), _c10d.Backend)
    # Object collectives run on CPU tensors, as on gloo's group.
    gathered = [None] * world
    dist.all_gather_object(gathered, {"rank": rank})
    assert gathered == [{"rank": r} for r in range(world)]
    dist.destroy_process_group()


def test_the_group_serves_cpu_and_cuda_and_is_named_fairring():
    spawn(registered, 2)


def on_time(rank, world, port):
    init(rank, world, port)
    for wait_all in (False, True):
        for _ in range(3):
            dist.all_reduce(torch.ones(4))
            dist.monitored_barrier(timeout=SHORT, wait_all_ranks=wait_all)
    # The group goes on as before.
    t = torch.ones(8)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((8,), float(world)))
    dist.destroy_process_group()


def test_monitored_barrier_with_every_rank_on_time_passes():
    spawn(on_time, 3)


def late(rank, world, port, missing):
    """`missing` ranks never reach the barrier; rank 0 names them, the others
    say they reached it but heard nothing from rank 0."""
    init(rank, world, port)
    store = dist.distributed_c10d._get_default_store()
    wait_all = len(missing) > 1
    if rank in missing:
        store.wait(["checked"], datetime.timedelta(seconds=60))
    elif rank == 0:
        start = time.monotonic()
        names = ", ".join(map(str, missing))
        pattern = f"Ranks {names} failed" if wait_all else f"Rank {missing[0]} failed"
        with pytest.raises(RuntimeError, match=pattern + " to pass monitoredBarrier in 2000 ms"):
            dist.monitored_barrier(timeout=SHORT, wait_all_ranks=wait_all)
        assert time.monotonic() - start < 10, "rank 0 waited far past the timeout"
    else:
        with pytest.raises(
            RuntimeError,
            match=f"Rank {rank} successfully reached monitoredBarrier, but received errors "
            "while waiting for send/recv from rank 0",
        ):
            dist.monitored_barrier(timeout=SHORT, wait_all_ranks=wait_all)
    # The group is not used again. Rank 0 serves the store: it leaves last,
    # once every other rank is done with the store.
    if rank == 0:
        store.set("checked", "1")
        while store.add("left", 0) < world - 1:
            time.sleep(0.01)
    else:
        store.add("left", 1)


def test_monitored_barrier_names_the_rank_that_did_not_arrive():
    spawn(late, 3, [2])


def test_monitored_barrier_with_wait_all_ranks_names_every_late_rank():
    spawn(late, 4, [1, 3])


def native(rank, world, port):
    """The calls the C++ backend starts itself are exact, leave no engine
    handle behind, and a finished work kept by the caller holds up nothing.
    Two ranks."""
    from fairring import _c10d

    init(rank, world, port)
    kept = dist.all_reduce(torch.ones(4), async_op=True)
    kept.wait()
    kept_future = dist.all_reduce(torch.ones(4), async_op=True).get_future()
    kept_future.wait()
    # Never waited on, polled or asked a future of.
    untouched = dist.all_reduce(torch.ones(4), async_op=True)
    # Past the engine's table of operations, several times over.
    t = torch.ones(256)
    for _ in range(3000):
        dist.all_reduce(t)
        t.fill_(1.0)
    assert _c10d.live_native_works() == 2, _c10d.live_native_works()  # the two kept
    assert untouched.is_completed()
    b = torch.arange(5, dtype=torch.int16) * (rank + 1)
    dist.broadcast(b, src=world - 1)
    assert torch.equal(b, torch.arange(5, dtype=torch.int16) * world)
    out = torch.empty(3 * world, dtype=torch.bfloat16)
    dist.all_gather_into_tensor(out, torch.full((3,), float(rank), dtype=torch.bfloat16))
    assert torch.equal(out, torch.arange(world, dtype=torch.bfloat16).repeat_interleave(3))
    mine = torch.empty(2, dtype=torch.int64)
    dist.reduce_scatter_tensor(mine, torch.arange(2 * world, dtype=torch.int64))
    assert torch.equal(mine, (torch.arange(2) + 2 * rank) * world)
    dist.barrier()
    # Messages: a type the engine names and one it moves as bytes, a tag,
    # and the receive's source.
    peer = 1 - rank
    for dtype in (torch.float32, torch.complex64):
        mine = torch.arange(6).to(dtype) + 10 * rank
        theirs = torch.empty(6, dtype=dtype)
        if rank == 0:
            dist.send(mine, dst=peer, tag=7)
            received = dist.irecv(theirs, src=peer, tag=7)
        else:
            received = dist.irecv(theirs, src=peer, tag=7)
            dist.send(mine, dst=peer, tag=7)
        received.wait()
        assert received._source_rank() == peer
        assert torch.equal(theirs, torch.arange(6).to(dtype) + 10 * peer)
    # A mismatch fails every rank with fairring's own error, from the call or
    # from wait().
    with pytest.raises(fairring.FairringError, match="(?i)mismatch"):
        dist.all_reduce(torch.ones(4 + rank))
    dist.destroy_process_group()


def test_the_native_calls_are_exact_and_release_the_engine():
    spawn(native, 2)


def test_a_bad_fairring_torch_calls_is_refused_naming_it(monkeypatch):
    from fairring import _backend

    monkeypatch.setenv("FAIRRING_TORCH_CALLS", "sometimes")
    with pytest.raises(ValueError, match='FAIRRING_TORCH_CALLS="sometimes"'):
        _backend.create(dist.HashStore(), 0, 1, datetime.timedelta(seconds=5))


LAID_OUT_BY_HAND = """
import sys, warnings
import torch.distributed as dist
import fairring
from fairring import _backend
assert fairring.__file__.startswith(sys.argv[1]), fairring.__file__
assert _backend.c10d_module() is None
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    dist.init_process_group(
        "fairring", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1
    )
assert any("no C++ backend" in str(w.message) for w in caught), [str(w.message) for w in caught]
import torch
t = torch.arange(6, dtype=torch.float32)
dist.all_reduce(t)
assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], t
dist.destroy_process_group()
print("RAN AS A PYTHON GROUP")
"""


def test_a_package_laid_out_without_its_cpp_backend_runs_as_a_python_group(tmp_path):
    # The GPU kit lays the package out by hand, without `fairring._c10d`
    # (compiled against another torch): the group must still form, warning.
    import os
    import pathlib
    import shutil
    import subprocess
    import sys

    from conftest import free_port

    installed = pathlib.Path(fairring.__file__).parent
    package = tmp_path / "fairring"
    package.mkdir()
    for f in installed.iterdir():
        if f.suffix == ".py" or f.name.startswith("_fairring_ffi"):
            shutil.copy(f, package / f.name)
    assert not list(package.glob("_c10d*"))
    ran = subprocess.run(
        [sys.executable, "-c", LAID_OUT_BY_HAND, str(tmp_path), str(free_port())],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    assert "RAN AS A PYTHON GROUP" in ran.stdout, ran.stdout
