"""The op record: how an op that does not complete inside its call completes;
and the queue entries, what the comm thread runs.

A blocking collective, in the calling thread or on the comm thread, needs
no record: it completes inside its call, watched meanwhile through its
group's own record (hpccomm._core.state.InFlight, ``group.running``).
Every other op has one :class:`OpRecord`: its completion (its state, the
MPI request of a posted op, the steps after it, its futures and callbacks,
its error), which its Work asks everything of (hpccomm._core.work).  It is
an :class:`~hpccomm._core.state.InFlight`: posted, it is the record the
watchdog reads.  It is started one of two ways, :meth:`~OpRecord.queue` or
:meth:`~OpRecord.post`, and completed by the comm thread (a queued op, or a
posted collective once its future was asked for: :meth:`~OpRecord.future`
changes its state, never its owner), else by whoever waits on it or tests
it.

What the comm thread runs is apart from it, as ProcessGroupMPI queues a
``(WorkEntry, Work)`` pair: a queue entry is a tuple ``(run, record,
...)``, what to run and the record it completes (hpccomm._core.comm_thread
calls ``run(entry)``, then ``record.release()``).  Two kinds:
``(run_queued, record, call, asynchronous)``, a queued op (its checked call
run in its plan's blocking form by hpccomm._core.execute), and
``(complete_posted, record)``, a posted collective whose future was asked
for (its request waited for at its place in the group's op order).  A tuple,
not an object: the queued form makes one per op, and an object with slots
cost that form about 1,800 instructions more (docs/benchmarks.md).

Its states (``state``; the constants below, in this order; ``state >= DONE``: complete):

| state | meaning | moved there by |
|---|---|---|
| SUBMITTED | made, not numbered yet: queued on the comm thread (``queue``), or about to be posted | the op path (``OpRecord(...)``, ``queue``) |
| RUNNING | numbered, communicating: its blocking form runs, or its request is posted; a batch, from its making | the thread running it: the comm thread, its waiter in its place (``running``), the caller posting it (``post``) |
| DONE | complete: outputs in place, future completed, its callbacks run | whoever completes it, under its lock (``_complete``) |
| FAILED | complete with an error (named after the op), raised by ``wait()``, ``result()`` and the future | the same |

A timeout is not a state: the watchdog marks a RUNNING op it reported
past its group's timeout (``timed_out``, by ``expired()``: InFlight's), and
the op stays RUNNING; it may still complete (``HPCCOMM_ON_TIMEOUT=warn``).

Its lock: one thread at a time touches its MPI request, and it completes
once.  A failed op's future fails where C++ sees it: ``set_exception`` only
stores the exception as the value, so the future torch sees is chained on a
raw one whose callback raises (``_result_or_raise``).  The record keeps its
plan, and with it the op's tensors and buffers, until it completes.
"""
from __future__ import annotations

import time
from _thread import allocate_lock as _allocate_lock

import torch

from .. import _mpi
from .._compat import hide_from_compiler
from ..errors import HpccommError
from . import comm_thread, failures, state, trace
from .execute import execute
from .plan import AFTER, ARGS, BEFORE, ICALL, NBYTES, OUTPUTS
from .state import InFlight

SUBMITTED, RUNNING, DONE, FAILED = range(4)  # (state >= DONE: complete)


