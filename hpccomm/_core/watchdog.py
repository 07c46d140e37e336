"""Timeouts: a daemon thread that notices an op outliving its group's timeout.

Every op is recorded in :mod:`hpccomm._core.state` while it runs, as one
:class:`~hpccomm._core.state.InFlight` record whatever its form: a
blocking collective in its group's own record while it communicates, a
posted op (its record, hpccomm._core.record) from the moment it is posted
until it completes, a group's creation, split or shrink (:meth:`Watchdog.begin`)
while it lasts.  The ``hpccomm-watchdog`` thread wakes once a second and
reads them (:func:`hpccomm._core.state.records`: the records themselves,
none made per tick); when an op has run longer than its group's timeout,
the watchdog

1. publishes in the group's key-value store which op this rank is stuck in,
2. waits a few seconds for the other members' own reports (they time out on
   the same op at about the same time), then
3. prints one line naming the op, its group and sequence number, and which
   ranks left (destroyed their process group, or their program ended: they
   said so in the store, hpccomm._core.state.record_leaving) and which never
   arrived (or are stuck elsewhere, or did not answer: busy outside hpccomm,
   hung or dead), and
4. hands it to the failure policy (hpccomm._core.failures.timed_out),
   which acts as ``HPCCOMM_ON_TIMEOUT`` says: ``abort`` (default) calls
   MPI_Abort, ending every rank of the job: an MPI collective cannot be
   cancelled, so its state is not recoverable; ``warn`` only prints.

Threads: this thread never calls MPI but for MPI_Abort, and reads only
settings validated at init (:mod:`hpccomm.config`).  At exit it is stopped
and joined (an ``hpccomm._mpi.at_exit`` hook, after the ops still queued
have run under its watch): a daemon thread inside a torch store call when
the interpreter finalizes is ended by Python 3.11 as it takes the GIL back,
and the forced unwind through torch's C++ binding aborts the process
(``terminate called without an active exception``; seen with
``HPCCOMM_ON_TIMEOUT=warn``, where the watchdog deletes its report of an op
that completed late as the program ends).
"""
from __future__ import annotations

import sys
import threading
import time
from typing import Optional

from . import failures, flight, signatures, state

_GRACE = 3.0  # seconds to wait for the other ranks' reports
_TICK = 1.0
_ASK_AFTER = 1.0  # an op running this long asks the store whether a peer refused it
_ASK_AT_MOST = 16  # ops asked about per tick (the oldest first)
_JOIN = _GRACE + 2 * _TICK  # at exit: how long to wait for the thread to leave a store call
_AT_EXIT_ORDER = 9  # after the hooks that run queued ops and complete pending requests (hpccomm._mpi.at_exit)


