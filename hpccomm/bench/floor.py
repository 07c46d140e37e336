"""The ``floor`` comparison: what torch.distributed itself costs a Python backend.

A process group with the least per-call work torch accepts: each method makes
one MPI call on the tensors' memory and returns a finished Work, with no
argument checks, watchdog, trace, sequence numbers or GPU dispatch.  Timing
``dist.all_reduce`` etc. on it measures torch's own Python wrapper, C++
dispatch and Work/future handling around the same MPI call that the raw mpi4py
baseline makes.  No Python backend can do better through torch.distributed, so
``hpccomm / floor`` is the share of the gap that is hpccomm's, and
``floor / raw mpi4py`` the share that is torch's API.

Benchmark-only: it assumes what a real backend must check (contiguous CPU
tensors of a native MPI type, matching sizes on every rank) and supports only
the ops of issue 7's bandwidth targets, blocking.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

NAME = "hpccomm_bench_floor"
OPS = ("all_reduce", "all_gather", "reduce_scatter")

_TYPES = {torch.float32: "FLOAT", torch.float64: "DOUBLE", torch.int32: "INT32_T", torch.int64: "INT64_T",
          torch.int8: "INT8_T", torch.uint8: "UINT8_T"}


class _Done(dist.Work):
    """A Work born finished; its future's value is the outputs (DDP-style callers read it)."""

    def __init__(self, outputs) -> None:
        super().__init__()
        self._outputs = outputs

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut = torch.futures.Future()
        fut.set_result(self._outputs)
        return fut


class FloorGroup(dist.ProcessGroup):
    """One MPI call per op on a private duplicate of COMM_WORLD."""

    def __init__(self, comm) -> None:
        super().__init__(comm.Get_rank(), comm.Get_size())
        from mpi4py import MPI

        self.comm = comm
        self._in_place = MPI.IN_PLACE
        self._fromaddress = MPI.buffer.fromaddress
        self._types = {d: getattr(MPI, n) for d, n in _TYPES.items()}
        R = dist.ReduceOp
        self._ops = {R.SUM: MPI.SUM, R.PRODUCT: MPI.PROD, R.MIN: MPI.MIN, R.MAX: MPI.MAX}  # by RedOpType
        self._sum = MPI.SUM
        self._name = NAME

    def _buf(self, t: torch.Tensor, count=None):
        """``[memory, count, type]``; mpi4py counts all-gather receives and
        reduce-scatter sends per rank (``count``)."""
        n = t.numel()
        return [self._fromaddress(t.data_ptr(), n * t.element_size()), n if count is None else count,
                self._types[t.dtype]]

    def allreduce(self, tensors, opts=None):
        op = self._ops[opts.reduceOp.op] if opts is not None else self._sum
        self.comm.Allreduce(self._in_place, self._buf(tensors[0]), op=op)
        return _Done(tensors)

    def all_gather_single(self, output, input, opts=None):
        if input.data_ptr() == output.data_ptr() + self.rank() * input.numel() * input.element_size():
            self.comm.Allgather(self._in_place, self._buf(output, input.numel()))
        else:
            self.comm.Allgather(self._buf(input), self._buf(output, input.numel()))
        return _Done([output])

    def reduce_scatter_single(self, output, input, opts=None):
        op = self._ops[opts.reduceOp.op] if opts is not None else self._sum
        self.comm.Reduce_scatter_block(self._buf(input, output.numel()), self._buf(output), op=op)
        return _Done([output])

    def getBackendName(self) -> str:
        return NAME

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name


def supported(name: str, placement: str, asynchronous: bool, dtype: torch.dtype, redop: str):
    """None if the floor can run this case, else why not (decided from the
    arguments alone: the same on every rank)."""
    if name not in OPS:
        return f"floor: only {', '.join(OPS)} (the ops of the bandwidth targets)"
    if asynchronous:
        return "floor: blocking calls only"
    if dtype not in _TYPES:
        return f"floor: no native MPI type for {dtype} here"
    if redop == "avg":
        return "floor: MPI has no AVG"
    if name == "reduce_scatter" and placement != "out-of-place":
        return "floor: out-of-place reduce_scatter only (MPI's in-place layout differs from torch's)"
    return None


def _create(opts, backend_options=None):
    from mpi4py import MPI

    ranks = list(opts.global_ranks_in_group)
    if ranks and ranks != list(range(MPI.COMM_WORLD.Get_size())):
        raise ValueError("the bench's floor group spans every rank of the job")
    return FloorGroup(MPI.COMM_WORLD.Dup())


def new_group():
    """A world-wide floor group (collective: every rank calls it)."""
    from .._compat import register_backend

    register_backend(NAME, _create, devices=["cpu"])  # once per process
    return dist.new_group(backend=NAME)
