"""What is running on this rank, and who failed: the one place that knows.

- What runs: every op in flight, whatever its form, and every step of a
  group that may hang outside its op order (its creation, a split, a shrink)
  is one :class:`InFlight` record, watched from its start to its end
  (:func:`records` lists them; the watchdog, the SIGTERM reporter, the
  flight recorder and the exit read them, nothing else):

  | form | its record | from | to |
  |---|---|---|---|
  | a collective in its blocking form, in the calling thread or on the comm thread (a queued op while it runs) | its group's own, ``group.running``, made with the group and reused by each such collective (no object per op) | :func:`start` (no record) | :func:`finished` |
  | a posted op (a point-to-point op, or a collective in its nonblocking form) | its op record (hpccomm._core.record.OpRecord, an :class:`InFlight`) | :func:`start` (with it) | :func:`end` (it completed) |
  | a group's creation, split or shrink (``kind`` ``"setup"``) | its own, made by hpccomm._core.watchdog.begin | :func:`watch` | :func:`end` |

  A queued op waiting for the comm thread is not running: it has no record
  there yet; a batch of point-to-point ops is watched through its parts.
- Op numbers: :func:`start` numbers every op when it starts (a group's
  collectives are numbered alike on every member: they run in the same order
  everywhere; point-to-point ops are numbered per rank).
- The flight recorder's entries: :func:`start` puts each op it numbers in its
  group's ring (``group.flight``; hpccomm._core.flight writes the rings out),
  as a tuple of the fields :data:`F_ID` ... :data:`F_START`.
- Who failed: a rank about to end the job records why in the world group's
  key-value store (:func:`record_failure`), so that the other ranks' lines
  can name it; :data:`failures` holds what fault tolerance (hpccomm.fault_tolerance)
  knows of lost ranks.
- Who left: a rank that destroys its world group or ends its program says so
  in the world's key-value store (:func:`record_leaving`), so that a rank
  whose op times out waiting for it names it as gone rather than hung
  (:func:`who_left`).
- The keys of the key-value store that ranks use to tell each other of a
  failure, a refusal, a departure or a timeout: :func:`failure_key`,
  :func:`refusal_key`, :func:`left_key`, :func:`timeout_key`.

The watchdog (timeouts), the SIGTERM reporter (hpccomm._core.signals), the
excepthook and hpccomm.errors' messages read it.  Nothing here calls MPI or
starts a thread.
"""
from __future__ import annotations

import itertools
import os
import weakref
import socket
import time
from typing import Optional

_monotonic = time.monotonic


#: token -> the :class:`InFlight` record of each op this rank is in now but each group's blocking
#: collective (its group's own record, ``group.running``): posted ops, and a group's creation, split or shrink.
watched: dict = {}
ids = itertools.count()
#: The groups of this process (hpccomm._core.group adds every group): each has its own
#: :class:`InFlight` record ``running`` of the collective it runs in its blocking form, and the
#: name of its latest collective in ``group.last`` (both set by :func:`start`).
groups = weakref.WeakSet()
#: [the group whose op started last on this rank]
last_group: list = [None]
#: The fields of a flight-recorder entry (:func:`start`), by index: a record id (every op of this
#: process, in the order numbered), ``"collective"`` or ``"p2p"``, its number (a point-to-point
#: op's by this rank's own numbering), the group's other number then (its point-to-point count for
#: a collective, its collective count for a point-to-point op), its name, its peer (a point-to-point
#: op's other rank in the group; None: any), its ``io`` (``(sizes_in, dtypes_in, sizes_out,
#: dtypes_out)``: per input tensor, then per output tensor, an element count or a shape as a tuple
#: of ints, and a ``torch.dtype`` or torch's name of it, each a tuple, as the op path handed it),
#: and its start (``time.monotonic()``).  Plain values, so that Python's garbage collector stops
#: tracking them (a ring of lists, or of ``torch.Size``, made collections longer while it filled),
#: written here, where the op is numbered: a call frame more per op costs about 700 instructions.
#: Whether the op is over is not kept: :func:`records` says what runs.
F_ID, F_KIND, F_SEQ, F_OTHER_SEQ, F_NAME, F_PEER, F_IO, F_START = range(8)
_records = itertools.count()


