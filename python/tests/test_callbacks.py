"""Callbacks on a group's futures may use the group: a blocking collective, or
a wait on another operation's future, inside a ``then`` callback completes (it
once waited forever on the thread that was running the callback), nested
three deep, and many callbacks blocked at once do not hold up each other. A
failed operation raises `fairring.FairringError` itself from ``wait()``. A
collective from a callback that the ranks order differently from the issuing
thread's fails as a mismatch that says why. With FAIRRING_CALLBACKS=caller a
future comes back complete and its callbacks run on the attaching thread; a bad
value is refused naming the variable."""

import datetime
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

import fairring
from conftest import TIMEOUT, spawn


def callbacks(rank, world, port):
    dist.init_process_group(
        "fairring",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=TIMEOUT,
    )

    def nested(depth):
        def callback(fut):
            (got,) = fut.value()
            # A blocking collective, then a wait on another future, on the
            # thread that completed `fut`.
            u = torch.full((4,), float(depth))
            dist.all_reduce(u)
            (v,) = dist.all_reduce(torch.ones(2), async_op=True).get_future().wait()
            assert torch.equal(v, torch.full((2,), float(world)))
            if depth < 3:
                inner = dist.all_reduce(torch.ones(4), async_op=True).get_future()
                inner.then(nested(depth + 1)).wait()
            return got + u

        return callback

    fut = dist.all_reduce(torch.ones(4), async_op=True).get_future()
    out = fut.then(nested(1)).wait()
    assert torch.equal(out, torch.full((4,), float(world) * 2)), out

    # Eight callbacks all blocked at once, each waiting on a later operation.
    started = [dist.all_reduce(torch.full((8,), float(i)), async_op=True) for i in range(8)]
    chained = [
        w.get_future().then(lambda f, i=i: dist.all_reduce(torch.full((2,), float(i))))
        for i, w in enumerate(started)
    ]
    for c in chained:
        c.wait()
    for i, w in enumerate(started):
        assert torch.equal(w.get_future().value()[0], torch.full((8,), float(i * world)))

    dist.destroy_process_group()
    leftover = [t.name for t in threading.enumerate() if t.name.startswith("fairring-")]
    assert not leftover, leftover


def test_collectives_inside_callbacks_complete():
    spawn(callbacks, 2)


def mismatch(rank, world, port):
    dist.init_process_group(
        "fairring",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=TIMEOUT,
    )
    # Different lengths on the two ranks: a mismatch, named on both.
    try:
        dist.all_reduce(torch.ones(4 + rank))
    except fairring.FairringError as e:
        assert "mismatch" in str(e).lower(), e
    else:
        raise AssertionError("a mismatched all-reduce passed")
    # The group has failed: a later call is refused (or, had it started,
    # would fail) with the same error type.
    try:
        dist.all_reduce(torch.ones(4), async_op=True).wait()
    except fairring.FairringError:
        pass
    else:
        raise AssertionError("an all-reduce on a failed group passed")
    dist.destroy_process_group()


def test_a_failed_operation_raises_fairring_error_from_wait():
    spawn(mismatch, 2)


def unwaited(rank, world, port):
    dist.init_process_group(
        "fairring",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=TIMEOUT,
    )
    expected = torch.full((30, 20), float(world))
    # Polled, never waited: is_completed settles it (the non-contiguous
    # tensor's copy back included) without a wait.
    polled = torch.ones(20, 30).t()
    work = dist.all_reduce(polled, async_op=True)
    deadline = time.monotonic() + 30
    while not work.is_completed():
        assert time.monotonic() < deadline, "is_completed never turned true"
        time.sleep(0.0005)
    assert work.is_success() and work.exception() is None
    assert torch.equal(polled, expected)
    # Started and dropped: the group's thread settles it and copies it back.
    dropped = torch.ones(20, 30).t()
    dist.all_reduce(dropped, async_op=True)
    deadline = time.monotonic() + 30
    while not torch.equal(dropped, expected):
        assert time.monotonic() < deadline, "a dropped operation was never copied back"
        time.sleep(0.001)
    # Many in flight, waited in reverse order, each by the caller; a future
    # asked for after the operation finished completes at once.
    works = [dist.all_reduce(torch.full((8,), float(i)), async_op=True) for i in range(200)]
    for w in reversed(works):
        assert w.wait()
    (late,) = works[0].get_future().wait()
    assert torch.equal(late, torch.zeros(8))
    # Waited from two threads at once.
    w = dist.all_reduce(torch.ones(1000), async_op=True)
    t = threading.Thread(target=w.wait)
    t.start()
    assert w.wait()
    t.join()
    dist.destroy_process_group()


