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
from _thread import allocate_lock as _allocate_lock
from datetime import timedelta
from typing import Optional

import torch

from . import _ft, _mpi, _status
from ._compat import WorkBase, hide_from_compiler
from ._engine import Job as _Job
from ._engine import engine as _engine
from ._engine import latch as _latch
from ._watchdog import watchdog
from .errors import HpccommError
from .ops._common import Posted as _Posted
from .ops.p2p import Pending as _P2P

_work_init = WorkBase.__init__
_end_watch = _status.end
_watched = _status.watched


class Work(WorkBase):
    """A finished or pending hpccomm operation (see the module docstring)."""

    # Slots for what every Work sets, and a receive's source (an op path that makes a Work per op pays for
    # no dict insertion through pybind's instance type); what few Works ever set is
    # read from the class until then (an instance dict only when set).
    __slots__ = ("_outputs", "_pending", "_done", "_lock", "_engine_completes", "_source", "__dict__")
    # A future holding CUDA tensors must name their devices: torch then orders the
    # waiter's stream after the completing thread's (hpccomm.gpu).
    _devices = None
    _describe = ""  # a string, a function making it, or "": the pending's describe()
    _error = None
    # The future torch sees, and the one completion sets (the first is chained on
    # it): made on the first get_future(), so an op nobody asks a future of never
    # pays for one.
    _future = _rawf = None
    # An engine op's latch (hpccomm._engine.latch): made by the first waiter that
    # has to sleep, opened once the Work is complete and its callbacks ran.
    _completed = None

    def __init__(self, outputs, pending=None, describe="", devices=None) -> None:
        _work_init(self)
        self._outputs = outputs  # the future's value; also keeps the tensors alive
        self._pending = pending  # holds the MPI request and its buffers until done
        self._source = -1  # a receive's source rank, once known (a slot: every receive sets it)
        if describe:
            self._describe = describe
        if devices:
            self._devices = devices
        if pending is None:
            self._done = True
            self._lock = None
            self._engine_completes = False
            return
        self._done = False
        self._lock = _allocate_lock()  # one thread at a time touches the MPI request
        # Ops queued on the comm thread are always completed there (or by their waiter
        # in its place), right after they run, so callbacks chained on their futures
        # (DDP hooks that issue more ops) run at the same point of the op sequence on
        # every rank.
        self._engine_completes = pending.engine_completes

    @property
    def _raw(self) -> torch.futures.Future:
        """The future that completion sets (made, with the chained one, on first use)."""
        if self._rawf is None:
            self._make_future()
        return self._rawf

    @_raw.setter
    def _raw(self, future) -> None:
        self._rawf = future

    def _make_future(self) -> None:
        """Make the futures (caller holds ``_lock``, or the Work is born done): the
        chained one completes with the outputs, or fails visibly to C++ (see the
        module docstring); complete at once if the op already is."""
        raw = self._new_future()
        self._rawf = raw
        self._future = raw.then(self._result_or_raise)
        if self._done:
            raw.set_result(None)

    def _what(self, pending=None) -> str:
        """What this Work is, for messages (an async op is numbered when it runs)."""
        d = self._describe
        if d:
            return d() if callable(d) else d
        pending = self._pending if pending is None else pending
        return pending.describe() if pending is not None else "op"

    def _new_future(self) -> torch.futures.Future:
        return torch.futures.Future(devices=self._devices) if self._devices else torch.futures.Future()

    def _result_or_raise(self, _raw):
        if self._error is not None:
            raise self._error
        return self._outputs

    def _complete(self, error: Optional[BaseException] = None, release: bool = True) -> None:
        """Run the pending op's finish step; caller holds ``_lock``, request
        done (or failed with ``error``).  ``release``: open the latch of an
        engine op now (the comm thread opens it itself, a moment later)."""
        pending, self._pending = self._pending, None
        token = getattr(pending, "token", None)
        if token is not None:
            _end_watch(token)  # the watchdog stops watching it (watchdog.end, without its call)
        if error is None:
            try:
                source = pending.finish()
                if source is not None:
                    self._source = source
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                error = exc
        if error is not None:  # the success path tests this one thing
            if _ft.state.enabled:  # a rank died (fault-tolerance mode): hpccomm.RankFailure
                error = _ft.from_pending(self._what(pending), pending, error)
            if isinstance(error, Exception) and not isinstance(error, HpccommError):
                wrapped = HpccommError(f"hpccomm {self._what(pending)}: {type(error).__name__}: {error}")
                wrapped.__cause__ = error
                error = wrapped
            self._error = error
        self._done = True
        raw = self._rawf
        if raw is not None:
            raw.set_result(None)  # runs _result_or_raise, then the callbacks chained on the future
        if release and self._completed is not None:
            self._completed.release()  # after the callbacks: ops they issued come before the waiter's next op

    def _settled(self) -> bool:
        """Done and its future complete.  ``_done`` turns True a moment before
        the completing thread completes the future (``_raw.set_result``): a
        waiter on another thread must not return in between, or
        ``get_future().value()`` finds an incomplete future."""
        return self._future is None or self._future.done()

    def _finish_on_engine(self) -> None:
        """The comm thread completes a Work whose op it just ran (callbacks
        included); it opens the latch itself afterwards."""
        with self._lock:
            if not self._done:
                job = self._pending
                if job.error is None and self._rawf is None:
                    # The common case, _complete's work without its calls: the op
                    # succeeded and nobody asked for a future (no callbacks to run).
                    self._outputs = job.result  # the future's value: the op's outputs
                    self._pending = None
                    self._done = True
                    return
                self._complete(release=False)

    def _complete_on_engine(self) -> None:
        """Complete a Work whose op just ran, and let its waiters go."""
        with self._lock:
            if not self._done:
                self._complete()

    def _hand_to_engine(self) -> None:
        """A posted collective (hpccomm.ops._common.Posted) is from now on
        completed by the comm thread: a queued job waits on its request and
        completes this Work, callbacks included, at its place in the group's
        op order (ops issued later on the group queue behind it on every
        rank).  Asked for by :meth:`get_future`."""
        with self._lock:  # not while a waiter or the progress thread is in the request
            if self._done or self._engine_completes:
                return
            posting = self._pending
            job = _Job(posting.group, _wait_posted, posting.op, posting)
            job.seq = posting.seq
            job.work = self
            self._pending = job
            self._engine_completes = True
        _engine.submit(job)

    def _poll(self) -> bool:
        """Non-blocking progress from the progress thread; True once done."""
        if self._done:
            return self._settled()
        if self._engine_completes:
            return False  # the comm thread completes it (see __init__)
        if not self._lock.acquire(False):
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
        if not timeout and not self._done and (self._pending.__class__ is _Posted or self._pending.__class__ is _P2P) \
                and not self._engine_completes:
            # A posted collective or a point-to-point op waited for without a time limit (torch
            # passes 0 or None for none; its blocking send/recv wait at once), the latency-bound
            # case: _wait_pending and Request.wait without their calls, and when nothing is left
            # to finish, _complete (with a receive's check of what arrived) without its calls.
            with self._lock:
                if not self._done and not self._engine_completes:
                    pending = self._pending
                    try:
                        pending.req.Wait(pending.status)
                    except _mpi.mpi().Exception as exc:  # finish() reports it, naming the op
                        pending.error = exc
                    else:
                        if pending.after is None and not pending.traced and self._rawf is None:
                            settled = True
                            if pending.is_recv:  # from a named rank, as many elements as the tensor holds
                                source = pending.peer
                                count, datatype = pending.expect
                                settled = source is not None and pending.status.Get_elements(datatype) == count
                                if settled:
                                    self._source = source
                            if settled:
                                _watched.pop(pending.token, None)  # _status.end, without its call
                                self._pending = None
                                self._done = True
                                return True
                    self._complete()  # any source, a staged receive, a short message, an error, a future
                    if self._error is not None:
                        raise self._error
                    return True
        if not self._done:
            seconds = None
            if timeout is not None and timeout != timedelta(0):
                seconds = timeout.total_seconds()
            if not self._engine_completes:
                finished = self._wait_pending(seconds)
                if finished is None:  # handed to the comm thread meanwhile (get_future)
                    return self.wait(timeout)
            else:
                job = self._pending
                # Not run yet and nothing else queued: run it here rather than sleep while
                # the comm thread does (hpccomm._engine.Engine.steal); with a time limit,
                # wait instead (the op could outlast it).
                if seconds is None and job is not None and _engine.steal(job):
                    finished = True
                else:
                    with self._lock:  # (the comm thread opens the latch if it exists once done)
                        latch = None if self._done else self._completed
                        if latch is None and not self._done:
                            latch = self._completed = _latch()
                    finished = True
                    if latch is not None:
                        finished = latch.acquire(True, -1 if seconds is None else seconds)
                        if finished:
                            latch.release()  # open for any other waiter
            if not finished:
                raise TimeoutError(f"hpccomm {self._what()}: not complete after {seconds:g} s")
        elif not self._settled():  # another thread is completing it right now: wait for its future
            try:
                self._future.wait()
            except Exception:  # noqa: BLE001 - the same error is raised below
                pass
        if self._error is not None:
            raise self._error
        return True

    def _wait_pending(self, seconds):
        """Wait in the caller; None if the comm thread completes it now (:meth:`_hand_to_engine`)."""
        with self._lock:
            if self._done:
                return True
            if self._engine_completes:
                return None
            try:
                finished = self._pending.wait(seconds)
            except Exception as exc:  # noqa: BLE001 - the op failed
                self._complete(exc)
                return True
            if finished:
                self._complete()
            return finished

    def get_future(self) -> torch.futures.Future:
        if self._future is None:  # made on first request
            if self._lock is None:  # born done
                future = self._new_future()
                future.set_result(self._outputs)
                self._future = future
                return future
            with self._lock:  # not while another thread completes it
                if self._future is None:
                    self._make_future()
        if not self._done:
            from ._engine import engine

            if getattr(self._pending, "kind", "") == "collective" and engine.usable() and not _progress.is_current():
                # A posted collective: its callbacks run on the comm thread, in op order (see
                # _hand_to_engine); never on the progress thread.
                self._hand_to_engine()
            elif _progress.is_current() or (not self._engine_completes and not engine.usable()):
                # Asked by a callback that the progress thread is running (that thread
                # cannot complete this op while it runs the callback), or below
                # MPI_THREAD_MULTIPLE, where no other thread may call MPI (hpccomm._engine):
                # complete it here, in the caller (an error goes to the future).
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