class InFlight:
    """One op in flight on this rank, or one step of a group outside its op
    order that may hang: the one record the watchdog, the SIGTERM reporter,
    the flight recorder and the exit read, whatever the op's form (the module
    docstring's table says who makes it and when).

    ``group``: the group it runs on (hpccomm._core.group.Group), or for a
    group being created its members (hpccomm._core.group.Members); ``name``:
    what it is in messages; ``kind``: ``"collective"`` (numbered alike on every
    member), ``"p2p"`` (numbered by this rank; ``peer``: the other group rank,
    None for any; ``matched_by``: the op the peer must post for it to
    complete, its declaration's: hpccomm._ops.op.Op)
    or ``"setup"`` (a group's creation, split or shrink, watched against the
    timeout outside the op order; its ``seq`` the number of the group's
    latest collective); ``seq``, ``start``: its number and when it
    started (``time.monotonic()``; ``start`` None: a group's record between
    two collectives); ``token``: its key in :data:`watched` (None: a group's
    own record, never in it); ``timed_out``: the watchdog reported it past
    its deadline (a mark: it may still complete, ``HPCCOMM_ON_TIMEOUT=warn``;
    the watchdog clears a group's own record's once that collective is over).

    A group's own record is rewritten by each blocking collective; whoever
    changes it clears ``start`` first and sets it last (:func:`start`,
    :func:`relabel`, :func:`finished`), so a reader on another thread that
    reads ``start``, then the other fields, then finds ``start`` the same
    object read one collective's fields (hpccomm._core.watchdog does).

    Example: ``InFlight(g, "new_group", "setup")``, numbered and started,
    then :func:`watch`; its ``describe()`` reads ``new_group (op #0 on group
    '1', rank 1/4)`` and its deadline is its start plus its group's timeout.
    """

    __slots__ = ("group", "name", "kind", "peer", "matched_by", "seq", "start", "token", "timed_out")

    def __init__(self, group, name: str = "", kind: str = "collective", peer=None, matched_by=None) -> None:
        self.group, self.name, self.kind, self.peer, self.matched_by = group, name, kind, peer, matched_by
        self.seq = self.start = self.token = None
        self.timed_out = False

    @property
    def deadline(self):
        """When it is past its group's timeout (``time.monotonic()``); None: no timeout, or not running."""
        seconds, start = self.group.timeout_s, self.start
        return start + seconds if seconds and start is not None else None

    def where(self) -> str:
        """``op #3 on group '0', rank 1/4`` (``p2p op #3 ...`` for a point-to-point op)."""
        return self.group.where_p2p(self.seq) if self.kind == "p2p" else self.group.where(self.seq)

    def describe(self) -> str:
        """What it is, for messages: ``all_reduce (op #3 on group '0', rank 1/4)``."""
        return f"{self.name} ({self.where()})"

    def expired(self) -> None:
        """The watchdog reported it past its deadline (``timed_out``)."""
        self.timed_out = True


