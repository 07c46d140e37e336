"""Reductions: all_reduce (dense and sparse), reduce, reduce_scatter,
reduce_scatter_tensor and the coalesced forms; each op's whole story here:
its cache key, checks, signature, plan, composed plan and NCCL forms, and its
declaration (:class:`~hpccomm._ops.op.Op`) at the end.

AVG and PREMUL_SUM reduce with SUM plus a local step (divide after,
:func:`hpccomm._ops.staging.averaged`; multiply before,
:func:`hpccomm._ops.staging.scaled`), as NCCL does; float16/bfloat16 reduce
through a user-defined MPI op that computes in that dtype (see
``_mpi.DTYPES``), which has no nonblocking form.

The composed plans (the GPU route ``composed``) run hpccomm's ring
(:mod:`hpccomm._ops.composed`) with torch's kernels: the same results as the
MPI plans, every dtype and ReduceOp.
"""
from __future__ import annotations

import math
from functools import partial

import torch

from .. import _mpi
from .._compat import ReduceOp, RedOpType, redop_code
from .._core.plan import NBYTES, blocking, sequence
from .._core.plan import run as run_plan
from ..errors import HpccommError
from . import checks, composed, staging
from .gather import allgather
from .op import STRIDED, Call, Op, Signature, Tensor

_R = RedOpType
_FLATTEN_BYTES = 1 << 18  # coalesced ops below this total go as one message
# Open MPI's allreduce allocates scratch memory of up to half the message (a 1 GiB
# float32 all_reduce peaked at 1.5x the tensor above baseline, raw mpi4py as well):
# messages past this size go in pieces of it, which bounds that scratch (to 0.03x
# at 1 GiB) at no measurable cost in bandwidth (each piece is itself bandwidth-bound).
_ALLREDUCE_PIECE_BYTES = 64 << 20
#: What a ReduceOp argument is, where a call's key takes it: torch's ``ReduceOp`` (what torch's options hold)
#: or one of its kinds (``dist.ReduceOp.SUM``); each hashes to its kind's value (hpccomm._compat.redop_code).
_REDOPS = (ReduceOp, RedOpType)


def _signature(op: str, tensors, r) -> Signature:
    return Signature(op, tensors, (("op", r.name),))


# ----------------------------------------------------------------------------
# all_reduce
# ----------------------------------------------------------------------------

def all_reduce_key(args):
    """all_reduce's shape: one dense CPU tensor's dtype and count, the ReduceOp
    (what its checks' verdict and its signature depend on; the plan reads the
    tensor's layout in memory itself, every call)."""
    tensors, redop = args
    if tensors.__class__ is list and len(tensors) == 1:
        t = tensors[0]
        if t.__class__ is Tensor and t.is_cpu and t.layout is STRIDED and redop.__class__ in _REDOPS:
            return (ALL_REDUCE, t.dtype, t.numel(), redop_code(redop))
    return None


#: all_reduce's facts for a sparse COO tensor (all_reduce_sparse's plan).
SPARSE = "sparse"


def check_all_reduce(group, tensors, redop, op: str = "all_reduce") -> Call:
    """One dense tensor and a ReduceOp its dtype has; a sparse COO tensor (DDP's
    sparse gradients reach torch's allreduce) is :func:`check_all_reduce_sparse`'s."""
    try:
        t = checks.single(group, op, tensors)
    except checks.OpTypeError:
        t = tensors[0] if isinstance(tensors, (list, tuple)) and len(tensors) == 1 else None
        if isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo:
            return check_all_reduce_sparse(group, tensors, redop, op)
        raise
    r = checks.reduction(group, op, t.dtype, redop)
    return Call(_signature(op, ((t.dtype, t.numel()),), r), r, r.factor is None)


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


