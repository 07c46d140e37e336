"""Horovod's collectives (``hvd.allreduce`` and the rest) over hpccomm's process groups.

Every op has two steps:

1. **Agreement.** The ranks of the process set allgather three integers on the
   set's control group: a state (0 ready, -1 "my input was refused", k > 0
   "I have joined"), a hash of the op's description (kind, name, dtypes,
   shapes, ReduceOp, scale factors, root) and one size (allgather's first
   dimension).  When the hashes agree and nobody joined, the op goes on.
   Otherwise the ranks allgather their full descriptions and every rank raises
   the same error naming the ranks and what differs, so a mismatch is an
   error, never a hang.  Ranks that called :func:`join` take part in this step
   from their join loop and, for allreduce and barrier, feed zeros into the
   data step (Horovod's join).
2. **Data.** The transfer runs as a torch.distributed op on the set's data
   group: in the calling thread for the blocking functions (``allreduce``,
   ``broadcast_``, ...), with ``async_op=True`` (on hpccomm's comm thread) for
   the ``*_async`` functions, which return an integer handle for
   :func:`poll`/:func:`synchronize`.

Horovod matches ops across ranks by name; here they are matched by their
position in each rank's sequence of ops on the process set (as MPI does).
"""
from __future__ import annotations

import hashlib
import itertools
import threading
import warnings
from contextlib import contextmanager
from typing import Optional

import torch
import torch.distributed as dist

from . import basics
from .basics import HorovodInternalError
from .compression import Compression
from .process_sets import ProcessSet, global_process_set, member

#: Horovod's reduction ops (the values of its C++ enum).
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}
_TORCH_OP = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
             Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}
