"""The comm thread, and hpccomm's rule for which thread may call MPI.

THE THREAD RULE (every thread hpccomm makes is listed here; docs/design.md
has the whole story):

- At MPI_THREAD_MULTIPLE (what hpccomm asks for, and what Open MPI, MPICH and
  Intel MPI grant here), each communicator has one owner at a time, and only
  these threads call MPI:
  * the calling thread: checks every op, runs blocking collectives on the
    group's ``comm`` when the group has no queued async op, posts
    point-to-point ops (MPI_Isend/Irecv on the group's ``p2p`` communicator)
    and waits on them, and (``HPCCOMM_ASYNC_NONBLOCKING=1``, off by
    default: DDP's Join passes async_op=True on some ranks and False on
    others) posts ``async_op=True`` all_reduce,
    all_gather_into_tensor, reduce_scatter_tensor and broadcast as
    nonblocking collectives (MPI_Iallreduce, MPI_Iallgather,
    MPI_Ireduce_scatter_block, MPI_Ibcast on ``comm``) when the group has no
    queued op, then tests (``is_completed``) and waits (``wait``) on such a
    request itself, unless it was handed to ``hpccomm-comm``;
  * ``hpccomm-comm`` (one daemon thread, this module): runs ``async_op=True``
    collectives, and blocking ones queued behind them, in issue order on the
    group's ``comm``; a group with queued ops is never used by the caller at
    the same time (blocking ops queue behind), and every creation of a
    sub-communicator or free of a communicator first drains its queue.  A
    waiter whose op is the only one queued and not yet started runs it in
    this thread's place (:meth:`Engine.steal`): the queue is the same, and
    this thread runs nothing meanwhile.  Posted collectives: it waits on the
    request of one whose future was asked for, as a queued job (a
    Work is completed once: whoever holds its lock first, and never by the
    caller after the hand-over); behind queued ops it posts an async
    collective of those four kinds itself, in the same nonblocking form, and
    waits (async ops past 64 KiB keep the blocking form here, for overlap:
    hpccomm.ops._common.NONBLOCKING_MAX_BYTES).  Whether an op is nonblocking is decided only from what is equal
    on every rank (op, ``async_op``, dtype, ReduceOp, element counts), never
    from which thread runs it: MPI never matches a nonblocking collective
    with a blocking one, so (with it on) ``async_op`` must be the same on
    every rank;
  * ``hpccomm-progress`` (hpccomm._work): MPI_Test on pending point-to-point
    requests whose future someone asked for; a request is touched by one
    thread at a time (the Work's lock).
- Below MPI_THREAD_MULTIPLE only the calling thread calls MPI: async ops run
  in the caller and complete before returning, a point-to-point Work's
  future is completed by waiting in the caller when asked for, and neither
  ``hpccomm-comm`` nor ``hpccomm-progress`` is started.  Logged once, shown
  by ``hpccomm info``.
- ``hpccomm-watchdog`` and ``hpccomm-signals`` never call MPI but for
  MPI_Abort when ending the job; they read only settings validated at init.
- ``hpccomm-init-watch`` (hpccomm._mpi) never calls MPI: it runs while
  MPI_Init may be blocked, and ends the process with a message if MPI_Init
  has not returned within init_process_group's timeout (the job
  preflight's: 300 s).
- At exit (hpccomm._mpi, before MPI_Finalize) the queued ops are run, the
  comm and progress threads are stopped and joined, posted collectives are
  waited for in the calling thread (MPI forbids cancelling or freeing them;
  the group's timeout still applies), pending point-to-point requests
  are completed or cancelled, and then the watchdog is stopped and joined
  (it calls torch's store: a daemon thread inside such a call when Python
  finalizes aborts the process).

The comm thread: a blocking op (``async_op=False``) runs its MPI call in the
calling thread, unless its group still has queued async ops: then it queues
behind them and the caller waits, so ops on one communicator run in the
order they were issued, on every rank (MPI's rule for collectives).  An
async op is checked in the calling thread (bad input raises there, before
any communication), then posted (the four ops above, see hpccomm._runner.
post_collective) or queued; ``hpccomm-comm`` runs the queue in order,
inside MPI calls that release the GIL.  The returned Work completes when
its job has run or its request completed; a future, once asked for,
completes on the comm thread, so DDP's callbacks run there.  Fault
tolerance, debug mode, the GPU transports and MPI below THREAD_MULTIPLE
keep the blocking form for every op (each is the same on every rank).
"""
from __future__ import annotations

