"""``hvd.allgather`` and its forms (blocking or async, one tensor or a grouped
list; differentiable), and ``hvd.sparse_allreduce_async``, a sparse allreduce
made of two allgathers."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..process_sets import global_process_set, member
from .allreduce import allreduce, grouped_allreduce
from .checks import Average, check_gatherable
from .handles import (Pending, check_free, discard, free_names, inline, new_handle, run_async, synchronize,
                      tensor_names, works)
from .negotiation import all_gather_single, negotiate, tensor_desc


def start_allgather(ps, tensor, sizes) -> Pending:
    out = torch.empty((sum(sizes), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    parts = list(out.split(sizes))
    src = tensor.detach().contiguous()
    work = dist.all_gather(parts, src, group=ps._data, async_op=run_async())
    return Pending(works(work), lambda: out, keep=(parts, src))


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Start gathering ``tensor`` from every rank of the set, concatenated
    along the first dimension, which may differ between ranks.

    :param tensor: the tensor (at least 1-D; the other dimensions must match).
    :param name: a name, checked to be the same on every rank.
    :param process_set: the :class:`ProcessSet`.
    :returns: a handle; :func:`synchronize` returns the gathered tensor.
    :raises ValueError: a bad argument on this rank (the others raise
        :class:`HorovodInternalError` naming it), or ``name`` is held by
        an op in flight on the process set (raised before anything is sent).
    :raises HorovodInternalError: the ranks' dtypes or trailing dimensions differ.

    Example::

        h = hvd.allgather_async(torch.full((hvd.rank() + 1, 2), hvd.rank()))
        everything = hvd.synchronize(h)      # size(size+1)/2 rows
    """
    kind = "allgather"
    ps = member(process_set, kind)
    names = free_names(ps, kind, name)
    error = check_gatherable(kind, [tensor])
    descs = (tensor_desc(tensor, skip_dim0=True),) if error is None else ()
    sizes = negotiate(ps, (kind, name, (), descs), error, size0=tensor.shape[0] if error is None else 0)
    return new_handle(start_allgather(ps, tensor, sizes), names)