class OpRecord(InFlight):
    """A call of ``op`` (its declaration, hpccomm._ops.op.Op; None for a
    batch, named ``name``) on ``group`` with ``plan`` (hpccomm._core.plan:
    its outputs, and a posted op's steps); ``kind``
    ``"collective"``, ``"p2p"`` (``peer``: the other rank, None for any) or
    ``"batch"`` (torch's coalesced point-to-point ops: ``parts``);
    ``devices``: the CUDA devices its future names; ``io``: its sizes and
    dtypes for the flight recorder (hpccomm._core.state.start; None: not
    recorded).  An :class:`~hpccomm._core.state.InFlight`: posted, it is the
    record the watchdog reads (``seq``, ``start``, ``token`` given by
    hpccomm._core.state when numbered; ``deadline`` from them)."""

    __slots__ = ("op", "plan", "devices", "state", "lock", "by_comm_thread", "req", "status", "error", "source",
                 "parts", "traced", "latch", "fut", "raw", "io")

    def __init__(self, group, op, plan, kind: str = "collective", peer=None, devices=None,
                 name: str = "", io=None) -> None:
        # InFlight's fields, as InFlight.__init__ sets them (here: one call less per op; a unit test holds
        # the two alike, tests/test_unit.py::test_every_form_in_flight_is_one_record_type)
        self.group, self.kind, self.peer = group, kind, peer
        if op is not None:
            self.name, self.matched_by = op.name, op.matched_by
        else:
            self.name, self.matched_by = name, None
        self.seq = self.start = self.token = None
        self.timed_out = False
        self.op, self.plan = op, plan
        self.devices = devices
        self.state = SUBMITTED
        self.lock = _allocate_lock()
        self.by_comm_thread = False
        self.req = self.status = self.error = None
        self.source = -1
        self.parts = ()
        self.traced = 0
        self.latch = self.fut = self.raw = None  # a queued op's waiters' latch, its futures: made when needed
        self.io = io

    @classmethod
    def batch(cls, group, parts, description: str):
        """A batch of point-to-point ops' records: complete when every part is."""
        record = cls(group, None, None, "batch", name=description)
        record.parts, record.state = tuple(parts), RUNNING
        return record

    # -- two ways to start it (the op path) ---------------------------------
    def queue(self, call, asynchronous: bool) -> None:
        """Queue checked ``call`` (hpccomm._ops.op.Call): the comm thread runs
        its plan's blocking form after the group's earlier queued ops (entry
        ``(run_queued, self, call, asynchronous)``; ``asynchronous``: the
        call's ``async_op``, which debug mode compares)."""
        self.by_comm_thread = True
        comm_thread.submit((run_queued, self, call, asynchronous))

    def post(self) -> None:
        """Post it here: numbered and watched, its plan's ``before`` step, its
        nonblocking MPI call.  An error raises (an MPI one naming the op),
        nothing left watched."""
        g, plan = self.group, self.plan
        if self.op.completes is not None:  # its step at completion reads what arrived (hpccomm._ops.op.Op)
            self.status = _mpi.status()
        state.start(g, self.name, self, self.io)
        if g.instrumented and self.kind == "collective" and trace.active():
            self.traced = trace.now_ns()
        try:
            before = plan[BEFORE]
            if before is not None:
                before()
            self.req = plan[ICALL](*plan[ARGS])
        except BaseException as exc:
            state.end(self.token)
            if not _mpi.is_error(exc):
                raise
            raise failures.mpi_error(self.describe(), exc, self.kind == "collective") from exc
        self.state = RUNNING
        if g.coalescing is not None and self.kind == "p2p":  # torch's coalescing window collects it
            g.coalescing.append(self)

    # -- what its queue entry calls (the comm thread, or its waiter in its place)
    def ran(self, error) -> None:
        """Its queue entry ran it, or waited for its request, with ``error``
        (None: none): complete it, callbacks included, before the group
        counts as idle (so ops they issue run at one point of the op order
        on every rank); its waiters go on at :meth:`release`."""
        with self.lock:
            if self.state < DONE:
                self._complete(error, False)

    def running(self, seq: int) -> None:
        """(hpccomm._core.execute) A queued op was numbered ``seq`` and runs."""
        self.seq, self.state = seq, RUNNING

    def release(self) -> None:
        """Let its waiters go (after its queue entry ran, once the group counts as idle)."""
        if self.latch is not None:
            self.latch.release()

    def test(self) -> bool:
        """Progress without blocking: True once complete (``is_completed()``;
        the comm thread, for a posted op whose future was asked for)."""
        if self.state >= DONE:
            return self.fut is None or self.fut.done()  # (its future completes a moment after its state)
        if self.by_comm_thread or not self.lock.acquire(False):
            return False  # the comm thread completes it, or a waiter holds it and will
        try:
            if self.state < DONE:
                try:
                    if self._done_now():
                        self._complete()
                except Exception as exc:  # noqa: BLE001 - it completed with an error
                    self._complete(exc)
            return self.state >= DONE
        finally:
            self.lock.release()

    # -- what messages read (the watchdog reads the rest: InFlight) -----------
    def where(self) -> str:
        if self.seq is None:
            return f"group {self.group.name!r}"  # a queued op is numbered when it runs
        return InFlight.where(self)

    def describe(self) -> str:
        """What it is, for messages: ``all_reduce (op #3 on group '0', rank 1/4)``; a
        batch (no op of its own), its description, which says where."""
        return self.name if self.op is None else InFlight.describe(self)

    # -- what its Work asks (hpccomm._core.work) ------------------------------
    def wait(self, seconds=None) -> None:
        """Block until complete, at most ``seconds`` (then TimeoutError; None:
        no limit); raise its error, if any."""
        if self.state < DONE:
            if self.by_comm_thread:
                self._wait_queued(seconds)
            else:
                with self.lock:
                    if self.state < DONE and not self.by_comm_thread:
                        try:
                            if seconds is not None:
                                if not self._poll(seconds):
                                    raise TimeoutError(f"hpccomm {self.describe()}: not complete after {seconds:g} s")
                            elif self.req is not None:
                                self.req.Wait(self.status)
                            else:
                                for p in self.parts:  # (their errors: _finish raises the first)
                                    p.wait_quietly()
                        except TimeoutError:
                            raise
                        except Exception as exc:  # noqa: BLE001 - it completed with an error
                            self._complete(exc)
                        else:
                            self._complete()
                if self.state < DONE:  # handed to the comm thread meanwhile (future())
                    return self.wait(seconds)
        if self.fut is not None and not self.fut.done():  # another thread completes its future now: wait
            self.wait_quietly(future=True)
        if self.error is not None:
            raise self.error

    def wait_quietly(self, future: bool = False) -> None:
        """Wait without raising: for it (a batch's part), or for its future."""
        try:
            self.fut.wait() if future else self.wait()
        except Exception:  # noqa: BLE001 - raised where it is asked for
            pass

    def future(self) -> torch.futures.Future:
        """Its future (made on the first ask; its value the outputs).  A posted
        collective is handed to the comm thread, which completes it at its
        place in the group's op order (callbacks run there on every rank
        alike); a posted point-to-point op is tested there until it
        completes; on the comm thread, or below MPI_THREAD_MULTIPLE, it
        completes here."""
        if self.fut is None:
            with self.lock:  # not while another thread completes it
                if self.fut is None:
                    raw = torch.futures.Future(devices=self.devices) if self.devices else torch.futures.Future()
                    self.raw, self.fut = raw, raw.then(self._result_or_raise)
                    if self.state >= DONE:
                        raw.set_result(None)
        if self.state < DONE and not self.by_comm_thread:
            if self.kind == "collective" and comm_thread.usable():
                with self.lock:  # not while a waiter is in the request
                    handed = self.state < DONE and not self.by_comm_thread
                    self.by_comm_thread = self.by_comm_thread or handed
                if handed:
                    comm_thread.submit((complete_posted, self))
            elif comm_thread.on_it() or not comm_thread.usable():
                self.wait_quietly()  # (the future carries its error)
            else:
                comm_thread.watch(self)
        return self.fut

    def _result_or_raise(self, _raw):
        if self.error is not None:
            raise self.error
        return self.plan[OUTPUTS] if self.plan is not None else None

    # -- inside -------------------------------------------------------------
    def _wait_queued(self, seconds) -> None:
        """Run it here if it is the only one queued and the comm thread idle
        (:func:`hpccomm._core.comm_thread.steal`), else sleep on its latch,
        opened once it completed."""
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

    def _done_now(self) -> bool:
        """Whether its request (a batch: every part) completed; its MPI error raises."""
        return all(p.test() for p in self.parts) if self.parts else self.req.Test(self.status)

    def _poll(self, seconds) -> bool:
        """:meth:`_done_now` until True, or False once ``seconds`` passed."""
        deadline, idle = time.monotonic() + seconds, 1e-6
        while not self._done_now():
            if time.monotonic() > deadline:
                return False
            time.sleep(idle)
            idle = min(idle * 2, 1e-3)
        return True

    def _complete(self, error=None, release: bool = True) -> None:
        """Complete it (lock held; it completed, or failed with ``error``): its
        last step, its error named after it, its future and callbacks;
        ``release``: open a queued op's latch now (else the comm thread does)."""
        try:
            self._finish(error)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            if state.failures.tolerant:  # a rank died (fault-tolerance mode): hpccomm.RankFailure
                exc = failures.from_pending(self.describe(), exc)
            if isinstance(exc, Exception) and not isinstance(exc, HpccommError):
                wrapped = HpccommError(f"hpccomm {self.describe()}: {type(exc).__name__}: {exc}")
                wrapped.__cause__ = exc
                exc = wrapped
            self.error, self.state = exc, FAILED
        else:
            self.state = DONE
        if self.raw is not None:
            self.raw.set_result(None)  # runs _result_or_raise, then the callbacks chained on the future
        if release and self.latch is not None:
            self.latch.release()  # after the callbacks: ops they issued come before the waiter's next op

    def _finish(self, error) -> None:
        """Raise ``error`` (a batch: its parts' first); a posted op's watch
        ends and it is drawn first, and on success the op's own step at
        completion runs (its declaration's ``completes``: a receive's count
        check, which gives its source) and the plan's ``after`` step."""
        if self.req is None:
            error = error or next((p.error for p in self.parts if p.error is not None), None)
            if error is not None:
                raise error
            return
        state.end(self.token)
        if self.traced and trace.active():  # drawn from its post to its completion, on any thread
            trace.active().record(self.name, self.group.name, self.seq, self.plan[NBYTES], self.traced,
                                  trace.now_ns())
        completes = self.op.completes
        if error is not None:
            raise self._failure(error, completes) if _mpi.is_error(error) else error
        if completes is not None:  # the op's own step (a receive's count check): the source rank, the Work's
            self.source = completes(self.plan, self.status, self.peer, self.describe)
        after = self.plan[AFTER]
        if after is not None:
            after()

    def _failure(self, exc, completes) -> HpccommError:
        """The error of a request that completed with MPI error ``exc``:
        the op's own step's (``completes``: a receive's larger message), else one named after the op."""
        named = None if completes is None else completes(self.plan, self.status, self.peer, self.describe, exc)
        return named if named is not None else failures.mpi_error(self.describe(), exc, self.kind == "collective")


# -- the queue entries' runs (hpccomm._core.comm_thread calls ``run(entry)``) --
def run_queued(entry) -> None:
    """Entry ``(run_queued, record, call, asynchronous)``: a queued op, run
    here in its plan's blocking form (numbered there and told to its
    record: ``running``); its outcome completes the record."""
    _, record, call, asynchronous = entry
    error = None
    try:
        execute(record.group, record.op, call, record.plan, record, asynchronous, record.io)
    except BaseException as exc:  # noqa: BLE001 - handed to its waiters
        error = exc
    record.ran(error)


def complete_posted(entry) -> None:
    """Entry ``(complete_posted, record)``: a posted collective whose future
    was asked for, its request waited for here, at its place in the group's
    op order (so its callbacks run there on every rank alike); its outcome
    completes the record."""
    record, error = entry[1], None
    try:
        record.req.Wait(record.status)
    except BaseException as exc:  # noqa: BLE001 - handed to its waiters
        error = exc
    record.ran(error)


# The future's callback runs inside torch's C++ layer: kept out of torch.compile.
hide_from_compiler(OpRecord, ["_result_or_raise"])
