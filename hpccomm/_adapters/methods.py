"""torch's op methods, mapped onto hpccomm's op path: shared by both adapters.

torch calls a backend by method names (``allreduce``, ``all_gather_single``,
...) with option objects.  :class:`TorchOps` has one method per torch method an
op declares (hpccomm._ops.op.Op ``methods``): it unpacks torch's options and
calls :func:`hpccomm._ops.op_path.run` with the op's declaration.
The two adapters that torch sees are thin classes over it:

- ``hpccomm._adapters.process_group.ProcessGroupHpccomm``: a ``ProcessGroup`` subclass
  (torch 2.13, which has no Python ``Backend``);
- ``hpccomm._adapters.backend.BackendHpccomm``: a ``Backend`` subclass (torch >= 2.14,
  dispatched by torch's C++ ``PyBackend`` trampoline).

Which one torch gets is decided once, by feature test
(:func:`hpccomm._compat.py_backend`).  Every subclass holds its group's MPI
side in ``self._g`` (a :class:`hpccomm._core.group.Group`).
"""
from __future__ import annotations

import types

from .. import _compat as compat
from .._about import BACKEND_NAME
from .._compat import ReduceOp
from .._core import comm_thread, failures, state, trace
from .._gpu import group_routes
from .._ops import alltoall, gather, op_path, p2p, reduce, registry, scatter

_SUM = ReduceOp.SUM


def _reduce_op(opts):
    """The ReduceOp in torch's options (SUM without them; torch's C++ layer may pass a ReduceOp in their place)."""
    return _SUM if opts is None else getattr(opts, "reduceOp", opts)

class TorchOps:
    """torch's collective and point-to-point methods (see the module docstring):
    each runs the op that declares it among its ``methods``
    (hpccomm._ops.op.Op; tests/test_declarations.py holds the two together)."""

    _g = None  # the hpccomm.Group (set by the adapter's constructor)

    @property
    def mpi_comm(self):
        """The group's mpi4py communicator its collectives run on (owned by hpccomm: do not free it)."""
        return self._g.comm

    def getBackendName(self) -> str:
        return BACKEND_NAME

    # -- collectives ----------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        return op_path.run(self._g, reduce.ALL_REDUCE, (tensors, _reduce_op(opts)), opts)

    def allreduce_sparse(self, tensors, opts=None):
        return op_path.run(self._g, reduce.ALL_REDUCE_SPARSE, (tensors, _reduce_op(opts)), opts)

    def allreduce_coalesced(self, tensors, opts=None):
        return op_path.run(self._g, reduce.ALL_REDUCE_COALESCED, (tensors, _reduce_op(opts)), opts)

    def reduce(self, tensors, opts):
        return op_path.run(self._g, reduce.REDUCE, (tensors, opts.rootRank, opts.reduceOp), opts)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        return op_path.run(self._g, reduce.REDUCE_SCATTER, (outputs, input_lists, _reduce_op(opts)), opts)

    def reduce_scatter_single(self, output, input, opts=None):
        return op_path.run(self._g, reduce.REDUCE_SCATTER_TENSOR, (output, input, _reduce_op(opts)), opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        return op_path.run(self._g, reduce.REDUCE_SCATTER_TENSOR_COALESCED, (outputs, inputs, _reduce_op(opts)), opts)

    def broadcast(self, tensors, opts):
        return op_path.run(self._g, scatter.BROADCAST, (tensors, opts.rootRank), opts)

    def scatter(self, outputs, input_lists, opts):
        return op_path.run(self._g, scatter.SCATTER, (outputs, input_lists, opts.rootRank), opts)

    def allgather(self, output_lists, inputs, opts=None):
        return op_path.run(self._g, gather.ALL_GATHER, (output_lists, inputs), opts)

    def all_gather_single(self, output, input, opts=None):
        return op_path.run(self._g, gather.ALL_GATHER_INTO_TENSOR, (output, input), opts)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return op_path.run(self._g, gather.ALL_GATHER_COALESCED, (output_lists, inputs), opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return op_path.run(self._g, gather.ALL_GATHER_INTO_TENSOR_COALESCED, (outputs, inputs), opts)

    def gather(self, output_lists, inputs, opts):
        return op_path.run(self._g, gather.GATHER, (output_lists, inputs, opts.rootRank), opts)

    def gather_single(self, output, input, opts):
        return op_path.run(self._g, gather.GATHER_SINGLE, (output, input, opts.rootRank), opts)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return op_path.run(self._g, alltoall.ALL_TO_ALL_SINGLE, (output, input, output_split_sizes, input_split_sizes),
                    opts)

    def alltoall(self, outputs, inputs, opts=None):
        return op_path.run(self._g, alltoall.ALL_TO_ALL, (outputs, inputs), opts)

    def barrier(self, opts=None):
        return op_path.run(self._g, p2p.BARRIER, (), opts)

    # -- point-to-point -------------------------------------------------------
    def send(self, tensors, dst: int, tag: int = 0):
        return op_path.run(self._g, p2p.SEND, (tensors, dst, tag))

    def recv(self, tensors, src: int, tag: int = 0):
        return op_path.run(self._g, p2p.RECV, (tensors, src, tag))

    def recv_anysource(self, tensors, tag: int = 0):
        return op_path.run(self._g, p2p.RECV, (tensors, None, tag))

    # -- lifetime -------------------------------------------------------------
    def abort(self) -> None:
        """Abort every rank of the job: MPI state cannot be recovered.  In
        fault-tolerance mode, revoke and free this group's communicators on
        this rank only (``dist.shrink_group`` aborts the groups it drops)."""
        failures.group_aborted(self._g)

    def shutdown(self) -> None:
        """Free this group's MPI communicators and transports (torch's destroy_process_group calls it)."""
        g = self._g
        if g.comm is not None and g.is_world:
            comm_thread.flush(g)
            trace.finish(g.comm)  # every rank destroys the world: gather the trace now
            state.record_leaving(f"destroyed its process group ({state.last_op_text()})")
        group_routes.release(g)
        g.free()


def _legacy() -> dict:
    """torch's older method names -> the method each stands for (the ops' declared ``legacy`` names)."""
    return {old: op.methods[0] for op in registry.OPS for old in op.legacy}


def add_legacy(cls) -> None:
    """Give ``cls`` torch's older names of its methods (each op's declared
    ``legacy`` names: ``_allgather_base`` is ``all_gather_single``), which
    only the ProcessGroup route (torch 2.13) is called by."""
    for old, name in _legacy().items():
        setattr(cls, old, getattr(TorchOps, name))


def hide_methods(cls) -> None:
    """Keep the methods torch's C++ layer calls on ``cls`` (the public ones
    and the ops' declared legacy names) out of ``torch.compile``."""
    legacy = _legacy()
    compat.hide_from_compiler(cls, [
        name for name, value in vars(cls).items()
        if isinstance(value, types.FunctionType) and (not name.startswith("_") or name in legacy)])


hide_methods(TorchOps)