import collections
import logging
import threading
from _thread import allocate_lock as _allocate_lock
from datetime import timedelta
from typing import Optional

from . import _mpi

log = logging.getLogger("hpccomm")


_get_ident = threading.get_ident
#: The comm thread's name (its track in hpccomm._trace's timeline).
THREAD_NAME = "hpccomm-comm"


def latch():
    """A closed latch: a plain lock, taken; ``release()`` opens it, and a
    waiter ``acquire()``s then ``release()``s it (so every waiter passes).
    Far cheaper than a ``threading.Event`` (a Python Condition per Event)."""
    lock = _allocate_lock()
    lock.acquire()
    return lock


def _nothing(job) -> None:
    return None


class Job:
    """A queued op: ``run(job)`` communicates (``op``, ``call`` and ``args``
    are the op path's), and where its result goes.  ``done``: a :func:`latch`
    opened once a job without a Work (a flush) has run; a job with a Work
    opens the Work's latch, if a waiter made one (after completing the Work)."""

    engine_completes = True  # the comm thread completes the Work (hpccomm._work)
    token = None  # the op registers itself with the watchdog while it runs
    done = None
    result = None
    error: Optional[BaseException] = None
    work = None  # the Work to complete (set by the submitter; let go of once complete)
    seq = None  # the op's number, taken when it runs
    asynchronous = False  # issued with async_op=True (debug mode compares it across ranks)

    def __init__(self, group, run, op: str = "", call=None, args=()) -> None:
        self.group = group
        self.run = run
        self.op, self.call, self.args = op, call, args

    def describe(self) -> str:
        """What the Work is, for its messages: the op and, once it ran, its number."""
        g = self.group
        return f"{self.op} ({g.where(self.seq) if self.seq is not None else 'group ' + repr(g.name)})"

    def describe_as(self, op: str):
        self.op = op
        return self.describe

    # -- the Pending protocol of hpccomm._work (its Work waits in its own way) --
    def test(self) -> bool:
        if self.done is not None:
            if self.done.acquire(False):
                self.done.release()
                return True
            return False
        return self.work is None or self.work._done

    def wait(self, seconds) -> bool:
        if self.done is not None:
            if self.done.acquire(True, -1 if seconds is None else seconds):
                self.done.release()
                return True
            return False
        work = self.work
        if work is None:
            return True
        try:
            work.wait(None if seconds is None else timedelta(seconds=seconds))
        except TimeoutError:
            return False
        except Exception:  # noqa: BLE001 - finish() raises it
            pass
        return True

    def finish(self):
        if self.error is not None:
            raise self.error
        self.work._outputs = self.result  # the future's value: the op's outputs
        return None


