"""The backend's CUDA path (`_device_collectives`, `DeviceWork`, the side
stream's write-backs) run end to end without a GPU.

The pieces only CUDA has are replaced by stand-ins: the current and side
streams, events, the CUDA-aware future, the allocator's stream record, and
the memory the calls describe, which becomes host memory so that the engine
runs every call the device path makes on CPU tensors. What remains is the
device path's own logic: which engine calls it makes, with which counts,
types and roots, what it copies back and where, how its `Work` and future
finish, that the side stream is made to wait for every operation on the
device (`fr_work_enqueue_wait`, the real export: on a communicator with no
device side it waits on the host, which keeps the results here exact), and
that `wait()` orders the current stream without ever blocking the host.
`test_cuda.py` runs the real thing on a GPU.
"""

import contextlib
import os
import threading

import torch
import torch.distributed as dist

from conftest import TIMEOUT, spawn

# The side stream's handle, as the stand-in hands it to the library.
SIDE = 0x5EED


class _Stream:
    cuda_stream = 0

    def __init__(self, *args, **kwargs):
        self.waited = []

    def wait_event(self, event):
        assert event.recorded, "a stream waited for an event never recorded"
        self.waited.append(event)


class _SideStream(_Stream):
    cuda_stream = SIDE


# What the device path did, as the stand-ins saw it.
seen = {"side_waits": 0, "other_waits": 0, "host_blocked_in_wait": 0}
_in_wait = threading.local()


class _Event:
    def __init__(self, *args, **kwargs):
        self.recorded = False

    def record(self, stream=None):
        self.recorded = True

    def query(self):
        return self.recorded


def _stand_ins():
    """Makes this process's fairring take the device path for CPU tensors."""
    # Every call through the Python group, where the stand-ins are.
    os.environ["FAIRRING_TORCH_CALLS"] = "python"
    from fairring import _backend, _cuda, _device_collectives, _native, _work

    def check(self, what, tensors):
        assert all(t.device.type == "cpu" for t in tensors), what
        self.index = 0

    _cuda.GroupDevice.check = check
    _cuda.GroupDevice.current_stream = lambda self: _Stream()
    _cuda.GroupDevice.side_stream = lambda self: _SideStream()
    _backend.any_cuda = lambda tensors: True
    _device_collectives._record = lambda tensor, stream: None
    # The engine runs the described calls on host memory.
    _native.MEMORY_DEVICE = _native.MEMORY_HOST
    # The side stream waits for every operation on the device, through the
    # library's own export.
    enqueue_wait = _native.lib().fr_work_enqueue_wait

    def counted_enqueue_wait(work, stream):
        side = getattr(stream, "value", stream) == SIDE
        seen["side_waits" if side else "other_waits"] += 1
        return enqueue_wait(work, stream)

    _native.lib().fr_work_enqueue_wait = counted_enqueue_wait
    # `DeviceWork.wait()` without a timeout never blocks the host on the
    # operation.
    device_wait = _work.DeviceWork.wait
    wait_here = _work._Pending.wait_here

    def flagged_wait(self, *args, **kwargs):
        _in_wait.on = True
        try:
            return device_wait(self, *args, **kwargs)
        finally:
            _in_wait.on = False

    def watched_wait_here(self, seconds):
        if getattr(_in_wait, "on", False):
            seen["host_blocked_in_wait"] += 1
        return wait_here(self, seconds)

    _work.DeviceWork.wait = flagged_wait
    _work._Pending.wait_here = watched_wait_here
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.Event = _Event
    torch.cuda.current_stream = lambda device=None: _Stream()
    _work._future_on = lambda device: torch.futures.Future()


