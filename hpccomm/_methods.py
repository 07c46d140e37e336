"""torch's op methods, mapped onto hpccomm's op path: shared by both adapters.

torch calls a backend by method names (``allreduce``, ``all_gather_single``,
...) with option objects.  :class:`TorchOps` has one method per torch method an op declares
(hpccomm._ops.op.Op ``methods``), made from the form of its arguments
(:data:`FORMS`): it unpacks torch's options and calls
:func:`hpccomm._ops.op_path.run` with the op's declaration.
The two adapters that torch sees are thin classes over it:

- ``hpccomm.process_group.ProcessGroupHpccomm``: a ``ProcessGroup`` subclass
  (torch 2.13, which has no Python ``Backend``);
- ``hpccomm.backend.BackendHpccomm``: a ``Backend`` subclass (torch >= 2.14,
  dispatched by torch's C++ ``PyBackend`` trampoline).

Which one torch gets is decided once, by feature test
(:func:`hpccomm._compat.py_backend`).  Every subclass holds its group's MPI
side in ``self._g`` (a :class:`hpccomm._core.group.Group`).
"""
from __future__ import annotations

import types

from . import _mpi
from ._core import comm_thread, failures, trace
from ._gpu import dispatch
from ._ops import op_path, registry
from . import _compat as compat
from . import BACKEND_NAME
from ._compat import ReduceOp

_SUM = ReduceOp.SUM
_run = op_path.run


def _reduce_op(opts):
    """The ReduceOp in torch's options (SUM without them; torch's C++ layer may pass a ReduceOp in their place)."""
    return _SUM if opts is None else getattr(opts, "reduceOp", opts)

#: How torch's arguments to a method become an op's (an op's declaration names
#: its methods' form): each form makes the method for an op.  torch passes the
#: tensors positionally, then an options object (``opts``) whose ``reduceOp``
#: and ``rootRank`` join the op's arguments; point-to-point methods take the
#: peer and tag themselves.  One closure per method, made at import: a call
#: costs what a hand-written method would.
FORMS = {
    "tensors, reduceOp": lambda op: lambda self, tensors, opts=None: _run(
        self._g, op, (tensors, _reduce_op(opts)), opts),
    "tensors, rootRank, reduceOp": lambda op: lambda self, tensors, opts: _run(
        self._g, op, (tensors, opts.rootRank, opts.reduceOp), opts),
    "tensors, rootRank": lambda op: lambda self, tensors, opts: _run(
        self._g, op, (tensors, opts.rootRank), opts),
    "output, input": lambda op: lambda self, output, input, opts=None: _run(
        self._g, op, (output, input), opts),
    "output, input, reduceOp": lambda op: lambda self, output, input, opts=None: _run(
        self._g, op, (output, input, _reduce_op(opts)), opts),
    "output, input, rootRank": lambda op: lambda self, output, input, opts: _run(
        self._g, op, (output, input, opts.rootRank), opts),
    "output, input, output_splits, input_splits": lambda op: lambda self, output, input, output_splits, \
        input_splits, opts=None: _run(self._g, op, (output, input, output_splits, input_splits), opts),
    "": lambda op: lambda self, opts=None: _run(self._g, op, (), opts),
    "tensors, peer, tag": lambda op: lambda self, tensors, peer, tag=0: _run(self._g, op, (tensors, peer, tag)),
    "tensors, tag": lambda op: lambda self, tensors, tag=0: _run(self._g, op, (tensors, None, tag)),
}


def methods(legacy: bool = False) -> dict:
    """torch's method name -> the method, for every op of hpccomm._ops.registry
    (``legacy``: torch's older names too, which torch 2.13's ProcessGroup route calls)."""
    made = {}
    for op in registry.OPS:
        for name, form in op.methods.items():
            made[name] = method = FORMS[form](op)
            method.__name__ = method.__qualname__ = name
            method.__doc__ = f"torch's ``{name}``: hpccomm's {op.name} (hpccomm._ops.{op.plan.__module__.rsplit('.', 1)[-1]})."
            if legacy:
                for old in op.legacy:
                    made[old] = method
    return made


class TorchOps:
    """torch's collective and point-to-point methods (see the module docstring),
    made from the ops' declarations (:func:`methods`)."""

    _g = None  # the hpccomm.Group (set by the adapter's constructor)

    @property
    def mpi_comm(self):
        """The group's mpi4py communicator its collectives run on (owned by hpccomm: do not free it)."""
        return self._g.comm

    def getBackendName(self) -> str:
        return BACKEND_NAME

    # -- lifetime -------------------------------------------------------------
    def abort(self) -> None:
        """Abort every rank of the job: MPI state cannot be recovered.  In
        fault-tolerance mode, revoke and free this group's communicators on
        this rank only (``dist.shrink_group`` aborts the groups it drops)."""
        if not failures.abort_group(self._g):
            _mpi.abort(1)

    def shutdown(self) -> None:
        """Free this group's MPI communicators and transports (torch's destroy_process_group calls it)."""
        g = self._g
        if g.comm is not None and g.is_world:
            comm_thread.flush(g)
            trace.finish(g.comm)  # every rank destroys the world: gather the trace now
        dispatch.release(g)
        g.free()


def hide_methods(cls) -> None:
    """Keep the methods torch's C++ layer calls on ``cls`` (the public ones
    and torch's legacy aliases) out of ``torch.compile``."""
    compat.hide_from_compiler(cls, [
        name for name, value in vars(cls).items()
        if isinstance(value, types.FunctionType) and (not name.startswith("_") or name.endswith("_base"))])


for _name, _method in methods().items():
    setattr(TorchOps, _name, _method)
hide_methods(TorchOps)
