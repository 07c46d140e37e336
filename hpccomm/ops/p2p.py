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

from .. import _mpi
from ..errors import HpccommError
from . import _common as c


class Pending:
    """One MPI request plus what to do once it completes.

    ``source``: the group rank a receive named (None: any source, read from
    the status).  ``expect``: for a receive, ``(elements, MPI datatype)`` the
    tensor holds, checked against what arrived.  ``after``: run once the data
    is in place (the write-back of a staged receive).
    """

    def __init__(self, req, keep, op: str, where: str, *, is_recv: bool = False, source=None,
                 expect=None, after=None) -> None:
        self.req = req
        self.keep = keep  # the tensors MPI reads or writes: alive until done
        self.op = op
        self.where = where
        self.is_recv = is_recv
        self.source = source
        self.expect = expect
        self.after = after
        self.status = _mpi.mpi().Status()
        self.error = None  # an MPI error the request completed with

    def test(self) -> bool:
        """Non-blocking: True once the request completed (with or without error)."""
        MPI = _mpi.mpi()
        try:
            return self.req.Test(self.status)
        except MPI.Exception as exc:  # completed with an error: finish() reports it
            self.error = exc
            return True

    def wait(self, seconds) -> bool:
        """Block until complete (``seconds`` None) or for at most ``seconds``."""
        if seconds is None:
            MPI = _mpi.mpi()
            try:
                self.req.Wait(self.status)
            except MPI.Exception as exc:
                self.error = exc
            return True
        deadline = time.monotonic() + seconds
        idle = 1e-6
        while not self.test():
            if time.monotonic() > deadline:
                return False
            time.sleep(idle)
            idle = min(idle * 2, 1e-3)
        return True

    def _fail(self, what: str, fix: str = "") -> HpccommError:
        return HpccommError(f"hpccomm {self.op} ({self.where}): {what}" + (f". {fix}" if fix else ""))

    def finish(self):
        """After completion: check what arrived, write it back; the group rank
        of the sender for a receive, else None.  Raises HpccommError."""
        MPI = _mpi.mpi()
        source = self.source
        if self.is_recv and source is None:
            source = self.status.Get_source()
        if self.error is not None:
            exc = self.error
            if exc.Get_error_class() == MPI.ERR_TRUNCATE:
                raise self._fail(f"the message from rank {source} is larger than the tensor "
                                 f"({self.expect[0]} elements); the tensor may be partly overwritten",
                                 "Sender and receiver must pass tensors with the same number of elements")
            raise self._fail(f"MPI failed: {exc}")
        if not self.is_recv:
            return None
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


def send(group, tensors, dst: int, tag: int, op: str = "send"):
    """Send ``tensors[0]`` to group rank ``dst``; a :class:`Pending`."""
    c.check_list(group, op, tensors, 1, "tensors")
    t = tensors[0]
    c.check_tensor(group, op, t)
    c.check_root(group, op, dst, "dst")
    c.check_tag(group, op, tag)
    buf = c.contiguous(t)
    req = _post(buf, group.max_count, lambda m: group.p2p.Isend(m, dest=dst, tag=tag))
    return Pending(req, (t, buf), op, group.where())


def recv(group, tensors, src, tag: int, op: str = "recv"):
    """Receive into ``tensors[0]`` from group rank ``src`` (None: any source); a :class:`Pending`."""
    c.check_list(group, op, tensors, 1, "tensors")
    t = tensors[0]
    c.check_tensor(group, op, t)
    if src is not None:
        c.check_root(group, op, src, "src")
    c.check_tag(group, op, tag)
    out = c.out_buffer(t)
    MPI = _mpi.mpi()
    source = MPI.ANY_SOURCE if src is None else src
    req = _post(out, group.max_count, lambda m: group.p2p.Irecv(m, source=source, tag=tag))
    return Pending(req, (t, out), op, group.where(), is_recv=True, source=src,
                   expect=(t.numel(), _mpi.mpi_type(t.dtype)), after=lambda: c.write_back(t, out))


def barrier(group, op: str = "barrier"):
    group.comm.Barrier()
    return []
