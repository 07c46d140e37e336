"""The Work objects hpccomm hands to torch, and the pending operations behind them.

Every Work is made here, by :func:`done` (a blocking op that already ran) or
by ``Work(outputs, pending)`` (an op still in flight); nothing outside this
module writes a Work's fields.  torch's C++ callers (DDP's reducer,
functional collectives) wait on ``get_future()`` and never call ``wait()``,
so every Work's future must complete by itself; its value is the list of
output tensors (DDP reads it).

A pending Work waits on an object of the :class:`Pending` protocol:

- :class:`Request`: a posted MPI request, a point-to-point op or a
  collective in its nonblocking form;
- ``hpccomm._core.comm_thread.Job``: an op queued on the comm thread;
- :class:`AllOf`: a batch of Works (torch's coalesced point-to-point ops).

An error from any of them completes the Work with that error (wrapped in
:class:`hpccomm.errors.HpccommError` naming the op), which ``wait()`` and the
future raise: a pending op never dies silently on another thread.  A pending
Work completes when its owner calls ``wait()``, or, once someone asked for
its future, on the comm thread (hpccomm._core.comm_thread), which then runs the
callbacks chained on that future.

A failed op's future must fail where C++ sees it: ``Future.set_exception``
only stores the exception as the future's *value* (unwrapped in Python), so
DDP or a functional collective would read it as a successful result.  So a
pending Work's future is chained, ``raw.then(result_or_raise)``, and the
callback raises: torch records that as the future's error.
"""
from __future__ import annotations

import sys
import time
from _thread import allocate_lock as _allocate_lock
from datetime import timedelta
from typing import Optional, Protocol

import torch

from .. import _mpi
from .._ops.plan import AFTER, ARGS, NBYTES, OUTPUTS
from .._torch.compat import WorkBase, hide_from_compiler
from ..errors import HpccommError
from . import failures, state, trace
from .comm_thread import Job, engine, latch


class Pending(Protocol):
    """What a pending Work waits on (implemented by :class:`Request`,
    :class:`AllOf` and ``hpccomm._core.comm_thread.Job``).  Only the Work holding it
    calls these, under the Work's lock, so one thread at a time touches an MPI
    request."""

    #: The comm thread completes the Work, right after running the op (a queued job).
    engine_completes: bool

    def test(self) -> bool:
        """Non-blocking progress: True once the op completed (with or without error)."""

    def wait(self, seconds: Optional[float]) -> bool:
        """Block until complete (``seconds`` None), or at most ``seconds``: False if not complete then."""

    def finish(self) -> Optional[int]:
        """Once complete, in the completing thread, once: raise the op's error,
        else run its last step; the source rank of a receive, else None."""

    def describe(self) -> str:
        """What the op is, for messages: ``all_reduce (op #3 on group '0', rank 1/4)``."""


