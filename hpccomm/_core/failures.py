"""The failure policy: what each failure does, decided here and nowhere else.

=====================================  ======================================  ======================================
failure                                this rank                               the job
=====================================  ======================================  ======================================
an MPI error in a collective           raises HpccommError, naming the likely  ends first (MPI_Abort 6: other ranks
(:func:`mpi_error`)                    cause, where the job goes on: one rank  may have returned wrong data), the
                                       in the world, or                        cause said; a dead rank with fault
                                       HPCCOMM_ABORT_ON_EXCEPTION=0            tolerance on: as below
an MPI error in a point-to-point op    raises HpccommError                     goes on
a dead rank, fault tolerance on        raises RankFailure (:func:`failure`,    goes on: every communicator is
(MPI_ERR_PROC_FAILED, _REVOKED, a      :func:`damaged`, :func:`from_pending`)  revoked, so each survivor's op raises
damaged exchange)                                                              RankFailure; hpccomm.shrink() recovers
a failure while recovering             says so (:func:`recovery_failed`)       ends: every survivor exits with
                                                                               status 5
a refusal (the op's checks)            raises it; the others learn of it: the  their watchdog ends the job on it
                                       call's comparison (every rank raises    (:func:`peer_refused`: MPI_Abort 4),
                                       at once), else a note in the group's    or says it (HPCCOMM_ON_TIMEOUT=warn)
                                       store (:func:`announce_refusal`)
a refusal only this rank sees while    says it (:func:`refused_alone`)         ends (MPI_Abort 1)
its peers may be in MPI already
a mismatch the watchdog finds          says it (:func:`mismatch`)              ends (MPI_Abort 6)
(HPCCOMM_MISMATCH_CHECK=first)
a timeout (:func:`timed_out`)          says which ranks never came             ends (MPI_Abort 3), or goes on
                                                                               (HPCCOMM_ON_TIMEOUT=warn)
a timeout at exit                      says it (:func:`timed_out_at_exit`)     ends (MPI_Abort 1)
an uncaught exception                  its traceback, hpccomm's line last      ends (MPI_Abort 1;
(:func:`uncaught_exit`)                                                        HPCCOMM_ABORT_ON_EXCEPTION=0: left to
                                                                               the launcher)
torch aborts a group                   fault tolerance on: the group's         else ends (MPI_Abort 1)
(:func:`group_aborted`)                communicators revoked and freed here
the launcher ends the job (SIGTERM)    one line naming who failed              exit status 143
                                       (hpccomm._core.signals)
=====================================  ======================================  ======================================

A rank that ends the job says why in one piece, hpccomm's line last, and
records it in the world's key-value store for the lines of the ranks the
launcher then ends (:func:`end_job`).  This rank's flight record
(hpccomm._core.flight) is written on the way: before every MPI_Abort (a
hook on hpccomm._mpi.at_abort), at the first RankFailure (:func:`_first`),
and for a timeout by the watchdog before it calls :func:`timed_out` (the
op as it stood, before the diagnosis).  MPI's side of a dead rank (who
failed, revoking) is hpccomm._core.ulfm's; the recovery is
hpccomm.fault_tolerance's, which reads and resets the failure seen here
(:func:`rank_failure`, :func:`recovered`).
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Optional

from .. import _mpi, config
from ..errors import FailedRank, HpccommError, OpError, RankFailure
from . import flight, state, ulfm

#: MPI_Abort's error code (a process's exit status under most launchers), by what ended the job.
#: (MISMATCH also ends the job on an MPI error in a collective: a mismatch is its likely cause.)
ABORTED, TIMED_OUT, PEER_REFUSED, MISMATCH = 1, 3, 4, 6
#: The exit status of every survivor when recovery itself fails (no MPI_Abort: see :func:`recovery_failed`).
UNRECOVERABLE = 5

_lock = threading.RLock()  # state.failures.first: the first failure wins, and a shrink forgets it


# ----------------------------------------------------------------------------
# MPI errors and dead ranks
# ----------------------------------------------------------------------------

def mpi_error(what: str, exc, collective: bool = True) -> HpccommError:
    """What MPI error ``exc`` in ``what`` (an op and its place, e.g.
    ``all_reduce (op #3 on group '0', rank 1/4)``) raises: a
    :class:`~hpccomm.errors.RankFailure` when a rank died and fault
    tolerance is on (:func:`failure`); for a point-to-point op, an
    :class:`HpccommError` naming it.  For a collective, the likely cause is a
    mismatch the checks could not see (a signature agreed on before), and
    the other ranks may have returned wrong data from the op, so the job
    ends here, the cause said; with ``HPCCOMM_ABORT_ON_EXCEPTION=0`` (or one
    rank in the world) the error is returned for the caller to raise."""
    found = failure(what, exc) if state.failures.tolerant else None
    if found is not None:
        return found
    if not collective:
        return HpccommError(f"hpccomm {what}: MPI failed: {exc}")
    try:
        truncated = exc.Get_error_class() == _mpi.mpi().ERR_TRUNCATE  # a receive larger than its buffer
    except Exception:  # noqa: BLE001 - not an MPI exception
        truncated = False
    text = (f"hpccomm {what}: MPI failed: {exc}. {'Likely' if truncated else 'A possible'} cause: the ranks "
            "called this collective with different sizes, dtypes, ReduceOps or roots, or called different "
            "collectives; HPCCOMM_DEBUG=DETAIL compares every call across ranks and names both sides")
    if state.world.size > 1 and config.get("HPCCOMM_ABORT_ON_EXCEPTION"):
        end_job(f"hpccomm: rank {state.world.rank}: {text[len('hpccomm '):]}. Other ranks may have returned wrong "
                "data from this op: aborting the job", f"failed in {what} (MPI: {exc})", MISMATCH)
    return HpccommError(text)


def failure(what: str, exc):
    """The :class:`~hpccomm.errors.RankFailure` for MPI error ``exc`` raised
    by ``what`` (an op and its place), or None when ``exc`` is not about a
    failed process.  Revokes every hpccomm communicator first, so that the
    other survivors' ops fail too."""
    if not ulfm.is_failure(exc):
        return None
    ulfm.revoke_all()
    failed = ulfm.failed_ranks(wait=ulfm.NAME_WAIT)
    text = exc.Get_error_string().split(":")[0].strip() if hasattr(exc, "Get_error_string") else str(exc)
    if failed:
        who = f"{ulfm.describe(failed)} failed ({text})"
    else:
        who = (f"a rank failed ({text}: another survivor revoked hpccomm's communicators; MPI has not said yet "
               "which rank died: hpccomm.shrink() agrees on it)")
    return _first(f"hpccomm {what}: {who}. The job can go on without it: call hpccomm.shrink() on every surviving "
                  "rank (docs/fault-tolerance.md)", failed)


def damaged(what: str, exc):
    """The :class:`~hpccomm.errors.RankFailure` behind ``exc``, an error that
    is not MPI's (a received message that does not unpickle) raised by
    ``what``, an exchange of Python objects, when MPI knows of a failed rank
    (waiting up to :data:`hpccomm._core.ulfm.NAME_WAIT` seconds for its
    notice); else None.  Open MPI 5.0.11 once completed an allgather of
    pickled objects on a survivor without error, a dead rank's part left as
    zero bytes (debug mode's fingerprint exchange, torch 2.15:
    ``UnpicklingError: invalid load key``).  Revokes every hpccomm
    communicator, as :func:`failure` does."""
    failed = ulfm.failed_ranks(wait=ulfm.NAME_WAIT)
    if not failed:
        return None
    ulfm.revoke_all()
    return _first(f"hpccomm {what}: {ulfm.describe(failed)} failed (the exchange returned a damaged message: "
                  f"{type(exc).__name__}: {exc}). The job can go on without it: call hpccomm.shrink() on every "
                  "surviving rank (docs/fault-tolerance.md)", failed)


def _first(message: str, failed):
    """A RankFailure of ``message``, kept as this rank's first since the last shrink if it is; the
    first one writes this rank's flight record (hpccomm._core.flight)."""
    error = RankFailure(message, failed)
    with _lock:
        first = state.failures.first is None
        if first:
            state.failures.first = error
    if first:
        flight.dump_quietly(f"a rank failed: {error}")
    return error


def from_pending(what: str, error):
    """For hpccomm._core.record: the error an op in flight completed with, as
    :class:`~hpccomm.errors.RankFailure` when the MPI error behind it says a
    process failed."""
    if isinstance(error, RankFailure):
        return error
    exc = getattr(error, "__cause__", None)
    found = failure(what, exc) if exc is not None else None
    return error if found is None else found


def rank_failure(exc: Optional[BaseException] = None):
    """The :class:`~hpccomm.errors.RankFailure` behind ``exc``, or None when no rank failed.

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


def recovered() -> None:
    """The survivors agreed on a new world (hpccomm.fault_tolerance): the
    failure seen and the revocation are forgotten."""
    with _lock:
        state.failures.first, state.failures.revoked = None, False


def recovery_failed(old_rank: int, failed, exc: BaseException, comm=None, members=()) -> None:
    """A failure during a shrink, after the survivors agreed (a second
    failure, the new store unreachable): print one line saying so (naming the
    rank that failed meanwhile when MPI says, ``members`` being ``(old rank,
    host, pid)`` of ``comm``'s ranks) and end this rank with exit status
    :data:`UNRECOVERABLE` (the world is half rebuilt; every survivor is in the
    same shrink and ends the same way).  Not MPI_Abort: after a failure under
    ``--with-ft ulfm``, Open MPI 5.0.11's launcher sometimes never returned
    once survivors had called it (2 of 16 jobs here, every rank gone; 0 of 10
    with exit), and it ends the job with the ranks' status when they have all
    exited.  ``failed``: the ranks that failed first, as
    :class:`~hpccomm.errors.FailedRank`."""
    what = ulfm.describe(failed) if failed else "no rank"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    second = ""
    if comm is not None and ulfm.is_failure(exc):
        gone = ulfm.failed_in(comm, ulfm.NAME_WAIT)
        if gone:
            second = f"{ulfm.describe(FailedRank(*members[r]) for r in gone if r < len(members))} failed meanwhile: "
    print(f"hpccomm: rank {old_rank}: hpccomm.shrink() failed while rebuilding the world after the failure of "
          f"{what}: {second}{text}. A failure during recovery (a second failure) is not recoverable: ending "
          f"the job (every survivor exits with status {UNRECOVERABLE})", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(UNRECOVERABLE)  # no MPI_Finalize either: it would wait for the dead


def group_aborted(g) -> None:
    """torch aborts group ``g`` (``dist.shrink_group`` does, to the groups it
    destroys): with fault tolerance on, its communicators are revoked and
    freed on this rank only; off, the job ends (MPI state cannot be
    recovered)."""
    if state.failures.tolerant:
        ulfm.revoke(g)
        g.free(flush=True)  # queued ops fail at once on the revoked communicators
        return
    state.record_failure(f"aborted group '{g.name}'")
    _mpi.abort(ABORTED)


# ----------------------------------------------------------------------------
# refusals, mismatches, timeouts
# ----------------------------------------------------------------------------

def announce_refusal(g, exc, peer: Optional[int] = None) -> None:
    """Record in ``g``'s store that this rank refused an op (``exc``) the
    others may wait in: its next collective, or its point-to-point op with
    group rank ``peer``.  A waiting rank's watchdog finds it within a second
    or two (:func:`peer_refused`) instead of waiting for the timeout.  Never
    raises: the refusal itself is raised either way."""
    me = g.global_ranks[g.rank]
    try:
        if peer is not None:  # the peer waits in the matching receive or send
            g.store.set(state.refusal_key(g, "p2p", from_rank=me, to_rank=g.global_ranks[peer]), str(exc))
        else:
            g.store.set(state.refusal_key(g, "collective", seq=g.seq + 1), f"rank {me}: {exc}")
    except Exception:  # noqa: BLE001 - the store's host may be gone
        pass


def peer_refused(message: str) -> None:
    """The watchdog found that another rank refused the op this rank waits in
    (``message`` says so): its MPI call cannot end, so the job ends
    (``HPCCOMM_ON_TIMEOUT=abort``, the refusing rank recorded why), or the
    line is said and the wait goes on (``warn``)."""
    if config.get("HPCCOMM_ON_TIMEOUT") == "abort":
        say_last(message + "; aborting the job (HPCCOMM_ON_TIMEOUT=abort)")
        _mpi.abort(PEER_REFUSED)
    print(message, file=sys.stderr, flush=True)


def refused_alone(group, exc: Exception) -> None:
    """A refusal only this rank can see (``exc``) while its peers in
    ``group`` may already be inside MPI (all_to_all's counts past MPI's
    limit): said, recorded for the other ranks' lines, and the job ends
    rather than leave them waiting."""
    say_last(f"{exc}; ending the job: the other ranks of group '{group.name}' may already be waiting in MPI")
    state.record_failure(f"refused {exc.op}: {exc.what}" if isinstance(exc, OpError) else str(exc))
    _mpi.abort(ABORTED)


def mismatch(line: str, what: str, handshake=None) -> None:
    """The watchdog found that the ranks called a collective differently
    (hpccomm._core.signatures.watch, ``HPCCOMM_MISMATCH_CHECK=first``): this
    rank says ``line``, runs ``handshake`` (the ranks' notes in the store,
    so that the rank in the check speaks first) and ends the job, ``what``
    recorded for the other ranks' lines."""
    print(line, file=sys.stderr, flush=True)
    if handshake is not None:
        handshake()
    state.record_failure(what)
    _mpi.abort(MISMATCH)


def timed_out(message: str, what: str) -> None:
    """An op (``what``) did not complete within its group's timeout
    (``message`` says which ranks never came): the job ends
    (``HPCCOMM_ON_TIMEOUT=abort``), or the line is said and the op keeps
    waiting (``warn``)."""
    if config.get("HPCCOMM_ON_TIMEOUT") == "abort":
        end_job(message + "; aborting the job (HPCCOMM_ON_TIMEOUT=abort)", f"timed out in {what}", TIMED_OUT)
    print(message, file=sys.stderr, flush=True)


def timed_out_at_exit(what: str) -> None:
    """A posted collective (``what``) still running past its group's timeout
    at exit (a rank never posted it?): said, and the job ends."""
    print(f"hpccomm: {what} did not complete within the group's timeout at exit (a rank never posted it?); "
          "ending the job", file=sys.stderr, flush=True)
    state.record_failure(f"timed out in {what} at exit")
    _mpi.abort(ABORTED)


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


def uncaught_exit(kind, value, tb, told: bool) -> None:
    """An exception (``kind``, ``value``, ``tb``) ends this rank's program
    while the job goes on elsewhere (hpccomm._start.creator's excepthook,
    with ``HPCCOMM_ABORT_ON_EXCEPTION`` on): the job ends at once, with what
    :func:`uncaught` says, instead of leaving the other ranks in their next
    collective until the timeout.  ``told``: its traceback was printed already."""
    where = state.last_op_text()
    rank, size = state.world.rank, state.world.size  # (as renumbered by hpccomm.shrink())
    end_job(uncaught(kind, value, tb, rank, size, where, told), f"raised an uncaught {kind.__name__} ({where})",
            ABORTED)


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
