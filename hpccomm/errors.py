"""Exceptions raised by hpccomm.

Every error about an op carries the op's name, its sequence number on its
group, the group, and this process's rank and size, so a message read in one
rank's log says where it came from.  All of them pickle (they may cross a
process boundary: multiprocessing, torch elastic's error files).  What each
failure raises, and when the job ends instead, is hpccomm._core.failures'
(the failure policy).

:class:`RankFailure` is a :class:`torch.distributed.DistBackendError` too: it
is made when first named (``hpccomm.RankFailure``), so that importing this
module imports nothing of torch (``import hpccomm`` runs inside
``import torch``: hpccomm._torch.plugin).
"""
from __future__ import annotations

import threading
from typing import NamedTuple


class HpccommError(RuntimeError):
    """Base class of every error hpccomm raises (a :class:`RuntimeError`).

    Raised as itself for failures during communication (an MPI error in an op,
    an async op that failed, found by ``wait()`` or its future), for a
    mismatch found by debug mode, and by :func:`hpccomm.monitored_barrier`.
    Catch it to handle any hpccomm error.

    Example::

        try:
            hpccomm.monitored_barrier(timeout=timedelta(seconds=30))
        except hpccomm.HpccommError as exc:
            print(exc)   # ... rank(s) [3] did not arrive within 0:00:30
    """


class ConfigError(HpccommError, ValueError):
    """A malformed ``HPCCOMM_*`` environment variable; ``variable`` names it.

    Also a :class:`ValueError`.  Raised when the option is read (at init or at
    the op that needs it), not at import.

    :param message: what is wrong, e.g. ``HPCCOMM_ON_TIMEOUT='stop' is not one of abort, warn``.
    :param variable: the variable's name.

    Example::

        try:
            hpccomm.config.get("HPCCOMM_STORE_PORT")     # with HPCCOMM_STORE_PORT=http
        except hpccomm.ConfigError as exc:
            print(exc.variable)                          # HPCCOMM_STORE_PORT
    """

    def __init__(self, message: str, variable: str = "") -> None:
        self.variable = variable
        super().__init__(message)

    def __reduce__(self):
        return type(self), (str(self), self.variable)


class InitError(HpccommError):
    """Initialisation failed or disagrees with the launcher.

    Raised by :func:`hpccomm.init_process_group`, by
    ``dist.init_process_group("hpccomm")`` (for example when ``RANK`` and
    ``WORLD_SIZE`` disagree with MPI's ranks), by :func:`hpccomm.from_mpi4py`
    and by the rank queries called before init.  The message says what to
    change.

    Example::

        try:
            hpccomm.local_rank()
        except hpccomm.InitError as exc:
            print(exc)   # hpccomm: not initialised; call hpccomm.init_process_group() first
    """


def _part(text: str) -> str:
    """One clause of a message: no surrounding spaces, no final period (the
    joins add their own punctuation)."""
    text = " ".join(text.split())
    return text[:-1] if text.endswith(".") and not text.endswith("..") else text


class OpError(HpccommError):
    """An op was called with arguments it cannot accept.

    Raised before any communication; the user's tensors are unchanged.  The
    message is ``hpccomm <op> (<where>): <what>. <fix>``; the parts are kept
    as attributes ``op``, ``where``, ``what`` and ``fix``.

    :param op: the op's name, e.g. ``"broadcast"``.
    :param where: op number, group and rank, e.g. ``op #3 on group '0', rank 1/4``.
    :param what: what is wrong.
    :param fix: what to do instead (may be empty).

    Example (how hpccomm raises one)::

        OpValueError("broadcast", group.where(), "src 5 is not a rank of this group of size 4",
                     "Pass a group rank in 0..size-1")
    """

    def __init__(self, op: str, where: str, what: str, fix: str = "") -> None:
        self.op = op
        self.where = where
        self.what = _part(what)
        self.fix = _part(fix)
        msg = f"hpccomm {op} ({where}): {self.what}"
        if self.fix:
            msg += f". {self.fix}"
        super().__init__(msg)

    def __reduce__(self):
        return type(self), (self.op, self.where, self.what, self.fix)


class OpValueError(OpError, ValueError):
    """Bad sizes, ranks or list lengths (an :class:`OpError` and a :class:`ValueError`).

    Example::

        out = torch.empty(3)          # all_gather_into_tensor needs world size * 4 elements
        dist.all_gather_into_tensor(out, torch.ones(4))   # raises OpValueError naming both sizes
    """


class OpTypeError(OpError, TypeError):
    """Unsupported dtype, ReduceOp, device or tensor layout (an :class:`OpError` and a :class:`TypeError`).

    Example::

        t = torch.ones(4)                               # float32
        dist.all_reduce(t, op=dist.ReduceOp.BAND)       # raises OpTypeError: no bitwise ops on floats
    """


class FailedRank(NamedTuple):
    """A rank that failed: its world rank (in the world it failed in), host and pid.

    :param rank: its rank in the world it failed in.
    :param host: the host it ran on.
    :param pid: its process id there.

    Example::

        failure.failed       # (FailedRank(rank=3, host='node2', pid=4242),)
    """

    rank: int
    host: str
    pid: int


class _RankFailure(HpccommError):
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


_made = threading.Lock()  # (one RankFailure class, whichever thread names it first)


def __getattr__(name: str):
    """``RankFailure``, made once when first named: :class:`_RankFailure`
    with torch's DistBackendError among its bases."""
    if name != "RankFailure":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    with _made:
        made = globals().get("RankFailure")
        if made is None:
            from ._compat import DistBackendError

            made = type("RankFailure", (_RankFailure, DistBackendError), {"__doc__": _RankFailure.__doc__,
                                                                         "__module__": __name__})
            globals()["RankFailure"] = made
    return made
