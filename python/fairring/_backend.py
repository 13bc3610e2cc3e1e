"""The ``fairring`` process group: torch.distributed collectives on fairring's
engine, through its C ABI.

Every collective starts in the engine at once (the calling thread never waits
for the network) and returns a `Work` whose future one completion thread per
group fulfils, in the order the operations were issued. A failed operation
fails its future with a `FairringError` naming the cause (the lost rank, the
mismatching call), so ``wait()``, DDP's reducer and ``get_future()`` all raise.
"""

import atexit
import ctypes
import datetime
import logging
import queue
import threading
import weakref

import torch
import torch.distributed as dist

from . import _native as native
from ._native import FairringError

log = logging.getLogger("fairring")

_DTYPES = {
    torch.float32: native.DTYPE_F32,
    torch.float64: native.DTYPE_F64,
    torch.float16: native.DTYPE_F16,
    torch.bfloat16: native.DTYPE_BF16,
    torch.int32: native.DTYPE_I32,
    torch.int64: native.DTYPE_I64,
    torch.uint8: native.DTYPE_U8,
    torch.int8: native.DTYPE_I8,
}

_RED = dist.ReduceOp.RedOpType
_OPS = {
    _RED.SUM: native.OP_SUM,
    _RED.PRODUCT: native.OP_PRODUCT,
    _RED.MIN: native.OP_MIN,
    _RED.MAX: native.OP_MAX,
    _RED.AVG: native.OP_AVG,
}


def _op_code(op, what):
    # `ReduceOp` compares equal to its RedOpType but hashes differently: key
    # on the RedOpType.
    kind = getattr(op, "op", op)
    code = _OPS.get(kind)
    if code is None:
        raise ValueError(
            f"fairring: {what}: ReduceOp.{getattr(kind, 'name', kind)} is not supported "
            "(supported: SUM, AVG, PRODUCT, MIN, MAX)"
        )
    return code


def _dtype_code(tensor, what):
    code = _DTYPES.get(tensor.dtype)
    if code is None:
        names = ", ".join(str(d).replace("torch.", "") for d in _DTYPES)
        raise TypeError(
            f"fairring: {what}: reductions on {tensor.dtype} are not supported "
            f"(supported: {names})"
        )
    return code


