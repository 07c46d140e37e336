"""The op record: one object per op in flight, from its start to its completion.

A blocking collective run in the calling thread completes inside the call
that issued it and needs no record: while it runs it is noted in
``group.running`` (hpccomm._core.state, which shows it to the watchdog as a
record).  Every other op has one :class:`OpRecord`.  It is the comm thread's
queue entry (a queued op), holds the MPI request (a posted op), is the
watchdog's record (numbered, with its deadline), and is what the op's Work
waits on (hpccomm._core.work).  Two ways to start it: :meth:`~OpRecord.queue`
(the comm thread runs it, in issue order) and :meth:`~OpRecord.post` (its
nonblocking MPI call is posted now).  It is completed by the comm thread (a
queued op, or a posted one once its future was asked for: :meth:`~OpRecord.future`
hands it over, changing its state, never its owner), else by whoever waits
on it or tests it.

| state | meaning | moved there by |
|---|---|---|
| SUBMITTED | made and queued on the comm thread; not numbered yet | the op path (:meth:`~OpRecord.queue`) |
| RUNNING | numbered and communicating: its blocking form runs, or its request is posted | the thread that runs it (the comm thread, its waiter in its place, or the caller posting it) |
| TIMED_OUT | RUNNING past its group's timeout: the watchdog reported it (a mark, :meth:`~OpRecord.expired`: it still completes, ``HPCCOMM_ON_TIMEOUT=warn``) | the watchdog |
| DONE | complete: outputs in place, future and its callbacks done | whoever completes it, holding its lock |
| FAILED | complete with an error, which ``wait()`` and the future raise | the same |

Its lock: one thread at a time touches its MPI request; completion and the
making of its future happen under it, once.  A failed op's future must fail
where C++ sees it: ``Future.set_exception`` only stores the exception as the
future's *value*, so the future torch sees is chained on a raw one
(``raw.then(_result_or_raise)``), whose callback raises: torch records that
as the future's error.  Every record keeps its plan, and with it the op's
tensors and buffers (``keep``), until it completes.
"""
from __future__ import annotations

import sys
import time
from _thread import allocate_lock as _allocate_lock

import torch

from .. import _mpi
from .._compat import hide_from_compiler
from ..errors import HpccommError
from . import comm_thread, failures, state, trace
from .execute import execute
from .plan import AFTER, ARGS, BEFORE, ICALL, NBYTES, OUTPUTS

SUBMITTED, RUNNING, DONE, FAILED = range(4)  # (state >= DONE: complete)
STATES = ("submitted", "running", "done", "failed")


