"""The c10d store PyTorch hands the backend, bridged to the C ABI's store
callbacks."""

import ctypes
import datetime
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
