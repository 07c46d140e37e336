"""Reductions composed of point-to-point messages and local arithmetic.

hpccomm's own all_reduce, reduce_scatter and reduce, for an MPI library that
moves device memory well but reduces it slowly (Open MPI copies device buffers
to the host to reduce them): the data moves in a ring of ``Sendrecv`` calls (each
rank sends to the next and receives from the previous: the point-to-point
path CUDA-aware libraries make fastest, CUDA IPC within a node), and the
arithmetic runs where the tensors are, with torch's kernels.  Device-agnostic:
the same plans run on CPU tensors over host MPI, which is how they are tested.

The ring: the tensor is cut into one block per rank.  Reduce-scatter: in
``n - 1`` steps each rank sends a block to the next rank and combines the block
it receives from the previous one into its own copy, so that rank ``r`` ends
holding block ``r`` reduced over every rank.  All-gather: in ``n - 1`` more
steps each reduced block travels around the ring.  Each block is reduced once,
by its owner, and then copied, so every rank holds the same bits.  Bandwidth:
each rank sends ``2 (n - 1) / n`` of the tensor, the optimum for all_reduce.

Results are the CPU path's: the same ReduceOp meanings (bool SUM is OR and
PRODUCT is AND; integers wrap), AVG as SUM then hpccomm's division
(:func:`hpccomm._ops.staging.finish_average`), PREMUL_SUM as the SUM of a scaled
copy, the user's tensors untouched where the op does not write them.
Floating-point sums are taken in ring order, which may round differently
from the MPI library's order (identical on every rank all the same).

Each function is a plan function (its checks are the CPU plan's checks); the
plans have the blocking form only (an async call runs on the comm thread).
"""
from __future__ import annotations

from functools import partial

import torch

from .. import _mpi
from .._compat import RedOpType
from .._core.plan import blocking, sequence
from .._core.steps import sign_flipped, signed_view
from . import checks, staging

_R = RedOpType
#: The tag of the ring's messages on the group's collective communicator (user messages travel on
#: the group's point-to-point communicator: they never meet).
TAG = 0x4843
_WIDE_UNSIGNED = tuple(d for d in (getattr(torch, n, None) for n in ("uint16", "uint32", "uint64")) if d is not None)
_BOOL = {_R.SUM: _R.MAX, _R.PRODUCT: _R.MIN}


def combiner(dtype: torch.dtype, kind: RedOpType):
    """``combine(acc, other)``: ``acc <- acc (kind) other`` in place, with
    the CPU path's meaning for ``dtype`` (torch's kernels on the tensors'
    device).  bool combines as uint8 (SUM: OR, PRODUCT: AND); the unsigned
    types torch has no arithmetic for combine on their signed view (the same
    bits for SUM, PRODUCT and the bitwise ops; MIN and MAX with the sign bit
    flipped, which keeps the unsigned order)."""
    view, flip = None, False
    if dtype == torch.bool:
        view, kind = (lambda t: t.view(torch.uint8)), _BOOL.get(kind, kind)
    elif dtype in _WIDE_UNSIGNED:
        view, flip = signed_view, kind in (_R.MIN, _R.MAX)
    kernel = _KERNELS[kind]
    if flip:
        def combine(acc, other):
            a = view(acc)
            a.copy_(sign_flipped(kernel(sign_flipped(a), sign_flipped(view(other)))))
    elif view is not None:
        def combine(acc, other):
            a = view(acc)
            a.copy_(kernel(a, view(other)))
    else:
        def combine(acc, other):
            acc.copy_(kernel(acc, other))
    return combine


_KERNELS = {
    _R.SUM: torch.add, _R.PRODUCT: torch.mul, _R.MIN: torch.minimum, _R.MAX: torch.maximum,
    _R.BAND: torch.bitwise_and, _R.BOR: torch.bitwise_or, _R.BXOR: torch.bitwise_xor,
}


