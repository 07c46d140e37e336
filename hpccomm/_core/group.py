"""A process group's MPI side: its communicators, ranks and op counters.

Torch-free (but for tensors): the torch-facing adapters (``process_group.py``
for torch 2.13, ``backend.py`` for torch >= 2.14) wrap one :class:`Group`.

Op numbers.  ``seq`` counts the group's collectives and is the same on every
member (debug-mode fingerprints and the watchdog's store keys depend on it);
``p2p_seq`` counts this rank's point-to-point ops, which other members need
not match.  hpccomm.state.start takes them, and records what runs.
"""
from __future__ import annotations

import itertools
import threading
from typing import Optional, Sequence

from .. import _mpi, config
from . import comm_thread, debug_mode, flight, shutdown, signatures, state

_ids = itertools.count()
_made: dict = {}  # global ranks -> groups of exactly those ranks this process made


class MPICalls:
    """The MPI calls plans hand over, bound once per group: ``calls.Allreduce``
    is ``comm.Allreduce`` (binding a method makes an object, on every op
    otherwise); ``Isend`` and ``Irecv`` are the point-to-point communicator's."""

    __slots__ = ("Allreduce", "Iallreduce", "Bcast", "Ibcast", "Allgather", "Iallgather", "Allgatherv",
                 "Reduce_scatter_block", "Ireduce_scatter_block", "Barrier", "Isend", "Irecv")

    def __init__(self, comm, p2p) -> None:
        for name in self.__slots__[:-2]:
            setattr(self, name, getattr(comm, name))
        self.Isend, self.Irecv = p2p.Isend, p2p.Irecv


class Group:
    """An MPI communicator owned by hpccomm, with what error messages need.

    ``global_ranks``: this group's members as ranks of the default (world)
    group, in group-rank order.  ``comm``: the communicator collectives run
    on; ``p2p``: a duplicate for user point-to-point traffic (never matches
    hpccomm's own messages); ``checks``: a duplicate that only the
    cross-rank checks use (hpccomm._core.signatures, debug mode), in the
    thread that runs the group's collectives; ``calls``: the calls plans
    make on ``comm`` and ``p2p`` (:class:`MPICalls`); ``gpu``: its CUDA
    routes (hpccomm._gpu.group_routes.GroupRoutes: what it was told, chose
    and made for each device), None until its first CUDA op or setting.

    Its attributes are slots: the op path reads several on every op, and a
    slot is read without a dict lookup (CPython 3.11 also stops sharing an
    instance dict's keys past 30 attributes, which slowed every read).
    """

    __slots__ = ("comm", "p2p", "checks", "calls", "rank", "size", "global_ranks", "key", "name", "desc", "store",
                 "_timeout", "timeout_s", "seq", "p2p_seq", "_seqs", "_p2p_seqs", "running", "last", "queued",
                 "is_world", "coalescing", "checked", "_observed", "_debug", "instrumented", "nonblocking",
                 "max_count", "tag_ub", "_owns_comm", "_lock", "barriers", "flight", "gpu", "__weakref__")

    def __init__(self, comm, global_ranks: Sequence[int], name: str = "", store=None,
                 timeout=None, owns_comm: bool = True, tag_ub: Optional[int] = None) -> None:
        self.comm = comm
        self.p2p = comm.Dup()  # collective over comm's members only
        signatures.attach(self)  # the checks communicator (also a Dup) and the first-call check's state
        self.calls = MPICalls(comm, self.p2p)
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.global_ranks = list(global_ranks)
        members = tuple(self.global_ranks)
        n = _made.get(members, 0)
        _made[members] = n + 1
        #: The same on every member (members make their groups of one set of ranks in
        #: one order), whatever name torch gives the group: keys the store notices.
        self.key = f"{','.join(map(str, members))}#{n}"
        self.name = name or f"hpccomm:{next(_ids)}"
        self.desc = ""
        self.store = store
        self.timeout = timeout
        self.seq = 0  # collectives run so far (equal on every member)
        self.p2p_seq = 0  # point-to-point ops posted so far (this rank's own)
        self._seqs, self._p2p_seqs = itertools.count(1), itertools.count(1)  # next() is atomic under the GIL
        #: the record of the collective it runs in its blocking form (reused; hpccomm._core.state.start)
        self.running = state.InFlight(self)
        self.last = None  # the name of its latest collective (its number: seq)
        self.flight = flight.ring()  # its last ops, for the flight record (hpccomm._core.flight; None: off)
        self.queued = 0  # async ops of this group not yet run by the comm thread
        self.is_world = False
        self.coalescing = None  # a list of pending p2p ops while torch coalesces them
        #: The checked calls of this group by their shape (hpccomm._ops.op_path: an op's ``key`` -> its Call).
        self.checked = {}
        self.barriers = 0  # hpccomm.monitored_barrier's calls on this group (its store keys)
        self.gpu = None  # its CUDA routes, made at its first CUDA op or setting (hpccomm._gpu.group_routes)
        # tracing or per-op debug logging (the settings, read when the group is made)
        self._observed = bool(config.get("HPCCOMM_TRACE")) or config.get("HPCCOMM_LOG") == "DEBUG"
        self.debug = debug_mode.enabled()  # compare every collective across ranks first
        # async ops of up to 64 KiB posted as nonblocking MPI collectives (hpccomm._ops.op_path.form)
        self.nonblocking = config.get("HPCCOMM_ASYNC_NONBLOCKING")
        self.max_count = config.get("HPCCOMM_MAX_MPI_COUNT")
        self.tag_ub = _mpi.tag_ub() if tag_ub is None else tag_ub  # the largest tag MPI takes
        self._owns_comm = owns_comm
        self._lock = threading.Lock()
        _mpi.live.add(self)
        state.groups.add(self)
        shutdown.register()  # its queued and posted ops are settled at exit

    def where(self, seq: int | None = None) -> str:
        """Context for error messages: op number, group and rank.  ``seq``
        None names the collective being checked (the next one)."""
        return f"op #{self.seq + 1 if seq is None else seq} on group '{self.name}', rank {self.rank}/{self.size}"

    def where_p2p(self, seq: int | None = None) -> str:
        """As :meth:`where`, for this rank's point-to-point ops."""
        n = self.p2p_seq + 1 if seq is None else seq
        return f"p2p op #{n} on group '{self.name}', rank {self.rank}/{self.size}"

    def subgroup(self, ranks: Sequence[int], tag: int, name: str = "", store=None, timeout=None) -> "Group":
        """The group of ``ranks`` (ranks of this group), built collectively by
        the members only (MPI_Comm_create_group): non-members take no part."""
        return Group(create_group(self.comm, ranks, tag), [self.global_ranks[r] for r in ranks], name, store,
                     timeout)

    def free(self, flush: bool = True) -> None:
        """Free the communicators, after this group's queued ops ran (``flush``)."""
        if self.comm is not None and flush:
            comm_thread.flush(self)
        comm, p2p, self.comm, self.p2p, self.calls = self.comm, self.p2p, None, None, None
        self.checked = {}  # (its checked calls' plans are bound to these communicators: a later call is refused)
        MPI = _mpi.mpi()
        if comm is None or MPI.Is_finalized():
            return
        p2p.Free()
        signatures.detach(self)
        if self._owns_comm:
            comm.Free()

    @property
    def debug(self) -> bool:
        """Debug mode: every collective is compared across the group's ranks first (hpccomm._core.debug_mode)."""
        return self._debug

    @debug.setter
    def debug(self, on: bool) -> None:
        self._debug = on
        #: Debug mode, tracing or per-op debug logging: the op path takes its instrumented branch
        #: (hpccomm._core.execute); one attribute test on the latency-bound path.
        self.instrumented = bool(on) or self._observed

    @property
    def freed(self) -> bool:
        return self.comm is None

    @property
    def timeout(self):
        """The group's timeout (a timedelta, or None for none)."""
        return self._timeout

    @timeout.setter
    def timeout(self, value) -> None:
        seconds = None
        if value is not None:
            seconds = value.total_seconds() if hasattr(value, "total_seconds") else float(value)
        self._timeout, self.timeout_s = value, (seconds if seconds and seconds > 0 else None)
        if self.timeout_s:
            from .watchdog import watchdog

            watchdog.start()  # it watches this group's ops from now on


