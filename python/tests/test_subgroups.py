"""Subgroups built and destroyed in a loop leak nothing: with a fairring
default group up, each of five rounds builds a subgroup of all ranks and one
of each pair of neighbours, all-reduces on each, exchanges messages around
the ring of the all-ranks subgroup (linking its peers), destroys them, and leaves
this process's threads, file descriptors and shared-memory segments as they
were before the round (or fewer). A 2-D device mesh built beside them works
throughout."""

import gc
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fairring  # noqa: F401  (registers the backend)
from conftest import TIMEOUT, spawn

ROUNDS = 5


def resources():
    shm = [n for n in os.listdir("/dev/shm") if "fairring" in n]
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd")), len(shm)


def rounds(rank, world, port, path):
    torch.set_num_threads(1)
    dist.init_process_group(
        "fairring", init_method=f"file://{path}", rank=rank, world_size=world, timeout=TIMEOUT
    )
    # The mesh's groups live as long as the process (torch keeps them).
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    dist.all_reduce(torch.ones(1))
    baseline = resources()
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for k in range(ROUNDS):
        everyone = dist.new_group(backend="fairring", timeout=TIMEOUT)
        pairs = [dist.new_group([r, (r + 1) % world], backend="fairring", timeout=TIMEOUT) for r in range(world)]
        t = torch.full((8,), float(rank + k))
        dist.all_reduce(t, group=everyone)
        assert torch.equal(t, torch.full((8,), float(sum(range(world)) + world * k)))
        # Each pair in turn (a rank is in two): no pair waits on another.
        for r, g in enumerate(pairs):
            if rank in (r, (r + 1) % world):
                u = torch.full((4,), float(r))
                dist.all_reduce(u, group=g)
                assert torch.equal(u, torch.full((4,), float(2 * r if world > 1 else r))), (r, u)
        for dim in ("dp", "tp"):
            v = torch.ones(2)
            dist.all_reduce(v, group=mesh.get_group(dim))
            assert torch.equal(v, torch.full((2,), float(mesh.get_group(dim).size())))
        # Messages around the ring, on the subgroup of all ranks.
        w = torch.empty(3)
        reqs = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, torch.full((3,), float(rank + k)), nxt, group=everyone),
                dist.P2POp(dist.irecv, w, prv, group=everyone),
            ]
        )
        for r in reqs:
            r.wait()
        assert torch.equal(w, torch.full((3,), float(prv + k)))
        for g in [everyone, *pairs]:
            dist.destroy_process_group(g)
        gc.collect()
        # Threads the teardown joined or let go may take a moment to exit.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(n > b for n, b in zip(resources(), baseline)):
            time.sleep(0.05)
        now = resources()
        # Nothing more than before (one of torch's descriptors may close).
        assert all(n <= b for n, b in zip(now, baseline)), (
            f"round {k}: threads, fds, segments {now}, before {baseline}"
        )
    dist.destroy_process_group()


def test_subgroups_and_their_messages_in_a_loop_leave_nothing_behind(tmp_path):
    spawn(rounds, 4, str(tmp_path / "store"))