def _host(tensor, what):
    """Checks that fairring can take `tensor`: a dense CPU tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"fairring: {what}: expected a tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"fairring: {what}: {tensor.layout} tensors are not supported")
    if tensor.device.type != "cpu":
        raise RuntimeError(
            f"fairring: {what} on a {tensor.device.type} tensor: the Python backend "
            "takes CPU tensors only (the engine's CUDA tensors are reached from Rust "
            "and C, not yet from PyTorch); pass CPU tensors"
        )
    return tensor


class _Staged:
    """A tensor as the engine sees it: itself if contiguous, else a contiguous
    copy that is written back when the operation finishes."""

    def __init__(self, tensor, what, write_back=True):
        _host(tensor, what)
        self.tensor = tensor
        self.buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
        self.write_back = write_back and self.buffer is not tensor

    def ptr(self):
        return ctypes.c_void_p(self.buffer.data_ptr())

    def finish(self):
        if self.write_back:
            self.tensor.copy_(self.buffer)


class _Pending:
    """Operations started in the engine, whose future is set when all finish."""

    __slots__ = ("works", "future", "finish", "result", "what", "keep")

    def __init__(self, works, future, finish, result, what, keep):
        self.works = works
        self.future = future
        self.finish = finish
        self.result = result
        self.what = what
        self.keep = keep


class _Completer:
    """One thread that waits for a group's operations in issue order and
    fulfils their futures. Waiting happens inside the library, without the GIL."""

    def __init__(self, rank):
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(
            target=self._run, name=f"fairring-futures-{rank}", daemon=True
        )
        self._thread.start()

    def put(self, pending):
        self._queue.put(pending)

    def close(self):
        if self._thread.is_alive():
            self._queue.put(None)
            if threading.current_thread() is not self._thread:
                self._thread.join()

    def _run(self):
        lib = native.lib()
        while True:
            p = self._queue.get()
            if p is None:
                return
            failure = None
            for w in p.works:
                status = native.PENDING
                while status == native.PENDING:
                    status = lib.fr_work_wait_timeout(w, 1000)
                if status != native.OK and failure is None:
                    failure = FairringError(p.what, status, native.last_error())
                lib.fr_work_free(w)
            if failure is None:
                try:
                    if p.finish is not None:
                        p.finish()
                    p.future.set_result(p.result)
                except Exception as e:  # a copy back that failed
                    p.future.set_exception(e)
            else:
                p.future.set_exception(failure)
            # The tensors may be reclaimed now.
            p.keep = None


class Work(dist.Work):
    """A fairring operation in flight.

    ``wait()`` blocks until it finishes and raises its error; ``get_future()``
    completes with the operation's output tensors or fails with the error. The
    tensors are kept alive until the operation finishes.
    """

    def __init__(self, future, keep, what="operation"):
        super().__init__()
        self._raw = future
        # A future failed through set_exception alone reads as success to
        # C++ callers (DDP's reducer); re-raising in `then` marks it failed.
        self._future = future.then(lambda f: f.value())
        self._keep = keep
        self._what = what
        self._done = threading.Event()
        future.add_done_callback(lambda _: self._done.set())

    def wait(self, timeout=datetime.timedelta(0)):
        """Waits for the operation (up to `timeout` if it is not zero) and
        raises its error."""
        seconds = timeout.total_seconds() if timeout else 0
        if seconds > 0 and not self._done.wait(seconds):
            raise RuntimeError(
                f"fairring: {self._what} did not finish within {seconds:g} s "
                "(it still runs; the group's own timeout fails it if a peer is lost)"
            )
        self._future.wait()
        return True

    def is_completed(self):
        return self._raw.done()

    def is_success(self):
        if not self._raw.done():
            return False
        try:
            self._raw.value()
            return True
        except Exception:
            return False

    def exception(self):
        if not self._raw.done():
            return None
        try:
            self._raw.value()
            return None
        except Exception as e:
            return e

    def get_future(self):
        return self._future


class _StoreBridge:
    """The c10d store PyTorch hands the backend, as fairring's store callbacks."""

    def __init__(self, store):
        self._store = store
        self.error = None
        self.struct = native.Store(
            None,
            native.SET_FN(self._set),
            native.GET_FN(self._get),
            native.CHECK_FN(self._check),
            native.RELEASE_FN(self._release),
        )

    def _failed(self, what, e):
        self.error = f"{what}: {e}"
        log.debug("fairring: store %s failed: %s", what, e)
        return native.STORE_FAILED

    def _set(self, user, key, value, length):
        try:
            self._store.set(key.decode(), ctypes.string_at(value, length))
            return native.STORE_OK
        except Exception as e:
            return self._failed("set", e)

    def _get(self, user, key, timeout_ms, buf, capacity, length):
        k = key.decode()
        try:
            self._store.wait([k], datetime.timedelta(milliseconds=timeout_ms))
        except Exception as e:
            if "timeout" in str(e).lower() or "timed out" in str(e).lower():
                return native.STORE_TIMEOUT
            return self._failed("wait", e)
        try:
            v = self._store.get(k)
            if len(v) > capacity:
                return self._failed("get", f"{k} holds {len(v)} bytes")
            ctypes.memmove(buf, v, len(v))
            length[0] = len(v)
            return native.STORE_OK
        except Exception as e:
            return self._failed("get", e)

    def _check(self, user, keys, count, ready):
        try:
            ready[0] = bool(self._store.check([keys[i].decode() for i in range(count)]))
            return native.STORE_OK
        except Exception as e:
            return self._failed("check", e)

    def _release(self, user):
        self._store = None


def _teardown(state):
    """Destroys a group's communicator once: joins its completion thread, then
    lets the engine go (which joins its threads)."""
    comm, completer = state.pop("comm", None), state.pop("completer", None)
    if completer is not None:
        completer.close()
    if comm is not None:
        native.lib().fr_comm_destroy(comm)


_live = weakref.WeakSet()


@atexit.register
def _teardown_all():
    for pg in list(_live):
        pg.shutdown()