#: dtypes the reductions take (Horovod's int32, int64, float16, float32, float64, and bfloat16).
REDUCE_DTYPES = (torch.int32, torch.int64, torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: dtypes the moving ops (allgather, broadcast, alltoall) take.
MOVE_DTYPES = REDUCE_DTYPES + (torch.uint8, torch.int8, torch.int16, torch.bool)
#: ops that ranks which have joined can take part in (Horovod's rule).
JOIN_OK = ("allreduce", "grouped_allreduce", "barrier", "optimizer")

# torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor (the old names warn)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_tls = threading.local()


@contextmanager
def inline():
    """Inside, data steps run in the calling thread (``async_op=False``): the
    blocking functions (``allreduce``, ``broadcast_``, ...) wait for their result
    anyway, and handing a small op to the comm thread and back costs more than the op."""
    before = getattr(_tls, "inline", False)
    _tls.inline = True
    try:
        yield
    finally:
        _tls.inline = before


def _async() -> bool:
    return not getattr(_tls, "inline", False)


def _works(*works):
    return [w for w in works if w is not None]  # a blocking torch op returns None


_handles: dict = {}
_handle_ids = itertools.count(1)
_shadows: list = []  # zero-filled ops a joined rank started (waited at the end of join)


def reset() -> None:
    """Forget every handle (at shutdown)."""
    _handles.clear()
    _shadows.clear()


# -- descriptions and the agreement step ---------------------------------------------

def _tdesc(t: torch.Tensor, skip_dim0: bool = False):
    shape = (None, *t.shape[1:]) if skip_dim0 else tuple(t.shape)  # None: may differ between ranks
    return (str(t.dtype).replace("torch.", ""), shape, t.device.type)


def _text(desc) -> str:
    """A description as a user reads it: ``allreduce('loss', float32[4], Average)``."""
    kind, name, params, tensors = desc
    parts = [repr(name)] if name else []
    for dtype, shape, device in tensors:
        dims = ", ".join("*" if d is None else str(d) for d in shape)
        parts.append(f"{dtype}[{dims}]" + ("" if device == "cpu" else f" on {device}"))
    parts += [f"{k}={v}" for k, v in params]
    return f"{kind}({', '.join(parts)})"


def _hash(desc) -> int:
    digest = hashlib.blake2b(repr(desc).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _where(kind: str, ps: ProcessSet, name=None) -> str:
    label = f"{kind} {name!r}" if name else kind
    return (f"hpccomm.horovod {label} (op #{ps.negotiations} on process set {ps.process_set_id}, "
            f"rank {ps.rank()}/{len(ps.ranks)})")


def _differences(a, b) -> str:
    """What differs between two descriptions, in words."""
    if a[0] != b[0]:
        return "different ops"
    if a[1] != b[1]:
        return "different names"
    if len(a[3]) != len(b[3]):
        return "different numbers of tensors"
    if [t[0] for t in a[3]] != [t[0] for t in b[3]]:
        return "mismatched dtypes"
    if [t[2] for t in a[3]] != [t[2] for t in b[3]]:
        return "mismatched devices"
    if [len(t[1]) for t in a[3]] != [len(t[1]) for t in b[3]]:
        return "mismatched numbers of dimensions"
    if [t[1] for t in a[3]] != [t[1] for t in b[3]]:
        return "mismatched shapes"
    da, db = dict(a[2]), dict(b[2])
    return "mismatched " + ", ".join(k for k in da if da.get(k) != db.get(k))  # the only part left to differ


def negotiate(ps: ProcessSet, desc, error: Optional[BaseException] = None, size0: int = 0) -> list:
    """The agreement step (module docstring); returns every rank's ``size0``.

    Raises on every rank of the set when an input was refused, the
    descriptions differ, or ranks have joined and ``desc`` cannot run then."""
    kind, name = desc[0], desc[1]
    n = len(ps.ranks)
    payload = torch.tensor([-1 if error is not None else 0, _hash(desc), size0], dtype=torch.int64)
    rows = torch.empty(3 * n, dtype=torch.int64)
    _all_gather_single(rows, payload, group=ps._ctrl)
    ps.negotiations += 1
    rows = rows.view(n, 3).tolist()
    states = [r[0] for r in rows]
    if all(s == 0 for s in states) and all(r[1] == rows[0][1] for r in rows):
        return [r[2] for r in rows]
    infos = [None] * n
    dist.all_gather_object(infos, (desc, None if error is None else f"{type(error).__name__}: {error}"),
                           group=ps._ctrl)
    where = _where(kind, ps, name)
    if error is not None:
        raise error
    refused = [i for i, s in enumerate(states) if s < 0]
    if refused:
        first = refused[0]
        raise HorovodInternalError(
            f"{where}: the input of rank(s) {[ps.ranks[i] for i in refused]} was refused, so this op cannot run "
            f"(rank {ps.ranks[first]}: {infos[first][1]})")
    active = [i for i, s in enumerate(states) if s == 0]
    joined = [ps.ranks[i] for i, s in enumerate(states) if s > 0]
    for i in active:
        if infos[i][0] != infos[active[0]][0]:
            a, b = active[0], i
            raise HorovodInternalError(
                f"{where}: {_differences(infos[a][0], infos[b][0])} across ranks: rank {ps.ranks[a]} called "
                f"{_text(infos[a][0])} but rank {ps.ranks[b]} called {_text(infos[b][0])}. Every rank must call the "
                "same ops in the same order with the same dtypes, shapes and arguments (hpccomm.horovod matches "
                "ops by their order, where Horovod matched them by name)")
    if joined and kind not in JOIN_OK:
        raise HorovodInternalError(
            f"{where}: {kind} is not supported while ranks have joined (rank(s) {joined} called hvd.join()); as "
            "in Horovod, only allreduce, grouped_allreduce, barrier and DistributedOptimizer's reductions are")
    return [r[2] for r in rows]


def _join_negotiate(ps: ProcessSet, joined_at: int):
    """A joined rank's side of one agreement step: ``(done, last_rank, desc)``."""
    n = len(ps.ranks)
    payload = torch.tensor([joined_at, 0, 0], dtype=torch.int64)
    rows = torch.empty(3 * n, dtype=torch.int64)
    _all_gather_single(rows, payload, group=ps._ctrl)
    ps.negotiations += 1
    states = [r[0] for r in rows.view(n, 3).tolist()]
    if all(s > 0 for s in states):
        last = max(range(n), key=lambda i: (states[i], i))  # ties: the highest rank, as Horovod's controller
        return True, ps.ranks[last], None
    infos = [None] * n
    dist.all_gather_object(infos, (None, None), group=ps._ctrl)
    active = [i for i, s in enumerate(states) if s <= 0]
    if any(states[i] < 0 for i in active) or any(infos[i][0] != infos[active[0]][0] for i in active):
        return False, None, None  # the active ranks raise; nothing to feed
    desc = infos[active[0]][0]
    return False, None, (desc if desc[0] in JOIN_OK else None)


# -- handles ------------------------------------------------------------------------------

class _Pending:
    """A started data step: its Works, and what turns their buffers into the result."""

    __slots__ = ("works", "finish", "keep")

    def __init__(self, works, finish, keep=None) -> None:
        self.works = works
        self.finish = finish
        self.keep = keep  # tensors MPI reads or writes until the Works complete

    def done(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def wait(self):
        try:
            for w in self.works:
                w.wait()
        except HorovodInternalError:
            raise
        except RuntimeError as exc:
            raise HorovodInternalError(str(exc)) from exc
        return self.finish()


def _handle(pending: _Pending) -> int:
    h = next(_handle_ids)
    _handles[h] = pending
    return h


def poll(handle: int) -> bool:
    """Whether the async op behind ``handle`` has completed (then
    :func:`synchronize` returns without waiting).

    :param handle: from an ``*_async`` function.
    :raises ValueError: the handle was never made or was already synchronized.

    Example::

        h = hvd.allreduce_async(t)
        while not hvd.poll(h):
            do_other_work()
        avg = hvd.synchronize(h)
    """
    pending = _handles.get(handle)
    if pending is None:
        raise ValueError(f"Handle {handle} was not created or has been cleared.")
    return pending.done()


def synchronize(handle: int):
    """Wait for the async op behind ``handle`` and return its result (a tensor,
    a tuple of tensors for grouped ops and for alltoall, the tensor and the
    received splits). An unknown handle returns None, as in Horovod.

    :param handle: from an ``*_async`` function.
    :raises HorovodInternalError: the op failed.

    Example::

        h = hvd.allgather_async(t)
        gathered = hvd.synchronize(h)
    """
    pending = _handles.pop(handle, None)
    if pending is None:
        return None
    return pending.wait()


# -- checks ----------------------------------------------------------------------------------

def resolve_op(op, average):
    """Horovod's ``op``/``average`` rule: ``op`` wins, ``average`` is deprecated, Average by default."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


def _check_tensor(kind, t, dtypes):
    if not isinstance(t, torch.Tensor):
        return TypeError(f"hpccomm.horovod {kind}: expected a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse:
        return ValueError(f"hpccomm.horovod {kind}: sparse tensors are not supported; pass tensor.to_dense()")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        return ValueError(f"hpccomm.horovod {kind}: tensor type {t.type()} ({t.dtype}) is not supported; "
                          f"supported: {names}")
    return None


def _check_reduce_op(kind, op, allowed=(Average, Sum, Min, Max, Product)):
    if op == Adasum:
        return NotImplementedError(f"hpccomm.horovod {kind}: op=hvd.Adasum is not supported (hpccomm.horovod has no "
                                   "Adasum reduction); use op=hvd.Average, the default")
    if op not in allowed:
        names = ", ".join(f"hvd.{OP_NAMES[o]}" for o in allowed)
        return ValueError(f"hpccomm.horovod {kind}: op={op!r} is not one of {names}")
    return None


def _first_error(*errors):
    return next((e for e in errors if e is not None), None)


def _scale_(t: torch.Tensor, factor: float) -> None:
    """Horovod's scaling: floats multiply; integers are multiplied in double
    precision and truncated toward zero."""
    if factor == 1.0:
        return
    if t.is_floating_point() or t.is_complex():
        t.mul_(factor)
    else:
        t.copy_(torch.trunc(t.double() * factor))


def _float_or_error(kind, name, value):
    try:
        return float(value), None
    except (TypeError, ValueError):
        return 1.0, TypeError(f"hpccomm.horovod {kind}: {name} must be a number, got {value!r}")


# -- allreduce ---------------------------------------------------------------------------------

def _start_allreduce(ps: ProcessSet, outputs, op, pre, post, group=None) -> _Pending:
    """Reduce ``outputs`` in place (same-dtype tensors fused into one buffer each);
    scale by ``pre`` before and ``post`` (divided by the set's size for Average) after."""
    group = ps._data if group is None else group
    post = post / len(ps.ranks) if op == Average else post
    by_kind: dict = {}
    for i, t in enumerate(outputs):
        by_kind.setdefault((t.dtype, t.device), []).append(i)
    works, parts = [], []
    for idx in by_kind.values():
        ts = [outputs[i] for i in idx]
        if len(ts) == 1 and ts[0].is_contiguous():
            buf, fused = ts[0], None
        else:
            buf, fused = torch.cat([t.reshape(-1) for t in ts]), ts
        _scale_(buf, pre)
        works.extend(_works(dist.all_reduce(buf, op=_TORCH_OP[op], group=group, async_op=_async())))
        parts.append((buf, fused))

    def finish():
        for buf, fused in parts:
            _scale_(buf, post)
            if fused is not None:
                offset = 0
                for t in fused:
                    t.copy_(buf[offset:offset + t.numel()].view(t.shape))
                    offset += t.numel()
        return outputs

    return _Pending(works, finish, keep=parts)


def _allreduce_handle(kind, tensors, outputs_of, name, op, prescale_factor, postscale_factor, process_set,
                      grouped) -> int:
    ps = member(process_set, kind)
    pre, e1 = _float_or_error(kind, "prescale_factor", prescale_factor)
    post, e2 = _float_or_error(kind, "postscale_factor", postscale_factor)
    tensors = list(tensors)
    error = _first_error(e1, e2, _check_reduce_op(kind, op), *(_check_tensor(kind, t, REDUCE_DTYPES) for t in tensors))
    if error is None and not tensors:
        error = ValueError(f"hpccomm.horovod {kind}: the list of tensors is empty")
    if error is None and len({t.device for t in tensors}) > 1:
        error = ValueError(f"hpccomm.horovod {kind}: tensors in the list must be on the same device")
    descs = tuple(_tdesc(t) for t in tensors) if error is None else ()
    negotiate(ps, (kind, name, (("op", OP_NAMES.get(op, op)), ("prescale_factor", pre),
                                ("postscale_factor", post)), descs), error)
    outputs = outputs_of(tensors)
    pending = _start_allreduce(ps, outputs, op, pre, post)
    if grouped:
        inner = pending.finish
        pending.finish = lambda: tuple(inner())
    else:
        inner = pending.finish
        pending.finish = lambda: inner()[0]
    return _handle(pending)


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
        :class:`HorovodInternalError` naming it).
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
        :class:`HorovodInternalError` naming it).
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


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Reduce a sparse COO tensor by allgathering its indices and values (how
    DistributedOptimizer reduces sparse gradients unless ``sparse_as_dense``).

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
    t = tensor.coalesce() if not tensor.is_coalesced() else tensor
    h_idx = allgather_async(t._indices().t().contiguous(), name=f"{name}.indices" if name else None,
                            process_set=process_set)
    h_val = allgather_async(t._values(), name=f"{name}.values" if name else None, process_set=process_set)

    def finish():
        values = synchronize(h_val)
        indices = synchronize(h_idx)
        if op == Average:
            values = values / len(process_set.ranks)
        return torch.sparse_coo_tensor(indices.t(), values, t.size(), check_invariants=True)

    return finish


# -- allgather ---------------------------------------------------------------------------------------

def _start_allgather(ps, tensor, sizes) -> _Pending:
    out = torch.empty((sum(sizes), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    parts = list(out.split(sizes))
    src = tensor.detach().contiguous()
    work = dist.all_gather(parts, src, group=ps._data, async_op=_async())
    return _Pending(_works(work), lambda: out, keep=(parts, src))


def _check_gatherable(kind, tensors):
    error = _first_error(*(_check_tensor(kind, t, MOVE_DTYPES) for t in tensors))
    if error is None and any(t.dim() == 0 for t in tensors):
        error = ValueError(f"hpccomm.horovod {kind}: cannot {kind.replace('grouped_', '')} a 0-dimensional tensor "
                           "(the result is concatenated along the first dimension); reshape it to (1,)")
    return error


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    """Start gathering ``tensor`` from every rank of the set, concatenated
    along the first dimension, which may differ between ranks.

    :param tensor: the tensor (at least 1-D; the other dimensions must match).
    :param name: a name, checked to be the same on every rank.
    :param process_set: the :class:`ProcessSet`.
    :returns: a handle; :func:`synchronize` returns the gathered tensor.
    :raises ValueError: a bad argument on this rank (the others raise
        :class:`HorovodInternalError` naming it).
    :raises HorovodInternalError: the ranks' dtypes or trailing dimensions differ.

    Example::

        h = hvd.allgather_async(torch.full((hvd.rank() + 1, 2), hvd.rank()))
        everything = hvd.synchronize(h)      # size(size+1)/2 rows
    """
    kind = "allgather"
    ps = member(process_set, kind)
    error = _check_gatherable(kind, [tensor])
    descs = (_tdesc(tensor, skip_dim0=True),) if error is None else ()
    sizes = negotiate(ps, (kind, name, (), descs), error, size0=tensor.shape[0] if error is None else 0)
    return _handle(_start_allgather(ps, tensor, sizes))


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
    error = _check_gatherable(kind, tensors)
    if error is None and not tensors:
        error = ValueError(f"hpccomm.horovod {kind}: the list of tensors is empty")
    descs = tuple(_tdesc(t, skip_dim0=True) for t in tensors) if error is None else ()
    negotiate(ps, (kind, name, (), descs), error)
    mine = torch.tensor([t.shape[0] for t in tensors], dtype=torch.int64)
    rows = torch.empty(len(ps.ranks) * len(tensors), dtype=torch.int64)
    _all_gather_single(rows, mine, group=ps._ctrl)
    rows = rows.view(len(ps.ranks), len(tensors))
    parts = [_start_allgather(ps, t, rows[:, i].tolist()) for i, t in enumerate(tensors)]
    return _handle(_Pending([w for p in parts for w in p.works], lambda: tuple(p.finish() for p in parts),
                            keep=parts))


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


# -- broadcast ----------------------------------------------------------------------------------------

def _broadcast_handle(kind, tensors, root_rank, name, process_set, in_place, grouped=False) -> int:
    ps = member(process_set, kind)
    error = _first_error(*(_check_tensor(kind, t, MOVE_DTYPES) for t in tensors))
    if error is None and (not isinstance(root_rank, int) or root_rank not in ps.ranks):
        error = ValueError(f"hpccomm.horovod {kind}: invalid root rank {root_rank!r} for the provided process set "
                           f"{ps.ranks} (root_rank is a global rank, hvd.rank() of the root)")
    descs = tuple(_tdesc(t) for t in tensors) if error is None else ()
    negotiate(ps, (kind, name, (("root_rank", root_rank),), descs), error)
    bufs = [(t.detach() if in_place else t.detach().clone(memory_format=torch.contiguous_format)) for t in tensors]
    works = _works(*[dist.broadcast(b, src=root_rank, group=ps._data, async_op=_async()) for b in bufs])
    if grouped:
        return _handle(_Pending(works, lambda: tuple(tensors if in_place else bufs), keep=bufs))
    return _handle(_Pending(works, lambda: tensors[0] if in_place else bufs[0], keep=bufs))


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    """Start broadcasting ``tensor`` from ``root_rank``; ``tensor`` is not modified.

    :param tensor: the tensor (same dtype and shape on every rank).
    :param root_rank: the global rank (``hvd.rank()``) that sends.
    :param name: a name, checked to be the same on every rank.
    :param process_set: the :class:`ProcessSet` (``root_rank`` must be in it).
    :returns: a handle; :func:`synchronize` returns a new tensor with the root's values.
    :raises ValueError: a bad argument on this rank (the others raise
        :class:`HorovodInternalError` naming it).
    :raises HorovodInternalError: the ranks' calls (dtype, shape, root) do not match.

    Example::

        h = hvd.broadcast_async(t, root_rank=0)
        from_root = hvd.synchronize(h)
    """
    return _broadcast_handle("broadcast", [tensor], root_rank, name, process_set, in_place=False)


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
    return _broadcast_handle("broadcast", [tensor], root_rank, name, process_set, in_place=True)


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


# -- alltoall --------------------------------------------------------------------------------------

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
        :class:`HorovodInternalError` naming it).
    :raises HorovodInternalError: the ranks' calls do not match.

    Example::

        out, got = hvd.synchronize(hvd.alltoall_async(t, splits=[1] * hvd.size()))
    """
    kind = "alltoall"
    ps = member(process_set, kind)
    n = len(ps.ranks)
    error = _check_gatherable(kind, [tensor])
    send = None
    if error is None:
        if splits is None:
            if tensor.shape[0] % n:
                error = ValueError(f"hpccomm.horovod {kind}: splits not provided, but first dimension of tensor "
                                   f"({tensor.shape[0]}) is not an even multiple of the number of workers ({n})")
            else:
                send = [tensor.shape[0] // n] * n
        else:
            if isinstance(splits, torch.Tensor):
                if splits.dim() > 1:
                    error = ValueError(f"hpccomm.horovod {kind}: alltoall expects a 1D splits tensor")
                elif splits.dtype != torch.int32:
                    error = ValueError(f"hpccomm.horovod {kind}: alltoall expects splits to contain 32-bit integer "
                                       f"elements, got {splits.dtype}")
                send = splits.tolist()
            else:
                send = list(splits)
            if error is None and (len(send) != n or any(not isinstance(s, int) or s < 0 for s in send)):
                error = ValueError(f"hpccomm.horovod {kind}: splits {send} must be {n} non-negative integers (one per "
                                   "rank of the process set)")
            elif error is None and sum(send) > tensor.shape[0]:
                error = ValueError(f"hpccomm.horovod {kind}: Sum of splits entries ({sum(send)}) is greater than the "
                                   f"first dimension of tensor ({tensor.shape[0]})")
    descs = (_tdesc(tensor, skip_dim0=True),) if error is None else ()
    negotiate(ps, (kind, name, (), descs), error)
    recv = torch.empty(n, dtype=torch.int64)
    dist.all_to_all_single(recv, torch.tensor(send, dtype=torch.int64), group=ps._ctrl)
    recv_list = recv.tolist()
    src = tensor.detach()[:sum(send)].contiguous()
    out = torch.empty((sum(recv_list), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
    work = dist.all_to_all_single(out, src, output_split_sizes=recv_list, input_split_sizes=send,
                                  group=ps._data, async_op=_async())
    received = recv.to(torch.int32)
    return _handle(_Pending(_works(work), lambda: (out, received), keep=(src, out)))


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


# -- reducescatter ------------------------------------------------------------------------------------

def _rows(total: int, n: int):
    """Horovod's split of the first dimension: the first ``total % n`` ranks get one row more."""
    q, r = divmod(total, n)
    return [q + 1 if i < r else q for i in range(n)]


def _start_reducescatter(ps, tensor, op, pre, post) -> _Pending:
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
        _scale_(inp, pre)
    out = src.new_empty((most, *rest))
    work = _reduce_scatter_single(out, inp, op=_TORCH_OP[op], group=ps._data, async_op=_async())
    post = post / n if op == Average else post

    def finish():
        mine = out[:rows[ps.rank()]]
        _scale_(mine, post)
        return mine

    return _Pending(_works(work), finish, keep=(inp, out))


def _reducescatter_handle(kind, tensors, name, op, prescale_factor, postscale_factor, process_set, grouped) -> int:
    ps = member(process_set, kind)
    pre, e1 = _float_or_error(kind, "prescale_factor", prescale_factor)
    post, e2 = _float_or_error(kind, "postscale_factor", postscale_factor)
    tensors = list(tensors)
    op_error = None
    if op == Adasum:
        op_error = _check_reduce_op(kind, op)
    elif op not in (Average, Sum):
        op_error = ValueError(f"hpccomm.horovod {kind}: op={OP_NAMES.get(op, op)}: Reducescatter currently only "
                              "supports AVERAGE and SUM (hvd.Average, hvd.Sum)")
    error = _first_error(e1, e2, op_error, *(_check_tensor(kind, t, REDUCE_DTYPES) for t in tensors))
    if error is None and not tensors:
        error = ValueError(f"hpccomm.horovod {kind}: the list of tensors is empty")
    if error is None and any(t.dim() == 0 for t in tensors):
        error = ValueError(f"hpccomm.horovod {kind}: cannot reducescatter a 0-dimensional tensor (it is split along "
                           "the first dimension); reshape it to (1,)")
    descs = tuple(_tdesc(t) for t in tensors) if error is None else ()
    negotiate(ps, (kind, name, (("op", OP_NAMES.get(op, op)), ("prescale_factor", pre),
                                ("postscale_factor", post)), descs), error)
    parts = [_start_reducescatter(ps, t, op, pre, post) for t in tensors]
    works = [w for p in parts for w in p.works]
    if grouped:
        return _handle(_Pending(works, lambda: tuple(p.finish() for p in parts), keep=parts))
    return _handle(_Pending(works, parts[0].finish, keep=parts))


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
        :class:`HorovodInternalError` naming it).
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


# -- barrier and join -------------------------------------------------------------------------------------

def barrier(process_set=global_process_set) -> None:
    """Block until every rank of the set has called it (ranks that have
    joined count as arrived, as in Horovod).

    :param process_set: the :class:`ProcessSet`.
    :raises ValueError: not initialised, or this rank is not in the set.
    :raises HorovodInternalError: the ranks called different ops at this point.

    Example::

        hvd.barrier()
    """
    ps = member(process_set, "barrier")
    negotiate(ps, ("barrier", None, (), ()))
    dist.barrier(group=ps._data)


def _feed(ps: ProcessSet, desc, device) -> None:
    """As a joined rank, take part in ``desc``'s data step with zeros."""
    kind = desc[0]
    if kind == "barrier":
        dist.barrier(group=ps._data)
        return
    if kind == "optimizer":
        from . import optimizer

        _shadows.extend(optimizer.feed_round(desc, device))
        return
    params = dict(desc[2])
    op = next(o for o, n in OP_NAMES.items() if n == params["op"])
    zeros = [torch.zeros(shape, dtype=getattr(torch, dtype), device=device) for dtype, shape, _ in desc[3]]
    _start_allreduce(ps, zeros, op, params["prescale_factor"], params["postscale_factor"]).wait()


def join(device=-1) -> int:
    """Say this rank has no more data: until every rank has joined, it takes
    part in the other ranks' allreduces (and DistributedOptimizer's) with
    zeros, as Horovod does; returns the global rank that joined last.

    An Average still divides by the full size. Broadcast, allgather, alltoall
    and reducescatter raise on the other ranks while a rank has joined
    (Horovod's rule).

    :param device: where the zeros live: -1 (CPU, default) or a CUDA device index.
    :raises ValueError: Horovod is not initialised.

    Example::

        for batch in my_uneven_share_of_the_data:
            train_step(batch)
        last = hvd.join()
    """
    ps = member(global_process_set, "join")
    where = torch.device("cpu") if device is None or device < 0 else torch.device("cuda", device)
    joined_at = ps.negotiations + 1
    try:
        while True:
            done, last, desc = _join_negotiate(ps, joined_at)
            if done:
                break
            if desc is not None:
                _feed(ps, desc, where)
        for pending in _shadows:
            pending.wait()
    finally:
        _shadows.clear()
    return last
