"""Operations in flight: the completion thread that fulfils a group's futures
in issue order, and the `Work` objects torch.distributed hands callers."""

import collections
import ctypes
import datetime
import queue
import threading

import torch
import torch.distributed as dist

from . import _native as native
from ._native import FairringError

# How long the completion thread leaves operations to the threads that wait
# on them before it waits itself: a blocking caller settles its own operation
# (no hand-over, no contention for the GIL), and an operation nobody waits on
# is settled, and its engine handle freed, this long after it starts at most
# (plus its own time). A future asked for wakes the thread at once.
SWEEP_SECONDS = 0.002

# The prefix of the names of the threads that run `then` callbacks.
CALLBACK_THREAD = "fairring-callbacks-"

# What a mismatch in a group whose callbacks issued collectives adds.
_CALLBACK_RACE = (
    "; collectives issued from a future's callbacks (DDP's PowerSGD hook does "
    "this) take their place in the group's order when the callback runs, so "
    "with several operations in flight (several DDP buckets) they race with "
    "the issuing thread's and each other's, and ranks may order them "
    "differently: set FAIRRING_CALLBACKS=caller on every rank (a future is "
    "then handed out complete, so its callbacks run on the thread that "
    "attaches them, in the program's order), or run such hooks on one bucket "
    "(a bucket_cap_mb above the model's gradients)"
)


def _failure(what, status, completer):
    """The `FairringError` for `status`, with the library's last message on
    this thread; a mismatch in a group whose callbacks issue collectives
    says why it may have happened."""
    message = native.last_error()
    if status == native.MISMATCH and completer is not None and completer.callbacks_issue:
        message += _CALLBACK_RACE
    return FairringError(what, status, message)


def in_callback():
    """Whether the calling thread is running a group's `then` callbacks."""
    return threading.current_thread().name.startswith(CALLBACK_THREAD)


class _Pending:
    """Operations started in the engine, settled once by whichever thread
    sees them finish first: a caller in `Work.wait` (or `is_completed`), or
    the completion thread. Settling copies the results back and records the
    outcome (`failure`, which `Work.wait` raises); the future
    `Work.get_future` returns, made only when asked for, is completed by a
    dispatcher (or at once, if asked for after the operations finished). The
    engine's work handles are freed once the operations are settled and no
    thread waits on them any more."""

    __slots__ = (
        "works", "finish", "result", "what", "keep", "lock", "users",
        "freed", "settled", "failure", "gate", "chained", "completer", "device",
    )

    def __init__(self, works, finish, result, what, keep):
        self.works = works
        self.finish = finish
        self.result = result
        self.what = what
        self.keep = keep
        self.lock = threading.Lock()
        # Threads inside the library on `works`.
        self.users = 0
        self.freed = False
        self.settled = False
        self.failure = None
        self.gate = None
        self.chained = None
        # The group's `_Completer`, set when it is handed over.
        self.completer = None
        # For CUDA tensors: (the side stream the results are ready on, its
        # device index); None on the host.
        self.device = None

    def wait_here(self, seconds):
        """Waits for the operations on this thread (inside the library,
        without the GIL) and settles them if no other thread has; with
        `seconds` > 0, returns False if they are still running then."""
        with self.lock:
            if self.settled:
                return True
            self.users += 1
        lib = native.lib()
        failure, finished = None, True
        try:
            for w in self.works:
                status = native.PENDING
                while status == native.PENDING and finished:
                    ms = max(1, int(seconds * 1000)) if seconds > 0 else 1000
                    status = lib.fr_work_wait_timeout(w, ms)
                    finished = not (status == native.PENDING and seconds > 0)
                if not finished:
                    break
                if status != native.OK and failure is None:
                    failure = _failure(self.what, status, self.completer)
        finally:
            with self.lock:
                self.users -= 1
                self._free_locked()
        if finished:
            self._settle(failure)
        return finished

    def poll(self):
        """Whether the operations have finished, without waiting; settles
        them if they have."""
        with self.lock:
            if self.settled:
                return True
            self.users += 1
        lib = native.lib()
        failure, finished = None, True
        try:
            done = ctypes.c_bool(False)
            for w in self.works:
                status = lib.fr_work_test(w, ctypes.byref(done))
                if status != native.OK and failure is None:
                    failure = _failure(self.what, status, self.completer)
                finished = finished and (done.value or status != native.OK)
        finally:
            with self.lock:
                self.users -= 1
                self._free_locked()
        if finished:
            self._settle(failure)
        return finished

    def _settle(self, failure):
        """Settles the operations, once: copies results back, records the
        outcome, frees the handles if no thread waits on them, and has a
        dispatcher complete the future handed out for callbacks."""
        with self.lock:
            if self.settled:
                return
            if failure is None and self.finish is not None:
                try:
                    self.finish()
                except Exception as e:  # a copy back that failed
                    failure = e
            self.settled = True
            self.failure = failure
            self._free_locked()
            callbacks = self.gate is not None
            if not callbacks:
                self.keep = None
        if callbacks:
            # A callback may wait on a later operation: never on this thread.
            self.completer.hand_over(self, failure)

    def _free_locked(self):
        if self.settled and self.users == 0 and not self.freed:
            self.freed = True
            lib = native.lib()
            for w in self.works:
                lib.fr_work_free(w)

    def future_for_callbacks(self):
        with self.lock:
            if self.chained is None:
                # A CUDA-aware future where the results are on a GPU: its
                # callbacks and `value()` are ordered after them on the device.
                self.gate = _future_on(self.device)
                # A future failed through set_exception alone reads as success
                # to C++ callers (DDP's reducer); re-raising in `then` marks it
                # failed.
                self.chained = self.gate.then(lambda f: f.value())
                if self.settled:
                    # No callback is attached yet: completing it here runs none.
                    _complete(self.gate, self.result, self.failure, self.device)
                elif self.completer is not None:
                    self.completer.urge()
            return self.chained


