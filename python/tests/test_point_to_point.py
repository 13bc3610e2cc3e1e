"""Point-to-point and all-to-all through torch.distributed on a fairring
group: send/recv and isend/irecv of every dtype (non-contiguous too), messages
between a pair in order, both directions at once, a ring exchange and a
pipeline schedule of `batch_isend_irecv` over 4 ranks for 20 microbatches;
`all_to_all_single` with random unequal splits and the list form on 2, 3 and
4 ranks; all checked against values computed on each rank. A receive of
another size, and splits that disagree, fail naming both sides; a sender
killed mid-job fails its receiver naming it; tags match their own receives
whatever order they are posted in;
receives from any rank are refused naming the call."""

import datetime
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import fairring  # noqa: F401  (registers the backend)
from conftest import TIMEOUT, _bounded, free_port, spawn
from test_collectives import DTYPES, rank_input

MICROBATCHES = 20


def init(rank, world, port):
    dist.init_process_group(
        "fairring",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=TIMEOUT,
    )


def resources():
    """This process's threads and open file descriptors."""
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def pairs(rank, world, port, path):
    torch.set_num_threads(1)  # no intra-op threads of torch's own to count
    baseline = resources()
    # A file store: a TCP store's server leaves a pipe of its own behind.
    dist.init_process_group(
        "fairring", init_method=f"file://{path}", rank=rank, world_size=world, timeout=TIMEOUT
    )
    # Every dtype, from each rank to each other, blocking and async.
    for dtype in DTYPES:
        for src in range(world):
            for dst in range(world):
                if src == dst:
                    continue
                salt = 10 * src + dst
                if rank == src:
                    dist.send(rank_input(src, 37, dtype, salt=salt), dst)
                elif rank == dst:
                    got = torch.empty(37, dtype=dtype)
                    dist.recv(got, src)
                    assert torch.equal(got, rank_input(src, 37, dtype, salt=salt)), (dtype, src)
    # Several messages in flight between a pair arrive in order; a
    # non-contiguous receive is copied back; a 0-element message.
    if rank == 0:
        works = [dist.isend(torch.full((100,), float(i)), 1) for i in range(10)]
        works.append(dist.isend(torch.arange(12.0).view(3, 4).t().contiguous(), 1))
        works.append(dist.isend(torch.empty(0), 1))
        for w in works:
            w.wait()
    elif rank == 1:
        bufs = [torch.empty(100) for _ in range(10)]
        works = [dist.irecv(b, 0) for b in bufs]
        strided = torch.empty(3, 4).t()
        works.append(dist.irecv(strided, 0))
        works.append(dist.irecv(torch.empty(0), 0))
        for w in reversed(works):
            w.wait()
        for i, b in enumerate(bufs):
            assert torch.equal(b, torch.full((100,), float(i))), i
        assert torch.equal(strided, torch.arange(12.0).view(3, 4).t())
    # Both directions at once, and a ring exchange, through batch_isend_irecv.
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    out, inb = torch.full((5,), float(rank)), torch.empty(5)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, out, nxt), dist.P2POp(dist.irecv, inb, prv)])
    for r in reqs:
        r.wait()
    assert torch.equal(inb, torch.full((5,), float(prv)))
    # Refusals name the call or the peer; the group keeps working after them.
    with pytest.raises(NotImplementedError, match="any source"):
        dist.recv(torch.empty(1))
    with pytest.raises(ValueError, match="peer"):
        dist.group.WORLD.send([torch.ones(1)], rank, 0)
    t = torch.ones(3)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((3,), float(world)))
    dist.destroy_process_group()
    # Messages' state went with the group: no thread or descriptor is left.
    deadline = time.monotonic() + 10
    while resources() != baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert resources() == baseline, (resources(), baseline)


@pytest.mark.parametrize("world", [2, 3])
def test_send_recv_between_every_pair(tmp_path, world):
    spawn(pairs, world, str(tmp_path / "store"))


def pipeline(rank, world, port):
    """A pipeline of `world` stages: each microbatch's activation goes
    forward stage by stage, its gradient back; every stage posts its sends
    and receives of a step together (batch_isend_irecv)."""
    init(rank, world, port)
    stage = lambda k, s: torch.full((64, 16), float(1000 * k + s))  # noqa: E731
    for k in range(MICROBATCHES):
        ops, activation, gradient = [], torch.empty(64, 16), torch.empty(64, 16)
        if rank > 0:
            ops.append(dist.P2POp(dist.irecv, activation, rank - 1))
        if rank < world - 1:
            ops.append(dist.P2POp(dist.isend, stage(k, rank), rank + 1))
        for r in dist.batch_isend_irecv(ops) if ops else []:
            r.wait()
        if rank > 0:
            assert torch.equal(activation, stage(k, rank - 1)), (k, rank)
        ops = []
        if rank < world - 1:
            ops.append(dist.P2POp(dist.irecv, gradient, rank + 1))
        if rank > 0:
            ops.append(dist.P2POp(dist.isend, -stage(k, rank), rank - 1))
        for r in dist.batch_isend_irecv(ops) if ops else []:
            r.wait()
        if rank < world - 1:
            assert torch.equal(gradient, -stage(k, rank + 1)), (k, rank)
    dist.barrier()
    dist.destroy_process_group()


def test_a_pipeline_schedule_of_batch_isend_irecv_on_4_ranks():
    spawn(pipeline, 4)


