"""Whether CUDA tensors can run, and the checks a call on them passes.

A group runs CUDA tensors on the engine's device path (the library's `cuda`
feature): a collective is ordered after everything already enqueued on the
current stream of the tensors' device, the calling thread does not wait for
the GPU to start it, and what follows it on the device waits for it only
where the caller asks (`Work.wait()`, the future). The checks are plain functions of what they
are told, so that they run, and are tested, on a machine without a GPU.
"""

import torch

from . import _native as native

def cuda_status():
    """``(available, reason)``: whether CUDA tensors can run through fairring
    here, and a sentence saying why or why not."""
    if not native.cuda_built():
        return (
            False,
            "the fairring library was built without its `cuda` feature (the package "
            "builds it unless FAIRRING_CUDA=0 was set at install)",
        )
    if not torch.cuda.is_available():
        return False, "torch sees no CUDA device (torch.cuda.is_available() is False)"
    count = torch.cuda.device_count()
    return True, f"the library has its device calls and torch sees {count} CUDA device(s)"


def refusal(what, devices, bound, capturing, status):
    """Why a call `what` on tensors on `devices` (``torch.device``s, at least
    one of them CUDA) is refused, or None: `bound` is the CUDA device index the
    group runs on (None before its first CUDA call), `capturing` whether the
    current stream is being captured into a CUDA graph, `status` what
    `cuda_status` says."""
    kinds = sorted({d.type for d in devices})
    if len(kinds) > 1:
        return f"{what} on tensors of {' and '.join(kinds)} at once: pass tensors of one device"
    available, reason = status
    if not available:
        return f"{what} on CUDA tensors: {reason}; pass CPU tensors"
    indices = sorted({d.index for d in devices})
    if len(indices) > 1:
        return (
            f"{what} on CUDA tensors of devices {indices} at once: a group runs on one "
            "device; pass tensors of one"
        )
    if bound is not None and indices[0] != bound:
        return (
            f"{what} on a tensor of cuda:{indices[0]}, but this group runs on "
            f"cuda:{bound} (the device of its first CUDA call)"
        )
    if capturing:
        return (
            f"{what} while the current CUDA stream is being captured into a graph: "
            "fairring's collectives run on the host's engine and cannot be captured; "
            "issue it outside the capture"
        )
    return None


def any_cuda(tensors):
    """Whether any of `tensors` (tensors, or lists of them) is a CUDA tensor."""
    for t in tensors:
        if isinstance(t, (list, tuple)):
            if any_cuda(t):
                return True
        elif isinstance(t, torch.Tensor) and t.device.type == "cuda":
            return True
    return False


class GroupDevice:
    """A group's CUDA side: the device it runs on (bound at its first CUDA
    call) and the side stream its write-backs run on, made when first needed."""

    def __init__(self):
        self.index = None
        self._side = None

    def check(self, what, tensors):
        """Refuses `tensors` (naming why) unless they can run on this group's
        device; binds the group to their device at its first CUDA call."""
        devices = [t.device for t in tensors]
        status = cuda_status()
        capturing = status[0] and torch.cuda.is_current_stream_capturing()
        why = refusal(what, devices, self.index, capturing, status)
        if why is not None:
            raise RuntimeError(f"fairring: {why}")
        if self.index is None:
            self.index = devices[0].index

    def current_stream(self):
        return torch.cuda.current_stream(self.index)

    def side_stream(self):
        """The stream that copies each finished operation's results where the
        caller wants them; `Work.wait()` and the future order the caller after
        it."""
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.index)
        return self._side
