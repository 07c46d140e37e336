"""Failure detection: a rank is lost, and every survivor learns of it.

With fault tolerance on (``HPCCOMM_FAULT_TOLERANCE=ulfm``, Open MPI's ULFM), a
call involving a dead process fails with MPI_ERR_PROC_FAILED
(MPI_ERR_PROC_FAILED_PENDING for a receive from any source).  The op path asks
:func:`failure` to turn such an MPI error into :class:`RankFailure`; with the
mode off nothing on the op path changes (the question is asked only in an
``except`` branch).  The first thread of a rank that sees a failure revokes
every hpccomm communicator of that rank (MPI_Comm_revoke, :func:`revoke_all`):
every op that any survivor is in, or calls later, on any hpccomm group then
fails at once with MPI_ERR_REVOKED, which becomes RankFailure as well.
RankFailure names the dead ranks that MPI knows of on this rank
(MPI_Comm_get_failed; a rank that learned of the failure from a revocation
waits up to ``_NAME_WAIT`` seconds for MPI's notice of who died).

Threads (an exception to hpccomm._core.comm_thread's one-owner rule): whichever
thread sees a failure revokes every hpccomm communicator, including ones
another thread is blocked in: interrupting them is what MPI_Comm_revoke is for.

Ending the job (:func:`end_job`): a rank that cannot go on (an uncaught
exception, a timeout, a refusal the others may wait behind) says why in one
piece, hpccomm's line last, records it for the other ranks' lines and calls
MPI_Abort; an uncaught error of hpccomm's own is told as :func:`uncaught`
says.

Recovery (shrinking the world, rebuilding torch's groups) is
:mod:`hpccomm.fault_tolerance`'s, above; the launch checks are start-up's
(hpccomm._start.bootstrap).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import NamedTuple, Optional

from .. import _mpi
from .._compat import DistBackendError
from ..errors import HpccommError
from . import flight, signatures, state

#: How long a rank that saw only a revocation waits for MPI to say who died.
_NAME_WAIT = 2.0


class FailedRank(NamedTuple):
    """A rank that failed: its world rank (in the world it failed in), host and pid."""

    rank: int
    host: str
    pid: int


class RankFailure(HpccommError, DistBackendError):
    """A rank of the job failed (killed, crashed, its node lost) while fault
    tolerance is on (``HPCCOMM_FAULT_TOLERANCE=ulfm``).

    Raised on every surviving rank by the op it is in, or by its next op on
    any hpccomm group: blocking or async (``work.wait()``, the Work's future,
    DDP's backward), collective or point-to-point.  A
    :class:`torch.distributed.DistBackendError` and an
    :class:`hpccomm.HpccommError`.  Recover by calling :func:`hpccomm.shrink`
    on every survivor.

    :param message: what failed where, e.g. ``hpccomm all_reduce (op #7 on
        group '0', rank 1/4): rank 3 (pid 4242 on node2) failed
        (MPI_ERR_PROC_FAILED) ...``.
    :param failed: the failed ranks MPI reported to this rank, as
        :class:`FailedRank` ``(rank, host, pid)`` with world ranks; may be
        empty when this rank learned of the failure from another survivor
        before MPI said who died (:func:`hpccomm.shrink` always says).

    ``ranks`` and ``hosts`` give the failed world ranks and their hosts.

    Example::

        try:
            loss.backward()
        except hpccomm.RankFailure as failure:
            print(failure.ranks, failure.hosts)     # (3,) ('node2',)
            hpccomm.shrink()
    """

    def __init__(self, message: str, failed=()) -> None:
        self.failed = tuple(FailedRank(*f) for f in failed)
        super().__init__(message)

    @property
    def ranks(self) -> tuple:
        return tuple(f.rank for f in self.failed)

    @property
    def hosts(self) -> tuple:
        return tuple(f.host for f in self.failed)

    def __reduce__(self):
        return type(self), (str(self), tuple(tuple(f) for f in self.failed))


_lock = threading.RLock()

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


def failure(what: str, exc) -> Optional[RankFailure]:
    """The :class:`RankFailure` for MPI error ``exc`` raised by ``what`` (an
    op and its place, e.g. ``all_reduce (op #3 on group '0', rank 1/4)``), or
    None when ``exc`` is not about a failed process.  Revokes every hpccomm
    communicator first, so that the other survivors' ops fail too."""
    if not is_failure(exc):
        return None
    revoke_all()
    failed = failed_ranks(wait=_NAME_WAIT)
    text = exc.Get_error_string().split(":")[0].strip() if hasattr(exc, "Get_error_string") else str(exc)
    if failed:
        who = f"{_describe(failed)} failed ({text})"
    else:
        who = (f"a rank failed ({text}: another survivor revoked hpccomm's communicators; MPI has not said yet "
               "which rank died: hpccomm.shrink() agrees on it)")
    error = RankFailure(f"hpccomm {what}: {who}. The job can go on without it: call hpccomm.shrink() on every "
                        "surviving rank (docs/fault-tolerance.md)", failed)
    _first(error)
    return error


def mpi_error(what: str, exc, collective: bool = True) -> HpccommError:
    """What MPI error ``exc`` in ``what`` (an op and its place) raises: a
    :class:`RankFailure` when a rank died and fault tolerance is on
    (:func:`failure`); else, for a collective, the job ends with the likely
    cause said (hpccomm._core.signatures.mpi_failed: the other ranks may have
    returned wrong data); for a point-to-point op, an
    :class:`HpccommError` naming it."""
    found = failure(what, exc) if state.failures.tolerant else None
    if found is not None:
        return found
    return signatures.mpi_failed(what, exc) if collective else HpccommError(f"hpccomm {what}: MPI failed: {exc}")


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
        :class:`RankFailure`.
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


def damaged(what: str, exc) -> Optional[RankFailure]:
    """The :class:`RankFailure` behind ``exc``, an error that is not MPI's
    (a received message that does not unpickle) raised by ``what``, an
    exchange of Python objects, when MPI knows of a failed rank (waiting up
    to ``_NAME_WAIT`` seconds for its notice); else None.  Open MPI 5.0.11
    once completed an allgather of pickled objects on a survivor without
    error, a dead rank's part left as zero bytes (debug mode's fingerprint
    exchange, torch 2.15: ``UnpicklingError: invalid load key``).  Revokes
    every hpccomm communicator, as :func:`failure` does."""
    failed = failed_ranks(wait=_NAME_WAIT)
    if not failed:
        return None
    revoke_all()
    error = RankFailure(f"hpccomm {what}: {_describe(failed)} failed (the exchange returned a damaged message: "
                        f"{type(exc).__name__}: {exc}). The job can go on without it: call hpccomm.shrink() on "
                        "every surviving rank (docs/fault-tolerance.md)", failed)
    _first(error)
    return error


def _first(error: RankFailure) -> None:
    """Keep ``error`` as the first failure since the last shrink, if it is; the first one writes
    this rank's flight record (hpccomm._core.flight)."""
    with _lock:
        first = state.failures.first is None
        if first:
            state.failures.first = error
    if first:
        flight.dump_quietly(f"a rank failed: {error}")


def rank_failure(exc: Optional[BaseException] = None) -> Optional[RankFailure]:
    """The :class:`RankFailure` behind ``exc``, or None when no rank failed.

    hpccomm raises RankFailure itself from every op it runs and from
    ``work.wait()``.  Errors that cross torch's C++ futures lose their type
    on the way (torch keeps the message only): DDP's ``loss.backward()``
    and ``work.get_future().wait()`` raise ``RuntimeError("Got the following
    error when running the callback: RankFailure: ...")``.  This gives the
    RankFailure back: ``exc`` itself if it is one, else the first failure
    this rank saw since the last :func:`hpccomm.shrink` (None if none; then
    ``exc`` has another cause).  With ``exc`` None: that failure, if any.

    :param exc: the exception caught, or None.

    Never raises.

    Example::

        try:
            loss = model(batch).sum()
            loss.backward()                  # DDP's gradient all-reduce
            optimizer.step()
        except Exception as exc:
            failure = hpccomm.rank_failure(exc)
            if failure is None:
                raise                        # not a lost rank
            hpccomm.shrink()
    """
    if isinstance(exc, RankFailure):
        return exc
    with _lock:
        return state.failures.first


def from_pending(what: str, error):
    """For hpccomm._core.record: the error an op in flight completed with, as
    :class:`RankFailure` when the MPI error behind it says a process failed."""
    if isinstance(error, RankFailure):
        return error
    exc = getattr(error, "__cause__", None)
    found = failure(what, exc) if exc is not None else None
    return error if found is None else found


def _describe(failed) -> str:
    return ", ".join(f"rank {f.rank} (pid {f.pid} on {f.host})" for f in failed)


def failed_ranks(wait: float = 0.0) -> tuple:
    """The world ranks MPI reports failed on this rank (MPI_Comm_get_failed
    on the world's communicator) as :class:`FailedRank`; waits up to
    ``wait`` seconds while the list is empty."""
    comm = getattr(state.world.group, "comm", None)
    if comm is None:
        return ()
    ranks = _failed_in(comm, wait)
    peers = state.world.peers
    return tuple(FailedRank(r, *(peers[r] if r < len(peers) else ("?", 0))) for r in ranks)


def _failed_in(comm, wait: float) -> list:
    """The ranks of ``comm`` MPI reports failed (MPI_Comm_get_failed); waits
    up to ``wait`` seconds while the list is empty."""
    MPI = _mpi.mpi()
    deadline = time.monotonic() + wait
    pause = 1e-3
    while True:
        try:
            ranks = _translate(comm.Get_failed(), comm)
        except Exception:  # noqa: BLE001 - MPI may refuse on a freed or odd communicator
            ranks = []
        if ranks or time.monotonic() >= deadline:
            return ranks
        # MPI learns of failures while it progresses: a probe of COMM_SELF makes it progress.
        MPI.COMM_SELF.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)
        time.sleep(pause)  # MPI offers no notification to wait on
        pause = min(pause * 2, 0.05)


def _translate(group, comm) -> list:
    """The ranks in ``comm`` of the processes of MPI group ``group`` (which it frees)."""
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
    with _lock:
        state.failures.revoked = True
    for g in _live_groups():
        revoke(g)


def revoke(g) -> None:
    for comm in (getattr(g, "comm", None), getattr(g, "p2p", None), getattr(getattr(g, "checks", None), "comm", None)):
        if comm is None:
            continue
        try:
            if not comm.Is_revoked():
                comm.Revoke()
        except Exception:  # noqa: BLE001 - freed meanwhile, or already revoked by a peer
            pass


def _live_groups() -> list:
    while True:
        try:
            return [g for g in list(_mpi.live) if getattr(g, "comm", None) is not None]
        except RuntimeError:  # the set changed while being copied (another thread made a group)
            continue


def abort_group(g) -> bool:
    """torch aborts a group (``dist.shrink_group`` does, to the groups it
    destroys): with fault tolerance on, revoke and free its communicators on
    this rank only, and return True; off, return False (the caller ends the
    job: MPI state cannot be recovered)."""
    if not state.failures.tolerant:
        return False
    revoke(g)
    g.free(flush=True)  # queued ops fail at once on the revoked communicators
    return True


# ----------------------------------------------------------------------------
# ending the job
# ----------------------------------------------------------------------------

def end_job(text: str, why: str, code: int) -> None:
    """End the whole job from this rank, ``text`` being the last it says.

    ``text`` (one or more lines, hpccomm's line last) goes to stderr in one
    write, so that the other ranks' output cannot come between its lines;
    ``why`` (``"timed out in ..."``) is recorded in the world's key-value
    store, for the lines of the ranks the launcher then ends
    (hpccomm._core.signals); then MPI_Abort with ``code``
    (:func:`hpccomm._mpi.abort`, which keeps the MPI library's own abort line
    from following ``text`` where it is printed by this process).
    """
    say_last(text)
    state.record_failure(why)
    _mpi.abort(code)


def say_last(text: str) -> None:
    """Write ``text`` to the process's stderr in one piece (after what Python
    buffered for stdout and stderr)."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or odd stream: write anyway
            pass
    data = (text.rstrip("\n") + "\n").encode(errors="replace")
    while data:
        data = data[os.write(2, data):]


def uncaught(kind, value, tb, rank: int, size: int, where: str, told: bool) -> str:
    """What rank ``rank`` of ``size`` says last when exception ``value`` (of
    type ``kind``, traceback ``tb``) ends its program while the job goes on
    elsewhere; ``where``: its last op (hpccomm._core.state.last_op_text);
    ``told``: whether its traceback was printed already (by Python's hook).

    An error of hpccomm's own (:class:`hpccomm.HpccommError`) names the op,
    its group and the rank itself: unless told, a line saying that the job
    ends, the traceback without hpccomm's and torch's frames (the user's own
    calls), and the error's line last.  Else the line that names the rank and
    its last op, after Python's traceback.
    """
    ending = ("aborting the job so the other ranks do not wait for it (HPCCOMM_ABORT_ON_EXCEPTION=0 turns "
              "this off)")
    if told or not issubclass(kind, HpccommError):
        return f"hpccomm: rank {rank} of {size} raised an uncaught {kind.__name__} ({where}); {ending}"
    import traceback

    frames = traceback.extract_tb(tb)
    mine = [f for f in frames if not _inside(f.filename)] or frames[-1:]
    return "".join([f"hpccomm: rank {rank} of {size} raised an uncaught {kind.__name__}; {ending}\n",
                    "Traceback (most recent call last; hpccomm's and torch's frames left out):\n",
                    *traceback.format_list(mine), *traceback.format_exception_only(kind, value)])


def _inside(filename: str) -> bool:
    """Whether ``filename`` is a file of hpccomm's or torch's."""
    if not _internal:
        import torch

        _internal.extend(os.path.join(os.path.dirname(os.path.realpath(m.__file__)), "")
                         for m in (sys.modules[__name__.split(".")[0]], torch))
    return os.path.realpath(filename).startswith(tuple(_internal))


_internal: list = []  # the folders of hpccomm and torch (with a trailing separator)
