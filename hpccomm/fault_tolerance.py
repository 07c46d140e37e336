"""Fault tolerance: a rank is lost and training goes on without it, in the
same job (MPI's User Level Failure Mitigation, ULFM).

Off by default.  ``hpccomm.init_process_group(fault_tolerance="ulfm")`` or
``HPCCOMM_FAULT_TOLERANCE=ulfm`` turns it on, under ``mpirun --with-ft ulfm``
with Open MPI 5 (whose PyPI wheel has ULFM compiled in); :func:`check_launch`
refuses, at init and on every rank, a launch or an MPI library that cannot
survive a failure, naming the missing flag.  docs/fault-tolerance.md is the
user's guide; this docstring says how it works.

Detection.  A call involving a dead process fails with MPI_ERR_PROC_FAILED
(MPI_ERR_PROC_FAILED_PENDING for a receive from any source).  The op path
(``hpccomm._core.execute`` for collectives, ``hpccomm._core.record`` for
point-to-point completions) hands every MPI error to the failure policy
(``hpccomm._core.failures``), which turns such an error into
:class:`RankFailure`; with the mode off nothing on the op path changes (the
question is asked only in an ``except`` branch).  The first thread of a rank
that sees a failure revokes every hpccomm communicator of that rank
(MPI_Comm_revoke, ``hpccomm._core.ulfm.revoke_all``): every op that any
survivor is in, or calls later, on any hpccomm group then fails at once with
MPI_ERR_REVOKED, which becomes RankFailure as well.  So every survivor learns
of the failure in the op it is in or in its next one, whether or not that op
involves the dead rank.  RankFailure names the dead ranks that MPI knows of
on this rank (MPI_Comm_get_failed; a rank that learned of the failure from a
revocation waits up to ``hpccomm._core.ulfm.NAME_WAIT`` seconds for MPI's
notice of who died).

Threads (an exception to hpccomm._core.comm_thread's one-owner rule): whichever
thread sees a failure revokes every hpccomm communicator, including ones
another thread is blocked in: interrupting them is what MPI_Comm_revoke is
for (MPI_THREAD_MULTIPLE).  :func:`shrink` runs in the calling thread after
draining the comm thread's queue (whose ops then fail at once).

Recovery.  :func:`shrink` (``hpccomm.shrink()``), called by every survivor:
MPI_Comm_shrink of the world's communicator agrees on who survived (it
tolerates failures while it runs); the failed ranks are the world's ranks
that are not in it.  From there on hpccomm.init rebuilds torch's world over
the new communicator: a new key-value store on the new rank 0 (the old one
lived on the old rank 0, which may be dead), the default group destroyed and
made again, and every hpccomm subgroup made again over its surviving
members.  A failure during that rebuild (a second failure, or the store not
reachable) is not recoverable: the job ends with a line saying so
(``hpccomm._core.failures.recovery_failed``).
On torch >= 2.14, ``dist.shrink_group`` reaches :func:`backend_shrink`
through hpccomm's Backend.

The watchdog still ends an op stuck past its group's timeout (MPI_Abort:
a live but hung rank cannot be shrunk away), and :func:`shrink` itself runs
under the world's timeout.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch.distributed as dist

from ._core import failures, state, ulfm
from ._core.failures import rank_failure
from ._start import creator
from . import _compat as compat
from ._adapters.backend import BackendHpccomm
from .errors import FailedRank, HpccommError, RankFailure

__all__ = ["FailedRank", "RankFailure", "Shrunk", "rank_failure", "shrink"]

#: Called between MPI_Comm_shrink and the rebuild of torch's world (tests
#: inject a second failure here; None otherwise).
_fault_injection = None


@dataclass
class Shrunk:
    """What :func:`hpccomm.shrink` did (it returns one; not made by users).

    :param failed: the ranks that failed, as ``FailedRank(rank, host, pid)``
        with their ranks in the world before the shrink.
    :param old_rank: this rank in the world before the shrink.
    :param old_size: the world size before the shrink.
    :param rank: this rank in the new world (``dist.get_rank()``).
    :param size: the new world size (``dist.get_world_size()``).
    :param groups: ``{old group: new group}`` for every hpccomm subgroup this
        rank was a member of, made again over its surviving members,
        renumbered in the same order.
    :param seconds: how long the shrink took on this rank.

    Example::

        result = hpccomm.shrink()
        print(f"lost {result.ranks}; rank {result.old_rank} of {result.old_size} is now "
              f"{result.rank} of {result.size}")
        pairs = result.group(pairs)          # a subgroup this rank was in
    """

    failed: tuple
    old_rank: int
    old_size: int
    rank: int
    size: int
    groups: dict = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ranks(self) -> tuple:
        """The failed ranks (world ranks before the shrink)."""
        return tuple(f.rank for f in self.failed)

    def group(self, old):
        """The group that replaced hpccomm group ``old`` (a group this rank was in).

        :raises KeyError: ``old`` was not an hpccomm subgroup this rank was a member of.
        """
        try:
            return self.groups[old]
        except KeyError:
            raise KeyError(f"hpccomm.shrink: {old!r} was not an hpccomm subgroup that rank {self.old_rank} was a "
                           "member of; the default group is dist.group.WORLD") from None


def _settle(groups) -> None:
    """Before the old groups go: their queued async ops run (and fail at
    once, their communicators being revoked), and point-to-point ops still
    pending on them stop being watched (their Works fail when waited on)."""
    from ._core import comm_thread

    for g in groups:
        comm_thread.flush(g)
    for record in state.records():  # a posted point-to-point op is its own record
        if record.kind == "p2p":
            state.end(record.token)


def _agree_on_survivors(g, groups, what: str):
    """Every communicator revoked and ``groups`` settled, MPI_Comm_shrink of
    group ``g``'s communicator under the watchdog (``what`` names it): the
    new communicator and the ranks of ``g`` that survived, in order."""
    from ._core.watchdog import watchdog

    ulfm.revoke_all()
    _settle(groups)
    token = watchdog.begin(g, f"{what} (MPI_Comm_shrink, waiting for every survivor)", g.seq)
    try:
        new = g.comm.Shrink()
    finally:
        watchdog.end(token)
    return new, ulfm.ranks_in(new.Get_group(), g.comm)


def shrink(timeout=None) -> Shrunk:
    """Go on without the ranks that failed: collective over every surviving rank.

    Call it on every survivor after :class:`hpccomm.RankFailure` (a survivor
    that was busy elsewhere learns of the failure at its next hpccomm op, or
    may call it directly).  MPI agrees on who survived (MPI_Comm_shrink);
    then the default group is replaced by one over the survivors, renumbered
    in the same order (``dist.get_rank()``, ``dist.get_world_size()`` and
    every ``dist.*`` call see the new world), a new key-value store is opened
    on the new rank 0, and every hpccomm subgroup is made again over its
    surviving members.  Old group objects are destroyed: use the new ones
    (``result.group(old)``), re-wrap DDP, make DeviceMeshes again.

    :param timeout: a :class:`datetime.timedelta` for the new world's
        collectives (default: the old world's timeout).  The shrink itself
        waits for every survivor at most the old world's timeout, then the
        job is ended naming the ranks that never came.
    :returns: :class:`hpccomm.Shrunk`: the failed ranks (``failed``, with
        hosts and pids; their ranks are the old world's), this rank's old and
        new rank and the sizes, ``groups`` (old subgroup -> new subgroup),
        and how long it took.
    :raises hpccomm.HpccommError: fault tolerance is off, or torch.distributed
        is not initialised with an hpccomm default group.  A failure during
        the shrink, after MPI agreed on the survivors (a second failure, the
        new store unreachable), is not recoverable: the job is aborted with a
        line naming both.

    Example::

        try:
            train_one_step()
        except hpccomm.RankFailure as failure:
            result = hpccomm.shrink()
            print(f"lost {result.ranks}, now rank {result.rank} of {result.size}")
            model = DistributedDataParallel(model.module)
    """
    if not state.failures.tolerant:
        raise HpccommError("hpccomm.shrink: fault tolerance is off; initialise with "
                           "hpccomm.init_process_group(fault_tolerance='ulfm') (or HPCCOMM_FAULT_TOLERANCE=ulfm) "
                           "under mpirun --with-ft ulfm")
    world = state.world.group
    if world is None or world.freed or not dist.is_initialized():
        raise HpccommError("hpccomm.shrink: torch.distributed is not initialised with an hpccomm default group")
    t0 = time.monotonic()
    groups = ulfm.live_groups()
    old_rank, old_size = world.rank, world.size
    peers = list(state.world.peers)
    new, survivors = _agree_on_survivors(world, groups, "shrink")
    failed = tuple(FailedRank(r, *(peers[r] if r < len(peers) else ("?", 0))) for r in range(old_size)
                   if r not in survivors)
    try:
        if _fault_injection is not None:
            _fault_injection()
        groups_map = creator.rebuild_world(new, survivors, groups, timeout)
    except BaseException as exc:  # noqa: BLE001 - a failure while rebuilding: nothing consistent is left
        failures.recovery_failed(old_rank, failed, exc, new, [(r, *peers[r]) for r in survivors])
        raise
    failures.recovered()
    return Shrunk(failed, old_rank, old_size, new.Get_rank(), new.Get_size(), groups_map, time.monotonic() - t0)


def backend_shrink(backend, ranks_to_exclude, opts=None):
    """``dist.shrink_group(ranks_to_exclude, group)`` on an hpccomm group
    (torch >= 2.14 calls the Backend's ``shrink``): agree with MPI on the
    survivors of ``backend``'s group and return the Backend over them.

    ``ranks_to_exclude`` (group ranks) must be the ranks that failed; torch
    then destroys the old group (and, for the default group, every other
    group) and makes the new one the default.  The new group gets a new
    key-value store on its rank 0."""
    g = backend._g
    if not state.failures.tolerant:
        raise HpccommError("dist.shrink_group on an hpccomm group needs fault tolerance "
                           "(HPCCOMM_FAULT_TOLERANCE=ulfm under mpirun --with-ft ulfm)")
    new, survivors = _agree_on_survivors(g, ulfm.live_groups(), "shrink_group")
    dead = [r for r in range(g.size) if r not in survivors]
    if sorted(int(r) for r in ranks_to_exclude) != dead:
        new.Free()
        raise HpccommError(f"dist.shrink_group (group '{g.name}', rank {g.rank}/{g.size}): ranks_to_exclude "
                           f"{sorted(int(r) for r in ranks_to_exclude)} are not the ranks that failed, {dead} (group "
                           "ranks, agreed by MPI_Comm_shrink). Pass the failed ranks (RankFailure.ranks, as ranks of "
                           "this group), or call hpccomm.shrink()")
    try:
        made = creator.shrunk_backend(g, new, survivors, opts)
    except BaseException as exc:  # noqa: BLE001 - as in shrink(): a failure while rebuilding
        peers = state.world.peers
        failures.recovery_failed(g.global_ranks[g.rank], tuple(FailedRank(g.global_ranks[r], *peers[g.global_ranks[r]])
                                                               for r in dead if g.global_ranks[r] < len(peers)), exc)
        raise
    failures.recovered()
    return made


def follow_mode() -> None:
    """After a group is made (hpccomm._torch.plugin): with fault tolerance on,
    ``dist.shrink_group`` (torch >= 2.14) registers the shrunk groups it makes
    from hpccomm's Backend as hpccomm's (hpccomm._compat.retype_shrunk_groups)."""
    if state.failures.tolerant and compat.py_backend():
        compat.retype_shrunk_groups(lambda backend: isinstance(backend, BackendHpccomm))


BackendHpccomm.shrinker = staticmethod(backend_shrink)  # dist.shrink_group reaches it through the Backend (torch >= 2.14)
