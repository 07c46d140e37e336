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

This module is the ring; each reducing op's composed plan (its checks are the
op's own, run once) is declared beside the op, in hpccomm._ops.reduce.  The
plans have the blocking form only (an async call runs on the comm thread).
"""
from __future__ import annotations

import torch

from .. import _mpi
from .._compat import RedOpType
from .._core.steps import sign_flipped, signed_view
from . import staging

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


def bounds(count: int, n: int, block: int = 0) -> list:
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


def blocks_to_root(group, flat: torch.Tensor, bounds_: list, root: int) -> None:
    """After the ring's reduce-scatter: every rank's reduced block of ``flat``
    to ``root`` (reduce's composed plan), in pieces within MPI's count limit."""
    comm, me = group.comm, group.rank
    if me != root:
        mine = flat[bounds_[me]:bounds_[me + 1]]
        for off, k in staging.chunks(mine.numel(), group.max_count):
            comm.Send(_mpi.buffer(mine, off, k), root, TAG)
        return
    for src in range(group.size):
        if src != root:
            block = flat[bounds_[src]:bounds_[src + 1]]
            for off, k in staging.chunks(block.numel(), group.max_count):
                comm.Recv(_mpi.buffer(block, off, k), src, TAG)
