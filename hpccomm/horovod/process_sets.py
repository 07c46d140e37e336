"""Horovod's process sets, each a pair of hpccomm process groups.

A process set owns two torch process groups over its ranks (each an MPI
communicator): one carries the data of its collectives, the other the small
agreement exchange that precedes every op (see hpccomm.horovod.ops), so that
exchange never waits behind queued transfers.
"""
from __future__ import annotations

import itertools
from typing import Optional

import torch.distributed as dist

import hpccomm

from . import basics


class ProcessSet:
    """A set of Horovod processes that run collectives together.

    Made from a list of global ranks or from an mpi4py communicator, then
    registered by :func:`hvd.init(process_sets=[...]) <init>` or
    :func:`add_process_set`; ``process_set_id`` is set once registered.
    Collectives take it as ``process_set=``. Root ranks (``broadcast``) stay
    global ranks, as in Horovod.

    :param ranks_or_comm: a sequence of global ranks, or an mpi4py communicator
        (registered at :func:`init` only; its members call init with it).
    :raises ValueError: the ranks are not integers, or ``ranks_or_comm`` is
        neither a sequence nor an mpi4py communicator.

    Example::

        evens = hvd.ProcessSet(range(0, hvd.size(), 2))
        hvd.add_process_set(evens)          # every rank calls it
        if evens.included():
            hvd.allreduce(t, process_set=evens)
    """

    process_set_id = None
    ranks = None
    mpi_comm = None

    def __init__(self, ranks_or_comm) -> None:
        self._data = None   # torch group for the data (members only)
        self._ctrl = None   # torch group for the agreement exchange
        self.negotiations = 0
        if isinstance(ranks_or_comm, (list, tuple, range, set, frozenset)):
            if any(not isinstance(r, int) or isinstance(r, bool) for r in ranks_or_comm):
                raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm object")
            self.ranks = sorted(ranks_or_comm)
            return
        if not isinstance(ranks_or_comm, hpccomm.mpi_module().Comm):
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm object")
        self.mpi_comm = ranks_or_comm

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> Optional[int]:
        """The number of processes in the set, or None if it is not registered.

        Example::

            print(evens.size())
        """
        if self.process_set_id is None:
            return None
        return len(self.ranks)

    def rank(self) -> Optional[int]:
        """This process's rank within the set, or None if it is not registered.

        :raises ValueError: this process is not in the set.

        Example::

            mine = hvd.allgather(t, process_set=evens)[evens.rank()]
        """
        if self.process_set_id is None:
            return None
        me = basics.rank()
        if me not in self.ranks:
            raise ValueError("Process is not part of provided process set.")
        return self.ranks.index(me)

    def included(self) -> Optional[bool]:
        """Whether this process is in the set (None when its ranks are not known yet).

        Example::

            if evens.included():
                hvd.barrier(process_set=evens)
        """
        if self.ranks is None:
            return None
        return basics.rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

_table: dict = {}          # id -> ProcessSet, on this process
_ids = itertools.count(1)


def _where(ps: ProcessSet) -> str:
    return f"process set {ps.process_set_id}"


def member(ps, op: str) -> ProcessSet:
    """``ps`` checked for use by ``op`` on this rank: registered, and this rank in it."""
    basics.require_init()
    if not isinstance(ps, ProcessSet):
        raise ValueError(f"hpccomm.horovod {op}: process_set must be an hvd.ProcessSet, not {type(ps).__name__}")
    if ps.process_set_id is None or _table.get(ps.process_set_id) is not ps:
        raise ValueError(f"hpccomm.horovod {op}: {ps} does not exist, or has not been registered (hvd.init("
                         "process_sets=[...]) or hvd.add_process_set)")
    if basics.state.rank not in ps.ranks:
        raise ValueError(f"hpccomm.horovod {op}: rank {basics.state.rank} is not a member of the provided process set "
                         f"{ps.ranks}")
    return ps


def setup_global() -> None:
    ps = global_process_set
    ps.ranks = list(range(basics.state.size))
    ps.negotiations = 0
    ps._data = dist.new_group(ps.ranks)
    ps._ctrl = dist.new_group(ps.ranks)
    _table.clear()
    _table[0] = ps


