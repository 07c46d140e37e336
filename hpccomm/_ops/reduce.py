"""Reductions: all_reduce, reduce, reduce_scatter and their coalesced forms.

Each function here is one op's plan function (see :mod:`hpccomm._core.plan`):
it checks every argument and returns the op's plan; hpccomm._ops.op_path runs it.

AVG and PREMUL_SUM reduce with SUM plus a local step (divide after,
:func:`hpccomm._ops.staging.averaged`; multiply before,
:func:`hpccomm._ops.staging.scaled`), as NCCL does; float16/bfloat16 reduce
through a user-defined MPI op that computes in that dtype (see
``_mpi.DTYPES``), which has no nonblocking form.
"""
from __future__ import annotations

import math

import torch

from .. import _mpi
from .._core.plan import NBYTES, blocking, sequence
from .._core.plan import run as run_plan
from ..errors import HpccommError
from . import checks, staging
from .gather import allgather

_FLATTEN_BYTES = 1 << 18  # coalesced ops below this total go as one message
# Open MPI's allreduce allocates scratch memory of up to half the message (a 1 GiB
# float32 all_reduce peaked at 1.5x the tensor above baseline, raw mpi4py as well):
# messages past this size go in pieces of it, which bounds that scratch (to 0.03x
# at 1 GiB) at no measurable cost in bandwidth (each piece is itself bandwidth-bound).
_ALLREDUCE_PIECE_BYTES = 64 << 20


