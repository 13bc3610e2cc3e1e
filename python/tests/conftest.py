"""Helpers shared by the tests: jobs of N processes on this machine."""

import datetime
import faulthandler
import os
import socket
import sys

import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))

TIMEOUT = datetime.timedelta(seconds=60)

# A rank still running after this long is hung: it prints every thread's stack
# and exits, which fails its test instead of hanging the run
# (FAIRRING_TEST_HUNG_AFTER seconds, to look at a hang sooner).
HUNG_AFTER = int(os.environ.get("FAIRRING_TEST_HUNG_AFTER", "240"))


def init_fairring(rank, world, port, timeout=TIMEOUT):
    """The default group of a job of `world` ranks, on fairring, met at
    `port` on loopback."""
    import torch.distributed as dist

    dist.init_process_group(
        "fairring",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timeout,
    )


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bounded(rank, fn, *args):
    faulthandler.dump_traceback_later(HUNG_AFTER, exit=True)
    try:
        fn(rank, *args)
    finally:
        faulthandler.cancel_dump_traceback_later()


def _in_environment(rank, environment, fn, *args):
    os.environ.clear()
    os.environ.update(environment)
    _bounded(rank, fn, *args)


# The ranks are forked from a server that has imported torch and fairring once
# (a rank then starts in milliseconds, not after a second or two of imports),
# and are given the caller's environment as it is at the call, as a spawned
# process would have it. Nothing in the server has touched CUDA.
_RANKS = mp.get_context("forkserver")
_RANKS.set_forkserver_preload(["torch", "torch.distributed", "fairring"])


def spawn(fn, world, *args):
    """Runs ``fn(rank, world, port, *args)`` in `world` fresh processes; an
    assertion or exception in any of them, or a rank hung for `HUNG_AFTER`
    seconds, fails the caller."""
    mp.start_processes(
        _in_environment,
        args=(dict(os.environ), fn, world, free_port()) + args,
        nprocs=world,
        join=True,
        start_method="forkserver",
    )