def plan_all_reduce(group, call: Call, args):
    """all_reduce's plan: in place on the tensor's memory (one MPI call, with a
    nonblocking form where the reduction has one); a strided tensor through a
    contiguous copy, PREMUL_SUM from a scaled copy, large tensors in pieces.
    A sparse tensor's is :func:`plan_all_reduce_sparse`."""
    r = call.facts
    if r is SPARSE:
        return plan_all_reduce_sparse(group, call, args)
    tensors = args[0]
    t = tensors[0]
    if t.is_contiguous():
        work, before, after = t, None, None
    else:
        work, before, after = staging.copy_inout(t)
    send = None
    if r.factor is not None:  # PREMUL_SUM reduces a scaled copy: should MPI fail, the tensor is as it was
        send, before = staging.scaled(t, r.factor)
    if r.average:
        after = staging.averaged(work, group.size, after)
    n = work.numel()
    nbytes = n * r.itemsize
    recv = [_mpi.fromaddress(work.data_ptr(), nbytes), n, r.mtype]  # (the checked call knows its MPI datatype)
    keep = t if work is t and send is None else (t, work, send)
    if n > group.max_count or nbytes > _ALLREDUCE_PIECE_BYTES:
        return (_pieces(group, work, r, send), (), None, tensors, keep, before, after, nbytes)
    calls = group.calls
    return (calls.Allreduce, (_mpi.IN_PLACE if send is None else _mpi.buffer(send), recv, r.mop),
            calls.Iallreduce if r.nonblocking else None, tensors, keep, before, after, nbytes)


def bind_all_reduce(group, call: Call):
    """all_reduce's plan bound to a cached call's shape (:class:`~hpccomm._ops.op.Op`
    ``bind``): a contiguous tensor reduced in place, one MPI call; None for
    AVG, PREMUL_SUM or a sparse tensor (steps, or no MPI call of its own) and
    past the count limit or the piece size (pieces)."""
    r = call.facts
    if r is SPARSE or r.factor is not None or r.average:
        return None
    n = call.signature.tensors[0][1]
    nbytes = n * r.itemsize
    if n > group.max_count or nbytes > _ALLREDUCE_PIECE_BYTES:
        return None
    calls, fromaddress, in_place, mtype, mop = group.calls, _mpi.fromaddress, _mpi.IN_PLACE, r.mtype, r.mop
    allreduce, iallreduce = calls.Allreduce, calls.Iallreduce if r.nonblocking else None

    def fill(args):
        tensors = args[0]
        t = tensors[0]
        if not t.is_contiguous():
            return None
        return (allreduce, (in_place, [fromaddress(t.data_ptr(), nbytes), n, mtype], mop), iallreduce, tensors, t,
                None, None, nbytes)

    return fill


def _work(t: torch.Tensor, r):
    """``(buffer, before, after)``: where a composed ring reduces ``t`` in
    place: ``t`` itself when contiguous and nothing scales it, else a
    contiguous copy filled before (scaled for PREMUL_SUM: ``t`` is untouched
    should MPI fail) and copied back after."""
    if r.factor is not None:
        buf, before = staging.scaled(t, r.factor)
        return buf, before, partial(t.copy_, buf)
    if t.is_contiguous():
        return t, None, None
    return staging.copy_inout(t)


def _of(r) -> Call:
    """A checked call of one tensor's all_reduce ``r`` (a Reduction), inside a coalesced op's plan."""
    return Call(None, r, False)


def _composed_in_place(group, t: torch.Tensor, r, outputs):
    """The composed plan of all_reduce ``r`` of ``t``: ring reduce-scatter, then ring all-gather."""
    work, before, back = _work(t, r)
    flat = work.view(-1)
    bounds = composed.bounds(flat.numel(), group.size)
    scratch = flat.new_empty(max(b - a for a, b in zip(bounds, bounds[1:])))
    combine = composed.combiner(t.dtype, r.kind if not (r.average or r.factor is not None) else _R.SUM)

    def run():
        if before is not None:
            before()
        composed.reduce_scatter_ring(group, flat, bounds, combine, scratch)
        composed.all_gather_ring(group, flat, bounds)
        if r.average:
            staging.finish_average(work, group.size)
        if back is not None:
            back()

    return blocking(run, outputs, (t, work, scratch), t.numel() * t.element_size())


