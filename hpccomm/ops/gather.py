"""Gathers: all_gather (lists, equal or different sizes), all_gather_into_tensor
(``all_gather_single``), gather, and the coalesced forms."""
from __future__ import annotations

import itertools
from functools import partial as _partial

import torch

from .. import _mpi
from . import _common as c

_Tensor = torch.Tensor
_STRIDED = torch.strided


def _displs(counts):
    return [0, *itertools.accumulate(counts)][:-1]


def _allgatherv(group, send: torch.Tensor, recv: torch.Tensor, counts) -> None:
    """Allgather(v) of contiguous ``send`` into contiguous ``recv`` (any shape)
    laid out by ``counts``; ``send`` may be the rank's own slot of ``recv`` (in
    place), or overlap it elsewhere (then MPI reads a copy: it forbids aliased
    buffers)."""
    if group.host:  # the common case first, from the two buffers alone: equal counts, within the limit
        sb, rb = _mpi.host_buffer(send), _mpi.host_buffer(recv)
        n, mem = sb[1], sb[0]
        if n and rb[1] <= group.max_count and counts.count(n) == group.size == len(counts):
            if mem.address == rb[0].address + group.rank * mem.nbytes:
                sb = _mpi.IN_PLACE  # this rank's slot of the output
            elif not c.disjoint(mem, rb[0]):
                # aliased elsewhere than this rank's slot: MPI reads a copy, held in ``send``
                # until the call returns (a buffer holds an address, not the tensor)
                send = send.clone()
                sb = _mpi.host_buffer(send)
            rb[1] = n  # mpi4py counts the receive side per rank
            group.comm.Allgather(sb, rb)
            return
    comm, MPI = group.comm, _mpi.mpi()
    in_place = send.numel() > 0 and send.data_ptr() == recv.data_ptr() + sum(counts[:group.rank]) * recv.element_size()
    if max(counts, default=0) > group.max_count or sum(counts) > group.max_count:
        # Past the count limit: every rank broadcasts its part, chunked.
        displs = _displs(counts)
        recv = recv.view(-1)
        if not in_place:
            recv[displs[group.rank]:displs[group.rank] + counts[group.rank]].copy_(send.view(-1))
        for r in range(group.size):
            for off, n in c.chunks(counts[r], group.max_count):
                comm.Bcast(_mpi.buffer(recv, displs[r] + off, n), root=r)
        return
    sendbuf = MPI.IN_PLACE if in_place else _mpi.buffer(send)
    dtype = _mpi.mpi_type(recv.dtype)
    mem = _mpi.buffer(recv)[0]
    if len(set(counts)) <= 1:
        comm.Allgather(sendbuf, [mem, counts[0] if counts else 0, dtype])
    else:
        comm.Allgatherv(sendbuf, [mem, (counts, _displs(counts)), dtype])


def all_gather_single(group, output, input, op: str = "all_gather_into_tensor"):
    c.check_tensor(group, op, output, "output")
    c.check_tensor(group, op, input, "input")
    if input.dtype != output.dtype:
        raise c.OpTypeError(op, group.where(), f"input has dtype {input.dtype} but output has {output.dtype}")
    if output.numel() != input.numel() * group.size:
        raise c.OpValueError(op, group.where(), f"output has {output.numel()} elements, expected input's "
                             f"{input.numel()} × group size {group.size} = {input.numel() * group.size}")

    def run():
        if group.host and output.is_contiguous() and input.is_contiguous():
            # The common case (latency-bound when small): MPI reads the input and writes the
            # output in place (_allgatherv tells in place, disjoint and aliased apart).
            _allgatherv(group, input, output, [input.numel()] * group.size)
            return [output]
        out = c.out_buffer(output)
        send = c.contiguous(input)
        n = send.numel()
        own = out.numel() and send.data_ptr() == out.data_ptr() + group.rank * n * out.element_size()
        if not own and c.overlaps(send, out):
            send = send.clone()  # aliased elsewhere than this rank's slot: MPI forbids it
        _allgatherv(group, send, out, [n] * group.size)  # contiguous: MPI needs no 1-D view
        c.write_back(output, out)
        return [output]

    return run


