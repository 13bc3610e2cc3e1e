"""Operations in flight: the completion thread that fulfils a group's futures
in issue order, and the `Work` objects torch.distributed hands callers."""

import datetime
import queue
import threading

import torch
import torch.distributed as dist

from . import _native as native
from ._native import FairringError

class _Pending:
    """Operations started in the engine. When all finish, `future` (what
    `Work.wait` waits on) is completed; the future `Work.get_future` returns,
    made only when asked for, is completed by a dispatcher (or at once, if
    asked for after the operations finished)."""

    __slots__ = (
        "works", "future", "finish", "result", "what", "keep",
        "lock", "settled", "failure", "gate", "chained",
    )

    def __init__(self, works, future, finish, result, what, keep):
        self.works = works
        self.future = future
        self.finish = finish
        self.result = result
        self.what = what
        self.keep = keep
        self.lock = threading.Lock()
        self.settled = False
        self.failure = None
        self.gate = None
        self.chained = None

    def settle(self, failure):
        """Records the outcome; returns whether a dispatcher must complete the
        future handed out for callbacks."""
        with self.lock:
            self.settled = True
            self.failure = failure
            return self.gate is not None

    def future_for_callbacks(self):
        with self.lock:
            if self.chained is None:
                self.gate = torch.futures.Future()
                # A future failed through set_exception alone reads as success
                # to C++ callers (DDP's reducer); re-raising in `then` marks it
                # failed.
                self.chained = self.gate.then(lambda f: f.value())
                if self.settled:
                    # No callback is attached yet: completing it here runs none.
                    _complete(self.gate, self.result, self.failure)
            return self.chained


def _complete(future, result, failure):
    if failure is None:
        future.set_result(result)
    else:
        future.set_exception(failure)


class _Completer:
    """Completes a group's operations.

    One thread waits for them in issue order (inside the library, without the
    GIL), copies results back and completes the future `Work.wait` waits on,
    which carries none of the caller's callbacks: a blocking caller wakes after
    one hand-over, and an operation nobody asked a future of ends there. The
    future `get_future` returns, to which callers attach ``then`` callbacks,
    is completed by a dispatcher thread instead, because
    completing a future runs its callbacks on the completing thread, and a
    callback may wait on a later operation of the same group (PowerSGD's hooks
    do; so may any user's). Every operation handed over has a dispatcher of
    its own reserved: an idle one, or a new thread while all are busy in
    callbacks. A callback that blocks holds up only itself, and a wait that
    can no longer finish ends with the group's timeout, which fails the
    operation waited on.
    """

    def __init__(self, rank):
        self._rank = rank
        self._queue = queue.SimpleQueue()
        self._ready = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._dispatchers = []
        self._thread = threading.Thread(
            target=self._run, name=f"fairring-futures-{rank}", daemon=True
        )
        self._thread.start()

    def put(self, pending):
        self._queue.put(pending)

    def close(self):
        """Ends the threads once the operations already handed over are
        complete, and joins them (but not the calling thread, if it is one)."""
        me = threading.current_thread()
        if self._thread.is_alive():
            self._queue.put(None)
            if me is not self._thread:
                self._thread.join()
        with self._lock:
            dispatchers = list(self._dispatchers)
        for _ in dispatchers:
            self._ready.put(None)
        for d in dispatchers:
            if d is not me:
                d.join()

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
            if failure is None and p.finish is not None:
                try:
                    p.finish()
                except Exception as e:  # a copy back that failed
                    failure = e
            # `future` holds only the package's own callbacks.
            _complete(p.future, p.result, failure)
            if p.settle(failure):
                self._hand_over(p, failure)
            else:
                p.keep = None

    def _hand_over(self, p, failure):
        with self._lock:
            if self._idle > 0:
                self._idle -= 1  # reserved for this one
            else:
                d = threading.Thread(
                    target=self._dispatch,
                    name=f"fairring-callbacks-{self._rank}-{len(self._dispatchers)}",
                    daemon=True,
                )
                self._dispatchers.append(d)
                d.start()
        self._ready.put((p, failure))

    def _dispatch(self):
        while True:
            item = self._ready.get()
            if item is None:
                return
            p, failure = item
            _complete(p.gate, p.result, failure)
            # The tensors may be reclaimed now.
            p.keep = None
            with self._lock:
                self._idle += 1


class Work(dist.Work):
    """A fairring operation in flight.

    ``wait()`` blocks until it finishes and raises its error; ``get_future()``
    completes with the operation's output tensors or fails with the error. The
    tensors are kept alive until the operation finishes.
    """

    def __init__(self, pending, keep, what="operation"):
        super().__init__()
        self._pending = pending
        self._raw = pending.future
        self._keep = keep
        self._what = what
        self._done = threading.Event()
        self._raw.add_done_callback(lambda _: self._done.set())

    def wait(self, timeout=datetime.timedelta(0)):
        """Waits for the operation (up to `timeout` if it is not zero) and
        raises its error."""
        seconds = timeout.total_seconds() if timeout else 0
        if seconds > 0 and not self._done.wait(seconds):
            raise RuntimeError(
                f"fairring: {self._what} did not finish within {seconds:g} s "
                "(it still runs; the group's own timeout fails it if a peer is lost)"
            )
        # The raw future raises the `FairringError` itself (the chained one
        # would wrap it in a RuntimeError about a callback).
        self._raw.wait()
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
        # Made on demand: an operation nobody asked a future of (a blocking
        # call) finishes without a hand-over to a dispatcher.
        return self._pending.future_for_callbacks()


class _Chained(dist.Work):
    """A Work over several: finished when all are, failed if any failed."""

    def __init__(self, future, works):
        super().__init__()
        self._future = future.then(lambda f: f.value())
        self._works = works

    def wait(self, timeout=datetime.timedelta(0)):
        # Each work raises its own `FairringError`.
        for w in self._works:
            w.wait(timeout)
        return True

    def is_completed(self):
        return self._future.done()

    def get_future(self):
        return self._future
