"""Point-to-point: send, recv (from a rank or any source), and barrier.

Each function here is one op's plan function (see :mod:`hpccomm._ops.plan`).
Sends and receives have no blocking form: hpccomm._core.op_path posts them
(MPI_Isend/MPI_Irecv on the group's private point-to-point communicator, so
they never match hpccomm's own internal messages) and returns a pending
Work; hpccomm._core.work checks what a receive got when it completes.

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
    MPI = _mpi.mpi()
    made: list = []
    try:
        datatype, count = _cover(_mpi.mpi_type(t.dtype), n, limit, t.element_size(), made)
        datatype.Commit()
        mem = MPI.buffer.fromaddress(t.data_ptr(), n * t.element_size())
        return start([mem, count, datatype], *rest)
    finally:
        for d in made:  # MPI keeps what a pending request still uses
            d.Free()


def _relabelled(group, exc):
    """``exc`` (a check's refusal) naming this rank's next point-to-point op."""
    return type(exc)(exc.op, group.where_p2p(), exc.what, exc.fix)


def _message(group, t: torch.Tensor, icall, peer, tag, receive: bool):
    """``(icall, args, keep, after)`` posting all of ``t`` (a checked tensor)
    as one message: on its own memory when contiguous, else through a
    contiguous copy (a send's copy taken now: the send is posted now; a
    receive's written back once it arrived)."""
    if t.is_contiguous() and group.host and t.numel() <= group.max_count:  # the common case: on the tensor's memory
        return icall, (_mpi.host_buffer(t), peer, tag), t, None
    if receive:
        buf, after = staging.staged_output(t)
    else:
        buf, after = staging.contiguous(t), None
    if buf.numel() <= group.max_count:
        return icall, (_mpi.host_buffer(buf) if group.host else _mpi.buffer(buf), peer, tag), (t, buf), after
    return partial(_post_large, icall, buf, group.max_count), (peer, tag), (t, buf), after


def send(group, tensors, dst: int, tag: int, op: str = "send"):
    """send's plan: ``tensors[0]`` to group rank ``dst`` (MPI_Isend)."""
    try:
        t = checks.single(group, op, tensors)
        checks.check_root(group, op, dst, "dst")
        checks.check_tag(group, op, tag)
    except checks.OpError as exc:
        raise _relabelled(group, exc) from None
    icall, args, keep, after = _message(group, t, group.p2p.Isend, dst, tag, False)
    return (None, args, icall, tensors, keep, None, after, t.numel() * t.element_size())


def recv(group, tensors, src, tag: int, op: str = "recv"):
    """recv's plan: into ``tensors[0]`` from group rank ``src`` (None: any
    source; MPI_Irecv).  What arrives is checked when it completes."""
    try:
        t = checks.single(group, op, tensors)
        if src is not None:  # (None: any source)
            checks.check_root(group, op, src, "src")
        checks.check_tag(group, op, tag)
    except checks.OpError as exc:
        raise _relabelled(group, exc) from None
    source = _mpi.mpi().ANY_SOURCE if src is None else src
    icall, args, keep, after = _message(group, t, group.p2p.Irecv, source, tag, True)  # (True: a receive)
    return (None, args, icall, tensors, keep, None, after, t.numel() * t.element_size())


def barrier(group, op: str = "barrier"):
    """barrier's plan: MPI_Barrier."""
    return (group.comm.Barrier, (), None, [], None, None, None, 0)
