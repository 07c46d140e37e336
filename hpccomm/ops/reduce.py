"""Reductions: all_reduce, reduce, reduce_scatter and their coalesced forms.

AVG and PREMUL_SUM reduce with SUM plus a local step (divide after, multiply
before), as NCCL does; float16/bfloat16 reduce through a user-defined MPI op
that computes in that dtype (see ``_mpi.DTYPES``).

Like every op module, each op checks its arguments and returns ``run``, a
function that communicates and returns the outputs; the caller decides which
thread runs it.
"""
from __future__ import annotations

import math
from functools import partial as _partial

import torch

from .. import _mpi
from .._compat import RedOpType
from ..errors import HpccommError
from . import _common as c

_R = RedOpType
_Tensor = torch.Tensor
_STRIDED = torch.strided
_FLATTEN_BYTES = 1 << 18  # coalesced ops below this total go as one message
# Open MPI's allreduce allocates scratch memory of up to half the message (a 1 GiB
# float32 all_reduce peaked at 1.5x the tensor above baseline, raw mpi4py as well):
# messages past this size go in pieces of it, which bounds that scratch (to 0.03x
# at 1 GiB) at no measurable cost in bandwidth (each piece is itself bandwidth-bound).
_ALLREDUCE_PIECE_BYTES = 64 << 20