class Members:
    """The members of a group being created, before it has a communicator:
    the group side of its creation's record (hpccomm._core.state.InFlight,
    ``kind`` ``"setup"``), which the watchdog reads like a group's (its ranks,
    store and timeout; a timeout's diagnosis goes through the new group's
    store).

    ``ranks``: its members as world ranks, in group-rank order; ``rank``,
    ``size``: this rank's place in it; ``store``, ``timeout``: the new
    group's (torch's options).  Example: ``Members([0, 2], 1, 2, store,
    timedelta(seconds=60)).where()`` is ``creating the new group of ranks
    [0, 2], rank 1/2``."""

    __slots__ = ("global_ranks", "rank", "size", "name", "store", "timeout", "timeout_s")

    def __init__(self, ranks, rank: int, size: int, store=None, timeout=None) -> None:
        self.global_ranks = list(ranks)
        self.rank, self.size = rank, size
        self.name = f"new group of ranks {self.global_ranks}"
        self.store, self.timeout = store, timeout
        seconds = timeout.total_seconds() if timeout is not None else 0
        self.timeout_s = seconds if seconds > 0 else None

    def where(self, seq=None) -> str:
        """What it is, for messages (``seq`` ignored: a group being made has no ops)."""
        return f"creating the {self.name}, rank {self.rank}/{self.size}"

    where_p2p = where


def create_group(comm, ranks: Sequence[int], tag: int):
    """A communicator over ``ranks`` of ``comm``, made by those ranks only
    (MPI_Comm_create_group): the other ranks of ``comm`` take no part."""
    mgroup = comm.Get_group().Incl(list(ranks))
    try:
        return comm.Create_group(mgroup, tag)
    finally:
        mgroup.Free()


def world(comm=None, store=None, timeout=None, name: str = "") -> Group:
    """A group over a private duplicate of ``comm`` (default COMM_WORLD).

    hpccomm never communicates on the user's communicator itself, so its
    messages cannot match the user's own.
    """
    MPI = _mpi.mpi()
    base = MPI.COMM_WORLD if comm is None else comm
    dup = base.Dup()
    return Group(dup, range(dup.Get_size()), name, store, timeout)