def allgather(group, output_lists, inputs, op: str = "all_gather"):
    c.check_list(group, op, inputs, 1, "input_tensors")
    c.check_list(group, op, output_lists, 1, "output_tensor_lists")
    input, outputs = inputs[0], output_lists[0]
    c.check_tensor(group, op, input, "input")
    c.check_list(group, op, outputs, group.size, "tensor_list")
    c.check_tensors(group, op, outputs, "tensor_list")
    c.check_same_dtype(group, op, outputs, input.dtype, "tensor_list")
    if outputs[group.rank].numel() != input.numel():
        raise c.OpValueError(op, group.where(), f"tensor_list[{group.rank}] (this rank's slot) has "
                             f"{outputs[group.rank].numel()} elements but the input has {input.numel()}")

    def run():
        counts = [t.numel() for t in outputs]
        send = c.contiguous(input)
        flat = c.flat_view(outputs)
        if flat is not None and not (c.overlaps(send, flat) and send.data_ptr() != outputs[group.rank].data_ptr()):
            _allgatherv(group, send, flat, counts)  # the outputs are one buffer: zero-copy
            return output_lists
        recv = torch.empty(sum(counts), dtype=input.dtype, device=input.device)
        _allgatherv(group, send, recv, counts)
        for t, part in zip(outputs, torch.split(recv, counts)):
            t.copy_(part.view(t.shape))
        return output_lists

    return run


def allgather_coalesced(group, output_lists, inputs, op: str = "all_gather_coalesced"):
    """``dist.all_gather_coalesced``: several inputs gathered at once.  torch's
    layout (as gloo reads it): ``output_lists[r][i]`` receives rank r's
    ``inputs[i]``."""
    c.check_list(group, op, inputs, len(inputs), "input_tensor_list")
    c.check_list(group, op, output_lists, group.size, "output_tensor_lists")
    for r, outs in enumerate(output_lists):
        c.check_list(group, op, outs, len(inputs), f"output_tensor_lists[{r}]")
    runs = [allgather(group, [[outs[i] for outs in output_lists]], [inp], op) for i, inp in enumerate(inputs)]

    def run():
        for r in runs:
            r()
        return output_lists

    return run


def all_gather_single_coalesced(group, outputs, inputs, op: str = "all_gather_into_tensor_coalesced"):
    c.check_list(group, op, inputs, len(outputs), "inputs")
    runs = [all_gather_single(group, o, i, op) for o, i in zip(outputs, inputs)]

    def run():
        for r in runs:
            r()
        return outputs

    return run


def gather(group, output_lists, inputs, root: int, op: str = "gather"):
    c.check_list(group, op, inputs, 1, "input_tensors")
    input = inputs[0]
    c.check_tensor(group, op, input, "input")
    c.check_root(group, op, root, "dst")
    if group.rank != root:
        if output_lists and any(len(o) for o in output_lists):
            raise c.OpValueError(op, group.where(), f"gather_list must be empty or None on rank {group.rank}, "
                                 f"which is not the destination (rank {root})")
        return lambda: _gather_send(group, input, root, output_lists)
    c.check_list(group, op, output_lists, 1, "output_tensor_lists")
    outputs = output_lists[0]
    c.check_list(group, op, outputs, group.size, "gather_list")
    c.check_tensors(group, op, outputs, "gather_list")
    c.check_same_dtype(group, op, outputs, input.dtype, "gather_list")
    for i, t in enumerate(outputs):
        if t.numel() != input.numel():
            raise c.OpValueError(op, group.where(), f"gather_list[{i}] has {t.numel()} elements but the input "
                                 f"has {input.numel()}", "gather needs tensors of one size on every rank")
    return lambda: _gather_recv(group, input, root, outputs, output_lists)


def gather_single(group, output, input, root: int, op: str = "gather_single"):
    """``dist.gather_single`` (torch >= 2.14): every rank's ``input`` into one
    flat ``output`` on ``root`` (group rank order), received in place when the
    output is contiguous.  Non-roots' ``output`` is ignored (torch passes an
    empty placeholder)."""
    c.check_tensor(group, op, input, "input")
    c.check_root(group, op, root, "dst")
    if group.rank != root:
        return lambda: _gather_send(group, input, root, [output])
    c.check_tensor(group, op, output, "output")
    if input.dtype != output.dtype:
        raise c.OpTypeError(op, group.where(), f"input has dtype {input.dtype} but output has {output.dtype}")
    if output.numel() != input.numel() * group.size:
        raise c.OpValueError(op, group.where(), f"output has {output.numel()} elements, expected input's "
                             f"{input.numel()} × group size {group.size} = {input.numel() * group.size}")

    def run():
        out = c.out_buffer(output)
        flat, n = out.view(-1), input.numel()
        parts = [flat[r * n:(r + 1) * n] for r in range(group.size)]  # views laid end to end: received in place
        _gather_recv(group, input, root, parts, None)
        c.write_back(output, out)
        return [output]

    return run


