"""Gathers: all_gather (lists, equal or different sizes), all_gather_into_tensor,
gather, gather_single, and the coalesced forms; each op's whole story here
(cache key, checks, signature, plan, NCCL forms) and its declaration
(:class:`~hpccomm._ops.op.Op`) at the end.
"""
from __future__ import annotations

import itertools

import torch

from .. import _mpi
from .._core.plan import sequence, steps
from . import checks, staging
from .op import STRIDED, Call, Op, Signature, Tensor


def _displs(counts):
    return [0, *itertools.accumulate(counts)][:-1]


def allgather(group, input: torch.Tensor, out: torch.Tensor, recv, offset: int, counts, outputs, after, kind=None):
    """The plan of the Allgather(v) of this rank's ``input`` into contiguous
    ``out`` (``recv``: its MPI buffer), where this rank's slot starts
    ``offset`` bytes in; ``counts``: every rank's part (elements, laid end to
    end), None for equal parts; ``outputs``, ``after``: the plan's; ``kind``:
    how the dtype travels, where the checked call knows it
    (:func:`hpccomm._mpi.kind_of`).

    This rank's part is read where it is: MPI_IN_PLACE when ``input`` is its
    slot of ``out`` (FSDP's layout), ``input`` itself when contiguous and
    apart from ``out``, else a copy made by the plan's ``before`` step
    (strided, or aliased elsewhere in ``out``: MPI forbids aliased buffers).
    The nonblocking form is there for equal parts only.  Past the count
    limit every rank broadcasts its part, chunked (no nonblocking form)."""
    mem = recv[0]
    sendbuf = send = before = None
    if input.is_contiguous():
        mtype, isize = kind or _mpi.kind_of(input.dtype)
        here, n = input.data_ptr(), input.numel()
        nbytes = n * isize
        base, total_bytes = mem.address, mem.nbytes
        if n and here == base + offset:
            sendbuf = _mpi.IN_PLACE
        elif not staging.overlap(here, nbytes, base, total_bytes):
            sendbuf, send = [_mpi.fromaddress(here, nbytes), n, mtype], input
    if sendbuf is None:
        send, before = staging.copy_in(input)
        sendbuf = _mpi.buffer(send)
        nbytes = sendbuf[0].nbytes
    keep = (input, out, send)
    total, size = recv[1], group.size
    if total > group.max_count:
        run = _bcasts(group, send, out, counts or [total // size] * size)
        return (run, (), None, outputs, keep, before, after, nbytes)
    calls = group.calls
    if counts is None or counts.count(counts[0]) == size:
        recv[1] = total // size  # mpi4py counts the receive side per rank
        return (calls.Allgather, (sendbuf, recv), calls.Iallgather, outputs, keep, before, after, nbytes)
    recv[1] = (counts, _displs(counts))
    return (calls.Allgatherv, (sendbuf, recv), None, outputs, keep, before, after, nbytes)


def _bcasts(group, send, out: torch.Tensor, counts):
    """The blocking form of an all_gather past the count limit: this rank's
    part into its slot (unless ``send`` is None: it is there), then every
    rank broadcasts its part, chunked."""
    comm, displs, flat = group.comm, _displs(counts), out.view(-1)

    def run():
        if send is not None:
            flat[displs[group.rank]:displs[group.rank] + counts[group.rank]].copy_(send.view(-1))
        for r in range(group.size):
            for off, n in staging.chunks(counts[r], group.max_count):
                comm.Bcast(_mpi.buffer(flat, displs[r] + off, n), root=r)

    return run


# ----------------------------------------------------------------------------
# all_gather_into_tensor (FSDP's) and its coalesced form
# ----------------------------------------------------------------------------

def all_gather_into_tensor_key(args):
    """all_gather_into_tensor's shape: two dense CPU tensors' dtypes and counts."""
    output, input = args
    if output.__class__ is Tensor and input.__class__ is Tensor and output.is_cpu and input.is_cpu and \
            output.layout is STRIDED and input.layout is STRIDED:
        return (ALL_GATHER_INTO_TENSOR, output.dtype, output.numel(), input.dtype, input.numel())
    return None


def check_all_gather_into_tensor(group, output, input, op: str = "all_gather_into_tensor") -> Call:
    """Two tensors of one dtype, the output the group size times the input's
    elements.  Facts: how the dtype travels."""
    checks.check_pair(group, op, output, input, "output")
    return Call(Signature(op, ((input.dtype, input.numel()), (output.dtype, output.numel()))),
                _mpi.kind_of(input.dtype))


def plan_all_gather_into_tensor(group, call: Call, args):
    """all_gather_into_tensor's plan: MPI writes the output in place, and
    reads the input where it is when it can (:func:`allgather`)."""
    output, input = args
    if output.is_contiguous():
        out, after = output, None
    else:
        out, after = staging.copy_out(output)
    kind = call.facts
    n = out.numel()
    nbytes = n * kind[1]
    recv = [_mpi.fromaddress(out.data_ptr(), nbytes), n, kind[0]]  # (the checked call knows its MPI datatype)
    return allgather(group, input, out, recv, group.rank * (nbytes // group.size), None, [output], after, kind)


def bind_all_gather_into_tensor(group, call: Call):
    """all_gather_into_tensor's plan bound to a cached call's shape
    (:class:`~hpccomm._ops.op.Op` ``bind``): a contiguous output written in
    place and a contiguous input read where it is (this rank's slot of the
    output: MPI_IN_PLACE, or apart from it), one MPI call; None past the
    count limit; ``fill`` gives None for a strided output or input, or an
    input aliased elsewhere in the output (copies: :func:`allgather`)."""
    (_, n), (_, total) = call.signature.tensors
    if total > group.max_count:
        return None
    mtype, isize = call.facts
    nbytes, total_bytes = n * isize, total * isize
    offset = group.rank * nbytes
    calls, fromaddress, overlap, in_place = group.calls, _mpi.fromaddress, staging.overlap, _mpi.IN_PLACE
    allgather_, iallgather = calls.Allgather, calls.Iallgather

    def fill(args):
        output, input = args
        if not (output.is_contiguous() and input.is_contiguous()):
            return None
        base, here = output.data_ptr(), input.data_ptr()
        if n and here == base + offset:
            sendbuf = in_place
        elif overlap(here, nbytes, base, total_bytes):
            return None
        else:
            sendbuf = [fromaddress(here, nbytes), n, mtype]
        return (allgather_, (sendbuf, [fromaddress(base, total_bytes), n, mtype]), iallgather, [output],
                (input, output, None if sendbuf is in_place else input), None, None, nbytes)

    return fill


def _nccl_all_gather_into_tensor(b, a, o, options):
    return b._allgather_base(a[0], a[1], options("allgather", o))


def _cupy_all_gather_into_tensor(n, output, input):
    dtype = n.dtype(output, input)
    n.comm.allGather(input.data_ptr(), output.data_ptr(), input.numel(), dtype, n.stream)


def check_all_gather_into_tensor_coalesced(group, outputs, inputs,
                                           op: str = "all_gather_into_tensor_coalesced") -> Call:
    """all_gather_into_tensor's checks for each (output, input) pair; every tensor in the signature."""
    if not isinstance(outputs, (list, tuple)):
        checks.check_list(group, op, outputs, 0, "outputs")  # (refused: not a list)
    checks.check_list(group, op, inputs, len(outputs), "inputs")
    calls = [check_all_gather_into_tensor(group, o, i, op) for o, i in zip(outputs, inputs)]
    return Call(Signature(op, tuple(x for c in calls for x in c.signature.tensors)), calls)


def plan_all_gather_into_tensor_coalesced(group, call: Call, args):
    """Each pair's all_gather_into_tensor, in turn."""
    outputs, inputs = args
    return sequence([plan_all_gather_into_tensor(group, c, (o, i)) for o, i, c in zip(outputs, inputs, call.facts)],
                    outputs)


def _nccl_all_gather_into_tensor_coalesced(b, a, o, options):
    return options.coalesced(b, "allgather_into_tensor_coalesced", "_allgather_base", a[0], a[1],
                             options("allgather", o))


# ----------------------------------------------------------------------------
# all_gather (a list of outputs, one per rank, sizes may differ) and its coalesced form
# ----------------------------------------------------------------------------

def _check_all_gather(group, op: str, output_lists, inputs):
    """``(input, outputs)`` of all_gather's arguments, checked: one input, one
    output per rank of its dtype, this rank's own of its size."""
    input = checks.single(group, op, inputs, "input_tensors", "input")
    outputs = checks.per_rank(group, op, output_lists, "output_tensor_lists", "tensor_list", input)
    checks.check_own_slot(group, op, outputs, input)
    return input, outputs


def check_all_gather(group, output_lists, inputs, op: str = "all_gather") -> Call:
    """The signature: the dtype and every rank's size (the output list, which
    every rank passes alike; this rank's own slot has its input's size), and
    as pairs what this rank sends each rank (its input) and expects from it
    (its list), for the message that says which sizes do not fit."""
    input, outputs = _check_all_gather(group, op, output_lists, inputs)
    counts = tuple(t.numel() for t in outputs)
    return Call(Signature(op, ((input.dtype, counts),), (), (tuple([input.numel()] * group.size), counts)))


def _gather_list(group, input, outputs, output_lists):
    """all_gather's plan: received in place when the outputs are laid end to
    end in one storage, else into one buffer then copied out; no nonblocking
    form (the op's declaration)."""
    counts = [t.numel() for t in outputs]
    recv, after = staging.split(outputs, counts, input)
    offset = sum(counts[:group.rank]) * input.element_size()
    return allgather(group, input, recv, _mpi.buffer(recv), offset, counts, output_lists, after)


def plan_all_gather(group, call: Call, args):
    output_lists, inputs = args
    return _gather_list(group, inputs[0], output_lists[0], output_lists)


def _nccl_all_gather(b, a, o, options):
    return b.allgather(a[0], a[1], options("allgather", o))


def check_all_gather_coalesced(group, output_lists, inputs, op: str = "all_gather_coalesced") -> Call:
    """``dist.all_gather_coalesced``: several inputs gathered at once.  torch's
    layout (as gloo reads it): ``output_lists[r][i]`` receives rank r's
    ``inputs[i]``; each input i is all_gather's checks on its column."""
    checks.check_list(group, op, inputs, len(inputs) if isinstance(inputs, (list, tuple)) else 0, "input_tensor_list")
    checks.check_list(group, op, output_lists, group.size, "output_tensor_lists")
    for r, outs in enumerate(output_lists):
        checks.check_list(group, op, outs, len(inputs), f"output_tensor_lists[{r}]")
    tensors = []
    for i, inp in enumerate(inputs):
        input, outputs = _check_all_gather(group, op, [[outs[i] for outs in output_lists]], [inp])
        tensors.append((input.dtype, tuple(t.numel() for t in outputs)))
    return Call(Signature(op, tuple(tensors)))


def plan_all_gather_coalesced(group, call: Call, args):
    output_lists, inputs = args
    return sequence([_gather_list(group, inp, [outs[i] for outs in output_lists], output_lists)
                     for i, inp in enumerate(inputs)], output_lists)


def _nccl_all_gather_coalesced(b, a, o, options):
    return b.allgather_coalesced(a[0], a[1], options("allgather", o))


# ----------------------------------------------------------------------------
# gather and gather_single (torch >= 2.14)
# ----------------------------------------------------------------------------

def check_gather(group, output_lists, inputs, root: int, op: str = "gather") -> Call:
    """One input; at the root a list of one output per rank of the input's
    size (gather needs one size on every rank), elsewhere none."""
    input = checks.single(group, op, inputs, "input_tensors", "input")
    outputs = checks.rooted(group, op, root, "dst", output_lists, "output_tensor_lists", "gather_list", input,
                            "the input", "gather needs tensors of one size on every rank")
    return Call(Signature(op, ((input.dtype, input.numel()),), (("root", root),)), outputs is not None)


def plan_gather(group, call: Call, args):
    """gather's plan: MPI_Gatherv to ``root``, received in place when the
    root's list is laid end to end in one storage; past the count limit,
    chunked messages."""
    output_lists, inputs, root = args
    input = inputs[0]
    if not call.facts:  # not the root: its input to the root
        return _gather_send(group, input, root, output_lists)
    return _gather_recv(group, input, root, output_lists[0], output_lists)


def _nccl_gather(b, a, o, options):
    return b.gather(a[0], a[1], options("gather", o, rootRank=a[2]))


def check_gather_single(group, output, input, root: int, op: str = "gather_single") -> Call:
    """``dist.gather_single``: every rank's ``input`` into one flat ``output``
    on ``root`` (the group size times the input's elements there); the
    non-roots' ``output`` is ignored (torch passes an empty placeholder)."""
    checks.check_tensor(group, op, input, "input")
    checks.check_root(group, op, root, "dst")
    if group.rank == root:
        checks.check_pair(group, op, output, input, "output")
    return Call(Signature(op, ((input.dtype, input.numel()),), (("root", root),)))


def plan_gather_single(group, call: Call, args):
    """gather_single's plan: received in place when the output is contiguous."""
    output, input, root = args
    if group.rank != root:
        return _gather_send(group, input, root, [output])
    if output.is_contiguous():
        out, write_back = output, None
    else:
        out, write_back = staging.copy_out(output)
    flat, n = out.view(-1), input.numel()
    parts = [flat[r * n:(r + 1) * n] for r in range(group.size)]  # views laid end to end: received in place
    return _gather_recv(group, input, root, parts, [output], write_back)


def _nccl_gather_single(b, a, o, options):
    # (torch's NCCL group has no gather_single: a gather into the rows of the contiguous output)
    rows = [list(a[0].reshape(b.size(), -1).unbind(0))] if b.rank() == a[2] else []
    return b.gather(rows, [a[1]], options("gather", o, rootRank=a[2]))


def _gather_send(group, input, root, outputs):
    """A non-root's part of gather: its input to ``root``."""
    comm, limit = group.comm, group.max_count
    if input.is_contiguous():
        send, before = input, None
    else:
        send, before = staging.copy_in(input)
    n = input.numel()

    def run():
        if n * group.size > limit:  # the root decides the same way
            for off, k in staging.chunks(n, limit):
                comm.Send(_mpi.buffer(send, off, k), dest=root, tag=0)
        else:
            comm.Gatherv(_mpi.buffer(send), None, root=root)

    return (run, (), None, outputs, (input, send), before, None, n * input.element_size())


def _gather_recv(group, input, root, outputs, result, write_back=None):
    """The root's part of gather: every rank's input into ``outputs`` (then ``write_back``)."""
    comm, limit = group.comm, group.max_count
    if input.is_contiguous():
        send, before = input, None
    else:
        send, before = staging.copy_in(input)
    counts = [t.numel() for t in outputs]
    recv, copy_out = staging.split(outputs, counts, input, send)
    displs = _displs(counts)

    def run():
        if sum(counts) > limit:
            recv[displs[root]:displs[root] + counts[root]].copy_(send.view(-1))
            for r in range(group.size):
                if r != root:
                    for off, k in staging.chunks(counts[r], limit):
                        comm.Recv(_mpi.buffer(recv, displs[r] + off, k), source=r, tag=0)
        else:
            spec = _mpi.buffer(recv)
            spec[1] = (counts, displs)
            comm.Gatherv(_mpi.buffer(send), spec, root=root)

    return (run, (), None, result, (input, outputs, send, recv), before, steps(copy_out, write_back),
            input.numel() * input.element_size())


# ----------------------------------------------------------------------------
# the declarations
# ----------------------------------------------------------------------------

ALL_GATHER_INTO_TENSOR = Op(
    "all_gather_into_tensor", methods=("all_gather_single",), legacy=("_allgather_base",),
    key=all_gather_into_tensor_key, check=check_all_gather_into_tensor, plan=plan_all_gather_into_tensor,
    bind=bind_all_gather_into_tensor, nonblocking=True, slot="output", nccl=_nccl_all_gather_into_tensor,
    cupy=_cupy_all_gather_into_tensor,
    recorded_as="_all_gather_base")
ALL_GATHER_INTO_TENSOR_COALESCED = Op(
    "all_gather_into_tensor_coalesced", methods=("all_gather_single_coalesced",),
    legacy=("allgather_into_tensor_coalesced",), check=check_all_gather_into_tensor_coalesced,
    plan=plan_all_gather_into_tensor_coalesced, nccl=_nccl_all_gather_into_tensor_coalesced)
ALL_GATHER = Op(
    "all_gather", methods=("allgather",), check=check_all_gather, plan=plan_all_gather,
    nccl=_nccl_all_gather, stacked=(False, True))
ALL_GATHER_COALESCED = Op(
    "all_gather_coalesced", methods=("allgather_coalesced",), check=check_all_gather_coalesced,
    plan=plan_all_gather_coalesced, nccl=_nccl_all_gather_coalesced, recorded_as="ALLGATHER_coalesced")
GATHER = Op(
    "gather", methods=("gather",), check=check_gather, plan=plan_gather,
    nccl=_nccl_gather)
GATHER_SINGLE = Op(
    "gather_single", methods=("gather_single",), check=check_gather_single,
    plan=plan_gather_single, nccl=_nccl_gather_single, recorded_as="gather")

OPS = (ALL_GATHER_INTO_TENSOR, ALL_GATHER_INTO_TENSOR_COALESCED, ALL_GATHER, ALL_GATHER_COALESCED, GATHER,
       GATHER_SINGLE)
