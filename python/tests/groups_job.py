"""A job of 4 processes, run under torchrun by test_jobs.py: three rounds of
building the default fairring group and destroying it again in the same
process, each round with subgroups (two explicit ones, `new_subgroups`, a 2-D
and a 1-D device mesh) all-reducing, and no fairring thread left behind after
the last."""

import os
import threading

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fairring  # noqa: F401  (registers the backend)


def check(t, want, what):
    assert torch.equal(t, torch.full_like(t, float(want))), f"{what}: {t.tolist()} != {want}"


def one_round(k):
    dist.init_process_group("fairring")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4, world
    t = torch.ones(4)
    dist.all_reduce(t)
    check(t, world, f"round {k}: the default group")
    first = dist.new_group([0, 1])
    rest = dist.new_group([1, 2, 3])
    if rank in (0, 1):
        x = torch.full((3,), float(rank))
        dist.all_reduce(x, group=first)
        check(x, 1, f"round {k}: group [0, 1]")
    if rank in (1, 2, 3):
        x = torch.full((3,), float(rank))
        dist.all_reduce(x, group=rest)
        check(x, 6, f"round {k}: group [1, 2, 3]")
    pair, _ = dist.new_subgroups(group_size=2)
    x = torch.full((2,), float(rank))
    dist.all_reduce(x, group=pair)
    check(x, 1 if rank < 2 else 5, f"round {k}: new_subgroups")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    for name in ("dp", "tp"):
        y = torch.ones(2)
        dist.all_reduce(y, group=mesh.get_group(name))
        check(y, 2, f"round {k}: mesh dimension {name}")
    flat = init_device_mesh("cpu", (world,))
    z = torch.ones(1)
    dist.all_reduce(z, group=flat.get_group())
    check(z, world, f"round {k}: a 1-D mesh")
    dist.destroy_process_group()


def main():
    for k in range(3):
        one_round(k)
    left = [t.name for t in threading.enumerate() if t.name.startswith("fairring")]
    assert not left, f"threads left behind: {left}"
    print(f"GROUPS DONE {os.environ['RANK']}", flush=True)


if __name__ == "__main__":
    main()