class Watchdog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stopping = threading.Event()

    def begin(self, group, name: str, seq: int) -> int:
        """Watch ``name``, a step of ``group`` that may hang outside its op
        order (its creation: ``group`` its members, hpccomm._core.group.Members;
        a split, a shrink), against the group's timeout, as a record of kind
        ``"setup"`` numbered ``seq`` (the group's latest collective); returns
        the token for :meth:`end`.

        Example: ``token = watchdog.begin(g, "split_group", g.seq)``, then
        ``watchdog.end(token)`` in a ``finally``."""
        record = state.InFlight(group, name, "setup")
        record.seq, record.start = seq, time.monotonic()
        token = state.watch(record)
        if group.timeout_s and self._thread is None:
            self.start()
        return token

    @staticmethod
    def end(token) -> None:
        state.end(token)

    def start(self) -> None:
        """Start the watchdog thread (once): a group with a timeout exists."""
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None:
                from .. import _mpi

                self._thread = threading.Thread(target=self._loop, name="hpccomm-watchdog", daemon=True)
                self._thread.start()
                _mpi.at_exit.append((_AT_EXIT_ORDER, self.stop))

    def stop(self) -> None:
        """At exit: end the thread and wait (at most ``_JOIN`` seconds) until
        it has left any store call (see the module's docstring)."""
        self._stopping.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN)

    def _loop(self) -> None:
        # (group id, kind, seq, start) -> (record, this rank's timeout key): reported (timed out or refused)
        reported: dict = {}
        notes_left: set = set()  # (group id, seq) of the first-call checks this rank left a note of in the store
        while not self._stopping.wait(_TICK):
            now = time.monotonic()
            live = {}
            for op in state.records():
                start = op.start  # (a group's own record: read first, then its fields, then checked: state.InFlight)
                if start is None:
                    continue
                key = (id(op.group), op.kind, op.seq, start)
                if op.start is start:  # (else that collective ended and another began meanwhile: next tick)
                    live[key] = op
            for key in [k for k in reported if k not in live]:  # it completed after all (HPCCOMM_ON_TIMEOUT=warn)
                if not self._stopping.is_set():
                    op, timeout_key = reported.pop(key)
                    op.timed_out = False  # (a group's own record goes on with its next collective)
                    _forget_report(op.group, timeout_key)
            for key, op in live.items():
                if key in reported:
                    continue
                seconds = op.group.timeout_s
                if seconds and now > key[3] + seconds:
                    reported[key] = (op, state.timeout_key(op))
                    op.expired()  # its timed_out mark (hpccomm._core.state.InFlight): it stays running
                    try:
                        self._expired(op, key[3])
                    except Exception as exc:  # noqa: BLE001 - the watchdog must outlive any one report
                        print(f"hpccomm: the watchdog could not report a timeout: {exc!r}", file=sys.stderr,
                              flush=True)
            waiting = sorted((key for key in live if now - key[3] > _ASK_AFTER and key not in reported),
                             key=lambda key: key[3])[:_ASK_AT_MOST]
            if waiting and not self._stopping.is_set():
                flight.answer()  # a rank ending the job asked for every rank's flight record
            for key in waiting:
                if self._stopping.is_set():
                    break
                op = live[key]
                try:
                    if self._peer_refused(op) or signatures.watch(op, notes_left):  # (a check stuck against an op)
                        reported[key] = (op, state.timeout_key(op))
                except Exception:  # noqa: BLE001 - the store may be gone (rank 0 dead): the timeout still holds
                    pass

    def _expired(self, op, start) -> None:
        """Report ``op`` (started at ``start``) past its deadline, unless it ended meanwhile."""
        g = op.group
        me = g.global_ranks[g.rank] if g.global_ranks else g.rank
        if op.kind == "p2p":
            peer = "any rank" if op.peer is None else f"rank {g.global_ranks[op.peer]}"
            what = f"{op.name} with {peer} ({op.where()})"
        else:
            what = f"{op.name} ({op.where()})"
        if op.start is not start:
            return  # it completed as it was read (a group's own record, reused since)
        flight.dump_quietly(f"timed out in {what}")  # (as the op stands, before the diagnosis's seconds)
        failures.timed_out(f"hpccomm: rank {me}: {what} did not complete within its timeout of {g.timeout}: "
                           f"{self._diagnose(op)}", what)

    def _peer_refused(self, op) -> bool:
        """Whether another rank announced it refused the op this rank waits
        in (its checks raised there; this rank's MPI call cannot end): then
        the failure policy acts (hpccomm._core.failures.peer_refused) and
        True is returned once reported."""
        g = op.group
        if op.kind == "setup" or g.store is None or g.size == 1:
            return False  # (a group's creation, split or shrink is outside the op order: nothing to refuse)
        me = g.global_ranks[g.rank]
        if op.kind == "p2p":
            if op.peer is None:
                return False
            key = state.refusal_key(g, "p2p", from_rank=g.global_ranks[op.peer], to_rank=me)
        else:
            key = state.refusal_key(g, "collective", seq=op.seq)
        if not g.store.check([key]):
            return False
        said = g.store.get(key).decode(errors="replace")
        failures.peer_refused(f"hpccomm: rank {me}: {op.name} ({op.where()}) cannot complete: another rank refused "
                              f"it ({said})")
        return True

    def _diagnose(self, op) -> str:
        """Which members never arrived (a collective) or what the peer is
        doing (point-to-point), learned through the store."""
        g = op.group
        store = g.store
        if store is None or g.size == 1:
            return "no key-value store to ask the other ranks"
        if op.kind == "p2p":
            return self._diagnose_p2p(op)
        prefix = state.timeout_key(op, "")
        try:
            store.set(state.timeout_key(op), f"{op.seq}:{op.name}")
            answers = _collect(store, prefix, range(g.size), self._stopping)
        except Exception as exc:  # noqa: BLE001 - a diagnosis must not hide the timeout
            return f"could not ask the other ranks through the store ({exc})"
        missing = [g.global_ranks[r] for r in range(g.size) if r not in answers]
        if not missing:
            return "every rank of the group is in this op (a deadlock inside MPI, or a network failure)"
        left = state.who_left(missing)
        gone = "; ".join(f"rank {r} left: it {what}" for r, what in sorted(left.items()))
        missing = [r for r in missing if r not in left]
        never = f"rank(s) {missing} never arrived (busy outside hpccomm, hung or dead)" if missing else ""
        return "; ".join(x for x in (gone, never, f"waiting in it: {sorted(g.global_ranks[r] for r in answers)}")
                         if x)

    def _diagnose_p2p(self, op) -> str:
        g = op.group
        store = g.store
        prefix = state.timeout_key(op, "")
        me = str(g.global_ranks[g.rank])
        peers = range(g.size) if op.peer is None else [op.peer]
        others = [str(g.global_ranks[r]) for r in peers if r != g.rank]
        try:
            store.set(state.timeout_key(op), f"{op.name} ({op.where()})")
            answers = _collect(store, prefix, others, self._stopping)
        except Exception as exc:  # noqa: BLE001 - a diagnosis must not hide the timeout
            return f"could not ask the other ranks through the store ({exc})"
        if op.peer is None:
            return "no rank sent a matching message" + (
                f"; stuck elsewhere: {', '.join(f'rank {r} in {w}' for r, w in sorted(answers.items()))}"
                if answers else "")
        peer = others[0] if others else me
        if peer in answers:
            return f"rank {peer} is stuck in {answers[peer]} (the two ranks wait for each other)"
        matching = op.matched_by  # (the op's declaration names its counterpart)
        left = state.who_left([int(peer)])
        if left:
            return f"rank {peer} left before posting the matching {matching}: it {left[int(peer)]}"
        return (f"rank {peer} never posted the matching {matching} "
                "(busy outside hpccomm, hung or dead)")


def current():
    """The longest-running op on this rank (a :class:`~hpccomm._core.state.InFlight`
    record), or None."""
    found, first = None, None
    for op in state.records():
        start = op.start
        if start is not None and (first is None or start < first):
            found, first = op, start
    return found


def _forget_report(group, key: str) -> None:
    """Delete this rank's report ``key`` of a timed-out op of ``group`` that completed after all."""
    store = group.store
    if store is None:
        return
    try:
        store.delete_key(key)
    except Exception:  # noqa: BLE001 - cleaning up a warning must not raise into the op path
        pass


def _collect(store, prefix: str, keys, stop: threading.Event, grace: float = _GRACE) -> dict:
    """``{key: value}`` of the ``prefix + key`` entries that appear within
    ``grace`` seconds (fewer once ``stop`` is set: the program is ending)."""
    deadline = time.monotonic() + grace
    answers: dict = {}
    keys = list(keys)
    while time.monotonic() < deadline and len(answers) < len(keys) and not stop.is_set():
        for k in keys:
            if k not in answers and store.check([prefix + str(k)]):
                answers[k] = store.get(prefix + str(k)).decode()
        stop.wait(0.1)
    return answers


watchdog = Watchdog()