def composed_all_reduce(group, call: Call, args):
    tensors, redop = args
    return _composed_in_place(group, tensors[0], call.facts, tensors)


def _nccl_all_reduce(b, a, o, options):
    return b.allreduce(a[0], options("allreduce", o, reduceOp=a[1]))


def _cupy_all_reduce(n, tensors, redop):
    t = tensors[0]
    dtype, nop = n.dtype(t), n.op(redop)  # (refused before the communicator is made)
    n.comm.allReduce(t.data_ptr(), t.data_ptr(), t.numel(), dtype, nop, n.stream)


# ----------------------------------------------------------------------------
# all_reduce of a sparse COO tensor
# ----------------------------------------------------------------------------

def check_all_reduce_sparse(group, tensors, redop, op: str = "all_reduce") -> Call:
    """One sparse COO CPU tensor of a dtype that sums, and ReduceOp.SUM (as gloo)."""
    t = checks.sparse_sum(group, op, tensors, redop)
    return Call(Signature(op, ((t.dtype, t.numel()),), (("layout", "sparse_coo"), ("op", "SUM"))), SPARSE)


def plan_all_reduce_sparse(group, call: Call, args, op: str = "all_reduce"):
    """SUM of a sparse COO tensor over the group, as torch's gloo backend does
    it (DDP with ``nn.Embedding(sparse=True)`` needs it): every rank's
    coalesced indices and values are gathered, summed and coalesced; the
    result is copied into the user's tensor (a sparse copy, which takes the
    sum's indices).  Only SUM, as gloo."""
    tensors, redop = args
    t = tensors[0]

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


# ----------------------------------------------------------------------------
# all_reduce_coalesced (DDP's, torch's coalescing manager)
# ----------------------------------------------------------------------------

def check_all_reduce_coalesced(group, tensors, redop, op: str = "all_reduce_coalesced") -> Call:
    """A list of dense tensors, each of a dtype the ReduceOp reduces; every
    tensor's dtype and count in the signature."""
    if not isinstance(tensors, (list, tuple)):
        checks.check_list(group, op, tensors, 0, "tensors")
    checks.check_tensors(group, op, tensors)
    rs = [checks.reduction(group, op, t.dtype, redop) for t in tensors]  # every check before the first message
    name = rs[0].name if rs else checks.reduce_op_name(group, op, redop)
    return Call(Signature(op, tuple((t.dtype, t.numel()) for t in tensors), (("op", name),)), rs)


def plan_all_reduce_coalesced(group, call: Call, args):
    """Several all_reduces at once: small tensors of one dtype travel as one
    message (one latency, not many), the rest one by one."""
    tensors, redop = args
    by_dtype: dict = {}
    for t, r in zip(tensors, call.facts):
        by_dtype.setdefault(t.dtype, ([], r))[0].append(t)
    plans = []
    for ts, r in by_dtype.values():
        if len(ts) > 1 and sum(t.numel() for t in ts) * ts[0].element_size() <= _FLATTEN_BYTES:
            flat = ts[0].new_empty(sum(t.numel() for t in ts))
            inner = plan_all_reduce(group, _of(r), ([flat], None))

            def gather_in(ts=ts, flat=flat):
                torch.cat([t.reshape(-1) for t in ts], out=flat)

            def scatter_out(ts=ts, flat=flat):
                off = 0
                for t in ts:
                    t.copy_(flat[off:off + t.numel()].view(t.shape))
                    off += t.numel()

            plans.append(sequence([inner], tensors, gather_in, scatter_out, inner[NBYTES]))
        else:
            plans.extend(plan_all_reduce(group, _of(r), ([t], None)) for t in ts)
    return sequence(plans, tensors)


