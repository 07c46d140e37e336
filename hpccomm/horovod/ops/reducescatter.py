"""``hvd.reducescatter`` and its forms: blocking or async, one tensor or a
grouped list; differentiable."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..compression import Compression
from ..process_sets import global_process_set, member
from .allgather import allgather, grouped_allgather
from .checks import OP_NAMES, TORCH_OP, Adasum, Average, Sum, check_reduce_op, check_reduction, scale_
from .handles import Pending, free_names, inline, new_handle, one_or_all, run_async, synchronize, works
from .negotiation import negotiate, tensor_desc

# torch 2.13 renamed reduce_scatter_tensor (the old name warns)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _rows(total: int, n: int):
    """Horovod's split of the first dimension: the first ``total % n`` ranks get one row more."""
    q, r = divmod(total, n)
    return [q + 1 if i < r else q for i in range(n)]


def start_reducescatter(ps, tensor, op, pre, post) -> Pending:
    n = len(ps.ranks)
    rows = _rows(tensor.shape[0], n)
    most = rows[0]
    rest = tensor.shape[1:]
    src = tensor.detach()
    if all(r == most for r in rows):
        inp = src.contiguous() if pre == 1.0 else src.clone(memory_format=torch.contiguous_format)
    else:  # pad every rank's block to the longest; the padding is never read back
        inp = src.new_zeros((n * most, *rest))
        start = 0
        for i, r in enumerate(rows):
            inp[i * most:i * most + r] = src[start:start + r]
            start += r
    if pre != 1.0:
        if inp.data_ptr() == src.data_ptr():
            inp = inp.clone()
        scale_(inp, pre)
    out = src.new_empty((most, *rest))
    work = reduce_scatter_single(out, inp, op=TORCH_OP[op], group=ps._data, async_op=run_async())
    post = post / n if op == Average else post

    def finish():
        mine = out[:rows[ps.rank()]]
        scale_(mine, post)
        return mine

    return Pending(works(work), finish, keep=(inp, out))


def _reducescatter_handle(kind, tensors, name, op, prescale_factor, postscale_factor, process_set, grouped) -> int:
    ps = member(process_set, kind)
    tensors = list(tensors)
    names = free_names(ps, kind, name, len(tensors))
    op_error = None
    if op == Adasum:
        op_error = check_reduce_op(kind, op)
    elif op not in (Average, Sum):
        op_error = ValueError(f"hpccomm.horovod {kind}: op={OP_NAMES.get(op, op)}: Reducescatter currently only "
                              "supports AVERAGE and SUM (hvd.Average, hvd.Sum)")
    pre, post, params, error = check_reduction(kind, tensors, op, op_error, prescale_factor, postscale_factor,
                                               why_rows="it is split along the first dimension")
    descs = tuple(tensor_desc(t) for t in tensors) if error is None else ()
    negotiate(ps, (kind, name, params, descs), error)
    parts = [start_reducescatter(ps, t, op, pre, post) for t in tensors]
    return new_handle(Pending([w for p in parts for w in p.works],
                              lambda: one_or_all([p.finish() for p in parts], grouped), keep=parts), names)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0) -> int:
    """Start a reducescatter: the elementwise reduction over the set, split
    along the first dimension; with ``n`` ranks and ``d`` rows the first
    ``d % n`` ranks get one row more (Horovod's split).

    :param tensor: the tensor (same shape on every rank, at least 1-D).
    :param name: a name.
    :param op: ``hvd.Average`` (default) or ``hvd.Sum``.
    :param process_set: the :class:`ProcessSet`.
    :param prescale_factor: multiplies the tensor before the reduction.
    :param postscale_factor: multiplies the result.
    :returns: a handle; :func:`synchronize` returns this rank's block.
    :raises ValueError: a bad argument on this rank (the others raise
        :class:`HorovodInternalError` naming it), or ``name`` is held by
        an op in flight on the process set (raised before anything is sent).
    :raises NotImplementedError: ``op=hvd.Adasum``.
    :raises HorovodInternalError: the ranks' calls do not match.

    Example::

        mine = hvd.synchronize(hvd.reducescatter_async(t, op=hvd.Sum))
    """
    return _reducescatter_handle("reducescatter", [tensor], name, op, prescale_factor, postscale_factor, process_set,
                                 grouped=False)


