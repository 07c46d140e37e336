"""Point-to-point: send, recv (from a rank or any source) and barrier.

Sends and receives are nonblocking MPI calls on the group's private
point-to-point communicator (so they never match hpccomm's own internal
messages); the returned :class:`Pending` completes them.

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

import time

import torch

from .. import _mpi, _status
from ..errors import HpccommError
from . import _common as c


class Pending(c.Request):
    """One MPI request plus what to do once it completes.

    ``peer``: the group rank a send goes to or a receive names (None: any
    source, read from the status).  ``expect``: for a receive, ``(elements,
    MPI datatype)`` the tensor holds, checked against what arrived.
    ``after``: run once the data is in place (the write-back of a staged
    receive).

    Once posted (hpccomm._runner.posted), a Pending is also what
    :mod:`hpccomm._status` records as running, with the fields of a
    :class:`hpccomm._status.Op`: ``group``, ``name``, ``seq``, ``start``,
    ``deadline``, ``kind``, ``peer`` and ``where()``; no record is made for it.
    """

    kind = "p2p"
    engine_completes = False  # completed by whoever waits or tests (hpccomm._work)
    #: Set by the op path once posted: the op's number, its group, when it was
    #: posted, its deadline and the watchdog's token (ended when the Work completes).
    #: While posted it is in hpccomm._status's records, which keep it (and so its
    #: tensors) alive until it completes, and through which it is settled at exit.
    seq = 0
    group = None
    start = deadline = None
    token = None
    expect = None  # a receive's (elements, MPI datatype)
    # (a send's defaults, from hpccomm.ops._common.Request: is_recv False, after None, status None)

    def __init__(self, req, keep, op: str, peer=None, is_recv: bool = False, expect=None, after=None) -> None:
        self.req = req
        self.keep = keep  # the tensors MPI reads or writes: alive until done
        self.op = self.name = op
        self.peer = peer
        if is_recv:
            self.is_recv = True
            self.expect = expect
            self.status = _mpi.mpi().Status()
            if after is not None:
                self.after = after

    @property
    def source(self):
        """The rank a receive named (None: any source)."""
        return self.peer if self.is_recv else None

    def where(self) -> str:
        """``p2p op #N on group 'G', rank r/n`` (for messages; made only when needed)."""
        return self.group.where_p2p(self.seq) if self.group is not None else f"{self.op} not posted"

    def describe(self) -> str:
        return f"{self.op} ({self.where()})"

    def _fail(self, what: str, fix: str = "") -> HpccommError:
        return HpccommError(f"hpccomm {self.op} ({self.where()}): {what}" + (f". {fix}" if fix else ""))

    def finish(self):
        """After completion: check what arrived, write it back; the group rank
        of the sender for a receive, else None.  Raises HpccommError."""
        if self.error is not None:
            MPI = _mpi.mpi()
            exc = self.error
            source = self.peer
            if self.is_recv and source is None:
                source = self.status.Get_source()
            if exc.Get_error_class() == MPI.ERR_TRUNCATE:
                raise self._fail(f"the message from rank {source} is larger than the tensor "
                                 f"({self.expect[0]} elements); the tensor may be partly overwritten",
                                 "Sender and receiver must pass tensors with the same number of elements")
            raise self._fail(f"MPI failed: {exc}")
        if not self.is_recv:
            return None
        source = self.peer
        if source is None:
            source = self.status.Get_source()
        n, datatype = self.expect
        got = self.status.Get_elements(datatype)
        if got != n:
            raise self._fail(f"received {got} elements from rank {source} but the tensor has {n}; "
                             f"only its first {got} elements were written",
                             "Sender and receiver must pass tensors with the same number of elements")
        if self.after is not None:
            self.after()
        return source


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


def _post(t: torch.Tensor, limit: int, start):
    """Post ``start(message)`` for all of contiguous ``t`` as one message."""
    n = t.numel()
    if n <= limit:
        return start(_mpi.buffer(t))
    MPI = _mpi.mpi()
    if t.is_cuda:
        _mpi.device_ready(t)
    made: list = []
    try:
        datatype, count = _cover(_mpi.mpi_type(t.dtype), n, limit, t.element_size(), made)
        datatype.Commit()
        mem = MPI.buffer.fromaddress(t.data_ptr(), n * t.element_size())
        return start([mem, count, datatype])
    finally:
        for d in made:  # MPI keeps what a pending request still uses
            d.Free()