def test_operations_settle_whoever_waits_or_polls_and_when_nobody_does():
    spawn(unwaited, 2)


def callback_racing_the_issuing_thread(rank, world, port):
    dist.init_process_group(
        "fairring",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=TIMEOUT,
    )
    store = dist.distributed_c10d._get_default_store()
    errors = []
    if rank == 1:
        # Rank 1 issues from its own thread: the first all-reduce once rank 0
        # has attached its callback (so that callback runs on a group thread,
        # not inline), then 5 elements, then 3.
        store.wait(["attached"])
        dist.all_reduce(torch.ones(4))
        later = []
        try:
            later = [dist.all_reduce(torch.ones(n), async_op=True) for n in (5, 3)]
        except fairring.FairringError as e:
            errors.append(str(e))
        for w in later:
            try:
                w.wait()
            except fairring.FairringError as e:
                errors.append(str(e))
        assert any("mismatch" in e.lower() for e in errors), errors
        dist.destroy_process_group()
        return
    # Rank 0: 3 elements from the first all-reduce's callback, then 5 from
    # this thread.
    issued = threading.Event()

    def callback(fut):
        fut.value()
        try:
            dist.all_reduce(torch.ones(3), async_op=True).wait()
        except fairring.FairringError as e:
            return str(e)
        finally:
            issued.set()
        return None

    fut = dist.all_reduce(torch.ones(4), async_op=True).get_future()
    from_callback = fut.then(callback)
    store.set("attached", "1")
    issued.wait()
    try:
        # Refused at once where the mismatch was found already.
        dist.all_reduce(torch.ones(5), async_op=True).wait()
    except fairring.FairringError as e:
        errors.append(str(e))
    if from_callback.wait() is not None:
        errors.append(from_callback.wait())
    assert errors, "two collectives of 3 and 5 elements matched"
    explained = [e for e in errors if "mismatch" in e.lower() and "PowerSGD" in e]
    assert explained, errors
    dist.destroy_process_group()


def test_a_callback_racing_the_issuing_thread_fails_as_a_mismatch_that_says_why():
    spawn(callback_racing_the_issuing_thread, 2)


def callbacks_on_the_caller(rank, world, port):
    os.environ["FAIRRING_CALLBACKS"] = "caller"
    dist.init_process_group(
        "fairring",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=TIMEOUT,
    )
    me = threading.current_thread()
    ran_on = []

    def callback(fut):
        ran_on.append(threading.current_thread())
        # A collective from the callback, in the program's order.
        (v,) = dist.all_reduce(torch.ones(2), async_op=True).get_future().wait()
        return fut.value()[0] + v[0]

    fut = dist.all_reduce(torch.ones(4), async_op=True).get_future()
    assert fut.done(), "a future handed out incomplete"
    chained = fut.then(callback)
    assert ran_on == [me], ran_on
    assert torch.equal(chained.wait(), torch.full((4,), 2.0 * world))
    dist.destroy_process_group()


def test_callbacks_run_on_the_caller_with_fairring_callbacks_caller():
    spawn(callbacks_on_the_caller, 2)


def test_a_bad_fairring_callbacks_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv("FAIRRING_CALLBACKS", "sometimes")
    store = dist.HashStore()
    with pytest.raises(ValueError, match='FAIRRING_CALLBACKS="sometimes"'):
        fairring.ProcessGroupFairring(store, 0, 1, datetime.timedelta(seconds=5))
