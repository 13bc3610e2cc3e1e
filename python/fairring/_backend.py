"""The ``fairring`` process group: torch.distributed collectives on fairring's
engine, through its C ABI.

`create` makes what torch registers: the C++ backend (``fairring._c10d``),
which starts the common host calls itself and hands every other call to the
Python group here, `ProcessGroupFairring`, on the same communicator.

Every collective starts in the engine at once (the calling thread never waits
for the network) and returns a `Work` whose future one completion thread per
group fulfils, in the order the operations were issued. A failed operation
fails its future with a `FairringError` naming the cause (the lost rank, the
mismatching call), so ``wait()``, DDP's reducer and ``get_future()`` all raise.
"""

import atexit
import ctypes
import importlib.util
import itertools
import os
import time
import warnings
import weakref

import torch
import torch.distributed as dist

from . import _native as native
from ._native import FairringError
from ._cuda import any_cuda
from ._device_collectives import DeviceCollectives, _call
from ._job_id import joined_comm
from ._store import _StoreBridge
from ._tensors import _DTYPES, Reduction, _Staged, _host, unpack
from ._work import (
    _CALLBACK_RACE,
    DeviceWork,
    Work,
    _Chained,
    _Completer,
    _Pending,
    _failure,
    in_callback,
)

# The tags of the monitored barrier's messages: the highest, counting down
# one per call, `MONITORED_BARRIER_TAGS` of them in turn (user tags below).
MONITORED_BARRIER_TAG = (1 << 32) - 1
MONITORED_BARRIER_TAGS = 1024


def _starting(calls):
    """The function that starts `calls` (`fr_call`s on host memory) as one
    work, the one way the library starts collectives (`fr_start`), and the
    array it reads them from (kept alive with the work)."""
    array = (native.Call * len(calls))(*calls)

    def start(comm, out):
        return native.lib().fr_start(comm, array, len(calls), out)

    return start, array

def _message_call(block, at, count, peer, sending, tag=0):
    """The `fr_call` of a send (`sending`) or a receive of `count` elements of
    the contiguous `block` from element `at`, to or from `peer`, with `tag`;
    a type the library does not name travels as bytes."""
    code = _DTYPES.get(block.dtype)
    size = block.element_size()
    c = native.Call()
    c.collective = native.COLLECTIVE_SEND if sending else native.COLLECTIVE_RECV
    c.input = c.output = block.data_ptr() + at * size
    if code is None:
        c.count, c.dtype = count * size, native.DTYPE_U8
    else:
        c.count, c.dtype = count, code
    c.peer, c.tag = peer, tag
    return c


def _teardown(state):
    """Destroys a group's communicators once: closes the C++ backend's way in,
    joins the completion thread, then lets the engines go (which joins their
    threads)."""
    comm, completer = state.pop("comm", None), state.pop("completer", None)
    for close in state.pop("on_teardown", []):
        close()
    if completer is not None:
        completer.close()
    # Destroying the communicator stops its linker (which connects peers
    # first named by a message) before it lets go of the store bridge.
    if comm is not None:
        native.lib().fr_comm_destroy(comm)


_live = weakref.WeakSet()


def _this_join(store, size):
    """`store`, scoped to this construction of the group.

    PyTorch may hand the same store (and key prefix) to a group built again
    after it was destroyed (under torchrun, the agent's store outlives every
    group), where the keys of the last construction still stand: a rank would
    read its predecessor's shared-memory name or endpoints. Every member adds
    one to a counter when it joins; a construction completes only once all
    members have joined, so the members of the `k`-th construction all read
    values in `k*size+1 ..= (k+1)*size` and agree on `k`."""
    joined = store.add("fairring/joins", 1)
    return dist.PrefixStore(f"fairring/{(joined - 1) // size}/", store)


def _env_choice(variable, default, choices):
    """The value of `variable` (`default` if unset), one of `choices` (each
    value with what it means), or a ValueError naming it and them."""
    value = os.environ.get(variable, default)
    if value not in choices:
        expected = " or ".join(f'"{v}" ({meaning})' for v, meaning in choices.items())
        raise ValueError(f'invalid {variable}="{value}": expected {expected}')
    return value