class OpRecord:
    """One op in flight (see the module docstring): op ``name`` of ``group``
    with ``plan`` (hpccomm._core.plan); ``kind`` ``"collective"``, ``"p2p"``
    (``peer``: its other rank, None for any source) or ``"batch"`` (torch's
    coalesced point-to-point ops: ``parts`` are their records); ``devices``:
    the CUDA devices its future names (torch orders the waiter's stream after
    the completing thread's).  ``seq``, ``start``, ``deadline``, ``token``:
    its number and watch, given by hpccomm._core.state when it is numbered."""

    __slots__ = ("group", "name", "plan", "kind", "peer", "devices", "state", "lock", "by_comm_thread", "seq",
                 "start", "deadline", "token", "args", "asynchronous", "req", "status", "error", "source",
                 "timed_out", "parts", "traced", "latch", "fut", "raw")

    def __init__(self, group, name: str, plan, kind: str = "collective", peer=None, devices=None) -> None:
        self.group = group
        self.name = name
        self.plan = plan
        self.kind = kind
        self.peer = peer
        self.devices = devices
        self.state = SUBMITTED
        self.lock = _allocate_lock()
        self.by_comm_thread = self.timed_out = False
        self.seq = self.start = self.deadline = self.token = self.req = self.status = self.error = None
        self.source = -1
        self.parts = ()
        self.traced = 0
        self.latch = self.fut = self.raw = None  # (a queued op's waiters' latch, its futures: made when needed)

    @classmethod
    def noted(cls, group, name: str, seq: int, start: float, seconds=None, kind: str = "collective",
              peer=None) -> "OpRecord":
        """A RUNNING record, for the watchdog, of what runs without one of its
        own: a blocking collective's note (hpccomm._core.state), group
        creation, a shrink; started at ``start`` (monotonic), ``seconds`` its
        time limit (None: its group's)."""
        record = cls(group, name, None, kind, peer)
        seconds = getattr(group, "timeout_s", None) if seconds is None else seconds
        record.seq, record.start, record.state = seq, start, RUNNING
        record.deadline = start + seconds if seconds else None
        return record

    # -- two ways to start it (the op path) ---------------------------------
    def queue(self, args, asynchronous: bool) -> None:
        """Queue it on the comm thread, which runs its plan in the blocking
        form (hpccomm._core.execute) after the group's earlier queued ops;
        ``args``, ``asynchronous``: torch's arguments and ``async_op`` (debug
        mode compares them across ranks)."""
        self.args, self.asynchronous, self.by_comm_thread = args, asynchronous, True
        comm_thread.submit(self)

    def post(self) -> None:
        """Post it here: numbered and watched (this record is the watchdog's),
        its plan's ``before`` step, then its nonblocking MPI call.  An error
        raises (an MPI one naming the op), and nothing is left watched."""
        g, plan = self.group, self.plan
        if self.name == "recv":
            self.status = _mpi.status()
        state.start(g, self.name, self)
        if g.instrumented and self.kind == "collective" and trace.active():
            self.traced = trace.now_ns()
        try:
            before = plan[BEFORE]
            if before is not None:
                before()
            self.req = plan[ICALL](*plan[ARGS])
        except BaseException as exc:
            state.end(self.token)
            if not isinstance(exc, _mpi.mpi().Exception):
                raise
            failure = failures.failure(self.describe(), exc) if state.failures.tolerant else None
            raise (failure or HpccommError(f"hpccomm {self.describe()}: MPI failed: {exc}")) from exc
        self.state = RUNNING
        if g.coalescing is not None and self.kind == "p2p":  # torch's coalescing window collects it
            g.coalescing.append(self)

    @classmethod
    def batch(cls, group, parts, description: str) -> "OpRecord":
        """The record of a batch (torch's coalesced point-to-point ops): complete when every part is."""
        record = cls(group, description, None, "batch")
        record.parts, record.state = tuple(parts), RUNNING
        return record

    # -- what the comm thread calls (hpccomm._core.comm_thread) ---------------
    def run(self) -> None:
        """Run it here (the comm thread, or its waiter in its place): a queued
        op's plan in the blocking form, or a posted op's request waited for;
        then complete it, callbacks included, before the group counts as idle
        (ops they issue, such as DDP's, then run at the same point of the op
        sequence on every rank).  Its waiters go on at :meth:`release`."""
        error = None
        try:
            if self.req is not None:
                self.req.Wait(self.status)
            else:
                execute(self.group, self.name, self.plan, self.args, self, self.asynchronous)
        except BaseException as exc:  # noqa: BLE001 - handed to its waiters
            error = exc
        with self.lock:
            if self.state < DONE:
                self._complete(error, False)

    def running(self, seq: int) -> None:
        """(hpccomm._core.execute) A queued op was numbered ``seq`` and runs now."""
        self.seq, self.state = seq, RUNNING

    def release(self) -> None:
        """Let its waiters go (after :meth:`run`, once the group counts as idle)."""
        if self.latch is not None:
            self.latch.release()

    def test(self) -> bool:
        """Progress without blocking (``is_completed()``; the comm thread, for a
        posted op whose future was asked for): True once complete."""
        if self.state >= DONE:
            return self.fut is None or self.fut.done()  # (its future completes a moment after its state)
        if self.by_comm_thread or not self.lock.acquire(False):
            return False  # the comm thread completes it, or a waiter holds it and will
        try:
            if self.state < DONE:
                try:
                    if all(p.test() for p in self.parts) if self.parts else self.req.Test(self.status):
                        self._complete()
                except Exception as exc:  # noqa: BLE001 - it completed with an error
                    self._complete(exc)
            return self.state >= DONE
        finally:
            self.lock.release()

    # -- what the watchdog calls ----------------------------------------------
    def expired(self) -> None:
        """The watchdog reported it past its group's timeout (TIMED_OUT)."""
        self.timed_out = True

    def where(self) -> str:
        g = self.group
        if self.seq is None:
            return f"group {g.name!r}"  # a queued op is numbered when it runs
        return g.where_p2p(self.seq) if self.kind == "p2p" else g.where(self.seq)

    def describe(self) -> str:
        """What it is, for messages: ``all_reduce (op #3 on group '0', rank 1/4)``."""
        return self.name if self.kind == "batch" else f"{self.name} ({self.where()})"

    # -- what its Work asks (hpccomm._core.work) ------------------------------
    def wait(self, seconds=None) -> None:
        """Block until complete (``seconds`` None), or at most ``seconds``
        (TimeoutError); then raise its error, if any."""
        if self.state < DONE:
            if self.by_comm_thread:
                self._wait_queued(seconds)
            else:
                with self.lock:
                    if self.state < DONE and not self.by_comm_thread:
                        try:
                            if self.parts:
                                finished = self._wait_parts(seconds)
                            elif seconds is None:
                                self.req.Wait(self.status)
                                finished = True
                            else:
                                finished = self._poll(seconds)
                        except Exception as exc:  # noqa: BLE001 - it completed with an error
                            self._complete(exc)
                        else:
                            if not finished:
                                raise TimeoutError(f"hpccomm {self.describe()}: not complete after {seconds:g} s")
                            self._complete()
                if self.state < DONE:  # handed to the comm thread meanwhile (future())
                    return self.wait(seconds)
        fut = self.fut
        if fut is not None and not fut.done():  # another thread completes its future now: wait for it
            try:
                fut.wait()
            except Exception:  # noqa: BLE001 - the same error is raised below
                pass
        if self.error is not None:
            raise self.error

    def future(self) -> torch.futures.Future:
        """Its future (made on the first ask; its value the outputs).  A
        posted collective is handed to the comm thread, which completes it at
        its place in the group's op order (ops issued later on the group queue
        behind it), so callbacks run there on every rank alike; a posted
        point-to-point op is tested there until it completes; on the comm
        thread itself, or below MPI_THREAD_MULTIPLE, it is completed here."""
        if self.fut is None:
            with self.lock:  # not while another thread completes it
                if self.fut is None:
                    raw = torch.futures.Future(devices=self.devices) if self.devices else torch.futures.Future()
                    self.raw, self.fut = raw, raw.then(self._result_or_raise)
                    if self.state >= DONE:
                        raw.set_result(None)
        if self.state < DONE and not self.by_comm_thread:
            if self.kind == "collective" and comm_thread.usable():
                with self.lock:  # not while a waiter or the comm thread is in the request
                    handed = self.state < DONE and not self.by_comm_thread
                    if handed:
                        self.by_comm_thread = True
                if handed:
                    comm_thread.submit(self)
            elif comm_thread.on_it() or not comm_thread.usable():
                try:
                    self.wait()
                except Exception:  # noqa: BLE001 - the future carries it
                    pass
            else:
                comm_thread.watch(self)
        return self.fut

    def _result_or_raise(self, _raw):
        if self.error is not None:
            raise self.error
        return self.plan[OUTPUTS] if self.plan is not None else None

    # -- inside -------------------------------------------------------------
    def _wait_queued(self, seconds) -> None:
        """Wait for a queued op: run it here if it is the only one queued and
        the comm thread is idle (:func:`hpccomm._core.comm_thread.steal`), else
        sleep on its latch, which the comm thread opens once it completed."""
        if seconds is None and comm_thread.steal(self):
            return
        with self.lock:
            latch = None if self.state >= DONE else self.latch
            if latch is None and self.state < DONE:
                latch = self.latch = comm_thread.latch()
        if latch is not None:
            if not latch.acquire(True, -1 if seconds is None else seconds):
                raise TimeoutError(f"hpccomm {self.describe()}: not complete after {seconds:g} s")
            latch.release()  # open for any other waiter

    def _poll(self, seconds) -> bool:
        """Test its request until it completes (True) or ``seconds`` passed (False)."""
        deadline, idle = time.monotonic() + seconds, 1e-6
        while not self.req.Test(self.status):
            if time.monotonic() > deadline:
                return False
            time.sleep(idle)
            idle = min(idle * 2, 1e-3)
        return True

    def _wait_parts(self, seconds) -> bool:
        deadline = None if seconds is None else time.monotonic() + seconds
        for p in self.parts:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if left == 0.0 and not p.test():
                return False
            try:
                p.wait(left)
            except TimeoutError:
                return False
            except Exception:  # noqa: BLE001 - _finish() raises the first error
                pass
        return True

    def _complete(self, error=None, release: bool = True) -> None:
        """Complete it (lock held; its op completed, or failed with
        ``error``): a posted op's last step, the error named after the op,
        the future and its callbacks; ``release``: open a queued op's latch
        now (the comm thread opens it itself, a moment later)."""
        try:
            self._finish(error)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            error = exc
        else:
            error = None
        if error is None:  # the success path tests this one thing
            self.state = DONE
        else:
            if state.failures.tolerant:  # a rank died (fault-tolerance mode): hpccomm.RankFailure
                error = failures.from_pending(self.describe(), error)
            if isinstance(error, Exception) and not isinstance(error, HpccommError):
                wrapped = HpccommError(f"hpccomm {self.describe()}: {type(error).__name__}: {error}")
                wrapped.__cause__ = error
                error = wrapped
            self.error, self.state = error, FAILED
        if self.raw is not None:
            self.raw.set_result(None)  # runs _result_or_raise, then the callbacks chained on the future
        if release and self.latch is not None:
            self.latch.release()  # after the callbacks: ops they issued come before the waiter's next op

    def _finish(self, error) -> None:
        """Raise ``error`` (the op's, or None), made an MPI error's message;
        for a posted op, first stop watching it (and draw it in the trace),
        and once it succeeded: a receive's source noted and its count checked
        against its tensor, then the plan's ``after`` step.  A batch raises
        its parts' first error."""
        if self.req is None:
            if error is None:
                error = next((p.error for p in self.parts if p.error is not None), None)
            if error is not None:
                raise error
            return
        state.end(self.token)
        if self.traced:  # posted here, completed here or on another thread: drawn from post to completion
            tracer = trace.active()
            if tracer:
                tracer.record(self.name, self.group.name, self.seq, self.plan[NBYTES], self.traced, trace.now_ns())
        if error is not None:
            raise self._failure(error) if isinstance(error, _mpi.mpi().Exception) else error
        if self.status is not None:
            self.source = self.peer if self.peer is not None else self.status.Get_source()
            message = self.plan[ARGS][0]
            if message.__class__ is list:  # [memory, count, MPI datatype]: what the tensor holds
                n, datatype = message[1], message[2]
            else:  # (past the count limit: a derived datatype described the tensor's elements)
                tensor = self.plan[OUTPUTS][0]
                n, datatype = tensor.numel(), _mpi.mpi_type(tensor.dtype)
            got = self.status.Get_elements(datatype)
            if got != n:
                raise HpccommError(f"hpccomm {self.describe()}: received {got} elements from rank {self.source} "
                                   f"but the tensor has {n}; only its first {got} elements were written. Sender "
                                   "and receiver must pass tensors with the same number of elements")
        after = self.plan[AFTER]
        if after is not None:
            after()

    def _failure(self, exc) -> HpccommError:
        """The error of a request that completed with MPI error ``exc``."""
        if state.failures.tolerant:
            failure = failures.failure(self.describe(), exc)
            if failure is not None:
                return failure
        if self.status is not None and exc.Get_error_class() == _mpi.mpi().ERR_TRUNCATE:
            source = self.peer if self.peer is not None else self.status.Get_source()
            return HpccommError(f"hpccomm {self.describe()}: the message from rank {source} is larger than the "
                                f"tensor ({self.plan[OUTPUTS][0].numel()} elements); the tensor may be partly "
                                "overwritten. Sender and receiver must pass tensors with the same number of elements")
        return HpccommError(f"hpccomm {self.describe()}: MPI failed: {exc}")