class _AllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, ps):
        with inline():
            out = synchronize(allgather_async(tensor, name=name, process_set=ps))
        ctx.ps = ps
        ctx.rows = tensor.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad):
        ps = ctx.ps
        reduced = allreduce(grad, op=Average, process_set=ps)
        sizes = synchronize(allgather_async(torch.tensor([ctx.rows]), process_set=ps)).tolist()
        offset = sum(sizes[:ps.rank()])
        return reduced.narrow(0, offset, ctx.rows), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Gather ``tensor`` from every rank of the set, concatenated along the
    first dimension (which may differ between ranks); differentiable.

    :param tensor: the tensor (at least 1-D; the other dimensions must match).
    :param name: a name, checked to be the same on every rank.
    :param process_set: the :class:`ProcessSet`.
    :raises ValueError: see :func:`allgather_async`.
    :raises HorovodInternalError: the ranks' dtypes or trailing dimensions differ.

    Example::

        labels = hvd.allgather(local_labels)     # every rank's labels, in rank order
    """
    return _AllgatherFn.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    """Start gathering each tensor of a list (one agreement step for all).

    :param tensors: the tensors (each at least 1-D).
    :param name: a base name.
    :param process_set: the :class:`ProcessSet`.
    :returns: a handle; :func:`synchronize` returns a tuple of gathered tensors.
    :raises ValueError: see :func:`allgather_async`; an empty list.
    :raises HorovodInternalError: the ranks' calls do not match.

    Example::

        xs, ys = hvd.synchronize(hvd.grouped_allgather_async([x, y]))
    """
    kind = "grouped_allgather"
    ps = member(process_set, kind)
    tensors = list(tensors)
    names = free_names(ps, kind, name, len(tensors))
    error = check_gatherable(kind, tensors)
    descs = tuple(tensor_desc(t, skip_dim0=True) for t in tensors) if error is None else ()
    negotiate(ps, (kind, name, (), descs), error)
    mine = torch.tensor([t.shape[0] for t in tensors], dtype=torch.int64)
    rows = torch.empty(len(ps.ranks) * len(tensors), dtype=torch.int64)
    all_gather_single(rows, mine, group=ps._ctrl)
    rows = rows.view(len(ps.ranks), len(tensors))
    parts = [start_allgather(ps, t, rows[:, i].tolist()) for i, t in enumerate(tensors)]
    return new_handle(Pending([w for p in parts for w in p.works], lambda: tuple(p.finish() for p in parts),
                              keep=parts), names)


class _GroupedAllgatherFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, ps, *tensors):
        with inline():
            out = synchronize(grouped_allgather_async(list(tensors), name=name, process_set=ps))
        ctx.ps = ps
        ctx.rows = [t.shape[0] for t in tensors]
        return out

    @staticmethod
    def backward(ctx, *grads):
        ps = ctx.ps
        reduced = grouped_allreduce(list(grads), op=Average, process_set=ps)
        sizes = synchronize(allgather_async(torch.tensor([ctx.rows]), process_set=ps))
        offsets = sizes[:ps.rank()].sum(dim=0).tolist() if ps.rank() else [0] * len(ctx.rows)
        return (None, None, *[g.narrow(0, o, n) for g, o, n in zip(reduced, offsets, ctx.rows)])


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Gather each tensor of a list as one op; returns a tuple. Differentiable.

    :param tensors: the tensors (each at least 1-D).
    :param name: a base name.
    :param process_set: the :class:`ProcessSet`.
    :raises ValueError: see :func:`grouped_allgather_async`.
    :raises HorovodInternalError: the ranks' calls do not match.

    Example::

        xs, ys = hvd.grouped_allgather([x, y])
    """
    return _GroupedAllgatherFn.apply(name, process_set, *tensors)


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Reduce a sparse COO tensor by allgathering its indices and values (how
    DistributedOptimizer reduces sparse gradients unless ``sparse_as_dense``).
    The two allgathers are named ``<name>.indices`` and ``<name>.values``, as
    in Horovod; both names are checked before either starts.

    :param tensor: a sparse COO tensor.
    :param name: a name.
    :param op: ``hvd.Average`` (values divided by the set's size) or ``hvd.Sum``.
    :param process_set: the :class:`ProcessSet`.
    :returns: a callable that waits and returns the reduced sparse tensor.
    :raises ValueError: see :func:`allgather_async`.

    Example::

        finish = hvd.sparse_allreduce_async(emb.weight.grad, "emb", hvd.Average)
        emb.weight.grad = finish()
    """
    parts = (f"{name}.indices", f"{name}.values") if name else (None, None)
    check_free(member(process_set, "sparse_allreduce"), "sparse_allreduce", name,
               [n for part in parts for n in tensor_names("allgather", part)])
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    h_idx = allgather_async(t._indices().t().contiguous(), name=parts[0], process_set=process_set)
    h_val = allgather_async(t._values(), name=parts[1], process_set=process_set)
    return SparseReduction(t, op, process_set, h_idx, h_val)


class SparseReduction:
    """What :func:`sparse_allreduce_async` returns: call it to wait for the
    reduced sparse tensor, or :meth:`discard` it."""

    __slots__ = ("tensor", "op", "process_set", "handles")

    def __init__(self, tensor, op, process_set, h_idx, h_val) -> None:
        self.tensor, self.op, self.process_set = tensor, op, process_set
        self.handles = (h_idx, h_val)

    def __call__(self):
        h_idx, h_val = self.handles
        values = synchronize(h_val)
        indices = synchronize(h_idx)
        if self.op == Average:
            values = values / len(self.process_set.ranks)
        return torch.sparse_coo_tensor(indices.t(), values, self.tensor.size(), check_invariants=True)

    def discard(self) -> None:
        """Forget the result (its names are free again; the transfers still complete)."""
        for h in self.handles:
            discard(h)
