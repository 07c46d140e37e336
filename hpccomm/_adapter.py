"""torch's op methods, mapped onto hpccomm's op path: shared by both adapters.

torch calls a backend by method names (``allreduce``, ``all_gather_single``,
...) with option objects.  :class:`TorchOps` unpacks the options and calls
:func:`hpccomm._runner.run` with the op's entry in :mod:`hpccomm.ops.table`.
The two adapters that torch sees are thin classes over it:

- ``hpccomm.process_group.ProcessGroupHpccomm``: a ``ProcessGroup`` subclass
  (torch 2.13, which has no Python ``Backend``);
- ``hpccomm.backend.BackendHpccomm``: a ``Backend`` subclass (torch >= 2.14,
  dispatched by torch's C++ ``PyBackend`` trampoline).

Which one torch gets is decided once, by feature test
(:data:`hpccomm._compat.PY_BACKEND`).  Every subclass holds its group's MPI
side in ``self._g`` (a :class:`hpccomm._group.Group`).
"""
from __future__ import annotations

import types

from . import _compat, _runner
from ._compat import ReduceOp
from .ops import table as _ops

#: The backend name registered with torch:
#: ``dist.init_process_group(hpccomm.BACKEND_NAME)`` is ``dist.init_process_group("hpccomm")``.
BACKEND_NAME = "hpccomm"

_SUM = ReduceOp.SUM


def _redop(opts):
    return _SUM if opts is None else getattr(opts, "reduceOp", opts)


class TorchOps:
    """torch's collective and point-to-point methods (see the module docstring)."""

    _g = None  # the hpccomm.Group (set by the adapter's constructor)

    @property
    def mpi_comm(self):
        """The group's mpi4py communicator its collectives run on (owned by hpccomm: do not free it)."""
        return self._g.comm

    def getBackendName(self) -> str:
        return BACKEND_NAME

    # -- collectives ----------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        if not isinstance(tensors, (list, tuple)):
            tensors = [tensors]
        # (a sparse tensor, DDP's sparse gradients on torch 2.13, is taken by all_reduce's plan too)
        return _runner.run(self._g, _ops.ALL_REDUCE, (tensors, _redop(opts)), opts)

    def allreduce_sparse(self, tensors, opts=None):
        return _runner.run(self._g, _ops.ALL_REDUCE_SPARSE, (tensors, _redop(opts)), opts)

    def allreduce_coalesced(self, tensors, opts=None):
        return _runner.run(self._g, _ops.ALL_REDUCE_COALESCED, (tensors, _redop(opts)), opts)

    def reduce(self, tensors, opts):
        return _runner.run(self._g, _ops.REDUCE, (tensors, opts.rootRank, opts.reduceOp), opts)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        return _runner.run(self._g, _ops.REDUCE_SCATTER, (outputs, input_lists, _redop(opts)), opts)

    def reduce_scatter_single(self, output, input, opts=None):
        return _runner.run(self._g, _ops.REDUCE_SCATTER_TENSOR, (output, input, _redop(opts)), opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return _runner.run(self._g, _ops.REDUCE_SCATTER_TENSOR_COALESCED, (outputs, inputs, _redop(opts)), opts)

    def broadcast(self, tensors, opts):
        return _runner.run(self._g, _ops.BROADCAST, (tensors, opts.rootRank), opts)

    def scatter(self, outputs, input_lists, opts):
        return _runner.run(self._g, _ops.SCATTER, (outputs, input_lists, opts.rootRank), opts)

    def allgather(self, output_lists, inputs, opts=None):
        return _runner.run(self._g, _ops.ALL_GATHER, (output_lists, inputs), opts)

    def all_gather_single(self, output, input, opts=None):
        return _runner.run(self._g, _ops.ALL_GATHER_INTO_TENSOR, (output, input), opts)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return _runner.run(self._g, _ops.ALL_GATHER_COALESCED, (output_lists, inputs), opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return _runner.run(self._g, _ops.ALL_GATHER_INTO_TENSOR_COALESCED, (outputs, inputs), opts)

    def gather(self, output_lists, inputs, opts):
        return _runner.run(self._g, _ops.GATHER, (output_lists, inputs, opts.rootRank), opts)

    def gather_single(self, output, input, opts):
        return _runner.run(self._g, _ops.GATHER_SINGLE, (output, input, opts.rootRank), opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return _runner.run(self._g, _ops.ALL_TO_ALL_SINGLE, (output, input, output_split_sizes, input_split_sizes), opts)

    def alltoall(self, outputs, inputs, opts=None):
        return _runner.run(self._g, _ops.ALL_TO_ALL, (outputs, inputs), opts)

    def barrier(self, opts=None):
        return _runner.run(self._g, _ops.BARRIER, (), opts)

    # -- point-to-point -------------------------------------------------------
    def send(self, tensors, dst: int, tag: int = 0):
        return _runner.run(self._g, _ops.SEND, (tensors, dst, tag))

    def recv(self, tensors, src: int, tag: int = 0):
        return _runner.run(self._g, _ops.RECV, (tensors, src, tag))

    def recv_anysource(self, tensors, tag: int = 0):
        return _runner.run(self._g, _ops.RECV, (tensors, None, tag))


def shutdown(g) -> None:
    """Free group ``g``'s communicators and transports (torch's destroy_process_group)."""
    from . import _engine, _trace
    from .gpu import dispatch as _gpu

    if g.comm is not None and g.is_world:
        _engine.engine.flush(g)
        _trace.finish(g.comm)  # every rank destroys the world: gather the trace now
    _gpu.release(g)
    g.free()


def hide_methods(cls) -> None:
    """Keep the methods torch's C++ layer calls on ``cls`` (the public ones
    and torch's legacy aliases) out of ``torch.compile``."""
    _compat.hide_from_compiler(cls, [
        name for name, value in vars(cls).items()
        if isinstance(value, types.FunctionType) and (not name.startswith("_") or name.endswith("_base"))])


hide_methods(TorchOps)
