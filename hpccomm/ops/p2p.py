"""Point-to-point: send, recv (from a rank or any source) and barrier.

Sends and receives are nonblocking MPI calls on the group's private
point-to-point communicator (so they never match hpccomm's own internal
messages); the returned pending object completes them.
"""
from __future__ import annotations

import time

import torch

from .. import _mpi
from . import _common as c


class Pending:
    """One or more MPI requests plus what to do once they complete."""

    def __init__(self, reqs, keep, after=None, source=None) -> None:
        self.reqs = reqs
        self.source = source
        self.keep = keep  # the tensors MPI reads or writes: alive until done
        self.after = after
        self.status = _mpi.mpi().Status()

    def test(self) -> bool:
        if len(self.reqs) == 1:
            return self.reqs[0].Test(self.status)
        return _mpi.mpi().Request.Testall(self.reqs)

    def wait(self, seconds) -> bool:
        if seconds is None:
            if len(self.reqs) == 1:
                self.reqs[0].Wait(self.status)
            else:
                _mpi.mpi().Request.Waitall(self.reqs)
            return True
        deadline = time.monotonic() + seconds
        idle = 1e-6
        while not self.test():
            if time.monotonic() > deadline:
                return False
            time.sleep(idle)
            idle = min(idle * 2, 1e-3)
        return True

    def finish(self):
        if self.after is not None:
            self.after()
        if self.source is not None:
            return self.source
        source = self.status.Get_source()
        return source if source >= 0 else None


def _segments(t: torch.Tensor, limit: int):
    return list(c.chunks(t.numel(), limit))


def send(group, tensors, dst: int, tag: int, op: str = "send"):
    c.check_list(group, op, tensors, 1, "tensors")
    t = tensors[0]
    c.check_tensor(group, op, t)
    c.check_peer(group, op, dst, "dst")
    c.check_tag(group, op, tag)
    buf = c.contiguous(t)
    reqs = [group.p2p.Isend(_mpi.buffer(buf, off, n), dest=dst, tag=tag) for off, n in _segments(buf, group.max_count)]
    return Pending(reqs, (t, buf))


def recv(group, tensors, src, tag: int, op: str = "recv"):
    """Receive into ``tensors[0]`` from group rank ``src`` (None: any source)."""
    c.check_list(group, op, tensors, 1, "tensors")
    t = tensors[0]
    c.check_tensor(group, op, t)
    if src is not None:
        c.check_peer(group, op, src, "src")
    c.check_tag(group, op, tag)
    out = c.out_buffer(t)
    MPI = _mpi.mpi()
    segs = _segments(out, group.max_count)
    if src is None and len(segs) > 1:
        # Later pieces must come from whoever sent the first: receive it, then the rest.
        first = group.p2p.Irecv(_mpi.buffer(out, *segs[0]), source=MPI.ANY_SOURCE, tag=tag)
        pending = Pending([first], (t, out))

        def rest():
            source = pending.status.Get_source()
            MPI.Request.Waitall([group.p2p.Irecv(_mpi.buffer(out, off, n), source=source, tag=tag)
                                 for off, n in segs[1:]])
            c.write_back(t, out)

        pending.after = rest
        return pending
    source = MPI.ANY_SOURCE if src is None else src
    reqs = [group.p2p.Irecv(_mpi.buffer(out, off, n), source=source, tag=tag) for off, n in segs]
    return Pending(reqs, (t, out), after=lambda: c.write_back(t, out), source=src)


def barrier(group, op: str = "barrier"):
    group.comm.Barrier()
    return []
