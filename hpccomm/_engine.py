"""The comm thread: where ``async_op=True`` collectives run, so communication
overlaps the caller's computation.

Threading model (docs/design.md has the whole story):

- A blocking op (``async_op=False``) runs its MPI call in the calling thread,
  unless its group still has queued async ops: then it queues behind them and
  the caller waits, so ops on one communicator run in the order they were
  issued, on every rank (MPI's rule for collectives).
- An async op is checked in the calling thread (bad input raises there, before
  any communication), then queued; one daemon thread, ``hpccomm-comm``, runs
  the queue in order, inside blocking MPI calls that release the GIL.  The
  returned Work completes when its job has run; its future completes on the
  comm thread, so DDP's callbacks run there.
- This needs MPI_THREAD_MULTIPLE (the caller and the comm thread may be in MPI
  at once, on different communicators).  With a lower level every op runs in
  the calling thread and async ops complete before returning; this is logged
  once and shown by ``hpccomm info``.
"""
from __future__ import annotations

import collections
import logging
import threading
from typing import Optional

from . import _mpi

log = logging.getLogger("hpccomm")


class Job:
    """A queued op: the function that communicates, and where its result goes."""

    __slots__ = ("group", "run", "done", "result", "error", "work")
    engine_completes = True  # the comm thread completes the Work (hpccomm._work)

    def __init__(self, group, run) -> None:
        self.group = group
        self.run = run
        self.done = threading.Event()
        self.result = None
        self.error: Optional[BaseException] = None
        self.work = None  # the Work to complete (set by the submitter)

    # -- the Pending protocol of hpccomm._work --------------------------------
    def test(self) -> bool:
        return self.done.is_set()

    def wait(self, seconds) -> bool:
        return self.done.wait(seconds)

    def finish(self):
        if self.error is not None:
            raise self.error
        self.work._outputs = self.result  # the future's value: the op's outputs
        return None


class Engine:
    """One FIFO queue and the thread that runs it."""

    def __init__(self) -> None:
        self._queue: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._usable: Optional[bool] = None

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
        """Whether the caller is the comm thread (a callback of a completed op)."""
        return threading.current_thread() is self._thread

    def submit(self, job: Job) -> Job:
        with self._cv:
            job.group.queued += 1
            self._queue.append(job)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="hpccomm-comm", daemon=True)
                self._thread.start()
            self._cv.notify()
        return job

    def flush(self, group) -> None:
        """Wait until ``group`` has no queued ops (before a collective that
        must not overlap them, such as building a sub-communicator)."""
        if group.queued:
            job = self.submit(Job(group, lambda: None))
            job.done.wait()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                job = self._queue.popleft()
            try:
                job.result = job.run()
            except BaseException as exc:  # noqa: BLE001 - handed to the job's waiter
                job.error = exc
            job.done.set()
            if job.work is not None:
                # Complete here, callbacks included, before the group counts as idle:
                # ops that callbacks issue (DDP hooks) run now, in the same place of
                # the op sequence on every rank.
                job.work._complete_on_engine()
            with self._cv:
                job.group.queued -= 1


engine = Engine()