def start(group, op: str, record=None, io=None) -> int:
    """Number op ``op`` of ``group`` and record it as running on this rank;
    returns its number.  Its ``io``, unless None, puts it in the group's
    flight record (the fields :data:`F_ID` ...).

    ``record`` None: a collective that runs now in the thread that calls
    this (its blocking form), recorded in its group's own :class:`InFlight`
    (``group.running``, reused: no object per op) until :func:`finished`.
    Else a posted op's record (an :class:`InFlight`: hpccomm._core.record.OpRecord,
    ``kind`` ``"p2p"``, numbered apart, or ``"collective"``), which gets its
    number, start time and ``token`` here, and is watched until :func:`end`.
    Collectives are numbered in the thread that runs (or posts) them, when it
    does: they run in the same order on every member, so they are numbered
    alike everywhere, whichever thread issued them; ``next()`` on the
    counters is atomic under the GIL.
    """
    now = _monotonic()
    if record is None:
        group.seq = seq = next(group._seqs)
        running = group.running
        running.start = None  # (cleared first, set last: InFlight's docstring)
        running.name, running.seq = op, seq
        running.start = now
        group.last = op
        last_group[0] = group
        if io is not None:
            group.flight.append((next(_records), "collective", seq, group.p2p_seq, op, None, io, now))
        return seq
    if record.kind == "p2p":
        group.p2p_seq = seq = next(group._p2p_seqs)
        if io is not None:
            group.flight.append((next(_records), "p2p", seq, group.seq, op, record.peer, io, now))
    else:
        group.seq = seq = next(group._seqs)
        group.last = op
        last_group[0] = group
        if io is not None:
            group.flight.append((next(_records), "collective", seq, group.p2p_seq, op, None, io, now))
    record.seq, record.start = seq, now
    record.token = token = next(ids)
    watched[token] = record
    return seq


def relabel(group, op: str) -> None:
    """The collective running on ``group`` goes on as ``op`` (same number,
    started now): after debug mode's fingerprint check, which ran under its own label."""
    running = group.running
    running.start = None  # (cleared first, set last: InFlight's docstring)
    running.name = group.last = op
    running.start = _monotonic()


def finished(group) -> None:
    """The collective :func:`start` recorded in ``group.running`` is over."""
    group.running.start = None


def watch(record) -> int:
    """Watch ``record`` (an :class:`InFlight` of what else may hang: a
    group's creation, split or shrink, numbered and started by the caller)
    until :func:`end` with the token returned."""
    record.token = token = next(ids)
    watched[token] = record
    return token


def records() -> list:
    """The :class:`InFlight` records of what runs now (a snapshot of the
    list; the records themselves live): those watched (:func:`start` with a
    record, :func:`watch`) and each group's own record while a collective
    runs in it."""
    found = list(watched.values())
    for g in list(groups):
        running = g.running
        if running.start is not None:
            found.append(running)
    return found


def end(token):
    """The op of ``token`` (:func:`start`, :func:`watch`) is over; returns it (None if unknown)."""
    return watched.pop(token, None)


def last_op_text() -> str:
    """``"last op: all_reduce (op #3 on group '0', rank 1/4)"``, or ``"before any op"``."""
    g = last_group[0]
    latest = getattr(g, "last", None)
    return f"last op: {latest} ({g.where(g.seq)})" if latest else "before any op"


# ----------------------------------------------------------------------------
# who failed
# ----------------------------------------------------------------------------

class _World:
    group = None  # hpccomm's world group (hpccomm._core.group.Group), while it lives
    rank = 0
    size = 1
    store = None
    peers: list = []  # (host, pid) per world rank


world = _World()


class Failures:
    """What this rank knows of lost ranks (fault tolerance, hpccomm.fault_tolerance)."""

    tolerant = False  # fault tolerance is on (agreed at init): MPI errors may mean a rank died
    first = None  # the first hpccomm.RankFailure seen since the last shrink
    revoked = False  # every hpccomm communicator revoked since that failure


failures = Failures()


def set_fault_tolerance(on: bool) -> None:
    """The ranks agreed at init whether fault tolerance is on."""
    failures.tolerant = on


def failure_key() -> str:
    """The world store's key where a rank ending the job says why (:func:`record_failure`)."""
    return "hpccomm/failure"


def left_key(rank) -> str:
    """The world store's key where world rank ``rank`` says it left (:func:`record_leaving`)."""
    return f"hpccomm/left/{rank}"


