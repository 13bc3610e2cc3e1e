"""Every collective through torch.distributed's public API on a fairring group,
compared with gloo (where gloo implements the case) and with a reference
computed on each rank, on 2 and 4 processes, for every dtype and op the backend
accepts. Refusals name what they refuse."""

import datetime
import functools
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
    torch.int16,
    torch.bool,
]
OPS = [R.SUM, R.AVG, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]
BITWISE = {
    R.BAND: torch.bitwise_and,
    R.BOR: torch.bitwise_or,
    R.BXOR: torch.bitwise_xor,
}


def defined(op, dtype):
    """Whether PyTorch defines `op` on `dtype` (and fairring offers it)."""
    if op == R.AVG:
        return dtype.is_floating_point
    if op in BITWISE:
        return not dtype.is_floating_point
    return True


def rank_input(rank, n, dtype, salt=0):
    """Small values, distinct per rank, that every dtype and op holds exactly
    when reduced over 4 ranks (so integer wrapping and float rounding stay out
    of the comparison, except float summation order, which is compared with a
    tolerance)."""
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).to(dtype)
    if dtype.is_floating_point:
        return (torch.randint(-8, 9, (n,), generator=g).to(dtype)) / 4
    return torch.randint(1, 4, (n,), generator=g).to(dtype)


def reference(inputs, op):
    """`op` over `inputs`, in float64 (int64 for the bitwise operators); a
    bool result converts as PyTorch converts (non-zero is true), so that sum
    and max are or, product and min and."""
    if op in BITWISE:
        return functools.reduce(BITWISE[op], [t.long() for t in inputs])
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
            if not defined(op, dtype):
                name = {R.AVG: "avg", R.BAND: "band", R.BOR: "bor", R.BXOR: "bxor"}[op]
                with pytest.raises(RuntimeError, match=name):
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
        # Rooted collectives, every root: only the root's tensors change.
        for root in range(world):
            for op in [R.SUM, R.MAX] + ([] if dtype.is_floating_point else [R.BXOR]):
                t = rank_input(rank, 51, dtype, salt=root)
                before = t.clone()
                dist.reduce(t, dst=root, op=op)
                if rank == root:
                    inputs = [rank_input(r, 51, dtype, salt=root) for r in range(world)]
                    assert close(t, reference(inputs, op).to(dtype), dtype, world), (dtype, op)
                else:
                    assert torch.equal(t, before), "reduce changed a non-root tensor"
            outs = [torch.empty(19, dtype=dtype) for _ in range(world)] if rank == root else None
            dist.gather(rank_input(rank, 19, dtype, salt=root), outs, dst=root)
            for r in range(world if rank == root else 0):
                assert torch.equal(outs[r], rank_input(r, 19, dtype, salt=root)), (dtype, root, r)
            parts = (
                [rank_input(rank, 23, dtype, salt=100 + r) for r in range(world)]
                if rank == root
                else None
            )
            got = torch.empty(23, dtype=dtype)
            dist.scatter(got, parts, src=root)
            assert torch.equal(got, rank_input(root, 23, dtype, salt=100 + rank)), (dtype, root)
        for op in [R.SUM, R.MAX] + ([R.AVG] if dtype.is_floating_point else [R.BXOR]):
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
    # Gathers and scatters of 2 MiB or more in all move each part once, as a
    # message between its rank and the root; reduces of 2 MiB or more between
    # machines of one rank each run as a chain of messages.
    big = (2 << 20) // (4 * world) + 5
    whole = (2 << 20) // 4 + 3
    for root in range(world):
        for op in [R.SUM, R.MAX]:
            t = rank_input(rank, whole, torch.float32, salt=root)
            before = t.clone()
            dist.reduce(t, dst=root, op=op)
            if rank == root:
                inputs = [rank_input(r, whole, torch.float32, salt=root) for r in range(world)]
                assert close(t, reference(inputs, op).float(), torch.float32, world), (root, op)
            else:
                assert torch.equal(t, before), "reduce changed a non-root tensor"

        outs = [torch.empty(big) for _ in range(world)] if rank == root else None
        dist.gather(rank_input(rank, big, torch.float32, salt=root), outs, dst=root)
        for r in range(world if rank == root else 0):
            assert torch.equal(outs[r], rank_input(r, big, torch.float32, salt=root)), (root, r)
        parts = (
            [rank_input(rank, big, torch.float32, salt=50 + r) for r in range(world)]
            if rank == root
            else None
        )
        got = torch.empty(big)
        dist.scatter(got, parts, src=root)
        assert torch.equal(got, rank_input(root, big, torch.float32, salt=50 + rank)), root
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
    # PREMUL_SUM: each rank's contribution scaled by its factor (a number or
    # a one-element tensor), then summed; a reduce-scatter's input untouched.
    for dtype in [torch.float32, torch.float64, torch.bfloat16, torch.float16]:
        for factor in [0.25, torch.tensor([0.5], dtype=dtype)]:
            op = dist._make_nccl_premul_sum(factor)
            t = rank_input(rank, n, dtype)
            dist.all_reduce(t, op=op)
            inputs = [rank_input(r, n, dtype) * factor for r in range(world)]
            assert close(t, reference(inputs, R.SUM).to(dtype), dtype, world), (dtype, factor)
            full = rank_input(rank, 40 * world, dtype, salt=3)
            before = full.clone()
            out = torch.empty(40, dtype=dtype)
            dist.reduce_scatter_tensor(out, full, op=op)
            inputs = [rank_input(r, 40 * world, dtype, salt=3) * factor for r in range(world)]
            want = reference(inputs, R.SUM).to(dtype)[rank * 40 : (rank + 1) * 40]
            assert close(out, want, dtype, world), (dtype, factor)
            assert torch.equal(full, before), "PREMUL_SUM scaled the caller's input"
    # Object collectives (what checkpointing uses).
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "x": [rank] * rank})
    assert objs == [{"rank": r, "x": [r] * r} for r in range(world)]
    gathered = [None] * world if rank == world - 1 else None
    dist.gather_object(("from", rank), gathered, dst=world - 1)
    if rank == world - 1:
        assert gathered == [("from", r) for r in range(world)]
    received = [None]
    dist.scatter_object_list(received, [f"to {r}" * (r + 1) for r in range(world)], src=1)
    assert received[0] == f"to {rank}" * (rank + 1)
    listed = [rank, {"k": rank}]
    dist.broadcast_object_list(listed, src=world - 1)
    assert listed == [world - 1, {"k": world - 1}]
    # Refusals name the op or the call; the group keeps working after them.
    with pytest.raises(TypeError, match="PREMUL_SUM"):
        dist.all_reduce(torch.ones(3, dtype=torch.int32), op=dist._make_nccl_premul_sum(2.0))
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(world)))
    assert compared["gloo"] > 0
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_every_collective_against_gloo(world):
    spawn(collectives, world)
