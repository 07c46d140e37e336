"""The public start-up calls: ``hpccomm.init_process_group`` and friends.

Registering the backend with torch is cheap and happens at ``import hpccomm``
(hpccomm._torch.plugin); MPI itself starts only when a process group is made
(hpccomm._start).
"""
from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from . import _mpi
from ._core import state
from ._start.bootstrap import DEFAULT_TIMEOUT, RankInfo, _bootstrap, started
from . import _compat as compat
from ._about import BACKEND_NAME
from .errors import HpccommError, InitError

__all__ = ["RankInfo", "from_mpi4py", "init_process_group", "local_rank", "local_size", "mpi_comm", "node_index"]


def init_process_group(backend: str = BACKEND_NAME, timeout: Optional[timedelta] = None, comm=None,
                       fault_tolerance: Optional[str] = None, **kwargs):
    """Initialise torch.distributed over MPI: one call under mpirun, mpiexec or srun.

    Rank and world size come from MPI (from ``comm``, an mpi4py communicator,
    default COMM_WORLD); the key-value store torch needs is opened by rank 0
    and its address broadcast over MPI, so no MASTER_ADDR or port is needed.
    Collective: every rank of ``comm`` must call it.

    :param backend: the torch backend name; ``"hpccomm"`` (the default).
    :param timeout: a :class:`datetime.timedelta`: how long any collective of the
        default group may take before the job is ended with a message naming the
        ranks that never arrived (see ``HPCCOMM_ON_TIMEOUT``); default 30 minutes.
    :param comm: the mpi4py communicator whose ranks form the world (default
        ``MPI.COMM_WORLD``); hpccomm works on a private duplicate of it.
    :param fault_tolerance: ``"ulfm"`` survives a lost rank (launch with
        ``mpirun --with-ft ulfm``; see :func:`hpccomm.shrink` and
        docs/fault-tolerance.md); ``"off"``; default ``HPCCOMM_FAULT_TOLERANCE``
        (off).  Every rank must ask for the same.
    :param kwargs: passed on to :func:`torch.distributed.init_process_group`.
    :raises hpccomm.InitError: torch.distributed is already initialised; the
        launch is inconsistent (a launcher started N processes but each sees an
        MPI world of 1, as with srun and the wrong ``--mpi=`` plugin); the
        key-value store cannot be opened or reached (the message names the
        address and the ``HPCCOMM_STORE_ADDR``/``HPCCOMM_STORE_PORT`` fix); or
        fault tolerance was asked for where a failure cannot be survived (not
        Open MPI with ULFM, no ``--with-ft ulfm``; the message names the fix).
    :raises hpccomm.ConfigError: an ``HPCCOMM_*`` variable has a malformed value.

    Example::

        import hpccomm, torch, torch.distributed as dist
        hpccomm.init_process_group()
        t = torch.ones(4)
        dist.all_reduce(t)          # t == world size everywhere
        dist.destroy_process_group()
    """
    if dist.is_initialized():
        raise InitError("hpccomm.init_process_group: torch.distributed is already initialised; call "
                        "dist.destroy_process_group() first")
    timeout = DEFAULT_TIMEOUT if timeout is None else timeout
    started.ft_mode = fault_tolerance
    store, info, started.world_comm = _bootstrap(comm, timeout)
    try:
        dist.init_process_group(backend=backend, store=store, rank=info.rank, world_size=info.size,
                                timeout=timeout, **kwargs)
    finally:
        if started.world_comm is not None:  # another backend, or torch failed before our creator took it
            started.world_comm.Free()
            started.world_comm = None


