"""Reductions: all_reduce, reduce, reduce_scatter and their coalesced forms.

AVG and PREMUL_SUM reduce with SUM plus a local step (divide after, multiply
before), as NCCL does; float16/bfloat16 reduce through a user-defined MPI op
that computes in that dtype (see ``_mpi.DTYPES``).

Like every op module, each op checks its arguments and returns ``run``, a
function that communicates and returns the outputs; the caller decides which
thread runs it.
"""
from __future__ import annotations

import torch

from .. import _mpi
from .._compat import RedOpType
from . import _common as c

_R = RedOpType
_FLATTEN_BYTES = 1 << 18  # coalesced ops below this total go as one message
# Open MPI's allreduce allocates scratch memory of up to half the message (a 1 GiB
# float32 all_reduce peaked at 1.5x the tensor above baseline, raw mpi4py as well):
# messages past this size go in pieces of it, which bounds that scratch (to 0.03x
# at 1 GiB) at no measurable cost in bandwidth (each piece is itself bandwidth-bound).
_ALLREDUCE_PIECE_BYTES = 64 << 20


def _allreduce_flat(group, t: torch.Tensor, mop) -> None:
    """In-place MPI_Allreduce over contiguous ``t``, in pieces past the count
    limit or past ``_ALLREDUCE_PIECE_BYTES``."""
    comm, IN_PLACE, count = group.comm, _mpi.in_place(), t.numel()
    limit = min(group.max_count, max(_ALLREDUCE_PIECE_BYTES // t.element_size(), 1))
    if count <= limit:  # the common case, without the chunk generator
        comm.Allreduce(IN_PLACE, _mpi.buffer(t, 0, count), op=mop)
        return
    for off, n in c.chunks(count, limit):
        comm.Allreduce(IN_PLACE, _mpi.buffer(t, off, n), op=mop)


def allreduce(group, tensors, redop, op: str = "all_reduce"):
    c.check_list(group, op, tensors, 1, "tensors")
    t = tensors[0]
    c.check_tensor(group, op, t)
    kind, factor = c.reduce_op(group, op, t.dtype, redop)

    def run():
        work = c.contiguous(t)
        if factor is not None:
            c.premultiplied(work, factor, inplace=True)
        _allreduce_flat(group, work, _mpi.mpi_op(t.dtype, kind))
        if kind == _R.AVG:
            c.finish_average(work, group.size)
        c.write_back(t, work)
        return tensors

    return run


def allreduce_coalesced(group, tensors, redop, op: str = "all_reduce_coalesced"):
    if not isinstance(tensors, (list, tuple)):
        c.check_list(group, op, tensors, 0, "tensors")
    c.check_tensors(group, op, tensors)
    for t in tensors:  # every check before the first message
        c.reduce_op(group, op, t.dtype, redop)

    def run():
        # Small tensors of one dtype travel as one message: one latency, not many.
        by_dtype: dict = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for ts in by_dtype.values():
            if len(ts) > 1 and sum(t.numel() for t in ts) * ts[0].element_size() <= _FLATTEN_BYTES:
                flat = torch.cat([t.reshape(-1) for t in ts])
                allreduce(group, [flat], redop, op)()
                off = 0
                for t in ts:
                    t.copy_(flat[off:off + t.numel()].view(t.shape))
                    off += t.numel()
            else:
                for t in ts:
                    allreduce(group, [t], redop, op)()
        return tensors

    return run


def reduce(group, tensors, root: int, redop, op: str = "reduce"):
    c.check_list(group, op, tensors, 1, "tensors")
    t = tensors[0]
    c.check_tensor(group, op, t)
    c.check_root(group, op, root, "dst")
    kind, factor = c.reduce_op(group, op, t.dtype, redop)

    def run():
        mop = _mpi.mpi_op(t.dtype, kind)
        comm = group.comm
        if group.rank == root:
            work = c.contiguous(t)
            if factor is not None:
                c.premultiplied(work, factor, inplace=True)
            for off, n in c.chunks(work.numel(), group.max_count):
                comm.Reduce(_mpi.in_place(), _mpi.buffer(work, off, n), op=mop, root=root)
            if kind == _R.AVG:
                c.finish_average(work, group.size)
            c.write_back(t, work)
        else:
            # Only the root's tensor is an output: leave this rank's untouched.
            send = c.premultiplied(t, factor, inplace=False) if factor is not None else c.contiguous(t)
            for off, n in c.chunks(send.numel(), group.max_count):
                comm.Reduce(_mpi.buffer(send, off, n), None, op=mop, root=root)
        return tensors

    return run


def _reduce_scatter_flat(group, send: torch.Tensor, out: torch.Tensor, mop) -> None:
    """MPI_Reduce_scatter_block of contiguous ``send`` (size × n) into ``out`` (n)."""
    comm, n = group.comm, out.numel()
    if n <= group.max_count:
        sendspec = _mpi.buffer(send)
        sendspec[1] = n  # mpi4py counts the send side per block
        comm.Reduce_scatter_block(sendspec, _mpi.buffer(out), op=mop)
        return
    # Past the count limit: one chunked reduce per destination rank.
    for r in range(group.size):
        for off, k in c.chunks(n, group.max_count):
            recv = _mpi.buffer(out, off, k) if r == group.rank else None
            comm.Reduce(_mpi.buffer(send, r * n + off, k), recv, op=mop, root=r)


def _finish_reduce_scatter(group, out, kind, user_out):
    if kind == _R.AVG:
        c.finish_average(out, group.size)
    c.write_back(user_out, out)


def reduce_scatter_single(group, output, input, redop, op: str = "reduce_scatter_tensor"):
    c.check_tensor(group, op, output, "output")
    c.check_tensor(group, op, input, "input")
    if input.dtype != output.dtype:
        raise c.OpTypeError(op, group.where(), f"input has dtype {input.dtype} but output has {output.dtype}")
    if input.numel() != output.numel() * group.size:
        raise c.OpValueError(op, group.where(), f"input has {input.numel()} elements, expected output's "
                             f"{output.numel()} × group size {group.size} = {output.numel() * group.size}")
    kind, factor = c.reduce_op(group, op, input.dtype, redop)

    def run():
        send = c.premultiplied(input, factor, inplace=False) if factor is not None else c.contiguous(input)
        if c.overlaps(send, output):
            send = send.clone()  # MPI forbids aliased send and receive buffers
        out = c.out_buffer(output)
        _reduce_scatter_flat(group, send, out, _mpi.mpi_op(input.dtype, kind))
        _finish_reduce_scatter(group, out, kind, output)
        return [output]

    return run


def reduce_scatter(group, outputs, input_lists, redop, op: str = "reduce_scatter"):
    c.check_list(group, op, outputs, 1, "output_tensors")
    c.check_list(group, op, input_lists, 1, "input_tensor_lists")
    output, inputs = outputs[0], input_lists[0]
    c.check_tensor(group, op, output, "output")
    c.check_list(group, op, inputs, group.size, "input_list")
    c.check_tensors(group, op, inputs, "input_list")
    c.check_same_dtype(group, op, inputs, output.dtype, "input_list")
    for i, t in enumerate(inputs):
        if t.numel() != output.numel():
            raise c.OpValueError(op, group.where(), f"input_list[{i}] has {t.numel()} elements but output has "
                                 f"{output.numel()}", "Every input must have the output's size")
    kind, factor = c.reduce_op(group, op, output.dtype, redop)

    def run():
        send = c.flat_view(inputs)
        if send is None or factor is not None or c.overlaps(send, output):
            send = torch.cat([t.reshape(-1) for t in inputs])
            if factor is not None:
                c.premultiplied(send, factor, inplace=True)
        out = c.out_buffer(output)
        _reduce_scatter_flat(group, send, out, _mpi.mpi_op(output.dtype, kind))
        _finish_reduce_scatter(group, out, kind, output)
        return outputs

    return run


def reduce_scatter_single_coalesced(group, outputs, inputs, redop, op: str = "reduce_scatter_tensor_coalesced"):
    c.check_list(group, op, inputs, len(outputs), "inputs")
    runs = [reduce_scatter_single(group, o, i, redop, op) for o, i in zip(outputs, inputs)]

    def run():
        for r in runs:
            r()
        return outputs

    return run