def _pieces(group, t: torch.Tensor, r, send=None):
    """The blocking form of an all_reduce into contiguous ``t`` (in place, or
    from contiguous ``send`` of the same size) in pieces of at most the count
    limit and ``_ALLREDUCE_PIECE_BYTES``."""
    comm, mop = group.comm, r.mop
    limit = min(group.max_count, max(_ALLREDUCE_PIECE_BYTES // t.element_size(), 1))

    def run():
        for off, n in staging.chunks(t.numel(), limit):
            comm.Allreduce(_mpi.IN_PLACE if send is None else _mpi.buffer(send, off, n), _mpi.buffer(t, off, n),
                           op=mop)

    return run


def all_reduce(group, tensors, redop, op: str = "all_reduce"):
    """all_reduce's plan: in place on the tensor's memory (one MPI call, with
    a nonblocking form where the reduction has one); a strided tensor
    through a contiguous copy, PREMUL_SUM from a scaled copy, large tensors
    in pieces.  A sparse COO tensor (DDP's sparse gradients reach torch's
    allreduce) is :func:`all_reduce_sparse`'s."""
    try:
        t = checks.single(group, op, tensors)
    except checks.OpTypeError:
        t = tensors[0] if isinstance(tensors, (list, tuple)) and len(tensors) == 1 else None
        if isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo:
            return all_reduce_sparse(group, tensors, redop, op)
        raise
    r = checks.reduction(group, op, t.dtype, redop)
    # in place on the tensor's memory when it is contiguous, else on a contiguous copy
    if t.is_contiguous():
        work, before, after = t, None, None
    else:
        work, before, after = staging.copy_inout(t)
    send = None
    if r.factor is not None:  # PREMUL_SUM reduces a scaled copy: should MPI fail, the tensor is as it was
        send, before = staging.scaled(t, r.factor)
    if r.average:
        after = staging.averaged(work, group.size, after)
    recv = _mpi.buffer(work)
    nbytes = recv[0].nbytes
    keep = t if work is t and send is None else (t, work, send)
    if recv[1] > group.max_count or nbytes > _ALLREDUCE_PIECE_BYTES:
        return (_pieces(group, work, r, send), (), None, tensors, keep, before, after, nbytes)
    calls = group.calls
    return (calls.Allreduce, (_mpi.IN_PLACE if send is None else _mpi.buffer(send), recv, r.mop),
            calls.Iallreduce if r.nonblocking else None, tensors, keep, before, after, nbytes)


def all_reduce_coalesced(group, tensors, redop, op: str = "all_reduce_coalesced"):
    """Several all_reduces at once: small tensors of one dtype travel as one
    message (one latency, not many), the rest one by one."""
    if not isinstance(tensors, (list, tuple)):
        checks.check_list(group, op, tensors, 0, "tensors")
    checks.check_tensors(group, op, tensors)
    for t in tensors:  # every check before the first message
        checks.reduction(group, op, t.dtype, redop)
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    plans = []
    for ts in by_dtype.values():
        if len(ts) > 1 and sum(t.numel() for t in ts) * ts[0].element_size() <= _FLATTEN_BYTES:
            flat = ts[0].new_empty(sum(t.numel() for t in ts))
            inner = all_reduce(group, [flat], redop, op)

            def gather_in(ts=ts, flat=flat):
                torch.cat([t.reshape(-1) for t in ts], out=flat)

            def scatter_out(ts=ts, flat=flat):
                off = 0
                for t in ts:
                    t.copy_(flat[off:off + t.numel()].view(t.shape))
                    off += t.numel()

            plans.append(sequence([inner], tensors, gather_in, scatter_out, inner[NBYTES]))
        else:
            plans.extend(all_reduce(group, [t], redop, op) for t in ts)
    return sequence(plans, tensors)


def reduce(group, tensors, root: int, redop, op: str = "reduce"):
    """reduce's plan: MPI_Reduce to ``root`` (in place there); only the root's
    tensor is an output, the others' are left untouched."""
    t = checks.single(group, op, tensors)
    checks.check_root(group, op, root, "dst")
    r = checks.reduction(group, op, t.dtype, redop)
    comm, limit = group.comm, group.max_count
    if group.rank == root:  # (in place as all_reduce)
        if t.is_contiguous():
            work, before, after = t, None, None
        else:
            work, before, after = staging.copy_inout(t)
        send = None
        if r.factor is not None:
            send, before = staging.scaled(t, r.factor)
        if r.average:
            after = staging.averaged(work, group.size, after)

        def run():
            for off, n in staging.chunks(work.numel(), limit):
                sendbuf = _mpi.IN_PLACE if send is None else _mpi.buffer(send, off, n)
                comm.Reduce(sendbuf, _mpi.buffer(work, off, n), op=r.mop, root=root)

        return (run, (), None, tensors, (t, work, send), before, after, t.numel() * t.element_size())
    if r.factor is not None:
        send, before = staging.scaled(t, r.factor)
    else:
        if t.is_contiguous():
            send, before = t, None
        else:
            send, before = staging.copy_in(t)

    def run():
        for off, n in staging.chunks(send.numel(), limit):
            comm.Reduce(_mpi.buffer(send, off, n), None, op=r.mop, root=root)

    return (run, (), None, tensors, (t, send), before, None, t.numel() * t.element_size())


def _reduce_scatter_blocks(group, send: torch.Tensor, out: torch.Tensor, r):
    """The blocking form of reduce_scatter past the count limit: one chunked
    reduce per destination rank."""
    comm, n = group.comm, out.numel()

    def run():
        for rank in range(group.size):
            for off, k in staging.chunks(n, group.max_count):
                recv = _mpi.buffer(out, off, k) if rank == group.rank else None
                comm.Reduce(_mpi.buffer(send, rank * n + off, k), recv, op=r.mop, root=rank)

    return run


def _reduce_scatter_plan(group, send, spec, out, recv, r, before, after, outputs, keep):
    """The plan of MPI_Reduce_scatter_block of contiguous ``send`` (``spec``:
    its MPI buffer; size × n elements) into contiguous ``out`` (``recv``: its
    MPI buffer; n elements), with AVG's step after it."""
    n = recv[1]
    if r.average:
        after = staging.averaged(out, group.size, after)
    if n > group.max_count:
        return (_reduce_scatter_blocks(group, send, out, r), (), None, outputs, keep, before, after, spec[0].nbytes)
    spec[1] = n  # mpi4py counts the send side per block
    calls = group.calls
    return (calls.Reduce_scatter_block, (spec, recv, r.mop), calls.Ireduce_scatter_block if r.nonblocking else None,
            outputs, keep, before, after, spec[0].nbytes)


def reduce_scatter_tensor(group, output, input, redop, op: str = "reduce_scatter_tensor"):
    """reduce_scatter_tensor's plan: MPI reads the input and writes the output
    in place when both are contiguous and apart; else through copies."""
    checks.check_pair(group, op, output, input, "input")
    r = checks.reduction(group, op, input.dtype, redop)
    if output.is_contiguous():
        out, after = output, None
    else:
        out, after = staging.copy_out(output)
    recv = _mpi.buffer(out)
    send, before, spec = input, None, None
    if r.factor is not None:  # PREMUL_SUM reduces a scaled copy
        send, before = staging.scaled(input, r.factor)
    elif input.is_contiguous():
        spec = _mpi.buffer(input)
        if staging.overlap(spec[0].address, spec[0].nbytes, recv[0].address, recv[0].nbytes):
            spec = None  # aliased with the output: MPI forbids aliased buffers
    if spec is None:
        if before is None:  # (strided, or aliased)
            send, before = staging.copy_in(input)
        spec = _mpi.buffer(send)
    return _reduce_scatter_plan(group, send, spec, out, recv, r, before, after, [output], (input, output, send, out))


def reduce_scatter(group, outputs, input_lists, redop, op: str = "reduce_scatter"):
    """reduce_scatter (a list of inputs, one per rank): read in place when the
    inputs are laid end to end in one storage, else concatenated."""
    output = checks.single(group, op, outputs, "output_tensors", "output")
    inputs = checks.per_rank(group, op, input_lists, "input_tensor_lists", "input_list", output, "output",
                             "Every input must have the output's size")
    r = checks.reduction(group, op, output.dtype, redop)
    if output.is_contiguous():
        out, after = output, None
    else:
        out, after = staging.copy_out(output)
    send, before = staging.joined(inputs, output.numel() * group.size, output, out, r.factor)
    return _reduce_scatter_plan(group, send, _mpi.buffer(send), out, _mpi.buffer(out), r, before, after, outputs,
                                (inputs, output, send, out))


def reduce_scatter_tensor_coalesced(group, outputs, inputs, redop, op: str = "reduce_scatter_tensor_coalesced"):
    checks.check_list(group, op, inputs, len(outputs), "inputs")
    return sequence([reduce_scatter_tensor(group, o, i, redop, op) for o, i in zip(outputs, inputs)], outputs)


def all_reduce_sparse(group, tensors, redop, op: str = "all_reduce"):
    """SUM of a sparse COO tensor over the group, as torch's gloo backend does
    it (DDP with ``nn.Embedding(sparse=True)`` needs it): every rank's
    coalesced indices and values are gathered, summed and coalesced; the
    result is copied into the user's tensor (a sparse copy, which takes the
    sum's indices).  Only SUM, as gloo."""
    t = checks.sparse_sum(group, op, tensors, redop)

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
        for send, recv, counts in ((indices.t().contiguous(), gathered_idx, [n * indices.shape[0] for n in nnzs]),
                                   (values, all_values, [n * row for n in nnzs])):
            offset = sum(counts[:group.rank]) * send.element_size()
            run_plan(allgather(group, send, recv, _mpi.buffer(recv), offset, counts, None, None))
        all_indices.copy_(gathered_idx.t())
        total = torch.sparse_coo_tensor(all_indices, all_values, t.shape, dtype=t.dtype).coalesce()
        t.copy_(total)

    return blocking(run, tensors, t)