def _future_on(device):
    """A future for results on `device` ((side stream, index), or None for
    the host)."""
    return torch.futures.Future(devices=[device[1]] if device is not None else None)


def _complete(future, result, failure, device=None):
    if failure is not None:
        future.set_exception(failure)
    elif device is None:
        future.set_result(result)
    else:
        # A CUDA-aware future records an event on the completing thread's
        # current stream: make that the side stream, after the results.
        with torch.cuda.stream(device[0]):
            future.set_result(result)


class _Completer:
    """Completes a group's operations that no caller completes itself.

    A caller that waits (`Work.wait`) waits inside the library on its own
    thread and settles its operation there: a blocking call wakes without a
    hand-over. Every operation is also put on a backlog that one thread goes
    through in issue order, waiting (inside the library, without the GIL) for
    those not settled yet: it lets `SWEEP_SECONDS` pass first unless a future
    was asked for, so that it contends with no blocking caller, and it sleeps
    while the backlog is empty. The future `get_future` returns, to which
    callers attach ``then`` callbacks, is completed by a dispatcher thread,
    because completing a future runs its callbacks on the completing thread,
    and a callback may wait on a later operation of the same group (PowerSGD's
    hooks do; so may any user's). Every operation handed over has a
    dispatcher of its own reserved: an idle one, or a new thread while all are
    busy in callbacks. A callback that blocks holds up only itself, and a wait
    that can no longer finish ends with the group's timeout, which fails the
    operation waited on.
    """

    def __init__(self, rank, callers_run_callbacks=False):
        self._rank = rank
        # FAIRRING_CALLBACKS=caller: `get_future` waits for its operation, so
        # callbacks run on the thread that attaches them (see `Work`).
        self.callers_run_callbacks = callers_run_callbacks
        self._backlog = collections.deque()
        self._wake = threading.Event()
        self._asleep = False
        self._closing = False
        self._ready = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._dispatchers = []
        # Set once a callback issued a collective on this group.
        self.callbacks_issue = False
        self._thread = threading.Thread(
            target=self._run, name=f"fairring-futures-{rank}", daemon=True
        )
        self._thread.start()

    def put(self, pending):
        pending.completer = self
        self._backlog.append(pending)
        if self._asleep:
            self._wake.set()

    def urge(self):
        """Has the thread go through the backlog now (a future was asked for)."""
        self._wake.set()

    def close(self):
        """Ends the threads once the operations already handed over are
        complete, and joins them (but not the calling thread, if it is one)."""
        me = threading.current_thread()
        if self._thread.is_alive():
            self._closing = True
            self._wake.set()
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
        backlog = self._backlog
        while True:
            if not backlog:
                if self._closing:
                    return
                # Announce the sleep, then look again: `put` wakes a sleeper.
                self._asleep = True
                if not backlog and not self._closing:
                    self._wake.wait()
                self._asleep = False
                self._wake.clear()
                continue
            if not self._closing and self._wake.wait(SWEEP_SECONDS):
                self._wake.clear()
            # What was handed over until now; later operations wait for the
            # next pass (their callers may still wait on them themselves).
            for _ in range(len(backlog)):
                p = backlog.popleft()
                if not p.settled:
                    p.wait_here(0)

    def hand_over(self, p, failure):
        """Has a dispatcher complete `p`'s future for callbacks."""
        with self._lock:
            if self._idle > 0:
                self._idle -= 1  # reserved for this one
            else:
                d = threading.Thread(
                    target=self._dispatch,
                    name=f"{CALLBACK_THREAD}{self._rank}-{len(self._dispatchers)}",
                    daemon=True,
                )
                self._dispatchers.append(d)
                d.start()
        self._ready.put((p, failure))

    def _dispatch(self):
        from ._backend import c10d_module

        # So that a call a callback issues through the C++ backend says so.
        c10d = c10d_module()
        if c10d is not None:
            c10d.mark_callback_thread()
        while True:
            item = self._ready.get()
            if item is None:
                return
            p, failure = item
            _complete(p.gate, p.result, failure, p.device)
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
        self._keep = keep
        self._what = what

    def wait(self, timeout=datetime.timedelta(0)):
        """Waits for the operation (up to `timeout` if it is not zero) and
        raises its error. The waiting thread waits inside the library itself
        (without the GIL) and, if it sees the operation finish first, settles
        it: a blocking call wakes without a hand-over between threads."""
        seconds = timeout.total_seconds() if timeout else 0
        if not self._pending.wait_here(seconds):
            raise RuntimeError(
                f"fairring: {self._what} did not finish within {seconds:g} s "
                "(it still runs; the group's own timeout fails it if a peer is lost)"
            )
        # Settled: the `FairringError` itself (a future's would wrap it in a
        # RuntimeError about a callback).
        if self._pending.failure is not None:
            raise self._pending.failure
        return True

    def is_completed(self):
        return self._pending.poll()

    def is_success(self):
        return self._pending.poll() and self._pending.failure is None

    def exception(self):
        return self._pending.failure if self._pending.poll() else None

    def get_future(self):
        # Made on demand: an operation nobody asked a future of (a blocking
        # call) finishes without a hand-over to a dispatcher.
        p = self._pending
        if p.completer is not None and p.completer.callers_run_callbacks:
            # FAIRRING_CALLBACKS=caller: the future comes back complete, so
            # the callbacks attached to it run at once on the attaching
            # thread, in the program's order on every rank.
            p.wait_here(0)
            future = p.future_for_callbacks()
            _wait_quietly(future)
            return future
        return p.future_for_callbacks()


