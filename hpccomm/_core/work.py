"""The Work hpccomm hands to torch for every op, made here only: :func:`finished`
(an op that completed inside its call) or :func:`pending` (an op in flight,
which it asks everything of its record, hpccomm._core.record).

torch's C++ callers (DDP's reducer, functional collectives) wait on
``get_future()``, never on ``wait()``, so every Work's future completes by
itself; its value is the op's output tensors (DDP reads them).  An op's
error, naming it, is raised by ``wait()``, ``result()`` and the future.
"""
from __future__ import annotations

from datetime import timedelta

import torch

from .._compat import WorkBase, hide_from_compiler


class Work(WorkBase):
    """``_op``: the op's record while in flight, None once complete in its
    call; ``_outputs``: the future's value (it keeps the tensors alive);
    ``_devices``: the CUDA devices a future of them names."""

    __slots__ = ("_op", "_outputs", "_devices", "_future")  # (set by the makers below)

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._op is not None:
            self._op.wait(timeout.total_seconds() if timeout else None)  # (torch passes 0 or None: no limit)
        return True

    def get_future(self) -> torch.futures.Future:
        if self._op is not None:
            return self._op.future()
        if self._future is None:
            self._future = torch.futures.Future(devices=self._devices) if self._devices else torch.futures.Future()
            self._future.set_result(self._outputs)
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
    """The Work of the op in flight ``record``; ``outputs``: its future's value."""
    work = Work()
    work._op = record
    work._outputs = outputs
    return work


# What torch's C++ layer calls on a Work: kept out of torch.compile.
hide_from_compiler(Work, ["wait", "get_future", "is_completed", "is_success", "exception", "result",
                          "source_rank", "_source_rank"])
