"""CUDA tensors through `torch.distributed` on a fairring group, on a machine
with a GPU (skipped elsewhere, saying why): processes sharing GPU 0 as
machines of their own (`FAIRRING_HOST_ID`), and as two ranks of one machine
(NCCL's multi-rank mode, or the host path where NCCL refuses).

- every collective the engine has a device form of, on CUDA tensors, against a
  reference computed on the CPU, for every dtype and operator the backend takes;
- stream semantics: a slow kernel on the current stream writes the input
  before the collective (the caller does not wait for it), a kernel after
  `wait()` reads the result; `get_future().then(...)` sees the result;
- DDP for 10 steps against gloo on CUDA tensors (bitwise on 2 ranks), and DDP
  on gloo with its buckets averaged by `fairring.allreduce_hook`; FSDP2
  (`fully_shard`) for 10 steps against the same model trained on one rank on
  the mean of every rank's gradients;
- a rank killed mid-training: the survivors raise naming it within the
  timeout, no hang, no crash;
- a rank passing CPU tensors where another passes CUDA tensors: both fail
  with a mismatch;
- a loop of 1000 all-reduces on fresh tensors (the stream synchronised each
  time) leaves the caching allocator's reserved memory flat;
- calls that wait for the whole device (emptying the allocator's cache,
  freeing, a kernel's first launch) made while the current stream waits for
  an operation a slow rank has yet to join: no hang, exact results;
- refusals: all-to-all and messages on CUDA tensors, a collective during a
  CUDA graph capture, each naming itself.
"""

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fairring
from conftest import TIMEOUT, spawn
from test_jobs import kill_rank_1_of_3
from test_collectives import DTYPES, OPS, close, defined, rank_input, reference

pytestmark = pytest.mark.skipif(
    not fairring.cuda_available(), reason=f"needs a CUDA device: {fairring.cuda_status()}"
)

R = dist.ReduceOp
LAYOUTS = [("machines", 2), ("one-machine", 2), ("machines", 3)]


def join(rank, world, port, layout, backend="fairring"):
    if layout == "machines":
        os.environ["FAIRRING_HOST_ID"] = f"machine-{rank}"
    else:
        os.environ["NCCL_MULTI_RANK_GPU_ENABLE"] = "1"
    torch.cuda.set_device(0)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=TIMEOUT
    )


