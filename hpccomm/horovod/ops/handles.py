"""What an op leaves behind until :func:`synchronize`: its handle, its started
data step (:class:`Pending`), and the names it holds.

Names follow Horovod's rule: on one process set, no two ops in flight may
have the same name.  Horovod names each tensor of an op ``<op>.<name>``
(``allreduce.loss``; a grouped op's tensors ``grouped_allreduce.grads_1of3``,
...), so an allgather may share its name with an allreduce; an op without a
name holds none.  An op checks its names on the calling rank before anything
is sent (a clash raises ``ValueError`` there, with Horovod's words); its handle
holds them until it is synchronized (an op that fails before returning a
handle never held them).
Horovod frees a name once its background thread has run the op, which may be
before ``synchronize``; freeing at ``synchronize`` makes the rule the same on
every run and every rank running the same program (docs/horovod.md).
"""
from __future__ import annotations

import itertools
import threading
from contextlib import contextmanager

from ..basics import HorovodInternalError
from .checks import where

DUPLICATE_NAME = ("Requested to allreduce, allgather, or broadcast a tensor with the same name as another tensor "
                  "that is currently being processed. If you want to request another tensor, use a different "
                  "tensor name.")

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


def run_async() -> bool:
    """The ``async_op`` a data step passes to torch.distributed now (see :func:`inline`)."""
    return not getattr(_tls, "inline", False)


def works(*started):
    """The Works among torch ops' return values (a blocking torch op returns None)."""
    return [w for w in started if w is not None]


class Pending:
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


def one_or_all(results, grouped: bool):
    """An op's result: a tuple of every tensor's for a grouped op, else the one tensor's."""
    return tuple(results) if grouped else results[0]


_handles: dict = {}   # handle -> (Pending, the names it holds)
_handle_ids = itertools.count(1)
_names: dict = {}     # (process set id, Horovod's tensor name) -> the handle holding it


def reset() -> None:
    """Forget every handle and name (at shutdown)."""
    _handles.clear()
    _names.clear()


def tensor_names(kind: str, name, count: int = 1) -> list:
    """Horovod's names for the tensors of op ``kind`` called with ``name``
    (none for an unnamed op: Horovod names it by its handle, which never clashes)."""
    if name is None or name == "":
        return []
    base = f"{kind}.{name}"
    if not kind.startswith("grouped_"):
        return [base]
    return [f"{base}_{i}of{count}" for i in range(1, count + 1)]


def check_free(ps, kind: str, name, names) -> list:
    """``names`` (Horovod's tensor names) as keys of the names table, checked
    to be free on ``ps``; called by op ``kind`` with ``name`` before it sends anything.

    :raises ValueError: an op in flight on ``ps`` holds one of ``names``.
    """
    keys = [(ps.process_set_id, n) for n in names]
    for key in keys:
        if key in _names:
            raise ValueError(
                f"{where(kind, ps, name, ps.negotiations + 1)}: {DUPLICATE_NAME} Tensor name {key[1]!r} is held by "
                f"handle {_names[key]}, which has not been synchronized; synchronize it first, or use another name. "
                f"Nothing was sent: ranks that did start this op wait for this rank's next op on process set "
                f"{ps.process_set_id}.")
    return keys


def free_names(ps, kind: str, name, count: int = 1) -> list:
    """The names op ``kind`` called with ``name`` (``count`` tensors) takes on
    ``ps``, checked to be free (:func:`check_free`); :func:`new_handle` takes them."""
    return check_free(ps, kind, name, tensor_names(kind, name, count))


def new_handle(pending: Pending, names=()) -> int:
    """A handle for a started op; it holds ``names`` (from :func:`free_names`) until synchronized.
    (An op that fails before it has a handle never held its names.)"""
    h = next(_handle_ids)
    _handles[h] = (pending, names)
    for key in names:
        _names[key] = h
    return h


def _release(names) -> None:
    for key in names:
        _names.pop(key, None)


def discard(handle: int) -> None:
    """Forget a handle whose result nobody will read; its names are free again.
    Its transfer still completes (the Works hold their tensors)."""
    entry = _handles.pop(handle, None)
    if entry is not None:
        _release(entry[1])


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
    entry = _handles.get(handle)
    if entry is None:
        raise ValueError(f"Handle {handle} was not created or has been cleared.")
    return entry[0].done()


def synchronize(handle: int):
    """Wait for the async op behind ``handle`` and return its result (a tensor,
    a tuple of tensors for grouped ops and for alltoall, the tensor and the
    received splits). An unknown handle returns None, as in Horovod. The op's
    name is free again afterwards, whether it succeeded or failed.

    :param handle: from an ``*_async`` function.
    :raises HorovodInternalError: the op failed.

    Example::

        h = hvd.allgather_async(t)
        gathered = hvd.synchronize(h)
    """
    entry = _handles.pop(handle, None)
    if entry is None:
        return None
    pending, names = entry
    try:
        return pending.wait()
    finally:
        _release(names)
