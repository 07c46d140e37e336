"""Point-to-point: send, recv (from a rank or any source), and barrier.

Each op's whole story here (cache key, checks, signature, plan, NCCL forms)
and its declaration (:class:`~hpccomm._ops.op.Op`) at the end.  Sends and
receives have no blocking form: hpccomm._ops.op_path posts them
(MPI_Isend/MPI_Irecv on the group's private point-to-point communicator, so
they never match hpccomm's own internal messages) and returns a pending
Work.  What a receive got is checked here, by recv's step at completion
(:func:`received`, its declaration's ``completes``), which the op's record
(hpccomm._core.record) runs once the request completed.

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
from .._core.plan import ARGS, OUTPUTS
from ..errors import HpccommError
from . import checks, staging
from .op import STRIDED, Call, Op, Signature, Tensor


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


def _key(op, tensors, peer, tag):
    """A message's shape: one dense CPU tensor's dtype and count, the peer and the tag."""
    if tensors.__class__ is list and len(tensors) == 1 and tag.__class__ is int and \
            (peer.__class__ is int or peer is None):
        t = tensors[0]
        if t.__class__ is Tensor and t.is_cpu and t.layout is STRIDED:
            return (op, t.dtype, t.numel(), peer, tag)
    return None


def send_key(args):
    return _key(SEND, *args)


def recv_key(args):
    return _key(RECV, *args)


def _check(group, op: str, tensors, peer, side: str, tag: int) -> Call:
    """One tensor; ``peer`` a rank of the group (``side`` as torch names it),
    None for any source; ``tag`` in MPI's range.  A refusal names this rank's
    next point-to-point op."""
    t = checks.message(group, op, tensors, peer, side, tag)
    return Call(Signature(op, ((t.dtype, t.numel()),), ((side, peer), ("tag", tag))), _mpi.kind_of(t.dtype))


def check_send(group, tensors, dst: int, tag: int, op: str = "send") -> Call:
    return _check(group, op, tensors, dst, "dst", tag)


def check_recv(group, tensors, src, tag: int, op: str = "recv") -> Call:
    return _check(group, op, tensors, src, "src", tag)


def _message(group, tensors, receive: bool, icall, source, tag: int, kind):
    """The plan posting ``tensors[0]`` as one message (``icall``: the group's
    ``Isend`` or ``Irecv``) to or from ``source`` (a rank, or MPI's
    ANY_SOURCE) with ``tag``; ``kind``: how its dtype travels (the checked
    call's facts, :func:`hpccomm._mpi.kind_of`).  The tensor's own memory when contiguous, else a contiguous
    copy: a send's taken now (it is posted now), a receive's written back
    once it arrived."""
    t = tensors[0]
    buf, after = t, None
    if not t.is_contiguous():
        if receive:
            buf, after = staging.copy_out(t)
        else:
            buf = t.contiguous()
    keep = t if buf is t else (t, buf)
    n = buf.numel()
    nbytes = n * kind[1]
    if n <= group.max_count:
        spec = [_mpi.fromaddress(buf.data_ptr(), nbytes), n, kind[0]]  # (the checked call knows its MPI datatype)
        return (None, (spec, source, tag), icall, tensors, keep, None, after, nbytes)
    return (None, (source, tag), partial(_post_large, icall, buf, group.max_count), tensors, keep,
            None, after, nbytes)


def plan_send(group, call: Call, args):
    """send's plan: ``tensors[0]`` to group rank ``dst`` (MPI_Isend)."""
    tensors, dst, tag = args
    return _message(group, tensors, False, group.calls.Isend, dst, tag, call.facts)


def plan_recv(group, call: Call, args):
    """recv's plan: into ``tensors[0]`` from group rank ``src`` (None: any
    source; MPI_Irecv).  What arrives is checked when it completes."""
    tensors, src, tag = args
    return _message(group, tensors, True, group.calls.Irecv, _mpi.mpi().ANY_SOURCE if src is None else src, tag,
                    call.facts)


def received(plan, status, peer, describe, error=None):
    """recv's step at completion (its declaration's ``completes``; the op's
    record runs it once the request completed, hpccomm._core.record).

    ``plan``: the receive's plan; ``status``: its request's MPI status;
    ``peer``: the group rank it was posted for (None: any source);
    ``describe()``: the op for messages (``recv (p2p op #3 on group '0',
    rank 1/4)``).  ``error`` None: returns the rank the message came from
    (the Work's ``source_rank``), once as many elements arrived as the tensor
    holds; raises :class:`~hpccomm.errors.HpccommError` naming both counts
    when fewer did.  ``error`` an MPI error of the request: returns the error
    to raise in its place (a message larger than the tensor), or None (the
    record names it as any other).

    Example: a 5-element receive that got 3 raises ``hpccomm recv (p2p op #1
    ...): received 3 elements from rank 0 but the tensor has 5; ...``."""
    if error is not None and error.Get_error_class() != _mpi.mpi().ERR_TRUNCATE:
        return None
    source = peer if peer is not None else status.Get_source()
    if error is not None:
        return HpccommError(f"hpccomm {describe()}: the message from rank {source} is larger than the tensor "
                            f"({plan[OUTPUTS][0].numel()} elements); the tensor may be partly overwritten. {_SAME}")
    message = plan[ARGS][0]
    if message.__class__ is list:  # [memory, count, MPI datatype]: what the tensor holds
        n, datatype = message[1], message[2]
    else:  # (past the count limit: a derived datatype described the tensor's elements)
        tensor = plan[OUTPUTS][0]
        n, datatype = tensor.numel(), _mpi.mpi_type(tensor.dtype)
    got = status.Get_elements(datatype)
    if got != n:
        raise HpccommError(f"hpccomm {describe()}: received {got} elements from rank {source} but the tensor has "
                           f"{n}; only its first {got} elements were written. {_SAME}")
    return source


_SAME = "Sender and receiver must pass tensors with the same number of elements"


def _nccl_send(b, a, o, options):
    return b.send(a[0], a[1], a[2])


def _nccl_recv(b, a, o, options):
    return b.recv(a[0], a[1], a[2])


def _cupy_send(n, tensors, dst, tag):
    t = tensors[0]
    dtype = n.dtype(t)
    n.comm.send(t.data_ptr(), t.numel(), dtype, dst, n.stream)


def _cupy_recv(n, tensors, src, tag):
    t = tensors[0]
    dtype = n.dtype(t)
    n.comm.recv(t.data_ptr(), t.numel(), dtype, src, n.stream)


# ----------------------------------------------------------------------------
# barrier
# ----------------------------------------------------------------------------

def barrier_key(args):
    return BARRIER_KEY


def check_barrier(group, op: str = "barrier") -> Call:
    """Nothing to check (no arguments)."""
    return Call(Signature(op))


def plan_barrier(group, call: Call, args):
    """barrier's plan: MPI_Barrier."""
    return (group.calls.Barrier, (), None, [], None, None, None, 0)


# ----------------------------------------------------------------------------
# the declarations
# ----------------------------------------------------------------------------

SEND = Op(
    "send", methods=("send",), key=send_key, check=check_send, plan=plan_send, p2p=True, matched_by="recv",
    first="in", nonblocking=True, nccl=_nccl_send, cupy=_cupy_send)
RECV = Op(
    "recv", methods=("recv", "recv_anysource"), key=recv_key, check=check_recv,
    plan=plan_recv, p2p=True, nonblocking=True, any_source=True, receives=True, matched_by="send",
    completes=received, nccl=_nccl_recv, cupy=_cupy_recv)
BARRIER = Op("barrier", methods=("barrier",), key=barrier_key, check=check_barrier, plan=plan_barrier)
BARRIER_KEY = (BARRIER,)

OPS = (SEND, RECV, BARRIER)