def composed_all_reduce_coalesced(group, call: Call, args):
    """Each tensor's composed all_reduce, in turn."""
    tensors, redop = args
    return sequence([_composed_in_place(group, t, r, [t]) for t, r in zip(tensors, call.facts)], tensors)


def _nccl_all_reduce_coalesced(b, a, o, options):
    return b.allreduce_coalesced(a[0], options("allreduce_coalesced", o, reduceOp=a[1]))


# ----------------------------------------------------------------------------
# reduce
# ----------------------------------------------------------------------------

def reduce_key(args):
    """reduce's shape: all_reduce's and the root."""
    tensors, root, redop = args
    if root.__class__ is int:
        shape = all_reduce_key((tensors, redop))
        if shape is not None:
            return (REDUCE, root, *shape[1:])
    return None


def check_reduce(group, tensors, root: int, redop, op: str = "reduce") -> Call:
    t = checks.single(group, op, tensors)
    checks.check_root(group, op, root, "dst")
    r = checks.reduction(group, op, t.dtype, redop)
    return Call(Signature(op, ((t.dtype, t.numel()),), (("op", r.name), ("root", root))), r, r.factor is None)


def plan_reduce(group, call: Call, args):
    """reduce's plan: MPI_Reduce to ``root`` (in place there); only the root's
    tensor is an output, the others' are left untouched."""
    tensors, root, redop = args
    t, r = tensors[0], call.facts
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


def composed_reduce(group, call: Call, args):
    """reduce's composed plan: the ring's reduce-scatter on a copy (the root's
    tensor at the root), then every rank's reduced block to the root; only the
    root's tensor is written."""
    tensors, root, redop = args
    t, r = tensors[0], call.facts
    if group.rank == root:
        work, before, back = _work(t, r)
    else:
        work, before = staging.copy_in(t) if r.factor is None else staging.scaled(t, r.factor)
        back = None
    flat = work.view(-1)
    bounds = composed.bounds(flat.numel(), group.size)
    scratch = flat.new_empty(max(b - a for a, b in zip(bounds, bounds[1:])))
    combine = composed.combiner(t.dtype, r.kind if not (r.average or r.factor is not None) else _R.SUM)
    me = group.rank

    def run():
        if before is not None:
            before()
        composed.reduce_scatter_ring(group, flat, bounds, combine, scratch)
        composed.blocks_to_root(group, flat, bounds, root)
        if me != root:
            return
        if r.average:
            staging.finish_average(work, group.size)
        if back is not None:
            back()

    return blocking(run, tensors, (t, work, scratch), t.numel() * t.element_size())


def _reduce_roles(args, rank: int) -> str:
    """reduce writes the root's tensor only; the others' are read."""
    return "inout" if args[1] == rank else "in"


def _nccl_reduce(b, a, o, options):
    return b.reduce(a[0], options("reduce", o, rootRank=a[1], reduceOp=a[2]))


def _cupy_reduce(n, tensors, root, redop):
    t = tensors[0]
    dtype, nop = n.dtype(t), n.op(redop)
    n.comm.reduce(t.data_ptr(), t.data_ptr(), t.numel(), dtype, nop, root, n.stream)


# ----------------------------------------------------------------------------
# reduce_scatter_tensor and reduce_scatter (a list of inputs)
# ----------------------------------------------------------------------------

def reduce_scatter_tensor_key(args):
    """reduce_scatter_tensor's shape: two dense CPU tensors' dtypes and counts, the ReduceOp."""
    output, input, redop = args
    if output.__class__ is Tensor and input.__class__ is Tensor and output.is_cpu and input.is_cpu and \
            output.layout is STRIDED and input.layout is STRIDED and redop.__class__ in _REDOPS:
        return (REDUCE_SCATTER_TENSOR, output.dtype, output.numel(), input.dtype, input.numel(), redop_code(redop))
    return None