def _allreduce_flat(group, t: torch.Tensor, mop, send=None) -> None:
    """MPI_Allreduce into contiguous ``t`` (in place, or from contiguous
    ``send`` of the same size), in pieces past the count limit or past
    ``_ALLREDUCE_PIECE_BYTES``."""
    comm, count = group.comm, t.numel()
    limit = min(group.max_count, max(_ALLREDUCE_PIECE_BYTES // t.element_size(), 1))
    if count <= limit:  # the common case, without the chunk generator
        comm.Allreduce(_mpi.in_place() if send is None else _mpi.buffer(send), _mpi.buffer(t, 0, count), op=mop)
        return
    for off, n in c.chunks(count, limit):
        comm.Allreduce(_mpi.in_place() if send is None else _mpi.buffer(send, off, n), _mpi.buffer(t, off, n),
                       op=mop)


def allreduce(group, tensors, redop, op: str = "all_reduce", sparse: bool = False):
    """``sparse``: take a sparse COO tensor to :func:`allreduce_sparse`
    (torch's allreduce carries DDP's sparse gradients) instead of refusing
    it; learned from the refusal, so a dense tensor pays nothing for it."""
    try:
        t = c.single(group, op, tensors)
    except c.OpTypeError:
        t = tensors[0] if isinstance(tensors, (list, tuple)) and len(tensors) == 1 else None
        if sparse and isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo:
            return allreduce_sparse(group, tensors, redop, op)
        raise
    r = c.reduction(group, op, t.dtype, redop)

    def run():
        mop = r.mop or r.resolve()
        if r.factor is None and group.host and t.is_contiguous():
            # The common case: in place on the user's memory, one MPI call (the blocking
            # path is latency-bound: no helper calls but the buffer's).
            buf = _mpi.host_buffer(t)
            if buf[1] <= group.max_count and buf[0].nbytes <= _ALLREDUCE_PIECE_BYTES:
                group.comm.Allreduce(_mpi.IN_PLACE, buf, op=mop)
                if mop.is_predefined:  # the next such op is the plain case (hpccomm._runner)
                    _remember_plain(t.dtype, redop, r, mop)
            else:
                _allreduce_flat(group, t, mop)
            if r.average:
                c.finish_average(t, group.size)
            return tensors
        work = c.out_buffer(t)
        # PREMUL_SUM scales a copy: should MPI fail, the user's tensor is as it was
        send = c.premultiplied(t, r.factor, inplace=False) if r.factor is not None else None
        if send is None and work is not t:
            work.copy_(t)
        _allreduce_flat(group, work, mop, send)
        if r.average:
            c.finish_average(work, group.size)
        c.write_back(t, work)
        return tensors

    return run


def allreduce_or_sparse(group, tensors, redop, op: str = "all_reduce"):
    """:func:`allreduce`, taking a sparse COO tensor to :func:`allreduce_sparse`
    (torch's allreduce carries DDP's sparse gradients on torch 2.13)."""
    return allreduce(group, tensors, redop, op, True)


def allreduce_coalesced(group, tensors, redop, op: str = "all_reduce_coalesced"):
    if not isinstance(tensors, (list, tuple)):
        c.check_list(group, op, tensors, 0, "tensors")
    c.check_tensors(group, op, tensors)
    for t in tensors:  # every check before the first message
        c.reduction(group, op, t.dtype, redop)

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
    r = c.reduction(group, op, t.dtype, redop)
    factor = r.factor

    def run():
        mop = r.mop or r.resolve()
        comm = group.comm
        if group.rank == root:
            work = c.out_buffer(t)
            # PREMUL_SUM scales a copy: should MPI fail, the user's tensor is as it was
            send = c.premultiplied(t, factor, inplace=False) if factor is not None else None
            if send is None and work is not t:
                work.copy_(t)
            for off, n in c.chunks(work.numel(), group.max_count):
                sendbuf = _mpi.in_place() if send is None else _mpi.buffer(send, off, n)
                comm.Reduce(sendbuf, _mpi.buffer(work, off, n), op=mop, root=root)
            if r.average:
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


def _finish_reduce_scatter(group, out, r, user_out):
    if r.average:
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
    r = c.reduction(group, op, input.dtype, redop)

    def run():
        mop = r.mop or r.resolve()
        if r.factor is None and group.host and input.is_contiguous() and output.is_contiguous():
            # The common case (latency-bound when small): MPI reads the input and writes the output in place.
            send, recv = _mpi.host_buffer(input), _mpi.host_buffer(output)
            n = recv[1]
            if n <= group.max_count and c.disjoint(send[0], recv[0]):
                send[1] = n  # mpi4py counts the send side per block
                group.comm.Reduce_scatter_block(send, recv, op=mop)
                if mop.is_predefined:  # the next such op is the plain case (hpccomm._runner)
                    _remember_plain(input.dtype, redop, r, mop)
                if r.average:
                    c.finish_average(output, group.size)
                return [output]
        send = c.premultiplied(input, r.factor, inplace=False) if r.factor is not None else c.contiguous(input)
        if c.overlaps(send, output):
            send = send.clone()  # MPI forbids aliased send and receive buffers
        out = c.out_buffer(output)
        _reduce_scatter_flat(group, send, out, mop)
        _finish_reduce_scatter(group, out, r, output)
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
    r = c.reduction(group, op, output.dtype, redop)
    factor = r.factor

    def run():
        send = c.flat_view(inputs)
        if send is None or factor is not None or c.overlaps(send, output):
            send = torch.cat([t.reshape(-1) for t in inputs])
            if factor is not None:
                c.premultiplied(send, factor, inplace=True)
        out = c.out_buffer(output)
        _reduce_scatter_flat(group, send, out, r.mop or r.resolve())
        _finish_reduce_scatter(group, out, r, output)
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


def allreduce_sparse(group, tensors, redop, op: str = "all_reduce"):
    """SUM of a sparse COO tensor over the group, as torch's gloo backend does
    it (DDP with ``nn.Embedding(sparse=True)`` needs it): every rank's
    coalesced indices and values are gathered, summed and coalesced; the
    result is copied into the user's tensor (a sparse copy, which takes the
    sum's indices).  Only SUM, as gloo."""
    c.check_list(group, op, tensors, 1, "tensors")
    t = tensors[0]
    if not isinstance(t, torch.Tensor) or t.layout != torch.sparse_coo:
        layout = getattr(t, "layout", type(t).__name__)
        raise c.OpTypeError(op, group.where(), f"a sparse all_reduce needs a sparse COO tensor, got {layout}")
    if t.dtype not in _mpi.DTYPES or _mpi.DTYPES[t.dtype].kind not in ("float", "half", "int", "complex"):
        raise c.OpTypeError(op, group.where(), f"sparse tensors of dtype {t.dtype} cannot be summed")
    if not t.is_cpu:
        raise c.OpTypeError(op, group.where(), f"sparse tensor on {t.device}; sparse all_reduce moves CPU tensors")
    try:
        kind = c.reduce_op_type(redop)
    except AttributeError:
        raise c.OpTypeError(op, group.where(), f"{redop!r} is not a torch.distributed.ReduceOp") from None
    if kind != _R.SUM:
        raise c.OpTypeError(op, group.where(), f"sparse tensors reduce with ReduceOp.SUM only (as gloo), "
                            f"not {str(kind).split('.')[-1]}", "Call .to_dense() first for other ReduceOps")

    def run():
        local = t.coalesce()
        indices = local.indices().contiguous()  # int64 [sparse_dim, nnz]
        values = local.values().contiguous()  # [nnz, *dense sizes]
        facts = group.comm.allgather((tuple(t.shape), t.sparse_dim(), str(t.dtype), local._nnz()))
        shapes = {f[:3] for f in facts}
        if len(shapes) > 1:
            raise HpccommError(f"hpccomm {op} ({group.where()}): the ranks' sparse tensors differ in shape, "
                                 f"sparse dimensions or dtype: {[f[:3] for f in facts]}")
        nnzs = [f[3] for f in facts]
        row = math.prod(values.shape[1:])  # elements per value (1: no dense dimensions)
        all_indices = torch.empty(indices.shape[0], sum(nnzs), dtype=torch.int64)
        all_values = torch.empty((sum(nnzs), *values.shape[1:]), dtype=values.dtype)
        # indices are [sparse_dim, nnz]: gather their transpose so each rank's part is contiguous
        gathered_idx = torch.empty(sum(nnzs), indices.shape[0], dtype=torch.int64)
        from .gather import _allgatherv

        _allgatherv(group, indices.t().contiguous(), gathered_idx, [n * indices.shape[0] for n in nnzs])
        _allgatherv(group, values, all_values, [n * row for n in nnzs])
        all_indices.copy_(gathered_idx.t())
        total = torch.sparse_coo_tensor(all_indices, all_values, t.shape, dtype=t.dtype).coalesce()
        t.copy_(total)
        return tensors

    return run


# -- nonblocking forms (async_op=True; hpccomm._runner) ------------------------
# Each takes the op's arguments after its checks passed and returns a
# c.Posted, or None when the op keeps its blocking form (run on the comm
# thread): past c.NONBLOCKING_MAX_BYTES, or a user-defined MPI op.  Which form
# an op takes is decided only from what is equal on every rank (dtype,
# ReduceOp, element counts), never from strides or timing: MPI never matches a nonblocking collective with a blocking
# one.  A strided tensor is staged through a contiguous buffer instead.

def _predefined(r):
    """The MPI op of ``r`` if MPI predefines it (float16/bfloat16 reduce through
    user-defined ops, which keep the blocking form: MPI would call back into
    Python from whichever thread drives the request's progress)."""
    mop = r.mop or r.resolve()
    return mop if mop.is_predefined else None


#: (dtype, RedOpType value) -> (MPI op, MPI datatype, bytes per element) of the
#: pairs whose all_reduce and reduce_scatter are the plain case (a predefined
#: MPI op, no factor, no division): filled by :func:`allreduce`,
#: :func:`iallreduce` and :func:`ireduce_scatter_single` once a pair has passed
#: its checks, after which a dense contiguous CPU tensor of that pair is posted
#: (or, blocking, reduced: hpccomm._runner.run_allreduce) without asking the
#: checks again.
PLAIN: dict = {}


def _remember_plain(dtype, redop, r, mop) -> None:
    """Enter (``dtype``, ``redop``) in :data:`PLAIN` when its checked
    reduction ``r`` (MPI op ``mop``, predefined) is the plain case and
    :func:`hpccomm._mpi.host_buffer` has met the dtype."""
    kind = _mpi.host_types.get(dtype)
    if kind is not None and r.factor is None and not r.average:
        PLAIN[(dtype, c.redop_code(redop))] = (mop, kind[0], kind[1])


def iallreduce(group, tensors, redop, op: str = "all_reduce"):
    """all_reduce's nonblocking form, checks included: hpccomm._runner calls
    it for ``async_op=True`` in place of :func:`allreduce` (one pass over the
    checks), and falls back to :func:`allreduce` when it returns None (past
    the size limits, a user-defined MPI op) or sees a tensor it does not take
    (a sparse or device tensor, or a refusal: :func:`allreduce` raises it
    with its message)."""
    plain = plain_allreduce_buffer(group, tensors, redop)
    if plain is not None and plain[0][0].nbytes <= c.NONBLOCKING_MAX_BYTES:
        return c.Posted(op, _partial(group.comm.Iallreduce, _mpi.IN_PLACE, plain[0], op=plain[1]), tensors,
                        tensors[0], None, plain[0][0].nbytes)
    try:
        t = c.single(group, op, tensors)
    except c.OpTypeError:
        return None
    r = c.reduction(group, op, t.dtype, redop)
    mop = _predefined(r)
    count, size = t.numel(), t.element_size()
    if mop is None or count > group.max_count or count * size > c.NONBLOCKING_MAX_BYTES:
        return None
    comm = group.comm
    if r.factor is None and t.is_contiguous():
        buf = _mpi.host_buffer(t)
        _remember_plain(t.dtype, redop, r, mop)
        after = (lambda: c.finish_average(t, group.size)) if r.average else None
        return c.Posted(op, _partial(comm.Iallreduce, _mpi.IN_PLACE, buf, op=mop), tensors, t, after, count * size)
    work = c.out_buffer(t)
    # PREMUL_SUM scales a copy: should MPI fail, the user's tensor is as it was
    send = c.premultiplied(t, r.factor, inplace=False) if r.factor is not None else None
    if send is None and work is not t:
        work.copy_(t)

    def after():
        if r.average:
            c.finish_average(work, group.size)
        c.write_back(t, work)

    sendbuf = _mpi.IN_PLACE if send is None else _mpi.buffer(send)
    return c.Posted(op, _partial(comm.Iallreduce, sendbuf, _mpi.buffer(work), op=mop), tensors, (t, work, send),
                    after, count * size)


def plain_allreduce_buffer(group, tensors, redop):
    """all_reduce's plain case, either form (:func:`iallreduce`,
    hpccomm._runner.run_allreduce): one dense contiguous CPU tensor whose
    (dtype, ReduceOp) pair is in :data:`PLAIN`, within the count limit:
    ``([memory, count, MPI type], MPI op)`` on the tensor's memory (c.single's
    checks, the cached reduction and _mpi.host_buffer without their calls);
    else None (the general case)."""
    if tensors.__class__ is list and len(tensors) == 1:
        t = tensors[0]
        if t.__class__ is _Tensor and t.layout is _STRIDED and t.is_cpu:
            plain = PLAIN.get((t.dtype, c.redop_code(redop)))
            if plain is not None and t.is_contiguous():
                count = t.numel()
                if count <= group.max_count:
                    return [_mpi.fromaddress(t.data_ptr(), count * plain[2]), count, plain[1]], plain[0]
    return None


def plain_scatter_buffers(group, output, input, redop):
    """reduce_scatter_tensor's plain case, either form (this module's
    :func:`ireduce_scatter_single`, hpccomm._runner.run_reduce_scatter_single):
    dense contiguous CPU tensors of one dtype, its (dtype, ReduceOp) pair in
    :data:`PLAIN`, within the count limit, the buffers apart: ``(send, receive,
    MPI op, bytes of the input)`` on the tensors' memory (reduce_scatter_single's
    checks, the cached reduction and _mpi.host_buffer without their calls); else
    None (the general case)."""
    if (output.__class__ is _Tensor and input.__class__ is _Tensor and output.layout is _STRIDED
            and input.layout is _STRIDED and output.is_cpu and input.is_cpu and output.dtype is input.dtype
            and output.is_contiguous() and input.is_contiguous()):
        plain = PLAIN.get((input.dtype, c.redop_code(redop)))
        n = output.numel()
        total = input.numel()
        if plain is not None and n and total == n * group.size and n <= group.max_count:
            size = plain[2]
            at, into = input.data_ptr(), output.data_ptr()
            if at + total * size <= into or into + n * size <= at:
                return ([_mpi.fromaddress(at, total * size), n, plain[1]],  # counted per block
                        [_mpi.fromaddress(into, n * size), n, plain[1]], plain[0], total * size)
    return None


def ireduce_scatter_single(group, output, input, redop, op: str = "reduce_scatter_tensor"):
    """reduce_scatter_tensor's nonblocking form (MPI_Ireduce_scatter_block),
    checks included (:func:`reduce_scatter_single`'s), or None past the size
    limits."""
    plain = plain_scatter_buffers(group, output, input, redop)
    if plain is not None and plain[3] <= c.NONBLOCKING_MAX_BYTES:
        return c.Posted(op, _partial(group.comm.Ireduce_scatter_block, plain[0], plain[1], op=plain[2]), [output],
                        (input, output), None, plain[3])
    reduce_scatter_single(group, output, input, redop, op)  # its checks (the closure it returns is not used)
    if input.numel() * input.element_size() > c.NONBLOCKING_MAX_BYTES:
        return None
    r = c.reduction(group, op, input.dtype, redop)
    mop = _predefined(r)
    n = output.numel()
    if mop is None or n > group.max_count:
        return None
    comm = group.comm
    send = None
    if r.factor is None and input.is_contiguous() and output.is_contiguous():
        send, recv, out = _mpi.host_buffer(input), _mpi.host_buffer(output), output
        keep = (input, output)
        _remember_plain(input.dtype, redop, r, mop)
        if not c.disjoint(send[0], recv[0]):
            send = None  # aliased: MPI forbids it (staged below)
    if send is None:
        src = c.premultiplied(input, r.factor, inplace=False) if r.factor is not None else c.contiguous(input)
        if c.overlaps(src, output):
            src = src.clone()  # MPI forbids aliased send and receive buffers
        out = c.out_buffer(output)
        send, recv = _mpi.buffer(src), _mpi.buffer(out)
        keep = (input, output, src, out)
    send[1] = n  # mpi4py counts the send side per block

    def after():
        if r.average:
            c.finish_average(out, group.size)
        c.write_back(output, out)

    return c.Posted(op, _partial(comm.Ireduce_scatter_block, send, recv, op=mop), [output], keep,
                    after if (r.average or out is not output) else None, input.numel() * input.element_size())
