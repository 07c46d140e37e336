"""Gathers: all_gather (lists, equal or different sizes), all_gather_into_tensor,
gather, gather_single, and the coalesced forms.

Each function here is one op's plan function (see :mod:`hpccomm._ops.plan`).
"""
from __future__ import annotations

import itertools

import torch

from .. import _mpi
from . import checks, staging
from .._core.plan import sequence, steps


def _displs(counts):
    return [0, *itertools.accumulate(counts)][:-1]


def own_part(input: torch.Tensor, recv: torch.Tensor, offset: int):
    """``(send, before)``: where MPI reads this rank's part of an all_gather
    into contiguous ``recv``, whose slot for this rank starts ``offset``
    bytes in.  ``send`` None: ``input`` is that slot (MPI_IN_PLACE: FSDP's
    layout); else ``input`` itself when contiguous and apart from ``recv``,
    or a copy that ``before`` makes (strided, or aliased elsewhere in
    ``recv``: MPI forbids aliased buffers)."""
    if input.is_contiguous() and input.nbytes and input.data_ptr() == recv.data_ptr() + offset:
        return None, None
    return staging.apart(input, recv)


def allgatherv(group, send, recv: torch.Tensor, counts):
    """``(call, args, icall)`` of the Allgather(v) of ``send`` (a contiguous
    tensor apart from ``recv``, or None: this rank's part is already in its
    slot) into contiguous ``recv`` (any shape) laid out by ``counts``;
    ``icall`` its nonblocking form (equal counts only, else None).  Past the
    count limit ``call`` is a function in which every rank broadcasts its
    part, chunked (``args`` empty, no nonblocking form)."""
    comm = group.comm
    if sum(counts) > group.max_count:
        displs = _displs(counts)
        flat = recv.view(-1)

        def run():
            if send is not None:
                flat[displs[group.rank]:displs[group.rank] + counts[group.rank]].copy_(send.view(-1))
            for r in range(group.size):
                for off, n in staging.chunks(counts[r], group.max_count):
                    comm.Bcast(_mpi.buffer(flat, displs[r] + off, n), root=r)

        return run, (), None
    sendbuf = _mpi.IN_PLACE if send is None else _mpi.buffer(send)
    recvbuf = _mpi.buffer(recv)
    if len(set(counts)) <= 1:
        recvbuf[1] = counts[0] if counts else 0  # mpi4py counts the receive side per rank
        return comm.Allgather, (sendbuf, recvbuf), comm.Iallgather
    recvbuf[1] = (counts, _displs(counts))
    return comm.Allgatherv, (sendbuf, recvbuf), None


def all_gather_into_tensor(group, output, input, op: str = "all_gather_into_tensor"):
    """all_gather_into_tensor's plan: MPI writes the output in place; the
    input is read in place too when it is this rank's slot of the output
    (MPI_IN_PLACE: FSDP's layout) or apart from it, and through a copy when it
    overlaps the output elsewhere (MPI forbids aliased buffers) or is strided."""
    checks.check_pair(group, op, output, input, "output")
    n = input.numel()
    out, after = staging.staged_output(output)
    send, before = own_part(input, out, group.rank * input.nbytes)
    call, args, icall = allgatherv(group, send, out, [n] * group.size)
    return (call, args, icall, [output], (input, output, send, out), before, after,
            n * input.element_size())


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
    recv, after = staging.split(outputs, counts, input)
    send, before = own_part(input, recv, sum(counts[:group.rank]) * input.element_size())
    call, args, _ = allgatherv(group, send, recv, counts)  # (all_gather has no nonblocking form: hpccomm._ops.table)
    return (call, args, None, output_lists, (input, outputs, send, recv), before, after,
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

    return (run, (), None, outputs, (input, send), before, None, n * input.element_size())


def _gather_recv(group, input, root, outputs, result, write_back=None):
    """The root's part of gather: every rank's input into ``outputs`` (then ``write_back``)."""
    comm, limit = group.comm, group.max_count
    send, before = staging.staged_input(input)
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