def every_collective(rank, world, port, layout):
    join(rank, world, port, layout)
    dev = torch.device("cuda", 0)
    n = 1001
    wrong = []
    for dtype in DTYPES:
        inputs = [rank_input(r, n, dtype) for r in range(world)]
        for op in [o for o in OPS if defined(o, dtype)]:
            t = inputs[rank].to(dev)
            dist.all_reduce(t, op=op)
            want = reference(inputs, op).to(dtype)
            if not close(t.cpu(), want, dtype, world):
                wrong.append(f"all_reduce {dtype} {op}")
            # Reduce-scatter of world blocks, each block's reduction.
            full = torch.cat([rank_input(r, n * world, dtype, salt=1) for r in range(world)])
            mine = full.view(world, -1)[rank].to(dev)
            out = torch.empty(n, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(out, mine, op=op)
            parts = [full.view(world, -1)[r].view(world, n)[rank] for r in range(world)]
            if not close(out.cpu(), reference(parts, op).to(dtype), dtype, world):
                wrong.append(f"reduce_scatter_tensor {dtype} {op}")
            t = inputs[rank].to(dev)
            dist.reduce(t, dst=world - 1, op=op)
            if rank == world - 1 and not close(t.cpu(), want, dtype, world):
                wrong.append(f"reduce {dtype} {op}")
        # Moving bytes: broadcast, all-gather (both forms), gather, scatter.
        t = inputs[rank].to(dev)
        dist.broadcast(t, src=1)
        if not torch.equal(t.cpu(), inputs[1]):
            wrong.append(f"broadcast {dtype}")
        out = torch.empty(world * n, dtype=dtype, device=dev)
        dist.all_gather_into_tensor(out, inputs[rank].to(dev))
        if not torch.equal(out.cpu(), torch.cat(inputs)):
            wrong.append(f"all_gather_into_tensor {dtype}")
        outs = [torch.empty(n, dtype=dtype, device=dev) for _ in range(world)]
        dist.all_gather(outs, inputs[rank].to(dev))
        if not all(torch.equal(o.cpu(), i) for o, i in zip(outs, inputs)):
            wrong.append(f"all_gather {dtype}")
        got = [torch.empty(n, dtype=dtype, device=dev) for _ in range(world)] if rank == 0 else None
        dist.gather(inputs[rank].to(dev), gather_list=got, dst=0)
        if rank == 0 and not all(torch.equal(o.cpu(), i) for o, i in zip(got, inputs)):
            wrong.append(f"gather {dtype}")
        part = torch.empty(n, dtype=dtype, device=dev)
        dist.scatter(part, scatter_list=[i.to(dev) for i in inputs] if rank == 0 else None, src=0)
        if not torch.equal(part.cpu(), inputs[rank]):
            wrong.append(f"scatter {dtype}")
    # A tensor that is not contiguous: its result is copied back into place.
    strided = torch.arange(2 * n, dtype=torch.float32, device=dev).view(n, 2).t()[0]
    dist.all_reduce(strided)
    if not torch.equal(strided.cpu(), torch.arange(0, 2 * n, 2, dtype=torch.float32) * world):
        wrong.append("all_reduce of a non-contiguous tensor")
    assert not wrong, f"rank {rank} ({layout}): {wrong}"
    dist.destroy_process_group()


@pytest.mark.parametrize("layout,world", LAYOUTS)
def test_every_collective_on_cuda_tensors_matches_the_reference(layout, world):
    spawn(every_collective, world, layout)


def stream_order(rank, world, port, layout):
    join(rank, world, port, layout)
    dev = torch.device("cuda", 0)
    n = 1 << 20
    t = torch.zeros(n, device=dev)
    # A slow kernel, then the input's write, then the collective: the
    # collective must see the write although the host never waited for it.
    torch.cuda._sleep(50_000_000)
    t.fill_(rank + 1.0)
    w = dist.all_reduce(t, async_op=True)
    w.wait()
    after = t * 2  # on the current stream, after wait(): sees the result
    total = world * (world + 1) / 2
    assert torch.equal(after.cpu(), torch.full((n,), 2 * total)), f"rank {rank}"
    # The future's callback sees the result too.
    u = torch.full((n,), rank + 1.0, device=dev)
    fut = dist.all_reduce(u, async_op=True).get_future().then(lambda f: f.value()[0] * 3)
    assert torch.equal(fut.wait().cpu(), torch.full((n,), 3 * total)), f"rank {rank}"
    dist.destroy_process_group()


@pytest.mark.parametrize("layout,world", LAYOUTS[:2])
def test_collectives_are_ordered_on_the_current_stream(layout, world):
    spawn(stream_order, world, layout)


def device_wide_calls(rank, world, port, layout):
    import time

    join(rank, world, port, layout)
    dev = torch.device("cuda", 0)
    n = 1 << 20
    total = world * (world + 1) / 2
    for round in range(3):
        t = torch.full((n,), rank + 1.0, device=dev)
        if rank == world - 1:
            # The operation cannot end before this rank joins it.
            time.sleep(1.0)
        work = dist.all_reduce(t, async_op=True)
        # The current stream now waits for the operation on the device; the
        # host goes on at once and makes calls that wait for the whole
        # device, as the caching allocator and lazy loading do.
        work.wait()
        torch.cuda.empty_cache()
        scratch = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
        del scratch
        torch.cuda.empty_cache()
        # A kernel this process has not launched yet (a first launch loads its
        # module under lazy loading).
        _ = torch.special.bessel_j0(torch.ones(16, device=dev) * (round + 1))
        after = (t * 2).cpu()
        assert torch.equal(after, torch.full((n,), 2 * total)), f"rank {rank} round {round}"
    dist.destroy_process_group()


@pytest.mark.parametrize("layout,world", LAYOUTS[:2])
def test_device_wide_calls_while_a_stream_waits_for_an_operation_do_not_hang(layout, world):
    spawn(device_wide_calls, world, layout)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def ddp_side_by_side(rank, world, port, layout):
    join(rank, world, port, layout)
    gloo = dist.new_group(backend="gloo")
    dev = torch.device("cuda", 0)
    base = model()
    with torch.no_grad():
        for p in base.parameters():
            p.add_(rank)  # DDP's broadcast from rank 0 must fix it
    ours = DDP(copy.deepcopy(base).to(dev))
    # DDP on gloo, its buckets averaged by fairring's hook on the default group.
    hooked = DDP(copy.deepcopy(base).to(dev), process_group=gloo)
    hooked.register_comm_hook(dist.group.WORLD, fairring.allreduce_hook)
    theirs = DDP(copy.deepcopy(base).to(dev), process_group=gloo)
    models = (ours, hooked, theirs)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    for step in range(10):
        g = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(16, 32, generator=g).to(dev), torch.randn(16, 8, generator=g).to(dev)
        for m, opt in zip(models, opts):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
        for name, m in (("DDP", ours), ("fairring.allreduce_hook", hooked)):
            for a, b in zip(m.parameters(), theirs.parameters()):
                # Three ranks: the engine and gloo add the three gradients in
                # other orders, so a parameter near zero may differ in its
                # last bits; the bound is the CPU test's (test_ddp.py).
                same = torch.equal(a, b) if world == 2 else torch.allclose(a, b, rtol=1e-6, atol=1e-7)
                assert same, (
                    f"rank {rank}, step {step}: {name}'s parameters differ from gloo's "
                    f"by up to {(a - b).abs().max().item():.3g}"
                )
    dist.destroy_process_group()


@pytest.mark.parametrize("layout,world", LAYOUTS)
def test_ddp_on_cuda_matches_gloo(layout, world):
    spawn(ddp_side_by_side, world, layout)


def memory_flat(rank, world, port, layout):
    join(rank, world, port, layout)
    dev = torch.device("cuda", 0)
    for _ in range(100):
        dist.all_reduce(torch.ones(4096, device=dev))
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved(dev)
    for i in range(1000):
        t = torch.full((4096 + i % 7,), 1.0, device=dev)
        dist.all_reduce(t)
        # Without a host wait the loop could run ahead of the GPU and hold
        # many tensors at once, which the allocator would keep reserved.
        torch.cuda.current_stream(dev).synchronize()
    torch.cuda.synchronize()
    after = torch.cuda.memory_reserved(dev)
    assert after <= before + (2 << 20), f"rank {rank}: reserved {before} -> {after} bytes"
    dist.destroy_process_group()


def test_a_thousand_all_reduces_leave_reserved_memory_flat():
    spawn(memory_flat, 2, "machines")


def refusals(rank, world, port, layout):
    join(rank, world, port, layout)
    dev = torch.device("cuda", 0)
    t = torch.ones(8, device=dev)
    with pytest.raises(RuntimeError, match="all_to_all_single on a CUDA tensor"):
        dist.all_to_all_single(torch.empty_like(t), t)
    with pytest.raises(RuntimeError, match="send on a CUDA tensor"):
        dist.send(t, dst=1 - rank)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="captured into a graph"):
        with torch.cuda.graph(graph):
            dist.all_reduce(t)
    dist.all_reduce(t)  # the group goes on
    assert torch.equal(t.cpu(), torch.full((8,), 2.0))
    dist.destroy_process_group()