def _bounds(count: int, n: int, block: int = 0) -> list:
    """Where each rank's block starts, and the end: blocks of ``block`` elements, or ``count`` cut in ``n``."""
    if block:
        return [i * block for i in range(n + 1)]
    return [count * i // n for i in range(n + 1)]


def _sendrecv(group, send: torch.Tensor, recv: torch.Tensor) -> None:
    """``send`` to the next rank of the ring while ``recv`` arrives from the
    previous one, in pieces within MPI's count limit (equal on both ends:
    each rank's blocks are laid out alike)."""
    comm, n, r = group.comm, group.size, group.rank
    right, left = (r + 1) % n, (r - 1) % n
    for (off, k), (roff, rk) in zip(staging.chunks(send.numel(), group.max_count),
                                     staging.chunks(recv.numel(), group.max_count)):
        comm.Sendrecv(_mpi.buffer(send, off, k), right, TAG, _mpi.buffer(recv, roff, rk), left, TAG)


def reduce_scatter_ring(group, flat: torch.Tensor, bounds, combine, scratch: torch.Tensor) -> None:
    """Reduce ``flat`` (contiguous, this rank's values) so that this rank's
    block ``bounds[r]:bounds[r+1]`` holds the reduction over every rank."""
    n, r = group.size, group.rank
    for s in range(n - 1):
        out, into = (r - s - 1) % n, (r - s - 2) % n
        block = flat[bounds[into]:bounds[into + 1]]
        incoming = scratch[:block.numel()]
        _sendrecv(group, flat[bounds[out]:bounds[out + 1]], incoming)
        combine(block, incoming)


def all_gather_ring(group, flat: torch.Tensor, bounds) -> None:
    """Every rank's block of ``flat`` to every rank (this rank's block is its own)."""
    n, r = group.size, group.rank
    for s in range(n - 1):
        out, into = (r - s) % n, (r - s - 1) % n
        _sendrecv(group, flat[bounds[out]:bounds[out + 1]], flat[bounds[into]:bounds[into + 1]])


def _work(t: torch.Tensor, r):
    """``(buffer, before, after)``: where the ring reduces ``t`` in place: ``t``
    itself when contiguous and nothing scales it, else a contiguous copy
    filled before (scaled for PREMUL_SUM: ``t`` is untouched should MPI fail)
    and copied back after."""
    if r.factor is not None:
        buf, before = staging.scaled(t, r.factor)
        return buf, before, partial(t.copy_, buf)
    if t.is_contiguous():
        return t, None, None
    return staging.copy_inout(t)


def _scale_(t: torch.Tensor, factor) -> None:
    """PREMUL_SUM's scaling of the work buffer ``t``, in place."""
    if isinstance(factor, torch.Tensor):
        factor = factor.to(t).reshape(())
    t.mul_(factor)


def all_reduce(group, tensors, redop, op: str = "all_reduce"):
    """all_reduce's composed plan: ring reduce-scatter, then ring all-gather."""
    t = checks.single(group, op, tensors)
    r = checks.reduction(group, op, t.dtype, redop)
    work, before, back = _work(t, r)
    flat = work.view(-1)
    bounds = _bounds(flat.numel(), group.size)
    scratch = flat.new_empty(max(b - a for a, b in zip(bounds, bounds[1:])))
    combine = combiner(t.dtype, r.kind if not (r.average or r.factor is not None) else _R.SUM)

    def run():
        if before is not None:
            before()
        reduce_scatter_ring(group, flat, bounds, combine, scratch)
        all_gather_ring(group, flat, bounds)
        if r.average:
            staging.finish_average(work, group.size)
        if back is not None:
            back()

    return blocking(run, tensors, (t, work, scratch), t.numel() * t.element_size())


def _scatter_plan(group, op: str, outputs, output: torch.Tensor, fill, dtype, redop, nbytes: int):
    """The composed plan of a reduce-scatter into ``output`` from a work copy
    that ``fill(work)`` makes of this rank's input (group size x output's elements)."""
    r = checks.reduction(group, op, dtype, redop)
    m = output.numel()
    work = output.new_empty(m * group.size)
    scratch = output.new_empty(m)
    bounds = _bounds(0, group.size, m)
    combine = combiner(dtype, r.kind if not (r.average or r.factor is not None) else _R.SUM)
    mine = work[group.rank * m:(group.rank + 1) * m]

    def run():
        fill(work)
        if r.factor is not None:
            _scale_(work, r.factor)
        reduce_scatter_ring(group, work, bounds, combine, scratch)
        output.copy_(mine.view(output.shape))
        if r.average:
            staging.finish_average(output, group.size)

    return blocking(run, outputs, (output, work, scratch), nbytes)


def reduce_scatter_tensor(group, output, input, redop, op: str = "reduce_scatter_tensor"):
    """reduce_scatter_tensor's composed plan: the ring's reduce-scatter on a
    copy of the input (the input is only read), the owned block copied out."""
    checks.check_pair(group, op, output, input, "input")
    return _scatter_plan(group, op, [output], output, lambda w: w.view(input.shape).copy_(input), input.dtype,
                         redop, input.numel() * input.element_size())


def reduce_scatter(group, outputs, input_lists, redop, op: str = "reduce_scatter"):
    """reduce_scatter's composed plan (a list of one input per rank)."""
    output = checks.single(group, op, outputs, "output_tensors", "output")
    inputs = checks.per_rank(group, op, input_lists, "input_tensor_lists", "input_list", output, "output",
                             "Every input must have the output's size")
    m = output.numel()

    def fill(w):
        for i, t in enumerate(inputs):
            w[i * m:(i + 1) * m].view(t.shape).copy_(t)

    return _scatter_plan(group, op, outputs, output, fill, output.dtype, redop, m * group.size * output.element_size())


def reduce(group, tensors, root: int, redop, op: str = "reduce"):
    """reduce's composed plan: the ring's reduce-scatter on a copy (the
    root's tensor at the root), then every rank's reduced block to the root;
    only the root's tensor is written."""
    t = checks.single(group, op, tensors)
    checks.check_root(group, op, root, "dst")
    r = checks.reduction(group, op, t.dtype, redop)
    if group.rank == root:
        work, before, back = _work(t, r)
    else:
        work, before = staging.copy_in(t) if r.factor is None else staging.scaled(t, r.factor)
        back = None
    flat = work.view(-1)
    bounds = _bounds(flat.numel(), group.size)
    scratch = flat.new_empty(max(b - a for a, b in zip(bounds, bounds[1:])))
    combine = combiner(t.dtype, r.kind if not (r.average or r.factor is not None) else _R.SUM)
    comm, me = group.comm, group.rank

    def run():
        if before is not None:
            before()
        reduce_scatter_ring(group, flat, bounds, combine, scratch)
        mine = flat[bounds[me]:bounds[me + 1]]
        if me != root:
            for off, k in staging.chunks(mine.numel(), group.max_count):
                comm.Send(_mpi.buffer(mine, off, k), root, TAG)
            return
        for src in range(group.size):
            if src != root:
                block = flat[bounds[src]:bounds[src + 1]]
                for off, k in staging.chunks(block.numel(), group.max_count):
                    comm.Recv(_mpi.buffer(block, off, k), src, TAG)
        if r.average:
            staging.finish_average(work, group.size)
        if back is not None:
            back()

    return blocking(run, tensors, (t, work, scratch), t.numel() * t.element_size())


def all_reduce_coalesced(group, tensors, redop, op: str = "all_reduce_coalesced"):
    """all_reduce_coalesced's composed plan: each tensor's, in turn."""
    if not isinstance(tensors, (list, tuple)):
        checks.check_list(group, op, tensors, 0, "tensors")
    return sequence([all_reduce(group, [t], redop, op) for t in tensors], tensors)


def reduce_scatter_tensor_coalesced(group, outputs, inputs, redop, op: str = "reduce_scatter_tensor_coalesced"):
    """reduce_scatter_tensor_coalesced's composed plan: each pair's, in turn."""
    checks.check_list(group, op, inputs, len(outputs), "inputs")
    return sequence([reduce_scatter_tensor(group, o, i, redop, op) for o, i in zip(outputs, inputs)], outputs)
