"""The comm thread: hpccomm's one background thread that calls MPI.

THE THREAD RULE.  Every thread hpccomm starts, and whether it may call MPI:

| thread | calls MPI? | on which communicators, and what it does |
|---|---|---|
| the calling thread | yes | checks every op (a refusal raises before any communication); runs blocking collectives on the group's ``comm`` when the group has nothing queued (and their cross-rank checks on its ``checks``, hpccomm._core.signatures); posts point-to-point ops on the group's ``p2p`` and, with ``HPCCOMM_ASYNC_NONBLOCKING=1``, small ``async_op=True`` collectives on ``comm`` (hpccomm._ops.op_path), and tests and waits on those requests itself |
| ``hpccomm-comm`` (this module; started at the first queued op, MPI_THREAD_MULTIPLE only) | yes | runs queued ops (``async_op=True`` collectives, and ops issued behind them) in issue order on each group's ``comm`` (their checks on its ``checks``); completes them, futures included, so DDP's callbacks run here; tests the posted ops whose future was asked for, until they complete |
| ``hpccomm-watchdog`` (hpccomm._core.watchdog) | only MPI_Abort | ends an op that outlives its group's timeout, or that another rank refused |
| ``hpccomm-signals`` (hpccomm._core.signals) | only MPI_Abort | one line when the launcher ends the rank with SIGTERM |
| ``hpccomm-init-watch`` (hpccomm._mpi, while MPI_Init runs) | no | ends the process with a message if MPI_Init has not returned within the timeout |

No communicator is used by two threads at once: a group with queued ops is
the comm thread's alone (a blocking op queues behind them; a new
sub-communicator or a free drains them first: ``flush``), a waiter running its
queued op in the thread's place counts as the thread (``steal``), and a request
is touched under its record's lock.  Below MPI_THREAD_MULTIPLE queued ops run
in the caller and this thread never starts (logged once; ``hpccomm info``).
Fault tolerance's revocation is the one exception: MPI_Comm_revoke exists to
interrupt a communicator another thread is in.  The queue holds entries,
tuples ``(run, record, ...)``: what to run and the record it completes
(hpccomm._core.record's, and ``flush``'s marks), as ProcessGroupMPI queues
``(WorkEntry, Work)`` pairs.  The thread calls ``run(entry)``, then, the
group counted idle, ``record.release()``; it uses a record through that
and ``group`` only, and watched posted ops' records through ``test()``
(tested between queued entries with a back-off up to 1 ms).
"""
from __future__ import annotations

import collections
import logging
import threading
from _thread import allocate_lock as _allocate_lock
from typing import Optional

from .. import _mpi

log = logging.getLogger("hpccomm")

_get_ident = threading.get_ident
#: The comm thread's name (its track in hpccomm._core.trace's timeline).
THREAD_NAME = "hpccomm-comm"
_IDLE_MIN, _IDLE_MAX = 1e-5, 1e-3  # the back-off between tests of watched records (seconds)


def latch():
    """A closed latch: a taken lock; ``release()`` opens it, a waiter
    ``acquire()``s then ``release()``s it.  Far cheaper than a ``threading.Event``."""
    lock = _allocate_lock()
    lock.acquire()
    return lock


class _Mark:
    """The record of a queue entry that runs nothing (``(_nothing, mark)``):
    :meth:`CommThread.flush` waits until it has run."""

    __slots__ = ("group", "latch", "release")

    def __init__(self, group) -> None:
        self.group, self.latch = group, latch()
        self.release = self.latch.release


def _nothing(entry) -> None:
    """A mark's run."""