def refusal_key(g, kind: str, seq=None, from_rank=None, to_rank=None) -> str:
    """Where a rank announces that it refused an op the others may wait in
    (hpccomm._ops.op_path.refused): a collective by its number on the group, a
    point-to-point op by its two world ranks."""
    if kind == "p2p":
        return f"hpccomm/refused/{g.key}/p2p/{from_rank}->{to_rank}"
    return f"hpccomm/refused/{g.key}/{seq}"


def timeout_key(op, rank=None) -> str:
    """Where a watchdog reports that its rank timed out in ``op`` (an
    :class:`InFlight`): this rank's key, or ``rank``'s (a world rank for a
    point-to-point op, a group rank for a collective); ``rank=""`` gives the
    prefix that every rank's key for that op starts with."""
    g = op.group
    if op.kind == "p2p":
        return f"hpccomm/timeout/p2p/{g.global_ranks[g.rank] if rank is None else rank}"
    return f"hpccomm/timeout/{op.seq}/{g.rank if rank is None else rank}"


def set_world_group(group) -> None:
    """Called when hpccomm's world group is made (and made again after a shrink)."""
    world.group = group


def set_world(rank: int, size: int, store, peers) -> None:
    """Called when the world group is made, with every rank's (host, pid)."""
    world.rank, world.size, world.store, world.peers = rank, size, store, list(peers)
    _leaving.clear()


def record_failure(what: str) -> None:
    """A rank about to end the job says why, in the store, for the others' lines."""
    store = world.store
    if store is None or world.size == 1:
        return
    try:
        store.set(failure_key(), f"rank {world.rank} {what}")
    except Exception:  # noqa: BLE001 - the store's host may be the one failing
        pass


_leaving: list = []  # what this rank recorded of its leaving, in order


def record_leaving(what: str) -> None:
    """This rank leaves the job's collectives (``what``: ``"destroyed its
    process group ..."``, ``"ended its program"``): say so in the world's
    key-value store, after what it said before, for the timeout lines of the
    ranks still waiting for it (hpccomm._core.watchdog)."""
    store = world.store
    if store is None or world.size == 1:
        return
    _leaving.append(what)
    try:
        store.set(left_key(world.rank), ", then ".join(_leaving))
    except Exception:  # noqa: BLE001 - the store's host (rank 0) may be gone already
        pass


def has_left() -> bool:
    """Whether this rank recorded leaving (:func:`record_leaving`) since the world was made."""
    return bool(_leaving)


def who_left(ranks) -> dict:
    """``{world rank: what it said}`` for those of ``ranks`` that left (:func:`record_leaving`)."""
    store = world.store
    if store is None:
        return {}
    found = {}
    for r in ranks:
        try:
            if store.check([left_key(r)]):
                found[r] = store.get(left_key(r)).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the store's host (rank 0) may be the one gone
            break
    return found


def recorded_failure() -> Optional[str]:
    store = world.store
    if store is None:
        return None
    try:
        if store.check([failure_key()]):
            return store.get(failure_key()).decode(errors="replace")
    except Exception:  # noqa: BLE001 - the store's host (rank 0) may be dead
        return "the key-value store on rank 0 does not answer (rank 0 may be dead)"
    return None


def who_failed() -> str:
    recorded = recorded_failure()
    if recorded:
        return recorded
    dead = dead_local_peers(world.peers)
    if dead:
        return ", ".join(f"rank {r} (pid {pid} on {host}) is dead" for r, host, pid in dead)
    return ("no failed rank known here (one on another node, or the job was cancelled: "
            "the launcher's message names it)")


def dead_local_peers(peers) -> list:
    """``(rank, host, pid)`` of the ranks on this host whose process is gone
    or a zombie (killed, not yet reaped by the launcher)."""
    me = socket.gethostname()
    dead = []
    for rank, (host, pid) in enumerate(peers):
        if host == me and pid != os.getpid() and not alive(pid):
            dead.append((rank, host, pid))
    return dead


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): ask the kernel
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