class Work(WorkBase):
    """A pending hpccomm operation, as torch sees it (see the module docstring).

    ``Work(outputs, pending, describe="", devices=None)``: ``outputs`` is the
    future's value (also keeps the tensors alive); ``pending`` the
    :class:`Pending` it waits on; ``describe`` what it is for messages (a
    string, a function making it, or "": the pending's describe());
    ``devices`` the CUDA devices of its tensors (a future holding CUDA
    tensors must name them: torch then orders the waiter's stream after the
    completing thread's).
    """

    # Slots for what every Work sets, and a receive's source; what few Works ever set is read
    # from the class until then (an instance dict only when set).
    __slots__ = ("_outputs", "_pending", "_done", "_lock", "_engine_completes", "_source", "__dict__")
    _devices = None
    _describe = ""
    _error = None
    # The future torch sees, and the one completion sets (the first is chained on it): made on
    # the first get_future(), so an op nobody asks a future of never pays for one.
    _future = _rawf = None
    # A queued op's latch (hpccomm._core.comm_thread.latch): made by the first waiter that has to sleep,
    # opened once the Work is complete and its callbacks ran.
    _completed = None

    def __init__(self, outputs, pending, describe="", devices=None) -> None:
        WorkBase.__init__(self)
        self._outputs = outputs
        self._pending = pending
        self._done = False
        self._source = -1  # a receive's source rank, once known
        self._lock = _allocate_lock()  # one thread at a time touches the pending op
        # Queued ops are completed on the comm thread (or by their waiter in its place), right after
        # they run, so callbacks chained on their futures (DDP hooks that issue more ops) run at the
        # same point of the op sequence on every rank.
        self._engine_completes = pending.engine_completes
        if describe:
            self._describe = describe
        if devices:
            self._devices = devices

    def _what(self, pending=None) -> str:
        """What this Work is, for messages (a queued op is numbered when it runs)."""
        d = self._describe
        if d:
            return d() if callable(d) else d
        pending = self._pending if pending is None else pending
        return pending.describe() if pending is not None else "op"

    def _new_future(self) -> torch.futures.Future:
        return torch.futures.Future(devices=self._devices) if self._devices else torch.futures.Future()

    def _make_future(self) -> None:
        """Make the futures (caller holds ``_lock``): the chained one completes
        with the outputs, or fails visibly to C++ (see the module docstring);
        completed at once if the op already is."""
        raw = self._new_future()
        self._rawf = raw
        self._future = raw.then(self._result_or_raise)
        if self._done:
            raw.set_result(None)

    def _result_or_raise(self, _raw):
        if self._error is not None:
            raise self._error
        return self._outputs

    def _complete(self, error: Optional[BaseException] = None, release: bool = True) -> None:
        """Complete the Work (caller holds ``_lock``; the op completed, or
        failed with ``error``): the pending's finish step, the error wrapped
        naming the op, the future and its callbacks.  ``release``: open a
        queued op's latch now (the comm thread opens it itself, a moment later)."""
        pending, self._pending = self._pending, None
        if error is None:
            try:
                source = pending.finish()
                if source is not None:
                    self._source = source
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                error = exc
        if error is not None:  # the success path tests this one thing
            if state.failures.tolerant:  # a rank died (fault-tolerance mode): hpccomm.RankFailure
                error = failures.from_pending(self._what(pending), pending, error)
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
        the completing thread completes the future: a waiter on another thread
        must not return in between, or ``get_future().value()`` finds an
        incomplete future."""
        return self._future is None or self._future.done()

    # -- what the comm thread asks (hpccomm._core.comm_thread) ----------------------------
    def _ran_on_engine(self) -> None:
        """Its queued op just ran (on the comm thread, or in its waiter's
        place): complete the Work, callbacks included; the latch is opened
        by :meth:`_release`, once the group counts as idle."""
        with self._lock:
            if not self._done:
                self._complete(release=False)

    def _release(self) -> None:
        """Let a queued op's waiters go (after :meth:`_ran_on_engine`)."""
        if self._completed is not None:
            self._completed.release()

    def _hand_to_engine(self) -> None:
        """A posted collective is from now on completed by the comm thread: a
        queued job waits on its request and completes this Work, callbacks
        included, at its place in the group's op order (ops issued later on
        the group queue behind it on every rank).  Asked for by :meth:`get_future`."""
        with self._lock:  # not while a waiter or the comm thread is in the request
            if self._done or self._engine_completes:
                return
            request = self._pending
            job = Job(request.group, request.name, _complete_request)
            job.plan = request
            job.seq = request.seq
            job.work = self
            self._pending = job
            self._engine_completes = True
        engine.submit(job)

    def _poll(self) -> bool:
        """Non-blocking progress (the comm thread, for a Work whose future was
        asked for; ``is_completed``); True once done."""
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
        if not self._done:
            seconds = timeout.total_seconds() if timeout else None  # torch passes 0 or None for no limit
            if self._engine_completes:
                self._wait_for_engine(seconds)
            else:
                with self._lock:
                    if not self._done and not self._engine_completes:
                        try:
                            finished = self._pending.wait(seconds)
                        except Exception as exc:  # noqa: BLE001 - the op failed
                            self._complete(exc)
                        else:
                            if not finished:
                                raise TimeoutError(f"hpccomm {self._what()}: not complete after {seconds:g} s")
                            self._complete()
                if not self._done:  # handed to the comm thread meanwhile (get_future)
                    return self.wait(timeout)
        if self._future is not None and not self._settled():  # another thread completes it now: wait for it
            try:
                self._future.wait()
            except Exception:  # noqa: BLE001 - the same error is raised below
                pass
        if self._error is not None:
            raise self._error
        return True

    def _wait_for_engine(self, seconds) -> None:
        """Wait for a queued op: run it here if it is the only one queued and
        the comm thread is idle (hpccomm._core.comm_thread.Engine.steal), else sleep on
        its latch, which the comm thread opens once the Work is complete."""
        job = self._pending
        if seconds is None and job is not None and engine.steal(job):
            return
        with self._lock:
            latch_ = None if self._done else self._completed
            if latch_ is None and not self._done:
                latch_ = self._completed = latch()
        if latch_ is not None:
            if not latch_.acquire(True, -1 if seconds is None else seconds):
                raise TimeoutError(f"hpccomm {self._what()}: not complete after {seconds:g} s")
            latch_.release()  # open for any other waiter

    def get_future(self) -> torch.futures.Future:
        if self._future is None:  # made on first request
            with self._lock:  # not while another thread completes it
                if self._future is None:
                    self._make_future()
        if not self._done and not self._engine_completes:
            if isinstance(self._pending, Request) and self._pending.kind == "collective" and engine.usable():
                # A posted collective: its callbacks run on the comm thread, in op order (see
                # _hand_to_engine).
                self._hand_to_engine()
            elif engine.on_comm_thread() or not engine.usable():
                # Asked on the comm thread (a callback it runs: it cannot complete this op meanwhile),
                # or below MPI_THREAD_MULTIPLE, where no other thread may call MPI
                # (hpccomm._core.comm_thread): complete it here, in the caller (an error goes to the future).
                try:
                    self.wait()
                except Exception:  # noqa: BLE001 - the future carries it
                    pass
            else:
                engine.watch(self)  # the comm thread tests it until it completes
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


