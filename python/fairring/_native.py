"""ctypes bindings of fairring's C ABI (``fairring-ffi/include/fairring.h``).

Only what the backend needs, with every signature declared: a call with the
wrong types fails here, in Python, not inside the library.
"""

import ctypes
import glob
import os
import threading

# fr_status values (fairring.h).
OK = 0
PENDING = 1
INVALID_ARGUMENT = 2
TIMEOUT = 6
PEER = 7
MISMATCH = 10
ABORTED = 12

STORE_OK = 0
STORE_TIMEOUT = 1
STORE_FAILED = 2

# FR_DTYPE_* and FR_OP_* (the engine's stable discriminants).
DTYPE_F32, DTYPE_F64, DTYPE_F16, DTYPE_BF16 = 0, 1, 2, 3
DTYPE_I32, DTYPE_I64, DTYPE_U8, DTYPE_I8 = 4, 5, 6, 7
DTYPE_I16, DTYPE_BOOL = 8, 9
OP_SUM, OP_PRODUCT, OP_MIN, OP_MAX, OP_AVG = 0, 1, 2, 3, 4
OP_BAND, OP_BOR, OP_BXOR = 5, 6, 7

# FR_COLLECTIVE_*, FR_MEMORY_* (the fields of an `fr_call`).
COLLECTIVE_ALL_REDUCE, COLLECTIVE_BROADCAST, COLLECTIVE_ALL_GATHER = 1, 2, 3
COLLECTIVE_REDUCE_SCATTER, COLLECTIVE_BARRIER, COLLECTIVE_REDUCE = 4, 5, 6
COLLECTIVE_GATHER, COLLECTIVE_SCATTER, COLLECTIVE_SEND, COLLECTIVE_RECV = 7, 8, 9, 10
MEMORY_HOST, MEMORY_DEVICE = 0, 1

c_status = ctypes.c_int32
comm_p = ctypes.c_void_p
work_p = ctypes.c_void_p

SET_FN = ctypes.CFUNCTYPE(
    ctypes.c_int32, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t
)
GET_FN = ctypes.CFUNCTYPE(
    ctypes.c_int32,
    ctypes.c_void_p,
    ctypes.c_char_p,
    ctypes.c_uint64,
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.POINTER(ctypes.c_size_t),
)
CHECK_FN = ctypes.CFUNCTYPE(
    ctypes.c_int32,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_char_p),
    ctypes.c_size_t,
    ctypes.POINTER(ctypes.c_bool),
)
RELEASE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class Store(ctypes.Structure):
    """``fr_store``."""

    _fields_ = [
        ("user", ctypes.c_void_p),
        ("set", SET_FN),
        ("get", GET_FN),
        ("check", CHECK_FN),
        ("release", RELEASE_FN),
    ]


class JobIdBytes(ctypes.Structure):
    """``fr_job_id``: a job's id, 128 bytes."""

    _fields_ = [("bytes", ctypes.c_uint8 * 128)]


class Call(ctypes.Structure):
    """``fr_call``: one call (a collective, a send or a receive) described
    (zeroed: the communicator's options, host memory)."""

    _fields_ = [
        ("collective", ctypes.c_int32),
        ("input", ctypes.c_void_p),
        ("output", ctypes.c_void_p),
        ("count", ctypes.c_uint64),
        ("dtype", ctypes.c_int32),
        ("op", ctypes.c_int32),
        ("root", ctypes.c_uint32),
        ("memory", ctypes.c_int32),
        ("stream", ctypes.c_void_p),
        ("algorithm", ctypes.c_int32),
        ("wire", ctypes.c_int32),
        ("peer", ctypes.c_uint32),
        ("tag", ctypes.c_uint32),
    ]


def _library_path():
    override = os.environ.get("FAIRRING_LIBRARY")
    if override:
        if not os.path.exists(override):
            raise ImportError(f"FAIRRING_LIBRARY={override!r}: no such file")
        return override
    here = os.path.dirname(os.path.abspath(__file__))
    found = sorted(glob.glob(os.path.join(here, "_fairring_ffi*.so")))
    if not found:
        raise ImportError(
            f"fairring's native library is not in {here}: install the package with "
            "`pip install ./python` from the repository, or set FAIRRING_LIBRARY to a "
            "built libfairring_ffi.so"
        )
    return found[0]


_lib = None
_lib_path = None
_lib_lock = threading.Lock()


def lib():
    """The loaded library, with its signatures declared (loaded once)."""
    global _lib, _lib_path
    with _lib_lock:
        if _lib is None:
            path = _library_path()
            _lib = _declare(ctypes.CDLL(path))
            _lib_path = os.path.abspath(path)
        return _lib


def library_path():
    """The file the library was loaded from (the C++ backend drives the same
    copy)."""
    lib()
    return _lib_path


def _declare(l):
    def fn(name, restype, *argtypes):
        f = getattr(l, name)
        f.restype = restype
        f.argtypes = list(argtypes)

    p_comm = ctypes.POINTER(comm_p)
    p_work = ctypes.POINTER(work_p)
    u64, i32, u32 = ctypes.c_uint64, ctypes.c_int32, ctypes.c_uint32
    vp = ctypes.c_void_p
    fn("fr_last_error", ctypes.c_char_p)
    fn("fr_status_name", ctypes.c_char_p, i32)
    fn("fr_comm_with_store", c_status, u32, u32, ctypes.POINTER(Store), u64, p_comm)
    fn("fr_comm_from_env", c_status, p_comm)
    fn("fr_job_id_new", c_status, ctypes.POINTER(JobIdBytes))
    fn("fr_comm_from_id", c_status, ctypes.POINTER(JobIdBytes), u32, u32, u64, p_comm)
    fn("fr_comm_rank", c_status, comm_p, ctypes.POINTER(u32), ctypes.POINTER(u32))
    fn("fr_comm_abort", c_status, comm_p)
    fn("fr_comm_destroy", None, comm_p)
    fn("fr_cuda_built", ctypes.c_bool)
    fn("fr_start", c_status, comm_p, ctypes.POINTER(Call), ctypes.c_size_t, p_work)
    # Exported only by a library built with the `cuda` feature.
    if l.fr_cuda_built():
        fn("fr_work_enqueue_wait", c_status, work_p, vp)
    fn("fr_work_test", c_status, work_p, ctypes.POINTER(ctypes.c_bool))
    fn("fr_work_wait", c_status, work_p)
    fn("fr_work_wait_timeout", c_status, work_p, u64)
    fn("fr_work_free", None, work_p)
    return l


class FairringError(RuntimeError):
    """An error fairring reported: ``status`` is its ``fr_status`` code."""

    def __init__(self, what, status, message):
        self.status = status
        name = lib().fr_status_name(status).decode()
        super().__init__(f"fairring: {what} failed ({name}): {message}")


def cuda_built():
    """Whether the loaded library was built with the `cuda` feature (its
    device calls exist)."""
    return bool(lib().fr_cuda_built())


def last_error():
    """This thread's last error message from the library."""
    return lib().fr_last_error().decode("utf-8", "replace")


def check(status, what):
    """Raises `FairringError` for an error status (read on the calling thread)."""
    if status not in (OK, PENDING):
        raise FairringError(what, status, last_error())
    return status
