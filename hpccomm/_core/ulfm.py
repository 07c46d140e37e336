"""What MPI says and does about failed processes (User Level Failure Mitigation).

With fault tolerance on (``HPCCOMM_FAULT_TOLERANCE=ulfm``, Open MPI's ULFM), a
call involving a dead process fails with MPI_ERR_PROC_FAILED
(MPI_ERR_PROC_FAILED_PENDING for a receive from any source), and a call on a
revoked communicator with MPI_ERR_REVOKED: :func:`is_failure`.  MPI names the
failed processes (MPI_Comm_get_failed: :func:`failed_ranks`,
:func:`failed_in`); a survivor revokes hpccomm's communicators so that every
other survivor's op fails at once (:func:`revoke_all`); the members of a new
group meet first, so a dead member is seen before MPI_Comm_create_group
(:func:`meet`).  What each failure then does (RankFailure on every survivor)
is hpccomm._core.failures'; recovery is hpccomm.fault_tolerance's.

Threads (an exception to hpccomm._core.comm_thread's one-owner rule): whichever
thread sees a failure revokes every hpccomm communicator, including ones
another thread is blocked in: interrupting them is what MPI_Comm_revoke is for.
"""
from __future__ import annotations

import time

from .. import _mpi
from ..errors import FailedRank
from . import state

#: How long a rank that saw only a revocation waits for MPI to say who died (seconds).
NAME_WAIT = 2.0

_classes: list = []


def _failure_classes() -> tuple:
    if not _classes:
        MPI = _mpi.mpi()
        _classes.extend(getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
                        if hasattr(MPI, name))
    return tuple(_classes)


def is_failure(exc) -> bool:
    """Whether MPI error ``exc`` says a process failed (or a survivor revoked the communicator)."""
    try:
        return exc.Get_error_class() in _failure_classes()
    except Exception:  # noqa: BLE001 - not an MPI exception
        return False


def describe(failed) -> str:
    """``rank 3 (pid 4242 on node2), ...`` for :class:`~hpccomm.errors.FailedRank` s."""
    return ", ".join(f"rank {f.rank} (pid {f.pid} on {f.host})" for f in failed)


def failed_ranks(wait: float = 0.0) -> tuple:
    """The world ranks MPI reports failed on this rank (MPI_Comm_get_failed
    on the world's communicator) as :class:`~hpccomm.errors.FailedRank`;
    waits up to ``wait`` seconds while the list is empty."""
    comm = getattr(state.world.group, "comm", None)
    if comm is None:
        return ()
    ranks = failed_in(comm, wait)
    peers = state.world.peers
    return tuple(FailedRank(r, *(peers[r] if r < len(peers) else ("?", 0))) for r in ranks)


def failed_in(comm, wait: float) -> list:
    """The ranks of ``comm`` MPI reports failed (MPI_Comm_get_failed); waits
    up to ``wait`` seconds while the list is empty."""
    MPI = _mpi.mpi()
    deadline = time.monotonic() + wait
    pause = 1e-3
    while True:
        try:
            ranks = ranks_in(comm.Get_failed(), comm)
        except Exception:  # noqa: BLE001 - MPI may refuse on a freed or odd communicator
            ranks = []
        if ranks or time.monotonic() >= deadline:
            return ranks
        # MPI learns of failures while it progresses: a probe of COMM_SELF makes it progress.
        MPI.COMM_SELF.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
        time.sleep(pause)  # MPI offers no notification to wait on
        pause = min(pause * 2, 0.05)


def ranks_in(group, comm) -> list:
    """The ranks in ``comm`` of the processes of MPI group ``group`` (which it
    frees), sorted: who of ``comm`` is in ``group``."""
    MPI = _mpi.mpi()
    try:
        n = group.Get_size()
        if n == 0:
            return []
        whole = comm.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(group, list(range(n)), whole)
        finally:
            whole.Free()
        return sorted(r for r in ranks if r != MPI.UNDEFINED)
    finally:
        if group != MPI.GROUP_EMPTY:
            group.Free()


def revoke_all() -> None:
    """Revoke every hpccomm communicator of this rank (each group's
    collective, point-to-point and checks ones): every survivor's pending and later
    ops on them fail with MPI_ERR_REVOKED."""
    state.failures.revoked = True
    for g in live_groups():
        revoke(g)


def revoke(g) -> None:
    """Revoke group ``g``'s communicators (those not revoked yet)."""
    for comm in (getattr(g, "comm", None), getattr(g, "p2p", None), getattr(getattr(g, "checks", None), "comm", None)):
        if comm is None:
            continue
        try:
            if not comm.Is_revoked():
                comm.Revoke()
        except Exception:  # noqa: BLE001 - freed meanwhile, or already revoked by a peer
            pass


def live_groups() -> list:
    """hpccomm's groups of this rank whose communicators are not freed."""
    while True:
        try:
            return [g for g in list(_mpi.live) if getattr(g, "comm", None) is not None]
        except RuntimeError:  # the set changed while being copied (another thread made a group)
            continue


def meet(comm, ranks, tag: int) -> None:
    """Before MPI_Comm_create_group in fault-tolerance mode: the members of a
    new group (``ranks``, ranks of ``comm``) meet over point-to-point
    messages (each sends a byte to the first member, which answers each once
    all arrived), so that a member that died raises MPI_ERR_PROC_FAILED here.
    Open MPI 5.0.11's MPI_Comm_create_group fails at once on a death MPI
    already knows of, but never returns when a member dies while the others
    wait in it (revoking ``comm`` does not end it either).  Called by
    the members only, on the thread that creates the group.

    :raises mpi4py.MPI.Exception: a member died (MPI_ERR_PROC_FAILED) or a
        survivor revoked ``comm`` (MPI_ERR_REVOKED); the caller makes it a
        :class:`~hpccomm.errors.RankFailure` (hpccomm._core.failures.failure).
    """
    MPI = _mpi.mpi()
    me, first = comm.Get_rank(), ranks[0]
    byte = bytearray(1)  # the message's content does not matter: its arrival does
    if me == first:
        for r in ranks[1:]:
            comm.Recv([byte, MPI.BYTE], source=r, tag=tag)
        for r in ranks[1:]:
            comm.Send([byte, MPI.BYTE], dest=r, tag=tag)
    else:
        comm.Send([byte, MPI.BYTE], dest=first, tag=tag)
        comm.Recv([byte, MPI.BYTE], source=first, tag=tag)
