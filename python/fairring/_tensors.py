"""The tensors the engine takes: torch's element types and reduce operators
as the C ABI numbers them, the checks a tensor passes, and a contiguous
stand-in for one that is not."""

import ctypes

import torch
import torch.distributed as dist

from . import _native as native

_DTYPES = {
    torch.float32: native.DTYPE_F32,
    torch.float64: native.DTYPE_F64,
    torch.float16: native.DTYPE_F16,
    torch.bfloat16: native.DTYPE_BF16,
    torch.int32: native.DTYPE_I32,
    torch.int64: native.DTYPE_I64,
    torch.uint8: native.DTYPE_U8,
    torch.int8: native.DTYPE_I8,
    torch.int16: native.DTYPE_I16,
    torch.bool: native.DTYPE_BOOL,
}

_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

_RED = dist.ReduceOp.RedOpType
_OPS = {
    _RED.SUM: native.OP_SUM,
    _RED.PRODUCT: native.OP_PRODUCT,
    _RED.MIN: native.OP_MIN,
    _RED.MAX: native.OP_MAX,
    _RED.AVG: native.OP_AVG,
    _RED.BAND: native.OP_BAND,
    _RED.BOR: native.OP_BOR,
    _RED.BXOR: native.OP_BXOR,
    # Scaled by its factor first (`Reduction.scale`), then summed.
    _RED.PREMUL_SUM: native.OP_SUM,
}


class Reduction:
    """A reduce operator as the engine runs it: its FR_OP_* code (`code`),
    and for PREMUL_SUM the factor each rank scales its contribution by
    before the sum (`factor`, a number or a one-element tensor; else None)."""

    def __init__(self, opts, what):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        # `ReduceOp` compares equal to its RedOpType but hashes differently:
        # key on the RedOpType.
        kind = getattr(op, "op", op)
        self.code = _OPS.get(kind)
        if self.code is None:
            raise ValueError(
                f"fairring: {what}: ReduceOp.{getattr(kind, 'name', kind)} is not supported "
                "(supported: SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR, PREMUL_SUM)"
            )
        self.factor = getattr(op, "factor", None) if kind == _RED.PREMUL_SUM else None
        if kind == _RED.PREMUL_SUM and self.factor is None:
            raise ValueError(f"fairring: {what}: ReduceOp.PREMUL_SUM without a factor")
        self.what = what

    def check(self, tensor):
        """The FR_DTYPE_* code of `tensor`, refusing a PREMUL_SUM of a type
        that cannot be scaled exactly as PyTorch scales (integers, bool)."""
        code = _dtype_code(tensor, self.what)
        if self.factor is not None and tensor.dtype not in _FLOATS:
            raise TypeError(
                f"fairring: {self.what}: ReduceOp.PREMUL_SUM is defined on floating-point "
                f"tensors only, not {tensor.dtype}"
            )
        return code

    def scale(self, tensor):
        """Scales this rank's contribution in place (PREMUL_SUM); a no-op
        for every other operator. Called once every check has passed."""
        if self.factor is not None:
            tensor.mul_(self.factor)


def _dtype_code(tensor, what):
    code = _DTYPES.get(tensor.dtype)
    if code is None:
        names = ", ".join(str(d).replace("torch.", "") for d in _DTYPES)
        raise TypeError(
            f"fairring: {what}: {tensor.dtype} tensors are not supported "
            f"(supported: {names})"
        )
    return code


def _host(tensor, what):
    """Checks that fairring can take `tensor`: a dense CPU tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"fairring: {what}: expected a tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise TypeError(f"fairring: {what}: {tensor.layout} tensors are not supported")
    if tensor.device.type == "cuda":
        raise RuntimeError(
            f"fairring: {what} on a CUDA tensor: the engine has no device form of it "
            "(it runs allreduce, broadcast, allgather, reduce_scatter, reduce, gather "
            "and scatter on CUDA tensors); pass CPU tensors"
        )
    if tensor.device.type != "cpu":
        raise RuntimeError(
            f"fairring: {what} on a {tensor.device.type} tensor: fairring takes CPU and "
            "CUDA tensors"
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


def unpack(flat, parts):
    """Copies `flat`'s consecutive blocks into `parts`, in order, each block
    as many elements as its part (an all-gather's or gather's output list,
    an all-to-all's outputs)."""
    at = 0
    for p in parts:
        p.copy_(flat[at : at + p.numel()].view(p.shape))
        at += p.numel()
