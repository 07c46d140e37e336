"""Rooted distribution: broadcast and scatter; each op's whole story here
(cache key, checks, signature, plan, NCCL forms) and its declaration
(:class:`~hpccomm._ops.op.Op`) at the end.
"""
from __future__ import annotations

from .. import _mpi
from . import checks, staging
from .op import STRIDED, Call, Op, Signature, Tensor


# ----------------------------------------------------------------------------
# broadcast
# ----------------------------------------------------------------------------

def broadcast_key(args):
    """broadcast's shape: one dense CPU tensor's dtype and count, the root."""
    tensors, root = args
    if tensors.__class__ is list and len(tensors) == 1 and root.__class__ is int:
        t = tensors[0]
        if t.__class__ is Tensor and t.is_cpu and t.layout is STRIDED:
            return (BROADCAST, t.dtype, t.numel(), root)
    return None


def check_broadcast(group, tensors, root: int, op: str = "broadcast") -> Call:
    """One dense tensor; the root a rank of the group.  Facts: how its dtype travels."""
    t = checks.single(group, op, tensors)
    checks.check_root(group, op, root, "src")
    return Call(Signature(op, ((t.dtype, t.numel()),), (("root", root),)), _mpi.kind_of(t.dtype))


def plan_broadcast(group, call: Call, args):
    """broadcast's plan: MPI_Bcast on the tensor's memory; a strided tensor
    through a contiguous copy (sent from it on the root, written back on the
    others); past the count limit in chunks."""
    tensors, root = args
    t = tensors[0]
    buf, before, after = t, None, None  # a contiguous tensor: MPI reads or writes its own memory
    if not t.is_contiguous():  # a copy sent from on the root, written back on the others
        if group.rank == root:
            buf, before = staging.copy_in(t)
        else:
            buf, after = staging.copy_out(t)
    mtype, size = call.facts
    n = buf.numel()
    nbytes = n * size
    spec = [_mpi.fromaddress(buf.data_ptr(), nbytes), n, mtype]  # (the checked call knows its MPI datatype)
    keep = t if buf is t else (t, buf)
    if n > group.max_count:
        return (_bcast_chunks(group, buf, root), (), None, tensors, keep, before, after, nbytes)
    calls = group.calls
    return (calls.Bcast, (spec, root), calls.Ibcast, tensors, keep, before, after, nbytes)


def bind_broadcast(group, call: Call):
    """broadcast's plan bound to a cached call's shape (:class:`~hpccomm._ops.op.Op`
    ``bind``): a contiguous tensor sent or written in place, one MPI call;
    None past the count limit (chunks)."""
    n = call.signature.tensors[0][1]
    if n > group.max_count:
        return None
    (mtype, size), root = call.facts, call.signature.fields[0][1]
    nbytes = n * size
    calls, fromaddress = group.calls, _mpi.fromaddress
    bcast, ibcast = calls.Bcast, calls.Ibcast

    def fill(args):
        tensors = args[0]
        t = tensors[0]
        if not t.is_contiguous():
            return None
        return (bcast, ([fromaddress(t.data_ptr(), nbytes), n, mtype], root), ibcast, tensors, t, None, None, nbytes)

    return fill


def _bcast_chunks(group, buf, root: int):
    """The blocking form of a broadcast past the count limit: in chunks."""
    comm = group.comm

    def run():
        for off, n in staging.chunks(buf.numel(), group.max_count):
            comm.Bcast(_mpi.buffer(buf, off, n), root=root)

    return run


def _broadcast_roles(args, rank: int) -> str:
    """The root's tensor is read; the others' written."""
    return "in" if args[1] == rank else "out"


def _nccl_broadcast(b, a, o, options):
    return b.broadcast(a[0], options("broadcast", o, rootRank=a[1]))


def _cupy_broadcast(n, tensors, root):
    t = tensors[0]
    dtype = n.dtype(t)
    n.comm.bcast(t.data_ptr(), t.numel(), dtype, root, n.stream)


# ----------------------------------------------------------------------------
# scatter
# ----------------------------------------------------------------------------

def check_scatter(group, outputs, input_lists, root: int, op: str = "scatter") -> Call:
    """One output; at the root a list of one input per rank of the output's
    size, elsewhere none."""
    output = checks.single(group, op, outputs, "output_tensors", "output")
    inputs = checks.rooted(group, op, root, "src", input_lists, "input_tensor_lists", "scatter_list", output,
                           "the output", "scatter needs tensors of the output's size")
    return Call(Signature(op, ((output.dtype, output.numel()),), (("root", root),)), inputs is not None)


def plan_scatter(group, call: Call, args):
    outputs, input_lists, root = args
    output = outputs[0]
    if not call.facts:  # not the root: its part from the root
        return _scatter_recv(group, output, root, outputs)
    return _scatter_send(group, output, input_lists[0], root, outputs)


def _big(group, n: int) -> bool:
    return n * group.size > group.max_count  # every rank decides alike: sizes are equal


def _scatter_recv(group, output, root, outputs):
    """A non-root's part of scatter: its slot from ``root``."""
    comm, n = group.comm, output.numel()
    if output.is_contiguous():
        out, after = output, None
    else:
        out, after = staging.copy_out(output)

    def run():
        if _big(group, n):
            for off, k in staging.chunks(n, group.max_count):
                comm.Recv(_mpi.buffer(out, off, k), source=root, tag=0)
        else:
            comm.Scatter(None, _mpi.buffer(out), root=root)

    return (run, (), None, outputs, (output, out), None, after, n * output.element_size())


def _scatter_send(group, output, inputs, root, outputs):
    """The root's part of scatter: read in place when the inputs are laid end
    to end in one storage, else concatenated."""
    comm, n = group.comm, output.numel()
    if output.is_contiguous():
        out, after = output, None
    else:
        out, after = staging.copy_out(output)
    send, before = staging.joined(inputs, n * group.size, output, out)

    def run():
        if _big(group, n):
            out.view(-1).copy_(send[root * n:(root + 1) * n])
            reqs = []
            for r in range(group.size):
                if r != root:
                    for off, k in staging.chunks(n, group.max_count):
                        reqs.append(comm.Isend(_mpi.buffer(send, r * n + off, k), dest=r, tag=0))
            _mpi.mpi().Request.Waitall(reqs)
        else:
            sendbuf = _mpi.buffer(send)
            sendbuf[1] = n  # mpi4py reads an explicit count as the count per rank, not the total
            comm.Scatter(sendbuf, _mpi.buffer(out), root=root)

    return (run, (), None, outputs, (inputs, output, send, out), before, after, n * output.element_size())


def _nccl_scatter(b, a, o, options):
    return b.scatter(a[0], a[1], options("scatter", o, rootRank=a[2]))


# ----------------------------------------------------------------------------
# the declarations
# ----------------------------------------------------------------------------

BROADCAST = Op(
    "broadcast", methods=("broadcast",), key=broadcast_key, check=check_broadcast,
    plan=plan_broadcast, bind=bind_broadcast, first="inout", roles=_broadcast_roles, nonblocking=True, chunkable=True,
    nccl=_nccl_broadcast, cupy=_cupy_broadcast)
SCATTER = Op(
    "scatter", methods=("scatter",), check=check_scatter, plan=plan_scatter,
    nccl=_nccl_scatter)

OPS = (BROADCAST, SCATTER)
