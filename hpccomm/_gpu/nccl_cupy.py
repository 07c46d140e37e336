"""Transport: NCCL through CuPy's bindings (``cupy.cuda.nccl``), for a torch
built without NCCL.

As in cupyx.distributed: rank 0 of the group makes the NCCL unique id, which
is broadcast over the group's MPI communicator; each hpccomm group gets its
own NCCL communicator.  Ops are enqueued on the caller's current CUDA stream
and return at once (NCCL's own semantics: later work on that stream is
ordered after them).

Covered: the ops whose declaration has a CuPy form (hpccomm._ops.op.Op
``cupy``: all_reduce, broadcast, reduce, all_gather_into_tensor,
reduce_scatter_tensor, send, recv), on contiguous tensors.  Other ops are
refused with a message naming the transports that have them.
"""
from __future__ import annotations

import logging

import torch

from .._compat import RedOpType, reduce_op_type
from ..errors import OpTypeError, OpValueError
from .nccl_wire import Ability

log = logging.getLogger("hpccomm")

_DTYPES = {torch.float32: "NCCL_FLOAT32", torch.float64: "NCCL_FLOAT64", torch.float16: "NCCL_FLOAT16",
           torch.bfloat16: "NCCL_BFLOAT16", torch.int8: "NCCL_INT8", torch.uint8: "NCCL_UINT8",
           torch.int32: "NCCL_INT32", torch.uint32: "NCCL_UINT32", torch.int64: "NCCL_INT64",
           torch.uint64: "NCCL_UINT64"}
_OPS = {RedOpType.SUM: "NCCL_SUM", RedOpType.PRODUCT: "NCCL_PROD", RedOpType.MIN: "NCCL_MIN",
        RedOpType.MAX: "NCCL_MAX", RedOpType.AVG: "NCCL_AVG"}
#: What CuPy's NCCL takes (the ops whose declaration has a ``cupy`` form: all_reduce, broadcast, reduce,
#: all_gather_into_tensor, reduce_scatter_tensor, send, recv); hpccomm._gpu.nccl_wire rewrites the rest, and
#: the calls it has no form for go to the group's fallback route (CUDA-aware MPI, else staged).
ABILITY = Ability(dtypes=frozenset(_DTYPES), redops=frozenset(_OPS),
                  avg=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
                  premul=frozenset(), declared="cupy")


def _import_nccl():
    from cupy.cuda import nccl  # the 'cuda' extra

    return nccl


class CupyNCCL:
    """NCCL communicators made with CuPy; see the module's docstring.

    ``nccl`` (the ``cupy.cuda.nccl`` module), ``bcast(group, obj)`` (the MPI
    broadcast of the unique id) and ``stream(device)`` (the current stream's
    handle) are injectable for tests.
    """

    name = "nccl-cupy"
    delegates = True  # takes the whole op, after hpccomm's checks, rewritten (hpccomm._gpu.nccl_wire)
    ability = ABILITY

    def __init__(self, device, reason: str, nccl=None, bcast=None, stream=None) -> None:
        self.device = device
        self.reason = reason
        self.nccl = nccl if nccl is not None else _import_nccl()
        self._bcast = bcast if bcast is not None else _mpi_bcast
        self._stream = stream if stream is not None else (lambda d: torch.cuda.current_stream(d).cuda_stream)
        self.comm = None

    def _comm(self, group):
        if self.comm is None:
            uid = self.nccl.get_unique_id() if group.rank == 0 else None
            uid = self._bcast(group, uid)
            self.comm = self.nccl.NcclCommunicator(group.size, uid, group.rank)
            log.info("hpccomm: group '%s': CuPy NCCL communicator made (unique id broadcast over MPI)", group.name)
        return self.comm

    def _dtype(self, group, op: str, *tensors):
        """NCCL's type of the call's tensors (the first one's dtype; each must be contiguous)."""
        t = tensors[0]
        name = _DTYPES.get(t.dtype)
        value = getattr(self.nccl, name, None) if name else None
        if value is None:
            raise OpTypeError(op, group.where(), f"CuPy's NCCL has no type for {t.dtype}",
                              "Set HPCCOMM_GPU_TRANSPORT=staged or mpi for this dtype")
        if not all(x.is_contiguous() for x in tensors):
            raise OpValueError(op, group.where(), "CuPy's NCCL transport needs contiguous tensors",
                               "Call .contiguous() first")
        return value

    def _op(self, group, op: str, redop):
        kind = reduce_op_type(redop)
        name = _OPS.get(kind)
        value = getattr(self.nccl, name, None) if name else None
        if value is None:
            raise OpTypeError(op, group.where(), f"CuPy's NCCL has no {str(kind).split('.')[-1]} reduction",
                              "Set HPCCOMM_GPU_TRANSPORT=staged or mpi for it")
        return value

    def delegate(self, group, op, args, opts):
        """Enqueue ``op`` (a declaration, hpccomm._ops.op.Op) on the current
        stream through its CuPy form; returns the outputs."""
        if op.cupy is None:
            raise OpValueError(op.name, group.where(), f"{op.name} is not available through CuPy's NCCL (its "
                               "declaration has no CuPy form)", "Install a torch built with NCCL, or set "
                               "HPCCOMM_GPU_TRANSPORT=mpi (CUDA-aware MPI) or staged")
        if op.p2p and args[1] is None:
            raise OpValueError(op.name, group.where(), "NCCL cannot receive from any source", "Name the source rank")
        if op.p2p and self.comm is None:
            raise OpValueError(op.name, group.where(), "CuPy's NCCL communicator is made by all members of the group "
                               "together, which a send or receive cannot do",
                               "Run one collective with CUDA tensors on this group first (dist.barrier does not "
                               "count: use dist.all_reduce on a small CUDA tensor)")
        op.cupy(_Call(self, group, op.name), *args)
        return args[0] if isinstance(args[0], (list, tuple)) else [args[0]]

    def plan(self, op, group, call, args):
        raise AssertionError("CupyNCCL delegates: it runs no hpccomm plan")


class _Call:
    """What an op's CuPy form (hpccomm._ops.op.Op ``cupy``) calls NCCL with:
    the group's communicator (made at its first collective), the current
    stream, and NCCL's type and ReduceOp of the call's tensors (a refusal names
    the op)."""

    def __init__(self, transport: CupyNCCL, group, op: str) -> None:
        self._t, self._group, self._op = transport, group, op
        self.stream = transport._stream(transport.device)

    @property
    def comm(self):
        return self._t._comm(self._group)

    def dtype(self, *tensors):
        return self._t._dtype(self._group, self._op, *tensors)

    def op(self, redop):
        return self._t._op(self._group, self._op, redop)


def _mpi_bcast(group, obj):
    from .._core import comm_thread

    if not comm_thread.on_it():
        comm_thread.flush(group)  # the comm thread must not be in MPI on this communicator meanwhile
    return group.comm.bcast(obj, root=0)
