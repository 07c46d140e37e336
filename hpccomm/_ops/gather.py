"""Gathers: all_gather (lists, equal or different sizes), all_gather_into_tensor,
gather, gather_single, and the coalesced forms.

Each function here is one op's plan function (see :mod:`hpccomm._ops.plan`).
"""
from __future__ import annotations

import itertools

import torch

from .. import _mpi
from . import checks, staging
from .plan import sequence, steps, with_steps


def _displs(counts):
    return [0, *itertools.accumulate(counts)][:-1]


def allgatherv(group, send: torch.Tensor, recv: torch.Tensor, counts):
    """``(call, args)`` of the Allgather(v) of contiguous ``send`` into
    contiguous ``recv`` (any shape) laid out by ``counts``: ``send`` is the
    rank's own slot of ``recv`` (in place) or apart from it.  Past the count
    limit ``call`` is a function in which every rank broadcasts its part,
    chunked (``args`` empty)."""
    comm = group.comm
    in_place = send.numel() > 0 and send.data_ptr() == recv.data_ptr() + sum(counts[:group.rank]) * recv.element_size()
    if max(counts, default=0) > group.max_count or sum(counts) > group.max_count:
        displs = _displs(counts)
        flat = recv.view(-1)

        def run():
            if not in_place:
                flat[displs[group.rank]:displs[group.rank] + counts[group.rank]].copy_(send.view(-1))
            for r in range(group.size):
                for off, n in staging.chunks(counts[r], group.max_count):
                    comm.Bcast(_mpi.buffer(flat, displs[r] + off, n), root=r)

        return run, ()
    sendbuf = _mpi.IN_PLACE if in_place else _mpi.buffer(send)
    dtype = _mpi.mpi_type(recv.dtype)
    mem = _mpi.buffer(recv)[0]
    if len(set(counts)) <= 1:
        return comm.Allgather, (sendbuf, [mem, counts[0] if counts else 0, dtype])
    return comm.Allgatherv, (sendbuf, [mem, (counts, _displs(counts)), dtype])


def all_gather_into_tensor(group, output, input, op: str = "all_gather_into_tensor"):
    """all_gather_into_tensor's plan: MPI writes the output in place; the
    input is read in place too when it is this rank's slot of the output
    (MPI_IN_PLACE: FSDP's layout) or apart from it, and through a copy when it
    overlaps the output elsewhere (MPI forbids aliased buffers) or is strided."""
    checks.check_pair(group, op, output, input, "output")
    n = input.numel()
    comm = group.comm
    if group.host and output.is_contiguous() and input.is_contiguous():  # the common case: on the user's memory
        send, recv = _mpi.host_buffer(input), _mpi.host_buffer(output)
        if recv[1] <= group.max_count:
            before, keep = None, (input, output)
            mem = send[0]
            nbytes = mem.nbytes
            if n and mem.address == recv[0].address + group.rank * nbytes:
                send = _mpi.IN_PLACE  # this rank's slot of the output
            elif not staging.disjoint(mem, recv[0]):
                copy, before = staging.copy_apart(input)  # aliased elsewhere than this rank's slot
                send = _mpi.host_buffer(copy)
                keep = (input, output, copy)
            recv[1] = n  # mpi4py counts the receive side per rank
            return with_steps(comm.Allgather, (send, recv), comm.Iallgather, [output], keep, before, None, nbytes)
    out, after = staging.staged_output(output)
    src, before = staging.staged_input(input)
    own = n and before is None and src.data_ptr() == out.data_ptr() + group.rank * n * out.element_size()
    if not own and before is None and staging.overlaps(src, out):
        src, before = staging.copy_apart(input)  # aliased elsewhere than this rank's slot: MPI forbids it
    keep = (input, output, src, out)
    nbytes = n * input.element_size()
    if output.numel() > group.max_count:
        call, args = allgatherv(group, src, out, [n] * group.size)
        return with_steps(call, args, None, [output], keep, before, after, nbytes)
    recv = _mpi.buffer(out)
    recv[1] = n  # mpi4py counts the receive side per rank
    return with_steps(comm.Allgather, (_mpi.IN_PLACE if own else _mpi.buffer(src), recv), comm.Iallgather,
                        [output], keep, before, after, nbytes)


