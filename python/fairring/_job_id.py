"""Joining a job by id, as NCCL's unique id: one process makes a `JobId`, the
host runtime hands its bytes to every rank by its own means, and each calls
`fairring.init_process_group(job_id, rank, world_size)`.

The ranks join the id's job in the library (``fr_comm_from_id``: its store,
its secret, its run), and that communicator is the default group's. torch
needs a store of its own besides (for subgroups, and its own keys): rank 0
serves a ``TCPStore`` on the address by which it reaches the id's maker, and
the ranks learn where from a broadcast on the communicator they have just
joined.
"""

import ctypes
import datetime
import ipaddress
import socket
import threading

import torch
import torch.distributed as dist

from . import _native as native
from ._device_collectives import _call
from ._native import FairringError

# The layout of an id (`src/bootstrap/job_id.rs`): what the package reads.
_SIZE = 128
_FAMILY = 9
_PORT = slice(10, 12)
_ADDRESS = slice(12, 28)

# Where rank 0's store serves, as it sends it: "address port", padded.
_WHERE_BYTES = 64


class JobId:
    """A job's id: 128 bytes naming where the job's rendezvous store serves,
    its secret and its run (the C ABI's ``fr_job_id``, Rust's ``JobId``:
    any of the three may make it, and any join with it). ``bytes(job_id)`` is
    what to hand out; ``JobId(data)`` takes it back."""

    __slots__ = ("_bytes",)

    def __init__(self, data):
        data = bytes(data)
        if len(data) != _SIZE:
            raise ValueError(f"fairring: a job id is {_SIZE} bytes, not {len(data)}")
        self._bytes = data

    @classmethod
    def new(cls):
        """Makes an id, and starts serving the job's rendezvous store in this
        process until it exits (or until a group of this process joined with
        the id is destroyed)."""
        made = native.JobIdBytes()
        status = native.lib().fr_job_id_new(ctypes.byref(made))
        if status != native.OK:
            raise FairringError("making a job id", status, native.last_error())
        return cls(bytes(made.bytes))

    def __bytes__(self):
        return self._bytes

    def __eq__(self, other):
        return isinstance(other, JobId) and other._bytes == self._bytes

    def __hash__(self):
        return hash(self._bytes)

    def store_address(self):
        """(address, port) of the job's rendezvous store, as the id says."""
        family, raw = self._bytes[_FAMILY], self._bytes[_ADDRESS]
        address = ipaddress.IPv4Address(raw[:4]) if family == 4 else ipaddress.IPv6Address(raw)
        return str(address), int.from_bytes(self._bytes[_PORT], "big")

    def __repr__(self):
        host, port = self.store_address()
        where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return f"fairring.JobId({where})"


# The communicators joined by id, by the store torch is handed with them,
# until the group made on that store takes its own.
_joined = {}
_joined_lock = threading.Lock()


def init_process_group(job_id, rank, world_size, timeout=datetime.timedelta(minutes=10)):
    """Joins the job `job_id` names as `rank` of `world_size` (every rank
    calls it), and makes the default ``torch.distributed`` group on it, a
    fairring group. A changed id is refused at once; one whose maker has
    exited fails within `timeout`, naming the id. Subgroups (``new_group``,
    device meshes) meet through the store torch is given, as any group made
    through a store does (their peers admitted by ``FAIRRING_JOB_SECRET`` or
    the derived secret)."""
    if not isinstance(job_id, JobId):
        job_id = JobId(job_id)
    if dist.is_initialized():
        raise RuntimeError("fairring: init_process_group: the default group exists already")
    timeout_ms = max(int(timeout.total_seconds() * 1000), 1)
    raw = native.JobIdBytes()
    ctypes.memmove(raw.bytes, bytes(job_id), _SIZE)
    comm = native.comm_p()
    status = native.lib().fr_comm_from_id(
        ctypes.byref(raw), rank, world_size, timeout_ms, ctypes.byref(comm)
    )
    if status != native.OK:
        raise FairringError(
            f"joining {job_id!r} as rank {rank} of {world_size}", status, native.last_error()
        )
    try:
        store = _torch_store(comm, job_id, rank, world_size, timeout)
    except BaseException:
        native.lib().fr_comm_destroy(comm)
        raise
    with _joined_lock:
        _joined[id(store)] = (store, comm)
    try:
        dist.init_process_group(
            "fairring", store=store, rank=rank, world_size=world_size, timeout=timeout
        )
    finally:
        with _joined_lock:
            left = _joined.pop(id(store), None)
        if left is not None:  # torch failed before making the group
            native.lib().fr_comm_destroy(left[1])


def joined_comm(store, rank, size):
    """The communicator joined by id for the group torch makes on `store`
    (under its prefixes), once; None for any other group."""
    base = store
    while isinstance(base, dist.PrefixStore):
        base = base.underlying_store
    with _joined_lock:
        found = _joined.get(id(base))
        if found is None or found[0] is not base:
            return None
        del _joined[id(base)]
    comm = found[1]
    here, total = ctypes.c_uint32(), ctypes.c_uint32()
    native.lib().fr_comm_rank(comm, ctypes.byref(here), ctypes.byref(total))
    if (here.value, total.value) != (rank, size):
        native.lib().fr_comm_destroy(comm)
        raise RuntimeError(
            f"fairring: the group joined by id is rank {here.value} of {total.value}, but torch "
            f"makes rank {rank} of {size} on its store"
        )
    return comm


def _torch_store(comm, job_id, rank, world_size, timeout):
    """torch's store for the job: served by rank 0, found by the others from
    a broadcast on `comm`."""
    where = torch.zeros(_WHERE_BYTES, dtype=torch.uint8)
    if rank == 0:
        host = _address_toward(*job_id.store_address())
        store = dist.TCPStore(host, 0, world_size, True, timeout, wait_for_workers=False)
        text = f"{host} {store.port}".encode()
        where[: len(text)] = torch.tensor(list(text), dtype=torch.uint8)
    call = _call(native.COLLECTIVE_BROADCAST, where, where, _WHERE_BYTES, root=0)
    work = native.work_p()
    lib = native.lib()
    status = lib.fr_start(comm, ctypes.byref(call), 1, ctypes.byref(work))
    if status in (native.OK, native.PENDING):
        status = lib.fr_work_wait(work)
        lib.fr_work_free(work)
    if status != native.OK:
        raise FairringError("finding torch's store of the job", status, native.last_error())
    if rank == 0:
        return store
    host, port = bytes(where.tolist()).rstrip(b"\0").decode().split(" ")
    return dist.TCPStore(host, int(port), world_size, False, timeout)


def _address_toward(host, port):
    """This machine's address on the route to `host` (no packet is sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port or 9))
        return s.getsockname()[0]
