"""Gathers: all_gather (lists, equal or different sizes), all_gather_into_tensor,
gather, gather_single, and the coalesced forms.

Each function here is one op's plan function (see :mod:`hpccomm._core.plan`).
"""
from __future__ import annotations

import itertools

import torch

from .. import _mpi
from .._core.plan import sequence, steps
from . import checks, staging


def _displs(counts):
    return [0, *itertools.accumulate(counts)][:-1]


def allgather(group, input: torch.Tensor, out: torch.Tensor, recv, offset: int, counts, outputs, after):
    """The plan of the Allgather(v) of this rank's ``input`` into contiguous
    ``out`` (``recv``: its MPI buffer), where this rank's slot starts
    ``offset`` bytes in; ``counts``: every rank's part (elements, laid end to
    end), None for equal parts; ``outputs``, ``after``: the plan's.

    This rank's part is read where it is: MPI_IN_PLACE when ``input`` is its
    slot of ``out`` (FSDP's layout), ``input`` itself when contiguous and
    apart from ``out``, else a copy made by the plan's ``before`` step
    (strided, or aliased elsewhere in ``out``: MPI forbids aliased buffers).
    The nonblocking form is there for equal parts only.  Past the count
    limit every rank broadcasts its part, chunked (no nonblocking form)."""
    mem = recv[0]
    sendbuf = send = before = None
    if input.is_contiguous():
        part = _mpi.buffer(input)
        here = part[0].address
        if part[1] and here == mem.address + offset:
            sendbuf = _mpi.IN_PLACE
        elif not staging.overlap(here, part[0].nbytes, mem.address, mem.nbytes):
            sendbuf, send = part, input
    if sendbuf is None:
        send, before = staging.copy_in(input)
        part = sendbuf = _mpi.buffer(send)
    keep, nbytes = (input, out, send), part[0].nbytes
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


def all_gather_into_tensor(group, output, input, op: str = "all_gather_into_tensor"):
    """all_gather_into_tensor's plan: MPI writes the output in place, and
    reads the input where it is when it can (:func:`allgather`)."""
    checks.check_pair(group, op, output, input, "output")
    if output.is_contiguous():
        out, after = output, None
    else:
        out, after = staging.copy_out(output)
    recv = _mpi.buffer(out)
    return allgather(group, input, out, recv, group.rank * (recv[0].nbytes // group.size), None, [output], after)


def all_gather(group, output_lists, inputs, op: str = "all_gather"):
    """all_gather's plan (a list of outputs, one per rank, sizes may differ):
    received in place when the outputs are laid end to end in one storage,
    else into one buffer then copied out; no nonblocking form (hpccomm._ops.table)."""
    input = checks.single(group, op, inputs, "input_tensors", "input")
    outputs = checks.per_rank(group, op, output_lists, "output_tensor_lists", "tensor_list", input)
    checks.check_own_slot(group, op, outputs, input)
    counts = [t.numel() for t in outputs]
    recv, after = staging.split(outputs, counts, input)
    offset = sum(counts[:group.rank]) * input.element_size()
    return allgather(group, input, recv, _mpi.buffer(recv), offset, counts, output_lists, after)


def all_gather_coalesced(group, output_lists, inputs, op: str = "all_gather_coalesced"):
    """``dist.all_gather_coalesced``: several inputs gathered at once.  torch's
    layout (as gloo reads it): ``output_lists[r][i]`` receives rank r's
    ``inputs[i]``."""
    checks.check_list(group, op, inputs, len(inputs), "input_tensor_list")
    checks.check_list(group, op, output_lists, group.size, "output_tensor_lists")
    for r, outs in enumerate(output_lists):
        checks.check_list(group, op, outs, len(inputs), f"output_tensor_lists[{r}]")
    return sequence([all_gather(group, [[outs[i] for outs in output_lists]], [inp], op)
                       for i, inp in enumerate(inputs)], output_lists)


def all_gather_into_tensor_coalesced(group, outputs, inputs, op: str = "all_gather_into_tensor_coalesced"):
    checks.check_list(group, op, inputs, len(outputs), "inputs")
    return sequence([all_gather_into_tensor(group, o, i, op) for o, i in zip(outputs, inputs)], outputs)


def gather(group, output_lists, inputs, root: int, op: str = "gather"):
    """gather's plan: MPI_Gatherv to ``root``, received in place when the
    root's list is laid end to end in one storage; past the count limit,
    chunked messages."""
    input = checks.single(group, op, inputs, "input_tensors", "input")
    outputs = checks.rooted(group, op, root, "dst", output_lists, "output_tensor_lists", "gather_list", input,
                            "the input", "gather needs tensors of one size on every rank")
    return (_gather_send(group, input, root, output_lists) if outputs is None  # not the root: its input to the root
            else _gather_recv(group, input, root, outputs, output_lists))


def gather_single(group, output, input, root: int, op: str = "gather_single"):
    """``dist.gather_single`` (torch >= 2.14): every rank's ``input`` into one
    flat ``output`` on ``root`` (group rank order), received in place when the
    output is contiguous.  Non-roots' ``output`` is ignored (torch passes an
    empty placeholder)."""
    checks.check_tensor(group, op, input, "input")
    checks.check_root(group, op, root, "dst")
    if group.rank != root:
        return _gather_send(group, input, root, [output])
    checks.check_pair(group, op, output, input, "output")
    if output.is_contiguous():
        out, write_back = output, None
    else:
        out, write_back = staging.copy_out(output)
    flat, n = out.view(-1), input.numel()
    parts = [flat[r * n:(r + 1) * n] for r in range(group.size)]  # views laid end to end: received in place
    return _gather_recv(group, input, root, parts, [output], write_back)


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
