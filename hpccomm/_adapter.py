"""torch's op methods, mapped onto hpccomm's op path: shared by both adapters.

torch calls a backend by method names (``allreduce``, ``all_gather_single``,
...) with option objects.  :class:`TorchOps` unpacks the options and calls
:func:`hpccomm._runner.run` with the op module that translates the op, or,
for the ops with a plain case (all_reduce, broadcast, all_gather_into_tensor,
reduce_scatter_tensor, send, recv), ``hpccomm._runner.run_*``, which takes
the common case itself and hands anything else to ``run``.  The
two adapters that torch sees are thin classes over it:

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
from .ops import alltoall as _a2a
from .ops import gather as _gather
from .ops import p2p as _p2p
from .ops import reduce as _reduce
from .ops import scatter as _scatter

#: The backend name registered with torch:
#: ``dist.init_process_group(hpccomm.BACKEND_NAME)`` is ``dist.init_process_group("hpccomm")``.
BACKEND_NAME = "hpccomm"


_SUM = ReduceOp.SUM


def _redop(opts):
    return _SUM if opts is None else getattr(opts, "reduceOp", opts)


def _barrier(g):
    return lambda: _p2p.barrier(g)


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
        # (a sparse tensor, DDP's sparse gradients on torch 2.13, goes to allreduce_sparse)
        return _runner.run_allreduce(self._g, tensors, _SUM if opts is None else getattr(opts, "reduceOp", opts),
                                     opts)

    def allreduce_sparse(self, tensors, opts=None):
        return _runner.run(self._g, "all_reduce", _reduce.allreduce_sparse, (tensors, _redop(opts)), opts)

    def allreduce_coalesced(self, tensors, opts=None):
        return _runner.run(self._g, "all_reduce_coalesced", _reduce.allreduce_coalesced, (tensors, _redop(opts)),
                           opts)

    def reduce(self, tensors, opts):
        return _runner.run(self._g, "reduce", _reduce.reduce, (tensors, opts.rootRank, opts.reduceOp), opts)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        return _runner.run(self._g, "reduce_scatter", _reduce.reduce_scatter, (outputs, input_lists, _redop(opts)),
                           opts)

    def reduce_scatter_single(self, output, input, opts=None):
        return _runner.run_reduce_scatter_single(self._g, output, input, _redop(opts), opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return _runner.run(self._g, "reduce_scatter_tensor_coalesced", _reduce.reduce_scatter_single_coalesced,
                           (outputs, inputs, _redop(opts)), opts)

    def broadcast(self, tensors, opts):
        return _runner.run_broadcast(self._g, tensors, opts.rootRank, opts)

    def scatter(self, outputs, input_lists, opts):
        return _runner.run(self._g, "scatter", _scatter.scatter, (outputs, input_lists, opts.rootRank), opts)

    def allgather(self, output_lists, inputs, opts=None):
        return _runner.run(self._g, "all_gather", _gather.allgather, (output_lists, inputs), opts)

    def all_gather_single(self, output, input, opts=None):
        return _runner.run_all_gather_single(self._g, output, input, opts)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return _runner.run(self._g, "all_gather_coalesced", _gather.allgather_coalesced, (output_lists, inputs),
                           opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return _runner.run(self._g, "all_gather_into_tensor_coalesced", _gather.all_gather_single_coalesced,
                           (outputs, inputs), opts)

    def gather(self, output_lists, inputs, opts):
        return _runner.run(self._g, "gather", _gather.gather, (output_lists, inputs, opts.rootRank), opts)

    def gather_single(self, output, input, opts):
        return _runner.run(self._g, "gather_single", _gather.gather_single, (output, input, opts.rootRank), opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return _runner.run(self._g, "all_to_all_single", _a2a.all_to_all_single,
                           (output, input, output_split_sizes, input_split_sizes), opts)

    def alltoall(self, outputs, inputs, opts=None):
        return _runner.run(self._g, "all_to_all", _a2a.alltoall, (outputs, inputs), opts)

    def barrier(self, opts=None):
        return _runner.run(self._g, "barrier", _barrier, (), opts)

    # -- point-to-point -------------------------------------------------------
    def send(self, tensors, dst: int, tag: int = 0):
        return _runner.run_send(self._g, tensors, dst, tag)

    def recv(self, tensors, src: int, tag: int = 0):
        return _runner.run_recv(self._g, tensors, src, tag)

    def recv_anysource(self, tensors, tag: int = 0):
        return _runner.run(self._g, "recv", _p2p.recv, (tensors, None, tag))


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