class _ReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, ps, pre, post):
        ctx.args = (op, ps, pre, post)
        with inline():
            return synchronize(reducescatter_async(tensor, name, op, ps, pre, post))

    @staticmethod
    def backward(ctx, grad):
        op, ps, pre, post = ctx.args
        grad = grad * (len(ps.ranks) if op == Sum else 1) * pre * post  # Horovod's scaling of the gradient
        return allgather(grad, process_set=ps), None, None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reducescatter (see :func:`reducescatter_async`); differentiable.

    :param tensor: the tensor.
    :param name: a name.
    :param compression: ``hvd.Compression.none`` or ``hvd.Compression.fp16``.
    :param op: ``hvd.Average`` (default) or ``hvd.Sum``.
    :param process_set: the :class:`ProcessSet`.
    :param prescale_factor: multiplies the tensor before the reduction.
    :param postscale_factor: multiplies the result.
    :raises ValueError: see :func:`reducescatter_async`.
    :raises NotImplementedError: ``op=hvd.Adasum``.
    :raises HorovodInternalError: the ranks' calls do not match.

    Example::

        shard = hvd.reducescatter(full_grad)        # this rank's rows of the average
    """
    compressed, ctx = compression.compress(tensor)
    out = _ReducescatterFn.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0) -> int:
    """Start a reducescatter of each tensor of a list, as one op.

    :param tensors: the tensors.
    :param name: a base name.
    :param op: ``hvd.Average`` (default) or ``hvd.Sum``.
    :param process_set: the :class:`ProcessSet`.
    :param prescale_factor: multiplies the tensors before the reduction.
    :param postscale_factor: multiplies the results.
    :returns: a handle; :func:`synchronize` returns a tuple of blocks.
    :raises ValueError: see :func:`reducescatter_async`; an empty list.
    :raises NotImplementedError: ``op=hvd.Adasum``.
    :raises HorovodInternalError: the ranks' calls do not match.

    Example::

        a_part, b_part = hvd.synchronize(hvd.grouped_reducescatter_async([a, b]))
    """
    return _reducescatter_handle("grouped_reducescatter", tensors, name, op, prescale_factor, postscale_factor,
                                 process_set, grouped=True)


class _GroupedReducescatterFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, ps, pre, post, *tensors):
        ctx.args = (op, ps, pre, post)
        with inline():
            return synchronize(grouped_reducescatter_async(list(tensors), name, op, ps, pre, post))

    @staticmethod
    def backward(ctx, *grads):
        op, ps, pre, post = ctx.args
        scale = (len(ps.ranks) if op == Sum else 1) * pre * post
        return (None, None, None, None, None, *grouped_allgather([g * scale for g in grads], process_set=ps))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    """Reducescatter each tensor of a list as one op; returns a list. Differentiable.

    :param tensors: the tensors.
    :param name: a base name.
    :param compression: ``hvd.Compression.none`` or ``hvd.Compression.fp16``.
    :param op: ``hvd.Average`` (default) or ``hvd.Sum``.
    :param process_set: the :class:`ProcessSet`.
    :param prescale_factor: multiplies the tensors before the reduction.
    :param postscale_factor: multiplies the results.
    :raises ValueError: see :func:`grouped_reducescatter_async`.
    :raises NotImplementedError: ``op=hvd.Adasum``.
    :raises HorovodInternalError: the ranks' calls do not match.

    Example::

        a_part, b_part = hvd.grouped_reducescatter([a, b], op=hvd.Sum)
    """
    pairs = [compression.compress(t) for t in tensors]
    outs = _GroupedReducescatterFn.apply(name, op, process_set, prescale_factor, postscale_factor,
                                         *[c for c, _ in pairs])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]