def check_reduce_scatter_tensor(group, output, input, redop, op: str = "reduce_scatter_tensor") -> Call:
    """Two tensors of one dtype, the input the group size times the output's elements."""
    checks.check_pair(group, op, output, input, "input")
    r = checks.reduction(group, op, input.dtype, redop)
    return Call(_signature(op, ((input.dtype, input.numel()), (output.dtype, output.numel())), r), r,
                r.factor is None)


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


def plan_reduce_scatter_tensor(group, call: Call, args):
    """reduce_scatter_tensor's plan: MPI reads the input and writes the output
    in place when both are contiguous and apart; else through copies."""
    output, input, redop = args
    r = call.facts
    if output.is_contiguous():
        out, after = output, None
    else:
        out, after = staging.copy_out(output)
    n, size = out.numel(), r.itemsize
    out_at, out_bytes = out.data_ptr(), n * size
    recv = [_mpi.fromaddress(out_at, out_bytes), n, r.mtype]  # (the checked call knows its MPI datatype)
    send, before, spec = input, None, None
    if r.factor is not None:  # PREMUL_SUM reduces a scaled copy
        send, before = staging.scaled(input, r.factor)
    elif input.is_contiguous():
        at, m = input.data_ptr(), input.numel()
        if not staging.overlap(at, m * size, out_at, out_bytes):  # (aliased with the output: MPI forbids it)
            spec = [_mpi.fromaddress(at, m * size), m, r.mtype]
    if spec is None:
        if before is None:  # (strided, or aliased)
            send, before = staging.copy_in(input)
        spec = _mpi.buffer(send)
    return _reduce_scatter_plan(group, send, spec, out, recv, r, before, after, [output], (input, output, send, out))


def bind_reduce_scatter_tensor(group, call: Call):
    """reduce_scatter_tensor's plan bound to a cached call's shape
    (:class:`~hpccomm._ops.op.Op` ``bind``): contiguous tensors apart from
    each other, one MPI call; None for AVG and past the count limit; ``fill``
    gives None for a strided or aliased pair."""
    r = call.facts
    if r.factor is not None or r.average:
        return None
    n = call.signature.tensors[1][1]  # (the output's elements: one block)
    if n > group.max_count:
        return None
    out_bytes = n * r.itemsize
    in_bytes = out_bytes * group.size
    calls, fromaddress, overlap, mtype, mop = group.calls, _mpi.fromaddress, staging.overlap, r.mtype, r.mop
    scatter, iscatter = calls.Reduce_scatter_block, calls.Ireduce_scatter_block if r.nonblocking else None

    def fill(args):
        output, input, _ = args
        if not (output.is_contiguous() and input.is_contiguous()):
            return None
        out_at, in_at = output.data_ptr(), input.data_ptr()
        if overlap(in_at, in_bytes, out_at, out_bytes):
            return None
        return (scatter, ([fromaddress(in_at, in_bytes), n, mtype], [fromaddress(out_at, out_bytes), n, mtype], mop),
                iscatter, [output], (input, output), None, None, in_bytes)

    return fill


def _composed_scatter(group, outputs, output: torch.Tensor, fill, r, nbytes: int):
    """The composed plan of a reduce-scatter into ``output`` from a work copy
    that ``fill(work)`` makes of this rank's input (group size x output's elements)."""
    m = output.numel()
    work = output.new_empty(m * group.size)
    scratch = output.new_empty(m)
    bounds = composed.bounds(0, group.size, m)
    combine = composed.combiner(r.dtype, r.kind if not (r.average or r.factor is not None) else _R.SUM)
    mine = work[group.rank * m:(group.rank + 1) * m]

    def run():
        fill(work)
        if r.factor is not None:
            staging.scale_(work, r.factor)
        composed.reduce_scatter_ring(group, work, bounds, combine, scratch)
        output.copy_(mine.view(output.shape))
        if r.average:
            staging.finish_average(output, group.size)

    return blocking(run, outputs, (output, work, scratch), nbytes)


