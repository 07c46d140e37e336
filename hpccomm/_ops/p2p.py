"""Point-to-point: send, recv (from a rank or any source), and barrier.

Each function here is one op's plan function (see :mod:`hpccomm._core.plan`).
Sends and receives have no blocking form: hpccomm._ops.op_path posts them
(MPI_Isend/MPI_Irecv on the group's private point-to-point communicator, so
they never match hpccomm's own internal messages) and returns a pending
Work; the op's record (hpccomm._core.record) checks what a receive got when
it completes.

A tensor always travels as ONE MPI message.  Past the per-call count limit
(``group.max_count``) it is described by a derived datatype whose count fits,
instead of being split into several messages: pieces of one tensor sent as
separate messages could be taken by another receive posted meanwhile (an
any-source receive, or any receive from the same rank and tag), mixing two
tensors' data.  As a single message, MPI's matching and non-overtaking rules
hold for tensors of any size.

A peer may be this rank itself (``isend``/``irecv`` to self, as torch allows);
torch itself refuses a blocking ``send`` to self.
"""
from __future__ import annotations

from functools import partial

import torch

from .. import _mpi
from . import checks, staging


def _cover(base, n: int, limit: int, extent: int, made: list):
    """``(datatype, count)`` describing ``n`` consecutive ``base`` elements
    (``extent`` bytes each) with ``count <= limit``; new types go in ``made``."""
    if n <= limit:
        return base, n
    q, r = divmod(n, limit)
    block = base.Create_contiguous(limit)
    made.append(block)
    inner, count = _cover(block, q, limit, extent * limit, made)
    if r == 0:
        return inner, count
    whole = _mpi.mpi().Datatype.Create_struct([count, r], [0, q * limit * extent], [inner, base])
    made.append(whole)
    return whole, 1


def _post_large(start, t: torch.Tensor, limit: int, *rest):
    """Post ``start(message, *rest)`` for all of contiguous ``t`` (more than
    ``limit`` elements) as one message, described by a derived datatype."""
    n = t.numel()
    made: list = []
    try:
        datatype, count = _cover(_mpi.mpi_type(t.dtype), n, limit, t.element_size(), made)
        datatype.Commit()
        return start([_mpi.buffer(t)[0], count, datatype], *rest)
    finally:
        for d in made:  # MPI keeps what a pending request still uses
            d.Free()


def _message(group, op: str, tensors, peer, side: str, tag: int, icall, source):
    """The plan posting ``tensors[0]`` as one message (``icall``: the group's
    ``Isend`` or ``Irecv``) to or from ``source`` (``peer``, or MPI's
    ANY_SOURCE).  Its checks first: one tensor; ``peer`` a rank of the group
    (``side`` as torch names it), None for any source; ``tag`` in MPI's
    range; a refusal names this rank's next point-to-point op.  The tensor's
    own memory when contiguous, else a contiguous copy: a send's taken now
    (it is posted now), a receive's written back once it arrived."""
    t = checks.message(group, op, tensors, peer, side, tag)
    buf, after = t, None
    if not t.is_contiguous():
        if side == "src":
            buf, after = staging.copy_out(t)
        else:
            buf = t.contiguous()
    keep = t if buf is t else (t, buf)
    nbytes = t.numel() * t.element_size()
    if buf.numel() <= group.max_count:
        return (None, (_mpi.buffer(buf), source, tag), icall, tensors, keep, None, after, nbytes)
    return (None, (source, tag), partial(_post_large, icall, buf, group.max_count), tensors, keep, None, after, nbytes)


def send(group, tensors, dst: int, tag: int, op: str = "send"):
    """send's plan: ``tensors[0]`` to group rank ``dst`` (MPI_Isend)."""
    return _message(group, op, tensors, dst, "dst", tag, group.calls.Isend, dst)


def recv(group, tensors, src, tag: int, op: str = "recv"):
    """recv's plan: into ``tensors[0]`` from group rank ``src`` (None: any
    source; MPI_Irecv).  What arrives is checked when it completes."""
    return _message(group, op, tensors, src, "src", tag, group.calls.Irecv,
                    _mpi.mpi().ANY_SOURCE if src is None else src)


def barrier(group, op: str = "barrier"):
    """barrier's plan: MPI_Barrier."""
    return (group.calls.Barrier, (), None, [], None, None, None, 0)
