"""fairring: a reduction-server all-reduce for PyTorch.

``import fairring`` registers the ``torch.distributed`` backend ``"fairring"``
for CPU and CUDA tensors (one group serves both). CUDA tensors run on the
engine's device path, as ProcessGroupNCCL runs them: ordered after the current
stream's work, started without waiting for the GPU, ``wait()`` ordering the
current stream after the result without blocking the host, a CUDA-aware
future. ``FAIRRING_DEVICE=local`` readies each rank's GPU when its group is
made (staging page-locked, NCCL's communicators made and warmed up) instead
of at its first CUDA collective.
``fairring.cuda_available()`` says whether they can run here and
``fairring.cuda_status()`` why or why not. With torch >= 2.14,
``init_process_group("fairring")`` finds the backend through its entry point
without the import.

- ``dist.init_process_group("fairring")``: the group rendezvouses through the
  store PyTorch hands it, and implements allreduce (SUM, AVG, PRODUCT, MIN,
  MAX, BAND, BOR, BXOR, PREMUL_SUM), allreduce_coalesced, broadcast,
  allgather, all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor,
  reduce, gather, scatter (so checkpointing works), send, recv, isend, irecv,
  batch_isend_irecv, all_to_all, all_to_all_single and barrier. Anything else
  (a receive from any source) raises an error naming the call. On CUDA
  tensors: every collective above but the messages and all-to-all, which
  the engine has no device form of (they raise, naming the call).
- ``fairring.JobId`` and ``fairring.init_process_group(job_id, rank,
  world_size)``: joining by an id one process makes and the host runtime
  hands out (``bytes(job_id)``), as NCCL's unique id; the default group is
  then a fairring group.
- ``fairring.allreduce_hook``: a DDP communication hook that averages each
  gradient bucket on a fairring group, for jobs that keep another backend as
  the default group.
"""

import torch.distributed as dist

from ._backend import ProcessGroupFairring, Work
from ._cuda import cuda_status as _cuda_status
from ._job_id import JobId, init_process_group
from ._native import FairringError  # noqa: E402

__all__ = [
    "ProcessGroupFairring",
    "Work",
    "FairringError",
    "JobId",
    "init_process_group",
    "allreduce_hook",
    "cuda_available",
    "cuda_status",
]


def cuda_available():
    """Whether CUDA tensors can run through fairring here: the library was
    built with its device calls and torch sees a CUDA device."""
    return _cuda_status()[0]


def cuda_status():
    """A sentence saying whether CUDA tensors can run through fairring here,
    and why or why not."""
    return _cuda_status()[1]

BACKEND = "fairring"


def _register():
    """Registers the backend (once). The entry point torch >= 2.14 calls."""
    if BACKEND in dist.Backend.backend_list:
        return
    from ._backend import create

    dist.Backend.register_backend(BACKEND, create, devices=["cpu", "cuda"])


def allreduce_hook(process_group, bucket):
    """A DDP communication hook: averages ``bucket`` across ``process_group``
    (a fairring group, e.g. ``dist.new_group(backend="fairring")``; ``None``
    means the default group) and returns the future DDP waits on.

    ``ddp.register_comm_hook(group, fairring.allreduce_hook)``.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    work = dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.AVG, group=group, async_op=True)
    return work.get_future().then(lambda f: f.value()[0])


_register()
