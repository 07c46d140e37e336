"""Timeouts: a daemon thread that notices an op outliving its group's timeout.

Every collective registers itself while it runs (a dict insert and delete,
about a microsecond).  The ``hpccomm-watchdog`` thread wakes once a second;
when an op has run longer than its group's timeout, the watchdog

1. publishes in the group's key-value store which op this rank is stuck in,
2. waits a few seconds for the other members' own reports (they time out on
   the same op at about the same time), then
3. prints one line naming the op, its group and sequence number, and which
   ranks never arrived (or are stuck in an earlier op, or did not answer:
   busy outside hpccomm, hung or dead), and
4. acts as ``HPCCOMM_ON_TIMEOUT`` says: ``abort`` (default) calls
   MPI_Abort, ending every rank of the job: an MPI collective cannot be
   cancelled, so its state is not recoverable; ``warn`` only prints.
"""
from __future__ import annotations

import itertools
import sys
import threading
import time
from typing import Optional

from . import config

_GRACE = 3.0  # seconds to wait for the other ranks' reports


class _Op:
    __slots__ = ("group", "name", "seq", "start", "deadline", "reported")

    def __init__(self, group, name, seq, start, deadline) -> None:
        self.group, self.name, self.seq, self.start, self.deadline = group, name, seq, start, deadline
        self.reported = False


class Watchdog:
    def __init__(self) -> None:
        self._ops: dict = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._last_timeout, self._last_seconds = None, 0.0

    def begin(self, group, name: str, seq: int) -> Optional[int]:
        timeout = group.timeout
        if timeout is None:
            return None
        if timeout is self._last_timeout:  # every op asks: convert each timeout once
            seconds = self._last_seconds
        else:
            seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
            self._last_timeout, self._last_seconds = timeout, seconds
        if seconds <= 0:
            return None
        token = next(self._ids)
        now = time.monotonic()
        self._ops[token] = _Op(group, name, seq, now, now + seconds)
        if self._thread is None:
            self._start()
        return token

    def end(self, token: Optional[int]) -> None:
        if token is not None:
            self._ops.pop(token, None)

    def current(self) -> Optional[_Op]:
        """The longest-running op on this rank, or None."""
        ops = list(self._ops.values())
        return min(ops, key=lambda op: op.start) if ops else None

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="hpccomm-watchdog", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            time.sleep(1.0)
            now = time.monotonic()
            for op in list(self._ops.values()):
                if now > op.deadline and not op.reported:
                    op.reported = True
                    self._expired(op, now)

    def _expired(self, op: _Op, now: float) -> None:
        g = op.group
        message = (f"hpccomm: rank {g.global_ranks[g.rank] if g.global_ranks else g.rank}: {op.name} "
                   f"(op #{op.seq} on group '{g.name}', group rank {g.rank}/{g.size}) did not complete within "
                   f"its timeout of {g.timeout}: {self._diagnose(op)}")
        action = config.get("HPCCOMM_ON_TIMEOUT")
        print(message + ("; aborting the job (HPCCOMM_ON_TIMEOUT=abort)" if action == "abort" else ""),
              file=sys.stderr, flush=True)
        if action == "abort":
            from . import _mpi, _signals

            _signals.record_failure(f"timed out in {op.name} (op #{op.seq} on group '{g.name}')")
            _mpi.abort(3)

    def _diagnose(self, op: _Op) -> str:
        """Which members never arrived, learned through the store."""
        g = op.group
        store = g.store
        if store is None or g.size == 1:
            return "no key-value store to ask the other ranks"
        prefix = f"hpccomm/timeout/{op.seq}/"
        try:
            store.set(prefix + str(g.rank), f"{op.seq}:{op.name}")
            deadline = time.monotonic() + _GRACE
            answers: dict = {}
            while time.monotonic() < deadline and len(answers) < g.size:
                for r in range(g.size):
                    if r not in answers and store.check([prefix + str(r)]):
                        answers[r] = store.get(prefix + str(r)).decode()
                time.sleep(0.1)
        except Exception as exc:  # noqa: BLE001 - a diagnosis must not hide the timeout
            return f"could not ask the other ranks through the store ({exc})"
        missing = [g.global_ranks[r] for r in range(g.size) if r not in answers]
        if not missing:
            return "every rank of the group is in this op (a deadlock inside MPI, or a network failure)"
        return (f"rank(s) {missing} never arrived (busy outside hpccomm, hung or dead); "
                f"waiting in it: {sorted(g.global_ranks[r] for r in answers)}")


watchdog = Watchdog()