def _gather_send(group, input, root, output_lists):
    comm = group.comm
    send = c.contiguous(input)
    n = send.numel()
    if n * group.size > group.max_count:  # the root decides the same way
        for off, k in c.chunks(n, group.max_count):
            comm.Send(_mpi.buffer(send, off, k), dest=root, tag=0)
    else:
        comm.Gatherv(_mpi.buffer(send), None, root=root)
    return output_lists


def _gather_recv(group, input, root, outputs, output_lists):
    comm = group.comm
    send = c.contiguous(input)
    counts = [t.numel() for t in outputs]
    flat = c.flat_view(outputs)
    direct = flat is not None and not c.overlaps(send, flat)
    recv = flat if direct else torch.empty(sum(counts), dtype=input.dtype, device=input.device)
    displs = _displs(counts)
    if sum(counts) > group.max_count:
        recv[displs[root]:displs[root] + counts[root]].copy_(send)
        for r in range(group.size):
            if r != root:
                for off, k in c.chunks(counts[r], group.max_count):
                    comm.Recv(_mpi.buffer(recv, displs[r] + off, k), source=r, tag=0)
    else:
        mem = _mpi.buffer(recv)[0]
        comm.Gatherv(_mpi.buffer(send), [mem, (counts, displs), _mpi.mpi_type(recv.dtype)], root=root)
    if recv is not flat:
        for t, part in zip(outputs, torch.split(recv, counts)):
            t.copy_(part.view(t.shape))
    return output_lists


def plain_buffers(group, output, input):
    """all_gather_into_tensor's plain case, either form (this module's
    :func:`iall_gather_single`, hpccomm._runner.run_all_gather_single): dense
    contiguous CPU tensors of one dtype hpccomm has moved before
    (_mpi.host_types), within the count limit, the input this rank's slot of
    the output or apart from it: ``(send, receive, bytes of the input)``, the
    MPI buffers on the tensors' memory (all_gather_single's checks and
    _mpi.host_buffer without their calls); else None (the general case)."""
    if (output.__class__ is _Tensor and input.__class__ is _Tensor and output.layout is _STRIDED
            and input.layout is _STRIDED and output.is_cpu and input.is_cpu and output.dtype is input.dtype
            and output.is_contiguous() and input.is_contiguous()):
        kind = _mpi.host_types.get(input.dtype)
        n = input.numel()
        total = output.numel()
        if kind is not None and n and total == n * group.size and total <= group.max_count:
            size = kind[1]
            at, into = input.data_ptr(), output.data_ptr()
            if at == into + group.rank * n * size:
                send = _mpi.IN_PLACE
            elif at + n * size <= into or into + total * size <= at:
                send = [_mpi.fromaddress(at, n * size), n, kind[0]]
            else:
                return None  # aliased elsewhere than this rank's slot: the general case copies it
            return send, [_mpi.fromaddress(into, total * size), n, kind[0]], n * size  # received per rank
    return None


def iall_gather_single(group, output, input, op: str = "all_gather_into_tensor"):
    """all_gather_into_tensor's nonblocking form (MPI_Iallgather), checks
    included (:func:`all_gather_single`'s), or None past the size limits (see
    hpccomm.ops.reduce's note on nonblocking forms)."""
    plain = plain_buffers(group, output, input)
    if plain is not None and plain[2] <= c.NONBLOCKING_MAX_BYTES:
        return c.Posted(op, _partial(group.comm.Iallgather, plain[0], plain[1]), [output], (input, output), None,
                        plain[2] * group.size)
    all_gather_single(group, output, input, op)  # its checks (the blocking closure it returns is not used)
    if output.numel() > group.max_count or input.numel() * input.element_size() > c.NONBLOCKING_MAX_BYTES:
        return None
    out = c.out_buffer(output)
    send = c.contiguous(input)
    n = send.numel()
    size = out.element_size()
    own = n and send.data_ptr() == out.data_ptr() + group.rank * n * size
    if not own and c.overlaps(send, out):
        send = send.clone()  # aliased elsewhere than this rank's slot: MPI forbids it
    recv = _mpi.host_buffer(out)
    recv[1] = n  # mpi4py counts the receive side per rank
    sendbuf = _mpi.IN_PLACE if own else _mpi.host_buffer(send)
    comm = group.comm
    return c.Posted(op, _partial(comm.Iallgather, sendbuf, recv), [output], (input, output, send, out),
                    None if out is output else (lambda: c.write_back(output, out)), out.numel() * size)
