"""The collectives on CUDA tensors, as the process group runs them.

Each call is described as the engine's calls (`fr_call` with device memory)
ordered on the current stream of the tensors' device, and started at once: the
engine orders it after everything already on that stream, enqueues everything
the device does for it, and the calling thread does not wait for the GPU.
Right after, still without waiting, the group's side stream is made to wait
for the operation on the device (`fr_work_enqueue_wait`), the copies of the
results where the caller wants them (a non-contiguous tensor, an output list)
are enqueued there, and an event is recorded after them. `Work.wait()` makes
the current stream wait for that event and returns, as ProcessGroupNCCL's
does: the host never blocks, so FSDP's prefetching and every overlap of
communication with computation work. The CUDA-aware future is completed on
the side stream once the host sees the operation finish.

A stream may wait for the engine because the engine's device work never
needs a CUDA call still to be made: every step of it was enqueued when the
call was accepted, each behind a word the engine opens by writing host
memory. Any thread may meanwhile make any CUDA call, one that waits for the
whole device included (a kernel's first launch under lazy loading, the
caching allocator freeing memory): it waits, and the engine goes on.

Temporaries made for a call are made on the current stream, as the caller's
own work would be; the tensors the side stream touches are recorded on it for
the caching allocator, and every tensor the engine touches is kept alive until
the engine has finished with it.

Messages and all-to-all have no device form in the engine: on CUDA tensors
they are refused, naming the call.
"""

import ctypes

import torch

from . import _native as native
from ._cuda import GroupDevice
from ._tensors import unpack


def _call(collective, input, output, count, dtype=native.DTYPE_U8, op=0, root=0):
    c = native.Call()
    c.collective = collective
    c.input = input.data_ptr()
    c.output = output.data_ptr()
    c.count = count
    c.dtype = dtype
    c.op = op
    c.root = root
    return c


def _record(tensor, stream):
    """Tells the caching allocator that `stream` uses `tensor`'s memory."""
    tensor.record_stream(stream)


def _nbytes(t):
    return t.numel() * t.element_size()


class _Contiguous:
    """A CUDA tensor as the engine sees it: itself if contiguous, else a
    contiguous copy (made on the current stream) whose result the side stream
    copies back."""

    def __init__(self, tensor):
        self.tensor = tensor
        self.buffer = tensor if tensor.is_contiguous() else tensor.contiguous()

    def write_back(self):
        if self.buffer is not self.tensor:
            self.tensor.copy_(self.buffer)


