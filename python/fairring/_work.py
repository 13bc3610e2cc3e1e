"""Operations in flight: the completion thread that fulfils a group's futures
in issue order, and the `Work` objects torch.distributed hands callers."""

import datetime
import queue
import threading

import torch.distributed as dist

from . import _native as native
from ._native import FairringError

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