def _callbacks_run_on():
    """`FAIRRING_CALLBACKS`: where a future's ``then`` callbacks run."""
    return _env_choice("FAIRRING_CALLBACKS", "dispatcher", {
        "dispatcher": "the default: a thread of the group completes futures and runs "
        "their callbacks",
        "caller": "get_future() waits for its operation, so callbacks run on the thread "
        "that attaches them",
    })


def c10d_module():
    """The C++ backend (`fairring._c10d`), checked against the running torch:
    it is compiled against the torch it was built with, whose C++ ABI it
    needs. None where the install has none (a package laid out by hand, as
    the GPU kit lays it out for a machine with another torch)."""
    # `from . import _c10d` raises a plain ImportError where the module is
    # absent, as where it fails to load: ask for it first.
    if importlib.util.find_spec(f"{__package__}._c10d") is None:
        return None  # not built into this install (see `create`)
    try:
        from . import _c10d
    except ImportError as e:
        raise ImportError(
            f"fairring: its C++ backend does not load under torch {torch.__version__} ({e}): "
            "rebuild the package against this torch (`pip install --no-build-isolation "
            "./python` from the repository)"
        ) from e
    if _c10d.torch_version != torch.__version__:
        raise ImportError(
            f"fairring: its C++ backend was built against torch {_c10d.torch_version}, "
            f"not the running {torch.__version__}: rebuild the package against this torch "
            "(`pip install --no-build-isolation ./python` from the repository)"
        )
    return _c10d


def _torch_calls():
    """`FAIRRING_TORCH_CALLS`: where torch's common host calls start."""
    return _env_choice("FAIRRING_TORCH_CALLS", "native", {
        "native": "the default: the C++ backend starts an all-reduce, broadcast, "
        "all-gather, reduce-scatter, send or receive of one dense host tensor, and a "
        "barrier, itself",
        "python": "every call goes through the Python group, as the C++ backend hands "
        "it the rest",
    })


@atexit.register
def _teardown_all():
    for pg in list(_live):
        pg.shutdown()


