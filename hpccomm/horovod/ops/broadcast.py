"""``hvd.broadcast`` and its forms: in place or not, blocking or async; differentiable."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .. import basics
from ..process_sets import global_process_set, member
from .allreduce import allreduce
from .checks import MOVE_DTYPES, Average, check_tensor, first_error
from .handles import Pending, free_names, inline, new_handle, one_or_all, run_async, synchronize, works
from .negotiation import negotiate, tensor_desc


def broadcast_handle(kind, tensors, root_rank, name, process_set, in_place, grouped=False) -> int:
    """Start broadcasting ``tensors`` (every form of broadcast, and broadcast_parameters)."""
    ps = member(process_set, kind)
    names = free_names(ps, kind, name, len(tensors))
    error = first_error(*(check_tensor(kind, t, MOVE_DTYPES) for t in tensors))
    if error is None and (not isinstance(root_rank, int) or root_rank not in ps.ranks):
        error = ValueError(f"hpccomm.horovod {kind}: invalid root rank {root_rank!r} for the provided process "
                           f"set {ps.ranks} (root_rank is a global rank, hvd.rank() of the root)")
    descs = tuple(tensor_desc(t) for t in tensors) if error is None else ()
    negotiate(ps, (kind, name, (("root_rank", root_rank),), descs), error)
    bufs = [t.detach() if in_place else t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
    started = works(*[dist.broadcast(b, src=root_rank, group=ps._data, async_op=run_async()) for b in bufs])
    results = tensors if in_place else bufs
    return new_handle(Pending(started, lambda: one_or_all(results, grouped), keep=bufs), names)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start broadcasting ``tensor`` from ``root_rank``; ``tensor`` is not modified.

    :param tensor: the tensor (same dtype and shape on every rank).
    :param root_rank: the global rank (``hvd.rank()``) that sends.
    :param name: a name, checked to be the same on every rank.
    :param process_set: the :class:`ProcessSet` (``root_rank`` must be in it).
    :returns: a handle; :func:`synchronize` returns a new tensor with the root's values.
    :raises ValueError: a bad argument on this rank (the others raise
        :class:`HorovodInternalError` naming it), or ``name`` is held by
        an op in flight on the process set (raised before anything is sent).
    :raises HorovodInternalError: the ranks' calls (dtype, shape, root) do not match.

    Example::

        h = hvd.broadcast_async(t, root_rank=0)
        from_root = hvd.synchronize(h)
    """
    return broadcast_handle("broadcast", [tensor], root_rank, name, process_set, in_place=False)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start broadcasting ``tensor`` from ``root_rank`` in place.

    :param tensor: the tensor; on other ranks it receives the root's values.
    :param root_rank: the global rank that sends.
    :param name: a name.
    :param process_set: the :class:`ProcessSet`.
    :returns: a handle.
    :raises ValueError: see :func:`broadcast_async`.
    :raises HorovodInternalError: the ranks' calls do not match.

    Example::

        hvd.synchronize(hvd.broadcast_async_(weights, root_rank=0))
    """
    return broadcast_handle("broadcast", [tensor], root_rank, name, process_set, in_place=True)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Broadcast ``tensor`` from ``root_rank`` in place and return it.

    :param tensor: the tensor.
    :param root_rank: the global rank that sends.
    :param name: a name.
    :param process_set: the :class:`ProcessSet`.
    :raises ValueError: see :func:`broadcast_async`.
    :raises HorovodInternalError: the ranks' calls do not match.

    Example::

        hvd.broadcast_(model.fc.weight.data, root_rank=0)
    """
    with inline():
        return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _BroadcastFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, ps):
        ctx.root_rank, ctx.ps = root_rank, ps
        with inline():
            return synchronize(broadcast_async(tensor, root_rank, name, ps))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average, process_set=ctx.ps)
        if basics.rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Return a new tensor holding ``root_rank``'s ``tensor``; differentiable.

    :param tensor: the tensor (same dtype and shape on every rank).
    :param root_rank: the global rank that sends.
    :param name: a name.
    :param process_set: the :class:`ProcessSet`.
    :raises ValueError: see :func:`broadcast_async`.
    :raises HorovodInternalError: the ranks' calls do not match.

    Example::

        seed = hvd.broadcast(torch.tensor([seed]), root_rank=0).item()
    """
    return _BroadcastFn.apply(tensor, root_rank, name, process_set)
