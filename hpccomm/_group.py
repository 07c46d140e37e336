"""A process group's MPI side: its communicator, ranks and op counter.

Torch-free (but for tensors): the torch-facing adapter in
``process_group.py`` wraps one :class:`Group`.
"""
from __future__ import annotations

import itertools
import threading
from typing import Optional, Sequence

from . import _mpi, config

_ids = itertools.count()


class Group:
    """An MPI communicator owned by hpccomm, with what error messages need.

    ``global_ranks``: this group's members as ranks of the default (world)
    group, in group-rank order.
    """

    def __init__(self, comm, global_ranks: Sequence[int], name: str = "", store=None,
                 timeout=None, owns_comm: bool = True) -> None:
        self.comm = comm
        self.p2p = comm.Dup()  # user point-to-point: never matches hpccomm's own messages
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.global_ranks = list(global_ranks)
        self.name = name or f"hpccomm:{next(_ids)}"
        self.desc = ""
        self.store = store
        self.timeout = timeout
        self.seq = 0
        self.queued = 0  # async ops of this group not yet run by the comm thread
        self.is_world = False
        from . import _debug

        self.debug = _debug.enabled()  # compare every collective across ranks first
        self.max_count = config.get("HPCCOMM_MAX_MPI_COUNT")
        self.tag_ub = _mpi.mpi().COMM_WORLD.Get_attr(_mpi.mpi().TAG_UB) or 32767
        self._owns_comm = owns_comm
        self._lock = threading.Lock()
        _mpi.live.add(self)

    def where(self, seq: int | None = None) -> str:
        """Context for error messages: op number (``seq``, default the latest), group and rank."""
        return f"op #{self.seq if seq is None else seq} on group '{self.name}', rank {self.rank}/{self.size}"

    def subgroup(self, ranks: Sequence[int], tag: int, name: str = "", store=None, timeout=None) -> "Group":
        """The group of ``ranks`` (ranks of this group), built collectively by
        the members only (MPI_Comm_create_group): non-members take no part."""
        mgroup = self.comm.Get_group().Incl(list(ranks))
        try:
            comm = self.comm.Create_group(mgroup, tag)
        finally:
            mgroup.Free()
        return Group(comm, [self.global_ranks[r] for r in ranks], name, store, timeout)

    def free(self, flush: bool = True) -> None:
        """Free the communicators, after this group's queued ops ran (``flush``)."""
        from ._engine import engine

        if self.comm is not None and flush:
            engine.flush(self)
        comm, p2p, self.comm, self.p2p = self.comm, self.p2p, None, None
        MPI = _mpi.mpi()
        if comm is None or MPI.Is_finalized():
            return
        p2p.Free()
        if self._owns_comm:
            comm.Free()

    @property
    def freed(self) -> bool:
        return self.comm is None


def world(comm=None, store=None, timeout=None, name: str = "") -> Group:
    """A group over a private duplicate of ``comm`` (default COMM_WORLD).

    hpccomm never communicates on the user's communicator itself, so its
    messages cannot match the user's own.
    """
    MPI = _mpi.mpi()
    base = MPI.COMM_WORLD if comm is None else comm
    dup = base.Dup()
    return Group(dup, range(dup.Get_size()), name, store, timeout)


def optional_free(group: Optional[Group]) -> None:
    if group is not None:
        group.free()
