"""``hvd.alltoall`` (blocking or async; differentiable)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..process_sets import global_process_set, member
from .checks import check_gatherable
from .handles import Pending, free_names, inline, new_handle, run_async, synchronize, works
from .negotiation import negotiate, tensor_desc


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start an alltoall: rows ``splits[0]`` go to the set's rank 0, the next
    ``splits[1]`` to rank 1, ...; without ``splits`` the first dimension is
    split evenly.

    :param tensor: the tensor (at least 1-D; other dimensions match across ranks).
    :param splits: None, or one row count per rank of the set (list or int32 tensor);
        their sum may not exceed the first dimension.
    :param name: a name.
    :param process_set: the :class:`ProcessSet`.
    :returns: a handle; :func:`synchronize` returns ``(output, received_splits)``.
    :raises ValueError: a bad argument on this rank (the others raise
        :class:`HorovodInternalError` naming it), or ``name`` is held by
        an op in flight on the process set (raised before anything is sent).
    :raises HorovodInternalError: the ranks' calls do not match.

    Example::

        out, got = hvd.synchronize(hvd.alltoall_async(t, splits=[1] * hvd.size()))
    """
    kind = "alltoall"
    ps = member(process_set, kind)
    names = free_names(ps, kind, name)
    send, error = _send_splits(kind, tensor, splits, len(ps.ranks))
    descs = (tensor_desc(tensor, skip_dim0=True),) if error is None else ()
    negotiate(ps, (kind, name, (), descs), error)
    recv = torch.empty(len(ps.ranks), dtype=torch.int64)
    dist.all_to_all_single(recv, torch.tensor(send, dtype=torch.int64), group=ps._ctrl)
    recv_list = recv.tolist()
    src = tensor.detach()[:sum(send)].contiguous()
    out = torch.empty((sum(recv_list), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    work = dist.all_to_all_single(out, src, output_split_sizes=recv_list, input_split_sizes=send,
                                  group=ps._data, async_op=run_async())
    received = recv.to(torch.int32)
    return new_handle(Pending(works(work), lambda: (out, received), keep=(src, out)), names)


def _send_splits(kind, tensor, splits, n):
    """``(rows sent to each rank of the set, None)``, or ``(None, the error)`` for a refused input."""
    error = check_gatherable(kind, [tensor])
    if error is not None:
        return None, error
    if splits is None:
        if tensor.shape[0] % n:
            return None, ValueError(f"hpccomm.horovod {kind}: splits not provided, but first dimension of tensor "
                                    f"({tensor.shape[0]}) is not an even multiple of the number of workers ({n})")
        return [tensor.shape[0] // n] * n, None
    if isinstance(splits, torch.Tensor):
        if splits.dim() > 1:
            return None, ValueError(f"hpccomm.horovod {kind}: alltoall expects a 1D splits tensor")
        if splits.dtype != torch.int32:
            return None, ValueError(f"hpccomm.horovod {kind}: alltoall expects splits to contain 32-bit integer "
                                    f"elements, got {splits.dtype}")
    send = splits.tolist() if isinstance(splits, torch.Tensor) else list(splits)
    if len(send) != n or any(not isinstance(s, int) or s < 0 for s in send):
        return None, ValueError(f"hpccomm.horovod {kind}: splits {send} must be {n} non-negative integers (one per "
                                "rank of the process set)")
    if sum(send) > tensor.shape[0]:
        return None, ValueError(f"hpccomm.horovod {kind}: Sum of splits entries ({sum(send)}) is greater than the "
                                f"first dimension of tensor ({tensor.shape[0]})")
    return send, None


class _AlltoallFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, ps):
        with inline():
            out, received = synchronize(alltoall_async(tensor, splits, name, ps))
        ctx.ps, ctx.received, ctx.rows = ps, received, tensor.shape[0]
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, *unused):
        back, _ = alltoall(grad, splits=ctx.received, process_set=ctx.ps)
        if back.shape[0] < ctx.rows:  # rows past sum(splits) were not sent: no gradient
            back = torch.cat([back, back.new_zeros((ctx.rows - back.shape[0], *back.shape[1:]))])
        return back, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Alltoall (see :func:`alltoall_async`); differentiable.

    :param tensor: the tensor.
    :param splits: None, or one row count per rank of the set.
    :param name: a name.
    :param process_set: the :class:`ProcessSet`.
    :returns: as Horovod: the gathered tensor when ``splits`` is None, else
        ``(tensor, received_splits)`` (int32, one count per rank).
    :raises ValueError: see :func:`alltoall_async`.
    :raises HorovodInternalError: the ranks' calls do not match.

    Example::

        out, received = hvd.alltoall(rows, splits=torch.tensor(counts, dtype=torch.int32))
    """
    return _AlltoallFn.apply(tensor, splits, name, process_set)