def test_calls_without_a_device_form_and_graph_captures_are_refused():
    spawn(refusals, 2, "machines")


def fsdp_against_one_rank(rank, world, port, layout):
    from torch.distributed.fsdp import fully_shard

    join(rank, world, port, layout)
    dev = torch.device("cuda", 0)
    sharded = model().to(dev)
    for layer in sharded:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(sharded)
    alone = model().to(dev)  # the reference, trained here on every rank's data
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (sharded, alone)]
    batches = lambda r, step: [  # noqa: E731
        t.to(dev)
        for t in (lambda g: (torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)))(
            torch.Generator().manual_seed(100 * r + step)
        )
    ]
    for step in range(10):
        opts[0].zero_grad()
        x, y = batches(rank, step)
        torch.nn.functional.mse_loss(sharded(x), y).backward()
        opts[0].step()
        # FSDP averages the ranks' gradients: the mean of the ranks' losses.
        opts[1].zero_grad()
        loss = sum(torch.nn.functional.mse_loss(alone(x), y) for x, y in
                   (batches(r, step) for r in range(world))) / world
        loss.backward()
        opts[1].step()
        for a, b in zip(sharded.parameters(), alone.parameters()):
            full = a.full_tensor()
            assert torch.allclose(full, b, rtol=1e-5, atol=1e-6), (
                f"rank {rank}, step {step}: FSDP2's parameters differ from the reference"
            )
    dist.destroy_process_group()


@pytest.mark.parametrize("layout,world", [LAYOUTS[0], LAYOUTS[2]])
def test_fsdp2_on_cuda_matches_one_rank_trained_on_every_batch(layout, world):
    spawn(fsdp_against_one_rank, world, layout)


def mixed(rank, world, port, layout):
    join(rank, world, port, layout)
    t = torch.ones(1024, device="cuda") if rank == 0 else torch.ones(1024)
    # An error on CUDA tensors reaches the host through the future (wait()
    # orders the stream and raises only what is already known).
    with pytest.raises(Exception, match="(?i)mismatch|device memory"):
        dist.all_reduce(t, async_op=True).get_future().wait()
    dist.destroy_process_group()


def test_cpu_tensors_against_cuda_tensors_are_a_mismatch():
    spawn(mixed, 2, "machines")


def test_a_killed_rank_fails_every_cuda_survivor_naming_it():
    # Each rank a machine of its own, so each is the only rank of its machine.
    machine = lambda r: {"FAIRRING_HOST_ID": f"machine-{r}", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    kill_rank_1_of_3("--device", "cuda", env=machine)