class ProcessGroupFairring(DeviceCollectives, dist.ProcessGroup):
    """fairring as a ``torch.distributed`` process group, on CPU tensors and,
    where the library has its device calls, CUDA tensors (see
    `_device_collectives`)."""

    def __init__(self, store, rank, size, timeout, comm=None):
        """Joins through `store`, or takes `comm`, a communicator of `size`
        ranks already joined as `rank` (a job joined by id)."""
        super().__init__(rank, size)
        # Read before joining: a bad value fails this rank before it meets.
        callers_run_callbacks = _callbacks_run_on() == "caller"
        self._timeout_ms = max(int(timeout.total_seconds() * 1000), 0) if timeout else 0
        if comm is None:
            scoped = _this_join(store, size)
            comm, self._bridge = self._join(scoped, rank, size, f"the group as rank {rank}")
        else:
            self._bridge = None
        self._comm = comm
        # Monitored barriers called so far (each has a tag of its own).
        self._monitored_barriers = 0
        self._state = {
            "comm": comm,
            "completer": _Completer(rank, callers_run_callbacks),
        }
        self._finalizer = weakref.finalize(self, _teardown, self._state)
        _live.add(self)

    def _join(self, store, rank, size, what):
        """A communicator of `size` ranks met through `store`, as `rank`."""
        bridge = _StoreBridge(store)
        comm = native.comm_p()
        status = native.lib().fr_comm_with_store(
            rank, size, ctypes.byref(bridge.struct), self._timeout_ms, ctypes.byref(comm)
        )
        if status != native.OK:
            message = native.last_error()
            if bridge.error:
                message += f" (store: {bridge.error})"
            raise FairringError(f"joining {what} of {size}", status, message)
        return comm, bridge

    # Identity.
    def getBackendName(self):
        return "fairring"

    def name(self):
        return "fairring"

    # torch names groups through these; with no C++ backend underneath, the
    # group keeps them itself.
    def setGroupName(self, name):
        self._group_name = name

    def getGroupName(self):
        return getattr(self, "_group_name", "")

    def _get_backend(self, device):
        """The group is its own backend, for every device type (torch asks,
        e.g. in `batch_isend_irecv`, whether it coalesces: it does not)."""
        return self

    def setGroupDesc(self, desc):
        self._group_desc = desc

    def getGroupDesc(self):
        return getattr(self, "_group_desc", "")

    # Lifetime.
    def abort(self):
        """Fails every operation in flight and every later one."""
        if "comm" in self._state:
            native.lib().fr_comm_abort(self._state["comm"])

    def shutdown(self):
        """Waits for the operations in flight and destroys the communicator."""
        self._finalizer()

    # For the C++ backend (`fairring._c10d`), which starts the common host
    # calls itself and hands this group the rest.
    def _native_failure(self, what, status, message):
        """The `FairringError` of an operation the C++ backend started."""
        completer = self._state.get("completer")
        if status == native.MISMATCH and completer is not None and completer.callbacks_issue:
            message += _CALLBACK_RACE
        return FairringError(what, status, message)

    def _note_callbacks_issue(self):
        """A callback issued a call through the C++ backend."""
        completer = self._state.get("completer")
        if completer is not None:
            completer.callbacks_issue = True

    def monitored_barrier(self, timeout, wait_all_ranks=False):
        """A barrier that names the ranks that did not reach it within
        `timeout`, as gloo's does: every other rank sends rank 0 a message and
        waits for its answer; rank 0 waits for each in rank order, raising for
        the first missing (or, with `wait_all_ranks`, for all of them), and
        answers every rank once all have arrived. A rank whose message failed
        (it was lost) is missing too. Each call has a tag of its own among
        the top `MONITORED_BARRIER_TAGS` (every rank counts its calls alike),
        so a late message of a failed call never passes a later one."""
        what = "monitored_barrier"
        seconds = timeout.total_seconds() if timeout else 0
        if seconds <= 0:
            seconds = self._timeout_ms / 1000 if self._timeout_ms else 1800.0
        me, world = self.rank(), self.size()
        if world == 1:
            return
        calls = self._monitored_barriers
        self._monitored_barriers += 1
        tag = MONITORED_BARRIER_TAG - calls % MONITORED_BARRIER_TAGS
        deadline = time.monotonic() + seconds
        limit = f"{int(seconds * 1000)} ms"

        def arrived(work):
            """Whether `work` finished by the deadline, and well."""
            if not work._pending.wait_here(max(deadline - time.monotonic(), 0.001)):
                return False
            try:
                work.wait()
            except FairringError:
                return False
            return True

        def token():
            return torch.zeros(1, dtype=torch.uint8)

        if me != 0:
            self._message(what, token(), 0, sending=True, tag=tag)
            if not arrived(self._message(what, token(), 0, False, tag)):
                raise RuntimeError(
                    f"Rank {me} successfully reached monitoredBarrier, but received errors "
                    "while waiting for send/recv from rank 0. Please check rank 0 logs for "
                    f"faulty rank (no answer within {limit})."
                )
            return
        arrivals = [(peer, self._message(what, token(), peer, False, tag)) for peer in range(1, world)]
        missing = []
        for peer, arrival in arrivals:
            if not arrived(arrival):
                missing.append(peer)
                if not wait_all_ranks:
                    break
        if missing:
            if len(missing) == 1:
                raise RuntimeError(f"Rank {missing[0]} failed to pass monitoredBarrier in {limit}")
            ranks = ", ".join(str(r) for r in missing)
            raise RuntimeError(f"Ranks {ranks} failed to pass monitoredBarrier in {limit}")
        for peer in range(1, world):
            self._message(what, token(), peer, sending=True, tag=tag).wait()

    # The engine.
    def _start(self, what, start_one, finish, result, keep, device=None):
        """Starts operations with `start_one(out_work_pointer) -> status` (each
        call of the iterable) and returns one Work over them. For CUDA tensors
        `device` is (the device index, the side stream, the event recorded
        there after the results, and `order(works)`, which orders the side
        stream after the started works), and the Work is a `DeviceWork`."""
        if "comm" not in self._state:
            raise RuntimeError(f"fairring: {what}: the process group has been shut down")
        completer = self._state["completer"]
        if in_callback():
            completer.callbacks_issue = True
        works = []
        try:
            for start in start_one:
                w = native.work_p()
                status = start(self._comm, ctypes.byref(w))
                if status not in (native.OK, native.PENDING):
                    raise _failure(what, status, completer)
                works.append(w)
        except BaseException:
            # Started ones still run: let the completion thread release them.
            if works:
                completer.put(
                    _Pending(works, None, None, what, keep)
                )
            raise
        pending = _Pending(works, finish, result, what, keep)
        if device is None:
            completer.put(pending)
            return Work(pending, keep, what)
        index, side, done, order = device
        pending.device = (side, index)
        try:
            # Before the completer may settle it: the future it completes
            # records its event on the side stream after the results.
            order(works)
        finally:
            completer.put(pending)
        return DeviceWork(pending, keep, what, done)

    def allreduce(self, tensors, opts=None):
        what = "allreduce"
        reduction = Reduction(opts, what)
        if any_cuda(tensors):
            return self._device_allreduce(tensors, reduction, what)
        if len(tensors) != 1:
            return self._allreduce_list(tensors, reduction, what)
        staged = _Staged(tensors[0], what)
        dtype = reduction.check(tensors[0])
        n = staged.buffer.numel()
        op = reduction.code
        reduction.scale(staged.buffer)

        start, array = _starting(
            [_call(native.COLLECTIVE_ALL_REDUCE, staged.buffer, staged.buffer, n, dtype, op)]
        )
        return self._start(what, [start], staged.finish, tensors, (staged, array))

    def allreduce_coalesced(self, tensors, opts=None):
        what = "allreduce_coalesced"
        return self._allreduce_list(tensors, Reduction(opts, what), what)

    def _allreduce_list(self, tensors, reduction, what):
        if any_cuda(tensors):
            return self._device_allreduce(tensors, reduction, what)
        staged = [_Staged(t, what) for t in tensors]
        op = reduction.code
        # One coalesced operation per run of one dtype, in list order (the same
        # on every rank).
        runs = []
        codes = [reduction.check(s.tensor) for s in staged]
        for s in staged:
            reduction.scale(s.buffer)
        for s, code in zip(staged, codes):
            if runs and runs[-1][0] == code:
                runs[-1][1].append(s)
            else:
                runs.append((code, [s]))

        def starter(code, group):
            return _starting(
                [
                    _call(native.COLLECTIVE_ALL_REDUCE, s.buffer, s.buffer, s.buffer.numel(), code, op)
                    for s in group
                ]
            )

        def finish():
            for s in staged:
                s.finish()

        started = [starter(code, group) for code, group in runs]
        starts = [start for start, _ in started]
        return self._start(what, starts, finish, tensors, (staged, started))

    def broadcast(self, tensors, opts=None):
        what = "broadcast"
        root = opts.rootRank if opts is not None else 0
        if len(tensors) != 1:
            raise ValueError(f"fairring: {what}: expected one tensor, got {len(tensors)}")
        if any_cuda(tensors):
            return self._device_broadcast(tensors[0], root, what)
        staged = _Staged(tensors[0], what)
        nbytes = staged.buffer.numel() * staged.buffer.element_size()

        # Bit-exact for every dtype: the engine moves bytes.
        start, array = _starting(
            [_call(native.COLLECTIVE_BROADCAST, staged.buffer, staged.buffer, nbytes, root=root)]
        )
        return self._start(what, [start], staged.finish, tensors, (staged, array))

    def allgather(self, output_tensors, input_tensors, opts=None):
        what = "allgather"
        if len(input_tensors) != 1 or len(output_tensors) != 1:
            raise ValueError(f"fairring: {what}: expected one input tensor and one output list")
        if any_cuda([input_tensors, output_tensors]):
            return self._device_allgather(output_tensors[0], input_tensors[0], what, output_tensors)
        inp = _host(input_tensors[0], what).contiguous()
        outs = output_tensors[0]
        self._check_parts(what, "output", outs, inp)
        flat = torch.empty(self.size() * inp.numel(), dtype=inp.dtype)
        nbytes = inp.numel() * inp.element_size()

        start, array = _starting([_call(native.COLLECTIVE_ALL_GATHER, inp, flat, nbytes)])

        def finish():
            unpack(flat, outs)

        return self._start(what, [start], finish, output_tensors, (inp, flat, outs, array))

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """``output_lists[r][i]`` receives rank r's ``inputs[i]``."""
        works = [
            self.allgather([[out[i] for out in output_lists]], [t], opts)
            for i, t in enumerate(inputs)
        ]
        return self._chain(works, output_lists)

    def all_gather_single(self, output, input, opts=None):
        what = "all_gather_into_tensor"
        if any_cuda([output, input]):
            return self._device_all_gather_single(output, input, what)
        _host(input, what)
        staged = _Staged(output, what)
        if staged.buffer.numel() != self.size() * input.numel() or output.dtype != input.dtype:
            raise ValueError(
                f"fairring: {what}: the output ({output.numel()} x {output.dtype}) must hold "
                f"{self.size()} x the input ({input.numel()} x {input.dtype})"
            )
        inp = input.contiguous()
        nbytes = inp.numel() * inp.element_size()

        start, array = _starting([_call(native.COLLECTIVE_ALL_GATHER, inp, staged.buffer, nbytes)])
        return self._start(what, [start], staged.finish, [output], (inp, staged, array))

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._chain(works, outputs)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        what = "reduce_scatter"
        if len(output_tensors) != 1 or len(input_tensors) != 1:
            raise ValueError(f"fairring: {what}: expected one output tensor and one input list")
        ins = input_tensors[0]
        if len(ins) != self.size():
            raise ValueError(
                f"fairring: {what}: the input list holds {len(ins)} tensors for "
                f"{self.size()} ranks"
            )
        if any_cuda([output_tensors, ins]):
            self._check_device(what, [output_tensors[0], *ins])
        else:
            for t in ins:
                _host(t, what)
        flat = torch.cat([t.reshape(-1) for t in ins])
        return self._reduce_scatter(output_tensors[0], flat, opts, what, output_tensors)

    def reduce_scatter_single(self, output, input, opts=None):
        what = "reduce_scatter_tensor"
        if any_cuda([output, input]):
            self._check_device(what, [output, input])
        else:
            _host(input, what)
        # The engine reduces its input in place; the caller's stays untouched.
        return self._reduce_scatter(output, input.reshape(-1).clone(), opts, what, [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._chain(works, outputs)

    def _reduce_scatter(self, output, flat, opts, what, result):
        reduction = Reduction(opts, what)
        if any_cuda([output, flat]):
            return self._device_reduce_scatter(output, flat, reduction, what, result)
        op = reduction.code
        staged = _Staged(output, what)
        dtype = reduction.check(output)
        n = staged.buffer.numel()
        self._check_scattered(what, flat, n, output)
        # `flat` is the engine's own copy: scaling it leaves the caller's input.
        reduction.scale(flat)

        start, array = _starting(
            [_call(native.COLLECTIVE_REDUCE_SCATTER, flat, staged.buffer, n, dtype, op)]
        )
        return self._start(what, [start], staged.finish, result, (flat, staged, array))

    def barrier(self, opts=None):
        call = native.Call()
        call.collective = native.COLLECTIVE_BARRIER
        start, array = _starting([call])
        return self._start("barrier", [start], None, [], array)

    def _chain(self, works, result):
        """One Work that finishes when all of `works` have (they complete in
        order on the completion thread, so the last one's future is last)."""
        def outcome(f):
            for each in f.value():
                each.value()  # raises the first failure
            return result

        # The works' futures as made for callbacks: never waited for here.
        futures = [w._pending.future_for_callbacks() for w in works]
        all_done = torch.futures.collect_all(futures).then(outcome)
        return _Chained(all_done, works)

    def reduce(self, tensors, opts=None):
        """Reduces every rank's tensor into the root's, into workspace on the
        other ranks, whose tensors are only read: as a chain of messages ending
        at the root where it pays (2 MiB or more, machines of one rank each),
        else as an all-reduce."""
        what = "reduce"
        if len(tensors) != 1:
            raise ValueError(f"fairring: {what}: expected one tensor, got {len(tensors)}")
        root = opts.rootRank if opts is not None else 0
        reduction = Reduction(opts, what)
        if any_cuda(tensors):
            return self._device_reduce(tensors[0], root, reduction, what)
        staged = _Staged(tensors[0], what)
        dtype = reduction.check(tensors[0])
        n = staged.buffer.numel()
        op = reduction.code
        if self.rank() == root:
            reduction.scale(staged.buffer)
            inp = out = staged.buffer
            finish = staged.finish
        else:
            inp = staged.buffer
            if reduction.factor is not None:
                inp = inp * reduction.factor  # this rank's tensor stays as it is
            out = torch.empty_like(inp)
            finish = None

        start, array = _starting([_call(native.COLLECTIVE_REDUCE, inp, out, n, dtype, op, root)])
        return self._start(what, [start], finish, tensors, (staged, inp, out, array))

    def gather(self, output_tensors, input_tensors, opts=None):
        """Every rank's input into the root's output list, bit for bit: each
        rank's part moves once, as a message to the root (in groups of up to
        32 ranks; in larger ones as an all-gather of bytes into workspace)."""
        what = "gather"
        root = opts.rootRank if opts is not None else 0
        if len(input_tensors) != 1:
            raise ValueError(f"fairring: {what}: expected one input tensor")
        outs = output_tensors[0] if self.rank() == root and output_tensors else []
        if any_cuda([input_tensors, outs]):
            return self._device_gather(outs, input_tensors[0], root, what, output_tensors)
        inp = _host(input_tensors[0], what).contiguous()
        if self.rank() == root:
            self._check_parts(what, "output", outs, inp)
        flat = torch.empty(self.size() * inp.numel(), dtype=inp.dtype)
        nbytes = inp.numel() * inp.element_size()

        start, array = _starting([_call(native.COLLECTIVE_GATHER, inp, flat, nbytes, root=root)])

        def finish():
            unpack(flat, outs)

        return self._start(what, [start], finish, output_tensors, (inp, flat, outs, array))

    def scatter(self, output_tensors, input_tensors, opts=None):
        """Part r of the root's input list into rank r's output, bit for bit:
        each part moves once, as a message from the root (in groups of up to
        32 ranks; in larger ones as a broadcast of the root's whole list)."""
        what = "scatter"
        root = opts.rootRank if opts is not None else 0
        if len(output_tensors) != 1:
            raise ValueError(f"fairring: {what}: expected one output tensor")
        if any_cuda([output_tensors, input_tensors]):
            parts = input_tensors[0] if self.rank() == root and input_tensors else []
            return self._device_scatter(output_tensors[0], parts, root, what, output_tensors)
        staged = _Staged(output_tensors[0], what)
        out = staged.buffer
        if self.rank() == root:
            parts = input_tensors[0] if input_tensors else []
            self._check_parts(what, "input", parts, out)
            flat = torch.cat([p.reshape(-1) for p in parts])
        else:
            flat = torch.empty(self.size() * out.numel(), dtype=out.dtype)
        nbytes = out.numel() * out.element_size()

        start, array = _starting(
            [_call(native.COLLECTIVE_SCATTER, flat, staged.buffer, nbytes, root=root)]
        )
        return self._start(what, [start], staged.finish, output_tensors, (flat, staged, array))

    def _check_scattered(self, what, flat, n, output):
        """Refuses a reduce-scatter input that is not `n` elements of the
        output's type per rank."""
        if flat.numel() != n * self.size() or flat.dtype != output.dtype:
            raise ValueError(
                f"fairring: {what}: the input ({flat.numel()} x {flat.dtype}) must hold "
                f"{self.size()} x the output ({n} x {output.dtype})"
            )

    def _check_parts(self, what, name, parts, like):
        """Refuses a list of per-rank parts that is not one `like` per rank."""
        if len(parts) != self.size():
            raise ValueError(
                f"fairring: {what}: the {name} list holds {len(parts)} tensors for "
                f"{self.size()} ranks"
            )
        for p in parts:
            if like.device.type == "cpu":
                _host(p, what)
            if p.numel() != like.numel() or p.dtype != like.dtype:
                raise ValueError(
                    f"fairring: {what}: an {name} tensor ({p.numel()} x {p.dtype}) does "
                    f"not match this rank's ({like.numel()} x {like.dtype})"
                )

    # What fairring does not implement: an error naming the call, never a
    # silent fallback to another backend.
    def _unsupported(self, call):
        raise NotImplementedError(
            f"fairring does not implement {call} (it implements allreduce, "
            "allreduce_coalesced, broadcast, allgather, all_gather_into_tensor, "
            "reduce_scatter, reduce_scatter_tensor, reduce, gather, scatter, all_to_all, "
            "all_to_all_single, send, recv from a given rank and barrier)"
        )

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """Rows `input_split_sizes[j]` of `input` (in order) to rank j, rows
        `output_split_sizes[j]` of `output` from it (equal splits where a list
        is empty): each block moves once, as a message to its rank."""
        what = "all_to_all_single"
        _host(input, what)
        staged = _Staged(output, what)
        inp = input.contiguous()
        if inp.dtype != staged.buffer.dtype:
            raise ValueError(
                f"fairring: {what}: the input is {inp.dtype} and the output {staged.buffer.dtype}"
            )
        ins = self._split_counts(what, "input", inp, input_split_sizes)
        outs = self._split_counts(what, "output", staged.buffer, output_split_sizes)
        start, array = self._all_to_all_start(inp, ins, staged.buffer, outs)
        return self._start(what, [start], staged.finish, [output], (inp, staged, array))

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """`input_tensors[j]` to rank j, `output_tensors[j]` from it (the
        lists packed into one buffer each, and the outputs unpacked)."""
        what = "all_to_all"
        if len(output_tensors) != self.size() or len(input_tensors) != self.size():
            raise ValueError(
                f"fairring: {what}: expected {self.size()} input and output tensors, got "
                f"{len(input_tensors)} and {len(output_tensors)}"
            )
        dtypes = {t.dtype for t in [*input_tensors, *output_tensors]}
        if len(dtypes) != 1:
            raise ValueError(f"fairring: {what}: the tensors are of several types {sorted(map(str, dtypes))}")
        for t in [*input_tensors, *output_tensors]:
            _host(t, what)
        flat_in = torch.cat([t.reshape(-1) for t in input_tensors])
        flat_out = torch.empty(sum(t.numel() for t in output_tensors), dtype=flat_in.dtype)
        ins = [t.numel() for t in input_tensors]
        outs = [t.numel() for t in output_tensors]
        start, array = self._all_to_all_start(flat_in, ins, flat_out, outs)

        def finish():
            unpack(flat_out, output_tensors)

        return self._start(what, [start], finish, output_tensors, (flat_in, flat_out, array))

    def _split_counts(self, what, name, tensor, sizes):
        """Elements per rank of `tensor` cut along its first dimension by
        `sizes` (equal cuts where it is empty)."""
        world = self.size()
        rows = tensor.shape[0] if tensor.dim() > 0 else tensor.numel()
        if not sizes:
            if rows % world:
                raise ValueError(
                    f"fairring: {what}: the {name}'s {rows} rows do not split equally "
                    f"among {world} ranks"
                )
            sizes = [rows // world] * world
        if len(sizes) != world or sum(sizes) != rows or min(sizes) < 0:
            raise ValueError(
                f"fairring: {what}: {name}_split_sizes {list(sizes)} must be {world} "
                f"sizes adding up to the {name}'s {rows} rows"
            )
        per_row = tensor.numel() // rows if rows else 0
        return [n * per_row for n in sizes]

    def _all_to_all_start(self, inp, ins, out, outs):
        """The function that starts an all-to-all of `ins[j]` elements of `inp`
        to rank j and `outs[j]` of `out` from it (both contiguous) as one
        group of sends and receives (`fr_start`), and the array of its calls.
        This rank's own block is copied here."""
        me = self.rank()
        if ins[me] != outs[me]:
            raise ValueError(
                f"fairring: all_to_all: this rank's block to itself ({ins[me]} elements) "
                f"does not fit its place in the output ({outs[me]} elements)"
            )
        # Each block's first element: the sums of the counts before it.
        at_in = [0, *itertools.accumulate(ins)]
        at_out = [0, *itertools.accumulate(outs)]
        out.view(-1)[at_out[me] : at_out[me] + outs[me]].copy_(
            inp.view(-1)[at_in[me] : at_in[me] + ins[me]]
        )
        calls = []
        for peer in range(self.size()):
            if peer != me:
                calls.append(_message_call(inp, at_in[peer], ins[peer], peer, True))
                calls.append(_message_call(out, at_out[peer], outs[peer], peer, False))
        return _starting(calls)

    # Point-to-point: a message is an operation of the library's engine,
    # from the sender's tensor into the receiver's. Messages from one rank
    # to another of one tag match that rank's receives of that tag in the
    # order both were posted, as NCCL's and MPI's do. A receive of another
    # size or type fails both messages, each naming both ranks (over the
    # fabric, between machines or ranks that may not read each other's
    # memory, a send of at most 16 KiB goes eagerly, and only its receive
    # fails).
    def _check_message(self, peer, tag, what):
        if not isinstance(peer, int) or not 0 <= peer < self.size() or peer == self.rank():
            raise ValueError(
                f"fairring: {what}: peer {peer} is not another rank of this group of "
                f"{self.size()}"
            )
        if not isinstance(tag, int) or not 0 <= tag < 1 << 32:
            raise ValueError(f"fairring: {what}: tag {tag} is not an integer in [0, 2**32)")

    def _message(self, what, tensor, peer, sending, tag):
        self._check_message(peer, tag, what)
        staged = _Staged(tensor, what, write_back=not sending)
        block = staged.buffer
        start, array = _starting([_message_call(block, 0, block.numel(), peer, sending, tag)])
        label = f"{what} {'to' if sending else 'from'} rank {peer}"
        return self._start(label, [start], staged.finish, [tensor], (staged, array))

    def send(self, tensors, dst, tag=0):
        if len(tensors) != 1:
            raise ValueError(f"fairring: send: expected one tensor, got {len(tensors)}")
        return self._message("send", tensors[0], dst, sending=True, tag=tag)

    def recv(self, tensors, src, tag=0):
        if len(tensors) != 1:
            raise ValueError(f"fairring: recv: expected one tensor, got {len(tensors)}")
        return self._message("recv", tensors[0], src, sending=False, tag=tag)

    def recv_anysource(self, *args, **kwargs):
        self._unsupported("recv (any source)")

    recvAnysource = recv_anysource


def create(store, rank, size, timeout):
    """The group's constructor, as ``Backend.register_backend`` calls it: a
    C++ ``c10d::Backend`` (``fairring._c10d``) over the Python group,
    registered for CPU and CUDA tensors on a torch ProcessGroup, as torch
    registers gloo's and NCCL's backends, and named "fairring"."""
    _c10d = c10d_module()
    # Read before joining: a bad value fails this rank before it meets.
    native_calls = _torch_calls() == "native"
    comm = joined_comm(store, rank, size)
    try:
        group = ProcessGroupFairring(store, rank, size, timeout, comm)
    except BaseException:
        if comm is not None:  # joined by id, and now no group's
            native.lib().fr_comm_destroy(comm)
        raise
    if _c10d is None:
        warnings.warn(
            "fairring: this install has no C++ backend (fairring._c10d; `pip install "
            "--no-build-isolation ./python` builds it): the group runs as a Python "
            "ProcessGroup, which torch registers for no device type (no "
            "monitored_barrier) and whose every call crosses the GIL",
            stacklevel=2,
        )
        return group
    backend = _c10d.Backend(
        group,
        group._comm.value,
        rank,
        size,
        group._state["completer"].callers_run_callbacks,
        native.library_path(),
        native_calls,
    )
    group._state.setdefault("on_teardown", []).append(backend.closer)
    process_group = _c10d.ProcessGroup(store, rank, size)
    custom = dist.ProcessGroup.BackendType.CUSTOM
    process_group._set_default_backend(custom)
    for device in ("cpu", "cuda"):
        process_group._register_backend(torch.device(device), custom, backend)
    return process_group
