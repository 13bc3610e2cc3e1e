"""DDP on fairring against DDP on gloo: the same model, data and optimizer,
parameters compared after every one of 10 steps. Bitwise on 2 ranks (a sum of
two floats does not depend on order); on 4 ranks within 1e-6 relative (float
sums in another order). The same through `fairring.allreduce_hook` on a job
whose default group is gloo."""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fairring
from conftest import TIMEOUT, spawn

STEPS = 10


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 8),
    )


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)


def train_side_by_side(rank, world, port, mode):
    default = "gloo" if mode == "hook" else "fairring"
    dist.init_process_group(
        default,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=TIMEOUT,
    )
    other = dist.new_group(backend="fairring" if mode == "hook" else "gloo")
    base = model()
    # Rank-dependent start: DDP's broadcast from rank 0 must fix it.
    with torch.no_grad():
        for p in base.parameters():
            p.add_(rank)
    if mode == "hook":
        theirs = DDP(copy.deepcopy(base))  # gloo, DDP's own all-reduce
        ours = DDP(copy.deepcopy(base))
        ours.register_comm_hook(other, fairring.allreduce_hook)
    else:
        ours = DDP(copy.deepcopy(base))  # the default group: fairring
        theirs = DDP(copy.deepcopy(base), process_group=other)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ours, theirs)]
    worst = 0.0
    for step in range(STEPS):
        x, y = batch(rank, step)
        for m, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
        for a, b in zip(ours.parameters(), theirs.parameters()):
            if world == 2:
                assert torch.equal(a, b), f"step {step}: {(a - b).abs().max()}"
            else:
                assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), f"step {step}"
            worst = max(worst, (a - b).abs().max().item())
    # Every rank holds the same parameters.
    flat = torch.cat([p.detach().reshape(-1) for p in ours.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat, group=other if mode != "hook" else None)
    for g in gathered:
        assert torch.equal(g, flat)
    print(f"rank {rank} ({mode}, {world} ranks): largest difference from gloo {worst:.3g}")
    del ours, theirs
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_matches_gloo(world):
    spawn(train_side_by_side, world, "backend")


@pytest.mark.parametrize("world", [2, 4])
def test_the_comm_hook_matches_gloo(world):
    spawn(train_side_by_side, world, "hook")
