"""What is running on this rank, and who failed: the one place that knows.

The op path records every op while it communicates (:func:`begin`/:func:`end`,
a dict insert and delete); the watchdog (timeouts), the SIGTERM reporter
(:mod:`hpccomm._signals`), the excepthook and :mod:`hpccomm.errors`' messages
read it.  A rank that is about to end the job records why in the world
group's key-value store (:func:`record_failure`), so that the other ranks'
lines can name it.  Nothing here calls MPI or starts a thread.
"""
from __future__ import annotations

import itertools
import os
import weakref
import socket
import time
from typing import Optional

FAILURE_KEY = "hpccomm/failure"


class Op:
    """An op this rank is in: ``kind`` is ``"collective"`` or ``"p2p"``;
    ``peer`` the other rank of a point-to-point op (None: any source)."""

    __slots__ = ("group", "name", "seq", "start", "deadline", "kind", "peer")

    def __init__(self, group, name, seq, start, deadline, kind="collective", peer=None) -> None:
        self.group, self.name, self.seq, self.start, self.deadline = group, name, seq, start, deadline
        self.kind, self.peer = kind, peer

    def where(self) -> str:
        g = self.group
        return g.where_p2p(self.seq) if self.kind == "p2p" else g.where(self.seq)


#: token -> Op: the point-to-point ops, posted collectives (and rare others) this rank is in now.
#: The op path's hottest callers use it directly: ``watched.pop(token, None)`` is :func:`end`,
#: ``watched[token] = op`` with a token ``next(ids)`` is :func:`watch`, without their calls.
watched: dict = {}
ids = itertools.count()
#: The groups whose collectives run here: each says which one it is in, if
#: any, in ``group.running`` = ``(name, seq, start)`` (set and cleared by the
#: op path, no allocation but the tuple: the cheapest way for the hottest
#: path), and its latest in ``group.last``.  hpccomm._group adds every group.
groups = weakref.WeakSet()
#: [the group whose collective started last on this rank]
last_group: list = [None]


def begin(group, name: str, seq: int, seconds: Optional[float], kind: str = "collective", peer=None) -> int:
    """Record that this rank entered op ``name`` (point-to-point ops, group
    creation, debug checks; the op path records collectives in
    ``group.running`` itself); ``seconds`` its time limit (None: none).
    Returns the token for :func:`end`."""
    token = next(ids)
    now = time.monotonic()
    watched[token] = Op(group, name, seq, now, now + seconds if seconds else None, kind, peer)
    return token


def watch(op) -> int:
    """Record ``op`` as running: an :class:`Op`, or an object with its fields
    and ``where()`` (a posted point-to-point op records itself, so posting
    makes no record object).  Returns the token for :func:`end`."""
    token = next(ids)
    watched[token] = op
    return token


def records() -> list:
    """The records made by :func:`begin` and :func:`watch` still open (a snapshot)."""
    return list(watched.values())


def end(token):
    """The op of ``token`` is over; returns it (None if unknown)."""
    return watched.pop(token, None)


def running() -> list:
    """The ops this rank is in now (a snapshot): the registered ones, and
    each group's running collective (as an :class:`Op`)."""
    ops = list(watched.values())
    for g in list(groups):
        entry = getattr(g, "running", None)
        if entry is not None:
            name, seq, start = entry
            seconds = getattr(g, "timeout_s", None)
            ops.append(Op(g, name, seq, start, start + seconds if seconds else None))
    return ops


def current() -> Optional[Op]:
    """The longest-running op on this rank, or None."""
    ops = running()
    return min(ops, key=lambda op: op.start) if ops else None


def last_op_text() -> str:
    """``"last op: all_reduce (op #3 on group '0', rank 1/4)"``, or ``"before any op"``."""
    g = last_group[0]
    latest = getattr(g, "last", None)
    return f"last op: {latest[0]} ({g.where(latest[1])})" if latest else "before any op"


# ----------------------------------------------------------------------------
# who failed
# ----------------------------------------------------------------------------

class _World:
    rank = 0
    size = 1
    store = None
    peers: list = []  # (host, pid) per world rank


world = _World()


def set_world(rank: int, size: int, store, peers) -> None:
    """Called when the world group is made, with every rank's (host, pid)."""
    world.rank, world.size, world.store, world.peers = rank, size, store, list(peers)


def record_failure(what: str) -> None:
    """A rank about to end the job says why, in the store, for the others' lines."""
    store = world.store
    if store is None or world.size == 1:
        return
    try:
        store.set(FAILURE_KEY, f"rank {world.rank} {what}")
    except Exception:  # noqa: BLE001 - the store's host may be the one failing
        pass


def recorded_failure() -> Optional[str]:
    store = world.store
    if store is None:
        return None
    try:
        if store.check([FAILURE_KEY]):
            return store.get(FAILURE_KEY).decode(errors="replace")
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