class Engine:
    """One FIFO queue and the thread that runs it.

    The queue, the thread's sleep and every group's ``queued`` count are
    guarded by one plain lock; the thread sleeps on another (released by the
    submitter that finds it asleep), so a submit costs two lock operations,
    not a Python Condition.
    """

    def __init__(self) -> None:
        self._queue: collections.deque = collections.deque()
        self._mutex = _allocate_lock()
        self._wake = latch()  # opened to wake the thread when it sleeps
        self._sleeping = False
        self._busy = False  # a job is running (on the comm thread, or taken by its waiter: steal)
        self._thread: Optional[threading.Thread] = None
        self._ident = None  # the thread's id while it runs
        self._stealer = None  # the id of a waiter running its own job in the comm thread's place
        self._usable: Optional[bool] = None
        self._stopping = False

    def usable(self) -> bool:
        """Whether async ops may run on the comm thread (MPI_THREAD_MULTIPLE granted)."""
        if self._usable is None:
            level = _mpi.thread_level()
            self._usable = level == "MULTIPLE"
            if not self._usable:
                log.warning("MPI granted thread level %s, not MULTIPLE: async ops run in the calling thread "
                            "and complete before returning (no overlap)", level)
        return self._usable

    def on_comm_thread(self) -> bool:
        """Whether the caller is the comm thread (a callback of a completed op),
        or a waiter standing in for it (:meth:`steal`)."""
        ident = _get_ident()
        return ident == self._ident or ident == self._stealer

    def steal(self, job: Job) -> bool:
        """Run queued ``job`` in the calling thread, its waiter, in the comm
        thread's place, if it is the only queued job and the comm thread is
        idle; False (nothing done) otherwise.

        Whoever runs it, the op is the next and only one on the queue, runs
        alone, and its Work completes (callbacks included) before the group
        counts as idle, exactly as on the comm thread; meanwhile the caller
        counts as the comm thread (:meth:`on_comm_thread`), so ops issued by
        callbacks run at once, as they would there.  A waiter would otherwise
        sleep while the comm thread runs the op: taking it saves two thread
        switches per op (an ``async_op=True`` op waited on at once).
        """
        with self._mutex:
            queue = self._queue
            if self._busy or len(queue) != 1 or queue[0] is not job:
                return False
            queue.popleft()
            self._busy = True
            self._stealer = _get_ident()
        try:
            job.result = job.run(job)
        except BaseException as exc:  # noqa: BLE001 - handed to the job's waiter
            job.error = exc
        work = job.work
        try:
            work._finish_on_engine()
        finally:
            job.work = None
            with self._mutex:
                self._busy = False
                self._stealer = None
                job.group.queued -= 1
                if queue and self._sleeping:  # ops queued meanwhile: the comm thread runs them
                    self._sleeping = False
                    self._wake.release()
            if work._completed is not None:
                work._completed.release()  # another waiter of the Work
        return True

    def submit(self, job: Job) -> Job:
        with self._mutex:
            self._stopping = False
            job.group.queued += 1
            self._queue.append(job)
            if self._sleeping and not self._busy:  # (busy: the stealer wakes it when done)
                self._sleeping = False
                self._wake.release()
            elif self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=THREAD_NAME, daemon=True)
                self._thread.start()
        return job

    def flush(self, group) -> None:
        """Wait until ``group`` has no queued ops (before a collective that
        must not overlap them, such as building a sub-communicator)."""
        if group.queued:
            job = Job(group, _nothing)
            job.done = latch()
            self.submit(job)
            job.done.acquire()
            job.done.release()

    def stop(self, seconds: float = 10.0) -> None:
        """Stop the comm thread once its queue is empty (at exit, before
        MPI_Finalize); waits for it at most ``seconds``."""
        with self._mutex:
            self._stopping = True
            if self._sleeping:
                self._sleeping = False
                self._wake.release()
            thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(seconds)

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException:  # never expected: the next submit starts a new thread instead of queuing forever
            with self._mutex:
                self._thread = self._ident = None
            raise

    def _serve(self) -> None:
        self._ident = _get_ident()
        queue, mutex, wake = self._queue, self._mutex, self._wake
        while True:
            with mutex:
                if queue and not self._busy:
                    job = queue.popleft()
                    self._busy = True
                elif self._stopping and not queue:
                    self._thread = self._ident = None
                    return
                else:
                    self._sleeping = True
                    job = None
            if job is None:
                wake.acquire()  # until a submit (or stop) opens it
                continue
            try:
                job.result = job.run(job)
            except BaseException as exc:  # noqa: BLE001 - handed to the job's waiter
                job.error = exc
            work = job.work
            if work is not None:
                # Complete here, callbacks included, before the group counts as idle:
                # ops that callbacks issue (DDP hooks) run now, in the same place of
                # the op sequence on every rank.
                work._finish_on_engine()
                job.work = None  # no Work <-> Job cycle left for the garbage collector
            with mutex:
                self._busy = False
                job.group.queued -= 1
            # The waiter goes on only now: the group is idle again, so its next
            # blocking op runs in the calling thread instead of queuing.
            done = job.done if work is None else work._completed
            if done is not None:
                done.release()


engine = Engine()


def _drain_and_stop() -> None:
    """At exit: every group's queued ops run, then the comm thread stops."""
    for group in list(_mpi.live):
        if getattr(group, "comm", None) is not None:
            engine.flush(group)
    engine.stop()


_mpi.at_exit.append((0, _drain_and_stop))