def device_path(rank, world, port):
    _stand_ins()
    dist.init_process_group(
        "fairring", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=TIMEOUT,
    )
    n = 257
    total = world * (world + 1) / 2
    t = torch.full((n,), rank + 1.0)
    w = dist.all_reduce(t, async_op=True)
    assert seen["side_waits"] == 1, f"the all-reduce did not take the device path: {seen}"
    w.wait()
    assert torch.equal(t, torch.full((n,), total)), "all_reduce"
    assert w.is_completed()

    # A column of a matrix: reduced in a contiguous copy, copied back in place.
    m = torch.zeros(n, 2)
    m[:, 0] = rank + 1.0
    dist.all_reduce(m[:, 0])
    assert torch.equal(m[:, 0], torch.full((n,), total)) and not m[:, 1].any(), "strided"

    b = torch.arange(n, dtype=torch.int64) + 100 * rank
    dist.broadcast(b, src=world - 1)
    assert torch.equal(b, torch.arange(n) + 100 * (world - 1)), "broadcast"

    mine = torch.arange(n, dtype=torch.float16) + rank
    outs = [torch.empty(n, dtype=torch.float16) for _ in range(world)]
    dist.all_gather(outs, mine)
    assert all(torch.equal(o, torch.arange(n, dtype=torch.float16) + r) for r, o in enumerate(outs))
    flat = torch.empty(world * n, dtype=torch.float16)
    dist.all_gather_into_tensor(flat, mine)
    assert torch.equal(flat, torch.cat(outs)), "all_gather_into_tensor"

    parts = [torch.full((n,), float(rank * world + r)) for r in range(world)]
    out = torch.empty(n)
    dist.reduce_scatter(out, parts)
    want = sum(float(q * world + rank) for q in range(world))
    assert torch.equal(out, torch.full((n,), want)), "reduce_scatter"
    whole = torch.cat(parts)
    out.zero_()
    dist.reduce_scatter_tensor(out, whole, op=dist.ReduceOp.MAX)
    assert torch.equal(out, torch.full((n,), float((world - 1) * world + rank))), "max"
    assert torch.equal(whole, torch.cat(parts)), "reduce_scatter_tensor changed its input"

    r = torch.full((n,), rank + 1, dtype=torch.int32)
    dist.reduce(r, dst=0)
    if rank == 0:
        assert torch.equal(r, torch.full((n,), int(total), dtype=torch.int32)), "reduce"
    else:
        assert torch.equal(r, torch.full((n,), rank + 1, dtype=torch.int32)), "reduce's input"

    got = [torch.empty(n, dtype=torch.int32) for _ in range(world)] if rank == 1 else None
    dist.gather(torch.full((n,), rank, dtype=torch.int32), gather_list=got, dst=1)
    if rank == 1:
        assert all(torch.equal(g, torch.full((n,), q, dtype=torch.int32)) for q, g in enumerate(got))

    part = torch.empty(n, dtype=torch.bool)
    source = [torch.full((n,), q % 2 == 0) for q in range(world)] if rank == 0 else None
    dist.scatter(part, scatter_list=source, src=0)
    assert torch.equal(part, torch.full((n,), rank % 2 == 0)), "scatter"

    # Coalesced: one engine call per tensor under one work.
    ts = [torch.full((n + k,), rank + 1.0) for k in range(3)]
    dist.all_reduce_coalesced(ts, async_op=True).wait()
    for t in ts:
        assert torch.equal(t, torch.full_like(t, total)), f"coalesced {t.numel()}"

    # PREMUL_SUM: this rank's contribution scaled first, the caller's
    # reduce-scatter input untouched.
    op = dist._make_nccl_premul_sum(0.5)
    p = torch.full((n,), rank + 1.0)
    dist.all_reduce(p, op=op)
    assert torch.equal(p, torch.full((n,), total / 2)), "premul all_reduce"
    whole = torch.full((world * n,), rank + 1.0)
    out = torch.empty(n)
    dist.reduce_scatter_tensor(out, whole, op=op)
    assert torch.equal(out, torch.full((n,), total / 2)), "premul reduce_scatter"
    assert torch.equal(whole, torch.full((world * n,), rank + 1.0)), "premul scaled the input"

    u = torch.full((n,), rank + 1.0)
    doubled = dist.all_reduce(u, async_op=True).get_future().then(lambda f: f.value()[0] * 2)
    assert torch.equal(doubled.wait(), torch.full((n,), 2 * total)), "the future"

    # Each of the 14 works above (every collective; the coalesced all-reduce
    # one work over its three calls) ordered the side stream after itself on
    # the device, no other stream was made to wait, and no wait() blocked the
    # host.
    assert seen["side_waits"] == 14, seen
    assert seen["other_waits"] == 0, seen
    assert seen["host_blocked_in_wait"] == 0, seen
    # A wait with a timeout waits on the host too, up to it.
    w = dist.all_reduce(torch.ones(n), async_op=True)
    import datetime

    assert w.wait(timeout=datetime.timedelta(seconds=30))
    assert seen["host_blocked_in_wait"] == 1, seen

    dist.destroy_process_group()


def test_the_device_path_runs_every_collective_exact_with_stand_ins_for_cuda():
    for world in (2, 3):
        spawn(device_path, world)