def _wait_posted(job):
    """The comm thread's job for a posted collective handed to it
    (:meth:`Work._hand_to_engine`): wait on its request, finish it (an MPI
    error raises naming the op), and let the watchdog stop watching it."""
    posting = job.call
    try:
        posting.wait(None)
        posting.finish()
    finally:
        token, posting.token = posting.token, None
        if token is not None:
            _end_watch(token)
    return posting.outputs


class AllOf:
    """The Pending of a batch: done when every Work in ``works`` is (torch's
    coalesced point-to-point ops, ``batch_isend_irecv``); the first error wins."""

    token = None
    engine_completes = False

    def __init__(self, works) -> None:
        self.works = list(works)

    def test(self) -> bool:
        return all(w._poll() for w in self.works)

    def wait(self, seconds) -> bool:
        deadline = None if seconds is None else time.monotonic() + seconds
        for w in self.works:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if left is not None and left == 0.0 and not w._poll():
                return False
            try:
                w.wait(None if left is None else timedelta(seconds=left))
            except TimeoutError:
                return False
            except Exception:  # noqa: BLE001 - finish() raises the first error
                pass
        return True

    def finish(self):
        for w in self.works:
            if w._error is not None:
                raise w._error
        return None


class Done(WorkBase):
    """The Work of an op that already completed (the blocking path, which is
    latency-bound): the outputs, and their devices for a future of CUDA
    tensors; no lock, event or future until someone asks.  Made by
    :func:`done` (or filled in the same way by the op path): no Python
    constructor runs, and its three fields are slots."""

    __slots__ = ("_outputs", "_devices", "_future")

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            future = torch.futures.Future(devices=self._devices) if self._devices else torch.futures.Future()
            future.set_result(self._outputs)
            self._future = future
        return self._future

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def result(self):
        return self._outputs

    def source_rank(self) -> int:
        return -1

    def _source_rank(self) -> int:
        return -1