def running() -> list:
    """The ops this rank is in now (a snapshot), as records: those watched
    (hpccomm._core.state: posted ops, group creation ...) and each group's
    blocking collective, from its note."""
    return state.records() + [OpRecord.noted(g, name, seq, start) for g, (name, seq, start) in state.notes()]


def current():
    """The longest-running op on this rank (a record), or None."""
    ops = running()
    return min(ops, key=lambda op: op.start) if ops else None


# The future's callback runs inside torch's C++ layer: kept out of torch.compile.
hide_from_compiler(OpRecord, ["_result_or_raise"])


def _settle_at_exit(seconds: float = 2.0) -> None:
    """At exit, before MPI_Finalize, once the comm thread has stopped (its
    thread rule): every request still posted is settled.  A collective's is
    waited for (MPI forbids cancelling or freeing it; the other ranks run the
    same collective, so it completes; one still running past its group's
    timeout ends the job with the watchdog's kind of message, the watchdog
    may have stopped).  A point-to-point request is completed if it can be
    within ``seconds`` (a send whose receiver is also exiting), else a
    receive is cancelled and a send's request freed (MPI lets it finish)."""
    MPI = _mpi.mpi()
    posted = [r for r in state.records() if isinstance(r, OpRecord) and getattr(r, "req", None) is not None]
    deadline = time.monotonic() + seconds
    for r in posted:
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
