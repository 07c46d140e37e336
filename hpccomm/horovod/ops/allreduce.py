"""``hvd.allreduce`` and its forms: in place or not, blocking or async, one
tensor or a grouped list; differentiable."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..compression import Compression
from ..process_sets import ProcessSet, global_process_set, member
from .checks import Average, TORCH_OP, check_reduce_op, check_reduction, resolve_op, scale_
from .handles import Pending, free_names, inline, new_handle, one_or_all, run_async, synchronize, works
from .negotiation import negotiate, tensor_desc


def start_allreduce(ps: ProcessSet, outputs, op, pre, post, group=None) -> Pending:
    """Reduce ``outputs`` in place (same-dtype tensors fused into one buffer each);
    scale by ``pre`` before and ``post`` (divided by the set's size for Average) after."""
    group = ps._data if group is None else group
    post = post / len(ps.ranks) if op == Average else post
    by_kind: dict = {}
    for i, t in enumerate(outputs):
        by_kind.setdefault((t.dtype, t.device), []).append(i)
    started, parts = [], []
    for idx in by_kind.values():
        ts = [outputs[i] for i in idx]
        if len(ts) == 1 and ts[0].is_contiguous():
            buf, fused = ts[0], None
        else:
            buf, fused = torch.cat([t.reshape(-1) for t in ts]), ts
        scale_(buf, pre)
        started.extend(works(dist.all_reduce(buf, op=TORCH_OP[op], group=group, async_op=run_async())))
        parts.append((buf, fused))

    def finish():
        for buf, fused in parts:
            scale_(buf, post)
            if fused is not None:
                offset = 0
                for t in fused:
                    t.copy_(buf[offset:offset + t.numel()].view(t.shape))
                    offset += t.numel()
        return outputs

    return Pending(started, finish, keep=parts)


def _allreduce_handle(kind, tensors, outputs_of, name, op, prescale_factor, postscale_factor, process_set,
                      grouped) -> int:
    ps = member(process_set, kind)
    tensors = list(tensors)
    names = free_names(ps, kind, name, len(tensors))
    pre, post, params, error = check_reduction(kind, tensors, op, check_reduce_op(kind, op), prescale_factor,
                                               postscale_factor)
    if error is None and len({t.device for t in tensors}) > 1:
        error = ValueError(f"hpccomm.horovod {kind}: tensors in the list must be on the same device")
    descs = tuple(tensor_desc(t) for t in tensors) if error is None else ()
    negotiate(ps, (kind, name, params, descs), error)
    pending = start_allreduce(ps, outputs_of(tensors), op, pre, post)
    return new_handle(Pending(pending.works, lambda: one_or_all(pending.finish(), grouped), keep=pending), names)


def _copies(tensors):
    return [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]


def _same(tensors):
    return [t.data if t.requires_grad else t for t in tensors]


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> int:
    """Start reducing ``tensor`` over the process set; ``tensor`` is not modified.

    :param tensor: the tensor (int32, int64, float16, bfloat16, float32, float64).
    :param average: deprecated (Horovod's); ``True`` is ``op=Average``, ``False`` ``op=Sum``.
    :param name: a name, checked to be the same on every rank.
    :param op: ``hvd.Average`` (default), ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``.
    :param prescale_factor: multiplies the tensor before the reduction.
    :param postscale_factor: multiplies the result (for Average, divided by the set's size).
    :param process_set: the :class:`ProcessSet` (default: every rank).
    :returns: a handle for :func:`poll` and :func:`synchronize`.
    :raises ValueError: a bad argument on this rank (every other rank raises
        :class:`HorovodInternalError` naming it), or ``name`` is held by
        an op in flight on the process set (raised before anything is sent).
    :raises NotImplementedError: ``op=hvd.Adasum``.
    :raises HorovodInternalError: the ranks' calls do not match.

    Example::

        h = hvd.allreduce_async(grad, op=hvd.Sum)
        total = hvd.synchronize(h)
    """
    op = resolve_op(op, average)
    return _allreduce_handle("allreduce", [tensor], _copies, name, op, prescale_factor, postscale_factor,
                             process_set, grouped=False)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> int:
    """Start reducing ``tensor`` in place (its values are final after :func:`synchronize`).

    :param tensor: the tensor; it receives the result.
    :param average: deprecated; see :func:`allreduce_async`.
    :param name: a name, checked to be the same on every rank.
    :param op: the reduction (default ``hvd.Average``).
    :param prescale_factor: multiplies the tensor before the reduction.
    :param postscale_factor: multiplies the result.
    :param process_set: the :class:`ProcessSet`.
    :returns: a handle.
    :raises ValueError: see :func:`allreduce_async`.
    :raises NotImplementedError: ``op=hvd.Adasum``.
    :raises HorovodInternalError: the ranks' calls do not match.

    Example::

        h = hvd.allreduce_async_(t)
        hvd.synchronize(h)          # t now holds the average
    """
    op = resolve_op(op, average)
    return _allreduce_handle("allreduce", [tensor], _same, name, op, prescale_factor, postscale_factor,
                             process_set, grouped=False)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set):
    """Reduce ``tensor`` in place and return it.

    :param tensor: the tensor; it receives the result.
    :param average: deprecated; see :func:`allreduce_async`.
    :param name: a name, checked to be the same on every rank.
    :param op: the reduction (default ``hvd.Average``).
    :param prescale_factor: multiplies the tensor before the reduction.
    :param postscale_factor: multiplies the result.
    :param process_set: the :class:`ProcessSet`.
    :raises ValueError: see :func:`allreduce_async`.
    :raises NotImplementedError: ``op=hvd.Adasum``.
    :raises HorovodInternalError: the ranks' calls do not match.

    Example::

        hvd.allreduce_(t, op=hvd.Max)
    """
    with inline():
        return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor,
                                            process_set))


