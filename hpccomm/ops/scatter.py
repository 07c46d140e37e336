"""Rooted distribution: broadcast and scatter."""
from __future__ import annotations

from functools import partial as _partial

import torch

from .. import _mpi
from . import _common as c


def broadcast(group, tensors, root: int, op: str = "broadcast"):
    t = c.single(group, op, tensors)
    if not (root.__class__ is int and 0 <= root < group.size):  # (check_root's test, without its call)
        c.check_root(group, op, root, "src")

    def run():
        if group.host and t.is_contiguous():  # the common case: one call on the user's memory
            buf = _mpi.host_buffer(t)
            if buf[1] <= group.max_count:
                group.comm.Bcast(buf, root=root)
                return tensors
        buf = c.contiguous(t)
        for off, n in c.chunks(buf.numel(), group.max_count):
            group.comm.Bcast(_mpi.buffer(buf, off, n), root=root)
        if group.rank != root:
            c.write_back(t, buf)
        return tensors

    return run


def scatter(group, outputs, input_lists, root: int, op: str = "scatter"):
    c.check_list(group, op, outputs, 1, "output_tensors")
    output = outputs[0]
    c.check_tensor(group, op, output, "output")
    c.check_root(group, op, root, "src")
    if group.rank != root:
        if input_lists and any(len(i) for i in input_lists):
            raise c.OpValueError(op, group.where(), f"scatter_list must be empty or None on rank {group.rank}, "
                                 f"which is not the source (rank {root})")
        return lambda: _scatter_recv(group, output, root, outputs)
    c.check_list(group, op, input_lists, 1, "input_tensor_lists")
    inputs = input_lists[0]
    n = output.numel()
    c.check_list(group, op, inputs, group.size, "scatter_list")
    c.check_tensors(group, op, inputs, "scatter_list")
    c.check_same_dtype(group, op, inputs, output.dtype, "scatter_list")
    for i, t in enumerate(inputs):
        if t.numel() != n:
            raise c.OpValueError(op, group.where(), f"scatter_list[{i}] has {t.numel()} elements but the output "
                                 f"has {n}", "scatter needs tensors of the output's size")
    return lambda: _scatter_send(group, output, inputs, root, outputs)


def _big(group, n: int) -> bool:
    return n * group.size > group.max_count  # every rank decides alike: sizes are equal


def _scatter_recv(group, output, root, outputs):
    comm, n = group.comm, output.numel()
    out = c.out_buffer(output)
    if _big(group, n):
        for off, k in c.chunks(n, group.max_count):
            comm.Recv(_mpi.buffer(out, off, k), source=root, tag=0)
    else:
        comm.Scatter(None, _mpi.buffer(out), root=root)
    c.write_back(output, out)
    return outputs


def _scatter_send(group, output, inputs, root, outputs):
    comm, n = group.comm, output.numel()
    out = c.out_buffer(output)
    send = c.flat_view(inputs)
    if send is None or c.overlaps(send, out):
        send = (torch.cat([t.reshape(-1) for t in inputs]) if inputs
                else torch.empty(0, dtype=output.dtype, device=output.device))
    if _big(group, n):
        out.view(-1).copy_(send[root * n:(root + 1) * n])
        reqs = []
        for r in range(group.size):
            if r != root:
                for off, k in c.chunks(n, group.max_count):
                    reqs.append(comm.Isend(_mpi.buffer(send, r * n + off, k), dest=r, tag=0))
        _mpi.mpi().Request.Waitall(reqs)
    else:
        sendbuf = _mpi.buffer(send)
        sendbuf[1] = n  # mpi4py reads an explicit count as the count per rank, not the total
        comm.Scatter(sendbuf, _mpi.buffer(out), root=root)
    c.write_back(output, out)
    return outputs


def ibroadcast(group, tensors, root: int, op: str = "broadcast"):
    """broadcast's nonblocking form (MPI_Ibcast), checks included (see
    hpccomm.ops.reduce.iallreduce), or None past the size limits (see
    hpccomm.ops.reduce's note on nonblocking forms)."""
    if root.__class__ is int and 0 <= root < group.size:
        buf = c.plain_buffer(group, tensors)  # the plain case: posted on the tensor's own memory
        if buf is not None and buf[0].nbytes <= c.NONBLOCKING_MAX_BYTES:
            return c.Posted(op, _partial(group.comm.Ibcast, buf, root=root), tensors, tensors[0], None,
                            buf[0].nbytes)
    t = c.single(group, op, tensors)
    if not (root.__class__ is int and 0 <= root < group.size):  # (check_root's test, without its call)
        c.check_root(group, op, root, "src")
    if t.numel() > group.max_count or t.numel() * t.element_size() > c.NONBLOCKING_MAX_BYTES:
        return None
    buf = c.contiguous(t)
    spec = _mpi.host_buffer(buf)
    comm = group.comm
    after = (lambda: c.write_back(t, buf)) if buf is not t and group.rank != root else None
    return c.Posted(op, _partial(comm.Ibcast, spec, root=root), tensors, (t, buf), after, t.numel() * t.element_size())