class Done(WorkBase):
    """The Work of an op that already completed (the blocking path, which is
    latency-bound): its outputs, and their devices for a future of CUDA
    tensors; no lock or future until someone asks.  Made by :func:`done`."""

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
    """The Work of an op that already completed: ``outputs`` is its future's
    value (also keeps the tensors alive), ``devices`` the CUDA devices of
    its tensors (None on the CPU)."""
    work = Done()
    work._outputs = outputs
    work._devices = devices
    work._future = None
    return work


class Request:
    """A posted MPI request: a point-to-point op (``kind`` ``"p2p"``) or a
    collective in its nonblocking form (``"collective"``); the :class:`Pending`
    of its Work.

    Made by hpccomm._core.op_path once the op's plan (hpccomm._ops.plan) is
    posted: ``req`` the MPI request, ``plan`` the op's plan (its ``keep``
    holds the buffers MPI reads or writes, alive until the request
    completes; its ``after`` runs once the data is in place).  While posted
    it is also this rank's record of the op in :mod:`hpccomm._core.state`, with
    the fields the watchdog reads (``group``, ``name``, ``seq``, ``start``,
    ``deadline``, ``kind``, ``peer``, ``where()``); through that record it is
    settled at exit (a collective's request cannot be cancelled or freed).
    ``peer``: a point-to-point op's other rank (None: any source).
    ``status``: filled for a receive (the source, and the count checked
    against the tensor).
    """

    # slots for what every Request sets; what few set is read from the class until then
    __slots__ = ("group", "name", "kind", "peer", "plan", "req", "status", "seq", "start", "deadline", "token",
                 "__dict__")
    engine_completes = False  # completed by whoever waits or tests, until handed to the comm thread
    error = None  # the MPI error it completed with
    traced = 0  # the tracer's start time (ns) when the tracer draws it

    def __init__(self, group, name: str, p2p: bool, plan, peer=None) -> None:
        self.group, self.name, self.plan, self.peer, self.req = group, name, plan, peer, None
        if p2p:
            self.kind = "p2p"
            self.status = _mpi.status() if name == "recv" else None
        else:
            self.kind = "collective"
            self.status = None

    def where(self) -> str:
        g = self.group
        return g.where_p2p(self.seq) if self.kind == "p2p" else g.where(self.seq)

    def describe(self) -> str:
        return f"{self.name} ({self.where()})"

    def test(self) -> bool:
        try:
            return self.req.Test(self.status)
        except _mpi.mpi().Exception as exc:  # completed with an error: finish() reports it
            self.error = exc
            return True

    def wait(self, seconds) -> bool:
        if seconds is None:
            try:
                self.req.Wait(self.status)
            except _mpi.mpi().Exception as exc:
                self.error = exc
            return True
        deadline = time.monotonic() + seconds
        idle = 1e-6
        while not self.test():
            if time.monotonic() > deadline:
                return False
            time.sleep(idle)
            idle = min(idle * 2, 1e-3)
        return True

    def finish(self):
        """After completion: the watchdog stops watching it; an MPI error raises
        naming the op; a receive's count is checked against its tensor; then
        the plan's last step.  The source rank of a receive, else None."""
        state.end(self.token)
        if self.traced:  # (only posted collectives are drawn)
            tracer = trace.active()
            if tracer:  # posted here, completed here or on another thread: drawn from post to completion
                tracer.record(self.name, self.group.name, self.seq, self.plan[NBYTES], self.traced, trace.now_ns())
        if self.error is not None:
            raise self._failure()
        source = None
        if self.status is not None:
            source = self.peer
            if source is None:
                source = self.status.Get_source()
            message = self.plan[ARGS][0]
            if message.__class__ is list:  # [memory, count, MPI datatype]: what the tensor holds
                n, datatype = message[1], message[2]
            else:  # (past the count limit: a derived datatype described the tensor's elements)
                tensor = self.plan[OUTPUTS][0]
                n, datatype = tensor.numel(), _mpi.mpi_type(tensor.dtype)
            got = self.status.Get_elements(datatype)
            if got != n:
                raise self._fail(f"received {got} elements from rank {source} but the tensor has {n}; "
                                 f"only its first {got} elements were written",
                                 "Sender and receiver must pass tensors with the same number of elements")
        after = self.plan[AFTER]
        if after is not None:
            after()
        return source

    def _fail(self, what: str, fix: str = "") -> HpccommError:
        return HpccommError(f"hpccomm {self.describe()}: {what}" + (f". {fix}" if fix else ""))

    def _failure(self) -> HpccommError:
        """The error of a request that completed with MPI error ``self.error``."""
        exc = self.error
        if state.failures.tolerant:
            failure = failures.failure(self.describe(), exc)
            if failure is not None:
                return failure
        if self.status is not None and exc.Get_error_class() == _mpi.mpi().ERR_TRUNCATE:
            source = self.peer if self.peer is not None else self.status.Get_source()
            return self._fail(f"the message from rank {source} is larger than the tensor "
                              f"({self.plan[OUTPUTS][0].numel()} elements); the tensor may be partly overwritten",
                              "Sender and receiver must pass tensors with the same number of elements")
        return self._fail(f"MPI failed: {exc}")