class _AllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, pre, post, ps):
        ctx.args = (op, pre, post, ps)
        with inline():
            return synchronize(allreduce_async(tensor, name=name, op=op, prescale_factor=pre,
                                               postscale_factor=post, process_set=ps))

    @staticmethod
    def backward(ctx, grad):
        op, pre, post, ps = ctx.args
        return allreduce(grad, op=op, prescale_factor=pre, postscale_factor=post, process_set=ps), \
            None, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` over the process set and return the result; ``tensor``
    is not modified.  Differentiable: the gradient is the same allreduce of
    the output's gradient.

    :param tensor: the tensor (int32, int64, float16, bfloat16, float32, float64).
    :param average: deprecated; see :func:`allreduce_async`.
    :param name: a name, checked to be the same on every rank.
    :param compression: ``hvd.Compression.none`` (default) or ``hvd.Compression.fp16``.
    :param op: ``hvd.Average`` (default), ``hvd.Sum``, ``hvd.Min``, ``hvd.Max``, ``hvd.Product``.
    :param prescale_factor: multiplies the tensor before the reduction.
    :param postscale_factor: multiplies the result (for Average, divided by the set's size).
    :param process_set: the :class:`ProcessSet`.
    :raises ValueError: a bad argument on this rank (the others raise
        :class:`HorovodInternalError` naming it), or ``name`` is held by
        an op in flight on the process set (raised before anything is sent).
    :raises NotImplementedError: ``op=hvd.Adasum``.
    :raises HorovodInternalError: the ranks' calls do not match.

    Example::

        avg_loss = hvd.allreduce(torch.tensor(loss), name="avg_loss").item()
    """
    op = resolve_op(op, average)
    compressed, ctx = compression.compress(tensor)
    reduced = _AllreduceFn.apply(compressed, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set) -> int:
    """Start reducing a list of tensors as one op (one agreement step; tensors
    of one dtype travel in one buffer); the inputs are not modified.

    :param tensors: the tensors (same device).
    :param average: deprecated; see :func:`allreduce_async`.
    :param name: a base name, checked to be the same on every rank.
    :param op: the reduction (default ``hvd.Average``).
    :param prescale_factor: multiplies the tensors before the reduction.
    :param postscale_factor: multiplies the results.
    :param process_set: the :class:`ProcessSet`.
    :returns: a handle; :func:`synchronize` returns a tuple of tensors.
    :raises ValueError: see :func:`allreduce_async`; an empty list.
    :raises NotImplementedError: ``op=hvd.Adasum``.
    :raises HorovodInternalError: the ranks' calls do not match.

    Example::

        h = hvd.grouped_allreduce_async([a, b])
        a_avg, b_avg = hvd.synchronize(h)
    """
    op = resolve_op(op, average)
    return _allreduce_handle("grouped_allreduce", tensors, _copies, name, op, prescale_factor, postscale_factor,
                             process_set, grouped=True)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=global_process_set) -> int:
    """Start reducing a list of tensors in place, as one op.

    :param tensors: the tensors; each receives its result.
    :param average: deprecated; see :func:`allreduce_async`.
    :param name: a base name.
    :param op: the reduction (default ``hvd.Average``).
    :param prescale_factor: multiplies the tensors before the reduction.
    :param postscale_factor: multiplies the results.
    :param process_set: the :class:`ProcessSet`.
    :returns: a handle.
    :raises ValueError: see :func:`grouped_allreduce_async`.
    :raises NotImplementedError: ``op=hvd.Adasum``.
    :raises HorovodInternalError: the ranks' calls do not match.

    Example::

        hvd.synchronize(hvd.grouped_allreduce_async_([a, b], op=hvd.Sum))
    """
    op = resolve_op(op, average)
    return _allreduce_handle("grouped_allreduce", tensors, _same, name, op, prescale_factor, postscale_factor,
                             process_set, grouped=True)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set):
    """Reduce a list of tensors in place, as one op; returns them as a tuple.

    :param tensors: the tensors; each receives its result.
    :param average: deprecated; see :func:`allreduce_async`.
    :param name: a base name.
    :param op: the reduction (default ``hvd.Average``).
    :param prescale_factor: multiplies the tensors before the reduction.
    :param postscale_factor: multiplies the results.
    :param process_set: the :class:`ProcessSet`.
    :raises ValueError: see :func:`grouped_allreduce_async`.
    :raises NotImplementedError: ``op=hvd.Adasum``.
    :raises HorovodInternalError: the ranks' calls do not match.

    Example::

        hvd.grouped_allreduce_([w_grad, b_grad])
    """
    with inline():
        return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                    process_set))


class _GroupedAllreduceFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, pre, post, ps, *tensors):
        ctx.args = (op, pre, post, ps)
        with inline():
            return synchronize(grouped_allreduce_async(list(tensors), name=name, op=op, prescale_factor=pre,
                                                       postscale_factor=post, process_set=ps))

    @staticmethod
    def backward(ctx, *grads):
        op, pre, post, ps = ctx.args
        reduced = grouped_allreduce(list(grads), op=op, prescale_factor=pre, postscale_factor=post, process_set=ps)
        return (None, None, None, None, None, *reduced)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set):
    """Reduce a list of tensors as one op and return a list of results; the
    inputs are not modified. Differentiable.

    :param tensors: the tensors (same device).
    :param average: deprecated; see :func:`allreduce_async`.
    :param name: a base name.
    :param compression: ``hvd.Compression.none`` or ``hvd.Compression.fp16``.
    :param op: the reduction (default ``hvd.Average``).
    :param prescale_factor: multiplies the tensors before the reduction.
    :param postscale_factor: multiplies the results.
    :param process_set: the :class:`ProcessSet`.
    :raises ValueError: see :func:`grouped_allreduce_async`.
    :raises NotImplementedError: ``op=hvd.Adasum``.
    :raises HorovodInternalError: the ranks' calls do not match.

    Example::

        loss_avg, acc_avg = hvd.grouped_allreduce([loss, acc])
    """
    op = resolve_op(op, average)
    pairs = [compression.compress(t) for t in tensors]
    reduced = _GroupedAllreduceFn.apply(name, op, prescale_factor, postscale_factor, process_set,
                                        *[c for c, _ in pairs])
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(reduced, pairs)]
