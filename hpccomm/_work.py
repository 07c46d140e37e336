"""The Work objects hpccomm hands to torch.

torch's C++ callers (DDP's reducer, functional collectives) wait on
``get_future()`` and never call ``wait()``, so every Work's future must
complete by itself; its value is the list of output tensors (DDP reads it).

A Work is either born done (a blocking op already ran) or wraps a
``Pending`` operation: an object with ``test() -> bool`` (non-blocking),
``wait(seconds or None) -> bool`` and ``finish() -> source rank or None``
(run once, after completion, in the completing thread; it may raise).  An
error from any of them completes the Work with that error (wrapped in
:class:`hpccomm.errors.HpccommError` naming the op), which ``wait()`` and the
future raise: a pending op never dies silently on the progress thread.
A pending Work completes when its owner calls ``wait()``, or, once someone
asked for its future, on the progress thread, which then runs the callbacks
chained on that future (a callback asking for another pending op's future
gets it completed in place).

A failed op's future must fail where C++ sees it: ``Future.set_exception``
only stores the exception as the future's *value* (unwrapped in Python), so
DDP or a functional collective would read it as a successful result.  So a
pending Work's future is chained, ``raw.then(result_or_raise)``, and the
callback raises: torch records that as the future's error.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Optional

import torch

from ._compat import WorkBase, hide_from_compiler
from .errors import HpccommError


class Work(WorkBase):
    """A finished or pending hpccomm operation (see the module docstring)."""

    def __init__(self, outputs, pending=None, describe: str = "", devices=None) -> None:
        super().__init__()
        # A future holding CUDA tensors must name their devices: torch then orders
        # the waiter's stream after the completing thread's (hpccomm.gpu).
        self._devices = devices
        self._outputs = outputs  # the future's value; also keeps the tensors alive
        self._pending = pending  # holds the MPI request and its buffers until done
        self._describe = describe
        self._source = -1
        self._error: Optional[BaseException] = None
        self._done = pending is None
        if self._done:
            # Born done (the blocking path, which is latency-bound): no lock, event or
            # future until someone asks; get_future() makes a completed one then.
            self._engine_completes = False
            self._future = None
            self._completed = None
            return
        self._lock = threading.Lock()  # one thread at a time touches the MPI request
        # Ops queued on the comm thread are always completed there, right after they
        # run, so callbacks chained on their futures (DDP hooks that issue more ops)
        # run at the same point of the op sequence on every rank.
        self._engine_completes = getattr(pending, "engine_completes", False)
        # Set once the Work is complete, by whichever thread (waited on by engine ops).
        self._completed = threading.Event() if self._engine_completes else None
        self._raw = self._new_future()
        # completes with the outputs, or fails visibly to C++ (see the module docstring)
        self._future = self._raw.then(self._result_or_raise)

    def _new_future(self) -> torch.futures.Future:
        return torch.futures.Future(devices=self._devices) if self._devices else torch.futures.Future()

    def _result_or_raise(self, _raw):
        if self._error is not None:
            raise self._error
        return self._outputs

    def _complete(self, error: Optional[BaseException] = None) -> None:
        """Run the pending op's finish step; caller holds ``_lock``, request
        done (or failed with ``error``)."""
        pending, self._pending = self._pending, None
        if error is None:
            try:
                source = pending.finish()
                if source is not None:
                    self._source = source
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                error = exc
        if isinstance(error, Exception) and not isinstance(error, HpccommError):
            wrapped = HpccommError(f"hpccomm {self._describe}: {type(error).__name__}: {error}")
            wrapped.__cause__ = error
            error = wrapped
        self._error = error
        self._done = True
        self._raw.set_result(None)  # runs _result_or_raise, then the callbacks chained on the future
        if self._completed is not None:
            self._completed.set()  # after the callbacks: ops they issued come before the waiter's next op

    def _settled(self) -> bool:
        """Done and its future complete.  ``_done`` turns True a moment before
        the completing thread completes the future (``_raw.set_result``): a
        waiter on another thread must not return in between, or
        ``get_future().value()`` finds an incomplete future."""
        return self._future is None or self._future.done()

    def _complete_on_engine(self) -> None:
        """The comm thread completes a Work whose op it just ran."""
        with self._lock:
            if not self._done:
                self._complete()

    def _poll(self) -> bool:
        """Non-blocking progress from the progress thread; True once done."""
        if self._done:
            return self._settled()
        if self._engine_completes:
            return False  # the comm thread completes it (see __init__)
        if not self._lock.acquire(blocking=False):
            return False  # a waiter holds it and will finish the op
        try:
            if not self._done:
                try:
                    finished = self._pending.test()
                except Exception as exc:  # noqa: BLE001 - the op failed; its waiter learns why
                    self._complete(exc)
                else:
                    if finished:
                        self._complete()
            return self._done
        finally:
            self._lock.release()

    # -- torch's Work API ---------------------------------------------------
    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._done:
            seconds = None
            if timeout is not None and timeout != timedelta(0):
                seconds = timeout.total_seconds()
            if self._engine_completes:
                finished = self._completed.wait(seconds)
            else:
                finished = self._wait_pending(seconds)
            if not finished:
                raise TimeoutError(f"hpccomm {self._describe}: not complete after {seconds:g} s")
        elif not self._settled():  # another thread is completing it right now: wait for its future
            try:
                self._future.wait()
            except Exception:  # noqa: BLE001 - the same error is raised below
                pass
        if self._error is not None:
            raise self._error
        return True

    def _wait_pending(self, seconds) -> bool:
        with self._lock:
            if self._done:
                return True
            try:
                finished = self._pending.wait(seconds)
            except Exception as exc:  # noqa: BLE001 - the op failed
                self._complete(exc)
                return True
            if finished:
                self._complete()
            return finished

    def get_future(self) -> torch.futures.Future:
        if self._future is None:  # born done: its future is made on first request
            future = self._new_future()
            future.set_result(self._outputs)
            self._future = future
            return future
        if not self._done:
            if _progress.is_current():
                # Asked by a callback that the progress thread is running: that
                # thread cannot complete this op while it runs the callback, so
                # complete it here (an error goes to the future).
                try:
                    self.wait()
                except Exception:  # noqa: BLE001 - the future carries it
                    pass
            else:
                _progress.watch(self)
        return self._future

    def is_completed(self) -> bool:
        return self._poll()

    def is_success(self) -> bool:
        return self._poll() and self._error is None

    def exception(self):
        return self._error

    def result(self):
        self.wait()
        return self._outputs

    def source_rank(self) -> int:
        return self._source

    def _source_rank(self) -> int:
        return self._source


# What torch's C++ layer calls on a Work (and the future's callback): kept out of torch.compile.
hide_from_compiler(Work, ["wait", "get_future", "is_completed", "is_success", "exception", "result",
                          "source_rank", "_source_rank", "_result_or_raise"])


def done(outputs, devices=None) -> Work:
    """A Work for an op that already completed (the blocking path)."""
    return Work(outputs, devices=devices)


class _Progress:
    """A daemon thread that completes watched pending Works, so that their
    futures complete without anyone calling ``wait()``."""

    def __init__(self) -> None:
        self._works: list[Work] = []
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None

    def is_current(self) -> bool:
        """Whether the calling thread is the progress thread (running a future's callback)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def watch(self, work: Work) -> None:
        with self._cv:
            if work not in self._works:
                self._works.append(work)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="hpccomm-progress", daemon=True)
                self._thread.start()
            self._cv.notify()

    def _run(self) -> None:
        idle = 1e-5
        while True:
            with self._cv:
                while not self._works:
                    self._cv.wait()
                works = list(self._works)
            finished = [w for w in works if w._poll()]
            if finished:
                with self._cv:
                    self._works = [w for w in self._works if w not in finished]
                idle = 1e-5
            else:
                time.sleep(idle)  # back off up to 1 ms while nothing completes
                idle = min(idle * 2, 1e-3)


_progress = _Progress()