def all_gather(group, output_lists, inputs, op: str = "all_gather"):
    """all_gather's plan (a list of outputs, one per rank, sizes may differ):
    received in place when the outputs are laid end to end in one storage,
    else into one buffer then copied out."""
    input = checks.single(group, op, inputs, "input_tensors", "input")
    outputs = checks.per_rank(group, op, output_lists, "output_tensor_lists", "tensor_list", input)
    if outputs[group.rank].numel() != input.numel():
        raise checks.OpValueError(op, group.where(), f"tensor_list[{group.rank}] (this rank's slot) has "
                             f"{outputs[group.rank].numel()} elements but the input has {input.numel()}")
    counts = [t.numel() for t in outputs]
    send, before = staging.staged_input(input)
    flat = staging.flat_view(outputs)
    if flat is not None and not (before is None and staging.overlaps(send, flat)
                                 and send.data_ptr() != outputs[group.rank].data_ptr()):
        recv, after = flat, None  # the outputs are one buffer: zero-copy
    else:
        recv = input.new_empty(sum(counts))

        def after():
            for t, part in zip(outputs, torch.split(recv, counts)):
                t.copy_(part.view(t.shape))

    call, args = allgatherv(group, send, recv, counts)
    return with_steps(call, args, None, output_lists, (input, outputs, send, recv), before, after,
                        input.numel() * input.element_size())


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
    out, write_back = staging.staged_output(output)
    flat, n = out.view(-1), input.numel()
    parts = [flat[r * n:(r + 1) * n] for r in range(group.size)]  # views laid end to end: received in place
    return _gather_recv(group, input, root, parts, [output], write_back)


def _gather_send(group, input, root, outputs):
    """A non-root's part of gather: its input to ``root``."""
    comm, limit = group.comm, group.max_count
    send, before = staging.staged_input(input)
    n = input.numel()

    def run():
        if n * group.size > limit:  # the root decides the same way
            for off, k in staging.chunks(n, limit):
                comm.Send(_mpi.buffer(send, off, k), dest=root, tag=0)
        else:
            comm.Gatherv(_mpi.buffer(send), None, root=root)

    return with_steps(run, (), None, outputs, (input, send), before, None, n * input.element_size())


def _gather_recv(group, input, root, outputs, result, write_back=None):
    """The root's part of gather: every rank's input into ``outputs`` (then ``write_back``)."""
    comm, limit = group.comm, group.max_count
    send, before = staging.staged_input(input)
    counts = [t.numel() for t in outputs]
    flat = staging.flat_view(outputs)
    direct = flat is not None and not staging.overlaps(send, flat)
    recv = flat if direct else input.new_empty(sum(counts))
    displs = _displs(counts)

    def run():
        if sum(counts) > limit:
            recv[displs[root]:displs[root] + counts[root]].copy_(send.view(-1))
            for r in range(group.size):
                if r != root:
                    for off, k in staging.chunks(counts[r], limit):
                        comm.Recv(_mpi.buffer(recv, displs[r] + off, k), source=r, tag=0)
        else:
            mem = _mpi.buffer(recv)[0]
            comm.Gatherv(_mpi.buffer(send), [mem, (counts, displs), _mpi.mpi_type(recv.dtype)], root=root)

    def after():
        for t, part in zip(outputs, torch.split(recv, counts)):
            t.copy_(part.view(t.shape))

    return with_steps(run, (), None, result, (input, outputs, send, recv), before,
                        steps(None if direct else after, write_back), input.numel() * input.element_size())
