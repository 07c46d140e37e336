"""The Work of a call an NCCL transport takes.

hpccomm._gpu.dispatch finds that a call's route is NCCL's and the form NCCL
takes it in (hpccomm._gpu.nccl_wire: the same call, or one rewritten into
dtypes and ops NCCL has, with steps before and after); :func:`delegated`
hands it over and gives the op path its Work.  A call taken as it is returns
NCCL's own Work; a rewritten one completes on the current stream, its future
holding the user's tensors.
"""
from __future__ import annotations

from .. import _compat as compat
from .._core import work
from .detect import future_devices


def delegated(made, group, op, wire, opts):
    """The Work of a call of ``op`` on ``group`` that NCCL transport ``made``
    takes, ``wire`` its form for NCCL, ``opts`` torch's options.

    A call taken as it is returns NCCL's own Work.  A rewritten one runs its
    copies in on the current stream, hands NCCL the wire tensors, makes the
    current stream wait for NCCL's Work (a stream wait, not a host block) and
    runs the steps after it there; its Work is complete from the host's view
    (as NCCL's own), its future holds the user's tensors."""
    for before in wire.before:
        before()
    out = made.delegate(group, op, wire.args, opts)
    if wire.direct and isinstance(out, compat.WorkBase):
        return out
    if isinstance(out, compat.WorkBase):
        out.wait()  # the current stream waits for NCCL: the steps after it see its result
    for after in wire.after:
        after()
    return work.finished(wire.outputs, future_devices(made.device))