def _complete_request(job):
    """The comm thread's job for a posted collective handed to it
    (:meth:`Work._hand_to_engine`): wait on its request and finish it."""
    request = job.plan
    request.wait(None)
    request.finish()


class AllOf:
    """The Pending of a batch: done when every Work in ``works`` is (torch's
    coalesced point-to-point ops, ``batch_isend_irecv``); the first error wins."""

    engine_completes = False

    def __init__(self, works, description: str) -> None:
        self.works = list(works)
        self.description = description

    def describe(self) -> str:
        return self.description

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


def _settle_at_exit(seconds: float = 2.0) -> None:
    """At exit, before MPI_Finalize, once the comm thread has stopped
    (hpccomm._core.comm_thread's thread rule): every request still posted is settled.
    A collective's is waited for (MPI forbids cancelling or freeing it; the
    other ranks run the same collective, so it completes; one still running
    past its group's timeout ends the job with the watchdog's kind of
    message, the watchdog may have stopped).  A point-to-point request is
    completed if it can be within ``seconds`` (a send whose receiver is also
    exiting), else a receive is cancelled and a send's request freed (MPI
    lets it finish on its own)."""
    MPI = _mpi.mpi()
    requests = [r for r in state.records() if isinstance(r, Request) and r.req is not None]
    deadline = time.monotonic() + seconds
    for r in requests:
        try:
            if r.kind == "collective":
                while not r.req.Test():
                    if r.deadline is not None and time.monotonic() > r.deadline + 2.0:
                        print(f"hpccomm: {r.describe()} did not complete within the group's timeout at exit "
                              "(a rank never posted it?); ending the job", file=sys.stderr, flush=True)
                        state.record_failure(f"timed out in {r.describe()} at exit")
                        _mpi.abort(1)
                    time.sleep(1e-4)
                continue
            if r.req == MPI.REQUEST_NULL:
                continue
            while not r.req.Test() and time.monotonic() < deadline:
                time.sleep(1e-3)
            if r.req == MPI.REQUEST_NULL:
                continue
            if r.status is not None:
                r.req.Cancel()
                r.req.Wait()
            else:
                r.req.Free()
        except MPI.Exception:  # at exit: settle the others
            pass


_mpi.at_exit.append((1.5, _settle_at_exit))
