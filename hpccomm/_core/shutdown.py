"""hpccomm's part of the exit, before MPI_Finalize (hooks on ``hpccomm._mpi.at_exit``).

In order: every group's queued ops run and the comm thread stops (0, the
thread rule: hpccomm._core.comm_thread); every MPI request still posted is
settled (1.5); gloo's workers let go (3, hpccomm._core.gloo_exit); the
watchdog stops (9, hpccomm._core.watchdog); then hpccomm._mpi frees the
communicators.  Registered when the first group is made (hpccomm._core.group).
"""
from __future__ import annotations

import time

from .. import _mpi
from . import comm_thread, failures, state
from .record import OpRecord


def drain_and_stop() -> None:
    """Every group's queued ops run, then the comm thread stops."""
    for group in list(_mpi.live):
        if getattr(group, "comm", None) is not None:
            comm_thread.flush(group)
    comm_thread.stop()


def settle_posted(seconds: float = 2.0) -> None:
    """Every request still posted is settled, the comm thread stopped.  A
    collective's is waited for (MPI forbids cancelling or freeing it; the
    other ranks run the same collective, so it completes; one still running
    past its group's timeout ends the job with the watchdog's kind of
    message, the watchdog may have stopped).  A point-to-point request is
    completed if it can be within ``seconds`` (a send whose receiver is also
    exiting), else a receive is cancelled and a send's request freed (MPI
    lets it finish on its own)."""
    MPI = _mpi.mpi()
    posted = [r for r in state.records() if isinstance(r, OpRecord) and r.req is not None]
    deadline = time.monotonic() + seconds
    for r in posted:
        try:
            if r.kind == "collective":
                while not r.req.Test():
                    if r.deadline is not None and time.monotonic() > r.deadline + 2.0:
                        failures.timed_out_at_exit(r.describe())
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


def register() -> None:
    """Put the hooks on ``hpccomm._mpi.at_exit`` (once)."""
    if all(hook is not drain_and_stop for _, hook in _mpi.at_exit):
        _mpi.at_exit.extend([(0, drain_and_stop), (1.5, settle_posted)])
