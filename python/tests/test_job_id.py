"""Joining by id from Python: the id one process makes, handed to the ranks
as bytes; a changed id and a stale one refused, naming the id."""

import datetime
import multiprocessing
import time

import pytest
import torch
import torch.distributed as dist

import fairring
from conftest import spawn


def joined(rank, world, port, data):
    fairring.init_process_group(fairring.JobId(data), rank, world)
    assert dist.get_backend() == "fairring"
    assert (dist.get_rank(), dist.get_world_size()) == (rank, world)
    t = torch.arange(1000, dtype=torch.float64) * (rank + 1)
    dist.all_reduce(t)
    assert torch.equal(t, torch.arange(1000, dtype=torch.float64) * (world * (world + 1) / 2))
    # A subgroup meets through the store torch was given.
    pair = dist.new_group([0, 1])
    if rank < 2:
        u = torch.full((4,), float(rank))
        dist.all_reduce(u, group=pair)
        assert torch.equal(u, torch.full((4,), 1.0))
    dist.barrier()
    dist.destroy_process_group()


def test_ranks_join_by_an_id_made_elsewhere_and_all_reduce():
    job_id = fairring.JobId.new()
    assert len(bytes(job_id)) == 128
    assert fairring.JobId(bytes(job_id)) == job_id
    spawn(joined, 3, bytes(job_id))


def test_a_changed_id_is_refused_at_once():
    data = bytearray(bytes(fairring.JobId.new()))
    data[40] ^= 1  # in the secret
    start = time.monotonic()
    with pytest.raises(fairring.FairringError, match="checksum"):
        fairring.init_process_group(fairring.JobId(data), 0, 2)
    assert time.monotonic() - start < 5
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match="128 bytes, not 127"):
        fairring.JobId(bytes(127))


def _make_id(queue):
    queue.put(bytes(fairring.JobId.new()))


def test_a_stale_id_fails_within_the_timeout_naming_it():
    # Made by a process that has exited: nothing serves its store.
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    maker = context.Process(target=_make_id, args=(queue,))
    maker.start()
    data = queue.get(timeout=60)
    maker.join()
    job_id = fairring.JobId(data)
    timeout = datetime.timedelta(seconds=3)
    start = time.monotonic()
    with pytest.raises(fairring.FairringError) as failed:
        fairring.init_process_group(job_id, 1, 2, timeout=timeout)
    took = time.monotonic() - start
    host, port = job_id.store_address()
    assert f"{host}:{port}" in str(failed.value) and "joining by id" in str(failed.value), failed.value
    assert took < 3 * timeout.total_seconds(), took
    assert not dist.is_initialized()