def _composed_scatter_tensor(group, output, input, r):
    """The ring's reduce-scatter on a copy of the input (the input is only read), the owned block copied out."""
    return _composed_scatter(group, [output], output, lambda w: w.view(input.shape).copy_(input), r,
                             input.numel() * input.element_size())


def composed_reduce_scatter_tensor(group, call: Call, args):
    output, input, redop = args
    return _composed_scatter_tensor(group, output, input, call.facts)


def _nccl_reduce_scatter_tensor(b, a, o, options):
    return b._reduce_scatter_base(a[0], a[1], options("reduce_scatter", o, reduceOp=a[2]))


def _cupy_reduce_scatter_tensor(n, output, input, redop):
    dtype, nop = n.dtype(output, input), n.op(redop)
    n.comm.reduceScatter(input.data_ptr(), output.data_ptr(), output.numel(), dtype, nop, n.stream)


def check_reduce_scatter(group, outputs, input_lists, redop, op: str = "reduce_scatter") -> Call:
    """One output, and a list of one input per rank of the output's size and dtype."""
    output = checks.single(group, op, outputs, "output_tensors", "output")
    checks.per_rank(group, op, input_lists, "input_tensor_lists", "input_list", output, "output",
                    "Every input must have the output's size")
    r = checks.reduction(group, op, output.dtype, redop)
    return Call(_signature(op, ((output.dtype, output.numel()),), r), r)


def plan_reduce_scatter(group, call: Call, args):
    """reduce_scatter (a list of inputs, one per rank): read in place when the
    inputs are laid end to end in one storage, else concatenated."""
    outputs, input_lists, redop = args
    output, inputs, r = outputs[0], input_lists[0], call.facts
    if output.is_contiguous():
        out, after = output, None
    else:
        out, after = staging.copy_out(output)
    send, before = staging.joined(inputs, output.numel() * group.size, output, out, r.factor)
    return _reduce_scatter_plan(group, send, _mpi.buffer(send), out, _mpi.buffer(out), r, before, after, outputs,
                                (inputs, output, send, out))


def composed_reduce_scatter(group, call: Call, args):
    """reduce_scatter's composed plan (a list of one input per rank)."""
    outputs, input_lists, redop = args
    output, inputs = outputs[0], input_lists[0]
    m = output.numel()

    def fill(w):
        for i, t in enumerate(inputs):
            w[i * m:(i + 1) * m].view(t.shape).copy_(t)

    return _composed_scatter(group, outputs, output, fill, call.facts, m * group.size * output.element_size())


def _nccl_reduce_scatter(b, a, o, options):
    return b.reduce_scatter(a[0], a[1], options("reduce_scatter", o, reduceOp=a[2]))


# ----------------------------------------------------------------------------
# reduce_scatter_tensor_coalesced (FSDP's)
# ----------------------------------------------------------------------------

def check_reduce_scatter_tensor_coalesced(group, outputs, inputs, redop,
                                          op: str = "reduce_scatter_tensor_coalesced") -> Call:
    """reduce_scatter_tensor's checks for each (output, input) pair; every tensor in the signature."""
    if not isinstance(outputs, (list, tuple)):
        checks.check_list(group, op, outputs, 0, "outputs")  # (refused: not a list)
    checks.check_list(group, op, inputs, len(outputs), "inputs")
    calls = [check_reduce_scatter_tensor(group, o, i, redop, op) for o, i in zip(outputs, inputs)]
    name = calls[0].facts.name if calls else checks.reduce_op_name(group, op, redop)
    return Call(Signature(op, tuple(x for c in calls for x in c.signature.tensors), (("op", name),)),
                [c.facts for c in calls])