hide_from_compiler(Done, ["wait", "get_future", "is_completed", "is_success", "exception", "result",
                          "source_rank", "_source_rank"])


def done(outputs, devices=None) -> Done:
    """A Work for an op that already completed (the blocking path)."""
    work = Done()
    work._outputs = outputs  # the future's value; also keeps the tensors alive
    work._devices = devices
    work._future = None
    return work


class _Progress:
    """A daemon thread that completes watched pending Works, so that their
    futures complete without anyone calling ``wait()``."""

    def __init__(self) -> None:
        self._works: list[Work] = []
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stopping = False

    def stop(self, seconds: float = 5.0) -> list:
        """Stop the thread (at exit, before MPI_Finalize); returns the Works
        it was still watching."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
            thread, left = self._thread, list(self._works)
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(seconds)
        return left

    def is_current(self) -> bool:
        """Whether the calling thread is the progress thread (running a future's callback)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def watch(self, work: Work) -> None:
        with self._cv:
            self._stopping = False
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
                while not self._works and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    self._thread = None
                    return
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


def _stop_progress() -> None:
    """At exit: stop the progress thread (what it watched is settled by
    hpccomm.ops.p2p's exit hook)."""
    _progress.stop()


def _register_exit_hook() -> None:
    from . import _mpi

    _mpi.at_exit.append((1, _stop_progress))


_register_exit_hook()