def _relabelled(group, exc):
    """``exc`` (a check's refusal) naming this rank's next point-to-point op."""
    return type(exc)(exc.op, group.where_p2p(), exc.what, exc.fix)


def check_send(group, tensors, dst: int, tag: int, op: str = "send"):
    """Check a send's arguments (raises OpError); returns the tensor."""
    try:
        c.single(group, op, tensors)
        # check_root and check_tag's tests, asked first without their calls: they raise only when one fails
        if not (dst.__class__ is int and 0 <= dst < group.size and tag.__class__ is int and 0 <= tag <= group.tag_ub):
            c.check_root(group, op, dst, "dst")
            c.check_tag(group, op, tag)
    except c.OpError as exc:
        raise _relabelled(group, exc) from None
    return tensors[0]


def check_recv(group, tensors, src, tag: int, op: str = "recv"):
    """Check a receive's arguments (raises OpError); returns the tensor."""
    try:
        c.single(group, op, tensors)
        if not ((src is None or (src.__class__ is int and 0 <= src < group.size))
                and tag.__class__ is int and 0 <= tag <= group.tag_ub):
            if src is not None:
                c.check_root(group, op, src, "src")
            c.check_tag(group, op, tag)
    except c.OpError as exc:
        raise _relabelled(group, exc) from None
    return tensors[0]


def send(group, tensors, dst: int, tag: int, op: str = "send"):
    """Send ``tensors[0]`` to group rank ``dst``; a posted :class:`Pending`."""
    t = check_send(group, tensors, dst, tag, op)
    buf = t if t.is_contiguous() else t.contiguous()
    if group.host:  # the common case: one message on the tensor's own memory
        spec = _mpi.host_buffer(buf)
        if spec[1] <= group.max_count:
            return Pending(group.p2p.Isend(spec, dest=dst, tag=tag), (t, buf), op, dst)
    req = _post(buf, group.max_count, lambda m: group.p2p.Isend(m, dest=dst, tag=tag))
    return Pending(req, (t, buf), op, dst)


def recv(group, tensors, src, tag: int, op: str = "recv"):
    """Receive into ``tensors[0]`` from group rank ``src`` (None: any source); a posted :class:`Pending`."""
    t = check_recv(group, tensors, src, tag, op)
    MPI = _mpi.mpi()
    source = MPI.ANY_SOURCE if src is None else src
    if group.host and t.is_contiguous():  # the common case: one message into the tensor's own memory
        spec = _mpi.host_buffer(t)
        if spec[1] <= group.max_count:
            return Pending(group.p2p.Irecv(spec, source=source, tag=tag), (t, t), op, src, True,
                           (spec[1], spec[2]))
    out = c.out_buffer(t)
    req = _post(out, group.max_count, lambda m: group.p2p.Irecv(m, source=source, tag=tag))
    return Pending(req, (t, out), op, src, True, (t.numel(), _mpi.mpi_type(t.dtype)),
                   None if out is t else lambda: c.write_back(t, out))


def _settle_at_exit(seconds: float = 2.0) -> None:
    """At exit, before MPI_Finalize (hpccomm._engine's thread rule): every
    request still pending is completed if it can be within ``seconds`` (a
    send whose receiver is also exiting), else a receive is cancelled and a
    send's request freed (MPI lets it finish on its own)."""
    MPI = _mpi.mpi()
    pending = [p for p in _status.records() if isinstance(p, Pending) and p.req is not None
               and p.req != MPI.REQUEST_NULL]
    deadline = time.monotonic() + seconds
    for p in pending:
        try:
            while not p.req.Test() and time.monotonic() < deadline:
                time.sleep(1e-3)
            if p.req == MPI.REQUEST_NULL:
                continue
            if p.is_recv:
                p.req.Cancel()
                p.req.Wait()
            else:
                p.req.Free()
        except MPI.Exception:  # at exit: settle the others
            pass


_mpi.at_exit.append((2, _settle_at_exit))


#: The checks alone, by op name, for transports that hand the op to NCCL.
CHECKS = {"send": check_send, "recv": check_recv}


def barrier(group, op: str = "barrier"):
    group.comm.Barrier()
    return []