def plan_reduce_scatter_tensor_coalesced(group, call: Call, args):
    """Each pair's reduce_scatter_tensor, in turn."""
    outputs, inputs, redop = args
    return sequence([plan_reduce_scatter_tensor(group, _of(r), (o, i, redop))
                     for o, i, r in zip(outputs, inputs, call.facts)], outputs)


def composed_reduce_scatter_tensor_coalesced(group, call: Call, args):
    """Each pair's composed reduce_scatter_tensor, in turn."""
    outputs, inputs, redop = args
    return sequence([_composed_scatter_tensor(group, o, i, r) for o, i, r in zip(outputs, inputs, call.facts)],
                    outputs)


def _nccl_reduce_scatter_tensor_coalesced(b, a, o, options):
    return options.coalesced(b, "reduce_scatter_tensor_coalesced", "_reduce_scatter_base", a[0], a[1],
                             options("reduce_scatter", o, reduceOp=a[2]))


# ----------------------------------------------------------------------------
# the declarations
# ----------------------------------------------------------------------------

ALL_REDUCE = Op(
    "all_reduce", methods=("allreduce",), key=all_reduce_key, check=check_all_reduce,
    plan=plan_all_reduce, bind=bind_all_reduce, composed=composed_all_reduce, reducing=True, first="inout",
    nonblocking=True, chunkable=True, nccl=_nccl_all_reduce, cupy=_cupy_all_reduce)
ALL_REDUCE_SPARSE = Op(
    "all_reduce", methods=("allreduce_sparse",), check=check_all_reduce_sparse,
    plan=plan_all_reduce_sparse, reducing=True, first="inout")
ALL_REDUCE_COALESCED = Op(
    "all_reduce_coalesced", methods=("allreduce_coalesced",), check=check_all_reduce_coalesced,
    plan=plan_all_reduce_coalesced, composed=composed_all_reduce_coalesced, reducing=True, first="inout",
    nccl=_nccl_all_reduce_coalesced, recorded_as="allreduce_coalesced")
REDUCE = Op(
    "reduce", methods=("reduce",), key=reduce_key, check=check_reduce,
    plan=plan_reduce, composed=composed_reduce, reducing=True, first="inout", roles=_reduce_roles, chunkable=True,
    nccl=_nccl_reduce, cupy=_cupy_reduce)
REDUCE_SCATTER = Op(
    "reduce_scatter", methods=("reduce_scatter",), check=check_reduce_scatter,
    plan=plan_reduce_scatter, composed=composed_reduce_scatter, reducing=True, nccl=_nccl_reduce_scatter,
    stacked=(True, False), scatters=True)
REDUCE_SCATTER_TENSOR = Op(
    "reduce_scatter_tensor", methods=("reduce_scatter_single",),
    legacy=("_reduce_scatter_base",), key=reduce_scatter_tensor_key, check=check_reduce_scatter_tensor,
    plan=plan_reduce_scatter_tensor, bind=bind_reduce_scatter_tensor, composed=composed_reduce_scatter_tensor,
    reducing=True, nonblocking=True, slot="input", nccl=_nccl_reduce_scatter_tensor, cupy=_cupy_reduce_scatter_tensor,
    recorded_as="_reduce_scatter_base", scatters=True)
REDUCE_SCATTER_TENSOR_COALESCED = Op(
    "reduce_scatter_tensor_coalesced", methods=("reduce_scatter_single_coalesced",),
    legacy=("reduce_scatter_tensor_coalesced",), check=check_reduce_scatter_tensor_coalesced,
    plan=plan_reduce_scatter_tensor_coalesced, composed=composed_reduce_scatter_tensor_coalesced, reducing=True,
    nccl=_nccl_reduce_scatter_tensor_coalesced, scatters=True)

OPS = (ALL_REDUCE, ALL_REDUCE_SPARSE, ALL_REDUCE_COALESCED, REDUCE, REDUCE_SCATTER, REDUCE_SCATTER_TENSOR,
       REDUCE_SCATTER_TENSOR_COALESCED)