class DeviceCollectives:
    """The process group's CUDA forms (a mixin of `ProcessGroupFairring`,
    which provides `_start`, `size` and `rank`)."""

    def _device(self):
        device = getattr(self, "_group_device", None)
        if device is None:
            device = self._group_device = GroupDevice()
        return device

    def _check_device(self, what, tensors):
        self._device().check(what, tensors)

    def _start_device(self, what, calls, result, keep, write_back=None, touched=()):
        """Starts `calls` (one work over them) and returns a `DeviceWork`:
        the side stream waits for it on the device, then runs `write_back`
        and records the work's event."""
        device = self._device()
        stream = device.current_stream()
        for c in calls:
            c.memory = native.MEMORY_DEVICE
            c.stream = stream.cuda_stream
        array = (native.Call * len(calls))(*calls)
        side = device.side_stream()
        done = torch.cuda.Event()

        def start(comm, out):
            return native.lib().fr_start(comm, array, len(calls), out)

        def order(works):
            # Ordered on the device after the operation, with no host wait.
            lib = native.lib()
            for w in works:
                native.check(
                    lib.fr_work_enqueue_wait(w, ctypes.c_void_p(side.cuda_stream)),
                    f"{what}: ordering the side stream after it",
                )
            with torch.cuda.stream(side):
                if write_back is not None:
                    write_back()
                done.record(side)
            for t in touched:
                _record(t, side)

        return self._start(
            what, [start], None, result, (keep, array), device=(device.index, side, done, order)
        )

    def _device_allreduce(self, tensors, reduction, what):
        self._check_device(what, tensors)
        codes = [reduction.check(t) for t in tensors]
        staged = [_Contiguous(t) for t in tensors]
        for s in staged:
            reduction.scale(s.buffer)
        calls = [
            _call(native.COLLECTIVE_ALL_REDUCE, s.buffer, s.buffer, s.buffer.numel(), code, reduction.code)
            for s, code in zip(staged, codes)
        ]

        def write_back():
            for s in staged:
                s.write_back()

        touched = [t for s in staged for t in (s.tensor, s.buffer)]
        return self._start_device(what, calls, tensors, staged, write_back, touched)

    def _device_broadcast(self, tensor, root, what):
        self._check_device(what, [tensor])
        s = _Contiguous(tensor)
        # Bit-exact for every dtype: the engine moves bytes.
        call = _call(native.COLLECTIVE_BROADCAST, s.buffer, s.buffer, _nbytes(s.buffer), root=root)
        return self._start_device(what, [call], [tensor], s, s.write_back, [s.tensor, s.buffer])

    def _device_allgather(self, outs, input, what, result):
        self._check_device(what, [input, *outs])
        self._check_parts(what, "output", outs, input)
        inp = input.contiguous()
        flat = torch.empty(self.size() * inp.numel(), dtype=inp.dtype, device=inp.device)
        call = _call(native.COLLECTIVE_ALL_GATHER, inp, flat, _nbytes(inp))

        def write_back():
            unpack(flat, outs)

        return self._start_device(what, [call], result, (inp, flat, outs), write_back, [flat, *outs])

    def _device_all_gather_single(self, output, input, what):
        self._check_device(what, [output, input])
        if output.numel() != self.size() * input.numel() or output.dtype != input.dtype:
            raise ValueError(
                f"fairring: {what}: the output ({output.numel()} x {output.dtype}) must hold "
                f"{self.size()} x the input ({input.numel()} x {input.dtype})"
            )
        s = _Contiguous(output)
        inp = input.contiguous()
        call = _call(native.COLLECTIVE_ALL_GATHER, inp, s.buffer, _nbytes(inp))
        return self._start_device(what, [call], [output], (inp, s), s.write_back, [s.tensor, s.buffer])

    def _device_reduce_scatter(self, output, flat, reduction, what, result):
        """`flat` is the engine's own copy of the input (it is workspace)."""
        self._check_device(what, [output, flat])
        dtype = reduction.check(output)
        s = _Contiguous(output)
        n = s.buffer.numel()
        self._check_scattered(what, flat, n, output)
        reduction.scale(flat)
        call = _call(native.COLLECTIVE_REDUCE_SCATTER, flat, s.buffer, n, dtype, reduction.code)
        return self._start_device(what, [call], result, (flat, s), s.write_back, [s.tensor, s.buffer])

    def _device_reduce(self, tensor, root, reduction, what):
        self._check_device(what, [tensor])
        dtype = reduction.check(tensor)
        s = _Contiguous(tensor)
        if self.rank() == root:
            reduction.scale(s.buffer)
            inp = out = s.buffer
            write_back, touched = s.write_back, [s.tensor, s.buffer]
        else:
            inp = s.buffer
            if reduction.factor is not None:
                inp = inp * reduction.factor  # this rank's tensor stays as it is
            out = torch.empty_like(inp)
            write_back, touched = None, []
        call = _call(native.COLLECTIVE_REDUCE, inp, out, inp.numel(), dtype, reduction.code, root)
        return self._start_device(what, [call], [tensor], (s, inp, out), write_back, touched)

    def _device_gather(self, outs, input, root, what, result):
        self._check_device(what, [input, *outs])
        if self.rank() == root:
            self._check_parts(what, "output", outs, input)
        inp = input.contiguous()
        flat = torch.empty(self.size() * inp.numel(), dtype=inp.dtype, device=inp.device)
        call = _call(native.COLLECTIVE_GATHER, inp, flat, _nbytes(inp), root=root)

        def write_back():
            unpack(flat, outs)

        return self._start_device(what, [call], result, (inp, flat, outs), write_back, [flat, *outs])

    def _device_scatter(self, output, parts, root, what, result):
        self._check_device(what, [output, *parts])
        s = _Contiguous(output)
        if self.rank() == root:
            self._check_parts(what, "input", parts, s.buffer)
            flat = torch.cat([p.reshape(-1) for p in parts])
        else:
            flat = torch.empty(self.size() * s.buffer.numel(), dtype=output.dtype, device=output.device)
        call = _call(native.COLLECTIVE_SCATTER, flat, s.buffer, _nbytes(s.buffer), root=root)
        return self._start_device(what, [call], result, (flat, s), s.write_back, [s.tensor, s.buffer])
