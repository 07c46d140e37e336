"""The Work hpccomm hands to torch for every op.

A Work is made here only: :func:`finished` for an op that completed inside
its call (a blocking collective run in the calling thread), or
:func:`pending` for an op in flight, which waits on the op's record
(hpccomm._core.record) and asks it everything.  torch's C++ callers (DDP's
reducer, functional collectives) wait on ``get_future()`` and never call
``wait()``, so every Work's future completes by itself; its value is the
list of output tensors (DDP reads it).  An op's error (an
:class:`hpccomm.errors.HpccommError` naming the op) is raised by ``wait()``,
``result()`` and the future: a pending op never dies silently on another
thread.
"""
from __future__ import annotations

from datetime import timedelta

import torch

from .._compat import WorkBase, hide_from_compiler


class Work(WorkBase):
    """An op's Work, as torch sees it (see the module docstring): ``_op`` its
    record while in flight (None once it completed inside its call);
    ``_outputs`` the future's value (it keeps the tensors alive), ``_devices``
    the CUDA devices a future of them must name."""

    # (torch's Work is constructed without arguments: the fields are set by this module's two makers)
    __slots__ = ("_op", "_outputs", "_devices", "_future")

    def wait(self, timeout: timedelta | None = None) -> bool:
        op = self._op
        if op is not None:
            op.wait(timeout.total_seconds() if timeout else None)  # (torch passes 0 or None for no limit)
        return True

    def get_future(self) -> torch.futures.Future:
        op = self._op
        if op is not None:
            return op.future()
        if self._future is None:
            future = torch.futures.Future(devices=self._devices) if self._devices else torch.futures.Future()
            future.set_result(self._outputs)
            self._future = future
        return self._future

    def is_completed(self) -> bool:
        return self._op is None or self._op.test()

    def is_success(self) -> bool:
        return self._op is None or (self._op.test() and self._op.error is None)

    def exception(self):
        return None if self._op is None else self._op.error

    def result(self):
        self.wait()
        return self._outputs

    def source_rank(self) -> int:
        return -1 if self._op is None else self._op.source

    def _source_rank(self) -> int:
        return self.source_rank()


def finished(outputs, devices=None) -> Work:
    """The Work of an op that already completed: no lock, no future until asked for."""
    work = Work()
    work._op = None
    work._outputs = outputs
    work._devices = devices
    work._future = None
    return work


def pending(record, outputs=None) -> Work:
    """The Work of the op in flight ``record``; ``outputs`` its future's value."""
    work = Work()
    work._op = record
    work._outputs = outputs
    return work


# What torch's C++ layer calls on a Work: kept out of torch.compile.
hide_from_compiler(Work, ["wait", "get_future", "is_completed", "is_success", "exception", "result",
                          "source_rank", "_source_rank"])
