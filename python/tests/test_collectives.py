"""Every collective through torch.distributed's public API on a fairring group,
compared with gloo (where gloo implements the case) and with a reference
computed on each rank, on 2 and 4 processes, for every dtype and op the backend
accepts. Refusals name what they refuse."""

import datetime
import time

import pytest
import torch
import torch.distributed as dist

import fairring  # noqa: F401  (registers the backend)
from conftest import TIMEOUT, spawn

R = dist.ReduceOp
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.int8,
]
OPS = [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX]


def rank_input(rank, n, dtype, salt=0):
    """Small values, distinct per rank, that every dtype and op holds exactly
    when reduced over 4 ranks (so integer wrapping and float rounding stay out
    of the comparison, except float summation order, which is compared with a
    tolerance)."""
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype.is_floating_point:
        return (torch.randint(-8, 9, (n,), generator=g).to(dtype)) / 4
    return torch.randint(1, 4, (n,), generator=g).to(dtype)


def reference(inputs, op):
    stack = torch.stack([t.double() for t in inputs])
    if op == R.SUM:
        return stack.sum(0)
    if op == R.AVG:
        return stack.mean(0)
    if op == R.PRODUCT:
        return stack.prod(0)
    if op == R.MIN:
        return stack.min(0).values
    return stack.max(0).values


def close(a, b, dtype, world):
    if not dtype.is_floating_point or world == 2:
        return torch.equal(a, b)
    # Four ranks: float sums may be added in another order.
    tol = {torch.float16: 1e-2, torch.bfloat16: 2e-2}.get(dtype, 1e-6)
    return torch.allclose(a.double(), b.double(), rtol=tol, atol=tol)


def collectives(rank, world, port):
    dist.init_process_group(
        "fairring",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=TIMEOUT,
    )
    gloo = dist.new_group(backend="gloo")
    compared = {"gloo": 0, "reference only": 0}
    n = 1003
    for dtype in DTYPES:
        for op in OPS:
            if op == R.AVG and not dtype.is_floating_point:
                with pytest.raises(RuntimeError, match="avg"):
                    dist.all_reduce(rank_input(rank, n, dtype), op=op)
                continue
            mine = rank_input(rank, n, dtype)
            expected = reference([rank_input(r, n, dtype) for r in range(world)], op).to(dtype)
            t = mine.clone()
            dist.all_reduce(t, op=op)
            assert close(t, expected, dtype, world), (dtype, op, t[:5], expected[:5])
            g = mine.clone()
            try:
                dist.all_reduce(g, op=op, group=gloo)
                compared["gloo"] += 1
                assert close(t, g, dtype, world), (dtype, op, "vs gloo", t[:5], g[:5])
            except RuntimeError:
                compared["reference only"] += 1  # gloo does not implement it
        # Byte-moving collectives: bit-exact, every dtype.
        for root in range(world):
            b = rank_input(rank, 77, dtype, salt=root)
            dist.broadcast(b, src=root)
            assert torch.equal(b, rank_input(root, 77, dtype, salt=root)), (dtype, root)
        outs = [torch.empty(33, dtype=dtype) for _ in range(world)]
        dist.all_gather(outs, rank_input(rank, 33, dtype))
        for r, o in enumerate(outs):
            assert torch.equal(o, rank_input(r, 33, dtype)), (dtype, r)
        flat = torch.empty(world * 33, dtype=dtype)
        dist.all_gather_into_tensor(flat, rank_input(rank, 33, dtype))
        assert torch.equal(flat, torch.cat([rank_input(r, 33, dtype) for r in range(world)]))
        # In place: the input is this rank's part of the output.
        flat = torch.zeros(world * 33, dtype=dtype)
        flat[rank * 33 : (rank + 1) * 33] = rank_input(rank, 33, dtype)
        dist.all_gather_into_tensor(flat, flat[rank * 33 : (rank + 1) * 33])
        assert torch.equal(flat, torch.cat([rank_input(r, 33, dtype) for r in range(world)]))
        for op in [R.SUM, R.MAX] + ([R.AVG] if dtype.is_floating_point else []):
            full = [rank_input(rank, 40 * world, dtype, salt=9)]
            expected = reference(
                [rank_input(r, 40 * world, dtype, salt=9) for r in range(world)], op
            ).to(dtype)[rank * 40 : (rank + 1) * 40]
            out = torch.empty(40, dtype=dtype)
            before = full[0].clone()
            dist.reduce_scatter_tensor(out, full[0], op=op)
            assert close(out, expected, dtype, world), (dtype, op)
            assert torch.equal(full[0], before), "reduce_scatter_tensor changed its input"
            out2 = torch.empty(40, dtype=dtype)
            dist.reduce_scatter(out2, list(full[0].chunk(world)), op=op)
            assert torch.equal(out, out2), (dtype, op)
    # Coalesced, non-contiguous, async, barrier.
    ts = [rank_input(rank, n, torch.float32, salt=s) for s in range(5)]
    work = dist.all_reduce_coalesced(ts, async_op=True)
    work.wait()
    for s in range(5):
        inputs = [rank_input(r, n, torch.float32, salt=s) for r in range(world)]
        assert close(ts[s], reference(inputs, R.SUM).float(), torch.float32, world), s
    strided = rank_input(rank, 200, torch.float64).view(20, 10).t()
    assert not strided.is_contiguous()
    dist.all_reduce(strided)
    expected = reference([rank_input(r, 200, torch.float64) for r in range(world)], R.SUM)
    assert torch.equal(strided, expected.view(20, 10).t())
    works = [dist.all_reduce(torch.full((1000,), float(i)), async_op=True) for i in range(20)]
    for w in works:
        assert w.wait()
    # A bounded wait that passes raises; the operation still completes.
    if rank != 0:
        time.sleep(1)  # rank 0's all-reduce cannot finish before this rank's starts
    late = dist.all_reduce(torch.ones(4), async_op=True)
    if rank == 0:
        with pytest.raises(RuntimeError, match="did not finish within 0.1 s"):
            late.wait(datetime.timedelta(milliseconds=100))
    assert late.wait(datetime.timedelta(seconds=30))
    fut = dist.all_reduce(torch.ones(4), async_op=True).get_future()
    assert torch.equal(fut.wait()[0], torch.full((4,), float(world)))
    dist.barrier()
    # Refusals name the op or the call; the group keeps working after them.
    with pytest.raises(ValueError, match="BAND"):
        dist.all_reduce(torch.ones(3, dtype=torch.int32), op=R.BAND)
    with pytest.raises(TypeError, match="bool"):
        dist.all_reduce(torch.ones(3, dtype=torch.bool))
    with pytest.raises(NotImplementedError, match="send"):
        dist.send(torch.ones(1), dst=(rank + 1) % world)
    with pytest.raises(NotImplementedError, match="all_to_all_single"):
        dist.all_to_all_single(torch.empty(world), torch.ones(world))
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(world)))
    assert compared["gloo"] > 0
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_every_collective_against_gloo(world):
    spawn(collectives, world)