def from_mpi4py(comm, timeout: Optional[timedelta] = None):
    """A torch process group over the ranks of ``comm``, an mpi4py communicator.

    Called by the members of ``comm`` only, after the default group exists
    (any backend; its ranks must be MPI_COMM_WORLD's).  The group communicates
    on a private duplicate of ``comm``; its ranks follow world-rank order, as
    torch's ``new_group`` does.  Returns what ``dist.new_group`` returns.

    :param comm: an mpi4py intracommunicator whose processes are all in the
        torch world (for example from ``MPI.COMM_WORLD.Split``).
    :param timeout: a :class:`datetime.timedelta` for the group's collectives;
        default: the default group's.
    :raises hpccomm.InitError: torch.distributed is not initialised yet, or
        ``comm`` has processes outside the torch world.

    Example::

        sub = MPI.COMM_WORLD.Split(color=rank % 2, key=rank)
        pg = hpccomm.from_mpi4py(sub)
        dist.all_reduce(t, group=pg)
    """
    MPI = _mpi.mpi()
    if not dist.is_initialized():
        raise InitError("hpccomm.from_mpi4py: initialise torch.distributed first (hpccomm.init_process_group)")
    world = state.world.group.comm if state.world.group is not None and not state.world.group.freed else MPI.COMM_WORLD
    group = comm.Get_group()
    try:
        mine = MPI.Group.Translate_ranks(group, list(range(comm.Get_size())), world.Get_group())
    finally:
        group.Free()
    if any(r == MPI.UNDEFINED for r in mine):
        raise InitError("hpccomm.from_mpi4py: the communicator has processes outside the torch world")
    ordered = comm.Split(0, key=mine[comm.Get_rank()])  # group rank order = world rank order
    started.sub_comm = ordered
    try:
        kw = {} if timeout is None else {"timeout": timeout}
        with compat.members_only_naming(mine):  # torch's group counter stays as the non-members have it
            return dist.new_group(sorted(mine), backend=BACKEND_NAME, use_local_synchronization=True, **kw)
    finally:
        if started.sub_comm is not None:
            started.sub_comm.Free()
            started.sub_comm = None


def mpi_comm(group=None):
    """The mpi4py communicator an hpccomm process group's collectives run on.

    :param group: a torch process group made with backend hpccomm (default:
        the default group).
    :returns: an ``mpi4py.MPI.Intracomm`` owned by hpccomm (do not free it;
        communicate on a ``Dup()`` of it), or None once the group is destroyed.
    :raises hpccomm.HpccommError: ``group`` is not an hpccomm group, or
        torch.distributed is not initialised.

    Example::

        comm = hpccomm.mpi_comm()           # the world's communicator
        assert comm.Get_size() == dist.get_world_size()
    """
    if group is None:
        if not dist.is_initialized():
            raise HpccommError("hpccomm.mpi_comm: torch.distributed is not initialised")
        group = compat.world_group()
    g = compat.group_of(group)
    if g is None:
        raise HpccommError(f"hpccomm.mpi_comm: {group!r} is not an hpccomm process group "
                           f"(its backend is {dist.get_backend(group)!r})")
    return g.comm


def mpi_module():
    """The ``mpi4py.MPI`` module, with MPI started as hpccomm starts it
    (MPI_THREAD_MULTIPLE asked; an MPI_Init that never returns ends the
    process with a message), for code beside hpccomm that calls MPI itself:
    hpccomm's Horovod API (``hvd.init(comm=...)``), a user's own mpi4py
    calls.  hpccomm never communicates on ``COMM_WORLD`` itself (its groups
    work on duplicates), so messages there cannot match hpccomm's.

    :raises hpccomm.InitError: no MPI library that mpi4py can load here (the
        message names the fix).

    Example::

        MPI = hpccomm.mpi_module()
        isinstance(comm, MPI.Comm)          # an mpi4py communicator?
        MPI.COMM_WORLD.Barrier()
    """
    from . import _mpi

    return _mpi.mpi()


def local_rank() -> int:
    """This process's rank among the ranks on its node, 0..local_size()-1.

    Known after :func:`hpccomm.init_process_group` (or any hpccomm init); it
    follows the launcher's local numbering when it gives one, so it is the
    index to pick a GPU or a core set with.

    :raises hpccomm.InitError: hpccomm is not initialised.

    Example::

        hpccomm.init_process_group()
        device = torch.device("cuda", hpccomm.local_rank())
    """
    return _require_info().local_rank


def local_size() -> int:
    """How many ranks share this node (its shared-memory domain).

    :raises hpccomm.InitError: hpccomm is not initialised.

    Example::

        torch.set_num_threads(max(1, os.cpu_count() // hpccomm.local_size()))
    """
    return _require_info().local_size


def node_index() -> int:
    """This node's index, 0..nodes-1, in order of the lowest rank on each node.

    :raises hpccomm.InitError: hpccomm is not initialised.

    Example::

        if hpccomm.local_rank() == 0:
            print(f"node {hpccomm.node_index()} has {hpccomm.local_size()} ranks")
    """
    return _require_info().node


def _require_info() -> RankInfo:
    if started.info is None:
        raise InitError("hpccomm: not initialised; call hpccomm.init_process_group() first")
    return started.info