def tags(rank, world, port):
    """Rank 0 sends tags 5, 3 and 5 again; rank 1 receives tag 3 first: each
    receive gets the send of its own tag, in order within a tag."""
    init(rank, world, port)
    if rank == 0:
        for r in [dist.isend(torch.full((4,), v), 1, tag=t) for v, t in [(1.0, 5), (2.0, 3), (3.0, 5)]]:
            r.wait()
    else:
        got = {k: torch.zeros(4) for k in ("3", "5a", "5b")}
        works = [
            dist.irecv(got["3"], 0, tag=3),
            dist.irecv(got["5a"], 0, tag=5),
            dist.irecv(got["5b"], 0, tag=5),
        ]
        for w in works:
            w.wait()
        assert [got[k][0].item() for k in ("3", "5a", "5b")] == [2.0, 1.0, 3.0], got
    with pytest.raises(ValueError, match="tag"):
        dist.send(torch.ones(1), 1 - rank, tag=-1)
    dist.barrier()
    dist.destroy_process_group()


def test_messages_match_their_own_tag():
    spawn(tags, 2)


def mismatched(rank, world, port):
    init(rank, world, port)
    if rank == 0:
        work = dist.isend(torch.ones(10), 1)
    else:
        work = dist.irecv(torch.empty(12), 0)
    with pytest.raises(fairring.FairringError) as failed:
        work.wait()
    text = str(failed.value)
    assert "10 x f32" in text and "12 x f32" in text, text
    dist.destroy_process_group()


def test_a_receive_of_another_size_fails_naming_both():
    spawn(mismatched, 2)


def splits(world, seed):
    """Random splits every rank computes alike: rows[i][j] from rank i to j."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 7, (world, world), generator=g).tolist()


def block(i, j, rows, dtype, seed):
    """The block rank i sends rank j: distinct per pair and seed."""
    return rank_input(i, rows * 3, dtype, salt=1000 * seed + 10 * j).view(rows, 3)


def exchanges(rank, world, port):
    init(rank, world, port)
    for seed, dtype in enumerate([torch.float32, torch.int64, torch.bfloat16, torch.bool, torch.complex64]):
        rows = splits(world, seed)
        mine = [block(rank, j, rows[rank][j], dtype, seed) for j in range(world)]
        want = [block(i, rank, rows[i][rank], dtype, seed) for i in range(world)]
        # all_to_all_single with unequal splits.
        out = torch.empty(sum(rows[i][rank] for i in range(world)), 3, dtype=dtype)
        dist.all_to_all_single(
            out,
            torch.cat(mine),
            output_split_sizes=[rows[i][rank] for i in range(world)],
            input_split_sizes=rows[rank],
        )
        assert torch.equal(out, torch.cat(want)), (dtype, seed)
        # The list form, into non-contiguous outputs.
        outs = [torch.empty(3, rows[i][rank], dtype=dtype).t() for i in range(world)]
        dist.all_to_all(outs, mine)
        for i in range(world):
            assert torch.equal(outs[i], want[i]), (dtype, seed, i)
    # Equal splits (no sizes given), async.
    x = torch.arange(world * 4, dtype=torch.float64) + 100 * rank
    y = torch.empty_like(x)
    dist.all_to_all_single(y, x, async_op=True).wait()
    expected = torch.cat([torch.arange(rank * 4, rank * 4 + 4, dtype=torch.float64) + 100 * i for i in range(world)])
    assert torch.equal(y, expected)
    # Splits that do not add up are refused naming the argument.
    with pytest.raises(ValueError, match="input_split_sizes"):
        dist.all_to_all_single(torch.empty(world), torch.ones(world), input_split_sizes=[5] * world)
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_to_all_with_random_splits(world):
    spawn(exchanges, world)


def mismatched_splits(rank, world, port):
    init(rank, world, port)
    # Rank 0 sends rank 1 three rows; rank 1 expects two.
    rows_in = [[1, 3], [2, 2]][rank]
    rows_out = [[1, 2], [2, 2]][rank]
    with pytest.raises(fairring.FairringError) as failed:
        dist.all_to_all_single(
            torch.empty(sum(rows_out)),
            torch.ones(sum(rows_in)),
            output_split_sizes=rows_out,
            input_split_sizes=rows_in,
        )
    text = str(failed.value)
    assert "3 x f32" in text and "2 x f32" in text, text
    dist.destroy_process_group()


def test_splits_that_disagree_fail_naming_both():
    spawn(mismatched_splits, 2)


def killed(rank, world, port):
    dist.init_process_group(
        "fairring",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=20),
    )
    # Both ways linked (one message each) before rank 1 dies.
    if rank == 1:
        dist.recv(torch.empty(4), 0)
        dist.send(torch.ones(4), 0)
        os.kill(os.getpid(), signal.SIGKILL)
    dist.send(torch.ones(4), 1)
    dist.recv(torch.empty(4), 1)
    start = time.monotonic()
    with pytest.raises(fairring.FairringError) as failed:
        dist.recv(torch.empty(1 << 20), 1)
    took = time.monotonic() - start
    text = str(failed.value)
    # The error names the sender in the group's numbering.
    assert "from rank 1" in text and "rank 1: " in text, text
    assert took < 20, took
    os._exit(0)  # the group cannot be torn down cleanly with a peer gone


def test_a_killed_sender_fails_its_receiver_naming_it():
    ctx = torch.multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_bounded, args=(r, killed, 2, port)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert procs[1].exitcode == -signal.SIGKILL
    assert procs[0].exitcode == 0, "the receiver did not raise naming the sender"