class CommThread:
    """One FIFO queue of entries and its thread.  One plain lock guards the
    queue, the thread's sleep, the watched records and every group's
    ``queued``; the thread sleeps on another, released by a submitter that
    finds it asleep (two lock operations, not a Python Condition)."""

    def __init__(self) -> None:
        self._queue: collections.deque = collections.deque()
        self._mutex = _allocate_lock()
        self._wake = latch()  # opened to wake the thread when it sleeps
        self._sleeping = self._busy = self._stopping = False  # busy: an op runs (here, or in its waiter)
        self._thread: Optional[threading.Thread] = None
        self._ident = self._stealer = None  # the thread's id; a waiter's running its own op in its place
        self._usable: Optional[bool] = None
        self._watched: list = []  # posted ops whose future was asked for: tested until they complete

    def usable(self) -> bool:
        """Whether queued ops may run on the comm thread (MPI_THREAD_MULTIPLE granted)."""
        if self._usable is None:
            level = _mpi.thread_level()
            self._usable = level == "MULTIPLE"
            if not self._usable:
                log.warning("MPI granted thread level %s, not MULTIPLE: async ops run in the calling thread "
                            "and complete before returning (no overlap)", level)
        return self._usable

    def on_it(self) -> bool:
        """Whether the caller is the comm thread (a callback it runs), or a waiter in its place."""
        ident = _get_ident()
        return ident == self._ident or ident == self._stealer

    def submit(self, entry) -> None:
        """Queue ``entry`` (``(run, record, ...)``): the thread runs it after
        every entry queued before it."""
        with self._mutex:
            self._stopping = False
            entry[1].group.queued += 1
            self._queue.append(entry)
            if not self._busy:  # (busy: the thread, or the stealer, looks at the queue when done)
                self._wake_locked(True)

    def steal(self, record) -> bool:
        """Run the queued entry of ``record`` in its waiter (the caller) in
        the thread's place if it is the only one queued and the thread idle
        (else False): it runs and completes as on the thread, the caller
        counting as the thread, saving two thread switches per op waited on at once."""
        with self._mutex:
            queue = self._queue
            if self._busy or len(queue) != 1 or queue[0][1] is not record:
                return False
            entry = queue.popleft()
            self._busy, self._stealer = True, _get_ident()
        entry[0](entry)
        with self._mutex:
            self._busy, self._stealer = False, None
            record.group.queued -= 1
            self._wake_locked(queue)  # ops queued meanwhile, or records to test: the thread takes them
        record.release()  # another waiter of the op
        return True

    def watch(self, record) -> None:
        """Test ``record`` (a posted op whose future was asked for) until it completes."""
        with self._mutex:
            self._stopping = False
            if record not in self._watched:
                self._watched.append(record)
            self._wake_locked(True)

    def flush(self, group) -> None:
        """Wait until ``group`` has no queued ops (before a collective that must not overlap them)."""
        if group.queued:
            mark = _Mark(group)
            self.submit((_nothing, mark))
            mark.latch.acquire()
            mark.latch.release()

    def stop(self, seconds: float = 10.0) -> list:
        """Stop the thread once its queue is empty (at exit), waiting at most
        ``seconds``; the records it was still testing."""
        with self._mutex:
            self._stopping = True
            if self._sleeping:
                self._sleeping = False
                self._wake.release()
            thread, left = self._thread, list(self._watched)
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(seconds)
        return left

    def _wake_locked(self, needed) -> None:
        """(Mutex held) Wake the thread if it sleeps and ``needed``; start it if there is none."""
        if not needed:
            return
        if self._sleeping:
            self._sleeping = False
            self._wake.release()
        elif self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=THREAD_NAME, daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException:  # never expected: the next submit starts a new thread, not a queue forever
            with self._mutex:
                self._thread = self._ident = None
            raise

    def _serve(self) -> None:
        self._ident = _get_ident()
        queue, mutex, wake = self._queue, self._mutex, self._wake
        idle = _IDLE_MIN
        while True:
            with mutex:
                watched, entry = bool(self._watched), None
                if queue and not self._busy:
                    entry, self._busy = queue.popleft(), True
                elif self._stopping and not queue:
                    self._thread = self._ident = None
                    return
                else:
                    self._sleeping = True
            if entry is None:
                if not watched:
                    wake.acquire()  # until a submit, a watch or stop opens it
                elif not wake.acquire(True, idle):  # nothing submitted meanwhile: test the watched records
                    with mutex:
                        if self._sleeping:
                            self._sleeping = False
                        else:
                            wake.acquire()  # opened just now by a submitter: close it again
                    idle = _IDLE_MIN if self._test_watched() else min(idle * 2, _IDLE_MAX)
                continue
            entry[0](entry)
            record = entry[1]
            with mutex:
                self._busy = False
                record.group.queued -= 1
            record.release()  # its waiters go on only now: the group is idle, their next blocking op runs there

    def _test_watched(self) -> bool:
        """Test each watched record once (completing those done); True if any completed."""
        with self._mutex:
            records = list(self._watched)
        finished = [r for r in records if r.test()]
        if finished:
            with self._mutex:
                self._watched = [r for r in self._watched if r not in finished]
        return bool(finished)


_the = CommThread()
#: The comm thread's calls (see :class:`CommThread`): ``comm_thread.submit(entry)`` ...
usable, on_it, submit, steal, watch, flush, stop = (_the.usable, _the.on_it, _the.submit, _the.steal, _the.watch,
                                                    _the.flush, _the.stop)
