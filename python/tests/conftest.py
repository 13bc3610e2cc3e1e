"""Helpers shared by the tests: jobs of N processes on this machine."""

import datetime
import os
import socket
import sys

import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))

TIMEOUT = datetime.timedelta(seconds=60)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(fn, world, *args):
    """Runs ``fn(rank, world, port, *args)`` in `world` fresh processes; an
    assertion or exception in any of them fails the caller."""
    mp.spawn(fn, args=(world, free_port()) + args, nprocs=world, join=True)