def _wait_quietly(future):
    """Waits for `future` to complete; its failure stays in it, for its
    callbacks and for whoever waits on it."""
    try:
        future.wait()
    except Exception:  # noqa: BLE001 (the future keeps it)
        pass


class DeviceWork(Work):
    """A fairring operation on CUDA tensors. ``wait()`` makes the current
    stream wait for `done`, the event recorded on the side stream after the
    operation and the copies of its results where the caller wants them, and
    returns: the host does not wait, as in ProcessGroupNCCL. It raises the
    operation's error if the operation is already known to have failed; one
    that fails later fails its future, and the group's next calls. With a
    `timeout`, the host also waits for the operation, up to it, as
    ProcessGroupNCCL's blocking wait does. ``is_completed()`` asks without
    waiting; the future is CUDA-aware."""

    def __init__(self, pending, keep, what, done):
        super().__init__(pending, keep, what)
        self._done = done

    def wait(self, timeout=datetime.timedelta(0)):
        p = self._pending
        if p.poll() and p.failure is not None:
            raise p.failure
        torch.cuda.current_stream(p.device[1]).wait_event(self._done)
        if timeout and timeout.total_seconds() > 0:
            super().wait(timeout)
        return True

    def is_completed(self):
        return self._pending.poll() and self._done.query()

    def synchronize(self):
        self.wait()


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
        completer = self._works[0]._pending.completer if self._works else None
        if completer is not None and completer.callers_run_callbacks:
            # As `Work.get_future`: complete before it is handed out.
            for w in self._works:
                w._pending.wait_here(0)
            _wait_quietly(self._future)
        return self._future