class ProcessGroupFairring(dist.ProcessGroup):
    """fairring as a ``torch.distributed`` process group (CPU tensors)."""

    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        lib = native.lib()
        self._bridge = _StoreBridge(store)
        comm = native.comm_p()
        ms = int(timeout.total_seconds() * 1000) if timeout is not None else 0
        status = lib.fr_comm_with_store(
            rank, size, ctypes.byref(self._bridge.struct), max(ms, 0), ctypes.byref(comm)
        )
        if status != native.OK:
            message = native.last_error()
            if self._bridge.error:
                message += f" (store: {self._bridge.error})"
            raise FairringError(f"joining the group as rank {rank} of {size}", status, message)
        self._comm = comm
        self._state = {"comm": comm, "completer": _Completer(rank)}
        self._finalizer = weakref.finalize(self, _teardown, self._state)
        _live.add(self)

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

    # The engine.
    def _start(self, what, start_one, finish, result, keep):
        """Starts operations with `start_one(out_work_pointer) -> status` (each
        call of the iterable) and returns one Work over them."""
        if "comm" not in self._state:
            raise RuntimeError(f"fairring: {what}: the process group has been shut down")
        works = []
        try:
            for start in start_one:
                w = native.work_p()
                native.check(start(self._comm, ctypes.byref(w)), what)
                works.append(w)
        except BaseException:
            # Started ones still run: let the completion thread release them.
            if works:
                self._state["completer"].put(
                    _Pending(works, torch.futures.Future(), None, None, what, keep)
                )
            raise
        future = torch.futures.Future()
        self._state["completer"].put(_Pending(works, future, finish, result, what, keep))
        return Work(future, keep, what)

    def allreduce(self, tensors, opts=None):
        what = "allreduce"
        op = _op_code(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, what)
        if len(tensors) != 1:
            return self._allreduce_list(tensors, op, what)
        staged = _Staged(tensors[0], what)
        dtype = _dtype_code(tensors[0], what)
        n = staged.buffer.numel()

        def start(comm, out):
            return native.lib().fr_all_reduce(comm, staged.ptr(), n, dtype, op, out)

        return self._start(what, [start], staged.finish, tensors, staged)

    def allreduce_coalesced(self, tensors, opts=None):
        what = "allreduce_coalesced"
        op = _op_code(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, what)
        return self._allreduce_list(tensors, op, what)

    def _allreduce_list(self, tensors, op, what):
        staged = [_Staged(t, what) for t in tensors]
        # One coalesced operation per run of one dtype, in list order (the same
        # on every rank).
        runs = []
        for s in staged:
            code = _dtype_code(s.tensor, what)
            if runs and runs[-1][0] == code:
                runs[-1][1].append(s)
            else:
                runs.append((code, [s]))

        def starter(code, group):
            ptrs = (ctypes.c_void_p * len(group))(*[s.buffer.data_ptr() for s in group])
            counts = (ctypes.c_uint64 * len(group))(*[s.buffer.numel() for s in group])

            def start(comm, out):
                return native.lib().fr_all_reduce_coalesced(
                    comm, ptrs, counts, len(group), code, op, out
                )

            return start

        def finish():
            for s in staged:
                s.finish()

        starts = [starter(code, group) for code, group in runs]
        return self._start(what, starts, finish, tensors, staged)

    def broadcast(self, tensors, opts=None):
        what = "broadcast"
        root = opts.rootRank if opts is not None else 0
        if len(tensors) != 1:
            raise ValueError(f"fairring: {what}: expected one tensor, got {len(tensors)}")
        staged = _Staged(tensors[0], what)
        nbytes = staged.buffer.numel() * staged.buffer.element_size()

        def start(comm, out):
            # Bit-exact for every dtype: the engine moves bytes.
            return native.lib().fr_broadcast(comm, staged.ptr(), nbytes, native.DTYPE_U8, root, out)

        return self._start(what, [start], staged.finish, tensors, staged)

    def allgather(self, output_tensors, input_tensors, opts=None):
        what = "allgather"
        if len(input_tensors) != 1 or len(output_tensors) != 1:
            raise ValueError(f"fairring: {what}: expected one input tensor and one output list")
        inp = _host(input_tensors[0], what).contiguous()
        outs = output_tensors[0]
        if len(outs) != self.size():
            raise ValueError(
                f"fairring: {what}: the output list holds {len(outs)} tensors for "
                f"{self.size()} ranks"
            )
        for o in outs:
            _host(o, what)
            if o.numel() != inp.numel() or o.dtype != inp.dtype:
                raise ValueError(
                    f"fairring: {what}: an output tensor ({o.numel()} x {o.dtype}) does "
                    f"not match the input ({inp.numel()} x {inp.dtype})"
                )
        flat = torch.empty(self.size() * inp.numel(), dtype=inp.dtype)
        nbytes = inp.numel() * inp.element_size()

        def start(comm, out):
            return native.lib().fr_all_gather(
                comm,
                ctypes.c_void_p(inp.data_ptr()),
                ctypes.c_void_p(flat.data_ptr()),
                nbytes,
                native.DTYPE_U8,
                out,
            )

        def finish():
            for r, o in enumerate(outs):
                o.copy_(flat[r * inp.numel() : (r + 1) * inp.numel()].view(o.shape))

        return self._start(what, [start], finish, output_tensors, (inp, flat, outs))

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """``output_lists[r][i]`` receives rank r's ``inputs[i]``."""
        works = [
            self.allgather([[out[i] for out in output_lists]], [t], opts)
            for i, t in enumerate(inputs)
        ]
        return self._chain(works, output_lists)

    def all_gather_single(self, output, input, opts=None):
        what = "all_gather_into_tensor"
        _host(input, what)
        staged = _Staged(output, what)
        if staged.buffer.numel() != self.size() * input.numel() or output.dtype != input.dtype:
            raise ValueError(
                f"fairring: {what}: the output ({output.numel()} x {output.dtype}) must hold "
                f"{self.size()} x the input ({input.numel()} x {input.dtype})"
            )
        inp = input.contiguous()
        nbytes = inp.numel() * inp.element_size()

        def start(comm, out):
            return native.lib().fr_all_gather(
                comm, ctypes.c_void_p(inp.data_ptr()), staged.ptr(), nbytes, native.DTYPE_U8, out
            )

        return self._start(what, [start], staged.finish, [output], (inp, staged))

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
        for t in ins:
            _host(t, what)
        flat = torch.cat([t.reshape(-1) for t in ins])
        return self._reduce_scatter(output_tensors[0], flat, opts, what, output_tensors)

    def reduce_scatter_single(self, output, input, opts=None):
        what = "reduce_scatter_tensor"
        _host(input, what)
        # The engine reduces its input in place; the caller's stays untouched.
        return self._reduce_scatter(output, input.reshape(-1).clone(), opts, what, [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._chain(works, outputs)

    def _reduce_scatter(self, output, flat, opts, what, result):
        op = _op_code(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, what)
        staged = _Staged(output, what)
        dtype = _dtype_code(output, what)
        n = staged.buffer.numel()
        if flat.numel() != n * self.size() or flat.dtype != output.dtype:
            raise ValueError(
                f"fairring: {what}: the input ({flat.numel()} x {flat.dtype}) must hold "
                f"{self.size()} x the output ({n} x {output.dtype})"
            )

        def start(comm, out):
            return native.lib().fr_reduce_scatter(
                comm, ctypes.c_void_p(flat.data_ptr()), staged.ptr(), n, dtype, op, out
            )

        return self._start(what, [start], staged.finish, result, (flat, staged))

    def barrier(self, opts=None):
        def start(comm, out):
            return native.lib().fr_barrier(comm, out)

        return self._start("barrier", [start], None, [], None)

    def _chain(self, works, result):
        """One Work that finishes when all of `works` have (they complete in
        order on the completion thread, so the last one's future is last)."""
        def outcome(f):
            for each in f.value():
                each.value()  # raises the first failure
            return result

        all_done = torch.futures.collect_all([w.get_future() for w in works]).then(outcome)
        return _Chained(all_done, works)

    # What fairring does not implement: an error naming the call, never a
    # silent fallback to another backend.
    def _unsupported(self, call):
        raise NotImplementedError(
            f"fairring does not implement {call} (it implements allreduce, "
            "allreduce_coalesced, broadcast, allgather, all_gather_into_tensor, "
            "reduce_scatter, reduce_scatter_tensor and barrier)"
        )

    def reduce(self, *args, **kwargs):
        self._unsupported("reduce")

    def gather(self, *args, **kwargs):
        self._unsupported("gather")

    def scatter(self, *args, **kwargs):
        self._unsupported("scatter")

    def alltoall(self, *args, **kwargs):
        self._unsupported("alltoall")

    def alltoall_base(self, *args, **kwargs):
        self._unsupported("all_to_all_single")

    all_to_all_single = alltoall_base

    def send(self, *args, **kwargs):
        self._unsupported("send")

    def recv(self, *args, **kwargs):
        self._unsupported("recv")

    def recv_anysource(self, *args, **kwargs):
        self._unsupported("recv (any source)")

    recvAnysource = recv_anysource


class _Chained(dist.Work):
    """A Work over several: finished when all are, failed if any failed."""

    def __init__(self, future, works):
        super().__init__()
        self._future = future.then(lambda f: f.value())
        self._works = works

    def wait(self, timeout=datetime.timedelta(0)):
        self._future.wait()
        return True

    def is_completed(self):
        return self._future.done()

    def get_future(self):
        return self._future


def create(store, rank, size, timeout):
    """The backend's constructor, as ``Backend.register_backend`` calls it."""
    return ProcessGroupFairring(store, rank, size, timeout)