def _make_groups(ps: ProcessSet) -> None:
    """The set's two torch groups, made by every rank (torch's rule for new_group)."""
    ps.negotiations = 0
    data = dist.new_group(ps.ranks)
    ctrl = dist.new_group(ps.ranks)
    if basics.state.rank in ps.ranks:
        ps._data, ps._ctrl = data, ctrl


def _make_groups_from_comm(ps: ProcessSet) -> None:
    """The set's groups from its mpi4py communicator (its members call this)."""
    ps.negotiations = 0
    ps._data = hpccomm.from_mpi4py(ps.mpi_comm)
    ps._ctrl = hpccomm.from_mpi4py(ps.mpi_comm)
    ps.ranks = sorted(dist.get_process_group_ranks(ps._data))


def _duplicate(ranks) -> bool:
    return any(other.ranks == ranks for other in _table.values())


def register_at_init(process_sets) -> None:
    for i, ps in enumerate(process_sets):
        if not isinstance(ps, ProcessSet):
            raise ValueError(f"hvd.init: process_sets entry number {i} is a {type(ps).__name__}, not an hvd.ProcessSet")
        if ps.ranks is not None:
            bad = [r for r in ps.ranks if not 0 <= r < basics.state.size]
            if bad:
                raise ValueError(f"hvd.init: process_sets entry number {i} names rank(s) {bad} outside the world of "
                                 f"size {basics.state.size}: {ps}")
            if _duplicate(ps.ranks):
                ps._invalidate()
                raise ValueError(f"Horovod could not be initialized because process_sets entry number {i} is a "
                                 f"duplicate: {ps}")
            _make_groups(ps)
        else:
            _make_groups_from_comm(ps)
        ps.process_set_id = next(_ids)
        _table[ps.process_set_id] = ps


def add_process_set(process_set) -> ProcessSet:
    """Register a process set after :func:`init`; every rank calls it, with the same ranks.

    Needs ``hvd.init(process_sets="dynamic")`` or ``HOROVOD_DYNAMIC_PROCESS_SETS=1``, as in Horovod.

    :param process_set: an unregistered :class:`ProcessSet` or a list of global ranks.
    :returns: the registered :class:`ProcessSet`.
    :raises ValueError: not initialised; dynamic process sets not enabled; a
        set with the same ranks exists; a rank is outside the world.
    :raises NotImplementedError: the set was made from an mpi4py communicator
        (register those at :func:`init`).

    Example::

        hvd.init(process_sets="dynamic")
        odd = hvd.add_process_set(range(1, hvd.size(), 2))
    """
    basics.require_init()
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None:
        raise NotImplementedError("Dynamically adding process sets defined by an MPI communicator is not implemented. "
                                  "Please build the process set via a list of ranks.")
    if not basics.state.dynamic:
        raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow adding process sets after Horovod initialization.")
    bad = [r for r in process_set.ranks if not 0 <= r < basics.state.size]
    if bad:
        raise ValueError(f"hvd.add_process_set: rank(s) {bad} are outside the world of size {basics.state.size}")
    if _duplicate(process_set.ranks):
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    _make_groups(process_set)
    process_set.process_set_id = next(_ids)
    _table[process_set.process_set_id] = process_set
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (every rank calls it) and free its groups.

    :param process_set: a registered :class:`ProcessSet`.
    :returns: True if it was removed; False for the global set or a set that is
        not registered.
    :raises ValueError: not initialised, or dynamic process sets not enabled.

    Example::

        assert hvd.remove_process_set(odd)
    """
    basics.require_init()
    if not basics.state.dynamic:
        raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 to allow removing process sets after Horovod "
                         "initialization.")
    psid = process_set.process_set_id
    if psid is None or psid == 0 or _table.get(psid) is not process_set:
        return False
    _free(process_set)
    del _table[psid]
    process_set._invalidate()
    return True


def _free(ps: ProcessSet) -> None:
    for g in (ps._data, ps._ctrl):
        if g is not None and dist.is_initialized():
            dist.destroy_process_group(g)
    ps._data = ps._ctrl = None


def teardown() -> None:
    for ps in list(_table.values()):
        _free(ps)
        if ps is not global_process_set:
            ps._invalidate()
    _table.clear()
