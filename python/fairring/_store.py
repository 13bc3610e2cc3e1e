"""The c10d store PyTorch hands the backend, bridged to the C ABI's store
callbacks."""

import ctypes
import time
import logging

from . import _native as native

log = logging.getLogger("fairring")


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
        # Polled rather than waited for: a store client runs one request at a
        # time, and a blocking wait would hold up every other user of it in
        # this process (the library's linker, linking a peer a message first
        # names, waits for keys the peer publishes) until it timed out.
        deadline = time.monotonic() + timeout_ms / 1000
        pause = 0.0002
        try:
            while not self._store.check([k]):
                if time.monotonic() >= deadline:
                    return native.STORE_TIMEOUT
                time.sleep(pause)
                pause = min(pause * 2, 0.01)
        except Exception as e:
            return self._failed("check", e)
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
